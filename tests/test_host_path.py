"""The functional API's host path (ffn_ext/ops.py `_on_host`, `_host_form`): on plain CPU tensors every public
function computes its table entry's ATen expression under ATen's autograd (ffn_ext's CPU kernels are ATen composites
written into preallocated outputs, slower than ATen's functional ops), with the native op's errors, and the native
op wherever something observes or transforms the call (torch function and dispatch modes, torch.compile)."""

from __future__ import annotations

import pytest
import torch
from optable import FORWARD_OPS, PACKINGS, RecordOps, api_call, call, is_packed, make_inputs, spec
from torch.overrides import TorchFunctionMode

import ffn_ext
from ffn_ext import ops as api
from ffn_ext.table import split_packed

pytestmark = pytest.mark.skipif(api._native is None, reason="needs the native library (the path it replaces)")


def _aten(name, packing, args):
    """The table's ATen expression of forward op `name` (its activation's, its gated op's forward)."""
    s, kw = spec(name), spec(name).example
    if s.kind == "unary":
        return s.act.aten(*args)
    if s.kind == "gated":
        return s.gated.forward(*args, **kw)
    return s.gated.forward(*split_packed(args[0], packing or "concat"), **kw)


def _cases(host=True):
    for name in FORWARD_OPS:
        if (name in api._HOST) == host:
            for packing in PACKINGS if is_packed(name) else (None,):
                yield name, packing


def test_host_path_serves_the_ops_without_parameters():
    """act(x) and act(gate) * up, packed or not: every forward op but those of a gated op with an ATen form of its
    own (swiglu_clamped, which stays native: see ops.py)."""
    assert set(api._HOST) == {n for n in FORWARD_OPS if spec(n).gated is None or spec(n).gated.aten is None}
    assert all(not spec(n).params for n in api._HOST)


@pytest.mark.parametrize("name, packing", list(_cases(host=False)))
def test_other_ops_stay_native_on_cpu(name, packing):
    args = make_inputs(name, (5, 33), torch.float32, packing=packing or "concat")
    with RecordOps() as rec:
        api_call(name, packing)(*args)
    leaves = [a.detach().requires_grad_() for a in args]
    out = api_call(name, packing)(*leaves)
    assert f"ffn_ext.{name}.default" in rec.ops, rec.ops
    assert type(out.grad_fn).__name__ == "_FunctionBackward", out.grad_fn  # the op's autograd (ffn_ext/_kernels.py)
    assert torch.equal(out, call(name, packing)(*args))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name, packing", list(_cases()))
def test_cpu_calls_are_the_aten_expression(name, packing, dtype):
    """Value, gradients and graph: bit for bit ATen's expression under ATen's autograd (the grad_fn is ATen's, not
    the ffn_ext op's), and within rounding of the native op."""
    args = make_inputs(name, (5, 33), dtype, packing=packing or "concat")
    leaves = [a.detach().requires_grad_() for a in args]
    ref_leaves = [a.detach().requires_grad_() for a in args]
    with RecordOps() as rec:  # a dispatch mode: the native op (what the recorder sees)
        native = api_call(name, packing)(*args)
    assert f"ffn_ext.{name}.default" in rec.ops, rec.ops
    out, want = api_call(name, packing)(*leaves), _aten(name, packing, ref_leaves)
    assert torch.equal(out, want) and out.stride() == want.stride()
    assert type(out.grad_fn) is type(want.grad_fn) and "ffn_ext" not in type(out.grad_fn).__name__
    grad = torch.randn_like(out)
    for g, w in zip(torch.autograd.grad(out, leaves, grad), torch.autograd.grad(want, ref_leaves, grad)):
        assert torch.equal(g, w)
    torch.testing.assert_close(out, native, rtol=0, atol=0) if dtype == torch.float64 else torch.testing.assert_close(
        out, native
    )


def test_modes_and_compile_see_the_ffn_ext_op():
    gate, up = make_inputs("swiglu", (4, 8), torch.float32)

    class Log(TorchFunctionMode):
        funcs = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.funcs.append(func)
            return func(*args, **(kwargs or {}))

    with Log():
        ffn_ext.swiglu(gate, up)
    assert torch.ops.ffn_ext.swiglu.default in Log.funcs
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm

    torch._dynamo.reset()
    compiled = torch.compile(lambda g, u: ffn_ext.swiglu(g, u), backend=backend, fullgraph=True)
    torch.testing.assert_close(compiled(gate, up), call("swiglu")(gate, up))
    assert any("ffn_ext.swiglu" in g for g in graphs), graphs
    torch._dynamo.reset()


def test_promotion_and_the_native_errors():
    """Mixed dtypes are promoted first (then computed once, in the common dtype); inputs the native op rejects get
    its errors, not ATen's (nor a broadcast)."""
    gate, up = make_inputs("swiglu", (3, 6), torch.float32)
    mixed = ffn_ext.swiglu(gate, up.bfloat16())  # promoted to float32 first, as ATen's silu(gate) * up promotes
    assert mixed.dtype == torch.float32 and torch.equal(mixed, spec("swiglu").act.aten(gate) * up.bfloat16().float())
    with pytest.raises(ValueError, match=r"ffn_ext\.swiglu: expected `up` to have the shape of `gate`"):
        ffn_ext.swiglu(gate, up[:, :1])  # would broadcast in ATen's expression
    with pytest.raises(
        ValueError,
        match=r"ffn_ext\.swiglu_packed: expected the last dimension of `gate_up` to be "
        r"even",
    ):
        ffn_ext.swiglu_packed(gate[:, :5])
    with pytest.raises(ValueError, match=r'`layout` must be "concat" or "interleaved", got "bogus"'):
        ffn_ext.swiglu_packed(gate, layout="bogus")
    with pytest.raises(TypeError, match=r"ffn_ext\.gelu: expected `x` to have dtype"):
        ffn_ext.gelu(torch.arange(4))
