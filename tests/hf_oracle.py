"""Shared by the Hugging Face tests. What transformers 5.24 had, as the product's class lists held it before ffn_ext
recognised forms from the code: test oracles only (the recogniser must agree with them on the classes the installed
transformers still defines with the same code; copied from ffn_ext/hf at 1952e74). And the tiny decoder configs'
common fields and the gradient comparison of a patched model with its unpatched copy.
"""

import torch

# a tiny decoder's config fields, less its widths (each test file picks hidden and intermediate sizes of its own)
_TOKENS = dict(vocab_size=97, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
TINY_DECODER = dict(_TOKENS, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def grads_equal(model, ref, atol=2e-6):
    """Every parameter's gradient equals ref's, to fp32 rounding relative to the gradient's scale: atol is relative
    to max(1, the largest |gradient|) (the fused ops round differently from ATen's several ops, by an ulp)."""
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        p0 = ref_params[name]
        assert (p.grad is None) == (p0.grad is None), name
        if p.grad is not None:
            scale = max(1.0, float(p0.grad.abs().max()))
            torch.testing.assert_close(p.grad, p0.grad, atol=atol * scale, rtol=1e-4, msg=name)


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
    "ModernBertMLP": ("Wi", "Wo", "act", "_DROPOUT_BETWEEN"),
    "ModernBertDecoderMLP": ("Wi", "Wo", "act", "_DROPOUT_BETWEEN"),
    "MoonshineDecoderMLP": ("fc1", "fc2", "activation_fn", "_UP_FIRST"),
    "MoonshineStreamingDecoderMLP": ("fc1", "fc2", "activation_fn", "_UP_FIRST"),
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
