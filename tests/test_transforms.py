"""torch.func transforms and forward-mode AD through the functional API.

Each differentiable op has, besides its Autograd kernel's Function, one in the form torch.func takes (setup_context,
jvp, a generated vmap rule; ffn_ext/_kernels.py FUNC_FUNCTIONS). The functional API (every forward op of the table:
ffn_ext.gelu/silu/swiglu/geglu/gated/swiglu_clamped/..., the packed ones in both layouts, and the modules built on
them) applies it under a transform, so grad, jacrev, jvp, jacfwd, hessian and vmap reach the op. Results are
compared with the same transform applied to the ATen reference, on fresh float64 inputs.
"""

from __future__ import annotations

import functools
import warnings

import optable
import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from conftest import RecordOps
from optable import PACKINGS, api_call, params_of

import ffn_ext
from ffn_ext.table import ACTIVATIONS, BY_NAME, GATED, split_packed

torch_func = pytest.importorskip("torch.func")


def _ref_packed(gate_up, act=BY_NAME["silu"]):
    gate, up = gate_up.chunk(2, -1)
    return act.aten(gate) * up


def _table_ops():
    """(name, ffn_ext function, ATen reference, number of inputs, last dim of the inputs) for every forward op of
    the table, through the public API: gelu, gelu(approximate="tanh"), silu, swiglu, geglu(approximate=...),
    gated(..., activation) and the packed forms."""
    ops = []
    for act in ACTIVATIONS:
        fn, kw = act.api
        public = getattr(ffn_ext, fn)
        ops.append((act.name, functools.partial(public, **kw) if kw else public, act.aten, 1, 5))
        gated = {"silu": ffn_ext.swiglu, "gelu": functools.partial(ffn_ext.geglu, **kw)}.get(fn)
        packed = {"silu": ffn_ext.swiglu_packed, "gelu": functools.partial(ffn_ext.geglu_packed, **kw)}.get(fn)
        ops.append(
            (
                act.gated,
                gated or functools.partial(ffn_ext.gated, activation=act.name),
                lambda g, u, a=act: a.aten(g) * u,
                2,
                5,
            )
        )
        ops.append(
            (
                act.gated + "_packed",
                packed or functools.partial(ffn_ext.gated_packed, activation=act.name),
                functools.partial(_ref_packed, act=act),
                1,
                6,
            )
        )
    # the gated ops with parameters (example values), and every packed op in the interleaved layout
    for g in GATED:
        p = params_of(g.name)
        if g.params:
            ops.append((g.name, api_call(g.name), lambda a, b, g=g, p=p: g.forward(a, b, **p), 2, 5))
        for packing in PACKINGS:
            if packing != "concat" or g.params:
                ops.append(
                    (
                        f"{g.name}_packed-{packing}",
                        api_call(g.name + "_packed", packing),
                        lambda t, g=g, p=p, k=packing: g.forward(*split_packed(t, k), **p),
                        1,
                        6,
                    )
                )
    return ops


OPS = _table_ops()
IDS = [o[0] for o in OPS]


def _inputs(n, last, batch=()):
    return [torch.randn(*batch, 3, last, dtype=torch.float64) * 2 for _ in range(n)]  # some beyond a clamp's limit


def _close(got, want):
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name,fn,ref,n,last", OPS, ids=IDS)
def test_grad_jacrev_jvp_match_aten(name, fn, ref, n, last):
    xs = _inputs(n, last)
    argnums = tuple(range(n))
    _close(
        torch_func.grad(lambda *a: fn(*a).pow(2).sum(), argnums)(*xs),
        torch_func.grad(lambda *a: ref(*a).pow(2).sum(), argnums)(*xs),
    )
    _close(torch_func.jacrev(fn, argnums)(*xs), torch_func.jacrev(ref, argnums)(*xs))
    tangents = tuple(torch.randn_like(x) for x in xs)
    _close(torch_func.jvp(fn, tuple(xs), tangents), torch_func.jvp(ref, tuple(xs), tangents))


@pytest.mark.parametrize("name,fn,ref,n,last", OPS, ids=IDS)
def test_vmap_and_per_sample_grads_match_aten_without_the_fallback_warning(name, fn, ref, n, last):
    xs = _inputs(n, last, batch=(4,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the slow per-example fallback warns ("performance drop")
        _close(torch_func.vmap(fn)(*xs), ref(*xs))
        per_sample = torch_func.vmap(torch_func.grad(lambda *a: fn(*a).sum()))(*xs)
    _close(per_sample, torch_func.vmap(torch_func.grad(lambda *a: ref(*a).sum()))(*xs))


def test_hessian_of_gelu():
    x = torch.randn(4, dtype=torch.float64)
    _close(torch_func.hessian(lambda t: ffn_ext.gelu(t).sum())(x), torch_func.hessian(lambda t: F.gelu(t).sum())(x))


@pytest.mark.parametrize("name,fn,ref,n,last", OPS, ids=IDS)
@pytest.mark.parametrize("no_grad", [False, True], ids=["grad", "no_grad"])
def test_forward_mode_dual_tensors_get_their_tangent(name, fn, ref, n, last, no_grad):
    xs = _inputs(n, last)
    ts = [torch.randn_like(x) for x in xs]
    with fwAD.dual_level(), torch.no_grad() if no_grad else torch.enable_grad():
        got = fwAD.unpack_dual(fn(*[fwAD.make_dual(x, t) for x, t in zip(xs, ts)]))
        want = fwAD.unpack_dual(ref(*[fwAD.make_dual(x, t) for x, t in zip(xs, ts)]))
    assert got.tangent is not None
    _close(got.primal, want.primal)
    _close(got.tangent, want.tangent)


def test_module_under_vmap_and_grad():
    """The activation modules are built on the functional API, so they follow it."""
    x = torch.randn(4, 3, 6, dtype=torch.float64)
    _close(torch_func.vmap(ffn_ext.SwiGLU())(x), _ref_packed(x))
    tanh = BY_NAME["gelu_tanh"]
    _close(torch_func.vmap(ffn_ext.GeGLU(approximate="tanh"))(x), _ref_packed(x, tanh))
    _close(torch_func.grad(lambda t: ffn_ext.GELU()(t).sum())(x), torch_func.grad(lambda t: F.gelu(t).sum())(x))
    _close(
        torch_func.grad(lambda t: ffn_ext.GELU(approximate="tanh")(t).sum())(x),
        torch_func.grad(lambda t: tanh.aten(t).sum())(x),
    )
    clamped = ffn_ext.SwiGLU(limit=2.0, alpha=1.702, up_offset=1.0, layout="interleaved")
    g, u = x[..., ::2], x[..., 1::2]
    _close(
        torch_func.vmap(clamped)(x),
        (u.clamp(-2.0, 2.0) + 1.0) * g.clamp(max=2.0) * torch.sigmoid(g.clamp(max=2.0) * 1.702),
    )


def _in_dual_level(fn):
    with fwAD.dual_level():
        return fn()


def test_every_transform_reaches_the_op():
    """A plain call, a dual level, vmap (the ops' batching rule: one call for the batch), grad, jvp and grad of vmap
    run ffn_ext's ops, not ATen's: the forward op, then (grad) its backward op."""
    x = torch.randn(3, 5, dtype=torch.float64)
    fwd, bwd = ["ffn_ext.gelu.default"], ["ffn_ext.gelu.default", "ffn_ext.gelu_backward.default"]
    calls = [
        (lambda: ffn_ext.gelu(x), fwd),
        (lambda: _in_dual_level(lambda: ffn_ext.gelu(x)), fwd),
        (lambda: torch_func.vmap(ffn_ext.gelu)(x), fwd),
        (lambda: torch_func.vmap(torch_func.vmap(ffn_ext.swiglu))(x, x), ["ffn_ext.swiglu.default"]),
        (lambda: torch_func.grad(lambda t: ffn_ext.gelu(t).sum())(x), bwd),
        (lambda: torch_func.jvp(ffn_ext.gelu, (x,), (x,)), fwd),
        (lambda: torch_func.grad(lambda t: torch_func.vmap(ffn_ext.gelu)(t).sum())(x), bwd),
    ]
    for k, (fn, want) in enumerate(calls):
        with RecordOps() as rec:
            fn()
        assert [o for o in rec.ops if o.startswith("ffn_ext")] == want, (k, rec.ops)


@pytest.mark.parametrize("name", optable.FORWARD_OPS)
def test_torch_ops_under_a_gradient_transform_reach_atens_autograd_or_say_to_call_the_api(name):
    """torch.ops.ffn_ext.<op> itself under torch.func.grad: on the CPU an op whose autograd there is ATen's
    (aten_autograd) gives the functional API's gradient; any other raises a clear error (never a result without its
    gradient): torch runs a Python autograd formula under torch.func only from Python, and the functional API is
    what applies the op's Function there."""
    args = optable.make_inputs(name, (3, 4), torch.float64)

    def loss(fn):
        return lambda *a: fn(*a).square().sum()

    grad = torch_func.grad(loss(optable.call(name)), argnums=tuple(range(len(args))))
    if optable.spec(name).aten_autograd:
        want = torch_func.grad(loss(optable.api_call(name)), argnums=tuple(range(len(args))))(*args)
        for g, w in zip(grad(*args), want):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    else:
        with pytest.raises(RuntimeError, match="call the functional API"):
            grad(*args)


# every op of the table (backward ops too), each packed op in both layouts
_OP_CASES = [(n, p) for n in optable.OPS for p in (optable.PACKINGS if optable.is_packed(n) else (None,))]


@pytest.mark.parametrize("unbatched_last", [False, True], ids=["all_batched", "last_unbatched"])
@pytest.mark.parametrize("name,packing", _OP_CASES, ids=[f"{n}-{p}" if p else n for n, p in _OP_CASES])
def test_vmap_of_every_dispatcher_op_is_one_call(name, packing, unbatched_last):
    """vmap(torch.ops.ffn_ext.<op>) runs the op's batching rule: no per-sample fallback (which warns), one call of
    the op for the whole batch, and the per-sample results. The first input is batched at its last physical dim
    (a packed op's pair dim must stay last), the others at dim 0; optionally the last input is unbatched."""
    fn, n, b = optable.call(name, packing), optable.N_INPUTS[name], 4
    samples = [optable.make_inputs(name, (3, 6), torch.float64, packing=packing or "concat") for _ in range(b)]
    if unbatched_last:
        if n == 1:
            pytest.skip("one input")
        samples = [s[:-1] + samples[0][-1:] for s in samples]
    batched = [torch.stack([s[k] for s in samples], -1 if k == 0 else 0) for k in range(n)]
    in_dims = [batched[0].dim() - 1] + [0] * (n - 1)
    if unbatched_last:
        batched[-1], in_dims[-1] = samples[0][-1], None
    with warnings.catch_warnings(), RecordOps() as rec:
        warnings.simplefilter("error")  # the per-sample fallback warns ("performance drop")
        got = torch_func.vmap(fn, in_dims=tuple(in_dims))(*batched)
    assert [o for o in rec.ops if o.startswith("ffn_ext")] == [f"ffn_ext.{name}.default"], rec.ops
    want = [optable.as_tuple(fn(*s)) for s in samples]
    for k, g in enumerate(optable.as_tuple(got)):
        _close(g, torch.stack([w[k] for w in want]))


@pytest.mark.parametrize("act", ACTIVATIONS, ids=[a.name for a in ACTIVATIONS])
@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
def test_gated_ffn_under_torch_func_and_forward_ad(packed, act):
    """The gated FFNs' lean autograd.Function supports neither; under them it runs the plain ops (F.linear and the
    functional gated op), with the results of the eager MLP (Llama's with SiLU, Gemma's with the tanh GELU)."""
    torch.manual_seed(0)
    mlp = ffn_ext.GatedFFN(6, 10, activation=act.name).double()
    if packed:
        w_gu = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        fn = lambda x: ffn_ext.gated_mlp_packed(x, w_gu, mlp.down_proj.weight, activation=act.name)  # noqa: E731
    else:
        fn = mlp
    ref = lambda x: mlp.down_proj(act.aten(mlp.gate_proj(x)) * mlp.up_proj(x))  # noqa: E731
    x = torch.randn(4, 3, 6, dtype=torch.float64)
    _close(
        torch_func.vmap(torch_func.grad(lambda t: fn(t).sum()))(x),
        torch_func.vmap(torch_func.grad(lambda t: ref(t).sum()))(x),
    )
    params = dict(mlp.named_parameters())
    grads = torch_func.grad(lambda p: torch_func.functional_call(mlp, p, (x,)).pow(2).sum())(params)
    want = torch_func.grad(lambda p: ref_call(mlp, p, x, act).pow(2).sum())(params)
    for k in params:
        _close(grads[k], want[k])
    t = torch.randn_like(x)
    with fwAD.dual_level():
        got = fwAD.unpack_dual(fn(fwAD.make_dual(x, t)))
        exp = fwAD.unpack_dual(ref(fwAD.make_dual(x, t)))
    _close(got.tangent, exp.tangent)


def ref_call(mlp, params, x, act):
    g = F.linear(x, params["gate_proj.weight"])
    u = F.linear(x, params["up_proj.weight"])
    return F.linear(act.aten(g) * u, params["down_proj.weight"])


# ---------------------------------------------------------------- the quantizing ops under vmap
QUANT_RECIPES = [
    ffn_ext.QuantRecipe(scaling="row"),
    ffn_ext.QuantRecipe(scaling="group", group_size=32, scale_layout="column"),
    ffn_ext.QuantRecipe(scaling="tensor"),  # dynamic: each sample's own amax
    ffn_ext.QuantRecipe(torch.float8_e5m2, scaling="tensor", static_scale=0.25),
]


def _bits(t):
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


@pytest.mark.parametrize("recipe", QUANT_RECIPES, ids=lambda r: f"{r.scaling}-{r.static_scale}-{r.scale_layout}")
@pytest.mark.parametrize("op", ["quantize", "swiglu_quant", "gated_packed_quant"])
def test_quant_ops_under_vmap_quantize_each_sample_as_if_alone(op, recipe):
    """vmap of a quantizing op (batch dim 1, unbatched up for the gated op) is the op on each sample, bit for bit,
    through the ops' batching rule: torch's per-sample fallback would warn ("performance drop")."""
    torch.manual_seed(0)
    x = torch.randn(3, 4, 64) * torch.tensor([1.0, 30.0, 0.01, 5.0])[:, None]  # samples (dim 1) of other amaxes
    up = torch.randn(3, 64)
    fns = {
        "quantize": (lambda t: ffn_ext.quantize(t, recipe), (x,), (1,)),
        "swiglu_quant": (lambda g, u: ffn_ext.swiglu_quant(g, u, recipe), (x, up), (1, None)),
        "gated_packed_quant": (lambda gu: ffn_ext.gated_packed_quant(gu, recipe, "gelu_tanh"), (x,), (1,)),
    }
    fn, args, in_dims = fns[op]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        q, s = torch_func.vmap(fn, in_dims=in_dims)(*args)
    for i in range(x.shape[1]):
        qi, si = fn(*(a.select(d, i) if d is not None else a for a, d in zip(args, in_dims)))
        assert torch.equal(_bits(q[i]), _bits(qi)), (op, i)
        assert torch.equal(s[i] if s.dim() else s, si), (op, i)
