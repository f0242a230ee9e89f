"""Differential fuzzing (hypothesis) of every ffn_ext op against a float64 reference.

Random shapes (0 and 1 sizes, odd widths), random layouts (storage offsets, padded rows, chunk views, transposes,
steps, expanded rows, sliced leading dims), every dtype (float64/32/16, bfloat16), the forward and backward ops
through torch.ops.ffn_ext and (some cases) the public API with autograd.

Non-finite inputs (NaN, +-inf) are mixed in on some cases. Their expected results differ by path:
- CPU (ATen composites): ATen's semantics, so the reference is ATen on the same dtype and inputs.
- CUDA kernels and the host copy of their element math (ffn_ext._C._host_math): the mathematical limits
  documented in csrc/ffn_math.h, so the reference is the float64 formula with those limits.

Hypothesis is not derandomized: every run draws new cases; a failure prints the falsifying draws (shapes, layouts,
the torch seed of the values) and a reproduce blob. The number of cases run is printed by the last test of this
file (about 10,600 on CPU; CI runtime about two minutes on 2 cores).
"""
import math
import os
import time
from collections import Counter

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import ffn_ext  # noqa: E402

OPS = torch.ops.ffn_ext
NATIVE = not ffn_ext.build_info()["native"].startswith("none")
CUDA = torch.cuda.is_available() and NATIVE and ffn_ext.has_cuda_kernels()
HOST_MATH = NATIVE and hasattr(getattr(ffn_ext.ops._native, "_host_math", None), "__call__")

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
# rtol applies to |ref| + the magnitude of the terms (error scale); atol is for values that round to ~0.
# The CPU composites round intermediates to the storage dtype (e.g. silu(gate) before the multiply), hence the
# few-ulp margins for float16/bfloat16.
TOL = {
    torch.float64: (1e-12, 1e-300),
    torch.float32: (1e-5, 1e-30),
    torch.float16: (3e-3, 1e-6),
    torch.bfloat16: (2e-2, 1e-30),
}

CASES = Counter()  # cases run per test, summed up by test_fuzz_case_count
_START = time.perf_counter()

SQRT1_2 = 1.0 / math.sqrt(2.0)
INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


# ---------------------------------------------------------------- float64 references
def _limits(val, x, at_neg_inf, at_pos_inf):
    val = torch.where(x == -math.inf, torch.full_like(val, at_neg_inf), val)
    return torch.where(x == math.inf, torch.full_like(val, at_pos_inf), val)


def ref_gelu(x):
    return _limits(0.5 * x * (1.0 + torch.erf(x * SQRT1_2)), x, 0.0, math.inf)


def ref_gelu_grad(x):
    d = 0.5 * (1.0 + torch.erf(x * SQRT1_2)) + x * torch.exp(-0.5 * x * x) * INV_SQRT_2PI
    return _limits(d, x, 0.0, 1.0)


def ref_silu(x):
    return _limits(x * torch.sigmoid(x), x, 0.0, math.inf)


def ref_silu_grad(x):
    s = torch.sigmoid(x)
    return _limits(s * (1.0 + x * (1.0 - s)), x, 0.0, 1.0)


def reference(op, ins, opmath=torch.float64):
    """float64 results and error scales of `op` on float64 inputs, with the documented limits at +-inf.
    The activation values and derivative factors are rounded to `opmath` (the kernels' compute type: float for
    float/half/bfloat16) before they multiply grad/up, so that where they underflow to 0 in the kernel, an
    infinite grad/up gives NaN in the reference too.
    Third result: masks of "NaN or inf, either is right" (an infinite grad/up times a factor so small that it is
    subnormal in the compute type: whether the kernel keeps it or flushes it to 0 is not specified)."""
    r = (lambda t: t.to(opmath).double()) if opmath != torch.float64 else (lambda t: t)
    tiny = torch.finfo(opmath).tiny

    def either(factor, *others):
        m = (factor.abs() < tiny) & (factor != 0)
        return m & torch.stack([~torch.isfinite(o) for o in others]).any(0)

    if op == "gelu":
        (x,) = ins
        return [ref_gelu(x)], [x.abs()], [None]
    if op == "silu":
        (x,) = ins
        return [ref_silu(x)], [x.abs()], [None]
    if op in ("gelu_backward", "silu_backward"):
        g, x = ins
        d = ref_gelu_grad(x) if op == "gelu_backward" else ref_silu_grad(x)
        return [g * r(d)], [g.abs() * (1.0 + x.abs())], [either(d, g)]
    if op == "swiglu":
        gate, up = ins
        h = ref_silu(gate)
        return [r(h) * up], [gate.abs() * up.abs()], [either(h, up)]
    if op == "swiglu_backward":
        g, gate, up = ins
        d, h = ref_silu_grad(gate), ref_silu(gate)
        return ([g * up * r(d), g * r(h)], [g.abs() * up.abs() * (1.0 + gate.abs()), g.abs() * gate.abs()],
                [either(d, g, up), either(h, g)])
    raise AssertionError(op)


def aten_same_dtype(op, ins):
    """ATen's own results on the same dtype (the CPU path's semantics for non-finite inputs)."""
    A = torch.ops.aten
    if op == "gelu":
        return [A.gelu(ins[0])]
    if op == "silu":
        return [A.silu(ins[0])]
    if op == "gelu_backward":
        return [A.gelu_backward(*ins)]
    if op == "silu_backward":
        return [A.silu_backward(*ins)]
    if op == "swiglu":
        return [A.silu(ins[0]) * ins[1]]
    if op == "swiglu_backward":
        g, gate, up = ins
        return [A.silu_backward(g * up, gate), g * A.silu(gate)]
    raise AssertionError(op)


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
        raise AssertionError(f"{what} ({dtype}): {int(wrong.sum())} NaN/inf mismatches; first at "
                             + "; ".join(f"{tuple(i)}: out={o[tuple(i)].item()!r} ref={ref[tuple(i)].item()!r}"
                                         for i in idx))
    rtol, atol = TOL[dtype]
    err = (o[fin] - ref[fin]).abs()
    tol = atol + rtol * (ref[fin].abs() + torch.nan_to_num(scale[fin], posinf=0.0))
    bad = ~(err <= tol)
    if bad.any():
        i = bad.nonzero()[0].item()
        raise AssertionError(f"{what} ({dtype}): {int(bad.sum())}/{err.numel()} elements out of tolerance; first: "
                             f"out={o[fin][i].item()!r} ref={ref[fin][i].item()!r} tol={tol[i].item():.3g}")


def check_same(out, ref, dtype, what):
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.cpu(), ref.cpu(), rtol=rtol, atol=max(atol, 1e-12), equal_nan=True,
                               msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------- random inputs
LAYOUTS = ["contiguous", "offset", "padded_rows", "transposed", "step", "expanded", "leading_slice"]


def _values(shape, dtype, gen, specials, big):
    """Random values (never all zeros) rounded to dtype; `specials` sprinkles NaN/+-inf, `big` widens the range."""
    v = torch.randn(shape, generator=gen, dtype=torch.float64) * (6.0 if big else 1.5)
    v = v.clamp(-30.0, 30.0)  # keeps float16 products (grad * up * silu') finite
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
        return vals(shape[:-1] + [shape[-1] + 3])[..., 1:shape[-1] + 1]
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
def run_unary(data, device, count_key):
    op = data.draw(st.sampled_from(["gelu", "silu"]), label="op")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    shape = data.draw(shapes(max_last=80 if device == "cuda" else 40), label="shape")
    lx, lg = (data.draw(st.sampled_from(LAYOUTS), label=f"layout_{n}") for n in ("x", "grad"))
    specials = data.draw(st.integers(0, 3), label="specials") == 0
    big = data.draw(st.booleans(), label="big")
    via_api = data.draw(st.integers(0, 3), label="via_api") == 0
    gen = _gen(_seed(data))
    x = make(shape, dtype, lx, gen, device, specials, big)
    grad = make(shape, dtype, lg, gen, device, specials and data.draw(st.booleans(), label="grad_specials"))
    bwd = op + "_backward"

    if via_api:  # public API + autograd (calls the backward op)
        x = x.detach().clone().requires_grad_(True)  # clone: contiguous leaf with the same values
        y = getattr(ffn_ext, op)(x)
        y.backward(grad)
        outs = {op: [y.detach()], bwd: [x.grad]}
        x = x.detach()
    else:
        outs = {op: [getattr(OPS, op)(x)], bwd: [getattr(OPS, bwd)(grad, x)]}
    _compare(outs, {op: [x], bwd: [grad, x]}, dtype, device, specials, contiguous=not via_api)
    CASES[count_key] += 1


def run_swiglu(data, device, count_key):
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    shape = data.draw(shapes(max_last=80 if device == "cuda" else 40), label="shape")
    specials = data.draw(st.integers(0, 3), label="specials") == 0
    big = data.draw(st.booleans(), label="big")
    gen = _gen(_seed(data))
    if data.draw(st.booleans(), label="chunked") and shape:  # gate, up = gate_up.chunk(2, -1): row stride 2M
        lgu = data.draw(st.sampled_from(LAYOUTS), label="layout_gate_up")
        gate, up = make(shape[:-1] + [2 * shape[-1]], dtype, lgu, gen, device, specials, big).chunk(2, -1)
    else:
        lga, lup = (data.draw(st.sampled_from(LAYOUTS), label=f"layout_{n}") for n in ("gate", "up"))
        gate = make(shape, dtype, lga, gen, device, specials, big)
        up = make(shape, dtype, lup, gen, device, specials)
    grad = make(shape, dtype, data.draw(st.sampled_from(LAYOUTS), label="layout_grad"), gen, device)
    via_api = data.draw(st.integers(0, 3), label="via_api") == 0
    if via_api:
        g, u = gate.detach().clone().requires_grad_(True), up.detach().clone().requires_grad_(True)
        h = ffn_ext.swiglu(g, u)
        h.backward(grad)
        outs = {"swiglu": [h.detach()], "swiglu_backward": [g.grad, u.grad]}
        gate, up = g.detach(), u.detach()  # ATen's CPU results can depend on the layout: compare on what ran
    else:
        outs = {"swiglu": [OPS.swiglu(gate, up)], "swiglu_backward": list(OPS.swiglu_backward(grad, gate, up))}
    _compare(outs, {"swiglu": [gate, up], "swiglu_backward": [grad, gate, up]}, dtype, device, specials,
             contiguous=not via_api)  # autograd's .grad takes the leaf's strides
    CASES[count_key] += 1


def run_packed(data, device, count_key):
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    shape = data.draw(shapes(min_dims=1, max_last=80 if device == "cuda" else 40, even_last=True), label="shape")
    specials = data.draw(st.integers(0, 3), label="specials") == 0
    big = data.draw(st.booleans(), label="big")
    gen = _gen(_seed(data))
    lgu, lg = (data.draw(st.sampled_from(LAYOUTS), label=f"layout_{n}") for n in ("gate_up", "grad"))
    gate_up = make(shape, dtype, lgu, gen, device, specials, big)
    m = shape[-1] // 2
    grad = make(shape[:-1] + [m], dtype, lg, gen, device)
    via_api = data.draw(st.integers(0, 3), label="via_api") == 0
    if via_api:
        gu = gate_up.detach().clone().requires_grad_(True)
        h = ffn_ext.swiglu_packed(gu)
        h.backward(grad)
        h, dgu, gate_up = h.detach(), gu.grad, gu.detach()
    else:
        h, dgu = OPS.swiglu_packed(gate_up), OPS.swiglu_packed_backward(grad, gate_up)
    assert h.shape == tuple(shape[:-1] + [m]) and dgu.shape == gate_up.shape
    gate, up = gate_up.chunk(2, -1)
    dgate, dup = dgu.chunk(2, -1)
    # compare the packed results as the swiglu ones (the chunks of a contiguous result are fine to compare)
    if not via_api:
        assert dgu.is_contiguous()
    outs = {"swiglu": [h], "swiglu_backward": [dgate.contiguous(), dup.contiguous()]}
    _compare(outs, {"swiglu": [gate, up], "swiglu_backward": [grad, gate, up]}, dtype, device, specials)
    CASES[count_key] += 1


def _compare(outs, inputs, dtype, device, specials, contiguous=True):
    for op, got in outs.items():
        ins = inputs[op]
        if specials and device == "cpu":  # ATen semantics on the CPU path
            # ATen's non-finite results depend on the loop ATen picks for the layout (vectorized or scalar: NaN or
            # the limit for gelu(+-inf) in float32), elementwise, so each element may match ATen on the same
            # strided inputs, ATen on contiguous copies, or the mathematical limit.
            refs, scales, _ = reference(op, [t.double() for t in ins], _opmath(dtype))
            cands = [aten_same_dtype(op, ins), aten_same_dtype(op, [t.contiguous() for t in ins]), refs]
            rtol, atol = TOL[dtype]
            for k, o in enumerate(got):
                o64 = o.cpu().double()
                tol = atol + rtol * torch.nan_to_num(scales[k].cpu(), nan=0.0, posinf=0.0)
                ok = torch.zeros_like(o64, dtype=torch.bool)
                for c in cands:
                    c64 = c[k].cpu().double()
                    ok |= (o64 - c64).abs() <= tol + rtol * c64.abs()
                    ok |= (o64 == c64) | (o64.isnan() & c64.isnan())
                assert bool(ok.all()), (f"{op}[{k}] ({dtype}) vs ATen/limits: {int((~ok).sum())} elements differ; "
                                        f"out={o64[~ok][:5].tolist()} aten={cands[0][k].double()[~ok][:5].tolist()}")
            continue
        refs, scales, eithers = reference(op, [t.double() for t in ins], _opmath(dtype))
        for k, (o, r, s, e) in enumerate(zip(got, refs, scales, eithers)):
            check_close(o, r, s, dtype, f"{op}[{k}] on {device}", contiguous, e)


# ---------------------------------------------------------------- the tests
SETTINGS = dict(deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow,
                                                                          HealthCheck.data_too_large])
# CPU: about 10,600 cases in all (the sum of these max_examples), ~2 minutes on 2 cores.
# FFN_EXT_FUZZ_SCALE multiplies every count (e.g. 0.1 for a quick run, 10 for a long one).
_SCALE = float(os.environ.get("FFN_EXT_FUZZ_SCALE", "1"))
N_UNARY, N_SWIGLU, N_PACKED, N_HOST = (max(1, int(n * _SCALE)) for n in (3400, 2800, 2800, 1600))
N_CUDA = max(1, int(600 * _SCALE))


@settings(max_examples=N_UNARY, **SETTINGS)
@given(data=st.data())
def test_fuzz_unary_cpu(data):
    run_unary(data, "cpu", "unary_cpu")


@settings(max_examples=N_SWIGLU, **SETTINGS)
@given(data=st.data())
def test_fuzz_swiglu_cpu(data):
    run_swiglu(data, "cpu", "swiglu_cpu")


@settings(max_examples=N_PACKED, **SETTINGS)
@given(data=st.data())
def test_fuzz_swiglu_packed_cpu(data):
    run_packed(data, "cpu", "packed_cpu")


HOST_OPS = {"gelu": 1, "gelu_backward": 2, "silu": 1, "silu_backward": 2, "swiglu": 2, "swiglu_backward": 3}


@pytest.mark.skipif(not HOST_MATH, reason="needs the native library (ffn_ext._C._host_math)")
@settings(max_examples=N_HOST, **SETTINGS)
@given(data=st.data())
def test_fuzz_host_math_limits(data):
    """The CUDA kernels' element math, run on the host: float64 reference with the documented limits at +-inf."""
    op = data.draw(st.sampled_from(sorted(HOST_OPS)), label="op")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    shape = data.draw(shapes(max_last=64), label="shape")
    specials = data.draw(st.booleans(), label="specials")
    gen = _gen(_seed(data))
    ins = [make(shape, dtype, "contiguous", gen, "cpu", specials, big=(i > 0)) for i in range(HOST_OPS[op])]
    got = ffn_ext.ops._native._host_math(op, ins)
    refs, scales, eithers = reference(op, [t.double() for t in ins], _opmath(dtype))
    for k, (o, r, s, e) in enumerate(zip(got, refs, scales, eithers)):
        check_close(o, r, s, dtype, f"_host_math {op}[{k}]", either=e)
    CASES["host_math"] += 1


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU and the ffn_ext CUDA kernels")
@settings(max_examples=N_CUDA, **SETTINGS)
@given(data=st.data())
def test_fuzz_unary_cuda(data):
    run_unary(data, "cuda", "unary_cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU and the ffn_ext CUDA kernels")
@settings(max_examples=N_CUDA, **SETTINGS)
@given(data=st.data())
def test_fuzz_swiglu_cuda(data):
    run_swiglu(data, "cuda", "swiglu_cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU and the ffn_ext CUDA kernels")
@settings(max_examples=N_CUDA, **SETTINGS)
@given(data=st.data())
def test_fuzz_swiglu_packed_cuda(data):
    run_packed(data, "cuda", "packed_cuda")


def test_fuzz_case_count(capsys):
    """Runs last in this file: prints how many fuzz cases ran (and fails if the CPU tests ran short)."""
    total = sum(CASES.values())
    with capsys.disabled():
        print(f"\n[ffn_ext fuzz] {total} cases in {time.perf_counter() - _START:.1f} s: "
              + ", ".join(f"{k}={v}" for k, v in sorted(CASES.items())))
    cpu = sum(v for k, v in CASES.items() if k.endswith("_cpu"))
    if {"unary_cpu", "swiglu_cpu", "packed_cpu"} <= set(CASES):  # all CPU fuzz tests ran in this session
        assert cpu >= 0.95 * (N_UNARY + N_SWIGLU + N_PACKED), CASES
