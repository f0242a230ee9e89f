"""FP8 inference MLPs: ``ffn_ext.quantize_fp8(model, recipe=)`` turns FFN modules into FP8 ones.

    model = ffn_ext.quantize_fp8(model)                  # every SwiGLUFFN / GeGLUFFN / GatedFFN / FFN in it
    mlp8 = ffn_ext.quantize_fp8(ffn_ext.SwiGLUFFN(896, 4864), recipe="block")

What is converted: ffn_ext's GatedFFN (SwiGLUFFN, GeGLUFFN) and FFN, and the Hugging Face MLPs that
ffn_ext.patch_hf_model patched (dense gated, packed gated, clamped SwiGLU with the limit and alpha they have when
quantized, and classic, nn.Linear or GPT-2's Conv1D projections). Anything that looks like an MLP but is left as it
is gets named in a warning, with the reason: an activation that is not ffn_ext's, projections that are not plain
nn.Linear, MoE experts, BERT-style layer pairs, and layers already in FP8 (transformers' FineGrainedFP8 FP8Linear).

Two recipes, both float8_e4m3fn with float32 scales (the formula: ffn_ext.quant, docs/fp8.md):

- "row": weights once per output channel (scale [1, N]), x and the activation output per token (scale [M, 1]);
  the projections through torch.nn.functional.scaled_mm with ScalingType.RowWise, on the CPU and CUDA (on the CPU,
  which has no FP8 units, 7-10x slower than the bf16 MLP: named once in a warning).
- "block" (DeepSeek-V3's): weights once in 128x128 blocks (scale [N/128, K/128], the layout of HF's
  weight_scale_inv), x and the activation output in 1x128 groups with "column" scales ([M, K/128], stride (1, M));
  the projections through F.scaled_mm with BlockWise1x128 x BlockWise128x128 on CUDA devices of compute capability
  9.0 (torch serves that recipe pair there only). Every projection's in and out features must be multiples
  of 128 (ValueError otherwise: padding would quantize zeros into the last block and change nothing but the cost,
  and the models of this recipe have such widths). Elsewhere (the CPU, other GPUs) torch has no blockwise scaled_mm
  (torch 2.13's CPU scaled_mm rejects it: "Invalid scaling configuration"); the GEMMs then run as an emulation,
  named once in a warning: the FP8 values and scales, dequantized in float32, multiplied in float32, rounded once to
  the output dtype. That computes the same product the GPU does (up to the order of the float32 sums), so the
  recipe's accuracy can be measured on any machine, and the warning says it is not a speed-up; an error there would
  leave no way to check a block-quantized model before it reaches an H100.

Between the projections, the gated activation and the quantization of its output are one op
(ffn_ext.gated_packed_quant over the [gate | up] output of one GEMM); the classic FFN's activation is ffn_ext's op
followed by ffn_ext.quantize. Forward only (inference): parameters are dropped, the FP8 weights are buffers, dropout
is not applied (as in eval mode).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from .modules import FFN, GatedFFN, formula_of
from .ops import Gating
from .quant import QuantRecipe, gated_packed_quant, quantize

__all__ = ["quantize_fp8", "FP8GatedFFN", "FP8FFN", "ROW", "BLOCK", "RECIPES"]

ROW = QuantRecipe(torch.float8_e4m3fn, "row")  # per output channel (weights), per token (activations)
BLOCK = QuantRecipe(torch.float8_e4m3fn, "group", 128, scale_layout="column")  # x and h: 1x128 groups, MN-major
_WEIGHT_BLOCK = 128
RECIPES = ("row", "block")
_EMULATED_WARNED: set = set()  # devices the block emulation or the CPU's RowWise GEMM was named for (once each)


def _caller_stacklevel() -> int:
    """The stacklevel of the caller's first frame outside ffn_ext and torch: a warning then names the user's line
    (a fixed level named torch's Module.__call__, and a fixed one breaks when a call goes through other layers)."""
    import sys

    inside = (str(__file__).rsplit("/", 1)[0] + "/", str(torch.__file__).rsplit("/", 1)[0] + "/")
    frame, level = sys._getframe(2), 2  # the caller of the function that warns
    while frame.f_back is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


def _rowwise(qa, sa, qw, sw, out_dtype):
    """(qa * sa) @ (qw * sw)^T through F.scaled_mm RowWise: qa [M, K] with sa [M, 1]; qw [N, K] with sw [1, N].
    On the CPU, named once in a warning: it runs, with the recipe's numbers, but slower than the bf16 MLP."""
    on_cpu = qa.device.type == "cpu"
    if on_cpu and "cpu (row)" not in _EMULATED_WARNED:
        _EMULATED_WARNED.add("cpu (row)")
        how = (
            "F.scaled_mm runs here"
            if _CPU_SCALED_MM
            else "this torch has no CPU F.scaled_mm, so its GEMMs are emulated (the FP8 values dequantized and "
            "multiplied in float32, the same numbers)"
        )
        warnings.warn(
            f"ffn_ext.quantize_fp8: recipe=\"row\" on cpu: {how}, but a CPU has no FP8 units, so the FP8 MLP is "
            "7-10x slower than the bf16 MLP; on the CPU it checks the recipe's numbers, it is not a speed-up",
            RuntimeWarning,
            stacklevel=_caller_stacklevel(),
        )
    if on_cpu and not _CPU_SCALED_MM:
        return ((qa.float() * sa.float()) @ (qw.float() * sw.float().t()).t()).to(out_dtype)  # sw: [1, N]
    rw = F.ScalingType.RowWise
    return F.scaled_mm(qa, qw.t(), sa, rw, sw, rw, output_dtype=out_dtype)


# F.scaled_mm's op (aten::_scaled_mm_v2) has no CPU kernel in torch 2.10; later releases have one (2.14 has)
_CPU_SCALED_MM = torch._C._dispatch_has_kernel_for_dispatch_key("aten::_scaled_mm_v2", "CPU")


def _blockwise_native(device: torch.device) -> bool:
    """Whether F.scaled_mm has BlockWise1x128 x BlockWise128x128 on `device`: CUDA, compute capability 9.0."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def _blockwise_sm90(qa, sa, qw, sw, out_dtype):
    """F.scaled_mm BlockWise1x128 x BlockWise128x128 as torch's CUDA check (_scaled_block1x128_block128x128) takes
    it: scale_a [M, K/128] with strides (1, M); mat_b = qw^T [K, N] and scale_b = the weight's scales transposed,
    [round_up(K/128, 4), N/128] with strides (1, round_up(K/128, 4)): the K blocks padded to a multiple of 4 (zeros,
    never read as data); M is padded to a multiple of 4 with zero rows, so that scale_a's columns start 16-byte
    aligned as in the callers of this GEMM we read (not a documented requirement; benchmarks/bench_fp8_mlp.py
    --check runs 5 tokens on the GPU), and the output cut back."""
    m, kb = qa.shape[0], sa.shape[1]
    pad_m, pad_k = -m % 4, -kb % 4
    if pad_m:
        qa = torch.cat([qa, qa.new_zeros(pad_m, qa.shape[1])])
        sa_p = sa.new_zeros(kb, m + pad_m)
        sa_p[:, :m] = sa.t()
        sa = sa_p.t()
    sb = (F.pad(sw, (0, pad_k)) if pad_k else sw).t()
    st = F.ScalingType
    y = F.scaled_mm(qa, qw.t(), sa, st.BlockWise1x128, sb, st.BlockWise128x128, output_dtype=out_dtype)
    return y[:m] if pad_m else y


def _dequant_blocks(q: torch.Tensor, s: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """q (FP8 [R, C]) times its scales s ([R / rows, C / cols], any strides) as float32."""
    return q.float() * s.float().repeat_interleave(rows, 0).repeat_interleave(cols, 1)


def _blockwise(qa, sa, qw, sw, out_dtype):
    """(qa * sa) @ (qw * sw)^T: qa [M, K] with sa [M, K/128] (stride (1, M)); qw [N, K] with sw [N/128, K/128].
    F.scaled_mm BlockWise1x128 x BlockWise128x128 on sm_90, else the float32 emulation named in the module
    docstring, with a one-time warning per device."""
    if _blockwise_native(qa.device):
        return _blockwise_sm90(qa, sa, qw, sw, out_dtype)
    key = str(qa.device)
    if key not in _EMULATED_WARNED:
        _EMULATED_WARNED.add(key)
        warnings.warn(
            f"ffn_ext.quantize_fp8: recipe=\"block\" on {key}: torch has no blockwise F.scaled_mm here (it needs CUDA "
            "compute capability 9.0), so its GEMMs are emulated: the FP8 values dequantized and multiplied in "
            "float32 (the same numbers, slower than bf16; recipe=\"row\" runs F.scaled_mm on the CPU and every GPU)",
            RuntimeWarning,
            stacklevel=_caller_stacklevel(),
        )
    a = _dequant_blocks(qa, sa, 1, 128)
    w = _dequant_blocks(qw, sw, _WEIGHT_BLOCK, _WEIGHT_BLOCK)
    return (a @ w.t()).to(out_dtype)


def _quantize_weight_blocks(w: torch.Tensor):
    """(q [N, K] e4m3, scale [N/128, K/128] float32) of w: each 128x128 block by the formula of ffn_ext.quant with
    its amax over the whole block (quantize with scaling="row" over the blocks laid out as rows)."""
    n, k = w.shape
    b = _WEIGHT_BLOCK
    blocks = w.reshape(n // b, b, k // b, b).transpose(1, 2).reshape(n // b, k // b, b * b)
    q, s = quantize(blocks.contiguous(), ROW)
    q = q.reshape(n // b, k // b, b, b).transpose(1, 2).reshape(n, k).contiguous()
    return q, s.reshape(n // b, k // b).contiguous()


class _FP8Linear(nn.Module):
    """A projection's weight [N, K] quantized once by `recipe` and its bias: q [N, K] e4m3 with scale [1, N] ("row")
    or [N/128, K/128] ("block"), float32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, recipe: str, what: str = "projection"):
        super().__init__()
        self.recipe = recipe
        with torch.no_grad():
            w = weight.detach()
            if recipe == "block":
                n, k = w.shape
                if n % _WEIGHT_BLOCK or k % _WEIGHT_BLOCK:
                    raise ValueError(
                        f"ffn_ext.quantize_fp8: recipe=\"block\" needs in and out features that are multiples of "
                        f"{_WEIGHT_BLOCK} (128x128 weight blocks, 1x128 activation groups); {what} has weight "
                        f"[out={n}, in={k}]: use recipe=\"row\""
                    )
                q, s = _quantize_weight_blocks(w)
            else:
                q, s = quantize(w, ROW)
                s = s.reshape(1, -1).contiguous()
        self.register_buffer("weight_q", q)
        self.register_buffer("weight_scale", s)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, qx, sx, out_dtype):
        gemm = _blockwise if self.recipe == "block" else _rowwise
        y = gemm(qx, sx, self.weight_q, self.weight_scale, out_dtype)
        return y if self.bias is None else y + self.bias.to(out_dtype)


def _act_recipe(recipe: str) -> QuantRecipe:
    return BLOCK if recipe == "block" else ROW


class FP8GatedFFN(nn.Module):
    """down(act(gate(x)) * up(x)) with FP8 weights and activations; see the module docstring. Made by quantize_fp8
    from the [gate | up] weight rows (one GEMM), the down projection's weight, the gated activation (as
    Gating.of(activation, **params) takes it: a table name, a gated op and its parameters, or a Gating, whose
    layout is not used: the rows are [gate | up]) and the recipe."""

    def __init__(self, gate_up_weight, gate_up_bias, down_weight, down_bias, activation, params=None, recipe="row"):
        super().__init__()
        self.gate_up = _FP8Linear(gate_up_weight, gate_up_bias, recipe, "the gate and up projections")
        self.down = _FP8Linear(down_weight, down_bias, recipe, "the down projection")
        g = Gating.of(activation, **(params or {}))
        self.gating, self.recipe = Gating(g.op, **g.kwargs), recipe

    @classmethod
    def from_ffn(cls, ffn: GatedFFN, recipe: str = "row") -> FP8GatedFFN:
        mods: dict[str, Any] = dict(ffn.named_children())
        gating, why = formula_of(ffn)
        if gating is None:
            raise ValueError(f"ffn_ext.FP8GatedFFN.from_ffn: {why or 'expected a GatedFFN'}")
        if "gate_up_proj" in mods and gating.layout == "concat":
            w, b = mods["gate_up_proj"].weight, mods["gate_up_proj"].bias
        elif "gate_up_proj" in mods:  # interleaved rows: reorder to [gate | up] once
            gu = mods["gate_up_proj"]
            w = torch.cat([gu.weight[0::2], gu.weight[1::2]])
            b = None if gu.bias is None else torch.cat([gu.bias[0::2], gu.bias[1::2]])
        else:
            g, u = mods["gate_proj"], mods["up_proj"]
            w = torch.cat([g.weight, u.weight])
            b = None if g.bias is None else torch.cat([g.bias, u.bias])
        return cls(w, b, mods["down_proj"].weight, mods["down_proj"].bias, gating, recipe=recipe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, dt, r = x.shape[:-1], x.dtype, _act_recipe(self.recipe)
        qx, sx = quantize(x.reshape(-1, x.shape[-1]), r)
        gu = self.gate_up(qx, sx, dt)
        g = self.gating
        qh, sh = gated_packed_quant(gu, r, g.op, **g.kwargs)
        return self.down(qh, sh, dt).reshape(*lead, -1)

    def extra_repr(self) -> str:
        return f"{self.gating!r}, recipe={self.recipe!r}"


class FP8FFN(nn.Module):
    """down(act(up(x))) with FP8 weights and activations: the classic FFN. `act`: a callable on the up projection's
    output (ffn_ext's activation module, or its op)."""

    def __init__(self, up_weight, up_bias, down_weight, down_bias, act, recipe="row"):
        super().__init__()
        self.up = _FP8Linear(up_weight, up_bias, recipe, "the up projection (fc1)")
        self.down = _FP8Linear(down_weight, down_bias, recipe, "the down projection (fc2)")
        self.act, self.recipe = act, recipe

    @classmethod
    def from_ffn(cls, ffn: FFN, recipe: str = "row") -> FP8FFN:
        act, why = formula_of(ffn)
        if act is None or isinstance(ffn, GatedFFN):
            raise ValueError(f"ffn_ext.FP8FFN.from_ffn: {why or 'expected an FFN'}")
        return cls(ffn.up_proj.weight, ffn.up_proj.bias, ffn.down_proj.weight, ffn.down_proj.bias, ffn.act, recipe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, dt, r = x.shape[:-1], x.dtype, _act_recipe(self.recipe)
        qx, sx = quantize(x.reshape(-1, x.shape[-1]), r)
        qh, sh = quantize(self.act(self.up(qx, sx, dt)), r)
        return self.down(qh, sh, dt).reshape(*lead, -1)

    def extra_repr(self) -> str:
        return f"recipe={self.recipe!r}"


def _convert(m: nn.Module, recipe: str):
    """(the FP8 module for m, None) or (None, why m is left as it is); (None, None) for modules of no MLP form."""
    form, why = formula_of(m)
    if form is not None and isinstance(m, GatedFFN):
        return FP8GatedFFN.from_ffn(m, recipe), None
    if form is not None and isinstance(m, FFN):
        return FP8FFN.from_ffn(m, recipe), None
    if why is not None:
        return None, why
    for hook in _CONVERTERS:
        found = hook(m, recipe)
        if found != (None, None):
            return found
    return None, None


# (module, recipe) -> (FP8 module, None) | (None, why not) | (None, None): registered by higher layers (ffn_ext.hf's
# patched MLPs, ffn_ext/hf/fp8.py), which this module does not import
_CONVERTERS: list = []


def quantize_fp8(module: nn.Module, recipe: str = "row") -> nn.Module:
    """An FP8 inference version of `module` by `recipe` ("row" or "block", see the module docstring): a GatedFFN
    (SwiGLUFFN, GeGLUFFN) or FFN becomes an FP8GatedFFN / FP8FFN (returned); any other module has its FFN
    submodules, and the MLPs ffn_ext.patch_hf_model patched, replaced in place (and is returned). What looks like
    an MLP but is left as it is gets named in a UserWarning with the reason."""
    if recipe not in RECIPES:
        raise ValueError(
            "ffn_ext.quantize_fp8: `recipe` must be \"row\" (per-channel weights, per-token activations, F.scaled_mm "
            "RowWise) or \"block\" (128x128 weight blocks, 1x128 activation groups, F.scaled_mm BlockWise on sm_90), "
            f"got {recipe!r}"
        )
    top, why = _convert(module, recipe)
    if top is not None:
        return top
    left = [("", module, why)] if why else []
    done: set[str] = set()
    for name, child in [] if why else list(module.named_modules()):  # a module named whole: not its parts
        if any(name == d or name.startswith(d + ".") for d in done):
            continue
        for cname, sub in list(child.named_children()):
            full = f"{name}.{cname}" if name else cname
            new, why = _convert(sub, recipe)
            if new is not None:
                setattr(child, cname, new)
                done.add(full)
            elif why:  # named once, with what is inside it
                left.append((full, sub, why))
                done.add(full)
    by_reason: dict = {}
    for name, sub, why in left:
        by_reason.setdefault(why, []).append(f"{name or type(sub).__name__} ({type(sub).__name__})")
    for why, names in by_reason.items():
        where = (
            names[0]
            if len(names) == 1
            else f"{', '.join(names[:3])}" + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        )
        verb = "is" if len(names) == 1 else "are"
        warnings.warn(f"ffn_ext.quantize_fp8: {where} {verb} not converted: {why}", stacklevel=2)
    return module
