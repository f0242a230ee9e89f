"""The functional API's call paths (ffn_ext/ops.py `_call`) for what the host path does not serve: torch.ops, started
below autograd when there is nothing to record (the ops' autograd kernel is Python, ffn_ext/_kernels.py, and would
cost microseconds a call to find that out), and through that kernel when a gradient is to be recorded. Both give
torch.ops' results, errors and dispatch-mode behaviour.

A spy wraps ops._below_autograd, so every test knows whether the call started below autograd.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from optable import (
    DEVICES,
    FORWARD_OPS,
    N_INPUTS,
    PACKINGS,
    PARAM_OPS,
    RecordOps,
    api_call,
    call,
    is_packed,
    make_inputs,
    make_layout,
    op_kwargs,
    spec,
)
from torch.overrides import TorchFunctionMode

import ffn_ext
from ffn_ext import ops as api

pytestmark = pytest.mark.skipif(api._native is None, reason="no native library is loaded")


@pytest.fixture(autouse=True)
def _native_paths_only(monkeypatch):
    """These tests are about the native paths: plain CPU tensors would take the host path (the ATen expression,
    ops._on_host; tests/test_host_path.py) first, so it is off here."""
    monkeypatch.setattr(api, "_on_host", lambda args: False)


API = {name: N_INPUTS[name] for name in FORWARD_OPS}


def _args(name, device, dtype=torch.float32, requires_grad=False):
    shape = (3, 10) if is_packed(name) else (3, 5)
    return tuple(make_layout(shape, dtype, device).requires_grad_(requires_grad) for _ in range(API[name]))


def _extra(name, packing="concat", params=None):
    """The scalar arguments ops.py passes op `name`'s fast entry after its tensors: op_kwargs' values (the example
    parameters, the layout) in the order of ops._KEYWORDS."""
    kw = op_kwargs(name, packing if is_packed(name) else None, params)
    assert set(kw) == set(api._KEYWORDS[name]), (name, kw, api._KEYWORDS[name])
    return tuple(kw[k] for k in api._KEYWORDS[name])


def test_every_forward_op_passes_its_keywords_in_schema_order():
    assert PARAM_OPS
    for name in FORWARD_OPS:  # its scalar arguments: the schema's keyword-only ones, in order (parameters, layout)
        schema = getattr(torch.ops.ffn_ext, name).default._schema
        assert api._KEYWORDS[name] == tuple(a.name for a in schema.arguments if a.kwarg_only), name


class Spy:
    """Wraps ops._below_autograd: counts the calls that started below autograd."""

    def __init__(self, monkeypatch):
        self.below = 0
        real = api._below_autograd

        def spy():
            self.below += 1
            return real()

        monkeypatch.setattr(api, "_below_autograd", spy)


@pytest.mark.parametrize("name", [n for n in FORWARD_OPS if spec(n).params or is_packed(n)])
def test_parameters_and_layouts_reach_the_op(monkeypatch, name):
    """A gated op with parameters, and a packed op in every layout: the call dispatches exactly the op, below
    autograd, with torch.ops' result for the same keyword arguments."""
    spy = Spy(monkeypatch)
    packings = PACKINGS if is_packed(name) else (None,)
    for packing in packings:
        args = make_inputs(name, (3, 5), torch.float32, packing=packing or "concat")
        with RecordOps() as rec:
            out = api_call(name, packing)(*args)
        assert rec.ops == [f"ffn_ext.{name}.default"], rec.ops
        assert torch.equal(out, call(name, packing)(*args))
    assert spy.below == len(packings)
    if is_packed(name) and not spec(name).params:  # the default layout, passed or not
        (gu,) = _args(name, "cpu")
        assert torch.equal(api_call(name, "concat")(gu), api_call(name)(gu))


@pytest.mark.parametrize("device", DEVICES + ["meta"])
@pytest.mark.parametrize("name", API)
def test_plain_tensors_start_below_autograd_and_match_torch_ops(monkeypatch, name, device):
    spy = Spy(monkeypatch)
    for dtype in (torch.float32, torch.bfloat16):
        args = _args(name, device, dtype)
        out = api_call(name)(*args)
        want = call(name)(*args)
        assert out.shape == want.shape and out.dtype == dtype and out.device == want.device
        if device != "meta":
            assert torch.equal(out, want)
    assert spy.below == 2


def test_keyword_arguments_reach_the_op(monkeypatch):
    spy = Spy(monkeypatch)
    gate, up = _args("swiglu", "cpu")
    torch.testing.assert_close(ffn_ext.swiglu(up=up, gate=gate), F.silu(gate) * up)
    assert spy.below == 1


def test_autograd_records_through_the_ops_autograd_kernel(monkeypatch):
    spy = Spy(monkeypatch)
    gate, up = _args("swiglu", "cpu", torch.float64, requires_grad=True)
    out = ffn_ext.swiglu(gate, up)
    assert type(out.grad_fn).__name__ == "_FunctionBackward" and spy.below == 0, out.grad_fn
    assert torch.autograd.gradcheck(ffn_ext.swiglu, (gate, up))
    with torch.no_grad():
        assert ffn_ext.swiglu(gate, up).grad_fn is None
    assert spy.below == 1


def test_torch_dispatch_mode_sees_the_op(monkeypatch):
    spy = Spy(monkeypatch)
    (x,) = _args("gelu", "cpu")
    with RecordOps() as rec:
        out = ffn_ext.gelu(x)
    assert spy.below == 1
    assert "ffn_ext.gelu.default" in rec.ops, rec.ops
    torch.testing.assert_close(out, F.gelu(x))


def test_torch_function_mode_and_subclasses_see_the_call():
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

    (gu,) = _args("swiglu_packed", "cpu")
    with Log() as log:
        out = ffn_ext.swiglu_packed(gu)
    assert torch.ops.ffn_ext.swiglu_packed.default in log.funcs, log.funcs
    out_sub = ffn_ext.swiglu_packed(gu.as_subclass(Tagged))
    assert torch.ops.ffn_ext.swiglu_packed.default in Tagged.seen and type(out_sub) is Tagged
    torch.testing.assert_close(out, out_sub.as_subclass(torch.Tensor))


@pytest.mark.parametrize(
    "case, exc, pattern",
    [
        (
            "dtype",
            TypeError,
            r"ffn_ext\.gelu: expected `x` to have dtype float64, float32, float16 or bfloat16, "
            r"got torch\.int64",
        ),
        ("shape", ValueError, r"ffn_ext\.swiglu: expected `up` to have the shape of `gate`"),
        (
            "sparse",
            TypeError,
            r"ffn_ext\.gelu: expected `x` to be a dense strided tensor, got layout torch\.sparse_coo",
        ),
        ("limit", ValueError, r"ffn_ext\.swiglu_clamped: `limit` must be > 0"),
        ("alpha", ValueError, r"ffn_ext\.swiglu_clamped_packed: `alpha` must be finite"),
        ("layout", ValueError, r'ffn_ext\.swiglu_packed: `layout` must be "concat" or "interleaved", got "bogus"'),
        ("limit-str", ValueError, r"ffn_ext\.swiglu_clamped: `limit` must be > 0, got '7'"),
        ("layout-int", ValueError, r'ffn_ext\.geglu_packed: `layout` must be "concat" or "interleaved", got "1"'),
    ],
)
def test_errors_reach_the_caller_with_their_type(case, exc, pattern):
    # The op raises its own error (dtype, shape, a parameter's or the layout's value), or the dispatcher fails (a
    # sparse tensor, a scalar of the wrong type), and _call raises the clear error.
    x = torch.randn(3, 4)
    call = {
        "dtype": lambda: ffn_ext.gelu(torch.arange(6)),
        "shape": lambda: ffn_ext.swiglu(x, torch.randn(3, 5)),
        "sparse": lambda: ffn_ext.gelu(x.to_sparse()),
        "limit": lambda: ffn_ext.swiglu_clamped(x, x, limit=0.0),
        "alpha": lambda: ffn_ext.swiglu_clamped_packed(x, limit=7.0, alpha=float("nan")),
        "layout": lambda: ffn_ext.swiglu_packed(x, layout="bogus"),
        "limit-str": lambda: ffn_ext.swiglu_clamped(x, x, limit="7"),
        "layout-int": lambda: ffn_ext.geglu_packed(x, layout=1),
    }[case]
    with pytest.raises(exc, match=pattern):
        call()


def test_compile_takes_the_torch_ops_path(monkeypatch):
    # Under torch.compile nothing starts below autograd: dynamo traces the torch.ops call into the graph.
    spy = Spy(monkeypatch)
    (x,) = _args("silu", "cpu")
    compiled = torch.compile(lambda t: ffn_ext.silu(t) * 2, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), F.silu(x) * 2)
    assert spy.below == 0
    torch._dynamo.reset()
