"""No CUDA test rots unrun: without a GPU every cuda-marked test function runs (its first cuda parametrization) in the
CUDA stand-in (tests/cuda_standin.py), or is named in cuda_standin.NO_STANDIN with the reason; and the stand-in
really runs ffn_ext's ops through the emulated CUDA launch."""

from __future__ import annotations

import importlib
from pathlib import Path

import cuda_standin
import native
import pytest
import torch
import torch.nn.functional as F
from conftest import STANDIN, standin_key

import ffn_ext

TESTS = Path(__file__).resolve().parent


def _has_cuda_mark(marks) -> bool:
    for m in marks:
        if m.name == "cuda":
            return True
        if m.name == "parametrize":  # a parametrization with the mark (DEVICES' "cuda")
            values = m.args[1] if len(m.args) > 1 else m.kwargs.get("argvalues", ())
            if any(_has_cuda_mark(getattr(v, "marks", ())) for v in values):
                return True
    return False


def _cuda_functions() -> set:
    """ "file::function" of every test function with a cuda mark (its own, its module's pytestmark, or one of its
    parametrizations'): what must run in the stand-in or have a reason."""
    found = set()
    for path in sorted(TESTS.glob("test_*.py")):
        module = importlib.import_module(path.stem)
        module_marks = getattr(module, "pytestmark", [])
        module_marks = module_marks if isinstance(module_marks, list) else [module_marks]
        for name, fn in vars(module).items():
            if name.startswith("test_") and callable(fn) and getattr(fn, "__module__", None) == module.__name__:
                if _has_cuda_mark(module_marks + list(getattr(fn, "pytestmark", []))):
                    found.add(f"{path.name}::{name}")
    return found


def test_no_standin_names_cuda_test_functions():
    """Every NO_STANDIN entry is an existing cuda-marked test function with a reason (no stale entries)."""
    cuda = _cuda_functions()
    assert len(cuda) > 40, sorted(cuda)  # the scan finds them (about 60 functions)
    for key, reason in cuda_standin.NO_STANDIN.items():
        file, name = key.split("::")
        module = importlib.import_module(file[:-3])
        assert callable(getattr(module, name, None)), f"NO_STANDIN names {key}, which does not exist"
        assert key in cuda, f"NO_STANDIN names {key}, which is not cuda-marked"
        assert isinstance(reason, str) and len(reason) > 20, key


@pytest.mark.skipif(
    not cuda_standin.available(), reason="a GPU is here, no native ffn_ext library, or FFN_EXT_CUDA_STANDIN=0"
)
def test_every_collected_cuda_function_runs_in_the_standin_or_has_a_reason(request):
    """Over this session's items (all of them in a full run): each cuda-marked function has one stand-in item or a
    NO_STANDIN reason, never both."""
    by_key: dict = {}
    for item in request.session.items:
        if item.get_closest_marker("cuda") is not None:
            by_key.setdefault(standin_key(item), []).append(item.stash.get(STANDIN, False))
    for key, flags in by_key.items():
        if key in cuda_standin.NO_STANDIN:
            assert not any(flags), key
        else:
            assert flags.count(True) == 1, (key, flags)


@pytest.mark.skipif(
    not cuda_standin.available(), reason="a GPU is here, no native ffn_ext library, or FFN_EXT_CUDA_STANDIN=0"
)
def test_standin_runs_the_emulated_launch(monkeypatch):
    """Inside the stand-in "cuda" tensors are host tensors that say cuda, and every ffn_ext op (torch.ops, the
    public API, the autograd backward) runs _emulate_cuda (tests/native.py): the same bits as calling it directly."""
    emulate = native.testing()._emulate_cuda
    host_x = torch.randn(5, 37)
    with cuda_standin.standin(monkeypatch) as calls:
        x = host_x.cuda()
        assert x.is_cuda and x.device == torch.device("cuda", 0)
        assert torch.randn(3, device="cuda").is_cuda
        y = torch.ops.ffn_ext.gelu(x)
        g = x.clone().requires_grad_()
        h = ffn_ext.swiglu(g, x)
        h.sum().backward()
        torch.cuda.synchronize()
    assert calls == {"gelu": 1, "swiglu": 1, "swiglu_backward": 1}, calls
    assert not y.is_cuda  # outside: the host tensor it is
    assert torch.equal(y, emulate("gelu", [host_x], cuda_standin.SMS, [], "concat")[0])
    torch.testing.assert_close(y, F.gelu(host_x))
    torch.testing.assert_close(h, F.silu(host_x) * host_x)
    dgate, _ = emulate("swiglu_backward", [torch.ones_like(host_x), host_x, host_x], cuda_standin.SMS, [], "concat")
    assert torch.equal(g.grad, dgate)


@pytest.mark.skipif(
    not cuda_standin.available(), reason="a GPU is here, no native ffn_ext library, or FFN_EXT_CUDA_STANDIN=0"
)
def test_standin_raises_what_the_cuda_kernels_raise(monkeypatch):
    """The emulated kernels run the CUDA glue's guards: torch.ops.ffn_ext raises the kernels' RuntimeError (all the
    stable ABI carries), and the public API explains it with the Python checks, as on a GPU."""
    x, y = torch.randn(4, 6), torch.randn(4, 5)
    with cuda_standin.standin(monkeypatch) as calls:
        gate, up = x.cuda(), y.cuda()
        with pytest.raises(RuntimeError, match=r"^ffn_ext\.swiglu: `up` must have the dtype, device and shape of"):
            torch.ops.ffn_ext.swiglu(gate, up)
        with pytest.raises(ValueError, match=r"^ffn_ext\.swiglu: expected `up` to have the shape"):
            ffn_ext.swiglu(gate, up)
        with pytest.raises(RuntimeError, match=r"^ffn_ext\.swiglu_clamped: `limit` must be > 0, `alpha`"):
            torch.ops.ffn_ext.swiglu_clamped(gate, gate, limit=-1.0)
        with pytest.raises(ValueError, match=r"^ffn_ext\.swiglu_clamped: `limit` must be > 0, got -1.0"):
            ffn_ext.swiglu_clamped(gate, gate, limit=-1.0)
        with pytest.raises(RuntimeError, match=r"^ffn_ext\.swiglu_packed: `layout`"):
            torch.ops.ffn_ext.swiglu_packed(gate, layout="bogus")
    assert not calls, calls  # counted when they return: the guards raised in the emulated kernels
