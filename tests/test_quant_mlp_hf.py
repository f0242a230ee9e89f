"""ffn_ext.quantize_fp8 on transformers models after ffn_ext.patch_hf_model: the patched dense gated (Llama, Qwen2),
packed (Phi-3) and classic (GPT-2's Conv1D, CLIP) MLPs become FP8 MLPs, the logits stay within FP8's error of the
fp32 model (printed with -s); what is left as it is gets named, FineGrainedFP8's FP8Linear with its reason. Tiny
random configs, no downloads."""

from __future__ import annotations

import warnings

import hf_oracle
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ffn_ext
from ffn_ext.fp8 import FP8FFN, FP8GatedFFN, quantize_fp8
from ffn_ext.hf.forms import FP8_PROJECTIONS, FP8_WRAPPED

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(
    not hasattr(F, "scaled_mm"), reason="torch.nn.functional.scaled_mm is not in this torch"
)

DECODER = dict(hf_oracle.TINY_DECODER, hidden_size=128, intermediate_size=256)
MODELS = {  # config, model, extra config, the FP8 class the MLPs become
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, FP8GatedFFN),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, FP8GatedFFN),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}, FP8GatedFFN),  # packed gate_up_proj
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(n_embd=128, n_layer=2, n_head=4, vocab_size=97, bos_token_id=1, eos_token_id=2),
        FP8FFN,
    ),
}


def _model(kind):
    cfg, cls, extra, _ = MODELS[kind]
    kw = extra if kind == "gpt2" else dict(DECODER, **extra)
    torch.manual_seed(0)
    return getattr(transformers, cls)(getattr(transformers, cfg)(**kw)).eval()


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("recipe", ["row", "block"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_patched_hf_model_quantized(kind, recipe, monkeypatch):
    model = _model(kind)
    monkeypatch.setattr(ffn_ext.fp8, "_EMULATED_WARNED", set())
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
        assert ffn_ext.patch_hf_model(model) == 2
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            quantize_fp8(model, recipe=recipe)
            fp8 = [m for m in model.modules() if isinstance(m, (FP8GatedFFN, FP8FFN))]
            assert len(fp8) == 2 and all(type(m) is MODELS[kind][3] for m in fp8)
            got = model(ids).logits
    msgs = [str(w.message) for w in rec]  # nothing left unconverted; the CPU's GEMMs named once (not a speed-up)
    named = "emulated" if recipe == "block" else "7-10x slower than the bf16 MLP"
    assert len(msgs) == 1 and named in msgs[0], msgs
    err = _rel(got, ref)
    print(f"{kind} {recipe}: logits relative error {err:.4f} vs the fp32 model (2 FP8 MLPs)")
    assert err < 0.05  # measured 0.013-0.040 (GPT-2: 0.036-0.040): attention and embeddings stay fp32


def test_clip_vision_mlps_quantized():
    cfg = transformers.CLIPVisionConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8
    )
    torch.manual_seed(0)
    model = transformers.CLIPVisionModel(cfg).eval()
    px = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ref = model(pixel_values=px).last_hidden_state
        assert ffn_ext.patch_hf_model(model) == 2
        quantize_fp8(model)
        assert sum(isinstance(m, FP8FFN) for m in model.modules()) == 2
        err = _rel(model(pixel_values=px).last_hidden_state, ref)
    print(f"CLIP vision: last hidden state relative error {err:.4f}")
    assert err < 0.05


def test_unpatched_hf_mlps_are_named():
    model = _model("llama")
    with pytest.warns(
        UserWarning,
        match=r"model\.layers\.0\.mlp \(LlamaMLP\), model\.layers\.1\.mlp \(LlamaMLP\) are "
        r"not converted: an MLP that ffn_ext\.patch_hf_model has not patched",
    ):
        quantize_fp8(model)
    assert not any(isinstance(m, FP8GatedFFN) for m in model.modules())


def test_patched_pairs_are_named_with_their_forms_reason():
    """A patched form with no FP8 module, the BERT-style layer pair, is named with its form's reason (Form.not_fp8)."""
    cfg = transformers.BertConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=97
    )
    model = transformers.BertModel(cfg).eval()
    assert ffn_ext.patch_hf_model(model) == 2
    with pytest.warns(UserWarning) as rec:
        assert quantize_fp8(model) is model
    why = ffn_ext.hf.forms.BertPair.not_fp8
    named = "encoder.layer.0 (BertLayer), encoder.layer.1 (BertLayer) are"
    assert [str(w.message) for w in rec] == [f"ffn_ext.quantize_fp8: {named} not converted: {why}"]


def _fp8_linear(n_in, n_out):
    from transformers.integrations.finegrained_fp8 import FP8Linear

    lin = FP8Linear(n_in, n_out, block_size=(128, 128))
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n_out, n_in).to(torch.float8_e4m3fn))
        lin.weight_scale_inv.fill_(0.01)
    return lin


def test_finegrained_fp8_named():
    """transformers' FP8Linear takes only an unquantized input: an MLP of them (patched or not) and a lone FP8Linear
    are named with that reason, never converted."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    mlp = LlamaMLP(transformers.LlamaConfig(**DECODER))
    for name in ("gate_proj", "up_proj", "down_proj"):
        old = getattr(mlp, name)
        setattr(mlp, name, _fp8_linear(old.in_features, old.out_features))
    model = nn.Sequential(mlp, _fp8_linear(128, 128))
    with pytest.warns(UserWarning) as rec:
        quantize_fp8(model)
    msg = " ".join(str(w.message) for w in rec)
    assert "0 (LlamaMLP), 1 (FP8Linear) are not converted: already FP8 (FineGrainedFP8): left as is, because" in msg
    assert "FP8Linear takes only the unquantized input" in msg
    assert type(model[0]) is LlamaMLP


def test_patched_finegrained_fp8_mlp_named_whole():
    """patch_hf_model accelerates the activation of an MLP of FP8Linear (its projections run as they are);
    quantize_fp8 then names the MLP once, not its projections."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    mlp = LlamaMLP(transformers.LlamaConfig(**DECODER))
    for name in ("gate_proj", "up_proj", "down_proj"):
        old = getattr(mlp, name)
        setattr(mlp, name, _fp8_linear(old.in_features, old.out_features))
    assert ffn_ext.patch_hf_model(mlp) == 1
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert ffn_ext.quantize_fp8(mlp) is mlp
    assert [str(w.message).split(" because")[0] for w in rec] == [
        "ffn_ext.quantize_fp8: LlamaMLP (LlamaMLP) is not converted: already FP8 (FineGrainedFP8): left as is,"
    ]


@pytest.mark.parametrize("name, module", [("Glm5NextTextMLP", "glm5_next"), ("MiniMaxM3VLDenseMLP", "minimax_m3_vl")])
def test_patched_clamped_mlps_quantized(name, module):
    """transformers' clamped SwiGLU MLPs (patched as ffn_ext.swiglu_clamped) become FP8GatedFFN with the limit and
    alpha they had when quantized."""
    import importlib
    import types

    try:
        cls = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)
    except (ImportError, AttributeError):
        pytest.skip(f"this transformers has no {name}")
    cfg = types.SimpleNamespace(
        hidden_size=128,
        intermediate_size=256,
        hidden_act="silu",
        swiglu_limit=3.0,
        swiglu_alpha=1.702,
        mlp_bias=False,
        dense_intermediate_size=256,
    )
    torch.manual_seed(0)
    mlp = cls(cfg).eval()
    x = torch.randn(2, 5, 128)
    with torch.no_grad():
        for p in mlp.parameters():  # weights of unit scale: the projections reach past the limit, the clamp acts
            p.copy_(torch.randn_like(p) / 8)
        ref = mlp(x)
        assert ffn_ext.patch_hf_model(mlp) == 1
        m8 = quantize_fp8(mlp)
        assert isinstance(m8, FP8GatedFFN) and m8.gating.op == "swiglu_clamped"
        assert m8.gating.kwargs["limit"] == 3.0
        err = _rel(m8(x), ref)
    print(f"{name}: FP8 relative error {err:.4f} vs the fp32 MLP")
    assert err < 0.1


@pytest.mark.parametrize("where", ["gate_proj", "mlp", "wrapper", "global"])
def test_hooked_patched_mlps_named_not_converted(where):
    """A hook on a patched MLP's projection or on the MLP, a forward wrapper set on it after patching, or a global
    hook changes what it computes, and the FP8 module that replaces it would drop that: quantize_fp8 leaves it as it
    is and names it. (Before, with a hook or wrapper doubling gate_proj's output or the MLP's, layer 0's MLP was
    converted silently: logits 0.25, 0.21 and 0.21 off, relative, against FP8's 0.016 without them.)"""
    model = _model("llama")
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    assert ffn_ext.patch_hf_model(model) == 2
    mlp = model.model.layers[0].mlp
    double = lambda mod, args, out: 2 * out if mod is mlp or where == "gate_proj" else out  # noqa: E731
    handle = None
    if where == "global":
        handle = nn.modules.module.register_module_forward_hook(double)
    elif where == "wrapper":
        patched = mlp.forward
        mlp.forward = lambda x: 2 * patched(x)
    else:
        handle = (mlp if where == "mlp" else mlp.gate_proj).register_forward_hook(double)
    try:
        with torch.no_grad():
            ref = model(ids).logits
            with warnings.catch_warnings(record=True) as rec:
                warnings.simplefilter("always")
                quantize_fp8(model)
            got = model(ids).logits
    finally:
        if handle is not None:
            handle.remove()
    assert _rel(got, ref) < 0.05  # layer 1's MLP in FP8 (but with a global hook): 0.009
    assert model.model.layers[0].mlp is mlp
    msgs = [str(w.message) for w in rec if "not converted" in str(w.message)]
    named = "model.layers.0.mlp (LlamaMLP) is"
    if where == "global":
        named = "model.layers.0.mlp (LlamaMLP), model.layers.1.mlp (LlamaMLP) are"
    why = FP8_PROJECTIONS if where == "gate_proj" else FP8_WRAPPED
    assert msgs == [f"ffn_ext.quantize_fp8: {named} not converted: {why}"], msgs
