"""The functional API's call paths (ffn_ext/ops.py `_call`): plain tensors take the native library's fast entry
point (csrc/python_module.cpp `fast_call`), everything the entry declines takes torch.ops, and both give the same
results, errors, autograd and dispatch-mode behaviour.

A spy replaces each fast entry point, so every test knows which path served the call; a test of the torch.ops
path also checks that the entry point was offered the call and declined it.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import ffn_ext
from ffn_ext import ops as api
from optable import DEVICES, FORWARD_OPS, N_INPUTS, RecordOps, api_call, is_packed, make_layout

pytestmark = pytest.mark.skipif(not api._fast, reason="no native library with fast entry points is loaded")

API = {name: N_INPUTS[name] for name in FORWARD_OPS}  # every forward op of the table has a fast entry point


def _args(name, device, dtype=torch.float32, requires_grad=False):
    shape = (3, 10) if is_packed(name) else (3, 5)
    return tuple(make_layout(shape, dtype, device).requires_grad_(requires_grad) for _ in range(API[name]))


def test_every_forward_op_has_a_fast_entry():
    assert sorted(api._fast) == sorted(FORWARD_OPS)


class Spy:
    """Wraps ops._fast[name]: records what each call returned (a tensor, NotImplemented) or raised."""

    def __init__(self, monkeypatch, name):
        self.results = []
        real = api._fast[name]

        def spy(*args):
            try:
                out = real(*args)
            except Exception as e:
                self.results.append(type(e))
                raise
            self.results.append("declined" if out is NotImplemented else "served")
            return out

        monkeypatch.setitem(api._fast, name, spy)


@pytest.mark.parametrize("device", DEVICES + ["meta"])
@pytest.mark.parametrize("name", API)
def test_plain_tensors_take_the_fast_entry_and_match_torch_ops(monkeypatch, name, device):
    spy = Spy(monkeypatch, name)
    for dtype in (torch.float32, torch.bfloat16):
        args = _args(name, device, dtype)
        out = api_call(name)(*args)
        want = getattr(torch.ops.ffn_ext, name)(*args)
        assert out.shape == want.shape and out.dtype == dtype and out.device == want.device
        if device != "meta":
            assert torch.equal(out, want)
    assert spy.results == ["served", "served"]


def test_keyword_arguments_take_the_fast_entry(monkeypatch):
    spy = Spy(monkeypatch, "swiglu")
    gate, up = _args("swiglu", "cpu")
    torch.testing.assert_close(ffn_ext.swiglu(up=up, gate=gate), F.silu(gate) * up)
    assert spy.results == ["served"]


@pytest.mark.parametrize("name", API)
def test_fast_entry_declines_what_torch_ops_must_serve(name):
    fast = api._fast[name]
    args = _args(name, "cpu")

    class Sub(torch.Tensor):
        pass

    assert isinstance(fast(*args), torch.Tensor)
    assert fast(*args, args[0]) is NotImplemented  # wrong number of arguments: torch.ops raises the clear error
    assert fast(*args[:-1]) is NotImplemented
    assert fast(*(a.as_subclass(Sub) for a in args)) is NotImplemented
    assert fast(*([1.0] * len(args))) is NotImplemented
    with TorchFunctionMode():
        assert fast(*args) is NotImplemented


def test_autograd_through_the_fast_entry(monkeypatch):
    spy = Spy(monkeypatch, "swiglu")
    gate, up = _args("swiglu", "cpu", torch.float64, requires_grad=True)
    out = ffn_ext.swiglu(gate, up)
    assert out.grad_fn is not None and spy.results == ["served"]
    assert torch.autograd.gradcheck(ffn_ext.swiglu, (gate, up))
    with torch.no_grad():
        assert ffn_ext.swiglu(gate, up).grad_fn is None


def test_torch_dispatch_mode_sees_the_op_through_the_fast_entry(monkeypatch):
    spy = Spy(monkeypatch, "gelu")
    (x,) = _args("gelu", "cpu")
    with RecordOps() as rec:
        out = ffn_ext.gelu(x)
    assert spy.results == ["served"]
    assert "ffn_ext.gelu.default" in rec.ops, rec.ops
    torch.testing.assert_close(out, F.gelu(x))


def test_torch_function_mode_and_subclasses_see_the_call(monkeypatch):
    class Log(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.funcs = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.funcs.append(func)
            return func(*args, **(kwargs or {}))

    class Tagged(torch.Tensor):
        seen = []

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            cls.seen.append(func)
            return super().__torch_function__(func, types, args, kwargs or {})

    spy = Spy(monkeypatch, "swiglu_packed")
    (gu,) = _args("swiglu_packed", "cpu")
    with Log() as log:
        out = ffn_ext.swiglu_packed(gu)
    assert torch.ops.ffn_ext.swiglu_packed.default in log.funcs, log.funcs
    out_sub = ffn_ext.swiglu_packed(gu.as_subclass(Tagged))
    assert torch.ops.ffn_ext.swiglu_packed.default in Tagged.seen and type(out_sub) is Tagged
    assert spy.results == ["declined", "declined"]
    torch.testing.assert_close(out, out_sub.as_subclass(torch.Tensor))


@pytest.mark.parametrize("case, exc, pattern", [
    ("dtype", TypeError, r"ffn_ext\.gelu: expected `x` to have dtype float64, float32, float16 or bfloat16, "
                         r"got torch\.int64"),
    ("shape", ValueError, r"ffn_ext\.swiglu: expected `up` to have the shape of `gate`"),
    ("sparse", TypeError, r"ffn_ext\.gelu: expected `x` to be a dense strided tensor, got layout torch\.sparse_coo"),
])
def test_errors_through_the_fast_entry(monkeypatch, case, exc, pattern):
    # The entry raises the op's own error (dtype, shape), or the dispatcher's, which _call turns into the clear one.
    name = "swiglu" if case == "shape" else "gelu"
    spy = Spy(monkeypatch, name)
    x = torch.randn(3, 4)
    call = {"dtype": lambda: ffn_ext.gelu(torch.arange(6)),
            "shape": lambda: ffn_ext.swiglu(x, torch.randn(3, 5)),
            "sparse": lambda: ffn_ext.gelu(x.to_sparse())}[case]
    with pytest.raises(exc, match=pattern):
        call()
    assert len(spy.results) == 1 and spy.results[0] in (TypeError, ValueError, NotImplementedError), spy.results


def test_compile_takes_the_torch_ops_path(monkeypatch):
    # Under torch.compile the entry point is never called: dynamo traces the torch.ops call into the graph.
    spy = Spy(monkeypatch, "silu")
    (x,) = _args("silu", "cpu")
    compiled = torch.compile(lambda t: ffn_ext.silu(t) * 2, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), F.silu(x) * 2)
    assert spy.results == []
    torch._dynamo.reset()
