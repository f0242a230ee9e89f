"""Differential fuzzing (hypothesis) of every ffn_ext op against a float64 reference. The ops are the table's
(tests/optable.py): the unary tests run once per activation, the gated and packed ones once per gated op (with
parameters: swiglu_clamped, each parameter drawn from its default and its example value); packed ops draw their
layout (concat, interleaved).

Random shapes (0 and 1 sizes, odd widths), random layouts (storage offsets, padded rows, chunk views, transposes,
steps, expanded rows, sliced leading dims), every dtype (float64/32/16, bfloat16), the forward and backward ops
through torch.ops.ffn_ext and (some cases) the public API with autograd.

Non-finite inputs (NaN, +-inf) are mixed in on some cases. Their expected results differ by path:
- CPU (ATen composites): ATen's semantics, so the reference is ATen on the same dtype and inputs.
- CUDA kernels and the host copy of their element math (_host_math, tests/native.py): the mathematical limits
  documented in csrc/ffn_math.h, so the reference is the float64 formula with those limits.

Hypothesis is not derandomized: every run draws new cases; a failure prints the falsifying draws (shapes, layouts,
the torch seed of the values) and a reproduce blob. The number of cases run is printed by the last test of this
file (on CPU about 1,100 per activation and 1,900 per gated op; CI runtime about three minutes on 2 cores).
"""

import math
import os
import time
from collections import Counter

import optable
import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
import native  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from optable import (  # noqa: E402
    ACTIVATIONS,
    GATED,
    GATED_IDS,
    PACKINGS,
    api_call,
    aten_result,
    call,
    host_params,
    ops_of,
    spec,
    terms,
)

from ffn_ext.table import split_packed  # noqa: E402

ACT_IDS = [a.name for a in ACTIVATIONS]

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
# rtol applies to |ref| + the magnitude of the terms (error scale); atol is for values that round to ~0.
# The CPU composites round intermediates to the storage dtype (e.g. act(gate) before the multiply), hence the
# few-ulp margins for float16/bfloat16.
TOL = {
    torch.float64: (1e-12, 1e-300),
    torch.float32: (1e-5, 1e-30),
    torch.float16: (3e-3, 1e-6),
    torch.bfloat16: (2e-2, 1e-30),
}

# Below these, an activation value or derivative may be lost to exp under/overflow in the compute type (as
# test_host_math's TINY).
TINY = {torch.float32: 1e-35, torch.float64: 1e-300}

CASES = Counter()  # cases run per test, summed up by test_fuzz_case_count
_START = time.perf_counter()


# ---------------------------------------------------------------- float64 references
def reference(name, ins, opmath=torch.float64, params=None):
    """float64 results and error scales of op `name` (not packed) on float64 inputs, with the limits at +-inf of
    the table's act.ref. The activation values and derivative factors are rounded to `opmath` (the kernels' compute
    type: float for float/half/bfloat16) before they multiply grad/up, so that where they underflow to 0 in the
    kernel, an infinite grad/up gives NaN in the reference too.
    Second result: error scales, |factors| * |x| for a value, |factors| * (1 + |x|) for a derivative.
    Third result: masks of "NaN or inf, either is right": an infinite grad/up times an activation value or
    derivative that is nonzero but within the kernel's error bound of 0 (K ulps of the compute type times the size
    of the terms its formula cancels, act.cancel, e.g. the exact GELU's 1 + erf for x << 0; or below TINY, where
    the formula's exp under- or overflows in the compute type, e.g. the tanh GELU's derivative near x = -10 in
    float): whether the kernel keeps the factor or gives 0 (and so NaN) is not specified."""
    r = (lambda t: t.to(opmath).double()) if opmath != torch.float64 else (lambda t: t)
    tiny, eps = TINY[opmath], torch.finfo(opmath).eps
    act = spec(name).act

    def either(factor, size, *others):
        m = (factor.abs() <= 4 * eps * size + tiny) & (factor != 0)
        return m & torch.stack([~torch.isfinite(o) for o in others]).any(0)

    def select(mask, t):  # a term's mask: 0 where it does not hold (a clamp's gradient), whatever t is there
        return t if mask is None or t is None else torch.where(mask, t, torch.zeros_like(t))

    refs, scales, eithers = [], [], []
    for which, x, factors, mask in terms(name, ins, params):
        k = 0 if which == "f" else 1
        v, cancel = act.ref(x)[k], act.cancel(x)[k]
        size = x.abs() if which == "f" else 1.0 + x.abs()
        if not factors:
            refs.append(select(mask, v))
            scales.append(select(mask, size))
            eithers.append(None)
            continue
        m = factors[0]
        for f in factors[1:]:
            m = m * f  # grad * up first, as the kernels multiply
        refs.append(select(mask, m * r(v)))
        scales.append(select(mask, m.abs() * size))
        e = either(v, cancel, *factors)
        eithers.append(e if mask is None else e & mask)
    return refs, scales, eithers


def aten_same_dtype(name, ins, params=None):
    """ATen's own results on the same dtype (the CPU path's semantics for non-finite inputs)."""
    out = aten_result(name, *ins, params=params)
    return list(out) if isinstance(out, tuple) else [out]


def aten_autograd(name, ins, params=None):
    """For a backward op: ATen's autograd of the forward op's ATen composite on the same inputs, as a list; [] for
    other ops. Its non-finite results may differ
    from the composite's backward formula (relu's keeps grad where x is NaN)."""
    if not name.endswith("_backward"):
        return []
    with torch.enable_grad():
        grad, leaves = ins[0], [t.detach().requires_grad_() for t in ins[1:]]
        out = optable._aten(name[: -len("_backward")], leaves, "concat", params)  # aten_result detaches
        return [list(torch.autograd.grad(out, leaves, grad, allow_unused=True))]


def _opmath(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_close(out, ref, scale, dtype, what, contiguous=True, either=None):
    """out (dtype) against the float64 ref: NaN where ref is NaN, the same infinities, finite values within
    atol + rtol * (|ref| + scale)."""
    assert out.dtype == dtype, (what, out.dtype, dtype)
    assert out.shape == ref.shape, (what, out.shape, ref.shape)
    assert out.is_contiguous() or not contiguous, what  # op outputs are fresh, contiguous tensors
    o = out.cpu().double()
    ref = ref.cpu()
    scale = scale.cpu()
    nan_r = ref.isnan()
    fin = torch.isfinite(ref)
    inf_r = ~fin & ~nan_r
    wrong = (o.isnan() != nan_r) | (inf_r & (o != ref))
    if either is not None:  # NaN or an infinity are both right there
        either = either.cpu()
        wrong = torch.where(either, torch.isfinite(o), wrong)
        fin = fin & ~either
    if wrong.any():
        idx = wrong.nonzero()[:5].tolist()
        raise AssertionError(
            f"{what} ({dtype}): {int(wrong.sum())} NaN/inf mismatches; first at "
            + "; ".join(f"{tuple(i)}: out={o[tuple(i)].item()!r} ref={ref[tuple(i)].item()!r}" for i in idx)
        )
    rtol, atol = TOL[dtype]
    err = (o[fin] - ref[fin]).abs()
    tol = atol + rtol * (ref[fin].abs() + torch.nan_to_num(scale[fin], posinf=0.0))
    bad = ~(err <= tol)
    if bad.any():
        i = bad.nonzero()[0].item()
        raise AssertionError(
            f"{what} ({dtype}): {int(bad.sum())}/{err.numel()} elements out of tolerance; first: "
            f"out={o[fin][i].item()!r} ref={ref[fin][i].item()!r} tol={tol[i].item():.3g}"
        )


def check_same(out, ref, dtype, what):
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(
        out.cpu(), ref.cpu(), rtol=rtol, atol=max(atol, 1e-12), equal_nan=True, msg=lambda m: f"{what}: {m}"
    )


# ---------------------------------------------------------------- random inputs
LAYOUTS = ["contiguous", "offset", "padded_rows", "transposed", "step", "expanded", "leading_slice"]


def _values(shape, dtype, gen, specials, big):
    """Random values (never all zeros) rounded to dtype; `specials` sprinkles NaN/+-inf, `big` widens the range."""
    v = torch.randn(shape, generator=gen, dtype=torch.float64) * (6.0 if big else 1.5)
    v = v.clamp(-30.0, 30.0)  # keeps float16 products (grad * up * act') finite
    if specials and v.numel():
        pick = torch.rand(shape, generator=gen, dtype=torch.float64)
        v = torch.where(pick < 0.06, torch.full_like(v, math.nan), v)
        v = torch.where((pick >= 0.06) & (pick < 0.12), torch.full_like(v, math.inf), v)
        v = torch.where((pick >= 0.12) & (pick < 0.18), torch.full_like(v, -math.inf), v)
    return v.to(dtype)


def make(shape, dtype, layout, gen, device, specials=False, big=False):
    """A tensor of `shape` whose memory layout is `layout` (views of larger buffers where the layout needs it)."""
    shape = list(shape)
    nd = len(shape)

    def vals(s):
        return _values(s, dtype, gen, specials, big).to(device)

    if nd == 0 or layout == "contiguous":
        return vals(shape)
    if layout == "offset":  # storage offset 1: misaligned for vector loads
        n = math.prod(shape)
        return vals([n + 1])[1:].view(shape)
    if layout == "padded_rows":  # rows with a stride larger than their length, starting at an odd column
        return vals(shape[:-1] + [shape[-1] + 3])[..., 1 : shape[-1] + 1]
    if layout == "transposed" and nd >= 2:
        s = shape[:-2] + [shape[-1], shape[-2]]
        return vals(s).transpose(-1, -2)
    if layout == "expanded":  # stride-0 leading dimensions
        return vals([1] * (nd - 1) + shape[-1:]).expand(shape)
    if layout == "leading_slice" and nd >= 2:
        return vals([2 * shape[0]] + shape[1:])[::2]
    # "step" (and the fallbacks of transposed / leading_slice for 1-d): last-dimension stride 2
    return vals(shape[:-1] + [2 * shape[-1]])[..., ::2]


@st.composite
def shapes(draw, min_dims=0, max_dims=3, max_last=40, even_last=False):
    nd = draw(st.integers(min_dims, max_dims))
    lead = [draw(st.sampled_from([0, 1, 1, 2, 3, 5, 7])) for _ in range(max(nd - 1, 0))]
    if nd == 0:
        return []
    last = draw(st.integers(0, max_last))
    if even_last:
        last = 2 * (last // 2)
    return lead + [last]


def _seed(data):
    return data.draw(st.integers(0, 2**63 - 1), label="torch_seed")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- one case per op family
def run_unary(data, act, device, count_key):
    name = act.name
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    shape = data.draw(shapes(max_last=80 if device == "cuda" else 40), label="shape")
    lx, lg = (data.draw(st.sampled_from(LAYOUTS), label=f"layout_{n}") for n in ("x", "grad"))
    specials = data.draw(st.integers(0, 3), label="specials") == 0
    big = data.draw(st.booleans(), label="big")
    via_api = data.draw(st.integers(0, 3), label="via_api") == 0
    gen = _gen(_seed(data))
    x = make(shape, dtype, lx, gen, device, specials, big)
    grad = make(shape, dtype, lg, gen, device, specials and data.draw(st.booleans(), label="grad_specials"))
    bwd = name + "_backward"

    if via_api:  # public API + autograd (calls the backward op)
        x = x.detach().clone().requires_grad_(True)  # clone: contiguous leaf with the same values
        y = api_call(name)(x)
        y.backward(grad)
        outs = {name: [y.detach()], bwd: [x.grad]}
        x = x.detach()
    else:
        outs = {name: [call(name)(x)], bwd: [call(bwd)(grad, x)]}
    _compare(outs, {name: [x], bwd: [grad, x]}, dtype, device, specials, contiguous=not via_api)
    CASES[count_key] += 1


def draw_params(data, g):
    """A gated op's parameters: each drawn from its default (where it has one) and its example value ({} for the
    gated ops without parameters)."""
    return {
        p.name: data.draw(st.sampled_from([v for v in (p.default, p.example) if v is not None]), label=p.name)
        for p in g.params
    }


def at_bounds(data, gate, up, params, gen):
    """Sometimes (an op with a `limit`, a clamp bound): about a tenth of gate's and up's elements set to +-limit
    exactly, in place (the layouts stay; not where an input's elements share memory, stride 0), where the clamps'
    gradients follow torch's convention at the bound."""
    limit = params.get("limit")
    if limit is None or not data.draw(st.booleans(), label="at_bounds"):
        return
    for t in (gate, up):
        if t.numel() and all(st_ != 0 for st_, n in zip(t.stride(), t.shape) if n > 1):
            pick = torch.rand(t.shape, generator=gen).to(t.device)
            t.masked_fill_(pick < 0.05, limit).masked_fill_((pick >= 0.05) & (pick < 0.1), -limit)


def run_gated(data, g, device, count_key):
    name, bwd = g.name, g.name + "_backward"
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    shape = data.draw(shapes(max_last=80 if device == "cuda" else 40), label="shape")
    specials = data.draw(st.integers(0, 3), label="specials") == 0
    big = data.draw(st.booleans(), label="big")
    params = draw_params(data, g)
    gen = _gen(_seed(data))
    if data.draw(st.booleans(), label="chunked") and shape:  # gate, up = gate_up.chunk(2, -1): row stride 2M
        lgu = data.draw(st.sampled_from(LAYOUTS), label="layout_gate_up")
        gate, up = make(shape[:-1] + [2 * shape[-1]], dtype, lgu, gen, device, specials, big).chunk(2, -1)
    else:
        lga, lup = (data.draw(st.sampled_from(LAYOUTS), label=f"layout_{n}") for n in ("gate", "up"))
        gate = make(shape, dtype, lga, gen, device, specials, big)
        up = make(shape, dtype, lup, gen, device, specials)
    at_bounds(data, gate, up, params, gen)
    grad = make(shape, dtype, data.draw(st.sampled_from(LAYOUTS), label="layout_grad"), gen, device)
    via_api = data.draw(st.integers(0, 3), label="via_api") == 0
    if via_api:
        gv, uv = gate.detach().clone().requires_grad_(True), up.detach().clone().requires_grad_(True)
        h = api_call(name, params=params)(gv, uv)
        h.backward(grad)
        outs = {name: [h.detach()], bwd: [gv.grad, uv.grad]}
        gate, up = gv.detach(), uv.detach()  # ATen's CPU results can depend on the layout: compare on what ran
    else:
        outs = {name: [call(name, params=params)(gate, up)], bwd: list(call(bwd, params=params)(grad, gate, up))}
    _compare(
        outs, {name: [gate, up], bwd: [grad, gate, up]}, dtype, device, specials, contiguous=not via_api, params=params
    )  # autograd's .grad takes the leaf's strides
    CASES[count_key] += 1


def run_packed(data, g, device, count_key):
    name, gated = g.name + "_packed", g.name
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    shape = data.draw(shapes(min_dims=1, max_last=80 if device == "cuda" else 40, even_last=True), label="shape")
    specials = data.draw(st.integers(0, 3), label="specials") == 0
    big = data.draw(st.booleans(), label="big")
    params = draw_params(data, g)
    packing = data.draw(st.sampled_from(PACKINGS), label="packing")
    gen = _gen(_seed(data))
    lgu, lg = (data.draw(st.sampled_from(LAYOUTS), label=f"layout_{n}") for n in ("gate_up", "grad"))
    gate_up = make(shape, dtype, lgu, gen, device, specials, big)
    at_bounds(data, *split_packed(gate_up, packing), params, gen)
    m = shape[-1] // 2
    grad = make(shape[:-1] + [m], dtype, lg, gen, device)
    via_api = data.draw(st.integers(0, 3), label="via_api") == 0
    if via_api:
        gu = gate_up.detach().clone().requires_grad_(True)
        h = api_call(name, packing, params)(gu)
        h.backward(grad)
        h, dgu, gate_up = h.detach(), gu.grad, gu.detach()
    else:
        h, dgu = call(name, packing, params)(gate_up), call(name + "_backward", packing, params)(grad, gate_up)
    assert h.shape == tuple(shape[:-1] + [m]) and dgu.shape == gate_up.shape
    gate, up = split_packed(gate_up, packing)
    dgate, dup = split_packed(dgu, packing)
    # compare the packed results as the gated op's (the halves of a contiguous result are fine to compare)
    if not via_api:
        assert dgu.is_contiguous()
    outs = {gated: [h], gated + "_backward": [dgate.contiguous(), dup.contiguous()]}
    _compare(outs, {gated: [gate, up], gated + "_backward": [grad, gate, up]}, dtype, device, specials, params=params)
    CASES[count_key] += 1


def _compare(outs, inputs, dtype, device, specials, contiguous=True, params=None):
    for name, got in outs.items():
        ins = inputs[name]
        if specials and device == "cpu":  # ATen semantics on the CPU path
            # ATen's non-finite results depend on the loop ATen picks for the layout (vectorized or scalar: NaN or
            # the limit for gelu(+-inf) in float32), elementwise, so each element may match ATen on the same
            # strided inputs, ATen on contiguous copies, or the mathematical limit.
            refs, scales, _ = reference(name, [t.double() for t in ins], _opmath(dtype), params)
            cands = [
                aten_same_dtype(name, ins, params),
                aten_same_dtype(name, [t.contiguous() for t in ins], params),
                refs,
            ] + aten_autograd(name, ins, params)
            rtol, atol = TOL[dtype]
            for k, o in enumerate(got):
                o64 = o.cpu().double()
                tol = atol + rtol * torch.nan_to_num(scales[k].cpu(), nan=0.0, posinf=0.0)
                ok = torch.zeros_like(o64, dtype=torch.bool)
                for c in cands:
                    c64 = c[k].cpu().double()
                    ok |= (o64 - c64).abs() <= tol + rtol * c64.abs()
                    ok |= (o64 == c64) | (o64.isnan() & c64.isnan())
                assert bool(ok.all()), (
                    f"{name}[{k}] ({dtype}) vs ATen/limits: {int((~ok).sum())} elements differ; "
                    f"out={o64[~ok][:5].tolist()} aten={cands[0][k].double()[~ok][:5].tolist()}"
                )
            continue
        refs, scales, eithers = reference(name, [t.double() for t in ins], _opmath(dtype), params)
        for k, (o, r, s, e) in enumerate(zip(got, refs, scales, eithers)):
            check_close(o, r, s, dtype, f"{name}[{k}] on {device}", contiguous, e)


# ---------------------------------------------------------------- the tests
SETTINGS = dict(
    deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
# CPU: N_UNARY cases per activation, N_GATED + N_PACKED per gated op; seconds per 1,000 cases on 2 cores.
# FFN_EXT_FUZZ_SCALE multiplies every count (e.g. 0.1 for a quick run, 10 for a long one).
_SCALE = float(os.environ.get("FFN_EXT_FUZZ_SCALE", "1"))
N_UNARY, N_GATED, N_PACKED, N_HOST = (max(1, int(n * _SCALE)) for n in (1100, 950, 950, 550))
N_CUDA = max(1, int(400 * _SCALE))
per_activation = pytest.mark.parametrize("act", ACTIVATIONS, ids=ACT_IDS)
per_gated = pytest.mark.parametrize("g", GATED, ids=GATED_IDS)


@per_activation
@settings(max_examples=N_UNARY, **SETTINGS)
@given(data=st.data())
def test_fuzz_unary_cpu(act, data):
    run_unary(data, act, "cpu", f"unary_cpu[{act.name}]")


@per_gated
@settings(max_examples=N_GATED, **SETTINGS)
@given(data=st.data())
def test_fuzz_gated_cpu(g, data):
    run_gated(data, g, "cpu", f"gated_cpu[{g.name}]")


@per_gated
@settings(max_examples=N_PACKED, **SETTINGS)
@given(data=st.data())
def test_fuzz_packed_cpu(g, data):
    run_packed(data, g, "cpu", f"packed_cpu[{g.name}]")


@per_activation
@settings(max_examples=N_HOST, **SETTINGS)
@given(data=st.data())
def test_fuzz_host_math_limits(act, data):
    """The CUDA kernels' element math, run on the host: float64 reference with the documented limits at +-inf."""
    name = data.draw(st.sampled_from(ops_of(act=act, kind="unary") + ops_of(act=act, kind="gated")), label="op")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    shape = data.draw(shapes(max_last=64), label="shape")
    specials = data.draw(st.booleans(), label="specials")
    params = draw_params(data, spec(name).gated) if spec(name).gated is not None else {}
    gen = _gen(_seed(data))
    ins = [make(shape, dtype, "contiguous", gen, "cpu", specials, big=(i > 0)) for i in range(len(spec(name).args))]
    if spec(name).kind == "gated":
        at_bounds(data, *ins[-2:], params, gen)
    got = native.testing()._host_math(name, ins, host_params(name, params))
    refs, scales, eithers = reference(name, [t.double() for t in ins], _opmath(dtype), params)
    for k, (o, r, s, e) in enumerate(zip(got, refs, scales, eithers)):
        check_close(o, r, s, dtype, f"_host_math {name}[{k}]", either=e)
    CASES[f"host_math[{act.name}]"] += 1


@pytest.mark.cuda
@per_activation
@settings(max_examples=N_CUDA, **SETTINGS)
@given(data=st.data())
def test_fuzz_unary_cuda(act, data):
    run_unary(data, act, "cuda", f"unary_cuda[{act.name}]")


@pytest.mark.cuda
@per_gated
@settings(max_examples=N_CUDA, **SETTINGS)
@given(data=st.data())
def test_fuzz_gated_cuda(g, data):
    run_gated(data, g, "cuda", f"gated_cuda[{g.name}]")


@pytest.mark.cuda
@per_gated
@settings(max_examples=N_CUDA, **SETTINGS)
@given(data=st.data())
def test_fuzz_packed_cuda(g, data):
    run_packed(data, g, "cuda", f"packed_cuda[{g.name}]")


def test_fuzz_case_count(capsys):
    """Runs last in this file: prints how many fuzz cases ran (and fails if the CPU tests ran short)."""
    total = sum(CASES.values())
    with capsys.disabled():
        print(
            f"\n[ffn_ext fuzz] {total} cases in {time.perf_counter() - _START:.1f} s: "
            + ", ".join(f"{k}={v}" for k, v in sorted(CASES.items()))
        )
    cpu = sum(v for k, v in CASES.items() if "_cpu[" in k)
    expected = {f"unary_cpu[{a.name}]" for a in ACTIVATIONS} | {
        f"{kind}_cpu[{g.name}]" for kind in ("gated", "packed") for g in GATED
    }
    if expected <= set(CASES):  # all CPU fuzz tests ran in this session
        assert cpu >= 0.95 * (len(ACTIVATIONS) * N_UNARY + len(GATED) * (N_GATED + N_PACKED)), CASES
