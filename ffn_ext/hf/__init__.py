"""Hugging Face interop: make a transformers model's MLPs run on ffn_ext, in place, where ffn_ext can show they
compute a form it has (docs/hf.md says it for users):

    model = AutoModelForCausalLM.from_pretrained(...)
    n = ffn_ext.hf.patch_model(model)      # == ffn_ext.patch_hf_model(model); returns the number patched

Recognised by structure, not by name (recognise.py): each module's forward (an experts module's _apply_gate, a
BERT-style layer's feed_forward_chunk) is read with ast and run symbolically on the instance; the value it returns
is matched to a form: the gated MLP down(act(gate(x)) * up(x)) and its packed form (dense.py), the clamped SwiGLU
(clamped.py), the classic fc2(act(fc1(x))) and the BERT-style pair (classic.py), and the experts' gating
(experts.py); the activation must be one of ffn_ext's table (common._table_activation: torch's, ffn_ext's and
transformers' activation classes, the latter by its own ACT2CLS and the entries' hf_names). Forms that no ffn_ext op
computes (a clamp after the activation, the up half first, a dropout between the gating and the projection back)
and MLP-shaped modules whose code is not recognised are named in one RuntimeWarning (strict=True: ValueError).

Checked where it can be wrong (common._check, experts._check_gate): before patching, the fused form and the
module's own code run on the same rows scaled across the activation's range and past every limit-like number on
the module or its config, in the module's dtype, forward and, where it trains, backward. A difference leaves it
unpatched and named; a check that could not run (meta weights, hooks) or gave nothing finite leaves the code's
evidence alone, which suffices for recognised code and not for extra_classes.

The patch replaces the instance's forward (or _apply_gate, or feed_forward_chunk): no class swap, no weight copy;
state_dict, save_pretrained, deepcopy and pickling keep working. The patched code checks at each call that the
activation may still be bypassed (no hooks, not replaced) and that the attributes the recognised code's `if` tests
read still hold; otherwise the original runs. MoE experts: only the gating is injected, where transformers calls it
(_apply_gate); experts_implementation="ffn_ext" (moe.py) runs the routed experts on ffn_ext with a lean autograd.
``unpatch_model`` restores the originals. transformers itself is not imported here.
"""

from __future__ import annotations

# The names below stay importable from ffn_ext.hf: models pickled with a patch refer to the bound forwards and their
# functions by these paths.
from .clamped import _clamped_forward, _clamped_packed_forward  # noqa: F401
from .common import _ACT, _GATED_NAMES, _HF_ENTRIES, _MARK, _PLAIN, _BoundForward, _Gate, _table_activation  # noqa: F401
from .dense import _gated_forward, _kind, _packed_forward  # noqa: F401
from .experts import _BoundGate, _is_experts  # noqa: F401
from .patch import patch_model, unpatch_model

__all__ = ["patch_model", "unpatch_model"]
from . import (
    fp8,  # noqa: F401,E402  (registers quantize_fp8's converter of the patched MLPs)
    moe,  # noqa: E402
)

moe.register_when_imported()  # experts_implementation="ffn_ext", without importing transformers here
