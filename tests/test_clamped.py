"""What is specific to the clamped SwiGLU (ffn_ext.swiglu_clamped, swiglu_clamped_packed, SwiGLU(limit=...)): it is
transformers' GPT-OSS / DeepSeek-V4 gating, written out here as those models write it,

    gate = gate.clamp(max=limit); up = up.clamp(-limit, limit)
    (up + up_offset) * gate * torch.sigmoid(gate * alpha)

forward and gradients (torch autograd of that expression), in float64 and float32 (and the bf16 values those models
run, 7.0 exactly among them), at the bounds themselves and beyond, with NaN and infinities; limit=inf clamps
nothing; the module in both layouts; torch's convention for clamp's gradient at the bound (which changed in torch 2.14)
is the one ffn_ext.table.CLAMP_GRAD_AT_BOUND states and the kernels follow; and on a GPU (marked cuda) the device
kernels against the host math (_host_math of the tests' host-code extension, tests/native.py: the kernels' element math
on the CPU) and the fp64 reference, separate and packed in both layouts. The table-driven tests (test_ops,
test_autograd, ...) cover the op with the table's example parameters; here the parameters are GPT-OSS's and
DeepSeek-V4's.
"""

from __future__ import annotations

import math

import native
import pytest
import torch
from optable import (
    FLOAT_DTYPES,
    RecordOps,
    assert_close_to,
    assert_matches_reference,
    call,
    error_scale,
    host_params,
    reference,
)

import ffn_ext
from ffn_ext.table import CLAMP_GRAD_AT_BOUND, clamp_pass, join_packed, split_packed

GPT_OSS = dict(limit=7.0, alpha=1.702, up_offset=1.0)  # GptOssExperts: swiglu_limit 7, alpha 1.702, up + 1
DEEPSEEK_V4 = dict(limit=10.0, alpha=1.0, up_offset=0.0)  # DeepseekV4Experts / MLP: config.swiglu_limit, alpha 1
ODD = dict(limit=0.75, alpha=-0.5, up_offset=-2.0)  # nothing relies on alpha > 0 or up_offset >= 0
PARAMS = {"gpt_oss": GPT_OSS, "deepseek_v4": DEEPSEEK_V4, "odd": ODD}
CPU_TOL = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=2e-6, atol=1e-5)}


def hf_gate(gate, up, limit, alpha=1.0, up_offset=0.0):
    """transformers' expression (GptOssExperts._apply_gate / DeepseekV4's), as the models write it."""
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return (up + up_offset) * gate * torch.sigmoid(gate * alpha)


def hf_apply_gate(gate_up, limit, alpha=1.0, up_offset=0.0):
    """GPT-OSS's experts on the interleaved projection: gate, up = gate_up[..., ::2], gate_up[..., 1::2]."""
    return hf_gate(gate_up[..., ::2], gate_up[..., 1::2], limit, alpha, up_offset)


def bound_values(limit, dtype):
    """+-limit, their neighbours in the dtype (just inside, just outside), beyond, inside, and ordinary values."""
    lim = torch.tensor([limit, -limit], dtype=dtype)
    vals = torch.cat(
        [
            lim,
            torch.nextafter(lim, 2 * lim),
            torch.nextafter(lim, torch.zeros_like(lim)),
            2 * lim,
            torch.tensor([0.0, 0.5, -1.28, 3.0, -3.0, 30.0, -30.0, 100.0, -100.0], dtype=dtype),
        ]
    )
    return vals


def grid(limit, dtype, specials=False):
    """gate, up: every pairing of bound_values (and NaN, +-inf with specials), flattened."""
    vals = bound_values(limit, dtype)
    if specials:
        vals = torch.cat([vals, torch.tensor([math.nan, math.inf, -math.inf], dtype=dtype)])
    g, u = torch.meshgrid(vals, vals, indexing="ij")
    return g.reshape(-1).clone(), u.reshape(-1).clone()


def _grads(fn, inputs, grad):
    ins = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*ins)
    return (out.detach(),) + torch.autograd.grad(out, ins, grad)


def _assert_same(got, want, dtype, what):
    """got vs want in one dtype: NaN where want is NaN, the same infinities, finite values within CPU_TOL, zeros
    where want is exactly 0 (a clamp's gradient)."""
    torch.testing.assert_close(got, want, equal_nan=True, **CPU_TOL[dtype], msg=lambda m: f"{what}: {m}")
    zero = want == 0
    assert (got[zero] == 0).all(), f"{what}: nonzero where transformers' expression gives exactly 0"


# ---------------------------------------------------------------- equals transformers' expression (CPU)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("pname", PARAMS)
def test_equals_transformers_expression_at_and_beyond_the_bounds(pname, dtype):
    p = PARAMS[pname]
    gate, up = grid(p["limit"], dtype, specials=True)
    grad = torch.randn(gate.shape, dtype=dtype)
    want = _grads(lambda g, u: hf_gate(g, u, **p), (gate, up), grad)
    got = _grads(lambda g, u: ffn_ext.swiglu_clamped(g, u, **p), (gate, up), grad)
    for what, a, b in zip(("forward", "dgate", "dup"), got, want):
        _assert_same(a, b, dtype, f"{pname} {what}")
    # the backward op itself gives the same (dgate, dup)
    dgate, dup = call("swiglu_clamped_backward", params=p)(grad, gate, up)
    _assert_same(dgate, want[1], dtype, f"{pname} swiglu_clamped_backward dgate")
    _assert_same(dup, want[2], dtype, f"{pname} swiglu_clamped_backward dup")


@pytest.mark.parametrize("layout", ["concat", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("pname", PARAMS)
def test_packed_equals_transformers_expression(pname, dtype, layout):
    """swiglu_clamped_packed on [..., 2M] in either layout; interleaved is GptOssExperts._apply_gate's input."""
    p = PARAMS[pname]
    gate, up = grid(p["limit"], dtype, specials=True)
    gate_up = join_packed(gate.view(-1, 25), up.view(-1, 25), layout)  # rows of M = 25: odd
    grad = torch.randn(gate_up.shape[:-1] + (25,), dtype=dtype)
    ref = (
        (lambda gu: hf_apply_gate(gu, **p)) if layout == "interleaved" else (lambda gu: hf_gate(*gu.chunk(2, -1), **p))
    )
    want = _grads(ref, (gate_up,), grad)
    got = _grads(lambda gu: ffn_ext.swiglu_clamped_packed(gu, layout=layout, **p), (gate_up,), grad)
    for what, a, b in zip(("forward", "dgate_up"), got, want):
        _assert_same(a, b, dtype, f"{pname} {layout} {what}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_types_at_the_bounds(dtype):
    """In bf16/fp16, where GPT-OSS runs and 7.0 is exact: the gradients are 0 where torch's clamp autograd (in the
    same dtype) stops them, at and beyond the bounds, and every value is within the dtype's tolerance of the fp64
    reference."""
    p = GPT_OSS
    gate, up = grid(p["limit"], dtype)
    grad = torch.randn(gate.shape, dtype=torch.float32).to(dtype)
    got = _grads(lambda g, u: ffn_ext.swiglu_clamped(g, u, **p), (gate, up), grad)
    stops = [
        (torch.autograd.grad(t.clamp(**kw).sum(), t)[0] == 0)
        for t, kw in (
            (gate.clone().requires_grad_(), dict(max=p["limit"])),
            (up.clone().requires_grad_(), dict(min=-p["limit"], max=p["limit"])),
        )
    ]
    assert all(s.any() and not s.all() for s in stops)
    for k, (a, stop) in enumerate(zip(got[1:], stops)):
        assert (a[stop] == 0).all(), f"gradient {k}: nonzero where torch's clamp autograd stops it"
    assert_matches_reference("swiglu_clamped", (gate, up), got[0], params=p)
    assert_matches_reference("swiglu_clamped_backward", (grad, gate, up), got[1:], params=p)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("pname", PARAMS)
def test_kernel_math_equals_transformers_expression(pname, dtype):
    """The CUDA kernels' element math (run on the host) against transformers' expression in float64, for finite
    inputs: within the dtype's tolerance, and exactly 0 where the expression's gradient is 0."""
    p = PARAMS[pname]
    gate, up = grid(p["limit"], dtype)
    grad = torch.randn(gate.shape, dtype=torch.float32).to(dtype)
    want = _grads(lambda g, u: hf_gate(g, u, **p), (gate.double(), up.double()), grad.double())
    (h,) = native.testing()._host_math("swiglu_clamped", [gate, up], host_params("swiglu_clamped", p))
    dgate, dup = native.testing()._host_math(
        "swiglu_clamped_backward", [grad, gate, up], host_params("swiglu_clamped", p)
    )
    spreads = error_scale("swiglu_clamped", gate, up, params=p) + error_scale(
        "swiglu_clamped_backward", grad, gate, up, params=p
    )
    for what, a, b, s in zip(("forward", "dgate", "dup"), (h, dgate, dup), want, spreads):
        assert_close_to(a, b, dtype, f"{pname} host math {what}", spread=s)
        assert (a[b == 0] == 0).all(), f"{pname} host math {what}: nonzero where the expression's gradient is 0"


# ---------------------------------------------------------------- the gradient at the bound: torch's convention
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_clamp_grad_at_bound_is_torchs(dtype):
    """ffn_ext.table.CLAMP_GRAD_AT_BOUND (which the tests and the ATen forms use; the CUDA kernels ask the running
    torch's version, csrc/shapes.cpp for_dtype) says what the running torch's clamp autograd does at the bound
    itself: a torch that changes it fails here first."""
    x = torch.tensor([-2.0, 2.0, 1.0, -3.0, 3.0], dtype=dtype, requires_grad=True)
    (g_both,) = torch.autograd.grad(x.clamp(-2.0, 2.0).sum(), x)
    (g_max,) = torch.autograd.grad(x.clamp(max=2.0).sum(), x)
    (g_min,) = torch.autograd.grad(x.clamp(min=-2.0).sum(), x)
    at_bound = float(CLAMP_GRAD_AT_BOUND)
    assert g_both.tolist() == [at_bound, at_bound, 1.0, 0.0, 0.0], g_both
    assert g_max.tolist() == [1.0, at_bound, 1.0, 1.0, 0.0], g_max
    assert g_min.tolist() == [at_bound, 1.0, 1.0, 0.0, 1.0], g_min
    # and table.clamp_pass, the reference's masks, is that autograd's
    gate, up = x.detach(), x.detach()
    pass_g, pass_u = clamp_pass(gate, up, 2.0)
    assert torch.equal(pass_g, g_max != 0) and torch.equal(pass_u, g_both != 0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_ops_follow_the_convention_at_the_bound(dtype):
    """At gate == limit and up == +-limit exactly, the ops' gradients (the CPU kernels, autograd through the public
    API, and the CUDA kernels' element math) pass or stop as torch's clamp autograd does."""
    limit = 7.0
    gate = torch.tensor([limit, limit, 1.0, 1.0, limit + 1], dtype=dtype)
    up = torch.tensor([2.0, limit, -limit, limit, -limit - 1], dtype=dtype)
    grad = torch.ones_like(gate)
    want = _grads(lambda g, u: hf_gate(g, u, limit, 1.702, 1.0), (gate, up), grad)
    p = dict(limit=limit, alpha=1.702, up_offset=1.0)
    results = {
        "op": call("swiglu_clamped_backward", params=p)(grad, gate, up),
        "autograd": _grads(lambda g, u: ffn_ext.swiglu_clamped(g, u, **p), (gate, up), grad)[1:],
    }
    results["host math"] = native.testing()._host_math(
        "swiglu_clamped_backward", [grad, gate, up], host_params("swiglu_clamped", p)
    )
    passes = (CLAMP_GRAD_AT_BOUND,) * 2
    expect_dgate = [passes[0], passes[0], True, True, False]
    expect_dup = [True, passes[1], passes[1], passes[1], False]
    for what, (dgate, dup) in results.items():
        assert ((dgate != 0).tolist(), (dup != 0).tolist()) == (expect_dgate, expect_dup), (what, dgate, dup)
        assert torch.equal(dgate == 0, want[1] == 0) and torch.equal(dup == 0, want[2] == 0), what


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_kernel_math_limit_the_dtype_does_not_hold(dtype):
    """A limit the dtype cannot hold (2.3): the kernels' gradients stop where torch's clamp autograd stops them, for
    inputs at the limit rounded to the dtype and at its neighbours."""
    limit = 2.3
    v = torch.tensor(limit, dtype=dtype)
    near = torch.stack([v, torch.nextafter(v, torch.zeros_like(v)), torch.nextafter(v, 2 * v)])
    vals = torch.cat([near, -near, torch.tensor([1.0], dtype=dtype)])
    g, u = (t.reshape(-1) for t in torch.meshgrid(vals, vals, indexing="ij"))
    grad = torch.ones_like(g)
    p = dict(limit=limit, alpha=1.0, up_offset=0.0)
    want = _grads(lambda a, b: hf_gate(a, b, **p), (g, u), grad)  # torch's autograd in the dtype
    dgate, dup = native.testing()._host_math("swiglu_clamped_backward", [grad, g, u], host_params("swiglu_clamped", p))
    cpu_dgate, cpu_dup = call("swiglu_clamped_backward", params=p)(grad, g, u)
    assert torch.equal(cpu_dgate == 0, want[1] == 0) and torch.equal(cpu_dup == 0, want[2] == 0)  # the CPU op: ok
    bad = (dgate == 0) != (want[1] == 0)
    assert not bad.any(), f"dgate stops elsewhere than torch's: gate {g[bad].tolist()}, up {u[bad].tolist()}"
    bad = (dup == 0) != (want[2] == 0)
    assert not bad.any(), f"dup stops elsewhere than torch's: gate {g[bad].tolist()}, up {u[bad].tolist()}"


@pytest.mark.xfail(
    strict=True,
    reason=(
        "BUG (ffn_ext/table.py _clamped_terms, the float64 reference model of gated_terms): it writes the op as "
        "silu(alpha x) * (c / alpha), so alpha=0 (accepted: `alpha` must only be finite) gives NaN for every element, "
        "where the op and transformers' expression give (clamp(up) + up_offset) * clamp(gate) / 2."
    ),
)
def test_reference_model_with_alpha_zero():
    gate = torch.tensor([1.0, -2.0, 3.0, -30.0], dtype=torch.float64)
    up = torch.tensor([0.5, 1.0, -1.0, 4.0], dtype=torch.float64)
    p = dict(limit=2.5, alpha=0.0, up_offset=1.0)
    out = call("swiglu_clamped", params=p)(gate, up)
    torch.testing.assert_close(out, hf_gate(gate, up, **p), rtol=1e-15, atol=0)  # the op is right
    assert_matches_reference("swiglu_clamped", (gate, up), out, inf_limits=True, params=p)


# ---------------------------------------------------------------- limit=inf: no clamp
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_infinite_limit_clamps_nothing(dtype):
    gate = (torch.randn(4, 33, dtype=torch.float64) * 30).to(dtype)  # far beyond any finite limit used above
    up = (torch.randn(4, 33, dtype=torch.float64) * 30).to(dtype)
    grad = torch.randn(4, 33, dtype=dtype)
    tol = {torch.float64: dict(rtol=1e-12, atol=1e-10), torch.float32: dict(rtol=1e-5, atol=1e-3)}[dtype]
    # alpha 1, no offset: the plain SwiGLU, forward and gradients
    got = _grads(lambda g, u: ffn_ext.swiglu_clamped(g, u, limit=math.inf), (gate, up), grad)
    want = _grads(lambda g, u: torch.nn.functional.silu(g) * u, (gate, up), grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)
    # with alpha and an offset: the unclamped expression
    got = _grads(
        lambda g, u: ffn_ext.swiglu_clamped(g, u, limit=math.inf, alpha=1.702, up_offset=1.0), (gate, up), grad
    )
    want = _grads(lambda g, u: (u + 1.0) * g * torch.sigmoid(g * 1.702), (gate, up), grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)
    (h,) = native.testing()._host_math("swiglu_clamped", [gate, up], [math.inf, 1.0, 0.0])
    (s,) = native.testing()._host_math("swiglu", [gate, up])
    torch.testing.assert_close(h, s, **tol)


# ---------------------------------------------------------------- the module
@pytest.mark.parametrize("layout", ["concat", "interleaved"])
@pytest.mark.parametrize("pname", ["gpt_oss", "deepseek_v4"])
def test_swiglu_module_is_the_models_gating(pname, layout):
    """SwiGLU(limit=, alpha=, up_offset=, layout=) on the packed projection (GPT-OSS: interleaved) and on gate, up:
    transformers' expression, forward and gradient; it runs ffn_ext's clamped ops."""
    p = PARAMS[pname]
    mod = ffn_ext.SwiGLU(**p, layout=layout)
    assert mod.clamped and mod.layout == layout and (mod.limit, mod.alpha, mod.up_offset) == tuple(p.values())
    gate_up = (torch.randn(3, 5, 2 * 24, dtype=torch.float64) * 6).requires_grad_()  # many beyond the limit
    gate, up = split_packed(gate_up, layout)
    ref = hf_gate(gate, up, **p)
    with RecordOps() as rec:
        out = mod(gate_up)
        two = mod(gate, up)
    assert rec.ops == ["ffn_ext.swiglu_clamped_packed.default", "ffn_ext.swiglu_clamped.default"], rec.ops
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(two, ref, rtol=1e-12, atol=1e-12)
    w = torch.randn_like(ref)
    (got,) = torch.autograd.grad((out + two) * w, gate_up, torch.ones_like(ref))
    (want,) = torch.autograd.grad(2 * ref * w, gate_up, torch.ones_like(ref))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_swiglu_module_options_and_repr():
    assert repr(ffn_ext.SwiGLU()) == "SwiGLU()" and not ffn_ext.SwiGLU().clamped
    gpt_oss = ffn_ext.SwiGLU(**GPT_OSS, layout="interleaved")
    assert repr(gpt_oss) == "SwiGLU(limit=7.0, alpha=1.702, up_offset=1.0, layout='interleaved')"
    assert repr(ffn_ext.SwiGLU(limit=10.0)) == "SwiGLU(limit=10.0)"
    assert repr(ffn_ext.SwiGLU(layout="interleaved")) == "SwiGLU(layout='interleaved')"
    # without a limit nothing is clamped (limit=inf); alpha or an offset alone still make it the clamped op's
    x = torch.randn(4, 16, dtype=torch.float64) * 20
    torch.testing.assert_close(ffn_ext.SwiGLU()(x), ffn_ext.swiglu_packed(x), rtol=0, atol=0)
    alpha_only = ffn_ext.SwiGLU(alpha=1.702, up_offset=1.0)
    assert alpha_only.clamped and alpha_only.limit is None
    g, u = x.chunk(2, -1)
    torch.testing.assert_close(alpha_only(x), (u + 1.0) * g * torch.sigmoid(1.702 * g), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        ffn_ext.SwiGLU(layout="interleaved")(x),
        torch.nn.functional.silu(x[:, ::2]) * x[:, 1::2],
        rtol=1e-12,
        atol=1e-12,
    )


# ---------------------------------------------------------------- CUDA: device vs host math vs reference
def _specials_grid(limit, dtype):
    gate, up = grid(limit, dtype, specials=True)
    rnd = (torch.randn(4096, dtype=torch.float64) * 2 * limit).to(dtype)
    return torch.cat([gate, rnd]), torch.cat([up, rnd.flip(0) * 0.9])


def _device_vs_host(dev, host, dtype, spread, what, stop=None):
    """The device's results against the host math's (the same functor; the device's expf and reciprocal differ in
    the last bits, more where the formula cancels: spread), NaN in the same places, and both exactly 0 where a
    clamp stops the gradient (`stop`)."""
    dev, host = dev.cpu(), host.cpu()
    assert torch.equal(dev.isnan(), host.isnan()), f"{what}: NaN differ"
    if stop is not None:
        assert (dev[stop] == 0).all() and (host[stop] == 0).all(), f"{what}: nonzero where the clamp stops it"
    assert_close_to(dev, host.double(), dtype, f"{what} device vs host math", spread=spread)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("pname", PARAMS)
def test_cuda_matches_host_math_and_reference(pname, dtype):
    p = PARAMS[pname]
    prm = host_params("swiglu_clamped", p)
    gate, up = _specials_grid(p["limit"], dtype)
    grad = torch.randn(gate.shape, dtype=torch.float32).to(dtype)
    (h_host,) = native.testing()._host_math("swiglu_clamped", [gate, up], prm)
    dg_host, du_host = native.testing()._host_math("swiglu_clamped_backward", [grad, gate, up], prm)
    g, u, gr = gate.cuda(), up.cuda(), grad.cuda()
    h = call("swiglu_clamped", params=p)(g, u)
    dg, du = call("swiglu_clamped_backward", params=p)(gr, g, u)
    sp_f = error_scale("swiglu_clamped", gate, up, params=p)
    sp_b = error_scale("swiglu_clamped_backward", grad, gate, up, params=p)
    pass_g, pass_u = clamp_pass(gate.double(), up.double(), p["limit"])
    _device_vs_host(h, h_host, dtype, sp_f[0], f"{pname} forward")
    _device_vs_host(dg, dg_host, dtype, sp_b[0], f"{pname} dgate", ~pass_g)
    _device_vs_host(du, du_host, dtype, sp_b[1], f"{pname} dup", ~pass_u)
    # the limits the kernels implement (gate = -inf: -0 times the clamped up, not transformers' NaN)
    assert_matches_reference("swiglu_clamped", (g, u), h, inf_limits=True, params=p)
    assert_matches_reference("swiglu_clamped_backward", (gr, g, u), (dg, du), inf_limits=True, params=p)
    # the packed ops in both layouts (rows of odd M: interleaved pairs at alternating alignments): the separate
    # op's values (the same functor), (dgate, dup) written in the layout
    m = 63
    n = gate.numel() // m * m

    def rows(t):
        return t[:n].view(-1, m)

    for layout in ("concat", "interleaved"):
        gu = join_packed(rows(g), rows(u), layout)
        hp = call("swiglu_clamped_packed", layout, p)(gu)
        dgu = call("swiglu_clamped_packed_backward", layout, p)(rows(gr), gu)
        dgp, dup_ = split_packed(dgu, layout)
        for what, a, b, sp in (
            ("forward", hp, rows(h), sp_f[0]),
            ("dgate", dgp, rows(dg), sp_b[0]),
            ("dup", dup_, rows(du), sp_b[1]),
        ):
            assert torch.equal(a.isnan(), b.isnan()), f"{pname} {layout} {what}: NaN differ"
            assert_close_to(a, b.double(), dtype, f"{pname} packed {layout} {what} vs separate", spread=rows(sp))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_gpt_oss_experts_match_transformers(dtype):
    """GPT-OSS's gating on an interleaved [tokens, 2I] projection (I = 2880, tokens of several experts): the
    fused op and its gradient against transformers' expression run by ATen on the GPU, finite inputs, within
    twice the dtype's tolerance of each other (ATen rounds its intermediates in the dtype), and within the
    tolerance of the fp64 reference."""
    kw = dict(packing="interleaved", params=GPT_OSS)
    gate_up = (torch.randn(37, 2 * 2880, device="cuda") * 5).to(dtype)
    gate_up[:, :16] = torch.tensor([7.0, -7.0, 7.0, 7.0, -7.0, 7.0, 8.0, -8.0] * 2, device="cuda")  # at the bounds
    grad = torch.randn(37, 2880, device="cuda").to(dtype)
    got = _grads(lambda gu: ffn_ext.swiglu_clamped_packed(gu, layout="interleaved", **GPT_OSS), (gate_up,), grad)
    want = _grads(lambda gu: hf_apply_gate(gu, **GPT_OSS), (gate_up,), grad)
    assert_matches_reference("swiglu_clamped_packed", (gate_up,), got[0], **kw)
    assert_matches_reference("swiglu_clamped_packed_backward", (grad, gate_up), got[1], **kw)
    ref = reference("swiglu_clamped_packed", gate_up, **kw)
    aten_err = (want[0].double() - ref).abs() / (1e-2 if dtype == torch.bfloat16 else 1e-5)
    assert_close_to(
        got[0],
        want[0].double(),
        dtype,
        "forward vs ATen",
        scale=2.0,
        spread=error_scale("swiglu_clamped_packed", gate_up, **kw)[0] + aten_err,
    )
    stop = join_packed(*[~m for m in clamp_pass(*split_packed(gate_up.double(), "interleaved"), 7.0)], "interleaved")
    assert (got[1][stop] == 0).all() and (want[1][stop] == 0).all(), "gradients where the clamps stop them"
