"""FP8 inference MLPs: ``ffn_ext.quantize_fp8(model)`` turns ffn_ext's FFN modules into FP8 ones.

    model = ffn_ext.quantize_fp8(model)              # every SwiGLUFFN / GeGLUFFN / GatedFFN / FFN in it
    mlp8 = ffn_ext.quantize_fp8(ffn_ext.SwiGLUFFN(896, 4864))

recipe="row" (the one so far): the weights are quantized once to float8_e4m3fn per output channel, x per row
(token), both with float32 scales; the projections run through torch.nn.functional.scaled_mm with
ScalingType.RowWise (CPU and CUDA); between them the gated activation and the quantization of its output are one
op (ffn_ext.gated_packed_quant: the gate and up projections are one GEMM, [gate | up]). The classic FFN's
activation is ffn_ext's op followed by ffn_ext.quantize. Forward only (inference): parameters are dropped, the
FP8 weights are buffers. A module whose activation is not one of ffn_ext's (replaced, or a subclass) is left as
it is, with a warning naming it.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from .modules import FFN, Gated, GatedFFN, GeGLU, SwiGLU
from .quant import QuantRecipe, gated_packed_quant, quantize

__all__ = ["quantize_fp8", "FP8GatedFFN", "FP8FFN", "ROW"]

ROW = QuantRecipe(torch.float8_e4m3fn, "row")  # per output channel (weights), per token (activations)
_FUSED_ACTS = (Gated, SwiGLU, GeGLU)


def _rowwise(qa, sa, qw, sw, out_dtype):
    """(qa * sa) @ (qw * sw)^T through F.scaled_mm RowWise: qa [M, K] with sa [M, 1]; qw [N, K] with sw [1, N]."""
    rw = F.ScalingType.RowWise
    return F.scaled_mm(qa, qw.t(), sa, rw, sw, rw, output_dtype=out_dtype)


class _FP8Linear(nn.Module):
    """A Linear's weight quantized once per output channel (q [N, K] e4m3fn, scale [1, N] float32) and its bias."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        with torch.no_grad():
            q, s = quantize(weight.detach(), ROW)
        self.register_buffer("weight_q", q)
        self.register_buffer("weight_scale", s.reshape(1, -1).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, qx, sx, out_dtype):
        y = _rowwise(qx, sx, self.weight_q, self.weight_scale, out_dtype)
        return y if self.bias is None else y + self.bias.to(out_dtype)


class FP8GatedFFN(nn.Module):
    """down(act(gate(x)) * up(x)) with FP8 weights and activations (recipe "row"); see the module docstring."""

    def __init__(self, ffn: GatedFFN):
        super().__init__()
        mods = ffn._modules
        act = mods["act"]
        if "gate_up_proj" in mods and act.layout == "concat":
            w, b = mods["gate_up_proj"].weight, mods["gate_up_proj"].bias
        elif "gate_up_proj" in mods:  # interleaved rows: reorder to [gate | up] once
            gu = mods["gate_up_proj"]
            w = torch.cat([gu.weight[0::2], gu.weight[1::2]])
            b = None if gu.bias is None else torch.cat([gu.bias[0::2], gu.bias[1::2]])
        else:
            g, u = mods["gate_proj"], mods["up_proj"]
            w = torch.cat([g.weight, u.weight])
            b = None if g.bias is None else torch.cat([g.bias, u.bias])
        self.gate_up = _FP8Linear(w, b)
        self.down = _FP8Linear(mods["down_proj"].weight, mods["down_proj"].bias)
        if isinstance(act, SwiGLU) and act.clamped:
            self.activation = "swiglu_clamped"
            self.params = dict(
                limit=math.inf if act.limit is None else act.limit, alpha=act.alpha, up_offset=act.up_offset
            )
        else:
            self.activation, self.params = act.activation, {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, dt = x.shape[:-1], x.dtype
        qx, sx = quantize(x.reshape(-1, x.shape[-1]), ROW)
        gu = self.gate_up(qx, sx, dt)
        qh, sh = gated_packed_quant(gu, ROW, self.activation, **self.params)
        return self.down(qh, sh, dt).reshape(*lead, -1)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}, recipe='row'"


class FP8FFN(nn.Module):
    """down(act(up(x))) with FP8 weights and activations (recipe "row"): the classic FFN."""

    def __init__(self, ffn: FFN):
        super().__init__()
        self.up = _FP8Linear(ffn.up_proj.weight, ffn.up_proj.bias)
        self.down = _FP8Linear(ffn.down_proj.weight, ffn.down_proj.bias)
        self.act = ffn.act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, dt = x.shape[:-1], x.dtype
        qx, sx = quantize(x.reshape(-1, x.shape[-1]), ROW)
        qh, sh = quantize(self.act(self.up(qx, sx, dt)), ROW)
        return self.down(qh, sh, dt).reshape(*lead, -1)


def _convert(m: nn.Module, name: str):
    if isinstance(m, GatedFFN):
        if type(m._modules["act"]) in _FUSED_ACTS and all(
            type(mods) is nn.Linear for k, mods in m._modules.items() if k != "act"
        ):
            return FP8GatedFFN(m)
    elif type(m) is FFN:
        if all(type(mods) is nn.Linear for k, mods in m._modules.items() if k != "act"):
            return FP8FFN(m)
    else:
        return None
    warnings.warn(
        f"ffn_ext.quantize_fp8: {name or type(m).__name__} ({type(m).__name__}) is not converted: its "
        "projections are not nn.Linear or its activation is not one of ffn_ext's",
        stacklevel=3,
    )
    return None


def quantize_fp8(module: nn.Module, recipe: str = "row") -> nn.Module:
    """An FP8 inference version of `module`: a GatedFFN (SwiGLUFFN, GeGLUFFN) or FFN becomes an FP8GatedFFN /
    FP8FFN (returned); any other module has its FFN submodules replaced in place (and is returned)."""
    if recipe != "row":
        raise ValueError(
            f"ffn_ext.quantize_fp8: `recipe` must be \"row\" (per-channel weights, per-token "
            f"activations, F.scaled_mm RowWise), got {recipe!r}"
        )
    top = _convert(module, "")
    if top is not None:
        return top
    for name, child in list(module.named_modules()):
        for cname, sub in list(child.named_children()):
            new = _convert(sub, f"{name}.{cname}" if name else cname)
            if new is not None:
                setattr(child, cname, new)
    return module
