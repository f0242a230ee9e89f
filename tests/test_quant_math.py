"""ffn_math.h's FP8 element math (what the quantizing CUDA kernels run), on the host through ffn_ext._C's test
paths, bit for bit against torch's own casts: the float32 neighbourhood of every fp8 value and of every midpoint
between two (ties to even), subnormals, saturation and overflow, +-0, inf, NaN; and the scale of a group from its
amax against quant.py's reference formula (floor, FLT_MAX, NaN, pow2 rounding up)."""

from __future__ import annotations

import pytest
import torch

import ffn_ext
from ffn_ext import quant

_C = getattr(ffn_ext.ops._native, "_host_fp8", None) and ffn_ext.ops._native
pytestmark = pytest.mark.skipif(
    _C is None, reason="needs the native ffn_ext library with _host_fp8 (ffn_ext._C or a JIT build)"
)

FORMATS = {torch.float8_e4m3fn: "e4m3fn", torch.float8_e5m2: "e5m2"}


def neighbourhood(dtype) -> torch.Tensor:
    """float32 values around every fp8 value and every midpoint of two consecutive ones (+-4 ulps), both signs,
    plus zeros, the subnormal range, far beyond the largest value, inf and NaN."""
    codes = torch.arange(0, 128, dtype=torch.uint8)
    vals = codes.view(dtype).float()
    vals = vals[torch.isfinite(vals)]
    mids = (vals[1:].double() + vals[:-1].double()) / 2  # exact in float32 (fp8 has 2-3 mantissa bits)
    top = torch.tensor(
        [
            float(torch.finfo(dtype).max) * 1.0625,
            float(torch.finfo(dtype).max) * 1.125,
            float(torch.finfo(dtype).max) * 1.5,
            1e30,
            3.4e38,
        ]
    )
    base = torch.cat([vals, mids.float(), top]).view(torch.int32)
    near = (base[:, None] + torch.arange(-4, 5, dtype=torch.int32)).view(-1)
    near = near[near >= 0].view(torch.float32)
    tiny = torch.logspace(-45, -1, 2000, dtype=torch.float64).float()
    special = torch.tensor([0.0, float("inf"), float("nan"), 1e-45, 2.0**-149])
    x = torch.cat([near, tiny, special, torch.randn(20000) * 10.0 ** torch.randint(-8, 6, (20000,)).float()])
    return torch.cat([x, -x])


@pytest.mark.parametrize("dtype", list(FORMATS), ids=list(FORMATS.values()))
def test_fp8_conversion_matches_torch(dtype):
    x = neighbourhood(dtype)
    got = _C._host_fp8(x, FORMATS[dtype])
    want = x.to(dtype).view(torch.uint8)
    nan = torch.isnan(x)
    # within the rounding range (up to the midpoint past the largest finite value): torch's cast, bit for bit
    edge = 464.0 if dtype == torch.float8_e4m3fn else 61440.0  # (448 + 480) / 2, (57344 + 65536) / 2
    inside = ~nan & (x.abs() <= edge)
    assert torch.equal(got[inside], want[inside]), x[inside][got[inside] != want[inside]][:10]
    # past it: e4m3fn saturates, e5m2 is inf (torch 2.13's casts; another torch may give NaN there)
    out = ~nan & ~inside
    sat = 0x7E if dtype == torch.float8_e4m3fn else 0x7C
    assert torch.equal(got[out], torch.where(x[out] > 0, sat, sat | 0x80).to(torch.uint8))
    assert (got[nan] == 0x7F).all()  # the positive canonical NaN, whatever the input's sign (quant.py)


@pytest.mark.parametrize("dtype", list(FORMATS), ids=list(FORMATS.values()))
@pytest.mark.parametrize("pow2", [False, True])
def test_scale_matches_reference(dtype, pow2):
    amax = torch.cat(
        [
            torch.tensor([0.0, 1e-13, 1e-12, 2e-12, 1.0, 448.0, 3.4e38, float("inf"), float("nan")]),
            torch.rand(5000) * 10.0 ** torch.randint(-15, 30, (5000,)).float(),
        ]
    )
    fmax = quant.FP8_MAX[dtype]
    got = _C._host_quant_scale(amax, fmax, pow2)
    want = amax.clamp(quant.AMAX_FLOOR, quant.FLT_MAX) / fmax
    if pow2:
        want = quant._pow2_up(want)
    nan = torch.isnan(amax)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))
    assert torch.isnan(got[nan]).all() and torch.isfinite(got[~nan]).all() and (got[~nan] > 0).all()
    if pow2:  # powers of two, and e8m0 holds them exactly
        assert torch.equal(torch.frexp(got[~nan])[0], torch.full_like(got[~nan], 0.5))
        assert torch.equal(got[~nan].to(torch.float8_e8m0fnu).float(), got[~nan])
