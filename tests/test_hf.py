"""ffn_ext.hf.patch_model on tiny randomly initialised transformers models (no downloads).

Skips when transformers is not importable (it is a test/extra dependency: pip install transformers)."""
import copy
import warnings

import pytest
import torch
import torch.nn as nn

import ffn_ext

transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=97, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)
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
    logits, logits0 = model(ids).logits, ref(ids).logits
    torch.testing.assert_close(logits, logits0, atol=1e-5, rtol=1e-5)
    w = torch.randn_like(logits)
    (logits * w).sum().backward()
    (logits0 * w).sum().backward()
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, ref_params[name].grad, atol=1e-5, rtol=1e-4, msg=name)

    # the patched MLPs really run ffn_ext's lean autograd
    x = torch.randn(3, 64, requires_grad=True)
    mlps = _mlps(model)
    assert len(mlps) == 2
    for mlp in mlps:
        assert "_SwiGLUMLP" in type(mlp(x).grad_fn).__name__
    for mlp in _mlps(ref):
        assert "_SwiGLUMLP" not in type(mlp(x).grad_fn).__name__


def test_patch_is_idempotent_and_reversible_and_survives_deepcopy():
    model = _tiny("qwen2")
    assert ffn_ext.patch_hf_model(model) == 2
    assert ffn_ext.hf.patch_model(model) == 0  # already patched
    x = torch.randn(5, 64, requires_grad=True)
    clone = copy.deepcopy(model)
    for mlp in _mlps(clone):
        assert "_SwiGLUMLP" in type(mlp(x).grad_fn).__name__
        assert mlp.forward.__self__ is mlp  # bound to the copy, not to the original
    assert ffn_ext.hf.unpatch_model(model) == 2
    for mlp in _mlps(model):
        assert "forward" not in vars(mlp)
        assert "_SwiGLUMLP" not in type(mlp(x).grad_fn).__name__
    assert ffn_ext.hf.patch_model(model) == 2


@pytest.mark.parametrize("kind", ["qwen2", "phi3"])
def test_patched_model_pickles(kind):
    """torch.save(model) of a patched model loads back patched, with the same outputs (the patched forward
    once pickled as getattr(mlp, '_gated_forward'), which torch.load could not resolve)."""
    import io

    model = _tiny(kind)
    assert ffn_ext.patch_hf_model(model) == 2
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    ids = torch.randint(3, 97, (2, 6), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    x = torch.randn(3, 64, requires_grad=True)
    for mlp in _mlps(loaded):
        assert mlp.forward.__self__ is mlp
        assert "_SwiGLUMLP" in type(mlp(x).grad_fn).__name__
    assert ffn_ext.hf.unpatch_model(loaded) == 2


def test_non_silu_mlps_are_skipped_with_a_warning_or_refused():
    model = _tiny("llama", hidden_act="gelu")
    with pytest.warns(RuntimeWarning, match="not SiLU-gated"):
        assert ffn_ext.patch_hf_model(model) == 0
    assert all("forward" not in vars(m) for m in _mlps(model))
    with pytest.raises(ValueError, match="not SiLU-gated"):
        ffn_ext.patch_hf_model(model, strict=True)


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
        return "_SwiGLUMLP" in type(m(x).grad_fn).__name__

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

    # the activation replaced after patching (here by GELU): the replacement runs, not the fused SiLU
    for m in (mlp, mlp0):
        setattr(m, name, nn.GELU())
    torch.testing.assert_close(mlp(x), mlp0(x), atol=1e-5, rtol=1e-5)
    assert not fused(mlp)
    setattr(mlp, name, nn.SiLU())  # another SiLU: fused again
    assert fused(mlp)
    # the record of the activation goes with unpatch
    assert ffn_ext.hf.unpatch_model(model) == 2
    assert not hasattr(mlp, "_ffn_ext_act")


def test_plain_module_with_the_names_is_patched():
    class MyMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj = nn.Linear(8, 24), nn.Linear(8, 24)
            self.down_proj, self.act_fn = nn.Linear(24, 8), nn.SiLU()

        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    torch.manual_seed(3)
    net = nn.Sequential(MyMLP(), MyMLP())
    x = torch.randn(4, 8)
    ref = net(x)
    assert ffn_ext.patch_hf_model(net) == 2
    torch.testing.assert_close(net(x), ref)


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
