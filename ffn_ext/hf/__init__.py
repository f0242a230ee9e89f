"""Hugging Face interop: make a transformers model's MLPs run on ffn_ext, in place, where ffn_ext can show they
compute a form it has (docs/hf.md says it for users):

    model = AutoModelForCausalLM.from_pretrained(...)
    n = ffn_ext.hf.patch_model(model)      # == ffn_ext.patch_hf_model(model); returns the number patched

By structure, not by name: a module's code is read symbolically (recognise.py) and matched by the forms of one
registry (forms.FORMS, a class each: the gated MLP and its packed form, clamped or not, the classic FFN, the
BERT-style pair, the experts' gating), with an activation of ffn_ext's table (common.table_activation), then checked
against the module's own code over every regime (common.self_check). What is not patched but looks like an MLP is
named in one RuntimeWarning (strict=True: ValueError). The patch (forms.Patched) replaces one method on the instance,
no class swap, no weight copy, and runs the original wherever the activation has been hooked or replaced or the
recognised code's `if` tests would read otherwise. experts_implementation="ffn_ext" (moe.py) runs the routed experts
on ffn_ext. transformers itself is not imported here.
"""

from __future__ import annotations

from . import (
    fp8,  # noqa: F401  (registers quantize_fp8's converter of the patched MLPs)
    moe,
)
from .patch import patch_model, unpatch_model

__all__ = ["patch_model", "unpatch_model"]

moe.register_when_imported()  # experts_implementation="ffn_ext", without importing transformers here
