"""ffn_ext.quantize_fp8 on the MLPs patch_model patched: each form converts its own (Form.fp8: the dense gated and
packed MLPs become FP8GatedFFN, the classic ones FP8FFN, from the plan the patch recorded on the module and its
gating now). Everything else that is an MLP, or already FP8, is named with the reason (registered as a converter of
ffn_ext.fp8)."""

from __future__ import annotations

import torch.nn as nn

from .. import fp8 as _fp8
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


def _finegrained(m) -> bool:
    t = type(m)
    return t.__name__ == "FP8Linear" and t.__module__.startswith("transformers.")


def convert_patched(m: nn.Module, recipe: str):
    """(FP8 module, None), (None, why not) or (None, None) (not an MLP, nor FP8) for ffn_ext.fp8's walk."""
    patched = m.__dict__.get(MARK)
    if patched is None and not _finegrained(m) and identify(m) is None:
        return None, None
    if any(_finegrained(s) for s in m.modules()):
        return None, FINEGRAINED_FP8
    if patched is None:
        return None, _NOT_PATCHED
    return patched.form.fp8(m, patched.plan, recipe)


_fp8._CONVERTERS.append(convert_patched)
