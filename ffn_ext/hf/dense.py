"""The gated MLPs: down_proj(act(gate_proj(x)) * up_proj(x)) and the packed form, the transformers classes known
to compute them (_KNOWN, _PACKED_NAMES) and the look-alikes named instead (_NAMED)."""

from __future__ import annotations

import torch.nn as nn

from .. import ops as _ops
from ..mlp import fusable, gated_mlp, gated_mlp_packed, linear_args
from .common import _DEFAULT_OPTS, _GATED_NAMES, _OPTS, _defining

# transformers classes whose forward is exactly down_proj(act(gate_proj(x)) * up_proj(x)) (gated), or
# down_proj(act(gate) * up) with gate, up = gate_up_proj(x).chunk(2, -1) (packed: the last two lines; the last one
# under the names of _PACKED_NAMES), with `act` the attribute act_fn or activation_fn (_PACKED_NAMES: its own) that
# __init__ sets to ACT2FN[...] or nn.SiLU(), as of transformers 5.24; the activation itself is identified at patch
# time (_table_activation). tests/test_hf.py::test_known_classes_compute_plain_gated_mlp checks each against the
# source, and that no class of those forms, under any attribute names, is missing.
_KNOWN = frozenset(
    """
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
""".split()
)

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
_DROPOUT_BETWEEN = (
    "packed gated MLPs with dropout between the gating and the projection back, "
    "Wo(drop(act(h[..., :I]) * h[..., I:])), h = Wi(x) (ModernBERT, ModernBERT decoder): ffn_ext's "
    "fused MLP has no dropout, so they are not patched, even where the dropout is inactive (they run "
    "as they are, unaccelerated)"
)
_UP_FIRST = (
    "packed gated MLPs whose projection gives the up half first, fc2(h[..., :I] * act(h[..., I:])), h = "
    "fc1(x) (Moonshine's decoder MLPs): ffn_ext's packed ops take the gate half first (they run as they "
    "are, unaccelerated)"
)
_NAMED = {
    "ModernBertMLP": ("Wi", "Wo", "act", _DROPOUT_BETWEEN),
    "ModernBertDecoderMLP": ("Wi", "Wo", "act", _DROPOUT_BETWEEN),
    "MoonshineDecoderMLP": ("fc1", "fc2", "activation_fn", _UP_FIRST),
    "MoonshineStreamingDecoderMLP": ("fc1", "fc2", "activation_fn", _UP_FIRST),
}

# (projection to [..., 2I], projection back, activation attributes in the order looked for): Phi-3's, then the others
_PACKED_FORMS = (("gate_up_proj", "down_proj", ("activation_fn", "act_fn")),) + tuple(
    dict.fromkeys((proj, out, (act,)) for proj, out, act in _PACKED_NAMES.values())
)

# the pairs of _NAMED: MLP-shaped only with a packed MLP's shapes (fc1 / fc2 also name plain MLPs, act(fc1(x)):
# CLIP, ViT, Whisper, Moonshine's encoder, ..., which have no gating and are none of this patch's business)
_SHAPED_FORMS = tuple(
    dict.fromkeys(
        (proj, out, (act,))
        for proj, out, act, _ in _NAMED.values()
        if (proj, out) not in {f[:2] for f in _PACKED_FORMS}
    )
)

# why a module that looks like a gated MLP was left unpatched (the keys of patch_model's warning)
_UNKNOWN = (
    "not known to compute exactly down_proj(act_fn(gate_proj(x)) * up_proj(x)) (their forward may add "
    "multipliers, clamps, norms, dropout or adapters); if a class does, pass it in extra_classes=[...]"
)


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
        return gated_mlp_packed(x, *linear_args(gu, d), activation=act.name, recompute=recompute, token_chunk=chunk)
    return d(_ops.gated_packed(gu(x), act.name))


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
            (f for f in _SHAPED_FORMS if linear(f[0], f[1]) and _packed_shapes(mods[f[0]], mods[f[1]])), None
        )
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


def _check_shapes(name, module, kind, names=()):
    mods = module._modules
    if kind == "gated":
        g, u, d = (mods[n] for n in _GATED_NAMES)
        ok = g.in_features == u.in_features == d.out_features and g.out_features == u.out_features == d.in_features
    else:
        ok = _packed_shapes(mods[names[0]], mods[names[1]])
    if not ok:
        raise ValueError(
            f"ffn_ext.hf.patch_model: {name or 'model'} ({type(module).__name__}) has MLP-named "
            "projections with inconsistent shapes; not a gated MLP ffn_ext can run"
        )
