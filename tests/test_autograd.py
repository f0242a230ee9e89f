"""Autograd of the public API: gradcheck / gradgradcheck in float64 (double backward goes through the backward
ops' own autograd), partial requires_grad, chunk-view inputs, and fp32/bf16 gradients vs ATen autograd."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import gradcheck, gradgradcheck

import ffn_ext
from conftest import DEVICES, RecordOps, assert_close_to, make_chunk_pair, make_layout

# float64 inputs from N(0, 2^2): they cover the curved parts of gelu and silu.
SCALE = 2.0


def _leaf(shape, device, layout="contiguous", requires_grad=True):
    return make_layout(shape, torch.float64, device, layout, scale=SCALE).detach().requires_grad_(requires_grad)


def _check(fn, inputs, double=True):
    assert gradcheck(fn, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)
    if double:
        assert gradgradcheck(fn, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "padded"])
@pytest.mark.parametrize("fn", [ffn_ext.gelu, ffn_ext.silu], ids=["gelu", "silu"])
def test_unary_gradcheck_gradgradcheck(fn, layout, device):
    _check(fn, (_leaf((3, 5), device, layout),))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("needs", [(True, True), (True, False), (False, True)], ids=["both", "gate", "up"])
def test_swiglu_gradcheck_gradgradcheck(needs, device):
    gate = _leaf((4, 7), device, requires_grad=needs[0])
    up = _leaf((4, 7), device, "transposed", requires_grad=needs[1])
    _check(ffn_ext.swiglu, (gate, up))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m", [1, 5])
def test_swiglu_chunk_views_gradcheck_gradgradcheck(m, device):
    # gate, up = t.chunk(2, -1) inside the function: gradients flow back into one packed leaf through views.
    t = _leaf((3, 2 * m), device)
    _check(lambda t: ffn_ext.swiglu(*t.chunk(2, dim=-1)), (t,))
    # the same views as non-leaf inputs of the op, with a separate leaf for each half
    gate, up = make_chunk_pair((3, m), torch.float64, device, scale=SCALE)
    _check(ffn_ext.swiglu, (gate.detach().requires_grad_(), up.detach().requires_grad_()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["contiguous", "offset", "chunk_hi"])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_swiglu_packed_gradcheck_gradgradcheck(m, layout, device):
    _check(ffn_ext.swiglu_packed, (_leaf((2, 2 * m), device, layout),))


@pytest.mark.parametrize("device", DEVICES)
def test_swiglu_packed_3d_and_backward_op_partial_grads(device):
    _check(ffn_ext.swiglu_packed, (_leaf((2, 3, 6), device),))
    # The backward ops directly, with only some inputs requiring grad.
    grad, x = _leaf((3, 4), device), _leaf((3, 4), device, requires_grad=False)
    _check(torch.ops.ffn_ext.gelu_backward, (grad, x), double=False)
    _check(torch.ops.ffn_ext.silu_backward, (grad.detach(), x.detach().requires_grad_()), double=False)
    g, gate, up = _leaf((2, 5), device, requires_grad=False), _leaf((2, 5), device), _leaf((2, 5), device, requires_grad=False)
    _check(torch.ops.ffn_ext.swiglu_backward, (g, gate, up), double=False)
    gu = _leaf((2, 10), device, requires_grad=False)
    _check(torch.ops.ffn_ext.swiglu_packed_backward, (_leaf((2, 5), device), gu), double=False)


def test_gradcheck_detects_a_wrong_gradient():
    # gradcheck here is able to fail: an op with a deliberately wrong backward is rejected.
    class Wrong(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return ffn_ext.gelu(x)

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return torch.ops.ffn_ext.silu_backward(g, x)

    with pytest.raises(Exception):
        gradcheck(Wrong.apply, (_leaf((4,), "cpu"),), eps=1e-6, atol=1e-7, rtol=1e-5)


# ---------------------------------------------------------------- low precision vs ATen autograd
def _ref_grads(fn_ref, inputs, grad_out):
    """Gradients of fn_ref in float64 from the same (upcast) inputs."""
    ins = [t.detach().double().requires_grad_() for t in inputs]
    out = fn_ref(*ins)
    return torch.autograd.grad(out, ins, grad_out.double())


CASES = {
    "gelu": (ffn_ext.gelu, F.gelu, 1),
    "silu": (ffn_ext.silu, F.silu, 1),
    "swiglu": (ffn_ext.swiglu, lambda g, u: F.silu(g) * u, 2),
    "swiglu_packed": (ffn_ext.swiglu_packed, lambda gu: F.silu(gu.chunk(2, -1)[0]) * gu.chunk(2, -1)[1], 1),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_backward_low_precision_vs_aten_autograd(name, dtype, device):
    fn, fn_ref, n = CASES[name]
    shape = (5, 34) if name == "swiglu_packed" else (5, 17)
    inputs = [make_layout(shape, dtype, device).requires_grad_() for _ in range(n)]
    out = fn(*inputs)
    assert out.dtype == dtype
    grad_out = make_layout(out.shape, dtype, device)
    grads = torch.autograd.grad(out, inputs, grad_out)
    want64 = _ref_grads(fn_ref, inputs, grad_out)
    # the same dtype through ATen autograd (rounds intermediates): agrees within twice the tolerance
    ins2 = [t.detach().requires_grad_() for t in inputs]
    want_same = torch.autograd.grad(fn_ref(*ins2), ins2, grad_out)
    for g, w64, ws in zip(grads, want64, want_same):
        assert g.dtype == dtype and g.shape == w64.shape
        assert_close_to(g, w64, dtype, f"{name} grad vs fp64 autograd")
        assert_close_to(g, ws.double(), dtype, f"{name} grad vs {dtype} ATen autograd", scale=3.0)


@pytest.mark.parametrize("device", DEVICES)
def test_backward_uses_ffn_ext_backward_ops(device):
    # Backward runs the ffn_ext *_backward ops (not an ATen re-derivation); double backward is differentiable.
    x = make_layout((4, 6), torch.float32, device).requires_grad_()
    t = make_layout((4, 12), torch.float32, device).requires_grad_()
    gate, up = t.chunk(2, -1)
    loss = (ffn_ext.gelu(x) + ffn_ext.silu(x)).sum() + ffn_ext.swiglu(gate, up).sum() + \
        ffn_ext.swiglu_packed(t).sum()
    with RecordOps() as rec:
        loss.backward()
    for name in ("gelu_backward", "silu_backward", "swiglu_backward", "swiglu_packed_backward"):
        assert f"ffn_ext.{name}.default" in rec.ops, f"backward did not call ffn_ext.{name}: {rec.ops}"
    assert x.grad is not None and t.grad is not None


@pytest.mark.parametrize("device", DEVICES)
def test_double_backward_matches_aten(device):
    # Hessian-vector products (float64) vs ATen's double backward.
    for fn, fn_ref in ((ffn_ext.gelu, F.gelu), (ffn_ext.silu, F.silu),
                       (ffn_ext.swiglu_packed, lambda gu: F.silu(gu.chunk(2, -1)[0]) * gu.chunk(2, -1)[1])):
        x = make_layout((3, 8), torch.float64, device).requires_grad_()
        v = make_layout((3, 8), torch.float64, device)
        res = []
        for f in (fn, fn_ref):
            (g,) = torch.autograd.grad(f(x).sum(), x, create_graph=True)
            (h,) = torch.autograd.grad(g, x, v)
            res.append(h)
        torch.testing.assert_close(res[0], res[1], rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- the inference path of the Autograd kernels
@pytest.mark.parametrize("device", DEVICES)
def test_no_grad_path_records_no_graph_and_matches(device):
    """With nothing to record (no_grad, or inputs without requires_grad) the Autograd kernels call the op below
    autograd directly (csrc/autograd.cpp, records_grad): same values, no grad_fn; with requires_grad the graph
    is recorded as before."""
    x = torch.randn(6, 10, device=device, dtype=torch.float64) * 3
    gate, up = x.chunk(2, -1)
    calls = [(ffn_ext.gelu, (x,)), (ffn_ext.silu, (x,)), (ffn_ext.swiglu, (gate, up)), (ffn_ext.swiglu_packed, (x,)),
             (torch.ops.ffn_ext.gelu_backward, (up, gate)), (torch.ops.ffn_ext.swiglu_backward, (up, gate, up))]
    for fn, args in calls:
        want = fn(*[a.detach().requires_grad_(True) for a in args])  # same layouts (views stay views)
        with torch.no_grad():
            got_no_grad = fn(*[a.detach().requires_grad_(True) for a in args])
        got_plain = fn(*args)
        for want_t, a, b in zip(want if isinstance(want, tuple) else (want,),
                                got_no_grad if isinstance(got_no_grad, tuple) else (got_no_grad,),
                                got_plain if isinstance(got_plain, tuple) else (got_plain,)):
            assert want_t.grad_fn is not None and a.grad_fn is None and b.grad_fn is None, fn
            assert not a.requires_grad and not b.requires_grad
            torch.testing.assert_close(a, want_t.detach(), rtol=0, atol=0)
            torch.testing.assert_close(b, want_t.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("no_grad", [False, True], ids=["grad", "no_grad"])
def test_forward_mode_ad_raises_instead_of_dropping_the_tangent(no_grad):
    """The dispatcher ops have no forward-mode formula; a dual input must raise (from Function::apply), also under
    no_grad where the kernels otherwise skip autograd, never return a primal without its tangent. (The functional
    API routes dual tensors to ATen's ops instead: tests/test_transforms.py.)"""
    import torch.autograd.forward_ad as fwAD

    x = torch.randn(3, 4, dtype=torch.float64)
    for op in (torch.ops.ffn_ext.gelu, torch.ops.ffn_ext.silu, torch.ops.ffn_ext.swiglu_packed):
        with fwAD.dual_level():
            dual = fwAD.make_dual(x, torch.randn_like(x))
            with torch.no_grad() if no_grad else torch.enable_grad():
                with pytest.raises(RuntimeError, match="jvp is not implemented"):
                    op(dual)
