"""The quantizing ops (ffn_ext.quant): q and scale bit for bit equal to quant.py's reference formula applied to
ffn_ext's unfused output, on every recipe, fp8 dtype, scale layout and gated form of the table (separate, packed
in both layouts, strided), on fuzzed shapes with all-zero, NaN and inf groups; the recipe's and the inputs' errors;
opcheck (Meta kernels: fake tensors, compile, export)."""

from __future__ import annotations

import zlib

import native
import pytest
import torch
from optable import DEVICES, GATED, PACKINGS

import ffn_ext
from ffn_ext import quant
from ffn_ext.quant import QuantRecipe, reference_quantize

FP8 = tuple(quant.FP8_MAX)


def recipes(dtypes=FP8):
    """Every recipe family: dynamic and static per tensor, per row, per group of 32/64/128, each with float32 or
    power-of-two scales (float32 or e8m0), in row and column layout where a layout applies."""
    out = []
    for dt in dtypes:
        out += [
            QuantRecipe(dt, "tensor"),
            QuantRecipe(dt, "tensor", static_scale=0.37),
            QuantRecipe(dt, "tensor", pow2_scales=True, scale_dtype=torch.float8_e8m0fnu),
        ]
        for scaling, g in [("row", 128), ("group", 32), ("group", 64), ("group", 128)]:
            for pow2, sdt in [(False, torch.float32), (True, torch.float32), (True, torch.float8_e8m0fnu)]:
                for lay in ("row", "column"):
                    out.append(QuantRecipe(dt, scaling, g, pow2, sdt, lay))
    return out


def rid(r: QuantRecipe) -> str:
    dt = "e4m3" if r.dtype == torch.float8_e4m3fn else "e5m2"
    s = r.scaling + (str(r.group_size) if r.scaling == "group" else "") + ("-static" if r.static_scale else "")
    return (
        f"{dt}-{s}{'-pow2' if r.pow2_scales else ''}{'-e8m0' if r.scale_dtype != torch.float32 else ''}"
        f"{'-col' if r.scale_layout == 'column' else ''}"
    )


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def assert_same(actual, expected, msg=""):
    (q, s), (eq, es) = actual, expected
    assert q.dtype == eq.dtype and s.dtype == es.dtype, msg
    assert q.shape == eq.shape and s.shape == es.shape, msg

    def layout(t):  # the strides that mean something: of dims longer than 1, in a non-empty tensor
        return [st for st, n in zip(t.stride(), t.shape) if n > 1] if t.numel() else []

    assert layout(s) == layout(es), f"{msg}: scale strides {s.stride()} != {es.stride()}"
    assert torch.equal(bits(q.cpu()), bits(eq.cpu())), f"{msg}: q differs"
    # scales bit for bit, except that a NaN scale's sign and payload are not defined (float arithmetic on another
    # device may give another NaN): NaN where the reference has NaN
    s, es = s.cpu(), es.cpu()
    nan = torch.isnan(es.float())
    assert torch.equal(torch.isnan(s.float()), nan), f"{msg}: NaN scales differ"
    assert torch.equal(bits(s)[~nan], bits(es)[~nan]), f"{msg}: scale differs"


def rand_h(shape, dtype, device, gen, specials=True):
    """Values over many magnitudes per group (so that groups get different scales), some groups all zero, some
    with NaN or +-inf."""
    x = torch.randn(shape, generator=gen, dtype=torch.float32)
    if len(shape):
        x = x * torch.exp2(torch.randint(-20, 20, shape[:-1] + (1,), generator=gen).float())
    if specials and x.numel() >= 8:
        flat = x.view(-1)
        n = flat.numel()
        i = torch.randint(0, n, (4,), generator=gen)
        flat[i[0]], flat[i[1]], flat[i[2]] = float("nan"), float("inf"), -float("inf")
        z = int(torch.randint(0, max(1, n - 32), (1,), generator=gen))
        flat[z : z + 32] = 0.0
    return x.to(dtype).to(device)


def _unfused(name, packing, params):
    if packing is None:
        return lambda g, u: getattr(torch.ops.ffn_ext, name)(g, u, **params)
    return lambda gu: getattr(torch.ops.ffn_ext, name + "_packed")(gu, **params, layout=packing)


def forms():
    """(op name, gated entry, packing): quantize (identity), each gated op separate and packed in each layout."""
    out = [("quantize", None, None)]
    for g in GATED:
        out.append((g.name + "_quant", g, None))
        out += [(g.name + "_packed_quant", g, p) for p in PACKINGS]
    return out


FORMS = forms()


def run_form(name, g, packing, recipe, shape, dtype, device, gen, strided=False):
    """(the op's (q, scale), the reference's) for inputs of h's shape `shape`."""
    kw = recipe.op_kwargs()
    params = g.example if g is not None else {}
    opf = getattr(torch.ops.ffn_ext, name)
    if dtype == torch.float64 and device == "cuda":  # the CUDA kernels refuse float64: the API takes the composite
        opf = ffn_ext._kernels.OP[name].cpu
    if g is None:
        x = rand_h(shape, dtype, device, gen)
        if strided:
            x = torch.cat([x, x], dim=-1)[..., ::2] if x.dim() else x
        return opf(x, **kw), reference_quantize(x, recipe)
    if packing is None:
        big = rand_h(shape[:-1] + (2 * shape[-1] + (3 if strided else 0),), dtype, device, gen)
        gate, up = big[..., : shape[-1]], big[..., -shape[-1] :]  # chunk views: rows strided, offsets apart
        if not strided:
            gate, up = gate.contiguous(), up.contiguous()
        h = _unfused(g.name, None, params)(gate, up)
        return opf(gate, up, **kw, **params), reference_quantize(h, recipe)
    gu = rand_h(shape[:-1] + (2 * shape[-1],), dtype, device, gen)
    if strided:
        gu = torch.cat([gu, gu], dim=0)[::2] if gu.dim() > 1 else gu
    h = _unfused(g.name, packing, params)(gu)
    return opf(gu, **kw, **params, layout=packing), reference_quantize(h, recipe)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", recipes(), ids=rid)
def test_recipes_bit_identical(recipe, device):
    # every recipe on every form, one odd shape each (7 rows, 3 groups of 128 / the group size), bf16
    gen = torch.Generator().manual_seed(zlib.crc32(rid(recipe).encode()))
    k = 3 * (recipe.group_size if recipe.scaling == "group" else 128)
    for name, g, packing in FORMS:
        assert_same(*run_form(name, g, packing, recipe, (7, k), torch.bfloat16, device, gen), msg=name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_fuzzed_shapes(dtype, device):
    # shapes: rows 0, 1, odd, 3-D leading dims; group counts 1..many; strided and packed inputs; specials
    gen = torch.Generator().manual_seed(1234 + dtype.itemsize)
    if dtype == torch.float64 and device == "cuda":
        # the stable CUDA kernels quantize float32/16 and bfloat16 only (the CUDA glue's guard: a RuntimeError);
        # the Python API computes float64 with the op's ATen composite, which run_form calls below
        x, r = torch.randn(3, 256, dtype=dtype, device=device), QuantRecipe()
        with pytest.raises(RuntimeError, match=r"^ffn_ext\.quantize: the CUDA kernels quantize float32"):
            torch.ops.ffn_ext.quantize(x, **r.op_kwargs())
        assert_same(ffn_ext.quantize(x, r), reference_quantize(x, r))
        assert_same(ffn_ext.swiglu_quant(x, x, r), reference_quantize(ffn_ext.swiglu(x, x), r))
    all_recipes = recipes()
    for trial in range(24):
        recipe = all_recipes[int(torch.randint(len(all_recipes), (1,), generator=gen))]
        gs = recipe.group_size if recipe.scaling == "group" else int(torch.randint(1, 300, (1,), generator=gen))
        n_groups = int(torch.randint(1, 18, (1,), generator=gen))
        lead = [(1,), (5,), (33,), (2, 3), (0,), (3, 1, 2)][trial % 6]
        shape = lead + (gs * n_groups if recipe.scaling == "group" else gs,)
        name, g, packing = FORMS[trial % len(FORMS)]
        got, ref = run_form(name, g, packing, recipe, shape, dtype, device, gen, strided=trial % 2 == 1)
        assert_same(got, ref, msg=f"{name} {rid(recipe)} {shape} {dtype}")


@pytest.mark.parametrize("device", DEVICES)
def test_formula_properties(device):
    # what the formula promises, on the reference and through the op: an all-zero group has q = 0 and a finite
    # positive scale; NaN propagates to its group's scale; inf saturates with a finite scale; |q| <= fp8_max;
    # pow2 scales are powers of two and >= the plain ones; dequantized values within half an fp8 step
    for dt in FP8:
        fmax = quant.FP8_MAX[dt]
        h = torch.randn(4, 256) * 3
        h[0] = 0
        h[1, 5] = float("nan")
        h[2, 130] = float("inf")
        h = h.to(device)
        r = QuantRecipe(dt, "group", 128)
        q, s = ffn_ext.quantize(h, r)
        assert torch.equal(q[0].float(), torch.zeros(256, device=device))
        assert torch.isfinite(s[0]).all() and (s[0] > 0).all()
        assert torch.isnan(s[1, 0]) and torch.isfinite(s[1, 1])
        assert torch.isfinite(s[2]).all() and q[2, 130].float() == fmax
        assert q.float().nan_to_num().abs().max() <= fmax
        deq = (q.float().view(4, 2, 128) * s[..., None]).view(4, 256)
        ok = torch.isfinite(h)
        ok[1, :128] = False
        ok[2, 128:] = False
        rel = 2.0**-3 if dt == torch.float8_e4m3fn else 2.0**-2  # half the spacing at the top binade, x2
        assert ((deq - h).abs()[ok] <= rel * h.abs()[ok] + s.repeat_interleave(128, -1)[ok] * 2.0**-9 * fmax).all()
        _, s2 = ffn_ext.quantize(h, QuantRecipe(dt, "group", 128, pow2_scales=True))
        fin = torch.isfinite(s2)
        assert torch.equal(torch.frexp(s2[fin])[0], torch.full_like(s2[fin], 0.5)) and (s2[fin] >= s[fin]).all()


def test_floor_and_static_scale():
    r = QuantRecipe(torch.float8_e4m3fn, "row")
    q, s = ffn_ext.quantize(torch.zeros(2, 8), r)
    assert torch.equal(s, torch.full((2, 1), torch.tensor(quant.AMAX_FLOOR, dtype=torch.float32).item() / 448))
    q, s = ffn_ext.quantize(
        torch.tensor([1.0, -2.0, 1000.0]), QuantRecipe(torch.float8_e4m3fn, "tensor", static_scale=0.5)
    )
    assert s.shape == () and s.item() == 0.5 and q.float().tolist() == [2.0, -4.0, 448.0]  # 2000 saturates


def test_python_api_matches_ops():
    gen = torch.Generator().manual_seed(7)
    gate, up = torch.randn(5, 256, generator=gen), torch.randn(5, 256, generator=gen)
    r = QuantRecipe(torch.float8_e5m2, "group", 64, pow2_scales=True, scale_dtype=torch.float8_e8m0fnu)
    assert_same(ffn_ext.swiglu_quant(gate, up, r), reference_quantize(ffn_ext.swiglu(gate, up), r))
    assert_same(
        ffn_ext.geglu_quant(gate, up, r, approximate="tanh"),
        reference_quantize(ffn_ext.geglu(gate, up, approximate="tanh"), r),
    )
    assert_same(ffn_ext.gated_quant(gate, up, r, activation="gelu"), reference_quantize(ffn_ext.geglu(gate, up), r))
    assert_same(
        ffn_ext.swiglu_clamped_quant(gate, up, r, limit=1.5, alpha=1.702, up_offset=1.0),
        reference_quantize(ffn_ext.swiglu_clamped(gate, up, limit=1.5, alpha=1.702, up_offset=1.0), r),
    )
    gu = torch.randn(5, 512, generator=gen)
    for layout in PACKINGS:
        assert_same(
            ffn_ext.gated_packed_quant(gu, r, activation="silu", layout=layout),
            reference_quantize(ffn_ext.swiglu_packed(gu, layout=layout), r),
        )
        assert_same(
            ffn_ext.gated_packed_quant(gu, r, activation="swiglu_clamped", layout=layout, limit=2.0),
            reference_quantize(ffn_ext.swiglu_clamped_packed(gu, limit=2.0, layout=layout), r),
        )
    q, s = ffn_ext.quantize(gate)  # the default recipe: e4m3, 1x128 groups, float32 scales
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 2) and s.dtype == torch.float32


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(dtype=torch.int8), "`dtype`"),
        (dict(dtype=torch.bfloat16), "`dtype`"),
        (dict(scaling="block"), "`scaling`"),
        (dict(group_size=0), "`group_size`"),
        (dict(group_size=100), "`group_size`"),
        (dict(scale_dtype=torch.float16), "`scale_dtype`"),
        (dict(scale_dtype=torch.float8_e8m0fnu), "pow2_scales"),
        (dict(scale_layout="swizzle"), "`scale_layout`"),
        (dict(scaling="tensor", scale_layout="column"), "`scale_layout`"),
        (dict(scaling="tensor", static_scale=0.0), "`static_scale`"),
        (dict(scaling="tensor", static_scale=-1.0), "`static_scale`"),
        (dict(scaling="tensor", static_scale=float("inf")), "`static_scale`"),
        (dict(scaling="tensor", static_scale=float("nan")), "`static_scale`"),
        (dict(scaling="row", static_scale=1.0), "`static_scale`"),
    ],
)
def test_recipe_errors(kwargs, match):
    # the same argument named by the recipe (Python) and by the ops (C++, called with the raw arguments)
    with pytest.raises((ValueError, TypeError), match=match):
        QuantRecipe(**kwargs)
    raw = dict(
        dtype=torch.float8_e4m3fn,
        scaling="group",
        group_size=128,
        pow2_scales=False,
        scale_dtype=torch.float32,
        scale_layout="row",
        static_scale=None,
    )
    raw.update(kwargs)
    with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
        torch.ops.ffn_ext.quantize(torch.randn(2, 128), **raw)


def test_input_errors():
    r = QuantRecipe()
    with pytest.raises(ValueError, match="`group_size`=128 must divide"):
        ffn_ext.quantize(torch.randn(3, 96), r)
    with pytest.raises(ValueError, match="`group_size`=128 must divide"):
        ffn_ext.swiglu_quant(torch.randn(3, 96), torch.randn(3, 96), r)
    with pytest.raises(ValueError, match="0-dim"):
        ffn_ext.quantize(torch.tensor(1.0), QuantRecipe(scaling="row"))
    with pytest.raises(TypeError, match="`x`"):
        ffn_ext.quantize(torch.ones(2, 128, dtype=torch.int32), r)
    with pytest.raises(ValueError, match="`up`"):
        ffn_ext.swiglu_quant(torch.randn(2, 128), torch.randn(2, 256), r)
    with pytest.raises(ValueError, match="`layout`"):
        ffn_ext.gated_packed_quant(torch.randn(2, 256), r, layout="zip")
    with pytest.raises(ValueError, match="`limit`"):
        ffn_ext.swiglu_clamped_quant(torch.randn(2, 128), torch.randn(2, 128), r, limit=-1.0)
    with pytest.raises(TypeError, match="`recipe`"):
        ffn_ext.quantize(torch.randn(2, 128), "row")
    x = torch.randn(2, 128, requires_grad=True)
    for call in (
        lambda: ffn_ext.quantize(x, r),
        lambda: torch.ops.ffn_ext.quantize(x, **r.op_kwargs()),
        lambda: torch.ops.ffn_ext.swiglu_quant(x.detach(), x, **r.op_kwargs()),
    ):
        with pytest.raises(RuntimeError, match="requires grad.*not differentiable"):
            call()
    with torch.no_grad():
        assert_same(ffn_ext.quantize(x, r), reference_quantize(x.detach(), r))


def test_api_explains_a_kernels_guard_with_the_python_checks(monkeypatch):
    # a CUDA kernel's C++ guard raises a RuntimeError (the CUDA kernel stood in for: no GPU needed): the API raises
    # the Python checks' error where they find the cause, and the kernel's error as it is where they do not
    from ffn_ext import _kernels

    def kernel(*args, **kwargs):
        raise RuntimeError("ffn_ext.quantize: a guard")

    monkeypatch.setattr(_kernels.OP["quantize"], "fast", (kernel,) * 4)
    with pytest.raises(ValueError, match=r"^ffn_ext\.quantize: `group_size`=128 must divide the last dimension of h"):
        ffn_ext.quantize(torch.randn(2, 96))
    with pytest.raises(RuntimeError, match=r"^ffn_ext\.quantize: a guard$"):
        ffn_ext.quantize(torch.randn(2, 128))


OPCHECK = [
    ("quantize", None, None),
    ("swiglu_quant", GATED[0], None),
    ("swiglu_clamped_packed_quant", [g for g in GATED if g.params][0], "interleaved"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name, g, packing", OPCHECK, ids=[c[0] for c in OPCHECK])
@pytest.mark.parametrize(
    "recipe",
    [
        QuantRecipe(scale_layout="column"),
        QuantRecipe(torch.float8_e5m2, "tensor"),
        QuantRecipe(scaling="row", pow2_scales=True, scale_dtype=torch.float8_e8m0fnu),
    ],
    ids=rid,
)
def test_opcheck(name, g, packing, recipe, device):
    shape = (3, 5, 256)
    params = g.example if g is not None else {}
    if g is None:
        args = (torch.randn(shape, device=device),)
    elif packing is None:
        args = (torch.randn(shape, device=device), torch.randn(shape, device=device))
    else:
        args = (torch.randn(shape[:-1] + (512,), device=device),)
    kwargs = dict(recipe.op_kwargs(), **params, **({"layout": packing} if packing else {}))
    torch.library.opcheck(getattr(torch.ops.ffn_ext, name).default, args, kwargs)


def test_every_gated_op_has_quant_ops():
    # derived from the table: a gated op added there gets its quantizing variants with no list to update
    for g in GATED:
        for suffix in ("_quant", "_packed_quant"):
            assert hasattr(torch.ops.ffn_ext, g.name + suffix), g.name + suffix


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kernel_emulation_bit_identical(dtype):
    # the CUDA kernels' per-lane code (quant_kernel.h) run on the host: q and scales equal the reference applied to
    # the unfused CUDA kernel's h (its launch emulated too), for group recipes, every form, strided and unaligned
    # operands (element loads), odd row counts; the emulation is the tests' host-code extension (tests/native.py)
    gen = torch.Generator().manual_seed(99 + dtype.itemsize)
    group_recipes = [r for r in recipes() if r.scaling == "group"]
    for trial, (name, g, packing) in enumerate(FORMS):
        for r in group_recipes[trial % 3 :: 5]:
            rows = (1, 7, 33)[trial % 3]
            k = r.group_size * (1, 3, 5)[(trial + rows) % 3]
            params = [float(v) for v in g.example.values()] if g is not None else []
            kw = dict(
                format="e4m3fn" if r.dtype == torch.float8_e4m3fn else "e5m2",
                group_size=r.group_size,
                pow2=r.pow2_scales,
                e8m0=r.scale_dtype != torch.float32,
                column=r.scale_layout == "column",
            )
            if g is None:
                x = rand_h((rows, k + 1), dtype, "cpu", gen)[:, 1:]  # rows 2 bytes off 16-byte alignment
                got = native.testing()._emulate_quant(name, [x], **kw)
                ref = reference_quantize(x, r)
            elif packing is None:
                big = rand_h((rows, 2 * k), dtype, "cpu", gen)
                gate, up = big[:, :k], big[:, k:]
                got = native.testing()._emulate_quant(name, [gate, up], params, **kw)
                ref = reference_quantize(native.testing()._emulate_cuda(g.name, [gate, up], params=params)[0], r)
            else:
                gu = rand_h((rows, 2 * k), dtype, "cpu", gen)
                got = native.testing()._emulate_quant(name, [gu], params, packing, **kw)
                ref = reference_quantize(
                    native.testing()._emulate_cuda(g.name + "_packed", [gu], params=params, layout=packing)[0], r
                )
            assert_same(tuple(got), ref, msg=f"{name} {packing} {rid(r)} {dtype}")


@pytest.mark.parametrize("layout", ["swizzle_32_4_4", "SWIZZLE_32_4_4"])
def test_swizzle_layout_is_named_unsupported(layout):
    with pytest.raises(
        ValueError, match=r"`scale_layout`=\"swizzle_32_4_4\" .* is not supported: use scale_layout=\"row\""
    ):
        ffn_ext.QuantRecipe(scaling="group", group_size=32, pow2_scales=True, scale_layout=layout)
