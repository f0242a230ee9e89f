"""Hugging Face interop: make a loaded `transformers` model's gated MLPs (SwiGLU, GeGLU, clamped SwiGLU) and MoE
experts run on ffn_ext, in place.

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

(transformers classes are recognised by class name in transformers.activations and the ACT2FN name they stand for,
which the table's ``hf_names`` must list; tests/test_hf.py checks each against transformers' ACT2FN numerically).
Not patched, named in the warning: any other activation, e.g. transformers' QuickGELUActivation ("quick_gelu",
x sigmoid(1.702 x), not a GELU ffn_ext implements), ClippedGELUActivation ("gelu_10", a clamped GELU), ReLU. Nor
gatings that clamp the activation's output, clamp(act_fn(gate), max=limit) * clamp(up, -limit, limit), which no
ffn_ext op computes (``_CLAMP_AFTER``: Step-3.7's Step3p7MLP and Step3p7Experts, and any class that sets
transformers' _fp8_experts_clamp_after_activation = True): named with that reason, also when listed in
extra_classes. Nor the packed MLPs of ``_NAMED``, named with what they compute that ffn_ext does not, also when
listed in extra_classes: ModernBERT's ModernBertMLP and ModernBertDecoderMLP, Wo(drop(act(h[..., :I]) * h[..., I:]))
with h = Wi(x) (a dropout between the gating and the projection back, which ffn_ext's fused MLP lacks; not patched
even where the dropout is inactive), and Moonshine's MoonshineDecoderMLP and MoonshineStreamingDecoderMLP,
fc2(h[..., :I] * act(h[..., I:])) with h = fc1(x) (the up half first; ffn_ext's packed ops take the gate half first).
Their pairs of names (Wi / Wo, fc1 / fc2: ``_SHAPED_FORMS``) make a module MLP-shaped only with a packed MLP's
shapes (to [..., 2I] and back), so plain MLPs act(fc1(x)) (CLIP, ViT, Moonshine's encoder, ...) are not named.

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

import inspect
import math
import warnings
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import ops as _ops
from .mlp import _options, fusable, gated_mlp, gated_mlp_packed, linear_args
from .modules import GELU, SiLU
from .table import ACTIVATIONS, BY_NAME

__all__ = ["patch_model", "unpatch_model"]

_MARK = "_ffn_ext_patched"  # 'gated' | 'packed' (MLPs) | 'experts' (forward, maybe _apply_gate) | 'experts_gate'
_ACT = "_ffn_ext_act"        # (attribute name of the activation, the activation patched over)
_OPTS = "_ffn_ext_mlp_options"  # (recompute, token_chunk) of a patched gated/packed MLP: patch_model's arguments

# transformers classes whose forward is exactly down_proj(act(gate_proj(x)) * up_proj(x)) (gated), or
# down_proj(act(gate) * up) with gate, up = gate_up_proj(x).chunk(2, -1) (packed: the last two lines; the last one
# under the names of _PACKED_NAMES), with `act` the attribute act_fn or activation_fn (_PACKED_NAMES: its own) that
# __init__ sets to ACT2FN[...] or nn.SiLU(), as of transformers 5.24; the activation itself is identified at patch
# time (_table_activation). tests/test_hf.py::test_known_classes_compute_plain_gated_mlp checks each against the
# source, and that no class of those forms, under any attribute names, is missing.
_KNOWN = frozenset("""
    AXK1MLP AXK2MLP AfmoeMLP Aimv2MLP AriaSharedExpertsMLP BailingHybridMLP BambaMLP BltMLP ChameleonMLP Cohere2MLP
    Cohere2MoeMLP CohereCompassMLP CohereMLP CsmMLP CwmMLP DINOv3ViTGatedMLP DeepseekOcr2TextMLP
    DeepseekOcr2VisionMLP DeepseekV2MLP DeepseekV32MLP DeepseekV3MLP Deimv2SwiGLUFFN DiffLlamaMLP
    DiffusionGemmaText4MLP Dinov2SwiGLUFFN Dinov2WithRegistersSwiGLUFFN DogeMLP Dots1MLP Dots3NoteTextMLP
    Dots3NoteVisionMLP EmbeddingGemma2MLP Emu3MLP EomtDinov3GatedMLP EomtSwiGLUFFN Ernie4_5MLP Ernie4_5_MoeMLP
    Ernie4_5_VLMoeMLP EsmcMLP EuroBertMLP EvollaMLP Exaone4MLP Exaone4_5_MLP ExaoneMoeMLP FlexOlmoMLP FlintMLP
    Gemma2MLP Gemma3MLP Gemma4TextMLP Gemma4UnifiedTextMLP Gemma4VisionMLP GemmaMLP Glm4MoeLiteMLP Glm4MoeMLP
    Glm4VisionMlp Glm4vMoeTextMLP Glm4vMoeisionMlp GlmMoeDsaMLP GlmOcrVisionMlp Granite4VisionTextMLP
    GraniteDoclingTextMLP GraniteMLP GraniteSWAMLP HYV3MLP HYV4MLP HYV4VLMLP HeliumMLP HiggsAudioV2MLP HrmTextMLP
    HunYuanDenseV1MLP HunYuanMoEV1MLP HunYuanVLMLP HyperCLOVAXMLP Idefics2MLP IdeficsMLP JambaMLP KimiLinearMLP
    Kolibri1MLP LagunaMLP LaraMiniMLP Llama4TextMLP LlamaMLP LongcatFlashMLP MellumMLP MiMoV2FlashMLP MiniCPM3MLP
    Ministral3MLP MinistralMLP Mistral4MLP MistralLarge4TextMLP MistralMLP MllamaTextMLP Molmo2ImageProjectorMLP
    Molmo2MLP MoonshinMoonshineStreamingDecoderMLP MuseGlimmerAssistantMLP MuseGlimmerTextMLP MuseSparkTextMLP
    NomicBertMLP Olmo2MLP Olmo3MLP OlmoHybridMLP OlmoMLP OlmoeMLP Ovis2MLP Ovis2VisionMLP PaddleOCRMLP
    PeAudioEncoderMLP PeAudioVideoEncoderMLP PeVideoEncoderMLP PixtralMLP Qwen2MLP Qwen2MoeMLP Qwen2_5OmniMLP
    Qwen2_5_VLMLP Qwen3MLP Qwen3MoeMLP Qwen3NextMLP Qwen3OmniMoeCode2WavMlp Qwen3OmniMoeMLP
    Qwen3OmniMoeTalkerTextMLP Qwen3OmniMoeThinkerTextMLP Qwen3VLMoeTextMLP Qwen3VLTextMLP Qwen3_5MLP Qwen3_5MoeMLP
    Qwen4ExpTextMLP RadioSwiGLUFFN RecurrentGemmaMlp RfDetrDinov2SwiGLUFFN Sapiens2GatedMLP SmolLM3MLP SolarOpenMLP
    StableLmMLP Tipsv2VisionSwiGLUFFN UltrabertMLP UnlimitedOcrTextMLP VaultGemmaMLP VibeVoiceMLP VideomtGatedMLP
    VideomtSwiGLUFFN VoxtralRealtimeMLP VoxtralRealtimeTextMLP YoutuMLP ZambaMLP
    DiaMLP Dots3NoteAudioMLP EsmFold2SwiGLU Glm4MLP Glm4vTextMLP GlmImageTextMLP GlmMLP GlmOcrTextMLP Phi3MLP
    Phi4MultimodalMLP
    GraniteMoeHybridMLP GraniteMoeSWAMLP GraniteMoeSharedMLP
""".split())

# Packed MLPs of _KNOWN whose attributes are not Phi-3's gate_up_proj / down_proj / activation_fn (or act_fn):
# class -> (the nn.Linear to [..., 2I], gate half first; the nn.Linear back; the activation). Modules with nn.Linear
# children of one of these pairs of names are MLP-shaped (_kind): patched when known, else named in the warning.
_PACKED_NAMES = {
    "GraniteMoeSharedMLP": ("input_linear", "output_linear", "activation"),  # the shared experts of Granite MoE
    "GraniteMoeSWAMLP": ("input_linear", "output_linear", "activation"),
    "GraniteMoeHybridMLP": ("input_linear", "output_linear", "activation"),  # Granite 4.0
}
# Packed MLPs of transformers 5.24 that compute what no ffn_ext op does, named in the warning with the reason (whatever
# extra_classes says: their forward is known; subclasses that keep it too): class -> (the nn.Linear to [..., 2I], the
# nn.Linear back, the activation, why). tests/test_hf.py::test_named_packed_lookalikes_have_their_form checks each
# against the source, and that no class of these forms, under any attribute names, is missing.
_DROPOUT_BETWEEN = ("packed gated MLPs with dropout between the gating and the projection back, "
                    "Wo(drop(act(h[..., :I]) * h[..., I:])), h = Wi(x) (ModernBERT, ModernBERT decoder): ffn_ext's "
                    "fused MLP has no dropout, so they are not patched, even where the dropout is inactive (they run "
                    "as they are, unaccelerated)")
_UP_FIRST = ("packed gated MLPs whose projection gives the up half first, fc2(h[..., :I] * act(h[..., I:])), h = "
             "fc1(x) (Moonshine's decoder MLPs): ffn_ext's packed ops take the gate half first (they run as they "
             "are, unaccelerated)")
_NAMED = {
    "ModernBertMLP": ("Wi", "Wo", "act", _DROPOUT_BETWEEN),
    "ModernBertDecoderMLP": ("Wi", "Wo", "act", _DROPOUT_BETWEEN),
    "MoonshineDecoderMLP": ("fc1", "fc2", "activation_fn", _UP_FIRST),
    "MoonshineStreamingDecoderMLP": ("fc1", "fc2", "activation_fn", _UP_FIRST),
}
# (projection to [..., 2I], projection back, activation attributes in the order looked for): Phi-3's, then the others
_PACKED_FORMS = (("gate_up_proj", "down_proj", ("activation_fn", "act_fn")),) + tuple(dict.fromkeys(
    (proj, out, (act,)) for proj, out, act in _PACKED_NAMES.values()))
# the pairs of _NAMED: MLP-shaped only with a packed MLP's shapes (fc1 / fc2 also name plain MLPs, act(fc1(x)):
# CLIP, ViT, Whisper, Moonshine's encoder, ..., which have no gating and are none of this patch's business)
_SHAPED_FORMS = tuple(dict.fromkeys((proj, out, (act,)) for proj, out, act, _ in _NAMED.values()
                                    if (proj, out) not in {f[:2] for f in _PACKED_FORMS}))
_GATED_NAMES = ("gate_proj", "up_proj", "down_proj")

# why a module that looks like a gated MLP was left unpatched (the keys of patch_model's warning)
_UNKNOWN = ("not known to compute exactly down_proj(act_fn(gate_proj(x)) * up_proj(x)) (their forward may add "
            "multipliers, clamps, norms, dropout or adapters); if a class does, pass it in extra_classes=[...]")
_DISAGREES = ("their forward gave a different result from the fused gated MLP on a random input (self-check), so "
              "it is not a plain gated MLP and must run as it is")


class _Gate(NamedTuple):
    """A gating that one ffn_ext op computes: act(gate) * up with `act` a table entry, or, with a `limit`, the
    clamped SwiGLU (clamp(up, -limit, limit) + up_offset) * g * sigmoid(alpha * g), g = clamp(gate, max=limit)
    (ffn_ext.swiglu_clamped). Packed projections are split by `layout`."""
    act: str | None = "act_fn"   # the attribute holding the activation (clamped: must be SiLU); None: SiLU written out
    limit: str | None = None     # the attribute holding the clamp limit; None: no clamp
    alpha: str | float = 1.0     # the attribute holding alpha, or its value
    up_offset: float = 0.0
    layout: str = "concat"       # of a packed [..., 2I] projection: "concat" [gate | up] or "interleaved" [g0, u0, ...]


_PLAIN = _Gate()

# transformers MLP classes with nn.Linear projections (gate_proj/up_proj/down_proj, or packed gate_up_proj/down_proj)
# whose forward is down_proj of a clamped SwiGLU, with the _Gate it computes (tests/test_hf_moe.py checks the source)
_KNOWN_CLAMPED = {
    "DeepseekV4MLP": _Gate(limit="limit"),                # the shared expert; act_fn = ACT2FN[hidden_act], SiLU
    "Glm5NextTextMLP": _Gate(limit="swiglu_limit"),
    "Glm5NextVisionMLP": _Gate(limit="swiglu_limit"),
    "MiniMaxM3VLDenseMLP": _Gate(act=None, limit="swiglu_limit", alpha="swiglu_alpha", up_offset=1.0),
}

# transformers 5.24 MoE experts classes whose gating is one ffn_ext op: name -> (_Gate, form). Forms: how the class's
# own (eager) forward reaches the gating, so what the patch replaces:
#   gate         it calls self._apply_gate (GPT-OSS, DeepSeek-V4, ...): only _apply_gate is patched
#   linear       @use_experts_implementation classes whose eager loop inlines gate, up = F.linear(x, gate_up_proj[e])
#                .chunk(2, -1); act_fn(gate) * up; transformers' default _apply_gate (the same gating) serves its other
#                implementations: both are patched (matmul: x @ gate_up_proj[e], is_transposed; linear_norm: with the
#                post_expert_norm)
#   llama4, longcat, dbrx, shared, jetmoe   classes without an experts implementation switch: forward is patched
#                (jetmoe: JetMoE's MoE layer, router and experts in one, its experts' [S, 2I] projection from
#                JetMoeParallelExperts submodules)
# tests/test_hf_moe.py checks each against transformers' source, and that no class of these forms is missing.
_GPT_OSS = _Gate(act=None, limit="limit", alpha="alpha", up_offset=1.0)
_EXPERTS = {
    **{name: (_PLAIN, "linear") for name in """
        AXK1Experts AXK2Experts AfmoeExperts BailingHybridExperts Cohere2MoeExperts DeepseekOcr2TextExperts
        DeepseekV2Experts DeepseekV32Experts DeepseekV3Experts DiffusionGemmaTextExperts Dots1Experts Dots3NoteExperts
        Ernie4_5_MoeExperts Ernie4_5_VLMoeMoeExperts ExaoneMoeExperts FlexOlmoExperts FlintExperts Gemma4TextExperts
        Glm4MoeExperts Glm4MoeLiteExperts Glm4vMoeTextExperts GlmMoeDsaExperts GraniteMoeExperts
        GraniteMoeHybridExperts GraniteMoeSWAExperts GraniteMoeSharedExperts HYV3Experts HunYuanMoEV1Experts
        InklingExperts JambaExperts KimiLinearExperts Kolibri1Experts LagunaExperts LaraMiniExperts Lfm2MoeExperts
        MellumExperts MiMoV2FlashExperts MiniMaxExperts MiniMaxM2Experts Mistral4Experts MistralLarge4TextExperts
        MixtralExperts OlmoeExperts PhimoeExperts Qwen2MoeExperts Qwen3MoeExperts Qwen3NextExperts
        Qwen3OmniMoeTalkerTextExperts Qwen3OmniMoeThinkerTextExperts Qwen3VLMoeTextExperts Qwen3_5MoeExperts
        Qwen4ExpTextExperts SolarOpenExperts UnlimitedOcrTextExperts ZayaExperts
    """.split()},
    "AriaExperts": (_PLAIN, "matmul"),
    "MuseSparkExperts": (_PLAIN, "linear_norm"),
    "BeamExperts": (_PLAIN, "gate"),  # act_fn(gate.float()) * up.float(), rounded once: what ffn_ext computes
    "GptOssExperts": (_GPT_OSS._replace(layout="interleaved"), "gate"),
    "OpenAIPrivacyFilterExperts": (_GPT_OSS, "gate"),
    "MiniMaxM3VLExperts": (_Gate(act=None, limit="swiglu_limit", alpha="swiglu_alpha", up_offset=1.0), "gate"),
    "DeepseekV4Experts": (_Gate(limit="limit"), "gate"),
    "Glm5NextTextExperts": (_Gate(act=None, limit="swiglu_limit"), "gate"),
    "HYV4Experts": (_Gate(act=None, limit="swiglu_limit"), "gate"),
    "HYV4VLExperts": (_Gate(act=None, limit="swiglu_limit"), "gate"),
    "Llama4TextExperts": (_PLAIN, "llama4"),
    "LongcatFlashExperts": (_PLAIN, "longcat"),
    "DbrxExpertGLU": (_Gate(act="activation_fn"), "dbrx"),
    "InklingSharedExperts": (_PLAIN, "shared"),
    "JetMoeMoE": (_Gate(act="activation"), "jetmoe"),  # not JetMoeMoA (attention experts: no gating)
}

_UNKNOWN_EXPERTS = ("MoE experts modules whose gating ffn_ext does not compute or that are not known to it (their "
                    "routed experts run as they are, unaccelerated)")
_CLAMPS_AFTER = ("gated MLPs and experts that clamp the activation's output, down(clamp(act_fn(gate), max=limit) * "
                 "clamp(up, -limit, limit)) (Step-3.7; transformers' _fp8_experts_clamp_after_activation): ffn_ext's "
                 "clamped SwiGLU clamps the gate before the activation, silu(clamp(gate, max=limit)), and no ffn_ext "
                 "op clamps after it (they run as they are, unaccelerated)")
# transformers 5.24 classes with the gated MLP modules' children (or experts' _apply_gate) whose gating clamps
# the activation's output (_CLAMPS_AFTER; tests/test_hf_moe.py checks the source and that none is missing); also
# any class that sets transformers' _fp8_experts_clamp_after_activation = True itself
_CLAMP_AFTER = frozenset({"Step3p7MLP", "Step3p7Experts"})
_DISAGREES_GATE = ("their gating gave a different result from ffn_ext's op on a random input (self-check), so it "
                   "must run as it is")


def _unsupported(act) -> str:
    what = type(act).__name__ if isinstance(act, nn.Module) or act is None else getattr(act, "__qualname__",
                                                                                         type(act).__name__)
    ours = "; ".join(f"{a.name}: {', '.join(a.hf_names)}" for a in ACTIVATIONS)
    return (f"activation {what} is not one ffn_ext implements (ffn_ext's, with the transformers ACT2FN names "
            f"that are the same function: {ours})")


# ---------------------------------------------------------------- which activation of the table is `act`?
_GELUS = {a.api[1]["approximate"]: a for a in ACTIVATIONS if a.api[0] == "gelu"}  # "none", "tanh" -> entry
_SILU = BY_NAME["silu"]
# transformers.activations classes -> the ACT2FN name whose function each computes (for every constructor argument
# ACT2FN passes); the table's hf_names says which entry that name is. As of transformers 5.24 (PytorchGELUTanh:
# GELUTanh's earlier name, now an alias); tests/test_hf.py checks these against ACT2FN.
_HF_CLASSES = {"SiLUActivation": "silu", "GELUActivation": "gelu", "GELUTanh": "gelu_pytorch_tanh",
               "PytorchGELUTanh": "gelu_pytorch_tanh", "NewGELUActivation": "gelu_new",
               "FastGELUActivation": "gelu_fast", "AccurateGELUActivation": "gelu_accurate"}
_HF_ENTRIES = {cls: a for cls, hf_name in _HF_CLASSES.items() for a in ACTIVATIONS if hf_name in a.hf_names}
_FUNCTIONS = ((F.silu, _SILU), (_ops.silu, _SILU), (F.gelu, _GELUS["none"]), (_ops.gelu, _GELUS["none"]))


def _table_activation(act):
    """The table entry (ffn_ext/table.py) that `act` computes, or None: nn.SiLU / nn.GELU(approximate) and
    ffn_ext's SiLU / GELU (these exact types: a subclass may compute something else), F.silu / F.gelu and ffn_ext's
    functions, and transformers' activation classes of _HF_CLASSES (matched by name and module, without importing
    transformers)."""
    cls = type(act)
    if cls is nn.SiLU or cls is SiLU:
        return _SILU
    if cls is nn.GELU or cls is GELU:
        return _GELUS.get(act.approximate)
    if cls.__module__ == "transformers.activations":
        return _HF_ENTRIES.get(cls.__name__)
    for fn, entry in _FUNCTIONS:
        if act is fn:
            return entry
    return None


def _act_now(self):
    """The table entry the fused kernels may stand in for the MLP's activation call with, else None: its
    activation (looked up now: it may have been replaced since patching) is one of the table's, and no hook or
    forward wrapper, on it or global, expects to see it run."""
    name = self.__dict__[_ACT][0]
    mods = self._modules
    act = mods[name] if name in mods else getattr(self, name, None)
    entry = _table_activation(act)
    if entry is None or (isinstance(act, nn.Module) and not fusable((), (act,))):
        return None
    return entry


_DEFAULT_OPTS = (False, None)


def _where(by_class: dict) -> str:
    """'Cls at 'name' and 3 more, ...' for class -> module names."""
    return ", ".join(f"{cls} at {names[0]!r}" + (f" and {len(names) - 1} more" if len(names) > 1 else "")
                     for cls, names in by_class.items())


def _gated_forward(self, x, act):
    mods = self._modules
    g, u, d = mods["gate_proj"], mods["up_proj"], mods["down_proj"]
    if fusable((g, u, d)):
        recompute, chunk = self.__dict__.get(_OPTS, _DEFAULT_OPTS)
        return gated_mlp(x, *linear_args(g, u, d), activation=act.name, recompute=recompute, token_chunk=chunk)
    return d(_ops.gated(g(x), u(x), act.name))


def _packed_forward(self, x, act, proj="gate_up_proj", out="down_proj"):
    mods = self._modules
    gu, d = mods[proj], mods[out]
    if fusable((gu, d)):
        recompute, chunk = self.__dict__.get(_OPTS, _DEFAULT_OPTS)
        return gated_mlp_packed(x, *linear_args(gu, d), activation=act.name, recompute=recompute,
                                token_chunk=chunk)
    return d(_ops.gated_packed(gu(x), act.name))



# ---------------------------------------------------------------- clamped SwiGLU and MoE experts
class _Clamp(NamedTuple):
    """The arguments of ffn_ext.swiglu_clamped(_packed) for a clamped _Gate, read from the module when it runs."""
    limit: float
    alpha: float
    up_offset: float
    layout: str


def _attr(module, name):
    mods = module._modules
    return mods[name] if name in mods else getattr(module, name, None)


def _real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)


def _gate_state(module, gate: _Gate):
    """What ffn_ext's op needs to stand in for `module`'s gating now, else None (then its own code runs): the table
    entry of its activation, which must run no hook (on it or global) and, clamped, be SiLU; or, clamped, the
    _Clamp of its current limit (a number > 0) and alpha (a finite number)."""
    entry = _SILU
    if gate.act is not None:
        act = _attr(module, gate.act)
        entry = _table_activation(act)
        if entry is None or (gate.limit is not None and entry is not _SILU) or (
                isinstance(act, nn.Module) and not fusable((), (act,))):
            return None
    if gate.limit is None:
        return entry
    limit = getattr(module, gate.limit, None)
    alpha = getattr(module, gate.alpha, None) if isinstance(gate.alpha, str) else gate.alpha
    if not (_real(limit) and limit > 0 and _real(alpha) and math.isfinite(alpha)):
        return None
    return _Clamp(float(limit), float(alpha), gate.up_offset, gate.layout)


def _gate_problem(module, gate: _Gate) -> str | None:
    """Why `module`'s gating (`gate`) cannot run on ffn_ext, or None (the patch-time form of _gate_state, which also
    lets hooks on the activation pass: with them the module's own code runs, call by call)."""
    if gate.act is not None:
        act = _attr(module, gate.act)
        entry = _table_activation(act)
        if entry is None:
            return _unsupported(act)
        if gate.limit is not None and entry is not _SILU:
            return (f"clamped gating with activation {type(act).__name__} ({entry.name}): ffn_ext's clamped op is "
                    "SiLU's")
    if gate.limit is not None:
        limit = getattr(module, gate.limit, None)
        alpha = getattr(module, gate.alpha, None) if isinstance(gate.alpha, str) else gate.alpha
        if not (_real(limit) and limit > 0):
            return f"clamp limit {gate.limit} = {limit!r} is not a number > 0"
        if not (_real(alpha) and math.isfinite(alpha)):
            return f"{gate.alpha} = {alpha!r} is not a finite number"
    return None


def _fused_gate(state, gate_up):
    """gate_up [..., 2I] -> [..., I] by ffn_ext's op, reading gate_up in place."""
    if isinstance(state, _Clamp):
        return _ops.swiglu_clamped_packed(gate_up, limit=state.limit, alpha=state.alpha, up_offset=state.up_offset,
                                          layout=state.layout)
    return _ops.gated_packed(gate_up, state.name)


def _own_gate(module, gate: _Gate, gate_up):
    """What the module's own code computes from gate_up: its class's _apply_gate, else (the classes that inline the
    gating: always the plain form, concat) act(gate) * up."""
    cls_gate = getattr(type(module), "_apply_gate", None)
    if cls_gate is not None:
        return cls_gate(module, gate_up)
    g, u = gate_up.chunk(2, dim=-1)
    return _attr(module, gate.act)(g) * u


def _clamped_forward(self, x, c):
    mods = self._modules
    g, u, d = mods["gate_proj"], mods["up_proj"], mods["down_proj"]
    return d(_ops.swiglu_clamped(g(x), u(x), limit=c.limit, alpha=c.alpha, up_offset=c.up_offset))


def _clamped_packed_forward(self, x, c, proj="gate_up_proj", out="down_proj"):
    mods = self._modules
    return mods[out](_fused_gate(c, mods[proj](x)))


# The replacement forwards of experts classes that inline their gating (_EXPERTS' forms): the class's own code with
# the gating by ffn_ext (state: from _gate_state), the rest as it was, operation for operation.
def _routed(self, state, hidden_states, top_k_index, top_k_weights, matmul=False, norm=False):
    final = torch.zeros_like(hidden_states)
    with torch.no_grad():
        mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert_idx in hit:
        expert_idx = expert_idx[0]
        if expert_idx == self.num_experts:
            continue
        top_k_pos, token_idx = torch.where(mask[expert_idx])
        current = hidden_states[token_idx]
        if matmul:
            current = _fused_gate(state, current @ self.gate_up_proj[expert_idx]) @ self.down_proj[expert_idx]
        else:
            current = F.linear(_fused_gate(state, F.linear(current, self.gate_up_proj[expert_idx])),
                               self.down_proj[expert_idx])
        if norm:
            current = self.post_expert_norm(current)
        current = current * top_k_weights[token_idx, top_k_pos, None]
        final.index_add_(0, token_idx, current.to(final.dtype))
    return final


def _routed_linear(self, state, hidden_states, top_k_index, top_k_weights):
    return _routed(self, state, hidden_states, top_k_index, top_k_weights)


def _routed_matmul(self, state, hidden_states, top_k_index, top_k_weights):
    return _routed(self, state, hidden_states, top_k_index, top_k_weights, matmul=True)


def _routed_linear_norm(self, state, hidden_states, top_k_index, top_k_weights):
    return _routed(self, state, hidden_states, top_k_index, top_k_weights, norm=True)


def _llama4_forward(self, state, hidden_states):
    hidden_states = hidden_states.view(self.gate_up_proj.shape[0], -1, self.hidden_size)
    gate_up = torch.bmm(hidden_states, self.gate_up_proj)
    return torch.bmm(_fused_gate(state, gate_up), self.down_proj).view(-1, self.hidden_size)


def _longcat_forward(self, state, hidden_states, top_k_index, top_k_weights):
    final = torch.zeros_like(hidden_states)
    if top_k_index.numel() == 0:
        return final
    mask = F.one_hot(top_k_index, num_classes=self.total_experts).permute(2, 1, 0)
    hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero(as_tuple=False)
    for expert_idx_tensor in hit:
        expert_idx = int(expert_idx_tensor.item())
        selection_idx, token_idx = torch.where(mask[expert_idx].squeeze(0))
        if token_idx.numel() == 0:
            continue
        current = hidden_states[token_idx]
        if expert_idx >= self.num_routed_experts or self.gate_up_proj is None:
            current = self.identity_expert(current)
        else:
            current = F.linear(_fused_gate(state, F.linear(current, self.gate_up_proj[expert_idx])),
                               self.down_proj[expert_idx])
        current = current * top_k_weights[token_idx, selection_idx, None]
        final.index_add_(0, token_idx, current.to(hidden_states.dtype))
    return final


def _dbrx_forward(self, state, x, expert_w1, expert_v1, expert_w2):
    return _ops.gated(x.matmul(expert_w1.T), x.matmul(expert_v1.T), state.name).matmul(expert_w2)


def _shared_forward(self, state, hidden_states, gammas):
    input_shape = hidden_states.shape
    hidden_states = hidden_states.reshape(1, -1, input_shape[-1]).expand(self.n_shared_experts, -1, -1)
    gammas = gammas.reshape(-1, self.n_shared_experts, 1).transpose(0, 1)
    gate = torch.bmm(hidden_states, self.gate_proj.transpose(1, 2))
    up = torch.bmm(hidden_states, self.up_proj.transpose(1, 2))
    down = torch.bmm(_ops.gated(gate, up, state.name) * gammas, self.down_proj.transpose(1, 2))
    return down.float().sum(dim=0).to(hidden_states.dtype).view(input_shape)


def _jetmoe_forward(self, state, layer_input):
    bsz, length, emb_size = layer_input.size()
    layer_input = layer_input.reshape(-1, emb_size)
    _, batch_index, batch_gates, expert_size, router_logits = self.router(layer_input)
    expert_inputs = layer_input[batch_index]
    hidden_states = _fused_gate(state, self.input_linear(expert_inputs, expert_size))
    expert_outputs = self.output_linear(hidden_states, expert_size)
    expert_outputs = expert_outputs * batch_gates[:, None]
    zeros = torch.zeros((bsz * length, self.input_size), dtype=expert_outputs.dtype, device=expert_outputs.device)
    layer_output = zeros.index_add(0, batch_index, expert_outputs)
    layer_output = layer_output.view(bsz, length, self.input_size)
    return layer_output + self.bias


_ROUTED = ("hidden_states", "top_k_index", "top_k_weights")
# form -> (the replacement forward, its parameters after self, whether the class has transformers' experts
# implementation switch (@use_experts_implementation: then only its "eager" runs the replacement)); "gate": none
_FORMS = {
    "linear": (_routed_linear, _ROUTED, True),
    "matmul": (_routed_matmul, _ROUTED, True),
    "linear_norm": (_routed_linear_norm, _ROUTED, True),
    "gate": None,
    "llama4": (_llama4_forward, ("hidden_states",), False),
    "longcat": (_longcat_forward, _ROUTED, False),
    "dbrx": (_dbrx_forward, ("x", "expert_w1", "expert_v1", "expert_w2"), False),
    "shared": (_shared_forward, ("hidden_states", "gammas"), False),
    "jetmoe": (_jetmoe_forward, ("layer_input",), False),
}


def _bind(names: tuple, args: tuple, kwargs: dict):
    """args and kwargs as a positional list over `names` (all of them, each once), else None."""
    if len(args) + len(kwargs) != len(names) or len(args) > len(names):
        return None
    out = list(args)
    for n in names[len(args):]:
        if n not in kwargs:
            return None
        out.append(kwargs[n])
    return out


def _eager(module) -> bool:
    """Whether a @use_experts_implementation module runs its own (eager) forward now: config._experts_implementation
    is "eager" or None (any other runs transformers' grouped_mm, batched_mm, ..., which call _apply_gate)."""
    return getattr(getattr(module, "config", None), "_experts_implementation", "") in ("eager", None)


class _BoundGate:
    """The patched _apply_gate of an experts module (set on the instance; picklable, like _BoundForward): what
    transformers' experts implementations (grouped_mm, batched_mm, deepgemm) and the class's own forward call on the
    [S, 2I] projection. Runs ffn_ext's op on it in place while _gate_state allows, else the class's _apply_gate."""

    def __init__(self, module, gate: _Gate):
        self.__self__, self.gate = module, gate

    def __call__(self, gate_up):
        module = self.__self__
        state = _gate_state(module, self.gate)
        if state is not None and isinstance(gate_up, torch.Tensor):
            return _fused_gate(state, gate_up)
        return type(module)._apply_gate(module, gate_up)


class _BoundForward:
    """The patched forward, bound to its MLP like a method, but picklable: a types.MethodType pickles as
    getattr(mlp, '_gated_forward') and so made torch.save(model) write checkpoints that torch.load could not read.
    This pickles the module-level function by name and the MLP by reference.

    A call with one tensor, positional or named `arg` (the original forward's parameter), runs the fused form with
    the activation's table entry while the activation may be bypassed (_act_now); every other call runs the
    original forward: `prev`, the forward the instance had when patched (a wrapper such as accelerate's hook, which
    must run), else the class's. `gate`: None for the MLPs of _KNOWN (and extra_classes), whose activation attribute
    is recorded on the module (_ACT); the clamped MLPs' _Gate, whose _gate_state the fused form runs with. `names`:
    the packed MLPs' projection attributes (to [..., 2I], back), passed on to `func`; () for the gated form."""

    arg, prev, gate, names = "x", None, None, ()  # class defaults: patched models pickled before these existed load

    def __init__(self, module, func, arg, prev, gate=None, names=()):
        self.__self__, self.__func__, self.arg, self.prev, self.gate = module, func, arg, prev, gate
        self.names = names

    def __call__(self, *args, **kwargs):
        mlp, prev = self.__self__, self.prev
        if prev is not None:
            return prev(*args, **kwargs)
        if len(args) + len(kwargs) == 1:
            x = args[0] if args else kwargs.get(self.arg)
            if isinstance(x, torch.Tensor):
                state = _act_now(mlp) if self.gate is None else _gate_state(mlp, self.gate)
                if state is not None:
                    return self.__func__(mlp, x, state, *self.names)
        return type(mlp).forward(mlp, *args, **kwargs)


class _BoundExperts(_BoundForward):
    """The patched forward of an experts module whose own forward inlines its gating (_FORMS): runs the replacement
    (`func`: the same code, with ffn_ext's op for the gating) where the class would run that forward (always, or for
    @use_experts_implementation classes while their implementation is "eager") and _gate_state allows. Every other
    call goes to the original forward: `prev` (an instance forward wrapper) if there was one, else the class's (its
    grouped_mm and batched_mm call the patched _apply_gate); so does a call that does not bind to the forward's
    parameters (`names`)."""

    names, dispatch = (), False

    def __init__(self, module, func, names, prev, gate, dispatch):
        super().__init__(module, func, names[0], prev, gate)
        self.names, self.dispatch = names, dispatch

    def __call__(self, *args, **kwargs):
        module, prev = self.__self__, self.prev
        if prev is not None:
            return prev(*args, **kwargs)
        if not self.dispatch or _eager(module):
            bound = _bind(self.names, args, kwargs)
            if bound is not None:
                state = _gate_state(module, self.gate)
                if state is not None:
                    return self.__func__(module, state, *bound)
        return type(module).forward(module, *args, **kwargs)


def _kind(module):
    """(kind, name of the activation attribute, projection names) for an MLP-shaped module, else None: 'gated' with
    nn.Linear children gate_proj, up_proj, down_proj (names: ()), or 'packed' with nn.Linear children of a pair of
    _PACKED_FORMS, or of _SHAPED_FORMS with a packed MLP's shapes (names: that pair, the projection to [..., 2I]
    first)."""
    mods = dict(module.named_children())

    def linear(*names):
        return all(isinstance(mods.get(n), nn.Linear) for n in names)

    if linear(*_GATED_NAMES):
        kind, names, acts = "gated", (), ("act_fn", "activation_fn")
    else:
        form = next((f for f in _PACKED_FORMS if linear(f[0], f[1])), None) or next(
            (f for f in _SHAPED_FORMS if linear(f[0], f[1]) and _packed_shapes(mods[f[0]], mods[f[1]])), None)
        if form is None:
            return None
        kind, names, acts = "packed", form[:2], form[2]
    return kind, next((n for n in acts if hasattr(module, n)), acts[0]), names


def _packed_shapes(proj: nn.Linear, out: nn.Linear) -> bool:
    """Whether proj (to [..., 2I]) and out (back) have a packed gated MLP's shapes."""
    return proj.in_features == out.out_features and proj.out_features == 2 * out.in_features


def _named_reason(cls):
    """Why an MLP of class cls is named, not patched (_NAMED): its forward is that of a transformers class of
    _NAMED; else None."""
    c = _defining(cls, "forward")
    if c is not None and c.__name__ in _NAMED and c.__module__.startswith("transformers."):
        return _NAMED[c.__name__][3]
    return None


def _vouched(cls, extra: tuple) -> bool:
    """Whether cls's forward is known to be a plain gated MLP: cls or a base class up to the one that defines forward is
    in `extra`, or that one is a transformers class named in _KNOWN."""
    for c in cls.__mro__:
        if c in extra:
            return True
        if "forward" in vars(c):
            return c.__name__ in _KNOWN and c.__module__.startswith("transformers.")
    return False


def _defining(cls, attr):
    """The first class of cls's MRO that defines `attr`, or None."""
    return next((c for c in cls.__mro__ if attr in vars(c)), None)


def _clamped_entry(cls):
    """The _Gate of a clamped MLP class: its forward is that of a transformers class of _KNOWN_CLAMPED; else None."""
    c = _defining(cls, "forward")
    if c is not None and c.__name__ in _KNOWN_CLAMPED and c.__module__.startswith("transformers."):
        return _KNOWN_CLAMPED[c.__name__]
    return None


def _experts_entry(cls):
    """(_Gate, form) of an experts class: its forward, and its _apply_gate if it has one, are those of a
    transformers class of _EXPERTS (a subclass that overrides either is not known); else None."""
    c = _defining(cls, "forward")
    if c is None or c.__name__ not in _EXPERTS or not c.__module__.startswith("transformers."):
        return None
    if _defining(cls, "_apply_gate") not in (None, c):
        return None
    return _EXPERTS[c.__name__]


def _clamps_after(cls) -> bool:
    """Whether cls's gating clamps the activation's output (_CLAMPS_AFTER): the class defining its _apply_gate (else
    its forward) is a transformers class of _CLAMP_AFTER, or sets _fp8_experts_clamp_after_activation = True."""
    c = _defining(cls, "_apply_gate") or _defining(cls, "forward")
    return c is not None and ((c.__name__ in _CLAMP_AFTER and c.__module__.startswith("transformers."))
                              or vars(c).get("_fp8_experts_clamp_after_activation") is True)


def _3d(params: dict, name: str) -> bool:
    t = params.get(name)
    return t is not None and t.dim() == 3


def _is_experts(module) -> bool:
    """Whether `module` holds gated MoE experts (patched, or named in the warning): a class of _EXPERTS or a subclass
    of one (its own forward or _apply_gate: not known); an experts class of transformers'
    @use_experts_implementation, by its has_gate (non-gated experts, act(up), are no more this patch's business
    than non-gated MLPs); any module with an _apply_gate; one with a 3-D gate_up_proj parameter, or 3-D gate_proj
    and up_proj."""
    cls = type(module)
    if any(c.__name__ in _EXPERTS and c.__module__.startswith("transformers.") for c in cls.__mro__):
        return True
    has_gate = module.__dict__.get("has_gate")
    if isinstance(has_gate, bool):
        return has_gate
    if callable(getattr(cls, "_apply_gate", None)):
        return True
    p = module._parameters
    return _3d(p, "gate_up_proj") or (_3d(p, "gate_proj") and _3d(p, "up_proj"))


def _gate_agrees(module, gate: _Gate) -> bool:
    """The experts' self-check: the module's own gating code (_own_gate: its class's _apply_gate or the inline form)
    and ffn_ext's op give the same on a random [4, 32] projection (float32 on the CPU, whatever the module's device
    and dtype: the gating has no parameters; a private generator), scaled to twice the clamp limit so that the
    clamps act. Not run (True) while hooks on the activation would see it run."""
    state = _gate_state(module, gate)
    if state is None:
        return True
    scale = 2 * min(state.limit, 1e4) if isinstance(state, _Clamp) else 4.0
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0)) * scale
    with torch.no_grad():
        ref, out = _own_gate(module, gate, x).float(), _fused_gate(state, x).float()
    return ref.shape == out.shape and bool((out - ref).norm() <= 1e-4 * ref.norm())


def _check_shapes(name, module, kind, names=()):
    mods = module._modules
    if kind == "gated":
        g, u, d = (mods[n] for n in _GATED_NAMES)
        ok = g.in_features == u.in_features == d.out_features and g.out_features == u.out_features == d.in_features
    else:
        ok = _packed_shapes(mods[names[0]], mods[names[1]])
    if not ok:
        raise ValueError(f"ffn_ext.hf.patch_model: {name or 'model'} ({type(module).__name__}) has MLP-named "
                         "projections with inconsistent shapes; not a gated MLP ffn_ext can run")


def _agrees(module, func, act, names=(), limit=None) -> bool:
    """The self-check: whether func (the fused forward) with table activation `act` (clamped MLPs: their _Clamp) and
    projection names `names` (packed: _kind's; gated: ()) computes what the class's forward does on two random rows
    (the module's device and dtype, no_grad, a private generator: the global RNG is untouched; with a clamp `limit`,
    scaled so that the first projection's largest output is 3 * limit and the clamps act). True without running
    anything when running would be neither cheap nor free of side effects: parameters on meta (offloaded) or not
    plain floating nn.Parameters of one dtype and device (quantized, sharded), a Linear that is not a plain
    nn.Linear (LoRA), hooks or forward wrappers on any submodule (or global hooks). Also True when the result is not
    finite (weights not initialised): nothing can be told from it. False when the class's forward fails on the rows
    (as [2, H] and as [1, 2, H]): it is not the form, and is left unpatched with the warning, never an exception."""
    params, subs = list(module.parameters()), tuple(module.modules())[1:]
    if not params or not fusable(tuple(m for m in subs if isinstance(m, nn.Linear)), subs):
        return True
    w = params[0]
    if not w.is_floating_point() or any(type(p) is not nn.Parameter or p.is_meta or p.dtype != w.dtype
                                        or p.device != w.device for p in params):
        return True
    mods, (first, last) = module._modules, (names or _GATED_NAMES[::2])
    x = torch.randn(2, mods[last].out_features, generator=torch.Generator().manual_seed(0), device="cpu")
    x = x.to(w.device, w.dtype)
    with torch.no_grad():
        if limit is not None:
            peak = float(mods[first](x).abs().max())
            if math.isfinite(peak) and peak > 0:
                x = x * (3 * min(limit, 1e4) / peak)
        try:  # two rows; a forward that wants [batch, seq, hidden] (MoshiGatingMLP) gets them as one sequence
            ref = type(module).forward(module, x).float()
        except Exception:
            try:
                x = x.unsqueeze(0)
                ref = type(module).forward(module, x).float()
            except Exception:
                return False  # its own forward fails on plain rows: not the form the fused forward computes
        out = func(module, x, act, *names).float()
        if out.shape != ref.shape:
            return False
    tol = 2e-2 if w.element_size() <= 2 else 1e-4  # relative, in norm; half types: ffn_ext rounds h once, ATen twice
    return not bool(ref.isfinite().all()) or bool((out - ref).norm() <= tol * ref.norm())


def _input_name(forward) -> str:
    """The name of the first parameter of a bound forward ('x' when there is none to name)."""
    try:
        return next(iter(inspect.signature(forward).parameters), "x")
    except (TypeError, ValueError):
        return "x"


def patch_model(model: nn.Module, strict: bool = False, extra_classes=(), *, recompute: bool = False,
                token_chunk: int | None = None) -> int:
    """Patches in place every MLP of `model` that computes a gated MLP with an activation of ffn_ext's table
    (SwiGLU, GeGLU with the exact or the tanh GELU), every known clamped SwiGLU MLP and every known MoE experts
    module whose gating ffn_ext computes (see the module docstring) to use ffn_ext; returns how many modules were
    patched now (already patched ones are not counted again).

    extra_classes: your own MLP classes (nn.Linear gate_proj/up_proj/down_proj or gate_up_proj/down_proj, an
    act_fn or activation_fn of the table: nn.SiLU, nn.GELU(approximate=...), transformers' ACT2FN["silu"],
    ACT2FN["gelu"], ACT2FN["gelu_pytorch_tanh"], ...; or input_linear/output_linear and activation, as Granite MoE's
    shared experts; or, with a packed MLP's shapes, Wi/Wo and act or fc1/fc2 and activation_fn) whose forward
    computes exactly down_proj(act_fn(gate_proj(x)) * up_proj(x)), or the packed form with gate first. Modules
    with these submodules that are not known to compute that, whose activation is not one of the table's or that
    fail the self-check, and gated MoE experts modules ffn_ext does not accelerate, are left
    unpatched with one RuntimeWarning naming their classes (and why); with strict=True that is a ValueError and
    nothing is patched. extra_classes does not apply to experts modules, nor to gatings known to clamp the
    activation's output (_CLAMP_AFTER), nor to the packed MLPs of _NAMED (dropout before the projection back, the
    up half first).

    recompute, token_chunk: the patched gated and packed MLPs run ffn_ext.mlp.gated_mlp(_packed) with these
    (recompute=True: backward recomputes the projections from the saved input; token_chunk=N: forward and backward
    over chunks of N tokens, for long sequences). A later call sets them anew on the MLPs patched before. They do
    not apply to the clamped MLPs and the MoE experts modules (their projections run as modules): with other than
    the defaults, those are named in a RuntimeWarning (strict=True: a ValueError, nothing patched)."""
    opts = _options("patch_model", recompute, token_chunk)
    extra = tuple(extra_classes)
    if not all(isinstance(c, type) for c in extra):
        raise TypeError(f"ffn_ext.hf.patch_model: extra_classes must be classes (nn.Module subclasses), got {extra!r}")
    todo, skipped = [], {}  # todo: (module, mark, forward, _apply_gate, _ACT); skipped: reason -> class -> names
    not_chunked = {}  # class -> names of what recompute / token_chunk do not apply to
    for name, module in model.named_modules():
        mark = getattr(module, _MARK, None)
        if mark:
            if mark in ("gated", "packed"):
                todo.append((module, mark, None, None, None))
            elif opts != _DEFAULT_OPTS:
                not_chunked.setdefault(type(module).__name__, []).append(name or "model")
            continue
        prev = module.__dict__.get("forward")  # a forward wrapper set on the instance (e.g. accelerate's hook)
        if _is_experts(module):
            entry = _experts_entry(type(module))
            if entry is None:
                reason = _CLAMPS_AFTER if _clamps_after(type(module)) else _UNKNOWN_EXPERTS
            else:
                gate, form = entry
                reason = _gate_problem(module, gate) or (None if _gate_agrees(module, gate) else _DISAGREES_GATE)
            if reason is None:
                spec = _FORMS[form]  # None: the class's forward calls _apply_gate
                fwd = spec and _BoundExperts(module, spec[0], spec[1], prev, gate, spec[2])
                gate_fn = _BoundGate(module, gate) if callable(getattr(type(module), "_apply_gate", None)) else None
                todo.append((module, "experts" if fwd else "experts_gate", fwd, gate_fn,
                             (gate.act, gate.act and _attr(module, gate.act))))
                if opts != _DEFAULT_OPTS:
                    not_chunked.setdefault(type(module).__name__, []).append(name or "model")
        else:
            found = _kind(module)
            if found is None:
                continue
            kind, act_name, names = found
            clamp = _clamped_entry(type(module))
            named = _named_reason(type(module))
            if _clamps_after(type(module)):  # whatever extra_classes says: its forward is known
                reason = _CLAMPS_AFTER
            elif named is not None:  # the same
                reason = named
            elif clamp is not None:
                func = _clamped_forward if kind == "gated" else _clamped_packed_forward
                act_name, act = clamp.act, clamp.act and _attr(module, clamp.act)
                reason = _gate_problem(module, clamp)
                if reason is None:
                    _check_shapes(name, module, kind, names)
                    state = _gate_state(module, clamp)
                    if not (prev is not None or state is None or _agrees(module, func, state, names, state.limit)):
                        reason = _DISAGREES
            else:
                act, func = getattr(module, act_name, None), _gated_forward if kind == "gated" else _packed_forward
                entry = _table_activation(act)
                if entry is None:
                    reason = _unsupported(act)
                elif not _vouched(type(module), extra):
                    reason = _UNKNOWN
                else:
                    _check_shapes(name, module, kind, names)
                    reason = None if prev is not None or _agrees(module, func, entry, names) else _DISAGREES
            if reason is None:
                todo.append((module, kind, _BoundForward(module, func, _input_name(module.forward), prev, clamp,
                                                         names), None, (act_name, act)))
                if clamp is not None and opts != _DEFAULT_OPTS:
                    not_chunked.setdefault(type(module).__name__, []).append(name or "model")
        if reason:
            skipped.setdefault(reason, {}).setdefault(type(module).__name__, []).append(name or "model")
    msgs = []  # (message, what happens to them without strict)
    if skipped:
        msgs.append(("; ".join(f"{reason}: {_where(by_class)}" for reason, by_class in skipped.items()),
                     " (left unpatched)"))
    if not_chunked:
        what = " and ".join(t for t in (opts[0] and "recompute=True", opts[1] is not None and f"token_chunk={opts[1]}")
                            if t)
        msgs.append((f"{what} does not apply to {_where(not_chunked)}: their projections run as modules (clamped "
                     "MLPs, MoE experts)", " (patched without it)"))
    for msg, outcome in msgs:
        if strict:
            raise ValueError(f"ffn_ext.hf.patch_model: {msg} (strict=True: nothing patched)")
        warnings.warn(f"ffn_ext.hf.patch_model: {msg}{outcome}", RuntimeWarning, stacklevel=2)
    count = 0
    for module, mark, fwd, gate_fn, act in todo:
        if mark in ("gated", "packed"):
            module.__dict__[_OPTS] = opts
        if act is None:  # patched before: only its options are new
            continue
        if fwd is not None:
            module.forward = fwd
        if gate_fn is not None:
            module._apply_gate = gate_fn
        setattr(module, _MARK, mark)
        setattr(module, _ACT, act)
        count += 1
    return count


def unpatch_model(model: nn.Module) -> int:
    """Undoes patch_model: each patched MLP gets back the forward it had (its class's, or the instance forward
    that was there); under a forward wrapper added after patching by accelerate (which keeps the patched forward
    as `_old_forward`), that is where it is restored. Returns how many MLPs were restored."""
    count = 0
    for name, module in model.named_modules():
        mark = getattr(module, _MARK, None)
        if not mark:
            continue
        d = module.__dict__
        if mark != "experts_gate":  # its forward was patched
            attr = next((a for a in ("forward", "_old_forward") if isinstance(d.get(a), _BoundForward)), None)
            if attr is None:
                warnings.warn(f"ffn_ext.hf.unpatch_model: {name or 'model'} ({type(module).__name__}): its patched "
                              "forward was wrapped by something other than accelerate's hook and cannot be taken "
                              "out; remove that wrapper first. Left patched.", RuntimeWarning, stacklevel=2)
                continue
            prev = d[attr].prev
            if prev is not None:
                d[attr] = prev
            elif attr == "forward":
                del d["forward"]
            else:
                d[attr] = type(module).forward.__get__(module)
        if isinstance(d.get("_apply_gate"), _BoundGate):
            del d["_apply_gate"]
        del d[_MARK], d[_ACT]
        d.pop(_OPTS, None)
        count += 1
    return count
