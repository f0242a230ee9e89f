"""ffn_math.h's FP8 element math (what the quantizing CUDA kernels run), on the host through the tests' host-code
extension (tests/native.py), bit for bit against torch's own casts: the float32 neighbourhood of every fp8 value and of
every midpoint between two (ties to even), subnormals, saturation and overflow, +-0, inf, NaN; and the scale of a group
from its amax against quant.py's reference formula (floor, FLT_MAX, NaN, pow2 rounding up)."""

from __future__ import annotations

import native
import pytest
import torch

from ffn_ext import quant

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
    got = native.testing()._host_fp8(x, FORMATS[dtype])
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
    got = native.testing()._host_quant_scale(amax, fmax, pow2)
    want = amax.clamp(quant.AMAX_FLOOR, quant.FLT_MAX) / fmax
    if pow2:
        want = quant._pow2_up(want)
    nan = torch.isnan(amax)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))
    assert torch.isnan(got[nan]).all() and torch.isfinite(got[~nan]).all() and (got[~nan] > 0).all()
    if pow2:  # powers of two, and e8m0 holds them exactly
        assert torch.equal(torch.frexp(got[~nan])[0], torch.full_like(got[~nan], 0.5))
        assert torch.equal(got[~nan].to(torch.float8_e8m0fnu).float(), got[~nan])


# ---------------------------------------------------------------- the row and tensor kernels, emulated
# quant_kernel.h's row and tensor kernels run on the host by _emulate_quant block by block and thread by thread
# (the block's amax folded in the device's order; grids of at most 3 blocks, so the grid-stride loops and the
# dynamic amax's parts run more than once), bit for bit against quant.py's reference applied to the unfused CUDA
# kernel's h (its launch emulated too). The emulation poisons q and the scales first: an element or scale the
# kernels do not write fails.
# (rows, K) of h: one element; odd K (a short last lane, element loads, byte stores); K = 0; a K with 256 chunks
# (one per thread); K past 256 threads x kRowChunks x 8 = 8192 (sweep 2 recomputes h); odd row counts
ROW_SHAPES = [(1, 1), (7, 13), (5, 0), (3, 2048), (2, 8192), (3, 8192 + 8 * 5 + 3), (33, 264), (9, 1000)]


def _row_recipes():
    from test_quant import recipes

    return [r for r in recipes() if r.scaling in ("row", "tensor")]


def _rows_h(shape, dtype, gen, specials):
    """Rows over many magnitudes; with specials: row 0 all zero, row 1 with a NaN, row 2 with +inf and -inf."""
    rows, k = shape
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-20, 20, (rows, 1), generator=gen).float())
    if specials and k:
        x[0] = 0.0
        if rows > 1:
            x[1, int(torch.randint(0, k, (1,), generator=gen))] = float("nan")
        if rows > 2:
            x[2, 0], x[2, -1] = float("inf"), -float("inf")
    return x.to(dtype)


def _emu_kw(r):
    return dict(
        format=FORMATS[r.dtype],
        group_size=int(r.group_size),
        pow2=r.pow2_scales,
        e8m0=r.scale_dtype != torch.float32,
        column=r.scale_layout == "column",
        scaling=r.scaling,
        static_scale=None if r.static_scale is None else float(r.static_scale),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_row_and_tensor_kernels_emulated(dtype):
    from test_quant import FORMS, assert_same, rid

    gen = torch.Generator().manual_seed(7 + dtype.itemsize)
    recipes = _row_recipes()
    n = 0
    for trial, (name, g, packing) in enumerate(FORMS):
        params = [float(v) for v in g.example.values()] if g is not None else []
        for i, r in enumerate(recipes[trial % 2 :: 2]):
            shape = ROW_SHAPES[(trial + i) % len(ROW_SHAPES)]
            # a dynamic per-tensor scale with a NaN anywhere is NaN: specials only every other time there
            specials = r.scaling == "row" or r.static_scale is not None or (trial + i) % 2 == 0
            rows, k = shape
            if g is None:  # unaligned rows (element loads) every other time
                off = (trial + i) % 2
                x = _rows_h((rows, k + off), dtype, gen, specials)[:, off:]
                got = native.testing()._emulate_quant(name, [x], **_emu_kw(r))
                ref = quant.reference_quantize(x, r)
            elif packing is None:
                big = _rows_h((rows, 2 * k), dtype, gen, specials)
                gate, up = big[:, :k], big[:, k:]
                got = native.testing()._emulate_quant(name, [gate, up], params, **_emu_kw(r))
                h = native.testing()._emulate_cuda(g.name, [gate, up], params=params)[0]
                ref = quant.reference_quantize(h, r)
            else:
                gu = _rows_h((rows, 2 * k), dtype, gen, specials)
                got = native.testing()._emulate_quant(name, [gu], params, packing, **_emu_kw(r))
                h = native.testing()._emulate_cuda(g.name + "_packed", [gu], params=params, layout=packing)[0]
                ref = quant.reference_quantize(h, r)
            assert_same(tuple(got), ref, msg=f"{name} {packing} {rid(r)} {dtype} {shape}")
            n += 1
    assert n >= len(FORMS) * len(recipes) // 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", list(FORMATS), ids=list(FORMATS.values()))
def test_row_and_tensor_kernels_every_recipe(dtype, fmt):
    # every row/tensor recipe of both formats on 3-d and 0-d / 1-d shapes: the scale's layout ([..., 1] in row
    # or column layout, or []) and the rows' count from the leading dims
    from test_quant import assert_same, rid

    gen = torch.Generator().manual_seed(11)
    for r in _row_recipes():
        if r.dtype != fmt:
            continue
        shapes = [(2, 3, 40), (3, 0, 5), (17,)] + ([()] if r.scaling == "tensor" else [])
        for shape in shapes:
            x = torch.randn(shape, generator=gen) * 3.0
            if x.numel():
                x.view(-1)[0] = float("inf")
            x = x.to(dtype)
            got = native.testing()._emulate_quant("quantize", [x], **_emu_kw(r))
            assert_same(tuple(got), quant.reference_quantize(x, r), msg=f"{rid(r)} {dtype} {shape}")


def test_tensor_static_scale_edges():
    # static scales that pow2 rounds up, that round to float32's largest or smallest values, e8m0 of them
    from test_quant import assert_same

    x = (torch.randn(5, 24) * 100).to(torch.bfloat16)
    for s in (0.37, 1.0, 3.0e-39, 1e-30, 2.5e38, 7.0):
        for pow2, sdt in [(False, torch.float32), (True, torch.float32), (True, torch.float8_e8m0fnu)]:
            r = quant.QuantRecipe(torch.float8_e4m3fn, "tensor", 128, pow2, sdt, static_scale=s)
            got = native.testing()._emulate_quant("quantize", [x], **_emu_kw(r))
            assert_same(tuple(got), quant.reference_quantize(x, r), msg=f"static {s} pow2={pow2} {sdt}")


def test_emulate_quant_raises_what_the_cuda_kernels_raise():
    # the recipe's and inputs' guards are the CUDA glue's (quant_ops.h, quant_recipe.cpp): RuntimeErrors naming the
    # op (the functional API explains them with QuantRecipe's and the ops' checks); a bad call of the test function
    # is a ValueError of its own
    x = torch.randn(2, 128)
    with pytest.raises(RuntimeError, match=r"^ffn_ext\.quantize: not a recipe of ffn_ext\.QuantRecipe"):
        native.testing()._emulate_quant("quantize", [x], group_size=48)
    with pytest.raises(RuntimeError, match=r"^ffn_ext\.quantize: `group_size` must divide"):
        native.testing()._emulate_quant("quantize", [torch.randn(2, 96)])
    with pytest.raises(RuntimeError, match=r"^ffn_ext\.swiglu_packed_quant: `layout`"):
        native.testing()._emulate_quant("swiglu_packed_quant", [x], layout="bogus")
    with pytest.raises(RuntimeError, match=r"^ffn_ext\.quantize: .*float64"):
        native.testing()._emulate_quant("quantize", [x.double()])
    with pytest.raises(ValueError, match="unknown op"):
        native.testing()._emulate_quant("tanh_quant", [x])
    with pytest.raises(ValueError, match="takes 2 inputs"):
        native.testing()._emulate_quant("swiglu_quant", [x])
    with pytest.raises(ValueError, match="takes params"):
        native.testing()._emulate_quant("swiglu_clamped_quant", [x, x])
    with pytest.raises(ValueError, match="format"):
        native.testing()._emulate_quant("quantize", [x], format="e3m4")
