"""Autograd of the public API: gradcheck / gradgradcheck in float64 (double backward goes through the backward
ops' own autograd), partial requires_grad, chunk-view inputs, and fp32/bf16 gradients vs ATen autograd, for every
activation and gated op of the table (tests/optable.py): the unary ops (ffn_ext.gelu(x, approximate=...),
ffn_ext.silu), the gated ops (ffn_ext.gated(gate, up, activation=...), ffn_ext.swiglu_clamped(..., limit=, ...)
with the table's example parameters) and their packed ops (ffn_ext.gated_packed, swiglu_clamped_packed) in both
layouts (concat, interleaved). ATen's autograd of the table's ATen expression (for swiglu_clamped: GPT-OSS's,
torch.clamp's gradient at the bounds included) is the reference."""

from __future__ import annotations

import pytest
import torch
from optable import (
    ACTIVATIONS,
    BACKWARD_OPS,
    DEVICES,
    FORWARD_OPS,
    GATED,
    GATED_IDS,
    N_INPUTS,
    NO_AUTOGRAD_OPS,
    PACKINGS,
    RecordOps,
    api_call,
    as_tuple,
    assert_close_to,
    aten_result,
    call,
    input_shapes,
    is_packed,
    make_chunk_pair,
    make_inputs,
    make_layout,
    op_kwargs,
    params_of,
    spec,
    tolerance,
)
from torch.autograd import gradcheck, gradgradcheck
from torch.autograd.gradcheck import GradcheckError

import ffn_ext
from ffn_ext.table import split_packed

# float64 inputs from N(0, 2^2): they cover the curved parts of the activations.
SCALE = 2.0
ACT_IDS = [a.name for a in ACTIVATIONS]
per_activation = pytest.mark.parametrize("act", ACTIVATIONS, ids=ACT_IDS)
per_gated = pytest.mark.parametrize("g", GATED, ids=GATED_IDS)  # every gated op, with or without parameters
per_packing = pytest.mark.parametrize("packing", PACKINGS)


def unary(act):
    return api_call(act.name)


def gated(g):
    return api_call(g.name)


def packed(g, packing="concat"):
    return api_call(g.name + "_packed", packing)


def _packings(name):
    return PACKINGS if is_packed(name) else (None,)


def aten_fn(name, packing=None):
    """Forward op `name` written with ATen ops (the table's act.aten; a gated op's Gated.forward with the example
    parameters, on gate_up's halves in `packing` for a packed op), differentiable by ATen's autograd."""
    s = spec(name)
    if s.kind == "unary":
        return s.act.aten
    p = params_of(name)
    if s.kind == "gated":
        return lambda g, u: s.gated.forward(g, u, **p)
    return lambda gu: s.gated.forward(*split_packed(gu, packing or "concat"), **p)


def _leaf(shape, device, layout="contiguous", requires_grad=True):
    return make_layout(shape, torch.float64, device, layout, scale=SCALE).detach().requires_grad_(requires_grad)


def _check(fn, inputs, double=True):
    assert gradcheck(fn, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)
    if double:
        assert gradgradcheck(fn, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "padded"])
@per_activation
def test_unary_gradcheck_gradgradcheck(act, layout, device):
    _check(unary(act), (_leaf((3, 5), device, layout),))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("needs", [(True, True), (True, False), (False, True)], ids=["both", "gate", "up"])
@per_gated
def test_gated_gradcheck_gradgradcheck(g, needs, device):
    gate = _leaf((4, 7), device, requires_grad=needs[0])
    up = _leaf((4, 7), device, "transposed", requires_grad=needs[1])
    _check(gated(g), (gate, up))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m", [1, 5])
@per_gated
def test_gated_chunk_views_gradcheck_gradgradcheck(g, m, device):
    # gate, up = t.chunk(2, -1) inside the function: gradients flow back into one packed leaf through views.
    t = _leaf((3, 2 * m), device)
    _check(lambda t: gated(g)(*t.chunk(2, dim=-1)), (t,))
    # the same views as non-leaf inputs of the op, with a separate leaf for each half
    gate, up = make_chunk_pair((3, m), torch.float64, device, scale=SCALE)
    _check(gated(g), (gate.detach().requires_grad_(), up.detach().requires_grad_()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["contiguous", "offset", "chunk_hi"])
@pytest.mark.parametrize("m", [1, 3, 8])
@per_packing
@per_gated
def test_packed_gradcheck_gradgradcheck(g, packing, m, layout, device):
    _check(packed(g, packing), (_leaf((2, 2 * m), device, layout),))


@pytest.mark.parametrize("device", DEVICES)
@per_packing
@per_gated
def test_packed_3d(g, packing, device):
    _check(packed(g, packing), (_leaf((2, 3, 6), device),))


@pytest.mark.parametrize("device", DEVICES)
@per_packing
@per_gated
def test_packed_interleaved_views_gradcheck(g, packing, device):
    # gate, up = gate_up[..., ::2], [..., 1::2] (interleaved) or chunk (concat) views through the gated op: the same
    # gradients as the packed op's, which writes (dgate, dup) back in that layout.
    t = _leaf((3, 10), device)
    _check(lambda t: gated(g)(*split_packed(t, packing)), (t,), double=False)
    out = packed(g, packing)(t)
    want = gated(g)(*split_packed(t, packing))
    w = torch.randn_like(want)
    (got_grad,) = torch.autograd.grad(out, t, w)
    (want_grad,) = torch.autograd.grad(want, t, w)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", [n for n in BACKWARD_OPS if n not in NO_AUTOGRAD_OPS])
def test_backward_op_partial_grads(name, device):
    # The backward ops directly (first-order gradcheck), first with only the first input requiring grad, then
    # with only the last.
    shapes = input_shapes(name, (2, 5))
    for packing in _packings(name):
        for needs in (0, N_INPUTS[name] - 1):
            ins = tuple(_leaf(s, device, requires_grad=(k == needs)) for k, s in enumerate(shapes))
            _check(call(name, packing), ins, double=False)


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

    with pytest.raises(GradcheckError):
        gradcheck(Wrong.apply, (_leaf((4,), "cpu"),), eps=1e-6, atol=1e-7, rtol=1e-5)


# ---------------------------------------------------------------- low precision vs ATen autograd
def _ref_grads(fn_ref, inputs, grad_out, dtype=torch.float64):
    """Gradients of fn_ref in `dtype` (default float64) from the same (upcast) inputs."""
    ins = [t.detach().to(dtype).requires_grad_() for t in inputs]
    out = fn_ref(*ins)
    return torch.autograd.grad(out, ins, grad_out.to(dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", FORWARD_OPS)
def test_backward_low_precision_vs_aten_autograd(name, dtype, device):
    for packing in _packings(name):
        _low_precision_vs_aten_autograd(name, dtype, device, packing)


def _low_precision_vs_aten_autograd(name, dtype, device, packing):
    # (inputs at a clamp's bounds: make_inputs; ATen's autograd gives torch.clamp's gradient there)
    fn, fn_ref = api_call(name, packing), aten_fn(name, packing)
    inputs = [t.requires_grad_() for t in make_inputs(name, (5, 17), dtype, device, packing=packing or "concat")]
    out = fn(*inputs)
    assert out.dtype == dtype
    grad_out = make_layout(out.shape, dtype, device)
    grads = torch.autograd.grad(out, inputs, grad_out)
    want64 = _ref_grads(fn_ref, inputs, grad_out)
    want32 = _ref_grads(fn_ref, inputs, grad_out, torch.float32)  # ATen's formulas in float, the same values
    # the same dtype through ATen autograd (rounds intermediates): agrees within twice the tolerance
    ins2 = [t.detach().requires_grad_() for t in inputs]
    want_same = torch.autograd.grad(fn_ref(*ins2), ins2, grad_out)
    # on the CPU the backward op is the table's ATen composite in the dtype (several ATen ops for a gated op with
    # parameters, swiglu_clamped: each rounds to the dtype, as GPT-OSS's expression does in eager): accepted
    # element by element, as in optable.assert_matches_reference
    composite = None
    if device == "cpu":
        bwd = name + "_backward"
        composite = [
            w.double()
            for w in as_tuple(aten_result(bwd, grad_out, *[t.detach() for t in inputs], packing=packing or "concat"))
        ]
        if is_packed(name):
            composite = [composite[0]]
    for k, (g, w64, w32, ws) in enumerate(zip(grads, want64, want32, want_same)):
        assert g.dtype == dtype and g.shape == w64.shape
        # ATen's formulas' own error in float (the 1 - tanh^2 its tanh GELU backward cancels, the exact GELU's
        # 1 + erf for negative x, times |grad up|) is allowed on top: the CPU kernels are ATen's composites
        spread = (w32.double() - w64).abs() / tolerance(dtype)["rtol"]
        # (on the CPU, ATen's autograd of the expression in the dtype, ws, is accepted too)
        alt = None if composite is None else [composite[k], ws.double()]
        assert_close_to(g, w64, dtype, f"{name} {packing} grad vs fp64 autograd", spread=spread, alt=alt)
        assert_close_to(
            g, ws.double(), dtype, f"{name} {packing} grad vs {dtype} ATen autograd", scale=3.0, spread=spread, alt=alt
        )


@pytest.mark.parametrize("device", DEVICES)
@per_gated
def test_backward_uses_ffn_ext_backward_ops(g, device):
    # Backward runs the ffn_ext *_backward ops (not an ATen re-derivation), the packed one in its layout.
    act = g.act
    x = make_layout((4, 6), torch.float32, device).requires_grad_()
    t = make_layout((4, 12), torch.float32, device).requires_grad_()
    gate, up = t.chunk(2, -1)
    with RecordOps() as rec:  # (the forward too: on plain CPU tensors outside a mode the API is ATen's expression)
        loss = unary(act)(x).sum() + gated(g)(gate, up).sum() + sum(packed(g, p)(t).sum() for p in PACKINGS)
        loss.backward()
    for name in (act.name + "_backward", g.name + "_backward", g.name + "_packed_backward"):
        assert f"ffn_ext.{name}.default" in rec.ops, f"backward did not call ffn_ext.{name}: {rec.ops}"
    assert rec.ops.count(f"ffn_ext.{g.name}_packed_backward.default") == len(PACKINGS), rec.ops
    assert x.grad is not None and t.grad is not None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", FORWARD_OPS)
def test_double_backward_matches_aten(name, device):
    # Hessian-vector products (float64) vs ATen's double backward, with respect to every input (inputs at a
    # clamp's bounds included: make_inputs).
    for packing in _packings(name):
        fn, fn_ref = api_call(name, packing), aten_fn(name, packing)
        xs = make_inputs(name, (3, 8), torch.float64, device, packing=packing or "concat")
        xs = [t.requires_grad_() for t in xs]
        vs = [make_layout(t.shape, torch.float64, device) for t in xs]
        res = []
        for f in (fn, fn_ref):
            gs = torch.autograd.grad(f(*xs).square().sum(), xs, create_graph=True)
            res.append(torch.autograd.grad(gs, xs, vs))
        for h, h_ref in zip(*res):
            torch.testing.assert_close(h, h_ref, rtol=1e-10, atol=1e-12, msg=lambda m: f"{packing}: {m}")


# ---------------------------------------------------------------- the inference path of the Autograd kernels
@pytest.mark.parametrize("device", DEVICES)
def test_no_grad_path_records_no_graph_and_matches(device):
    """With nothing to record (no_grad, or inputs without requires_grad) the ops record nothing (the public API
    starts them below autograd; through torch.ops the ops' Autograd kernel, ffn_ext/_kernels.py, finds nothing to
    record and calls below itself): same values, no grad_fn; with requires_grad the graph is recorded as before."""
    # forward ops through the public API, backward ops through torch.ops; chunk views as inputs
    calls = [
        (
            api_call(n, p) if not spec(n).backward else call(n, p),
            make_inputs(n, (6, 5), torch.float64, device, "chunk", packing=p or "concat"),
        )
        for n in FORWARD_OPS + BACKWARD_OPS
        if n not in NO_AUTOGRAD_OPS
        for p in _packings(n)
    ]
    for fn, args in calls:
        want = fn(*[a.detach().requires_grad_(True) for a in args])  # same layouts (views stay views)
        with torch.no_grad():
            got_no_grad = fn(*[a.detach().requires_grad_(True) for a in args])
        got_plain = fn(*args)
        for want_t, a, b in zip(
            want if isinstance(want, tuple) else (want,),
            got_no_grad if isinstance(got_no_grad, tuple) else (got_no_grad,),
            got_plain if isinstance(got_plain, tuple) else (got_plain,),
        ):
            assert want_t.grad_fn is not None and a.grad_fn is None and b.grad_fn is None, fn
            assert not a.requires_grad and not b.requires_grad
            torch.testing.assert_close(a, want_t.detach(), rtol=0, atol=0)
            torch.testing.assert_close(b, want_t.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("no_grad", [False, True], ids=["grad", "no_grad"])
def test_dispatcher_ops_carry_a_forward_mode_tangent(no_grad):
    """torch.ops.ffn_ext.<op> with a dual input (every differentiable op, forward and backward) returns the tangent
    of its ATen form's (torch.func.jvp of the form: for a backward op, of its forward form's vjp), also under
    no_grad, where nothing else records: never a primal without its tangent."""
    import torch.autograd.forward_ad as fwAD

    for name in [n for n in FORWARD_OPS + BACKWARD_OPS if n not in NO_AUTOGRAD_OPS]:
        args = list(make_inputs(name, (3, 4), torch.float64))
        ts = [torch.randn_like(a) for a in args]
        kw = op_kwargs(name)
        s = spec(name)
        params = {k: v for k, v in kw.items() if k != "layout"}
        layout = kw.get("layout", "concat") if s.kind == "packed" else None
        form = spec(s.forward_name) if s.backward else s
        fwd = lambda *p, f=form, kw=params, lay=layout: f.compute(p, kw, lay)  # noqa: E731
        ref = (lambda g, *p, fwd=fwd: torch.func.vjp(fwd, *p)[1](g)) if s.backward else fwd
        want = as_tuple(torch.func.jvp(ref, tuple(args), tuple(ts))[1])
        with fwAD.dual_level(), torch.no_grad() if no_grad else torch.enable_grad():
            outs = as_tuple(call(name)(*[fwAD.make_dual(a, t) for a, t in zip(args, ts)]))
            got = [fwAD.unpack_dual(o).tangent for o in outs]
        for g, w in zip(got, want):
            assert g is not None, name
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", NO_AUTOGRAD_OPS)
def test_ops_without_autograd_raise_where_a_gradient_would_be_recorded(name):
    """The ops the table marks differentiable=False (<act>_backward_recompute and <gated>_backward_recompute, which
    serve the lean MLPs' backward) raise a clear error where autograd would record them (an input requiring grad
    under grad mode, a dual tensor), and compute without a graph under no_grad."""
    import torch.autograd.forward_ad as fwAD

    *ins, x = make_inputs(name, (3, 4), torch.float64)
    with pytest.raises(RuntimeError, match=f"ffn_ext::{name} has no autograd formula"):
        call(name)(*ins, x.requires_grad_(True))
    with torch.no_grad():
        outs = call(name)(*ins, x)
    assert len(outs) == spec(name).n_outputs and all(o.grad_fn is None for o in outs)
    with fwAD.dual_level(), pytest.raises(RuntimeError, match="has no autograd formula"):
        call(name)(*ins, fwAD.make_dual(x.detach(), torch.randn_like(x)))
