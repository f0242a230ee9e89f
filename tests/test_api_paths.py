"""The one route of every public call (ffn_ext/_kernels.py `route`): the dispatcher op, which routes devices,
autograd, modes and subclasses; its one fast path for plain tensors in eager mode (`eager`: on the CPU the op's
kernel directly; elsewhere the op's Function where something records, else the op below its Python autograd
kernel); the op's Function under torch.func. Every path gives
torch.ops' results and the Python checks' errors.

A spy counts the calls that took the fast path (the CPU kernel called directly, or the dispatcher below autograd).
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
    spec,
)
from torch.overrides import TorchFunctionMode

import ffn_ext
from ffn_ext import _kernels


def _args(name, device, dtype=torch.float32, requires_grad=False):
    shape = (3, 10) if is_packed(name) else (3, 5)
    return tuple(make_layout(shape, dtype, device).requires_grad_(requires_grad) for _ in range(N_INPUTS[name]))


def test_every_op_takes_its_keywords_in_schema_order_and_the_tables_schema():
    assert PARAM_OPS
    for name, s in ffn_ext.table.OPS.items():  # the scalar arguments: the keyword-only ones, in schema order
        schema = getattr(torch.ops.ffn_ext, name).default._schema
        assert _kernels.OP[name].keywords == tuple(a.name for a in schema.arguments if a.kwarg_only), name
        assert schema == torch._C.parse_schema("ffn_ext::" + s.schema), name  # what define() registers without _C


class Spy:
    """Counts the calls that took the fast path: a CPU kernel called directly, or the dispatcher below autograd."""

    def __init__(self, monkeypatch):
        self.fast = 0
        real_below = _kernels._below_autograd

        def below():
            self.fast += 1
            return real_below()

        monkeypatch.setattr(_kernels, "_below_autograd", below)
        for op in _kernels.OP.values():

            def counted(*a, _k=op.cpu, **kw):
                self.fast += 1
                return _k(*a, **kw)

            monkeypatch.setattr(op, "fast", tuple(counted if k is op.cpu else k for k in op.fast))


@pytest.mark.parametrize("name", [n for n in FORWARD_OPS if spec(n).params or is_packed(n)])
def test_parameters_and_layouts_reach_the_op(monkeypatch, name):
    """A gated op with parameters, and a packed op in every layout: the fast path with torch.ops' result for the
    same keyword arguments; under a dispatch mode, exactly the op."""
    spy = Spy(monkeypatch)
    packings = PACKINGS if is_packed(name) else (None,)
    for packing in packings:
        args = make_inputs(name, (3, 5), torch.float32, packing=packing or "concat")
        out = api_call(name, packing)(*args)
        with RecordOps() as rec:
            again = api_call(name, packing)(*args)
        assert rec.ops == [f"ffn_ext.{name}.default"], rec.ops
        assert torch.equal(again, out)
        assert torch.equal(out, call(name, packing)(*args))
    assert spy.fast == len(packings)  # (the calls under the mode take the dispatcher)
    if is_packed(name) and not spec(name).params:  # the default layout, passed or not
        (gu,) = _args(name, "cpu")
        assert torch.equal(api_call(name, "concat")(gu), api_call(name)(gu))


@pytest.mark.parametrize("device", DEVICES + ["meta"])
@pytest.mark.parametrize("name", FORWARD_OPS)
def test_plain_tensors_take_the_fast_path_and_match_torch_ops(monkeypatch, name, device):
    spy = Spy(monkeypatch)
    for dtype in (torch.float32, torch.bfloat16):
        args = _args(name, device, dtype)
        out = api_call(name)(*args)
        want = call(name)(*args)
        assert out.shape == want.shape and out.dtype == dtype and out.device == want.device
        if device != "meta":
            assert torch.equal(out, want)
    standin = device == "cuda" and not torch.cuda.is_available()  # its dispatch mode: the dispatcher decides
    assert spy.fast == (0 if standin else 2)


@pytest.mark.parametrize("name", FORWARD_OPS)
def test_recording_on_the_cpu_is_atens_autograd_or_the_ops_function(monkeypatch, name):
    """Where something records, a CPU op whose table entry says so (aten_autograd) runs its CPU kernel under ATen's
    autograd, by the public call and by torch.ops alike; every other op records its Function. Either way the fast
    path serves the call where the tensors are plain, and the gradients are the backward op's."""
    spy = Spy(monkeypatch)
    args = _args(name, "cpu", torch.float64, requires_grad=True)
    out = api_call(name)(*args)
    assert spy.fast == 1  # the CPU kernel, directly or in the Function's forward
    node = type(out.grad_fn).__name__
    assert node == type(call(name)(*args).grad_fn).__name__
    assert (node == f"ffn_ext_{name}Backward") != spec(name).aten_autograd, node
    with torch.no_grad():
        assert api_call(name)(*args).grad_fn is None
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, args, grad)
    want = call(name + "_backward")(grad, *(a.detach() for a in args))
    for g, w in zip(got, want if isinstance(want, tuple) else (want,)):
        assert torch.equal(g, w), name
    assert torch.autograd.gradcheck(api_call(name), args)


def test_recording_elsewhere_goes_through_the_ops_function(monkeypatch):
    """On other devices (meta here) a recorded call applies the op's Function, directly from the fast path."""
    spy = Spy(monkeypatch)
    gate, up = _args("swiglu", "meta", requires_grad=True)
    out = ffn_ext.swiglu(up=up, gate=gate)
    assert type(out.grad_fn).__name__ == "ffn_ext_swigluBackward", out.grad_fn
    assert spy.fast == 1  # the Function's forward: the op below autograd
    out.sum().backward()  # the backward op, called by the Function: nothing records there, so the fast path
    assert spy.fast == 2 and gate.grad.shape == gate.shape


def test_torch_dispatch_mode_sees_the_op():
    (x,) = _args("gelu", "cpu")
    with RecordOps() as rec:
        out = ffn_ext.gelu(x)
    assert rec.ops == ["ffn_ext.gelu.default"], rec.ops
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
        ("odd", ValueError, r"ffn_ext\.swiglu_packed: expected the last dimension of `gate_up` to be even"),
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
@pytest.mark.parametrize("grad", [False, True], ids=["quiet", "recording"])
def test_errors_reach_the_caller_with_their_type(case, exc, pattern, grad):
    # The op's kernel raises its check's error (dtype, shape, a parameter's or the layout's value), or the
    # dispatcher fails (a sparse tensor, a scalar of the wrong type) and the API's explanation names the cause;
    # alike on the fast path and through the Function.
    x = torch.randn(3, 4, requires_grad=grad)
    call = {
        "dtype": lambda: ffn_ext.gelu(torch.arange(6)),
        "shape": lambda: ffn_ext.swiglu(x, torch.randn(3, 5)),  # would broadcast in ATen's expression
        "odd": lambda: ffn_ext.swiglu_packed(x[:, :3]),
        "sparse": lambda: ffn_ext.gelu(x.detach().to_sparse()),
        "limit": lambda: ffn_ext.swiglu_clamped(x, x, limit=0.0),
        "alpha": lambda: ffn_ext.swiglu_clamped_packed(x, limit=7.0, alpha=float("nan")),
        "layout": lambda: ffn_ext.swiglu_packed(x, layout="bogus"),
        "limit-str": lambda: ffn_ext.swiglu_clamped(x, x, limit="7"),
        "layout-int": lambda: ffn_ext.geglu_packed(x, layout=1),
    }[case]
    with pytest.raises(exc, match=pattern):
        call()


def test_mixed_dtypes_are_promoted_first():
    """As ATen's silu(gate) * up promotes: then computed once, in the common dtype."""
    gate, up = make_inputs("swiglu", (3, 6), torch.float32)
    mixed = ffn_ext.swiglu(gate, up.bfloat16())
    assert mixed.dtype == torch.float32 and torch.equal(mixed, spec("swiglu").act.aten(gate) * up.bfloat16().float())


def test_compile_takes_the_dispatcher_op(monkeypatch):
    # Under torch.compile nothing takes the fast path: dynamo traces the torch.ops call into the graph.
    spy = Spy(monkeypatch)
    (x,) = _args("silu", "cpu")
    compiled = torch.compile(lambda t: ffn_ext.silu(t) * 2, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), F.silu(x) * 2)
    assert spy.fast == 0
    torch._dynamo.reset()
