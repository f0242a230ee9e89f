"""Shared by the Hugging Face tests. What transformers 5.24 had, as the product's class lists held it before ffn_ext
recognised forms from the code: test oracles only (the recogniser must agree with them on the classes the installed
transformers still defines with the same code; copied from ffn_ext/hf at 1952e74). And the tiny decoder configs'
common fields, the gradient comparison of a patched model with its unpatched copy, and the fixture that makes a
recogniser's error fail the test (raise_errors: autouse where a test module imports it).
"""

import ast
import copy
import functools
import importlib
import io
import pathlib
import re

import pytest
import torch

from ffn_ext.hf import forms, recognise

# a tiny decoder's config fields, less its widths (each test file picks hidden and intermediate sizes of its own)
_TOKENS = dict(vocab_size=97, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
TINY_DECODER = dict(_TOKENS, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
# a tiny GPT-OSS's own fields (4 experts of 16, top 2; a sliding and a full attention layer)
TINY_GPT_OSS = dict(
    intermediate_size=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    head_dim=8,
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention"],
)


def same_outputs(model, ref, out, out0, atol=1e-5, grad_atol=2e-6, inputs=()):
    """model's output `out` equals ref's `out0`, and after backward of the same random weighting of both, so does
    every parameter's gradient (grads_equal) and the gradient of each (input, its copy for ref) pair of `inputs`
    that takes one. atol=grad_atol=0: bit for bit."""
    torch.testing.assert_close(out, out0, atol=atol, rtol=atol)
    w = torch.randn_like(out)
    (out * w).sum().backward()
    (out0 * w).sum().backward()
    grads_equal(model, ref, grad_atol)
    for a, a0 in inputs:
        if a.is_floating_point():
            torch.testing.assert_close(a.grad, a0.grad, atol=10 * grad_atol, rtol=grad_atol and 1e-4)


def same_generate(model, ref, ids, new=4):
    """Greedy generate() from the first row's first 5 ids gives the same `new` tokens with model and ref."""
    prompt = ids[:1, :5]
    kw = dict(max_new_tokens=new, do_sample=False, attention_mask=torch.ones_like(prompt))
    out, out0 = model.generate(prompt, **kw), ref.generate(prompt, **kw)
    assert out.shape == (1, 5 + new) and torch.equal(out, out0)


def reloaded(model):
    """The model after torch.save and torch.load."""
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def loaded_into(model, ref):
    """model (made under a meta device) on the CPU with ref's weights and buffers, as from a checkpoint."""
    model.to_empty(device="cpu")
    model.load_state_dict(ref.state_dict())
    for name, buf in ref.named_buffers():
        model.get_buffer(name).copy_(buf)
    return model


# ---------------------------------------------------------------- transformers' source, read with ast
def modeling_classes(pattern: str | None = None) -> list:
    """(class node, {method name: node}, file path) of every class at the top level of transformers' modeling files
    whose source matches the regex `pattern` (None: all); each file is parsed once."""
    import transformers

    paths = sorted(pathlib.Path(transformers.__file__).parent.glob("models/*/modeling_*.py"))
    return [c for p in paths if pattern is None or re.search(pattern, p.read_text()) for c in _classes_of(p)]


@functools.cache
def _classes_of(path) -> tuple:
    classes = (n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef))
    return tuple((n, {f.name: f for f in n.body if isinstance(f, ast.FunctionDef)}, path) for n in classes)


def load(name: str, path):
    """The class `name` of the modeling file `path`, or None where it cannot be imported."""
    try:
        return getattr(importlib.import_module(f"transformers.models.{path.parent.name}.{path.stem}"), name)
    except (ImportError, AttributeError):
        return None


def bare(cls, **attrs):
    """An instance of cls without its __init__ (no config, no weights) with `attrs` set, what the recogniser reads
    (the code, and the attributes its `if` tests read); None where it cannot be made."""
    try:
        m = object.__new__(cls)
    except TypeError:
        return None
    m.__dict__.update(attrs)
    return m


def body(fn: ast.FunctionDef, names=("x",)) -> str | None:
    """fn's statements as source, its inputs renamed `names`, docstrings dropped; None unless it takes
    (self, *names)."""
    fn = copy.deepcopy(fn)
    a = fn.args
    if len(a.args) != 1 + len(names) or a.vararg or a.kwarg or a.kwonlyargs or fn.decorator_list:
        return None
    renames = {arg.arg: n for arg, n in zip(a.args[1:], names)}
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and node.id in renames:
            node.id = renames[node.id]
    return "\n".join(
        ast.unparse(s) for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
    )


def init_assignments(cls: ast.ClassDef) -> dict:
    """{attribute: [source of each value assigned to self.<attribute> in cls.__init__]}"""
    init = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    out: dict = {}
    for node in ast.walk(init) if init is not None else ():
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(t, ast.Attribute) and ast.unparse(t.value) == "self":
                    out.setdefault(t.attr, []).append(ast.unparse(node.value))
    return out


def modeling_class(name: str, module: str):
    """transformers.models.<module>.modeling_<module>.<name>; the test skips where this transformers has none."""
    try:
        return getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)
    except (ImportError, AttributeError):
        pytest.skip(f"this transformers has no {name}")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: one intra-op thread is faster, above all on a busy machine (idle threads spin); autouse where a
    test module imports it, restored after the module."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def grads_equal(model, ref, atol=2e-6):
    """Every parameter's gradient equals ref's, to fp32 rounding relative to the gradient's scale: atol is relative
    to max(1, the largest |gradient|) (the fused ops round differently from ATen's several ops, by an ulp)."""
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        p0 = ref_params[name]
        assert (p.grad is None) == (p0.grad is None), name
        if p.grad is not None:
            scale = max(1.0, float(p0.grad.abs().max()))
            torch.testing.assert_close(p.grad, p0.grad, atol=atol * scale, rtol=atol and 1e-4, msg=name)


KNOWN = frozenset(
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

PACKED_NAMES = {
    "GraniteMoeSharedMLP": ("input_linear", "output_linear", "activation"),  # the shared experts of Granite MoE
    "GraniteMoeSWAMLP": ("input_linear", "output_linear", "activation"),
    "GraniteMoeHybridMLP": ("input_linear", "output_linear", "activation"),  # Granite 4.0
}

NAMED = {
    "ModernBertMLP": ("Wi", "Wo", "act", "DROPOUT_BETWEEN"),
    "ModernBertDecoderMLP": ("Wi", "Wo", "act", "DROPOUT_BETWEEN"),
    "MoonshineDecoderMLP": ("fc1", "fc2", "activation_fn", "UP_FIRST"),
    "MoonshineStreamingDecoderMLP": ("fc1", "fc2", "activation_fn", "UP_FIRST"),
}

CLASSIC_FORMS = {
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

KNOWN_CLASSIC = {cls: names for names, classes in CLASSIC_FORMS.items() for cls in classes.split()}

PAIR_LAYERS = frozenset(
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

INTERMEDIATES = frozenset(
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

OUTPUTS = frozenset(
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

KNOWN_CLAMPED = {"DeepseekV4MLP", "Glm5NextTextMLP", "Glm5NextVisionMLP", "MiniMaxM3VLDenseMLP"}

CLAMP_AFTER = frozenset({"Step3p7MLP", "Step3p7Experts"})


@pytest.fixture(autouse=True)
def raise_errors(monkeypatch):
    """An error while planning a module (a bug of the recogniser's) fails the test instead of naming the module:
    autouse where a test module imports it."""
    monkeypatch.setattr(forms, "RAISE_ERRORS", True)


class NotAnActivation(torch.nn.Module):
    """Mish's math under a name no table entry can have: the tests that need an activation ffn_ext lacks use it, so
    that adding one by docs/internals/adding-an-activation.md (Mish, say) breaks none of them."""

    def forward(self, x):
        return x * torch.tanh(torch.nn.functional.softplus(x))


def not_an_activation(monkeypatch) -> str:
    """Registers NotAnActivation in transformers' ACT2FN for the test; returns its hidden_act name."""
    from transformers.activations import ACT2FN

    monkeypatch.setitem(ACT2FN, "not_an_activation", NotAnActivation)
    return "not_an_activation"


def patched_as(module) -> str | None:
    """The name of the form a module is patched as, else None."""
    patched = vars(module).get(forms.MARK)
    return patched.form.name if patched is not None else None


def reason(name: str) -> str:
    """A reason of ffn_ext.hf by its name in forms or recognise (NAMED's last field)."""
    return getattr(forms, name, None) or getattr(recognise, name)
