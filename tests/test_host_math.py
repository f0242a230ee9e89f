"""The CUDA kernels' element math, checked on the CPU, for every op of the table (tests/optable.py) but the packed
ones (their element math is the gated ops'; tests/test_launcher_emulation.py runs them).

_host_math(op, inputs) of the tests' host-code extension (tests/native.py) runs the functors of csrc/ffn_math.h (the
code the CUDA kernels run) on the host, with the kernels' rounding: load the storage type, compute in the accumulation
type A (float for float16/bfloat16/float32, double for float64), store once. Here it is compared element by element with
the fp64 reference of the table (act.ref: the mathematical definitions, e.g. erfc-based GELU, so that the reference
itself does not cancel for negative x), over random inputs from ordinary to extreme magnitudes, and with the documented
limits at +-inf and NaN propagation.

Tolerance per element:  0.5 * spacing of the storage type at the reference value   (rounding once)
                      + K * eps(A) * (|ref| + S)                                     (the float/double math)
                      + TINY(A) * M                                                  (exp underflow in A)
                      + K * smallest subnormal of A                                  (math on subnormals)
where S is the size of the terms that cancel in the formula the kernels use (the table's act.cancel, e.g. |x| for
GELU at negative x, whose 1 + erf(x/sqrt(2)) cancels; and for a gated op with parameters, whose activation argument
is computed, alpha * clamp(gate), the error its rounding carries: optable.limit_terms) and M the factor multiplying
the activation value (grad, up). A kernel that rounded twice (e.g. silu(gate) to bfloat16 before the product) would
miss the 0.5-spacing bound on a good share of the elements. Gated ops with parameters run with the table's example
values (optable.host_params) and get inputs at their clamp bounds.
"""

from __future__ import annotations

import math
import zlib

import native
import pytest
import torch
from optable import (
    ACTIVATIONS,
    HOST_OPS,
    N_INPUTS,
    N_OUTPUTS,
    activation_arg,
    call,
    host_params,
    limit_terms,
    ops_of,
    params_of,
    spec,
)

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
OPS = HOST_OPS  # unary and gated ops, forward and backward
UNARY = ops_of(kind="unary")  # with their backward ops
INV_SQRT2 = 1.0 / math.sqrt(2.0)
INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
K = 4  # ulps of A allowed for the math in A (measured worst: about 2.1; erf/exp are within 2 ulp)
TINY = {torch.float32: 1e-35, torch.float64: 1e-300}  # exp(-x) overflows in A: x * sigmoid(x) is lost below this
ACT_IDS = [a.name for a in ACTIVATIONS]


def acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------- fp64 reference, with the documented limits
def act_value(act, x):
    """act(x) in float64 with the limits at +-inf (the table's act.ref)."""
    return act.ref(x)[0]


def reference(op, ins):
    """fp64 inputs -> [(fp64 output, cancellation scale S, factor M multiplying the function value)], one per
    output, from the table's act.ref (value, derivative) and act.cancel (S of the value, of the derivative), with
    a gated op's masks (optable.limit_terms)."""
    return limit_terms(op, ins)


def host_math(op, ins, dtype):
    outs = native.testing()._host_math(op, [t.to(dtype) for t in ins], host_params(op))
    assert len(outs) == N_OUTPUTS[op]
    for o in outs:
        assert o.dtype == dtype and o.shape == ins[0].shape
    return outs


def spacing(v, dtype):
    """Distance between neighbouring values of `dtype` around |v| (fp64 tensor), subnormals included."""
    fi = torch.finfo(dtype)
    a = v.abs().clamp(min=fi.tiny)
    e = torch.floor(torch.log2(a))
    return torch.clamp(torch.exp2(e) * fi.eps, min=fi.tiny * fi.eps)


def check(op, ins64, dtype, what="", outs=None):
    """ins64: fp64 tensors holding values exactly representable in `dtype`. outs: the results to check (default:
    the host math's). Returns the allowed error of each output, elementwise."""
    tols = []
    if outs is None:
        outs = host_math(op, ins64, dtype)
    a = acc_dtype(dtype)
    eps_a = torch.finfo(a).eps
    for k, (y, (ref, s, m)) in enumerate(zip(outs, reference(op, ins64))):
        y = y.double().cpu()
        stored = ref.to(dtype).double()  # the reference rounded to storage: says where it overflows
        name = f"{op}[{k}] {dtype} {what}"
        nan_ref = torch.isnan(ref)
        assert torch.equal(torch.isnan(y), nan_ref), (
            f"{name}: NaN where the reference is not (or the reverse) at inputs "
            f"{[t[torch.isnan(y) ^ nan_ref][:5].tolist() for t in ins64]}"
        )
        inf_ref = torch.isinf(stored)
        bad = torch.isinf(y) != inf_ref
        bad |= inf_ref & (y != stored)
        assert not bad.any(), (
            f"{name}: infinities differ: got {y[bad][:5].tolist()}, reference "
            f"{ref[bad][:5].tolist()} at inputs {[t[bad][:5].tolist() for t in ins64]}"
        )
        fin = ~(nan_ref | inf_ref)
        err = (y - ref).abs()[fin]
        fa = torch.finfo(a)
        # each operation on subnormals of A may be off by half of the smallest, and a subnormal product of the
        # factors (grad * up) is then multiplied by the activation's value or derivative, |ref| / M of it
        amp = torch.nan_to_num(ref.abs() / m.clamp(min=torch.finfo(torch.float64).tiny), nan=0.0, posinf=0.0)
        tol = 0.5 * spacing(ref, dtype) + K * eps_a * (ref.abs() + s) + TINY[a] * m + K * fa.tiny * fa.eps * (1 + amp)
        tols.append(tol)
        tol = tol[fin]
        over = err > tol
        if over.any():
            i = torch.nonzero(over)[:5, 0]
            raise AssertionError(
                f"{name}: {int(over.sum())} of {int(fin.sum())} elements off by more than the tolerance; worst "
                f"err/tol = {float((err / tol).max()):.3g}; examples: got {y[fin][i].tolist()}, reference "
                f"{ref[fin][i].tolist()}, inputs {[t[fin][i].tolist() for t in ins64]}"
            )
    return tols


# ---------------------------------------------------------------- inputs
def representable(x64, dtype):
    """Round fp64 values to `dtype` and back, so the reference sees exactly the kernel's inputs."""
    return x64.to(dtype).double()


def value_mix(n, dtype, gen):
    """Ordinary values, both sigmoid tails, large and tiny magnitudes, exact zeros (a few), shuffled."""
    fi = torch.finfo(dtype)
    parts = [
        torch.randn(n, generator=gen, dtype=torch.float64) * 4,  # the bulk
        (torch.rand(n // 4, generator=gen, dtype=torch.float64) * 2 - 1) * 12,  # the curved part
        (torch.rand(n // 4, generator=gen, dtype=torch.float64) * 2 - 1) * 50,
        (torch.rand(n // 4, generator=gen, dtype=torch.float64) * 2 - 1) * 100,  # float sigmoid tails
        -80.0 - torch.rand(n // 8, generator=gen, dtype=torch.float64) * 30,  # exp(-x) overflows in float
        torch.randn(n // 8, generator=gen, dtype=torch.float64) * 1e-3,
        torch.randn(n // 8, generator=gen, dtype=torch.float64) * fi.tiny * 64,  # subnormal / tiny
        torch.tensor([0.0, -0.0, 1.0, -1.0, -1.2784645427610738, 0.5, -0.5], dtype=torch.float64),
    ]
    if dtype == torch.float64:
        parts.append(-700.0 - torch.rand(n // 8, generator=gen, dtype=torch.float64) * 50)  # double exp overflow
    x = torch.cat(parts)
    x = x[torch.randperm(x.numel(), generator=gen)]
    return representable(x, dtype)


def grad_like(n, dtype, gen):
    g = torch.randn(n, generator=gen, dtype=torch.float64) * 2
    g = torch.where(g.abs() < 1e-3, torch.full_like(g, 0.25), g)
    return representable(g, dtype)


def at_bounds(op, ins, dtype):
    """An op with a clamp bound (a `limit` parameter): gate and up get +-limit and its neighbours in the dtype's
    grid ahead of their random values, in every pairing (the clamps' gradients at and next to the bound)."""
    limit = params_of(op).get("limit")
    if limit is None:
        return ins
    ins = [t.clone() for t in ins]
    names = spec(op).args
    g, u = names.index("gate"), names.index("up")
    vals = torch.tensor([limit, -limit], dtype=dtype)
    vals = torch.cat(
        [
            vals,
            torch.nextafter(vals, vals * 2),
            torch.nextafter(vals, torch.zeros_like(vals)),
            torch.tensor([0.0, 1.0], dtype=dtype),
        ]
    ).double()
    a, b = torch.meshgrid(vals, vals, indexing="ij")
    k = a.numel()
    ins[g][:k], ins[u][:k] = a.reshape(-1), b.reshape(-1)
    return ins


def make_inputs(op, dtype, gen):
    """x (or gate) from value_mix, grad from grad_like, up from value_mix clamped to +-1e3; at_bounds."""
    x = value_mix(4000, dtype, gen)
    n = x.numel()
    ins = []
    for name in spec(op).args:
        if name in ("x", "gate"):
            ins.append(x)
        elif name == "grad":
            ins.append(grad_like(n, dtype, gen))
        else:  # up
            up = value_mix(4000, dtype, gen)[:n]
            up = (
                torch.cat([up, torch.randn(n - up.numel(), generator=gen, dtype=torch.float64)])
                if up.numel() < n
                else up
            )
            ins.append(representable(up.clamp(-1e3, 1e3), dtype))  # keep act(gate) * up inside float16's range
    return at_bounds(op, ins, dtype)


# ---------------------------------------------------------------- tests
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("op", OPS)
def test_host_math_matches_fp64_reference(op, dtype):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{op} {dtype}".encode()))
    for rep in range(2):
        check(op, make_inputs(op, dtype, gen), dtype, f"(random set {rep})")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("op", OPS)
def test_host_math_dense_grid(op, dtype):
    """Every value on a fine grid over [-12, 12] (where the curves bend and the derivatives' zeros sit)."""
    x = representable(torch.linspace(-12, 12, 24001, dtype=torch.float64), dtype).unique()
    gen = torch.Generator().manual_seed(7)
    ins = [
        representable(torch.randn(x.numel(), generator=gen, dtype=torch.float64) * 3 + 0.1, dtype)
        for _ in range(N_INPUTS[op])
    ]
    ins[activation_arg(op)] = x
    check(op, ins, dtype, "(grid)")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_huge_finite_inputs(dtype):
    """Magnitudes up to the dtype's maximum: no spurious NaN from inf * 0 inside the formulas."""
    fi = torch.finfo(dtype)
    big = torch.tensor([fi.max, fi.max / 3, 1e4, 6e4, 1e30, 1e300], dtype=torch.float64)
    big = representable(big[big <= fi.max], dtype)
    x = torch.cat([big, -big])
    one = torch.ones_like(x)
    for op in OPS:  # the activation's argument huge, grad 0.5, up 0.75
        ins = [one * (0.5 if name == "grad" else 0.75) for name in spec(op).args]
        ins[activation_arg(op)] = x
        check(op, ins, dtype, "(huge)")


def every_16bit_value(dtype):
    """All 65536 bit patterns of float16 or bfloat16 (NaNs, infinities and subnormals included), as fp64."""
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype).double()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("op", UNARY)
def test_every_16bit_input(op, dtype):
    """Exhaustive over the activation's input: 16-bit GELU runs its own tail formula (not erff), and every
    activation its own fast-math path, so every value it can be given is checked, and at least 99.9% of the
    forward results must be the correctly rounded value."""
    x = every_16bit_value(dtype)
    if spec(op).backward:
        gen = torch.Generator().manual_seed(11)
        check(op, [grad_like(x.numel(), dtype, gen), x], dtype, "(every value)")
        check(op, [torch.ones_like(x), x], dtype, "(every value, grad 1)")
        return
    outs = host_math(op, [x], dtype)
    check(op, [x], dtype, "(every value)", outs=outs)
    (y,) = outs
    ref = act_value(spec(op).act, x)
    fin = torch.isfinite(ref)
    exact = (y.double() == ref.to(dtype).double())[fin].double().mean()
    assert exact > 0.999, f"{op} {dtype}: only {exact:.4%} of results are the correctly rounded value"


def test_gelu_tail_coefficients_are_the_fit():
    """The polynomial in ffn_math.h's gelu_tail is what csrc/fit_gelu_tail.py produces, and (in float64) keeps the
    normal tail's relative error within the 9.4e-8 its comment states, over the whole range that matters."""
    import importlib.util
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parent.parent
    if not (root / "csrc" / "fit_gelu_tail.py").is_file():
        pytest.skip("needs the source checkout's csrc/fit_gelu_tail.py (tests run outside it)")
    header = (root / "csrc" / "ffn_math.h").read_text()
    body = header[header.index("FFN_HD GeluTail gelu_tail(") :]
    k = float(re.search(r"kK = ([0-9.e+-]+)f;", body).group(1))
    c = [
        float(v)
        for v in re.findall(r"(-?[0-9.]+(?:e[+-]?[0-9]+)?)f", re.search(r"c\[8\] = \{([^}]*)\}", body).group(1))
    ]
    mod_spec = importlib.util.spec_from_file_location("fit_gelu_tail", root / "csrc" / "fit_gelu_tail.py")
    fit = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(fit)
    assert k == fit.K and len(c) == fit.DEGREE + 1
    c_fit, err_fit = fit.fit(iterations=100)
    assert err_fit < 1.2e-7
    assert max(abs(a - b) for a, b in zip(c, c_fit.tolist())) < 1e-4  # the same minimax polynomial
    a = torch.linspace(0, 13.5, 200001, dtype=torch.float64)
    u = 1 / (1 + k * a)
    r = sum(ci * u**i for i, ci in enumerate(c))
    q = u * r * torch.exp(-0.5 * a * a) * INV_SQRT_2PI
    q_ref = 0.5 * torch.special.erfc(a * INV_SQRT2)
    assert float(((q - q_ref) / q_ref).abs().max()) < 1.2e-7


def _bits_negative_zero(t):
    return bool(((t == 0) & torch.signbit(t)).all())


def _same(got, want):
    """Equal values, signed zeros included (-0 is not +0 here: gelu(-inf) = -0, relu(-inf) = +0)."""
    return got == want and math.copysign(1.0, got) == math.copysign(1.0, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("act", ACTIVATIONS, ids=ACT_IDS)
def test_documented_limits_at_infinity_and_nan(act, dtype):
    """Each activation's limits at -inf and +inf are its table entry's (act.limits: act(-inf), act(+inf),
    act'(-inf), act'(+inf)), in its ops, its backward and its gated ops; NaN propagates."""
    inf, nan = math.inf, math.nan
    f_ninf, f_pinf, d_ninf, d_pinf = act.limits
    x = torch.tensor([inf, -inf, nan], dtype=dtype)

    (y,) = native.testing()._host_math(act.name, [x])
    assert _same(y[0].item(), f_pinf) and _same(y[1].item(), f_ninf) and math.isnan(y[2].item()), y

    g = torch.tensor([1.5, 1.5, 1.5], dtype=dtype)
    (y,) = native.testing()._host_math(act.name + "_backward", [g, x])
    assert y[0].item() == 1.5 * d_pinf and y[1].item() == 1.5 * d_ninf and math.isnan(y[2].item()), y
    (y,) = native.testing()._host_math(
        act.name + "_backward", [torch.tensor([nan, 2.0], dtype=dtype), torch.tensor([0.0, nan], dtype=dtype)]
    )
    assert torch.isnan(y).all(), y

    up = torch.tensor([2.0, 2.0, 2.0], dtype=dtype)
    (h,) = native.testing()._host_math(act.gated, [x, up])
    assert h[0].item() == 2 * f_pinf and h[1].item() == 2 * f_ninf and math.isnan(h[2].item()), h
    # an infinite up times a finite nonzero act(gate): an infinity of act(gate)'s sign; NaN propagates
    gate = torch.tensor([1.0, -1.0, 0.5], dtype=dtype)
    (h,) = native.testing()._host_math(act.gated, [gate, torch.tensor([inf, inf, nan], dtype=dtype)])
    want = act_value(act, gate.double()) * torch.tensor([inf, inf, nan], dtype=torch.float64)
    assert torch.equal(h.double().nan_to_num(0.5), want.nan_to_num(0.5)), (h, want)
    dgate, dup = native.testing()._host_math(act.gated + "_backward", [g, x, up])
    assert dgate[0].item() == 3 * d_pinf and dgate[1].item() == 3 * d_ninf and math.isnan(dgate[2].item()), dgate
    assert dup[0].item() == 1.5 * f_pinf and dup[1].item() == 1.5 * f_ninf and math.isnan(dup[2].item()), dup


@pytest.mark.parametrize("act", ACTIVATIONS, ids=ACT_IDS)
def test_backward_product_is_finite_where_it_is(act):
    """grad * act'(x) for float32 x near the largest finite value and grad < 1: finite for every activation, also
    where act'(x) itself overflows (an unbounded derivative, act.bounded_derivative False: relu2' = 2x overflows for
    x > max / 2), in the unary backward and in the gated backward's dgate = grad * up * act'(gate). (float32: the
    fp64 reference holds the product; 16-bit storage computes in float, where it cannot overflow.)"""
    dtype = torch.float32
    big = torch.finfo(dtype).max
    x = torch.tensor([0.75 * big, 0.6 * big, -0.75 * big], dtype=dtype)
    g = torch.tensor([0.25, 0.5, 0.25], dtype=dtype)
    want = g.double() * act.ref(x.double())[1]
    assert want.isfinite().all(), want
    if not act.bounded_derivative:  # the case the functor's bwd exists for: act' alone is not finite here
        assert not act.ref(x.double())[1].to(dtype).isfinite().all()
    (y,) = native.testing()._host_math(act.name + "_backward", [g, x])
    torch.testing.assert_close(y.double(), want, rtol=4 * torch.finfo(dtype).eps, atol=0)
    dgate, _ = native.testing()._host_math(act.gated + "_backward", [g, x, torch.full_like(x, 0.5)])
    torch.testing.assert_close(dgate.double(), 0.5 * want, rtol=4 * torch.finfo(dtype).eps, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_specials_in_every_combination(dtype):
    """Every pairing of {+-inf, NaN, +-0, +-1, +-5} in every input position against the reference limits. (Not
    larger finite values: there an activation derivative that underflows to 0 in float meets an infinite grad and
    gives NaN where the fp64 reference, whose derivative is still nonzero, gives inf.)"""
    vals = torch.tensor([math.inf, -math.inf, math.nan, 0.0, -0.0, 1.0, -1.0, 5.0, -5.0], dtype=torch.float64)
    for op in OPS:
        n = N_INPUTS[op]
        grids = torch.meshgrid(*([vals] * n), indexing="ij")
        ins = [representable(t.reshape(-1), dtype) for t in grids]
        check(op, ins, dtype, "(specials)")


@pytest.mark.parametrize("act", ACTIVATIONS, ids=ACT_IDS)
def test_reference_matches_aten_float64(act):
    """The reference used above (act.ref) agrees with ATen (act.aten, act.aten_backward) in float64 (checks the
    checker, and that the table's two descriptions of the activation are the same function). ATen's formulas may
    cancel where the reference does not (the exact GELU's 1 + erf for negative x, the tanh GELU's 1 + tanh and
    1 - tanh^2, SiLU's derivative near its zero), so the allowed difference is a few ulps of the terms' size: |x|
    for the value, |grad| (1 + |x| + |x|^3) for the derivative, on top of the value's own ulps."""
    x = torch.cat([torch.randn(5000, dtype=torch.float64) * 4, torch.linspace(-30, 30, 1001, dtype=torch.float64)])
    g = torch.randn_like(x)
    eps = torch.finfo(torch.float64).eps
    f, d = act.ref(x)
    pairs = [
        ("value", f, act.aten(x), x.abs()),
        ("grad * derivative", g * d, act.aten_backward(g, x), g.abs() * (1 + x.abs() + x.abs() ** 3)),
    ]
    for what, ours, aten, scale in pairs:
        err = (ours - aten).abs()
        tol = 8 * eps * (ours.abs() + scale) + 1e-300
        assert (err <= tol).all(), (act.name, what, float((err / tol).max()), x[err > tol][:5].tolist())
    # and the two descriptions are not vacuous: the reference is not another activation's
    for other in ACTIVATIONS:
        if other is not act:
            assert not torch.allclose(other.ref(x)[0], f, rtol=1e-6, atol=0), (act.name, other.name)


def test_host_math_rejects_bad_calls():
    with pytest.raises(ValueError, match="unknown op"):
        native.testing()._host_math("tanh", [torch.ones(2)])
    for op in OPS:
        n, prm = N_INPUTS[op], host_params(op)
        with pytest.raises(ValueError, match=f"expected {n} inputs"):
            native.testing()._host_math(op, [torch.ones(2)] * (n - 1 if n > 1 else 2), prm)
        if n > 1:
            with pytest.raises(ValueError, match="one shape and dtype"):
                native.testing()._host_math(op, [torch.ones(2)] * (n - 1) + [torch.ones(3)], prm)
        # the params list: exactly the op's parameters ([] for the ops without)
        with pytest.raises(ValueError, match=f"{op} takes (no params|params \\[limit, alpha, up_offset\\])"):
            native.testing()._host_math(op, [torch.ones(2)] * n, prm + [1.0])
        if prm:
            with pytest.raises(ValueError, match=f"{op} takes params"):
                native.testing()._host_math(op, [torch.ones(2)] * n)
    for packed in ops_of(kind="packed"):  # not host-math ops: their element math is the gated op's
        with pytest.raises(ValueError, match="unknown op"):
            native.testing()._host_math(packed, [torch.ones(2)])


@pytest.mark.parametrize("act", ACTIVATIONS, ids=ACT_IDS)
def test_host_math_rounds_once_for_half_types(act):
    """A fused product rounded once is closer to fp64 than act(gate) rounded to bf16 and then multiplied:
    the host math must beat that two-rounding recipe on average, and never lose by more than the math error."""
    gen = torch.Generator().manual_seed(3)
    gate = representable(torch.randn(20000, generator=gen, dtype=torch.float64) * 3, torch.bfloat16)
    up = representable(torch.randn(20000, generator=gen, dtype=torch.float64) * 3, torch.bfloat16)
    (h,) = native.testing()._host_math(act.gated, [gate.bfloat16(), up.bfloat16()])
    ref = act_value(act, gate) * up
    twice = (act.aten(gate.bfloat16().float()).bfloat16().float() * up.float()).bfloat16().double()
    # where act(gate) is exact in bfloat16 (relu's everywhere) the two recipes are one: compare the others
    inexact = act.aten(gate.float()).bfloat16().float() != act.aten(gate.float())
    err_once = (h.double() - ref).abs()
    err_twice = (twice - ref).abs()
    assert (err_once <= err_twice + 1e-300)[~inexact].all()
    # (measured: 0.75 of the two-rounding error for SiLU, 0.86 for the GELUs, whose values are often exact in
    # bfloat16 already; rounding twice would give about 1)
    if inexact.sum() > 1000:
        assert err_once[inexact].mean() < 0.92 * err_twice[inexact].mean(), (err_once.mean(), err_twice.mean())
    correctly_rounded = (h.double() == ref.to(torch.bfloat16).double()).double().mean()
    assert correctly_rounded > 0.999, (
        f"only {correctly_rounded:.4%} of bfloat16 results are the correctly rounded value"
    )


# ---------------------------------------------------------------- the CUDA kernels themselves (GPU only)
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("op", OPS)
def test_cuda_kernels_match_reference_and_host_math(op, dtype):
    """The same inputs and tolerances through torch.ops.ffn_ext on the GPU (the device's erff/expf, and for 16-bit
    types its approximate reciprocal and exp2, differ from the host's in the last bits; the 16-bit unary ops also
    get every input value), plus the GPU results against the host math: within the two results' error
    allowances, so the host path tests the formulas the device runs. (Not
    'the same value or a neighbour': where a formula cancels, such as 1 + erf(x) for negative x or the sigmoid
    derivative near x = -1.28, last-bit differences of erf/exp grow by the cancellation, within the allowance.)"""
    gen = torch.Generator().manual_seed(zlib.crc32(f"cuda {op} {dtype}".encode()))
    vals = torch.tensor([math.inf, -math.inf, math.nan, 0.0, -0.0, 1.0, -1.0, 5.0, -5.0], dtype=torch.float64)
    specials = [representable(t.reshape(-1), dtype) for t in torch.meshgrid(*([vals] * N_INPUTS[op]), indexing="ij")]
    sets = [("random", make_inputs(op, dtype, gen)), ("specials", specials)]
    if op in UNARY and dtype in (torch.float16, torch.bfloat16):
        x = every_16bit_value(dtype)
        sets.append(("every value", [x] if not spec(op).backward else [grad_like(x.numel(), dtype, gen), x]))
    for what, ins in sets:
        outs = call(op)(*[t.to(dtype).cuda() for t in ins])
        outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        tols = check(op, ins, dtype, f"(CUDA, {what})", outs=[o.cpu() for o in outs])
        for k, (dev, host) in enumerate(zip(outs, host_math(op, ins, dtype))):
            dev, host = dev.cpu().double(), host.double()
            same = (dev == host) | (torch.isnan(dev) & torch.isnan(host))
            near = (dev - host).abs() <= 2 * tols[k]
            assert (same | near).all(), (
                f"{op}[{k}] {dtype} {what}: GPU and host math differ: GPU "
                f"{dev[~(same | near)][:5].tolist()}, host {host[~(same | near)][:5].tolist()}"
            )
