"""Hugging Face interop: make a loaded `transformers` model's MLPs run on ffn_ext, in place: the gated MLPs (SwiGLU,
GeGLU, clamped SwiGLU; ffn_ext/hf/dense.py, clamped.py), the MoE experts (experts.py) and the classic FFN
fc2(act(fc1(x))) (classic.py: GPT-2, GPT-NeoX, Falcon, Phi, StarCoder2, CLIP/SigLIP, ViT, the VLMs' vision MLPs, ...,
and the BERT-style *Intermediate / *Output pairs at their layer's feed_forward_chunk).

    model = AutoModelForCausalLM.from_pretrained(...)
    n = ffn_ext.hf.patch_model(model)      # == ffn_ext.patch_hf_model(model); returns the number patched

What is patched: the MLPs that compute exactly down_proj(act(gate_proj(x)) * up_proj(x)), or the packed form
out(act(gate) * up) with gate, up = proj(x).chunk(2, -1) (Phi-3's gate_up_proj / down_proj; Granite MoE's shared
experts' input_linear / output_linear: ``_PACKED_NAMES``), with nn.Linear projections and `act` (the module's act_fn
or activation_fn; Granite's activation) one of the activations of ffn_ext's table (ffn_ext/table.py):

    silu       nn.SiLU, ffn_ext.SiLU, F.silu, ffn_ext.silu; transformers' SiLUActivation (ACT2FN "silu"; "swish"
               is nn.SiLU)
    gelu       nn.GELU(), ffn_ext.GELU(), F.gelu, ffn_ext.gelu; transformers' GELUActivation (ACT2FN "gelu" and
               "gelu_python": the exact erf GELU)
    gelu_tanh  nn.GELU(approximate="tanh"), ffn_ext.GELU(approximate="tanh"); transformers' GELUTanh (alias
               PytorchGELUTanh; ACT2FN "gelu_pytorch_tanh", "gelu_python_tanh"), NewGELUActivation ("gelu_new"),
               AccurateGELUActivation ("gelu_accurate"), FastGELUActivation ("gelu_fast"): the same function,
               0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), written four ways (gelu_fast writes sqrt(2/pi) as
               0.7978845608, the same float32 number)

and every other entry of the table (relu, relu2, quick_gelu, ... as the table has them), through the same sources:
torch's nn.ReLU / F.relu / torch.relu where the table has relu, and transformers' classes read from its own ACT2CLS
(the transformers.activations the class comes from; transformers itself is never imported here): a class is an
entry's when every ACT2CLS name it is registered under is in that entry's ``hf_names`` (common._hf_entry;
tests/test_hf.py checks this against ACT2CLS and ACT2FN numerically). Not patched, named in the warning: any other
activation, e.g. one of transformers' the table lacks ("gelu_10", ClippedGELUActivation, a clamped GELU; "mish";
"xielu"): named, never substituted. Nor
gatings that clamp the activation's output, clamp(act_fn(gate), max=limit) * clamp(up, -limit, limit), which no
ffn_ext op computes (``_CLAMP_AFTER``: Step-3.7's Step3p7MLP and Step3p7Experts, and any class that sets
transformers' _fp8_experts_clamp_after_activation = True): named with that reason, also when listed in
extra_classes. Nor the packed MLPs of ``_NAMED``, named with what they compute that ffn_ext does not, also when
listed in extra_classes: ModernBERT's ModernBertMLP and ModernBertDecoderMLP, Wo(drop(act(h[..., :I]) * h[..., I:]))
with h = Wi(x) (a dropout between the gating and the projection back, which ffn_ext's fused MLP lacks; not patched
even where the dropout is inactive), and Moonshine's MoonshineDecoderMLP and MoonshineStreamingDecoderMLP,
fc2(h[..., :I] * act(h[..., I:])) with h = fc1(x) (the up half first; ffn_ext's packed ops take the gate half first).
Their pairs of names (Wi / Wo, fc1 / fc2: ``_SHAPED_FORMS``) make a module MLP-shaped only with a packed MLP's
shapes (to [..., 2I] and back), so classic MLPs fc2(act(fc1(x))) (CLIP, ViT, Moonshine's encoder, ...) are not
named as gated ones: classic.py patches them (see its docstring).

Which modules: those of the transformers classes known to have exactly that forward (``_KNOWN``: Llama, Qwen2/3,
Mistral, DeepSeek-V3, OLMo, Granite, ... with SiLU; Gemma, Gemma2, Gemma3, Gemma4 text, VaultGemma,
RecurrentGemma, ... with the tanh GELU of their configs; Phi-3 packed; GraniteMoeSharedMLP, GraniteMoeSWAMLP and
GraniteMoeHybridMLP packed under their own names; all checked against transformers' source by tests/test_hf.py, which
also checks that the list has every class of those forms, whatever its attribute names, and the same for _NAMED's
forms), and of the classes passed as
``extra_classes`` (your own MLPs of that form; subclasses that do not override forward count too). Modules that
only look like one (the same submodules, but extra multipliers, clamps, norms, dropout or adapters in forward) or
whose activation is not one of the above are left alone with one RuntimeWarning naming their classes (and the
activation), or refused with ValueError if strict=True (then nothing is patched). Self-check: before patching, a
module whose parameters are plain, materialized floating tensors (not meta / offloaded, quantized or sharded) and
that carries no hooks or forward wrappers is run both ways on two random rows (no_grad, its device and dtype, a
private generator); a mismatch leaves it unpatched the same way.

Clamped SwiGLU MLPs (``_KNOWN_CLAMPED``: DeepseekV4MLP, Glm5NextTextMLP, Glm5NextVisionMLP, MiniMaxM3VLDenseMLP):
down_proj of (clamp(up, -limit, limit) + up_offset) * g * sigmoid(alpha * g), g = clamp(gate, max=limit), with limit
(and alpha) read from the module at each call; the patched forward runs the projections as modules around
ffn_ext.swiglu_clamped (packed: swiglu_clamped_packed). Their activation, where they have one, must be a SiLU.

MoE experts (``_EXPERTS``, 70 transformers classes): the modules holding a layer's routed experts as 3-D parameters
(gate_up_proj [E, 2I, H], down_proj; JetMoeMoE: in JetMoeParallelExperts submodules), whose gating of the [S, 2I]
projection is one ffn_ext op: act_fn(gate) * up with act_fn of the table (Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3,
JetMoE, ...: gated_packed), or clamped (swiglu_clamped_packed: GPT-OSS's interleaved halves with alpha 1.702 and
up + 1; DeepSeek-V4's, GLM-5-Next's, ...). transformers' @use_experts_implementation classes reach the gating through
``_apply_gate`` under grouped_mm, batched_mm and deepgemm, and through their own forward under "eager"
(config._experts_implementation): the instance's _apply_gate is replaced (_BoundGate) and, where the class's forward
inlines the gating (``act_fn(gate) * up`` on a chunk), the instance's forward too (_BoundExperts: the same loop with
the fused gating while the implementation is "eager", the class's forward otherwise); classes without that switch
(Llama 4, LongCat, DBRX, Inkling's shared experts, JetMoE's MoE layer, whose forward routes and gates: not
JetMoeMoA, its attention experts, which have no gating) get a replaced forward. Gated experts modules (a subclass of
a class of the list, has_gate, an _apply_gate, or 3-D gate parameters) that are not in the list (or whose activation
or limit ffn_ext cannot take) are named in the warning, as are MLPs; experts that are not gated (act(up), NemotronH)
are not, like non-gated MLPs. The experts' self-check runs the class's gating code and the op on a random projection
(float32 on the CPU: the gating has no parameters), scaled past the clamp limit.

The patch replaces the MLP instance's ``forward`` (no class swap, no weight copy): the parameters stay the same
objects, state_dict / save_pretrained are unchanged, deepcopy and pickling keep the patch. Called with one tensor
(positionally or by the name of the original forward's parameter: x, hidden_state(s)), the new forward runs
ffn_ext.mlp.gated_mlp / gated_mlp_packed with the activation's table entry (the fused gated op; training saves x
and the projections and recomputes h in backward), or, when a projection is not a plain nn.Linear (LoRA, quantized)
or carries hooks or a forward wrapper (accelerate's add_hook_to_module, which loads offloaded weights), calls the
projections as modules with the fused gated op (ffn_ext.gated) in between. The activation is looked up at each
call: the fused forms never call the activation module, so when it carries hooks (or global module hooks are set)
or a forward wrapper, or it was replaced after patching by something that is not one of the activations above,
and for any other call signature, the MLP runs its original forward: the class's, or the forward wrapper the
instance had when it was patched (then always that one). An activation replaced by another of the table's is
fused with that one.
``unpatch_model`` restores the original forward (and removes the experts' instance _apply_gate). transformers
itself is not imported here.
"""

from __future__ import annotations

# The names below stay importable from ffn_ext.hf: tests read the class lists, and models pickled with a patch refer
# to the bound forwards and their functions by these paths.
from .clamped import _CLAMP_AFTER, _KNOWN_CLAMPED, _clamped_forward, _clamped_packed_forward  # noqa: F401
from .common import _ACT, _GATED_NAMES, _HF_ENTRIES, _MARK, _PLAIN, _BoundForward, _Gate, _table_activation  # noqa: F401
from .dense import (  # noqa: F401
    _DROPOUT_BETWEEN,
    _KNOWN,
    _NAMED,
    _PACKED_FORMS,
    _PACKED_NAMES,
    _SHAPED_FORMS,
    _UNKNOWN,
    _UP_FIRST,
    _gated_forward,
    _kind,
    _packed_forward,
)
from .experts import _EXPERTS, _FORMS, _BoundExperts, _BoundGate, _is_experts  # noqa: F401
from .patch import patch_model, unpatch_model

__all__ = ["patch_model", "unpatch_model"]
from . import fp8  # noqa: F401,E402  (registers quantize_fp8's converter of the patched MLPs)
