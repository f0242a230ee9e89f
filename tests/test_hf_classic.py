"""ffn_ext.hf.patch_model on the classic FFN, fc2(act(fc1(x))): tiny randomly initialised transformers models (no
downloads) patched completely and computing what they computed (logits, every parameter's gradient, three training
steps with dropout on, generate()), and the recogniser checked against transformers' source.

Skips when transformers is not importable (it is a test/extra dependency: pip install transformers)."""

import copy
import re
import warnings

import hf_oracle  # noqa: E402  (the class lists of transformers 5.24, test oracles)
import pytest
import torch
from hf_oracle import one_thread, raise_errors  # noqa: F401  (autouse fixtures)
from test_hf import _canonical  # attributes and locals renamed in order: the gated forms' check

import ffn_ext
from ffn_ext.hf import forms
from ffn_ext.hf.recognise import Call, In, _add, evaluate
from ffn_ext.table import ACTIVATIONS

transformers = pytest.importorskip("transformers")

IDS = dict(vocab_size=97, pad_token_id=0, bos_token_id=1, eos_token_id=2)
LM = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=32, **IDS
)
TOWER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)


def _ids(seed=1, shape=(2, 7)):
    return torch.randint(3, 97, shape, generator=torch.Generator().manual_seed(seed))


def _pixels(size=16, seed=2):
    return torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(seed))


def _qwen3_vl_vision():
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    cfg = transformers.Qwen3VLConfig(
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            patch_size=4,
            temporal_patch_size=2,
            spatial_merge_size=2,
            out_hidden_size=32,
            num_position_embeddings=16,
            deepstack_visual_indexes=[0],
        )
    )
    return Qwen3VLVisionModel(cfg.vision_config)


def _qwen3_vl_inputs():
    rows = torch.randn(16, 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(2))
    return dict(hidden_states=rows, grid_thw=torch.tensor([[1, 4, 4]]))


# name: (model factory, inputs, transformers' activation name the model uses, how many classic modules it has,
#        whether it generates)
MODELS = {
    "gpt2": (
        lambda: transformers.GPT2LMHeadModel(
            transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=32, **IDS)
        ),
        lambda: dict(input_ids=_ids()),
        "gelu_new",
        2,
        True,
    ),
    "gpt_neox": (
        lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**LM)),
        lambda: dict(input_ids=_ids()),
        "gelu",
        2,
        True,
    ),
    "falcon": (
        lambda: transformers.FalconForCausalLM(
            transformers.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, **IDS)
        ),
        lambda: dict(input_ids=_ids()),
        "gelu",
        2,
        True,
    ),
    "phi": (
        lambda: transformers.PhiForCausalLM(transformers.PhiConfig(**LM, resid_pdrop=0.1)),
        lambda: dict(input_ids=_ids()),
        "gelu_new",
        2,
        True,
    ),
    "starcoder2": (
        lambda: transformers.Starcoder2ForCausalLM(
            transformers.Starcoder2Config(**LM, num_key_value_heads=1, residual_dropout=0.1)
        ),
        lambda: dict(input_ids=_ids()),
        "gelu_pytorch_tanh",
        2,
        True,
    ),
    "nemotron": (
        lambda: transformers.NemotronForCausalLM(transformers.NemotronConfig(**LM, num_key_value_heads=1)),
        lambda: dict(input_ids=_ids()),
        "relu2",
        2,
        True,
    ),
    "clip": (
        lambda: transformers.CLIPModel(
            transformers.CLIPConfig(
                text_config=dict(**TOWER, vocab_size=97, max_position_embeddings=16),
                vision_config=dict(**TOWER, image_size=16, patch_size=8),
                projection_dim=16,
            )
        ),
        lambda: dict(input_ids=_ids(), pixel_values=_pixels()),
        "quick_gelu",
        4,
        False,
    ),
    "siglip": (
        lambda: transformers.SiglipModel(
            transformers.SiglipConfig(
                text_config=dict(**TOWER, vocab_size=97, max_position_embeddings=16),
                vision_config=dict(**TOWER, image_size=16, patch_size=8),
            )
        ),
        lambda: dict(input_ids=_ids(), pixel_values=_pixels()),
        "gelu_pytorch_tanh",
        5,
        False,
    ),
    "bert": (
        lambda: transformers.BertForMaskedLM(transformers.BertConfig(**TOWER, vocab_size=97)),
        lambda: dict(input_ids=_ids()),
        "gelu",
        2,
        False,
    ),
    "vit": (
        lambda: transformers.ViTModel(transformers.ViTConfig(**TOWER, image_size=16, patch_size=8)),
        lambda: dict(pixel_values=_pixels()),
        "gelu",
        2,
        False,
    ),
    "qwen3_vl_vision": (_qwen3_vl_vision, _qwen3_vl_inputs, "gelu_pytorch_tanh", 2, False),
}


def _entry_for(hf_name):
    return next((a for a in ACTIVATIONS if hf_name in a.hf_names), None)


def _model(kind):
    make, inputs, act, count, generates = MODELS[kind]
    if _entry_for(act) is None:
        pytest.skip(f"needs ffn_ext's table entry for transformers' {act!r} (ffn_ext/table.py has none)")
    torch.manual_seed(0)
    return make(), inputs(), count, generates


def _classic_modules(model):
    """The modules of the classic forms by the 5.24 oracle's lists (the recogniser must find the same ones)."""
    names = hf_oracle.KNOWN_CLASSIC.keys() | hf_oracle.PAIR_LAYERS
    return [m for m in model.modules() if type(m).__name__ in names]


def _out(model, inputs):
    out = model(**inputs)
    return out[0] if not isinstance(out, torch.Tensor) else out


@pytest.mark.parametrize("kind", list(MODELS))
def test_tiny_models_are_patched_completely_and_compute_what_they_did(kind, monkeypatch):
    """Every classic MLP (and BERT-style layer) is patched, without a warning, and each forward runs ffn_ext's fused
    plain MLP once per module; in fp32 the output and every parameter's gradient equal the unpatched model's, in train
    mode with dropout (the same seed for both: the dropout after fc2 stays where it was), over three SGD steps; and
    generate() gives the same tokens."""
    ref, inputs, count, generates = _model(kind)
    model = copy.deepcopy(ref)
    assert len(_classic_modules(model)) == count
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ffn_ext.patch_hf_model(model) == count
    calls = []
    plain = forms.plain_mlp
    monkeypatch.setattr(forms, "plain_mlp", lambda *a, **k: calls.append(a[0].shape) or plain(*a, **k))
    ref.train()
    model.train()
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(3):
        outs = []
        for m, o in ((ref, opt_ref), (model, opt)):
            o.zero_grad()
            torch.manual_seed(10 + step)
            y = _out(m, inputs)
            (y.float().square().mean()).backward()
            outs.append(y)
        torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-4)
        hf_oracle.grads_equal(model, ref, 1e-5)
        opt_ref.step()
        opt.step()
    assert len(calls) == 3 * count, calls
    if generates:
        ref.eval()
        model.eval()
        ids = inputs["input_ids"][:1]
        kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))
    assert ffn_ext.hf.unpatch_model(model) == count
    assert not any(isinstance(v, forms.Patched) for m in model.modules() for v in vars(m).values())


def test_recompute_and_token_chunk_reach_plain_mlp(monkeypatch):
    """patch_model's recompute / token_chunk are passed to plain_mlp by the classic MLPs and the BERT-style layers
    (a later call sets them anew), and the result is unchanged."""
    plain, seen = forms.plain_mlp, []
    for kind in ("gpt2", "bert"):
        ref, inputs, count, _ = _model(kind)
        model = copy.deepcopy(ref)
        seen.clear()
        monkeypatch.setattr(
            forms, "plain_mlp", lambda *a, **k: seen.append((k["recompute"], k["token_chunk"])) or plain(*a, **k)
        )
        assert ffn_ext.patch_hf_model(model, recompute=True, token_chunk=3) == count
        seen.clear()  # the self-checks'
        with torch.no_grad():
            torch.testing.assert_close(_out(model.eval(), inputs), _out(ref.eval(), inputs), atol=1e-5, rtol=1e-4)
        assert seen == [(True, 3)] * count
        assert ffn_ext.patch_hf_model(model) == 0
        seen.clear()
        with torch.no_grad():
            _out(model, inputs)
        assert seen == [(False, None)] * count


@pytest.mark.parametrize("kind", ["gpt2", "bert", "vit", "siglip"])
def test_models_built_under_a_meta_device_context_patch_completely(kind):
    """Deferred init (torch.device("meta")): every classic module is patched, without a warning (no self-check
    runs on meta), and after to_empty + the weights loaded the model computes what the unpatched one does."""
    ref, inputs, count, _ = _model(kind)
    with torch.device("meta"):
        model = MODELS[kind][0]()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ffn_ext.patch_hf_model(model) == count
    hf_oracle.loaded_into(model, ref)
    with torch.no_grad():
        torch.testing.assert_close(_out(model.eval(), inputs), _out(ref.eval(), inputs), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("ffn_dim", [64, 32])
def test_whisper_layers_are_named_with_the_reason(ffn_dim):
    """Whisper's FFN is inline in its encoder and decoder layers' forward (with a dropout between the activation and
    fc2, and the attention in the same forward): named in the one warning, not patched; strict=True refuses. Also
    where the FFN does not widen (transformers' own test config: ffn_dim = d_model)."""
    model = transformers.WhisperModel(
        transformers.WhisperConfig(
            d_model=32,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=ffn_dim,
            decoder_ffn_dim=ffn_dim,
            num_mel_bins=8,
            max_source_positions=16,
            max_target_positions=16,
            vocab_size=97,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=1,
        )
    )
    with pytest.warns(RuntimeWarning) as rec:
        assert ffn_ext.patch_hf_model(model) == 0
    msgs = [str(w.message) for w in rec if w.category is RuntimeWarning]
    assert len(msgs) == 1, msgs
    assert forms.INLINE in msgs[0]
    assert "WhisperEncoderLayer at 'encoder.layers.0'" in msgs[0]
    assert "WhisperDecoderLayer at 'decoder.layers.0'" in msgs[0]
    with pytest.raises(ValueError, match="WhisperEncoderLayer"):
        ffn_ext.patch_hf_model(model, strict=True)


@pytest.mark.parametrize("hidden_act", ["gelu_10", "not_an_activation", "xielu"])
def test_an_activation_ffn_ext_lacks_is_named_never_substituted(hidden_act, monkeypatch):
    """A classic MLP whose activation is not one of the table's is named with it, never run with another."""
    from transformers.models.vit.modeling_vit import ViTMLP

    hf_oracle.not_an_activation(monkeypatch)
    if hidden_act == "xielu":
        act = transformers.activations.ACT2CLS["xielu"]()
    else:
        act = transformers.activations.ACT2FN[hidden_act]
    mlp = ViTMLP(transformers.ViTConfig(hidden_size=16, intermediate_size=32))
    mlp.activation_fn = act
    with pytest.warns(RuntimeWarning, match=f"activation {type(act).__name__} is not one ffn_ext implements"):
        assert ffn_ext.patch_hf_model(mlp) == 0
    with pytest.raises(ValueError, match=type(act).__name__):
        ffn_ext.patch_hf_model(mlp, strict=True)


def test_gelu_fast_is_the_tanh_gelu_within_its_constants_rounding():
    """transformers' gelu_fast writes sqrt(2/pi) as 0.7978845608 and x (1 + 0.044715 x^2) for x + 0.044715 x^3: in
    float32 it equals the tanh GELU within a few ulps (so the table lists it under gelu_tanh); measured here."""
    x = torch.linspace(-12, 12, 200001)
    fast = transformers.activations.ACT2FN["gelu_fast"](x)
    tanh = torch.nn.functional.gelu(x, approximate="tanh")
    assert "gelu_fast" in _entry_for("gelu_pytorch_tanh").hf_names
    torch.testing.assert_close(fast, tanh, atol=1e-6, rtol=4e-7)


def test_lora_like_projections_run_as_modules_around_the_activation_op():
    """A projection that is not a plain nn.Linear / Conv1D (a LoRA-style subclass) is called as a module, with
    ffn_ext's activation op between: same result, and plain_mlp not used."""
    from transformers.models.vit.modeling_vit import ViTMLP

    class LoRALinear(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) + 0.5 * x.sum(-1, keepdim=True)

    torch.manual_seed(0)
    mlp = ViTMLP(transformers.ViTConfig(hidden_size=16, intermediate_size=32))
    lora = LoRALinear(16, 32)
    lora.load_state_dict(mlp.fc1.state_dict())
    mlp.fc1 = lora
    x = torch.randn(3, 16)
    ref = mlp(x)
    assert ffn_ext.patch_hf_model(mlp) == 1
    torch.testing.assert_close(mlp(x), ref, atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------- the lists against transformers' source
# The forms of a classic FFN with their attributes as placeholders: {fc1} {act} {fc2}, then {drop} (a dropout module)
# or {p} (F.dropout's probability attribute). A forward matches whatever its attribute and local variable names.
CLASSIC_FORMS = [
    "x = self.{fc1}(x)\nx = self.{act}(x)\nx = self.{fc2}(x)\nreturn x",
    "return self.{fc2}(self.{act}(self.{fc1}(x)))",
    "x = self.{act}(self.{fc1}(x))\nx = self.{fc2}(x)\nreturn x",
    "h = self.{fc1}(x)\nh = self.{act}(h)\nout = self.{fc2}(h)\nreturn out",
    "x = self.{fc1}(x)\nx = self.{act}(x)\nx = self.{fc2}(x)\nx = self.{drop}(x)\nreturn x",
    "h = self.{act}(self.{fc1}(x))\nh2 = self.{fc2}(h)\nreturn self.{drop}(h2)",
    "x = self.{fc1}(x)\nx = self.{act}(x)\nx = self.{fc2}(x)\n"
    "x = nn.functional.dropout(x, p=self.{p}, training=self.training)\nreturn x",
]
CHUNK = (
    "intermediate_output = self.intermediate(x)\nlayer_output = self.output(intermediate_output, x)\n"
    "return layer_output"
)
INTERMEDIATE = "x = self.dense(x)\nx = self.intermediate_act_fn(x)\nreturn x"
OUTPUT = "h = self.dense(h)\nh = self.dropout(h)\nh = self.LayerNorm(h + x)\nreturn h"
_LINEAR = re.compile(r"(nn\.Linear|Conv1D|FalconLinear)\(.*\)")


def test_the_recogniser_finds_the_classic_classes_of_the_source_matcher():
    """Read from transformers' source with ast: every class whose forward takes one of CLASSIC_FORMS (any attribute
    and local names) with fc1 and fc2 set once in __init__ to nn.Linear / Conv1D / FalconLinear and the dropout to
    nn.Dropout is recognised by ffn_ext's recogniser as classic with those attributes in their roles; at 5.24 these
    are exactly the classes of the list the product held then (hf_oracle.KNOWN_CLASSIC)."""
    known = {}
    for f in CLASSIC_FORMS:
        c, roles = _canonical(f.format(fc1="fc1", act="act", fc2="fc2", drop="drop", p="p"))
        known[c] = roles
    found, wrong = {}, {}
    for node, methods, path in hf_oracle.modeling_classes():
        body = hf_oracle.body(methods["forward"]) if "forward" in methods else None
        if body is None:
            continue
        canonical, attrs = _canonical(body)
        if canonical not in known:
            continue
        role = dict(zip(known[canonical], attrs))
        asg = hf_oracle.init_assignments(node)
        ok = all(len(asg.get(role[r], [])) == 1 for r in ("fc1", "fc2")) and all(
            _LINEAR.fullmatch(asg[role[r]][0]) for r in ("fc1", "fc2")
        )
        if "drop" in role:
            ok = ok and asg.get(role["drop"], [""])[0].startswith("nn.Dropout(")
        inst = hf_oracle.bare(hf_oracle.load(node.name, path)) if ok else None
        if inst is None:
            continue
        drop = role.get("drop") or ("p:" + role["p"] if "p" in role else "")
        want = (role["fc1"], role["act"], role["fc2"], drop)
        found.setdefault(node.name, set()).add(want)
        got = forms.recognised(inst)
        if got is None or got[0].name != "classic":
            wrong[node.name] = got
        elif (got[1].names[0], got[1].gate.act, got[1].names[1], got[1].drop) != want:
            wrong[node.name] = (want, got)
    assert not wrong, wrong
    assert {
        "GPT2MLP",
        "GPTNeoXMLP",
        "FalconMLP",
        "PhiMLP",
        "Starcoder2MLP",
        "CLIPMLP",
        "SiglipMLP",
        "ViTMLP",
        "NemotronMLP",
        "Qwen3VLVisionMLP",
        "GPTJMLP",
        "CodeGenMLP",
        "GPTBigCodeMLP",
        "Idefics3VisionMLP",
    } <= found.keys()
    if transformers.__version__ == "5.24.0":
        assert found.keys() == hf_oracle.KNOWN_CLASSIC.keys(), sorted(found.keys() ^ hf_oracle.KNOWN_CLASSIC.keys())


def test_the_recogniser_reads_the_bert_style_pairs_of_the_source_matcher():
    """The same for the BERT-style pair: layers whose feed_forward_chunk is output(intermediate(x), x), *Intermediate
    forwards act(dense(x)), *Output forwards LayerNorm(dropout(dense(h)) + x), each as the recogniser reads it
    (recognise.evaluate: the value the code returns); at 5.24 exactly the oracle's lists."""
    x, h = In(0), In(1)
    want_chunk = Call("output", (Call("intermediate", (x,)), x))
    want_out = Call("LayerNorm", (_add(Call("dropout", (Call("dense", (x,)),)), h),))
    layers, inters, outs, wrong = set(), set(), set(), {}
    for node, methods, path in hf_oracle.modeling_classes():
        checks = []
        if "feed_forward_chunk" in methods and hf_oracle.body(methods["feed_forward_chunk"]) == CHUNK:
            layers.add(node.name)
            checks.append(("feed_forward_chunk", 1, lambda v: v == want_chunk))
        if "forward" in methods:
            if hf_oracle.body(methods["forward"]) == INTERMEDIATE:
                inters.add(node.name)
                checks.append(("forward", 1, lambda v: isinstance(v, Call) and v.args == (Call("dense", (x,)),)))
            if hf_oracle.body(methods["forward"], ("h", "x")) == OUTPUT:
                outs.add(node.name)
                checks.append(("forward", 2, lambda v: v == want_out))
        for method, n, ok in checks:
            inst = hf_oracle.bare(hf_oracle.load(node.name, path))
            got = inst is not None and evaluate(inst, getattr(type(inst), method), n)
            if inst is not None and not (got and ok(got.value)):
                wrong[node.name] = got
    assert not wrong, wrong
    assert {"BertLayer", "RobertaLayer", "ElectraLayer"} <= layers and "BertIntermediate" in inters
    assert "BertOutput" in outs
    if transformers.__version__ == "5.24.0":
        assert layers == hf_oracle.PAIR_LAYERS, sorted(layers ^ hf_oracle.PAIR_LAYERS)
        assert inters == hf_oracle.INTERMEDIATES, sorted(inters ^ hf_oracle.INTERMEDIATES)
        assert outs == hf_oracle.OUTPUTS, sorted(outs ^ hf_oracle.OUTPUTS)
