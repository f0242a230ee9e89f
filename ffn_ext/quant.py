"""FP8 outputs: every gated op of the table and the identity write FP8 values and their scales in one pass.

    recipe = ffn_ext.QuantRecipe(dtype=torch.float8_e4m3fn, scaling="group", group_size=128)
    q, scale = ffn_ext.swiglu_quant(gate, up, recipe)          # h = swiglu(gate, up) ~= q * scale (per group)
    q, scale = ffn_ext.gated_packed_quant(gate_up, recipe, activation="silu", layout="interleaved")
    q, scale = ffn_ext.quantize(x, recipe)                     # no activation: a GEMM input

The formula, the same on every path (CPU composite, CUDA kernels, this module's reference):

    h      = the unfused op's output (ffn_ext.swiglu(gate, up), ...), in the input dtype, then converted to float32
    amax   = max |h| over the scale's elements (the whole tensor, a row, or a group of group_size along the last
             dim); NaN if any of them is NaN
    scale  = min(max(amax, AMAX_FLOOR), FLT_MAX) / fp8_max          (float32 arithmetic; NaN stays NaN)
             AMAX_FLOOR = float32(1e-12): an all-zero group gets q = 0 and a finite positive scale; an inf in a
             group makes its amax FLT_MAX, so its scale stays finite and the inf saturates to +-fp8_max
             a static per-tensor scale replaces this line (scaling="tensor", static_scale=s)
    scale  = 2 ** ceil(log2(scale)) if pow2_scales (exact: the float32's mantissa rounded up)
    inv    = 1 / scale                                              (float32, correctly rounded)
    q      = fp8(clamp(h * inv, -fp8_max, fp8_max))                 (round to nearest even, saturating; a NaN
             gives the positive canonical NaN 0x7F in both formats)

so h ~= q * scale: `scale` is the dequantization factor, what torch.nn.functional.scaled_mm takes. fp8_max is 448
for float8_e4m3fn and 57344 for float8_e5m2. A NaN in h makes its group's scale NaN (and its q NaN). Recipes and
scale shapes, for h of shape [..., K]:

    scaling="tensor"   scale [] (0-dim): dynamic (amax over the whole tensor) or static_scale
    scaling="row"      scale [..., 1]: one per row (per token)
    scaling="group"    scale [..., K // group_size], group_size 128 (DeepSeek-V3, DeepGEMM), 64 or 32 (MXFP8 with
                       pow2_scales=True, scale_dtype=torch.float8_e8m0fnu)
    scale_dtype        torch.float32, or torch.float8_e8m0fnu (needs pow2_scales=True: stored exactly)
    scale_layout       "row" (contiguous) or "column" (MN-major: the rows' index varies fastest, stride (1, rows)
                       for 2-D h; what F.scaled_mm's BlockWise1x128 takes on sm_90); not for scaling="tensor".
                       The SWIZZLE_32_4_4 layout of sm_100's MX GEMMs is not supported (a ValueError says what to
                       use: "row" MXFP8 scales, tiled by the caller).

The ops are torch.ops.ffn_ext.<gated>_quant, <gated>_packed_quant and quantize (forward only, not differentiable).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch

from . import _kernels
from .ops import Gating
from .table import GATED_BY_NAME, activation_for, bind_params

__all__ = [
    "QuantRecipe",
    "FP8_MAX",
    "AMAX_FLOOR",
    "reference_quantize",
    "quantize",
    "swiglu_quant",
    "geglu_quant",
    "swiglu_clamped_quant",
    "gated_quant",
    "gated_packed_quant",
]

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}  # the largest finite value of each format
AMAX_FLOOR = 1e-12  # as float32: the smallest amax a scale is computed from (torchao's; vLLM uses 1e-10)
FLT_MAX = float(torch.finfo(torch.float32).max)
SCALINGS = ("tensor", "row", "group")
GROUP_SIZES = (32, 64, 128)
SCALE_DTYPES = (torch.float32, torch.float8_e8m0fnu)
SCALE_LAYOUTS = ("row", "column")


@dataclass(frozen=True)
class QuantRecipe:
    """How h is quantized to FP8 (see the module's docstring for the formula). Checked when made: a bad recipe is a
    ValueError (TypeError for a dtype of the wrong kind) naming the argument."""

    dtype: torch.dtype = torch.float8_e4m3fn
    scaling: str = "group"  # "tensor" | "row" | "group"
    group_size: int = 128  # scaling="group": 128, 64 or 32 elements along the last dim
    pow2_scales: bool = False  # scales rounded up to a power of two (UE8M0)
    scale_dtype: torch.dtype = torch.float32  # or torch.float8_e8m0fnu (pow2_scales=True)
    scale_layout: str = "row"  # "row" | "column"
    static_scale: float | None = None  # scaling="tensor": a given scale instead of the tensor's amax

    def __post_init__(self):
        if not isinstance(self.dtype, torch.dtype) or self.dtype not in FP8_MAX:
            raise TypeError(
                f"QuantRecipe: `dtype` must be torch.float8_e4m3fn or torch.float8_e5m2, got {self.dtype!r}"
            )
        if self.scaling not in SCALINGS:
            raise ValueError(f"QuantRecipe: `scaling` must be one of {SCALINGS}, got {self.scaling!r}")
        if self.scaling == "group" and (isinstance(self.group_size, bool) or self.group_size not in GROUP_SIZES):
            raise ValueError(
                f"QuantRecipe: `group_size` must be one of {GROUP_SIZES} (elements per group along "
                f"the last dim), got {self.group_size!r}"
            )
        if not isinstance(self.pow2_scales, bool):
            raise TypeError(f"QuantRecipe: `pow2_scales` must be a bool, got {self.pow2_scales!r}")
        if not isinstance(self.scale_dtype, torch.dtype) or self.scale_dtype not in SCALE_DTYPES:
            raise TypeError(
                f"QuantRecipe: `scale_dtype` must be torch.float32 or torch.float8_e8m0fnu, got {self.scale_dtype!r}"
            )
        if self.scale_dtype == torch.float8_e8m0fnu and not self.pow2_scales:
            raise ValueError(
                "QuantRecipe: `scale_dtype`=torch.float8_e8m0fnu holds powers of two only: it needs pow2_scales=True"
            )
        if isinstance(self.scale_layout, str) and self.scale_layout.lower() == "swizzle_32_4_4":
            raise ValueError(
                "QuantRecipe: `scale_layout`=\"swizzle_32_4_4\" (F.scaled_mm's SwizzleType.SWIZZLE_32_4_4, the "
                "128x4-tiled scales of sm_100's MX GEMMs) is not supported: use scale_layout=\"row\" with "
                "scaling=\"group\", group_size=32, pow2_scales=True, scale_dtype=torch.float8_e8m0fnu (MXFP8) and "
                "tile the [M, K/32] scales for that GEMM"
            )
        if self.scale_layout not in SCALE_LAYOUTS:
            raise ValueError(f"QuantRecipe: `scale_layout` must be one of {SCALE_LAYOUTS}, got {self.scale_layout!r}")
        if self.scale_layout == "column" and self.scaling == "tensor":
            raise ValueError(
                "QuantRecipe: `scale_layout`=\"column\" is for scaling=\"row\" or \"group\"; a "
                "per-tensor scale has no layout"
            )
        if self.static_scale is not None:
            if self.scaling != "tensor":
                raise ValueError(f"QuantRecipe: `static_scale` is for scaling=\"tensor\", got scaling={self.scaling!r}")
            s = self.static_scale
            if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or not s > 0:
                raise ValueError(f"QuantRecipe: `static_scale` must be a finite number > 0, got {s!r}")

    @property
    def fp8_max(self) -> float:
        return FP8_MAX[self.dtype]

    def op_kwargs(self) -> dict:
        """The recipe as the ops' keyword arguments (torch.ops.ffn_ext.*_quant)."""
        return dict(
            dtype=self.dtype,
            scaling=self.scaling,
            group_size=int(self.group_size),
            pow2_scales=self.pow2_scales,
            scale_dtype=self.scale_dtype,
            scale_layout=self.scale_layout,
            static_scale=None if self.static_scale is None else float(self.static_scale),
        )


def _recipe(op: str, recipe) -> QuantRecipe:
    if recipe is None:
        return QuantRecipe()
    if not isinstance(recipe, QuantRecipe):
        raise TypeError(f"{op}: `recipe` must be an ffn_ext.QuantRecipe, got {type(recipe).__name__}")
    return recipe


def group_len(op: str, recipe: QuantRecipe, k: int) -> int:
    """Elements per scale along the last dim (row: all of them)."""
    if recipe.scaling == "group":
        if k % recipe.group_size:
            raise ValueError(f"{op}: `group_size`={recipe.group_size} must divide the last dimension of h, got {k}")
        return recipe.group_size
    return k


def _pow2_up(scale: torch.Tensor) -> torch.Tensor:
    """2 ** ceil(log2(scale)) for positive normal float32 scales, exactly: the mantissa rounded up; NaN stays."""
    bits = scale.view(torch.int32)
    up = ((bits + 0x7FFFFF) & 0x7F800000).view(torch.float32)
    return torch.where(torch.isnan(scale), scale, up)


def reference_quantize(h: torch.Tensor, recipe: QuantRecipe, op: str = "ffn_ext.reference_quantize"):
    """(q, scale) of h by the documented formula, with plain PyTorch ops: the tests' reference, and the ops' CPU
    kernels (ffn_ext._kernels.QuantOp)."""
    fmax = recipe.fp8_max
    x = h.float()
    if recipe.scaling != "tensor" and x.dim() == 0:
        raise ValueError(
            f"{op}: scaling={recipe.scaling!r} needs h with at least 1 dimension ([..., K]), got a 0-dim tensor"
        )
    if recipe.scaling == "tensor":
        if recipe.static_scale is not None:
            scale = torch.tensor(recipe.static_scale, dtype=torch.float32, device=h.device)
        else:
            amax = x.abs().amax() if x.numel() else torch.zeros((), device=h.device)
            scale = amax.clamp(AMAX_FLOOR, FLT_MAX) / fmax
        groups = x.reshape(1, -1)
    else:
        k = x.shape[-1]
        g = group_len(op, recipe, k)
        rows, n_groups = math.prod(x.shape[:-1]), (k // g if g else 1)  # a row of K=0: one empty group
        groups = x.reshape(rows, n_groups, g)
        amax = groups.abs().amax(-1) if g else torch.zeros((rows, n_groups), device=h.device)
        scale = amax.clamp(AMAX_FLOOR, FLT_MAX) / fmax
    if recipe.pow2_scales:
        scale = _pow2_up(scale)
    inv = torch.reciprocal(scale)
    if recipe.scaling == "tensor":
        q = _fp8((groups * inv).clamp(-fmax, fmax), recipe.dtype).reshape(h.shape)
        return q, scale.to(recipe.scale_dtype)
    q = _fp8((groups * inv[..., None]).clamp(-fmax, fmax), recipe.dtype).reshape(h.shape)
    scale = scale.to(recipe.scale_dtype).reshape(*h.shape[:-1], scale.shape[-1])
    return q, _layout(scale, recipe)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q * scale in `dtype` for row-layout group scales ([..., K] and [..., K / G], G dividing K): each value
    widened (float32, float64 for float64, which reads the FP8 values exactly), times its group's scale, rounded to
    `dtype` once; one temporary of the wide dtype."""
    wide = torch.promote_types(dtype, torch.float32)
    g = q.shape[-1] // scale.shape[-1]
    v = q.reshape(*scale.shape, g).to(wide).mul_(scale.to(wide).unsqueeze(-1))
    return v.reshape(q.shape).to(dtype)


def _fp8(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x (within +-fp8_max, or NaN) cast to fp8, NaN as the positive canonical NaN 0x7F (torch's cast keeps the
    NaN's sign bit, which float arithmetic does not define; the GPU's conversion gives 0x7F)."""
    q = x.to(dtype).view(torch.uint8)
    return torch.where(torch.isnan(x), torch.tensor(0x7F, dtype=torch.uint8, device=x.device), q).view(dtype)


def _layout(scale: torch.Tensor, recipe: QuantRecipe) -> torch.Tensor:
    if recipe.scale_layout == "row" or scale.dim() < 2:
        return scale
    col = torch.empty((scale.shape[-1],) + scale.shape[:-1], dtype=scale.dtype, device=scale.device)
    col = col.permute(*range(1, scale.dim()), 0)
    return col.copy_(scale)


# ---------------------------------------------------------------- the functional API
# The ops (their checks, kernels and call) are ffn_ext._kernels.QuantOp: the unfused op, then the formula above.
def _run(name: str, args: tuple, recipe, kwargs: dict):
    """torch.ops.ffn_ext.<name> by the ops' one route, the recipe's arguments added."""
    return _kernels.OP[name](*args, **_recipe(f"ffn_ext.{name}", recipe).op_kwargs(), **kwargs)


def quantize(x: torch.Tensor, recipe: QuantRecipe | None = None):
    """(q, scale) of x (a GEMM input) by `recipe` (default: float8_e4m3fn, 1x128 groups, float32 scales)."""
    return _run("quantize", (x,), recipe, {})


def gated_quant(gate: torch.Tensor, up: torch.Tensor, recipe: QuantRecipe | None = None, activation: str = "silu"):
    """(q, scale) of act(gate) * up for any activation of the table by its name (as ffn_ext.gated)."""
    return _run(Gating.of(activation).op + "_quant", (gate, up), recipe, {})


def swiglu_quant(gate: torch.Tensor, up: torch.Tensor, recipe: QuantRecipe | None = None):
    """(q, scale) of swiglu(gate, up) = silu(gate) * up."""
    return gated_quant(gate, up, recipe, "silu")


def geglu_quant(gate: torch.Tensor, up: torch.Tensor, recipe: QuantRecipe | None = None, approximate: str = "none"):
    """(q, scale) of geglu(gate, up, approximate)."""
    act = activation_for("gelu", approximate=approximate)
    return _run(act.gated + "_quant", (gate, up), recipe, {})


def swiglu_clamped_quant(
    gate: torch.Tensor,
    up: torch.Tensor,
    recipe: QuantRecipe | None = None,
    *,
    limit: float,
    alpha: float = 1.0,
    up_offset: float = 0.0,
):
    """(q, scale) of swiglu_clamped(gate, up, limit=, alpha=, up_offset=) (GPT-OSS, DeepSeek-V4)."""
    return _run("swiglu_clamped_quant", (gate, up), recipe, dict(limit=limit, alpha=alpha, up_offset=up_offset))


def gated_packed_quant(
    gate_up: torch.Tensor,
    recipe: QuantRecipe | None = None,
    activation: str = "silu",
    *,
    layout: str = "concat",
    **params,
):
    """(q, scale) of a gated op over one [..., 2M] tensor in `layout` ("concat" or "interleaved"). `activation`
    names an activation of the table, or a gated op (e.g. "swiglu_clamped", with its keyword `params`)."""
    gated = GATED_BY_NAME.get(activation) or GATED_BY_NAME[Gating.of(activation).op]
    name = gated.name + "_packed_quant"
    return _run(name, (gate_up,), recipe, dict(bind_params(f"ffn_ext.{name}", gated, params), layout=layout))


_kernels.add_quant(sys.modules[__name__])  # the quantizing ops' Ops, with this module's recipe and formula
