"""The classic FFN, fc2(act(fc1(x))): transformers' one-module MLPs of that form (_KNOWN_CLASSIC: GPT-2, GPT-NeoX,
Falcon, Phi, CLIP, SigLIP, ViT, the VLMs' vision MLPs, Nemotron, ...), with nn.Linear or GPT-2's Conv1D projections
and at most a dropout after fc2, and the BERT-style *Intermediate (act(dense(x))) / *Output (LayerNorm(dropout(
dense(h)) + x)) pairs, patched at the layer that calls both (_PAIR_LAYERS' feed_forward_chunk), so that the
activation's output is not kept for fc2's weight gradient. Modules that hold an FFN's projections (d -> f -> d) and
an activation but whose forward is not known (Whisper's and BART's layers, with the FFN inline in the layer's
forward and a dropout between the activation and fc2) are named (_INLINE)."""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import ops as _ops
from ..mlp import fusable, plain_mlp
from .common import (
    _DEFAULT_OPTS,
    _OPTS,
    _agrees,
    _BoundForward,
    _defining,
    _input_name,
    _table_activation,
    _unsupported,
)

# transformers 5.24 classes whose forward is exactly fc2(act(fc1(x))), then the dropout `drop` ("": none; a name:
# that dropout module, called; "p:name": F.dropout(p=self.name, training=self.training)), by their attribute names
# (fc1, act, fc2, drop), with fc1 and fc2 nn.Linear, GPT-2's Conv1D or FalconLinear (x @ W.T + b) and the
# activation whatever __init__ sets (identified at patch time). tests/test_hf_classic.py checks each against the
# source, and that no class of these forms, under any attribute names, is missing.
_CLASSIC_FORMS = {
    ('fc1', 'activation_fn', 'fc2', ''): """
        ASTMLP AXK2GateMLP AltCLIPMLP BeitMLP Blip2MLP BlipMLP CLIPMLP CLIPSegMLP CanaryDecoderMLP
        ChineseCLIPVisionMLP CohereAsrDecoderMLP Cosmos3EdgeMLP Cosmos3EdgeTextMLP DeiTMLP Dinov2MLP
        Dinov2WithRegistersMLP EomtMLP Florence2VisionMLP GitVisionMLP GlmImageVisionMLP GradiumPhononTTSMLP
        GraniteDoclingVisionMLP GroupViTMLP HYV4VLVisionMLP HieraMlp HunYuanVLVisionMLP IJepaMLP
        Idefics2VisionMLP Idefics3VisionMLP Inkling2VisionMLP InstructBlipMLP InstructBlipVideoMLP
        InternVLVisionMLP JinaEmbeddingsV3MLP Kosmos2VisionMLP Llama4VisionMLP MLCDMLP MetaClip2MLP MimiMLP
        MiniCPMOcrVisionMLP MiniCPMV4_6VisionMLP MiniCPMV4_7VisionMLP MiniMaxM3VLVisionMLP MllamaVisionMLP
        Molmo2VisionMLP MoonshineEncoderMLP MoonshineStreamingEncoderMLP MuseSparkAudioMLP NanoChatMLP
        Nemotron3DiarizationMLP Nemotron3_5TranscribeMLP NeuCodecMLP OneFormerTextMLP OwlViTMLP Owlv2MLP
        PaddleOCRVisionMLP Phi4MultimodalVisionMLP PhiMLP PixioMLP PocketTTSAudioTokenizerMLP PocketTTSMLP
        QianfanOCRVisionMLP RadioMLP RfDetrDinov2MLP RfDetrSegmentationMLP Sam3LiteTextTextMLP Siglip2MLP
        SiglipMLP SmolVLMVisionMLP Step3p7VisionMLP SwinMLP TimesFm2_5MLP Tipsv2MLP Tipsv2VisionMLP
        UnlimitedOcrMLP ViTMAEMLP ViTMLP ViTMSNMLP VibeVoiceDiffusionHeadMLP VideoLlama3VisionMLP VideoPrismMLP
        VideomtMLP VivitMLP XCLIPMLP Xcodec2MLP
    """,
    ('up_proj', 'act_fn', 'down_proj', ''): """
        Apertus1p5TextMLP ApertusMLP ArceeMLP DINOv3ViTMLP EomtDinov3MLP Jais2MLP NemotronHMLP NemotronMLP
        NeoMMEMLP Sapiens2MLP
    """,
    ('linear_fc1', 'act_fn', 'linear_fc2', ''): """
        CohereCompassVisionMLP Qwen3OmniMoeTalkerResizeMLP Qwen3OmniMoeVisionMLP Qwen3VLMoeVisionMLP
        Qwen3VLVisionMLP Qwen3_5MoeVisionMLP Qwen3_5VisionMLP Qwen4ExpVisionMLP
    """,
    ('lin1', 'act', 'lin2', ''): """
        DeepseekOcr2SamMLPBlock GotOcr2MLPBlock PPFormulaNetMLPBlock SLANeXtMLPBlock SamHQMLPBlock SamMLPBlock
        SegGptMlp UnlimitedOcrSamMLPBlock
    """,
    ('c_fc', 'act', 'c_proj', 'dropout'): """
        ClvpDecoderMLP DecisionTransformerGPT2MLP GPT2MLP GPTBigCodeMLP GPTNeoMLP ImageGPTMLP MLP
    """,
    ('fc1', 'act', 'fc2', ''): """
        Ernie4_5VLVisionMLP Kimi_K25VisionMLP MuseGlimmerVisionMLP MuseSparkVisionMLP VisionMlp
    """,
    ('linear1', 'activation', 'linear2', ''): """
        ClapProjectionLayer DeepseekVLAligner VibeVoiceAcousticTokenizerFeedForward VibeVoiceAsrFeedForward
    """,
    ('dense_h_to_4h', 'act', 'dense_4h_to_h', ''): """
        FalconMLP GPTNeoXJapaneseMLP GPTNeoXMLP PersimmonMLP
    """,
    ('fc_in', 'act', 'fc_out', 'dropout'): """
        CodeGenMLP GPTJMLP
    """,
    ('fc1', 'activation', 'fc2', ''): """
        VJEPA2MLP VitPoseBackboneMLP
    """,
    ('linear_in', 'act', 'linear_out', ''): """
        AriaProjectorMLP
    """,
    ('in_proj', 'gelu', 'out_proj', 'dropout'): """
        BarkMLP
    """,
    ('fc1', 'act_fn', 'fc2', ''): """
        GlmAsrMLP
    """,
    ('proj_out', 'activation_fn', 'vision_head', ''): """
        JanusVQVAEHead
    """,
    ('linear_1', 'act', 'linear_2', ''): """
        Nemotron3_5AsrPromptProjector
    """,
    ('dense1', 'intermediate_act_fn', 'dense2', ''): """
        PerceiverMLP
    """,
    ('c_fc', 'act', 'c_proj', 'p:residual_dropout'): """
        Starcoder2MLP
    """,
    ('dense1', 'adapter_act_fn', 'dense2', ''): """
        XmodAdapter
    """,
}
_KNOWN_CLASSIC = {cls: names for names, classes in _CLASSIC_FORMS.items() for cls in classes.split()}

# BERT-style layers whose feed_forward_chunk(x) is exactly self.output(self.intermediate(x), x), and the classes of
# the pair: *Intermediate: intermediate_act_fn(dense(x)); *Output(h, x): LayerNorm(dropout(dense(h)) + x) (tests/
# test_hf_classic.py checks the three lists against the source, and that none is missing)
_PAIR_LAYERS = frozenset(
    """
    AlignTextLayer AltRobertaLayer BertGenerationLayer BertLayer BigBirdLayer Blip2QFormerLayer BlipTextLayer
    BridgeTowerBertCrossLayer BridgeTowerTextLayer BrosLayer CamembertLayer CanineLayer ChineseCLIPTextLayer
    ClapTextLayer ConvBertLayer Data2VecTextLayer ElectraLayer ErnieLayer FNetLayer GitLayer
    InstructBlipQFormerLayer InstructBlipVideoQFormerLayer LayoutLMLayer LayoutLMv2Layer LayoutLMv3Layer
    LiltLayer LukeLayer MarkupLMLayer MraLayer NystromformerLayer PPDocLayoutV2ReadingOrderLayer RemBertLayer
    RoCBertLayer RoFormerLayer RobertaLayer RobertaPreLayerNormLayer SplinterLayer TapasLayer VisualBertLayer
    XLMRobertaLayer YosoLayer
""".split()
)
_INTERMEDIATES = frozenset(
    """
    AlignTextIntermediate AltRobertaIntermediate BertGenerationIntermediate BertIntermediate BigBirdIntermediate
    Blip2QFormerIntermediate BlipTextIntermediate BridgeTowerIntermediate BrosIntermediate CamembertIntermediate
    CanineIntermediate ChineseCLIPTextIntermediate ClapAudioIntermediate ClapTextIntermediate
    ConvBertIntermediate CpmAntIntermediate DPTViTIntermediate Data2VecTextIntermediate
    Data2VecVisionIntermediate DebertaIntermediate DebertaV2Intermediate DinatIntermediate DonutSwinIntermediate
    ElectraIntermediate ErnieIntermediate FNetIntermediate FlavaIntermediate GitIntermediate
    InstructBlipQFormerIntermediate InstructBlipVideoQFormerIntermediate LayoutLMIntermediate
    LayoutLMv2Intermediate LayoutLMv3Intermediate LiltIntermediate LongformerIntermediate LukeIntermediate
    LxmertIntermediate MPNetIntermediate MarkupLMIntermediate MaskFormerSwinIntermediate
    MegatronBertIntermediate MobileBertIntermediate MobileViTIntermediate MraIntermediate
    NystromformerIntermediate PPDocLayoutV2ReadingOrderIntermediate RemBertIntermediate RoCBertIntermediate
    RoFormerIntermediate RobertaIntermediate SEWDIntermediate SplinterIntermediate Swin2SRIntermediate
    Swinv2Intermediate TapasIntermediate TvpIntermediate VideoMAEIntermediate ViltIntermediate
    VisualBertIntermediate XLMRobertaIntermediate XLMRobertaXLIntermediate XmodIntermediate YolosIntermediate
    YosoIntermediate
""".split()
)
_OUTPUTS = frozenset(
    """
    AlignTextOutput AlignTextSelfOutput AltRobertaOutput AltRobertaSelfOutput BertGenerationOutput
    BertGenerationSelfOutput BertOutput BertSelfOutput BigBirdOutput BigBirdSelfOutput Blip2QFormerOutput
    Blip2QFormerSelfOutput BlipTextOutput BlipTextSelfOutput BridgeTowerOutput BridgeTowerSelfOutput BrosOutput
    BrosSelfOutput CamembertOutput CamembertSelfOutput CanineOutput CanineSelfOutput ChineseCLIPTextOutput
    ChineseCLIPTextSelfOutput ClapTextOutput ClapTextSelfOutput ConvBertOutput ConvBertSelfOutput CpmAntOutput
    Data2VecTextOutput Data2VecTextSelfOutput DebertaOutput DebertaSelfOutput DebertaV2Output
    DebertaV2SelfOutput ElectraOutput ElectraSelfOutput ErnieOutput ErnieSelfOutput FNetOutput GitOutput
    GitSelfOutput InstructBlipQFormerOutput InstructBlipQFormerSelfOutput InstructBlipVideoQFormerOutput
    InstructBlipVideoQFormerSelfOutput LayoutLMOutput LayoutLMSelfOutput LayoutLMv2Output LayoutLMv2SelfOutput
    LayoutLMv3Output LayoutLMv3SelfOutput LiltOutput LiltSelfOutput LongformerOutput LongformerSelfOutput
    LukeOutput LukeSelfOutput LxmertAttentionOutput LxmertOutput MPNetOutput MarkupLMOutput MarkupLMSelfOutput
    MraOutput MraSelfOutput NystromformerOutput NystromformerSelfOutput RemBertOutput RemBertSelfOutput
    RoCBertOutput RoCBertSelfOutput RoFormerOutput RoFormerSelfOutput RobertaOutput RobertaSelfOutput SEWDOutput
    SEWDSelfOutput SplinterOutput SplinterSelfOutput TapasOutput TapasSelfOutput VisualBertOutput
    VisualBertSelfOutput XLMRobertaOutput XLMRobertaSelfOutput YosoOutput YosoSelfOutput
""".split()
)

_INLINE = (
    "modules holding an FFN's projections (fc1: d -> f, fc2: f -> d) and an activation whose forward is "
    "not known to be exactly fc2(act(fc1(x))): an FFN inline in a layer's forward (Whisper's and BART's "
    "encoder and decoder layers, with a dropout between the activation and fc2 that ffn_ext's fused MLP lacks, "
    "and the attention in the same forward), or an MLP with something between or around the projections "
    "(they run as they are, unaccelerated)"
)
_UNKNOWN_PAIR = (
    "layers with a BERT-style *Intermediate / *Output pair whose feed_forward_chunk is not known to be "
    "exactly output(intermediate(x), x) (they run as they are, unaccelerated)"
)
# projection classes of transformers that compute x @ W.T + b as nn.Linear does (module, class name)
_LINEARS = {("transformers.models.falcon.modeling_falcon", "FalconLinear")}


def _transformers(cls, names) -> bool:
    return cls is not None and cls.__name__ in names and cls.__module__.startswith("transformers.")


def _layout(*projections) -> str | None:
    """ "linear" (nn.Linear, or a class of _LINEARS) or "conv1d" (transformers' Conv1D: weight [in, out]) when all the
    projections are of that kind, exactly, and carry no hook or forward wrapper (ffn_ext.mlp.plain_mlp runs them);
    else None (they run as modules)."""
    kinds = set()
    for m in projections:
        t = type(m)
        if t is nn.Linear or (t.__module__, t.__name__) in _LINEARS:
            kinds.add("linear")
        elif t.__name__ == "Conv1D" and t.__module__ == "transformers.pytorch_utils":
            kinds.add("conv1d")
        else:
            return None
    return kinds.pop() if len(kinds) == 1 and fusable((), projections) else None


def _features(m):
    """(in, out) features of a linear-like projection (nn.Linear and subclasses, LoRA-style wrappers with in_features,
    Conv1D), else None."""
    if isinstance(getattr(m, "in_features", None), int) and isinstance(getattr(m, "out_features", None), int):
        return m.in_features, m.out_features
    t = type(m)
    if t.__name__ == "Conv1D" and t.__module__ == "transformers.pytorch_utils":
        return m.nx, m.nf
    return None


def _ffn(x, fc1, fc2, act, opts):
    """fc2(act(fc1(x))) with ffn_ext: the fused plain MLP when the projections allow (_layout), else the projections
    as modules around ffn_ext's activation op."""
    layout = _layout(fc1, fc2)
    if layout is None:
        return fc2(_ops.call_op(act.name, fc1(x)))
    recompute, chunk = opts
    return plain_mlp(
        x,
        fc1.weight,
        fc2.weight,
        fc1.bias,
        fc2.bias,
        act.name,
        recompute=recompute,
        token_chunk=chunk,
        transposed=layout == "conv1d",
    )


def _classic_forward(self, x, act, fc1, fc2, drop=""):
    mods = self._modules
    y = _ffn(x, mods[fc1], mods[fc2], act, self.__dict__.get(_OPTS, _DEFAULT_OPTS))
    if not drop:
        return y
    if drop.startswith("p:"):
        return F.dropout(y, p=getattr(self, drop[2:]), training=self.training)
    return mods[drop](y)


def _pair_forward(self, x, act):
    inter, out = self._modules["intermediate"], self._modules["output"]
    y = _ffn(x, inter.dense, out.dense, act, self.__dict__.get(_OPTS, _DEFAULT_OPTS))
    return out.LayerNorm(out.dropout(y) + x)


def _pair_act(layer):
    """The table entry of a patched layer's activation, while the fused chunk may stand in for its *Intermediate and
    *Output calls (no hook or forward wrapper on them or on the activation, which may have been replaced), else None."""
    inter, out = layer._modules.get("intermediate"), layer._modules.get("output")
    act = getattr(inter, "intermediate_act_fn", None)
    entry = _table_activation(act)
    if entry is None or out is None or not fusable((), (inter, out) + ((act,) if isinstance(act, nn.Module) else ())):
        return None
    return entry


class _BoundChunk(_BoundForward):
    """The patched feed_forward_chunk of a BERT-style layer (set on the instance, picklable as _BoundForward): with
    one tensor, the pair by ffn_ext while _pair_act allows; every other call, the class's feed_forward_chunk."""

    @property
    def __signature__(self):  # the class's: transformers' apply_chunking_to_forward counts its parameters
        return inspect.signature(type(self.__self__).feed_forward_chunk.__get__(self.__self__))

    def __call__(self, *args, **kwargs):
        layer = self.__self__
        if len(args) + len(kwargs) == 1:
            x = args[0] if args else kwargs.get(self.arg)
            if isinstance(x, torch.Tensor):
                entry = _pair_act(layer)
                if entry is not None:
                    return _pair_forward(layer, x, entry)
        return type(layer).feed_forward_chunk(layer, *args, **kwargs)


def _activation_child(module) -> bool:
    return any(
        _table_activation(m) is not None
        or type(m).__module__ in ("transformers.activations", "torch.nn.modules.activation")
        for m in module._modules.values()
    )


def _inline(module) -> bool:
    """Whether `module` has linear-like children fc1 and fc2 chaining d -> f -> d (the names of Whisper's and BART's
    layers) and an activation child (named with _INLINE when its forward is not known)."""
    f1, f2 = (_features(module._modules.get(n)) for n in ("fc1", "fc2"))
    return f1 is not None and f2 is not None and f1 == f2[::-1] and _activation_child(module)


def classic_kind(module):
    """(kind, activation attribute, names) for a module of the classic forms, else None: "classic" (a class of
    _KNOWN_CLASSIC: names (fc1, fc2, drop)), "pair" (a layer of _PAIR_LAYERS: the activation is its intermediate's;
    names ()), "unknown_pair" (a layer with a known *Intermediate / *Output pair but another feed_forward_chunk) or
    "inline" (_inline); the last two are named, never patched."""
    cls = type(module)
    c = _defining(cls, "forward")
    if _transformers(c, _KNOWN_CLASSIC):
        fc1, act, fc2, drop = _KNOWN_CLASSIC[c.__name__]
        return "classic", act, (fc1, fc2, drop)
    mods = module._modules
    inter, out = mods.get("intermediate"), mods.get("output")
    if (
        inter is not None
        and out is not None
        and _transformers(_defining(type(inter), "forward"), _INTERMEDIATES)
        and _transformers(_defining(type(out), "forward"), _OUTPUTS)
    ):
        if _transformers(_defining(cls, "feed_forward_chunk"), _PAIR_LAYERS):
            return "pair", "intermediate_act_fn", ()
        return "unknown_pair", "intermediate_act_fn", ()
    if _inline(module):
        return "inline", None, ()
    return None


_DISAGREES_CLASSIC = (
    "their forward gave a different result from ffn_ext's plain MLP on a random input (self-check), "
    "so it is not fc2(act(fc1(x))) and must run as it is"
)


def _chunk_of(layer, x):
    return type(layer).feed_forward_chunk(layer, x)


def plan(module, prev):
    """For a module of the classic forms (classic_kind): (None, (mark, bound forward, (activation attribute,
    activation))) to patch it, or (why not, None); None for any other module. `prev`: the instance's forward wrapper
    (accelerate's hook), which the patched forward keeps calling (then the self-check does not run)."""
    found = classic_kind(module)
    if found is None:
        return None
    kind, act_name, names = found
    if kind == "inline":
        return _INLINE, None
    if kind == "unknown_pair" or (kind == "pair" and "feed_forward_chunk" in module.__dict__):
        return _UNKNOWN_PAIR, None
    mods = module._modules
    holder = mods["intermediate"] if kind == "pair" else module
    act = getattr(holder, act_name, None)
    entry = _table_activation(act)
    if entry is None:
        return _unsupported(act), None
    if kind == "pair":
        width = _features(mods["intermediate"].dense)
        if width is not None and not _agrees(
            module, lambda m, x, a: _pair_forward(m, x, a), entry, own=_chunk_of, width=width[0]
        ):
            return _DISAGREES_CLASSIC, None
        return None, (
            "pair",
            _BoundChunk(module, _pair_forward, _input_name(module.feed_forward_chunk), None),
            (act_name, act),
        )
    width = _features(mods[names[1]])
    if prev is None and width is not None and not _agrees(module, _classic_forward, entry, names, width=width[1]):
        return _DISAGREES_CLASSIC, None
    return None, (
        "classic",
        _BoundForward(module, _classic_forward, _input_name(module.forward), prev, None, names),
        (act_name, act),
    )
