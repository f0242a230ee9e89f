"""ffn_ext.quantize_fp8 on the MLPs patch_model patched: the dense gated and packed MLPs become FP8GatedFFN, the
classic ones (nn.Linear, FalconLinear or GPT-2's Conv1D projections) FP8FFN, each from the form the patch recorded
on the module (its mark, the activation attribute, the bound forward's projection names). Everything else that is
an MLP, or already FP8, is named with the reason (registered as a converter of ffn_ext.fp8)."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn

from .. import fp8 as _fp8
from .. import ops as _ops
from .classic import _inline, _layout
from .common import _GATED_NAMES, _MARK, _act_now, _BoundForward, _Clamp, _gate_state
from .dense import _kind
from .experts import _is_experts
from .recognise import Form, mlp_form, pair_form

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
    "experts": "MoE experts modules (3-D expert weights): ffn_ext has no FP8 grouped GEMM",
    "experts_gate": "MoE experts modules (3-D expert weights): ffn_ext has no FP8 grouped GEMM",
    "activation": (
        "its activation is no longer one ffn_ext computes, or carries hooks (replaced or hooked since patching)"
    ),
    "projections": "its projections are not plain nn.Linear (or GPT-2's Conv1D) modules without hooks",
}


def _finegrained(m) -> bool:
    t = type(m)
    return t.__name__ == "FP8Linear" and t.__module__.startswith("transformers.")


def _bound(module):
    """The _BoundForward patch_model set (as forward, or under accelerate's hook as _old_forward), or None."""
    d = module.__dict__
    return next((d[a] for a in ("forward", "_old_forward") if isinstance(d.get(a), _BoundForward)), None)


def _weight(proj, layout):
    """A projection's weight as [out, in] (Conv1D stores [in, out])."""
    return proj.weight.t() if layout == "conv1d" else proj.weight


def convert_patched(m: nn.Module, recipe: str):
    """(FP8 module, None), (None, why not) or (None, None) (not an MLP, nor FP8) for ffn_ext.fp8's walk."""
    if _finegrained(m):
        return None, FINEGRAINED_FP8
    mark = getattr(m, _MARK, None)
    if not mark:
        if _is_experts(m) or _kind(m) is not None or _inline(m) or isinstance(mlp_form(m), Form) or pair_form(m):
            if any(_finegrained(s) for s in m.modules()):
                return None, FINEGRAINED_FP8
            return None, _NOT_PATCHED
        return None, None
    if mark not in ("gated", "packed", "classic"):
        return None, _REASONS.get(mark, f"patched as {mark!r}, a form quantize_fp8 does not convert")
    fwd = _bound(m)
    if fwd is None:
        return None, _REASONS["projections"]
    mods: dict[str, Any] = dict(m.named_children())
    names = (fwd.names or _GATED_NAMES)[:3] if mark == "gated" else fwd.names[:2]  # classic: (fc1, fc2, drop)
    projs = [mods[n] for n in names]
    if any(_finegrained(p) for p in projs):
        return None, FINEGRAINED_FP8
    # the gating, read now: a clamped MLP's limit and alpha are frozen into the FP8 module
    state = _act_now(m) if fwd.gate is None else _gate_state(m, fwd.gate)
    if state is None:
        return None, _REASONS["activation"]
    if isinstance(state, _Clamp):
        activation, params, order = "swiglu_clamped", dict(state._asdict()), state.layout
        del params["layout"]
    else:
        activation, params = state.name, {}
        order = fwd.names[2] if mark == "packed" and len(fwd.names) > 2 else "concat"
    layout = _layout(*projs) if mark == "classic" else ("linear" if all(type(p) is nn.Linear for p in projs) else None)
    if layout is None:
        return None, _REASONS["projections"]
    if mark == "classic":
        fc1, fc2 = projs[0], projs[1]
        act = functools.partial(_ops.call_op, activation)
        return _fp8.FP8FFN(_weight(fc1, layout), fc1.bias, _weight(fc2, layout), fc2.bias, act, recipe), None
    if mark == "gated":
        g, u, d = projs
        w = torch.cat([g.weight, u.weight])
        b = None if g.bias is None else torch.cat([g.bias, u.bias])
    else:  # packed: [gate | up], or interleaved rows (the _Gate's layout) reordered to it once
        gu, d = projs[0], projs[1]
        w, b = gu.weight, gu.bias
        if order == "interleaved":
            w = torch.cat([w[0::2], w[1::2]])
            b = None if b is None else torch.cat([b[0::2], b[1::2]])
    return _fp8.FP8GatedFFN(w, b, d.weight, d.bias, activation, params, recipe), None


_fp8._CONVERTERS.append(convert_patched)
