"""ffn_ext.hf.patch_model on tiny randomly initialised transformers models (no downloads).

Skips when transformers is not importable (it is a test/extra dependency: pip install transformers)."""

import ast
import copy
import re
import textwrap
import types
import warnings

import hf_oracle  # noqa: E402  (the class lists of transformers 5.24, test oracles; tiny configs)
import pytest
import torch
import torch.nn as nn
from hf_oracle import raise_errors  # noqa: F401  (autouse: a recogniser's error fails the test)

import ffn_ext
from ffn_ext.hf import common, forms, recognise
from ffn_ext.table import ACTIVATIONS

transformers = pytest.importorskip("transformers")

TINY = dict(hf_oracle.TINY_DECODER, hidden_size=64, intermediate_size=176)
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama-mlp-bias": ("LlamaConfig", "LlamaForCausalLM", {"mlp_bias": True}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
}


def _tiny(kind, seed=0, **extra):
    cfg_name, model_name, kw = MODELS[kind]
    config = getattr(transformers, cfg_name)(**TINY, **kw, **extra)
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(config).eval()


def _mlps(model):
    return [m for m in model.modules() if type(m).__name__.endswith("MLP")]


@pytest.mark.parametrize("kind", list(MODELS))
def test_patched_model_matches_unpatched(kind):
    model = _tiny(kind)
    ref = copy.deepcopy(model)
    params = dict(model.named_parameters())
    assert ffn_ext.patch_hf_model(model) == 2
    # the same parameter objects, nothing copied or re-registered
    after = dict(model.named_parameters())
    assert after.keys() == params.keys() and all(after[n] is params[n] for n in params)
    assert model.state_dict().keys() == ref.state_dict().keys()

    ids = torch.randint(3, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    hf_oracle.same_outputs(model, ref, model(ids).logits, ref(ids).logits, grad_atol=1e-5)

    # the patched MLPs really run ffn_ext's lean autograd
    x = torch.randn(3, 64, requires_grad=True)
    mlps = _mlps(model)
    assert len(mlps) == 2
    for mlp in mlps:
        assert "_GatedMLP" in type(mlp(x).grad_fn).__name__
    for mlp in _mlps(ref):
        assert "_GatedMLP" not in type(mlp(x).grad_fn).__name__


def test_patch_is_idempotent_and_reversible_and_survives_deepcopy():
    model = _tiny("qwen2")
    assert ffn_ext.patch_hf_model(model) == 2
    assert ffn_ext.hf.patch_model(model) == 0  # already patched
    x = torch.randn(5, 64, requires_grad=True)
    clone = copy.deepcopy(model)
    for mlp in _mlps(clone):
        assert "_GatedMLP" in type(mlp(x).grad_fn).__name__
        assert mlp.forward.__self__ is mlp  # bound to the copy, not to the original
    assert ffn_ext.hf.unpatch_model(model) == 2
    for mlp in _mlps(model):
        assert "forward" not in vars(mlp)
        assert "_GatedMLP" not in type(mlp(x).grad_fn).__name__
    assert ffn_ext.hf.patch_model(model) == 2


def test_ffn_ext_modules_are_left_fused_and_subclasses_named_with_their_own_forward():
    """ffn_ext's own FFN modules run fused already: patch_hf_model neither patches nor names them, in a model of
    their own or as a Llama's MLP (before, they were named as MLPs whose forward it does not recognise, "run as
    they are, unaccelerated"). A subclass that overrides forward is named as running its own forward."""

    class Half(ffn_ext.GatedFFN):
        def forward(self, x):
            return 0.5 * super().forward(x)

    class HalfFFN(ffn_ext.FFN):
        def forward(self, x):
            return 0.5 * super().forward(x)

    own = (ffn_ext.SwiGLUFFN(8, 16), ffn_ext.SwiGLUFFN(8, 16, fused_gate_up=True), ffn_ext.GeGLUFFN(8, 16))
    net = nn.Sequential(*own, ffn_ext.FFN(8, 16), Half(8, 16), HalfFFN(8, 16))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert ffn_ext.patch_hf_model(net) == 0
    msgs = [str(w.message) for w in rec if "patch_model" in str(w.message)]
    assert msgs == [f"ffn_ext.hf.patch_model: {forms.OWN_FORWARD}: Half at '4', HalfFFN at '5' (left unpatched)"]
    assert not any(forms.MARK in vars(m) for m in net.modules())

    model = _tiny("llama")
    model.model.layers[0].mlp = ffn_ext.SwiGLUFFN(64, 176)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ffn_ext.patch_hf_model(model) == 1  # layer 1's LlamaMLP
    assert forms.MARK not in vars(model.model.layers[0].mlp)


@pytest.mark.parametrize("kind", ["qwen2", "phi3"])
def test_patched_model_pickles(kind):
    """torch.save(model) of a patched model loads back patched, with the same outputs (the patched forward
    once pickled as getattr(mlp, '_gated_forward'), which torch.load could not resolve)."""
    model = _tiny(kind)
    assert ffn_ext.patch_hf_model(model) == 2
    loaded = hf_oracle.reloaded(model)
    ids = torch.randint(3, 97, (2, 6), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    x = torch.randn(3, 64, requires_grad=True)
    for mlp in _mlps(loaded):
        assert mlp.forward.__self__ is mlp
        assert "_GatedMLP" in type(mlp(x).grad_fn).__name__
    assert ffn_ext.hf.unpatch_model(loaded) == 2


# Gemma family: GeGLU MLPs with the tanh GELU (hidden_activation / hidden_act "gelu_pytorch_tanh")
GEMMA_HEADS = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=16)
GEMMA_TINY = dict(hf_oracle.TINY_DECODER, hidden_size=32, intermediate_size=64, **GEMMA_HEADS)
GEMMAS = {
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {}),
    "gemma4": (
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",  # per-layer inputs and the global head kept tiny too
        {
            "vocab_size_per_layer_input": 97,
            "hidden_size_per_layer_input": 8,
            "global_head_dim": 16,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
}


def _tiny_gemma(kind):
    cfg_name, model_name, kw = GEMMAS[kind]
    if not hasattr(transformers, model_name):
        pytest.skip(f"this transformers ({transformers.__version__}) has no {model_name}")
    config = getattr(transformers, cfg_name)(**GEMMA_TINY, **kw)
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config).eval()


@pytest.mark.parametrize("kind", list(GEMMAS))
def test_gemma_models_patch_every_mlp_with_the_tanh_geglu(kind):
    """Tiny random Gemma, Gemma2, Gemma3 (text) and Gemma4 (text), fp32: every decoder layer's MLP is patched and
    runs ffn_ext's geglu_tanh through the lean autograd; logits and all parameter gradients equal the unpatched
    model's; greedy generate() gives the same tokens."""
    model = _tiny_gemma(kind)
    ref = copy.deepcopy(model)
    mlps = _mlps(model)
    assert len(mlps) == model.config.num_hidden_layers == 2
    assert all(common.table_activation(m.act_fn).name == "gelu_tanh" for m in mlps)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        # Gemma 4's layers gate a per-layer input, act(gate(h)) * e, then project it back: FFN-shaped code that no
        # ffn_ext form is, named (not silently skipped)
        warnings.filterwarnings("ignore", r".*\(T5's dropout .*Gemma4TextDecoderLayer at ", RuntimeWarning)
        assert ffn_ext.patch_hf_model(model) == len(mlps)
    assert all(isinstance(vars(m).get("forward"), forms.Patched) for m in mlps)

    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    with _Ops() as rec:
        logits = model(ids).logits
    assert rec.ops.count("ffn_ext.geglu_tanh.default") == len(mlps), rec.ops
    hf_oracle.same_outputs(model, ref, logits, ref(ids).logits, grad_atol=1e-5)
    x = torch.randn(3, 32, requires_grad=True)
    assert all("_GatedMLP" in type(m(x).grad_fn).__name__ for m in mlps)
    hf_oracle.same_generate(model, ref, ids)
    assert ffn_ext.hf.unpatch_model(model) == len(mlps)


# Granite MoE models' shared experts: GraniteMoeSharedMLP, GraniteMoeSWAMLP and GraniteMoeHybridMLP, the packed form
# under the names input_linear / output_linear / activation (forms._PACKED_NAMES), next to each layer's routed
# experts (GraniteMoe*Experts: tests/test_hf_moe.py). GraniteMoeHybrid: a Mamba layer, then an attention layer.
GRANITE_WIDTHS = dict(hidden_size=32, intermediate_size=16, shared_intermediate_size=24)
GRANITE_TINY = dict(hf_oracle.TINY_DECODER, **GRANITE_WIDTHS, num_local_experts=4, num_experts_per_tok=2)
GRANITES = {
    "granitemoeshared": ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM", "GraniteMoeSharedMLP", {}),
    "granitemoe_swa": (
        "GraniteMoeSWAConfig",
        "GraniteMoeSWAForCausalLM",
        "GraniteMoeSWAMLP",
        {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
    ),
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        "GraniteMoeHybridMLP",
        {
            "layer_types": ["mamba", "attention"],
            "mamba_n_heads": 4,
            "mamba_d_head": 16,
            "mamba_d_state": 8,
            "mamba_n_groups": 1,
            "mamba_chunk_size": 16,
        },
    ),
}


@pytest.mark.parametrize("kind", list(GRANITES))
def test_granite_moe_shared_expert_mlps_are_patched_and_match(kind, monkeypatch):
    """Tiny random GraniteMoeShared, GraniteMoeSWA and GraniteMoeHybrid in fp32: every layer's shared-expert MLP
    (output_linear(activation(h[..., :I]) * h[..., I:]), h = input_linear(x)) is patched, with the routed experts, in
    strict mode and without a warning; each runs ffn_ext.mlp.gated_mlp_packed (silu, once per MLP and forward) and
    its lean autograd; with the shared MLPs' weights 20x (SiLU well past its linear range), logits, all parameter
    gradients and greedy generate() equal the unpatched model's; torch.save / torch.load keep the patch (with the
    projection names); unpatch restores the class's forward."""
    cfg_name, model_name, mlp_name, kw = GRANITES[kind]
    if not hasattr(transformers, model_name):
        pytest.skip(f"this transformers ({transformers.__version__}) has no {model_name}")
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, cfg_name)(**GRANITE_TINY, **kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".shared_mlp." in name:
                p.mul_(20)
    ref = copy.deepcopy(model)
    mlps = [m for m in model.modules() if type(m).__name__ == mlp_name]
    experts = [m for m in model.modules() if forms.is_experts(m)]
    assert len(mlps) == len(experts) == 2
    assert all(_packed_names(m) == ("input_linear", "output_linear", "activation") for m in mlps)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ffn_ext.patch_hf_model(model, strict=True) == len(mlps) + len(experts)
    assert all(isinstance(vars(m).get("forward"), forms.Patched) and hf_oracle.patched_as(m) == "packed" for m in mlps)

    calls, packed = [], forms.gated_mlp_packed

    def spy(x, *args, **kwargs):
        calls.append(kwargs["activation"].activation)
        return packed(x, *args, **kwargs)

    monkeypatch.setattr(forms, "gated_mlp_packed", spy)
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    logits, logits0 = model(ids).logits, ref(ids).logits
    assert calls == ["silu"] * len(mlps)
    hf_oracle.same_outputs(model, ref, logits, logits0)
    x = torch.randn(3, 32, requires_grad=True)
    assert all("_GatedMLPPacked" in type(m(x).grad_fn).__name__ for m in mlps)
    hf_oracle.same_generate(model, ref, ids)
    loaded = hf_oracle.reloaded(model)  # pickled with its projection names: loads back patched, the same
    assert [vars(m)["forward"].plan.names for m in loaded.modules() if type(m).__name__ == mlp_name] == [
        ("input_linear", "output_linear")
    ] * len(mlps)
    torch.testing.assert_close(loaded(ids).logits, logits0, atol=1e-5, rtol=1e-5)
    assert ffn_ext.hf.unpatch_model(model) == len(mlps) + len(experts)
    assert not any("forward" in vars(m) for m in mlps)


def _packed_names(module):
    """(projection, projection back, activation) under which a module is shaped like a packed MLP, else None."""
    p = forms.PackedMLP().unrecognised(module, vouched=True)
    return None if p is None else (*p.names, p.gate.act)


def test_granite_shared_mlp_subclasses_and_lookalikes():
    """Modules with input_linear / output_linear nn.Linear children are MLP-shaped whatever their class: a subclass of
    GraniteMoeSharedMLP that keeps its forward is patched; one that overrides it (here a scale) is named in the
    warning, and listed in extra_classes it is refused by the self-check; the model computes what it did."""
    from transformers.models.granitemoeshared.modeling_granitemoeshared import GraniteMoeSharedMLP

    class Keeps(GraniteMoeSharedMLP):
        pass

    class Scales(GraniteMoeSharedMLP):
        def forward(self, hidden_states):
            return super().forward(hidden_states) * 0.5

    config = types.SimpleNamespace(hidden_size=16, shared_intermediate_size=24, hidden_act="silu")
    torch.manual_seed(7)
    net = nn.Sequential(Keeps(config), Scales(config))
    x = torch.randn(2, 3, 16)
    ref = net(x)
    with pytest.warns(RuntimeWarning, match=r"not known to compute.*Scales at '1' \(left unpatched\)"):
        assert ffn_ext.patch_hf_model(net) == 1
    assert hf_oracle.patched_as(net[0]) == "packed" and "forward" not in vars(net[1])
    with pytest.warns(RuntimeWarning, match=r"self-check.*Scales at '1'"):
        assert ffn_ext.patch_hf_model(net, extra_classes=[Scales]) == 0
    torch.testing.assert_close(net(x), ref, atol=1e-6, rtol=1e-5)
    assert "_GatedMLPPacked" in type(net[0](x.requires_grad_()).grad_fn).__name__


@pytest.mark.parametrize(
    "hidden_act, cls",
    [("gelu_10", "ClippedGELUActivation"), ("not_an_activation", "NotAnActivation"), ("relu6", "ReLU6")],
)
def test_mlps_with_an_activation_ffn_ext_lacks_are_skipped_with_a_warning_or_refused(hidden_act, cls, monkeypatch):
    """gelu_10 (a clamped GELU), Mish's math under a name no entry has and relu6 (a clamped ReLU) look like
    activations of the table but are none of them: named, never substituted."""
    hf_oracle.not_an_activation(monkeypatch)
    assert not any(hidden_act in a.hf_names for a in ffn_ext.table.ACTIVATIONS)
    model = _tiny("llama", hidden_act=hidden_act)
    ids = torch.randint(3, 97, (1, 5), generator=torch.Generator().manual_seed(5))
    ref = model(ids).logits
    with pytest.warns(
        RuntimeWarning,
        match=rf"activation {cls} is not one ffn_ext implements.*: LlamaMLP at "
        r"'model.layers.0.mlp' and 1 more \(left unpatched\)",
    ):
        assert ffn_ext.patch_hf_model(model) == 0
    assert all("forward" not in vars(m) for m in _mlps(model))
    with pytest.raises(ValueError, match=f"activation {cls} is not one ffn_ext implements"):
        ffn_ext.patch_hf_model(model, strict=True)
    torch.testing.assert_close(model(ids).logits, ref, rtol=0, atol=0)


from optable import RecordOps as _Ops  # noqa: E402  (records the ops that run inside it)


def _hf_act2fn():
    from transformers.activations import ACT2FN

    return ACT2FN


def _table_entry_of(hf_name):
    return next((a for a in ACTIVATIONS if hf_name in a.hf_names), None)


def test_table_hf_names_are_the_same_function_as_transformers_act2fn():
    """Every ACT2FN name in the table's hf_names computes the entry's function (fp64, on [-12, 12] and at +-30:
    equal to rounding, gelu_fast to its 10-digit sqrt(2/pi)), and every other ACT2FN name computes none of the
    table's functions (so hf_names misses none)."""
    act2fn = _hf_act2fn()
    x = torch.cat(
        [torch.linspace(-12, 12, 4801, dtype=torch.float64), torch.tensor([-30.0, 30.0], dtype=torch.float64)]
    )
    listed = {n for a in ACTIVATIONS for n in a.hf_names}
    assert listed <= set(act2fn), listed - set(act2fn)
    for name in act2fn:
        try:
            y = act2fn[name](x)
        except Exception:  # e.g. an activation with a dtype of its own; not a table function either way
            assert name not in listed, name
            continue
        same = [a.name for a in ACTIVATIONS if bool(torch.allclose(y, a.aten(x), rtol=1e-11, atol=1e-11))]
        entry = _table_entry_of(name)
        assert same == ([entry.name] if entry else []), (name, same)


@pytest.mark.parametrize(
    "hidden_act",
    list(
        dict.fromkeys(
            [
                "gelu",
                "gelu_python",
                "gelu_pytorch_tanh",
                "gelu_python_tanh",
                "gelu_new",
                "gelu_fast",
                "gelu_accurate",
                "silu",
                "swish",
                "quick_gelu",
                "gelu_10",
                "mish",
                "relu2",
            ]
        )
    ),
)
def test_every_act2fn_activation_is_identified_truthfully(hidden_act):
    """A Llama MLP with each ACT2FN activation: those of the table's hf_names are patched with that entry's gated
    op (recorded) and give the unpatched MLP's output and gradients; the others are left alone, named."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    act = _table_entry_of(hidden_act)
    torch.manual_seed(6)
    mlp = LlamaMLP(
        transformers.LlamaConfig(
            hidden_size=16, intermediate_size=40, hidden_act=hidden_act, num_attention_heads=2, mlp_bias=True
        )
    ).double()
    ref = copy.deepcopy(mlp)
    assert common.table_activation(mlp.act_fn) is act
    if act is None:
        with pytest.warns(RuntimeWarning, match=f"activation {type(mlp.act_fn).__name__} is not one"):
            assert ffn_ext.patch_hf_model(mlp) == 0
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ffn_ext.patch_hf_model(mlp) == 1
    x = torch.randn(2, 3, 16, dtype=torch.float64, requires_grad=True)
    x0 = x.detach().clone().requires_grad_()
    with _Ops() as rec:
        y = mlp(x)
        y.sum().backward()
    assert f"ffn_ext.{act.gated}.default" in rec.ops and f"ffn_ext.{act.gated}_backward.default" in rec.ops
    assert "_GatedMLP" in type(y.grad_fn).__name__
    y0 = ref(x0)
    y0.sum().backward()
    tol = dict(rtol=1e-10, atol=1e-10) if hidden_act != "gelu_fast" else dict(rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(y, y0, **tol)
    torch.testing.assert_close(x.grad, x0.grad, **tol)
    for (name, p), p0 in zip(mlp.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, p0.grad, **tol, msg=name)


def test_hf_activation_classes_are_those_of_transformers():
    """ffn_ext.hf reads transformers' activation classes from its ACT2CLS: a class is an entry's exactly when every
    ACT2CLS name it is registered under (whatever the constructor arguments) is in that entry's hf_names; a class
    also registered under a name of no entry (or of another) is none. Every entry's hf_names that ACT2CLS maps to a
    transformers.activations class gives that entry."""
    import transformers.activations as A

    by_class = {}
    for name, v in A.ACT2CLS.items():
        by_class.setdefault(v[0] if isinstance(v, tuple) else v, []).append(name)
    for cls, names in by_class.items():
        if cls.__module__ != "transformers.activations":
            continue
        entries = {getattr(_table_entry_of(n), "name", None) for n in names}
        want = _table_entry_of(names[0]) if len(entries) == 1 and None not in entries else None
        got = ffn_ext.hf.common._hf_entry(cls)
        assert got is want, (cls.__name__, names, got and got.name)
    for a in ACTIVATIONS:
        for n in a.hf_names:
            v = A.ACT2CLS.get(n)
            cls = v[0] if isinstance(v, tuple) else v
            if cls is not None and cls.__module__ == "transformers.activations":
                assert ffn_ext.hf.common._hf_entry(cls) is a, (a.name, n)
    assert A.PytorchGELUTanh is A.GELUTanh and common.table_activation(A.PytorchGELUTanh()).name == "gelu_tanh"


def test_lora_like_projection_and_hooks_keep_working():
    """A projection that is not a plain nn.Linear, or a hook on one, runs as a module (activation still fused)."""
    model = _tiny("llama")
    ref = copy.deepcopy(model)

    class Scaled(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 0.5

    for m in (model, ref):
        mlp = m.model.layers[0].mlp
        old = mlp.up_proj
        new = Scaled(old.in_features, old.out_features, bias=False)
        new.weight = old.weight
        mlp.up_proj = new
    seen = []
    model.model.layers[1].mlp.down_proj.register_forward_hook(lambda mod, i, o: seen.append(tuple(o.shape)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ffn_ext.patch_hf_model(model) == 2
    ids = torch.randint(3, 97, (1, 7), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(model(ids).logits, ref(ids).logits, atol=1e-5, rtol=1e-5)
    assert seen == [(1, 7, 64)]


@pytest.mark.parametrize("kind", ["llama", "phi3"])
def test_activation_hooks_and_replacement_run_the_models_own_forward(kind):
    """The fused forms never call the activation module. A hook on it (or a global module hook) must still fire,
    and an activation replaced after patching must be what runs: then the MLP runs its class's forward."""
    model = _tiny(kind)
    ref = copy.deepcopy(model)
    assert ffn_ext.patch_hf_model(model) == 2
    mlp, mlp0 = model.model.layers[0].mlp, ref.model.layers[0].mlp
    name = "act_fn" if kind == "llama" else "activation_fn"
    x = torch.randn(2, 3, 64, requires_grad=True)

    def fused(m):
        return "_GatedMLP" in type(m(x).grad_fn).__name__

    assert fused(mlp)
    # a forward hook that changes the activation's output, on both models: same result, and it fired
    seen = []

    def halve(mod, inputs, out):
        seen.append(tuple(out.shape))
        return out * 0.5

    handles = [getattr(m, name).register_forward_hook(halve) for m in (mlp, mlp0)]
    torch.testing.assert_close(mlp(x), mlp0(x), atol=1e-5, rtol=1e-5)
    assert len(seen) == 2 and not fused(mlp)
    for h in handles:
        h.remove()
    assert fused(mlp)

    # a global forward hook sees the activation run, as in the unpatched model
    names = []
    h = nn.modules.module.register_module_forward_hook(lambda mod, i, o: names.append(type(mod).__name__))
    try:
        mlp(x)
        patched_calls, names[:] = list(names), []
        mlp0(x)
    finally:
        h.remove()
    assert patched_calls == names and len(names) == (5 if kind == "llama" else 4), (patched_calls, names)
    assert fused(mlp)

    # the activation replaced after patching by one ffn_ext lacks (here Mish): the replacement runs, not the fused
    # SiLU; by another of the table's (the tanh GELU): fused with that one
    for m in (mlp, mlp0):
        setattr(m, name, nn.Mish())
    torch.testing.assert_close(mlp(x), mlp0(x), atol=1e-5, rtol=1e-5)
    assert not fused(mlp)
    for m in (mlp, mlp0):
        setattr(m, name, nn.GELU(approximate="tanh"))
    with _Ops() as rec:
        y = mlp(x)
    torch.testing.assert_close(y, mlp0(x), atol=1e-5, rtol=1e-5)
    op = "ffn_ext.geglu_tanh" + ("_packed" if kind == "phi3" else "") + ".default"
    assert fused(mlp) and op in rec.ops and not any("aten.gelu" in o for o in rec.ops), rec.ops
    setattr(mlp, name, nn.SiLU())  # another SiLU: fused again
    assert fused(mlp)
    # the record of the activation goes with unpatch
    assert ffn_ext.hf.unpatch_model(model) == 2
    assert not hasattr(mlp, forms.MARK)


class MyMLP(nn.Module):
    def __init__(self, scale=1.0):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(8, 24), nn.Linear(8, 24)
        self.down_proj, self.act_fn = nn.Linear(24, 8), nn.SiLU()
        self.scale = scale

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)) * self.scale


def test_own_classes_are_patched_when_listed_in_extra_classes():
    """A class of one's own is patched only when listed in extra_classes (a subclass that keeps its forward too);
    unlisted, it is left alone with a warning that names it and says what to do."""

    class Sub(MyMLP):  # inherits the listed forward
        pass

    torch.manual_seed(3)
    net = nn.Sequential(MyMLP(), Sub())
    x = torch.randn(4, 8)
    ref = net(x)
    with pytest.warns(RuntimeWarning, match=r"not known to compute.*extra_classes.*MyMLP at '0'.*Sub at '1'"):
        assert ffn_ext.patch_hf_model(net) == 0
    with pytest.raises(ValueError, match="MyMLP"):
        ffn_ext.patch_hf_model(net, strict=True)
    with pytest.raises(TypeError, match="extra_classes must be classes"):
        ffn_ext.patch_hf_model(net, extra_classes=["MyMLP"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ffn_ext.patch_hf_model(net, extra_classes=[MyMLP]) == 2
    torch.testing.assert_close(net(x), ref)
    assert "_GatedMLP" in type(net[1](x.requires_grad_()).grad_fn).__name__


def test_self_check_refuses_a_listed_class_that_is_not_plain_swiglu():
    """The self-check runs the listed class's own forward and the fused one on a random input before patching:
    a forward that does more than SwiGLU (here a scale) is left unpatched, with a warning or (strict) ValueError,
    and the model computes what it did."""
    torch.manual_seed(4)
    net = nn.Sequential(MyMLP(), MyMLP(scale=0.5))
    x = torch.randn(4, 8)
    ref = net(x)
    with pytest.raises(ValueError, match=r"self-check.*MyMLP at '1' \(strict=True: nothing patched"):
        ffn_ext.patch_hf_model(net, strict=True, extra_classes=[MyMLP])
    assert all("forward" not in vars(m) for m in net)  # strict: nothing patched
    with pytest.warns(RuntimeWarning, match=r"self-check.*MyMLP at '1'"):
        assert ffn_ext.patch_hf_model(net, extra_classes=[MyMLP]) == 1
    assert "forward" in vars(net[0]) and "forward" not in vars(net[1])
    torch.testing.assert_close(net(x), ref)


# Modules of transformers 5.24 with gate_proj/up_proj/down_proj (or gate_up_proj/down_proj) nn.Linear children and a
# SiLU whose forward does more than SwiGLU: class -> its modeling module (the difference in the comment). The clamped
# ones (DeepseekV4MLP, Glm5NextTextMLP: ffn_ext.swiglu_clamped) are patched, and those that clamp the activation's
# output (Step3p7MLP: recognise.CLAMPS_AFTER) named with that reason: tests/test_hf_moe.py
LOOKALIKES = {
    "FalconH1MLP": "falcon_h1",  # gate_multiplier, down_multiplier
    "InklingMLP": "inkling",  # global_scale
    "DoryMLP": "dory",  # suv scales and ffn_sub_norm
    "SeedOssMLP": "seed_oss",  # residual dropout in training
    "Phi4MultimodalAudioMLP": "phi4_multimodal",  # layer_norm first, packed halves in the order up, gate
    "Zamba2MLP": "zamba2",  # adapters added to gate_up; forward(hidden_state, layer_idx)
}
LOOKALIKE_CONFIG = types.SimpleNamespace(
    hidden_size=16,
    intermediate_size=32,
    hidden_act="silu",
    activation="silu",
    mlp_bias=False,
    add_bias_linear=False,
    mlp_multipliers=(2.0, 0.5),
    swiglu_limit=0.5,
    residual_dropout=0.5,
    dropout_rate=0.0,
    adapter_rank=4,
    num_mem_blocks=1,
    hybrid_layer_ids=[0],
)


@pytest.mark.parametrize("name", list(LOOKALIKES))
def test_mlps_that_only_look_like_swiglu_are_left_alone(name):
    """These once were patched by structure and then computed plain SwiGLU, silently dropping the rest."""
    cls = hf_oracle.modeling_class(name, LOOKALIKES[name])
    torch.manual_seed(0)
    mlp = cls(LOOKALIKE_CONFIG, num_fwd_mem_blocks=1, block_id=0) if name == "Zamba2MLP" else cls(LOOKALIKE_CONFIG)
    if name == "InklingMLP":
        mlp.global_scale.data.fill_(0.5)
    mlp.train(name == "SeedOssMLP")
    args = (torch.randn(3, 16),) + ((0,) if name == "Zamba2MLP" else ())

    def run():
        torch.manual_seed(1)  # the same dropout mask each time
        return mlp(*args)

    ref = run()
    with pytest.warns(RuntimeWarning, match=f"not known to compute.*{name} at 'model'"):
        assert ffn_ext.patch_hf_model(mlp) == 0
    torch.testing.assert_close(run(), ref, rtol=0, atol=0)
    with pytest.raises(ValueError, match=name):
        ffn_ext.patch_hf_model(mlp, strict=True)
    # listing one whose difference shows on a random input is refused by the self-check
    if name in ("FalconH1MLP", "InklingMLP", "DoryMLP", "Phi4MultimodalAudioMLP"):
        with pytest.warns(RuntimeWarning, match=f"self-check.*{name}"):
            assert ffn_ext.patch_hf_model(mlp, extra_classes=[cls]) == 0
        torch.testing.assert_close(run(), ref, rtol=0, atol=0)


# The forms of a plain gated MLP that _KNOWN's forwards take (their parameter renamed x), with their attributes as
# placeholders: gated {gate} {up} {down} {act}; packed (PACKED_FORMS) {proj} (to [..., 2I], gate half first), {out},
# {act}. A forward matches a form whatever its attribute and local variable names (_canonical), so a class of one of
# these forms under new names is found too. Which activation act / act_fn / activation_fn is, patch_model reads from
# the module (it is whatever ACT2FN[config.hidden_act] gives: SiLU for Llama, the tanh GELU for Gemma, ...).
GATED_FORMS = [
    "return self.{down}(self.{act}(self.{gate}(x)) * self.{up}(x))",
    "down_proj = self.{down}(self.{act}(self.{gate}(x)) * self.{up}(x))\nreturn down_proj",
    "down_proj = self.{act}(self.{gate}(x)) * self.{up}(x)\nreturn self.{down}(down_proj)",
    "gate = self.{act}(self.{gate}(x))\nreturn self.{down}(gate * self.{up}(x))",
]
PACKED_FORMS = [
    "up_states = self.{proj}(x)\ngate, up_states = up_states.chunk(2, dim=-1)\n"
    "up_states = up_states * self.{act}(gate)\nreturn self.{out}(up_states)",  # Phi-3
    "x = self.{proj}(x)\nchunked_hidden_states = x.chunk(2, dim=-1)\n"
    "x = self.{act}(chunked_hidden_states[0]) * chunked_hidden_states[1]\nx = self.{out}(x)\nreturn x",  # Granite MoE
]
# Packed MLPs that compute what no ffn_ext op does: the name of the reason (hf_oracle.reason) -> forms,
# with {drop} a dropout module. Each class of these forms is named in patch_model's warning with that reason.
NAMED_FORMS = {
    "DROPOUT_BETWEEN": [
        "gate, up = self.{proj}(x).chunk(2, dim=-1)\nreturn self.{out}(self.{drop}(self.{act}(gate) * up))"
    ],  # ModernBERT
    "UP_FIRST": [
        "x = self.{proj}(x)\nx, gate = x.chunk(2, dim=-1)\nx = self.{act}(gate) * x\nx = self.{out}(x)\nreturn x"
    ],  # Moonshine's decoder: the up half first
}
# a file whose source matches none of these has no forward of those forms (each form has one of them: checked below);
# the test parses only the others, whatever their attribute names (parsing every modeling file takes 3x as long)
_FORM_TEXT = re.compile(r"\*\s*self\.\w+\(\s*\w+\s*\)|\.chunk\(\s*2\s*,\s*dim\s*=\s*-1\s*\)")
_ACT_ATTRS = ("act_fn", "activation_fn")


def _canonical(body: str) -> tuple:
    """(body with self's attributes renamed a0, a1, ... and its local variables (but x) v0, v1, ..., in the order
    they are first met, the attribute names in that order)."""
    tree = ast.parse(body)
    local = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)} - {"x"}
    attrs, names = [], {}
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self":
            if n.attr not in attrs:
                attrs.append(n.attr)
            n.attr = f"a{attrs.index(n.attr)}"
        elif isinstance(n, ast.Name) and n.id in local:
            n.id = names.setdefault(n.id, f"v{len(names)}")
    return ast.unparse(tree), tuple(attrs)


def _forms(groups=(("gated", GATED_FORMS), ("packed", PACKED_FORMS))) -> dict:
    """canonical source -> (kind, its placeholders in the order _canonical met them) of the forms of `groups` ((kind,
    forms) pairs; by default GATED_FORMS, PACKED_FORMS)."""
    out = {}
    for kind, group in groups:
        for form in group:
            assert _FORM_TEXT.search(form.replace("{", "").replace("}", "")), form
            src = form.format(gate="gate", up="up", down="down", act="act", proj="proj", out="out", drop="drop")
            canonical, roles = _canonical(src)
            assert canonical not in out, form
            out[canonical] = (kind, roles)
    return out


def _form_of(body: str | None, forms: dict):
    """(kind, {placeholder: attribute}) of the form a forward's body takes, else None."""
    if body is None:
        return None
    canonical, attrs = _canonical(body)
    if canonical not in forms:
        return None
    kind, roles = forms[canonical]
    return kind, dict(zip(roles, attrs))


def _transformers_forwards():
    """(class node, the body of its forward (hf_oracle.body), its uninitialised instance maker) for each class of
    transformers' modeling files whose source matches _FORM_TEXT."""
    for node, methods, path in hf_oracle.modeling_classes(_FORM_TEXT.pattern):
        if "forward" in methods:
            yield (
                node,
                hf_oracle.body(methods["forward"]),
                lambda n=node.name, p=path: hf_oracle.bare(hf_oracle.load(n, p)),
            )


def _read(module):
    """(form, names, activation attribute, limit attribute) as the recogniser reads the module's code, or None."""
    found = forms.recognised(module)
    if found is None or not isinstance(found[1], forms.Plan):
        return None
    form, p = found
    return form.name, p.names, p.gate.act, p.gate.limit


def test_the_recogniser_agrees_with_the_source_matcher_and_the_oracle():
    """Two independent readings of transformers' source agree: every class whose forward this file's matcher of
    canonical source (GATED_FORMS, PACKED_FORMS, whatever the names) finds of a plain gated or packed form is
    recognised by ffn_ext's recogniser (ffn_ext/hf/recognise.py: the code run symbolically) as the same kind, with
    the same attributes in the same roles. At 5.24 these are exactly the classes of the list the product held then
    (hf_oracle.KNOWN); at a later release, a listed class missing from them has changed its code (Bailing-Hybrid's
    MLP clamps in 5.25) and must not be recognised as plain."""
    known = _forms()
    checked, wrong = set(), {}
    for node, body, make in _transformers_forwards():
        form = _form_of(body, known)
        inst = make() if form is not None or node.name in hf_oracle.KNOWN else None
        if inst is None:
            continue
        got = _read(inst)
        if form is None:  # a listed class whose code changed: not recognised as plain
            if got is not None and got[0] in ("gated", "packed") and got[3] is None:
                wrong[node.name] = ("listed class no longer plain, recognised as", got)
            continue
        kind, attrs = form
        want = (attrs["gate"], attrs["up"], attrs["down"]) if kind == "gated" else (attrs["proj"], attrs["out"])
        if got is None or got[:3] != (kind, want, attrs["act"]):
            wrong[node.name] = (form, got)
        checked.add(node.name)
    assert not wrong, wrong
    assert {"LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP", "GemmaMLP", "Gemma3MLP", "Phi3MLP"} <= checked
    if transformers.__version__ == "5.24.0":
        assert checked == hf_oracle.KNOWN, (sorted(checked - hf_oracle.KNOWN), sorted(hf_oracle.KNOWN - checked))
    else:
        assert len(checked & hf_oracle.KNOWN) >= 0.9 * len(hf_oracle.KNOWN)


def test_the_form_check_finds_plain_gated_mlps_under_new_names():
    """The check above matches forms, not names: a forward of a plain gated or packed form under attribute and local
    names no class uses is of that form (with its attributes in their roles); the same with a swapped order, an
    extra multiplier or the halves taken the other way round is not."""
    known = _forms()

    def form(src):
        fwd = ast.parse("def forward(self, h):\n" + textwrap.indent(src, "    ")).body[0]
        return _form_of(hf_oracle.body(fwd), known)

    assert form(
        "h = self.w_in(h)\na = h.chunk(2, dim=-1)\nh = self.nonlin(a[0]) * a[1]\nh = self.w_out(h)\nreturn h"
    ) == ("packed", {"proj": "w_in", "act": "nonlin", "out": "w_out"})
    assert form("return self.w2(self.act(self.w1(h)) * self.w3(h))") == (
        "gated",
        {"down": "w2", "act": "act", "gate": "w1", "up": "w3"},
    )
    assert form("u = self.fc1(h)\ng, u = u.chunk(2, dim=-1)\nu = u * self.act(g)\nreturn self.fc2(u)")[0] == "packed"
    named = _forms(tuple(NAMED_FORMS.items()))
    assert _form_of(
        hf_oracle.body(
            ast.parse(
                "def forward(self, h):\n    a, b = self.p(h).chunk(2, dim=-1)\n    return self.q(self.d(self.f(a) * b))"
            ).body[0]
        ),
        named,
    ) == ("DROPOUT_BETWEEN", {"proj": "p", "out": "q", "drop": "d", "act": "f"})
    assert _form_of(
        hf_oracle.body(
            ast.parse(
                "def forward(self, h):\n    h = self.p(h)\n    h, g = h.chunk(2, dim=-1)\n"
                "    h = self.f(g) * h\n    h = self.q(h)\n    return h"
            ).body[0]
        ),
        named,
    ) == ("UP_FIRST", {"proj": "p", "act": "f", "out": "q"})
    for other in (
        "h = self.w_in(h)\na = h.chunk(2, dim=-1)\nh = self.nonlin(a[1]) * a[0]\nh = self.w_out(h)\nreturn h",
        "return self.w2(self.act(self.w1(h)) * self.w3(h)) * self.scale",
        "u = self.fc1(h)\nu, g = u.chunk(2, dim=-1)\nu = u * self.act(g)\nreturn self.fc2(u)",
    ):
        assert form(other) is None, other


def test_named_packed_lookalikes_are_recognised_with_their_reason():
    """Every class whose forward the canonical matcher finds of a NAMED_FORMS form (a dropout between the gating and
    the projection back; the up half first) is recognised as Named with that reason, and at 5.24 those are the
    classes of the list the product held then (hf_oracle.NAMED)."""
    known = _forms(tuple(NAMED_FORMS.items()))
    found, wrong = set(), {}
    for node, body, make in _transformers_forwards():
        form = _form_of(body, known)
        inst = make() if form is not None else None
        if inst is None:
            continue
        got = forms.recognised(inst)
        if got is None or got[1] != recognise.Named(hf_oracle.reason(form[0])):
            wrong[node.name] = (form, got)
        found.add(node.name)
    assert not wrong, wrong
    assert {"ModernBertMLP", "MoonshineDecoderMLP"} <= found
    if transformers.__version__ == "5.24.0":
        assert hf_oracle.NAMED.keys() <= found


# hf_oracle.NAMED: class -> its modeling module
NAMED_MODULES = {
    "ModernBertMLP": "modernbert",
    "ModernBertDecoderMLP": "modernbert_decoder",
    "MoonshineDecoderMLP": "moonshine",
    "MoonshineStreamingDecoderMLP": "moonshine_streaming",
}
NAMED_CONFIG = types.SimpleNamespace(
    hidden_size=16, intermediate_size=24, mlp_bias=True, hidden_activation="gelu", mlp_dropout=0.1
)


@pytest.mark.parametrize("name", list(NAMED_MODULES))
def test_named_packed_lookalikes_are_named_with_their_reason(name):
    """ModernBERT's MLPs (dropout between the gating and Wo) and Moonshine's decoder MLPs (the up half first), with an
    activation of the table (GELU, SiLU) and in eval mode: named in the warning with their reason, also when listed in
    extra_classes and in a subclass that keeps the forward; strict=True refuses; the output is what it was. A
    subclass whose forward is the plain packed form (gate first, no dropout) under those names is MLP-shaped: named
    as not known, and patched (self-check passed) when listed."""
    assert NAMED_MODULES.keys() == hf_oracle.NAMED.keys()
    cls = hf_oracle.modeling_class(name, NAMED_MODULES[name])
    proj, out, act, reason = hf_oracle.NAMED[name]
    reason = hf_oracle.reason(reason)

    class Keeps(cls):
        pass

    class GateFirst(cls):
        def forward(self, x):
            gate, up = getattr(self, proj)(x).chunk(2, dim=-1)
            return getattr(self, out)(getattr(self, act)(gate) * up)

    def make(c):
        return c(NAMED_CONFIG, "silu") if name.startswith("Moonshine") else c(NAMED_CONFIG)

    torch.manual_seed(0)
    net = nn.Sequential(make(cls), make(Keeps), make(GateFirst)).eval()
    assert common.table_activation(getattr(net[0], act)) is not None
    assert all(_packed_names(m) == (proj, out, act) for m in net)
    x = torch.randn(2, 3, 16)
    ref = [m(x) for m in net]
    for extra in ((), (cls, Keeps)):  # GateFirst's getattr(self, ...) calls are not code the recogniser reads
        with pytest.warns(RuntimeWarning) as rec:
            assert ffn_ext.patch_hf_model(net, extra_classes=extra) == 0
        (msg,) = [str(w.message) for w in rec if w.category is RuntimeWarning]
        assert msg == (
            f"ffn_ext.hf.patch_model: {reason}: {name} at '0', Keeps at '1'; {forms.UNKNOWN_MLP}: "
            "GateFirst at '2' (left unpatched)"
        ), msg
        with pytest.raises(ValueError, match=re.escape(f"{reason}: {name} at '0'")):
            ffn_ext.patch_hf_model(net, strict=True, extra_classes=extra)
        assert all(torch.equal(m(x), r) for m, r in zip(net, ref))
        assert not any("forward" in vars(m) for m in net[:2])
    with pytest.warns(RuntimeWarning, match=re.escape(reason)):
        assert ffn_ext.patch_hf_model(net, extra_classes=[GateFirst]) == 1  # vouched, and its self-check agrees
    assert hf_oracle.patched_as(net[2]) == "packed" and vars(net[2])["forward"].plan.names == (proj, out)
    y = net[2](x.requires_grad_())
    assert "_GatedMLPPacked" in type(y.grad_fn).__name__
    torch.testing.assert_close(y, ref[2], atol=1e-5, rtol=1e-5)


def test_named_packed_lookalikes_in_tiny_models_and_plain_fc1_fc2_mlps_are_not():
    """Tiny random ModernBERT and Moonshine: their gated MLPs are named (with the count), Moonshine's encoder MLPs
    (fc2(act(fc1(x))), fc1 / fc2 as CLIP's) are not gated-MLP-shaped: they are patched as classic FFNs
    (tests/test_hf_classic.py); strict=True refuses; logits are unchanged."""
    torch.manual_seed(0)
    bert = transformers.ModernBertModel(
        transformers.ModernBertConfig(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=2,
            vocab_size=97,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            cls_token_id=1,
            sep_token_id=2,
        )
    ).eval()
    moon = transformers.MoonshineForConditionalGeneration(
        transformers.MoonshineConfig(
            hidden_size=32,
            intermediate_size=48,
            encoder_num_hidden_layers=1,
            decoder_num_hidden_layers=2,
            encoder_num_attention_heads=2,
            decoder_num_attention_heads=2,
            vocab_size=97,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=1,
        )
    ).eval()
    ids = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(1))
    audio = torch.randn(1, 2000, generator=torch.Generator().manual_seed(2))

    def run(model):
        if model is bert:
            return model(ids).last_hidden_state
        return model(input_values=audio, decoder_input_ids=ids).logits

    enc = [m for m in moon.modules() if type(m).__name__ == "MoonshineEncoderMLP"]
    assert enc and all(_packed_names(m) is None for m in enc)
    for model, reason, where in (
        (bert, forms.DROPOUT_BETWEEN, "ModernBertMLP at 'layers.0.mlp' and 1 more"),
        (moon, recognise.UP_FIRST, "MoonshineDecoderMLP at 'model.decoder.layers.0.mlp' and 1 more"),
    ):
        ref = run(model)
        with pytest.warns(RuntimeWarning) as rec:
            assert ffn_ext.patch_hf_model(model) == (0 if model is bert else len(enc))
        msgs = [str(w.message) for w in rec if w.category is RuntimeWarning]
        assert msgs == [f"ffn_ext.hf.patch_model: {reason}: {where} (left unpatched)"], msgs
        with pytest.raises(ValueError, match=re.escape(where)):
            ffn_ext.patch_hf_model(model, strict=True)
        torch.testing.assert_close(run(model), ref, rtol=0, atol=0)


@pytest.mark.parametrize("kind, name", [("llama", "x"), ("phi3", "hidden_states"), ("qwen2_5_vl", "hidden_state")])
def test_patched_forward_takes_the_input_by_name_and_other_calls_go_to_the_original(kind, name):
    """mlp(x) and mlp(<the original forward's parameter name>=x) run the fused form; any other call runs the
    original forward, so it behaves (and fails) as it did."""
    if kind == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLMLP

        mlp = Qwen2_5_VLMLP(types.SimpleNamespace(hidden_size=64, intermediate_size=176, hidden_act="silu"), bias=True)
    else:
        mlp = _tiny(kind).model.layers[0].mlp
    x = torch.randn(2, 3, 64, requires_grad=True)
    ref = mlp(x)
    assert ffn_ext.patch_hf_model(mlp) == 1
    for y in (mlp(x), mlp(**{name: x})):
        assert "_GatedMLP" in type(y.grad_fn).__name__
        torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    for args, kwargs in (((x, x), {}), ((), {"input": x}), ((x,), {name: x})):
        with pytest.raises(TypeError) as patched:
            mlp(*args, **kwargs)
        with pytest.raises(TypeError) as original:
            type(mlp).forward(mlp, *args, **kwargs)
        assert str(patched.value) == str(original.value)


def test_meta_device_and_half_precision_models_patch_without_a_false_self_check():
    """The self-check does not run on meta parameters (offloaded or not yet loaded models), and in bf16/fp16 it
    allows ffn_ext's rounding (h rounded once where ATen rounds twice)."""
    with torch.device("meta"):
        meta = _tiny("llama")
    for model in (meta, _tiny("llama").bfloat16(), _tiny("phi3").half()):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert ffn_ext.patch_hf_model(model) == 2


@pytest.mark.slow
def test_patched_mlp_compiles_without_graph_breaks():
    """torch.compile(fullgraph=True) of a patched MLP: the checks of the patched forward (activation, hooks,
    projection types) trace, and forward and backward match the unpatched MLP."""
    model = _tiny("llama")
    ref = copy.deepcopy(model)
    ffn_ext.patch_hf_model(model)
    mlp, mlp0 = model.model.layers[0].mlp, ref.model.layers[0].mlp
    x = torch.randn(2, 5, 64, requires_grad=True)
    x0 = x.detach().clone().requires_grad_()
    y = torch.compile(mlp, fullgraph=True)(x)
    y0 = mlp0(x0)
    torch.testing.assert_close(y, y0, atol=1e-5, rtol=1e-5)
    y.sum().backward()
    y0.sum().backward()
    torch.testing.assert_close(x.grad, x0.grad, atol=1e-5, rtol=1e-5)
