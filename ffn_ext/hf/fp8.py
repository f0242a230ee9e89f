"""ffn_ext.quantize_fp8 on the MLPs patch_model patched: the dense gated and packed MLPs become FP8GatedFFN, the
classic ones (nn.Linear, FalconLinear or GPT-2's Conv1D projections) FP8FFN, each from the form and plan the patch
recorded on the module (forms.Patched) and its gating now. Everything else that is
an MLP, or already FP8, is named with the reason (registered as a converter of ffn_ext.fp8)."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn

from .. import fp8 as _fp8
from .. import ops as _ops
from .common import linear_layout
from .forms import MARK, identify

FINEGRAINED_FP8 = (
    "already FP8 (FineGrainedFP8): left as is, because transformers' FP8Linear takes only the unquantized input "
    "(FP8Linear.forward(input) and fp8_linear(input, weight, weight_scale_inv, block_size, bias, activation_scale) "
    "quantize it themselves, per 1x128 group or with a static per-tensor activation_scale), so its down projection "
    "cannot be given the fused op's FP8 output and scales"
)
_NOT_PATCHED = (
    "an MLP that ffn_ext.patch_hf_model has not patched (not called yet, or it named the module with its reason): "
    "quantize_fp8 converts only the MLPs whose form the patch checked"
)
_REASONS = {
    "pair": (
        "BERT-style *Intermediate / *Output layers: the projection back shares its module with the dropout, the "
        "residual and the LayerNorm, which an FP8 MLP would have to take over"
    ),
    "experts_gate": "MoE experts modules (3-D expert weights): ffn_ext has no FP8 grouped GEMM",
    "activation": (
        "its activation is no longer one ffn_ext computes, or carries hooks (replaced or hooked since patching)"
    ),
    "projections": "its projections are not plain nn.Linear (or GPT-2's Conv1D) modules without hooks",
}


def _finegrained(m) -> bool:
    t = type(m)
    return t.__name__ == "FP8Linear" and t.__module__.startswith("transformers.")


def _weight(proj, layout):
    """A projection's weight as [out, in] (Conv1D stores [in, out])."""
    return proj.weight.t() if layout == "conv1d" else proj.weight


def convert_patched(m: nn.Module, recipe: str):
    """(FP8 module, None), (None, why not) or (None, None) (not an MLP, nor FP8) for ffn_ext.fp8's walk."""
    if _finegrained(m):
        return None, FINEGRAINED_FP8
    patched = m.__dict__.get(MARK)
    if patched is None:
        if identify(m) is None:
            return None, None
        return None, FINEGRAINED_FP8 if any(_finegrained(s) for s in m.modules()) else _NOT_PATCHED
    form, plan = patched.form, patched.plan
    if form.name not in ("gated", "packed", "classic"):
        return None, _REASONS.get(form.name, f"patched as {form.name!r}, a form quantize_fp8 does not convert")
    mods: dict[str, Any] = dict(m.named_children())
    projs = [mods[n] for n in plan.names]
    if any(_finegrained(p) for p in projs):
        return None, FINEGRAINED_FP8
    g = form.gating(m, plan)  # read now: a clamped MLP's limit and alpha are frozen into the FP8 module
    if g is None:
        return None, _REASONS["activation"]
    plain = all(type(p) is nn.Linear for p in projs)
    layout = linear_layout(*projs) if form.name == "classic" else "linear" if plain else None
    if layout is None:
        return None, _REASONS["projections"]
    if form.name == "classic":
        fc1, fc2 = projs
        act = functools.partial(_ops.call_op, g.activation)
        return _fp8.FP8FFN(_weight(fc1, layout), fc1.bias, _weight(fc2, layout), fc2.bias, act, recipe), None
    if form.name == "gated":
        gate, up, d = projs
        w = torch.cat([gate.weight, up.weight])
        b = None if gate.bias is None else torch.cat([gate.bias, up.bias])
    else:  # packed: [gate | up], or interleaved rows reordered to it once
        gu, d = projs
        w, b = gu.weight, gu.bias
        if g.layout == "interleaved":
            w = torch.cat([w[0::2], w[1::2]])
            b = None if b is None else torch.cat([b[0::2], b[1::2]])
    return _fp8.FP8GatedFFN(w, b, d.weight, d.bias, g, recipe=recipe), None


_fp8._CONVERTERS.append(convert_patched)
