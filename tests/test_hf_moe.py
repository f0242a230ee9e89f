"""ffn_ext.hf.patch_model on MoE experts and clamped SwiGLU MLPs of transformers (tiny random models, no downloads).

transformers 5.x keeps a layer's routed experts in one *Experts module with 3-D parameters (gate_up_proj [E, 2I, H],
down_proj); its experts implementations (config._experts_implementation: "eager", "grouped_mm", "batched_mm" run on
the CPU) reach the gating through the class's eager forward or its _apply_gate. Skips without transformers."""

import ast
import copy
import importlib
import io
import pathlib
import re
import textwrap
import types
import warnings

import pytest
import torch
import torch.nn as nn

import ffn_ext
from ffn_ext import hf

transformers = pytest.importorskip("transformers")

IMPLS = ("eager", "grouped_mm", "batched_mm")  # the experts implementations that run on the CPU
BASE = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=97,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
# name: (config, model, config kwargs, the classes patch_model patches (all its MLP and experts modules),
#        the attribute of the clamp limit or None)
MODELS = {
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            intermediate_size=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            head_dim=8,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
        ),
        {"GptOssExperts"},
        "limit",
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(intermediate_size=48, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, head_dim=8),
        {"Qwen3MoeExperts"},
        None,
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            intermediate_size=48,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            num_experts=4,
            num_experts_per_tok=2,
        ),
        {"Qwen2MoeExperts", "Qwen2MoeMLP"},
        None,
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, head_dim=8),
        {"MixtralExperts"},
        None,
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",  # layer 0 dense, layer 1 MoE + shared expert
        dict(
            intermediate_size=48,
            moe_intermediate_size=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            num_key_value_heads=4,
        ),
        {"DeepseekV3Experts", "DeepseekV3MLP"},
        None,
    ),
    "deepseek_v4": (
        "DeepseekV4Config",
        "DeepseekV4ForCausalLM",  # clamped experts and shared expert (MLP)
        dict(
            moe_intermediate_size=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            num_key_value_heads=1,
            head_dim=16,
            q_lora_rank=16,
            o_groups=2,
            o_lora_rank=16,
            index_n_heads=2,
            index_head_dim=8,
            index_topk=4,
            sliding_window=8,
            hc_mult=2,
            hc_sinkhorn_iters=2,
            swiglu_limit=2.0,
            mlp_layer_types=["hash_moe", "moe"],
        ),
        {"DeepseekV4Experts", "DeepseekV4MLP"},
        "limit",
    ),
}
GATING_OPS = ("gated", "gated_packed", "swiglu_clamped", "swiglu_clamped_packed")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These models' tensors are tiny: one intra-op thread is faster, and much faster on a busy machine (idle
    threads spin). Restored after the module."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _tiny(kind, **extra):
    cfg_name, model_name, kw, _, _ = MODELS[kind]
    config = getattr(transformers, cfg_name)(**{**BASE, **kw, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():  # MLP and expert weights 20x: projections well past the clamp limits
        for name, p in model.named_parameters():
            if ".mlp." in name:
                p.mul_(20)
    return model


def _patchable(model):
    """The modules patch_model must patch or name: gated MLPs and experts."""
    return [(n, m) for n, m in model.named_modules() if hf._is_experts(m) or hf._kind(m) is not None]


class Spy:
    """Records every call of ffn_ext's gating functions (ffn_ext.ops.<name>, which hf.py calls) with its inputs."""

    def __init__(self, monkeypatch):
        self.calls = []
        for name in GATING_OPS:
            orig = getattr(ffn_ext.ops, name)

            def spy(*args, _orig=orig, _name=name, **kwargs):
                self.calls.append((_name, args, kwargs))
                return _orig(*args, **kwargs)

            monkeypatch.setattr(ffn_ext.ops, name, spy)

    def clamp_hits(self):
        """For the clamped calls: whether some gate values were above the limit, and some up values beyond it."""
        above = beyond = False
        for name, args, kw in self.calls:
            if name == "swiglu_clamped_packed":
                g, u = (
                    (args[0][..., ::2], args[0][..., 1::2]) if kw["layout"] == "interleaved" else args[0].chunk(2, -1)
                )
            elif name == "swiglu_clamped":
                g, u = args
            else:
                continue
            above |= bool((g > kw["limit"]).any())
            beyond |= bool((u.abs() > kw["limit"]).any())
        return above, beyond


def _grads_equal(model, ref):
    """Every parameter's gradient equals ref's, to fp32 rounding relative to the gradient's scale (the fused gating
    rounds differently from ATen's several ops, by an ulp; the 20x weights make gradients of up to a few hundred)."""
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        p0 = ref_params[name]
        assert (p.grad is None) == (p0.grad is None), name
        if p.grad is not None:
            scale = max(1.0, float(p0.grad.abs().max()))
            torch.testing.assert_close(p.grad, p0.grad, atol=2e-6 * scale, rtol=1e-4, msg=name)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", list(MODELS))
def test_moe_models_patch_every_expert_module_and_match(kind, impl, monkeypatch):
    """Tiny GPT-OSS, Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3 and DeepSeek-V4 in fp32, for each experts
    implementation: every experts module and (clamped) MLP is patched, without a warning; the gating runs on
    ffn_ext's op (once per experts module and forward with grouped_mm / batched_mm, which call the patched
    _apply_gate; per expert hit in the eager loop); with the clamps active, logits, all parameter gradients and
    greedy generate() equal the unpatched model's."""
    model = _tiny(kind)
    model.set_experts_implementation(impl)
    ref = copy.deepcopy(model)
    classes, limit = MODELS[kind][3], MODELS[kind][4]
    todo = _patchable(model)
    assert {type(m).__name__ for _, m in todo} == classes
    experts = [m for _, m in todo if hf._is_experts(m)]
    assert len(experts) == (1 if kind == "deepseek_v3" else 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ffn_ext.patch_hf_model(model, strict=True) == len(todo)
    assert all(getattr(m, hf._MARK, None) for _, m in todo)

    spy = Spy(monkeypatch)
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    logits = model(ids).logits
    experts_calls = [c for c in spy.calls if c[0] in ("gated_packed", "swiglu_clamped_packed")]
    if impl == "eager":
        assert len(experts_calls) >= len(experts)
    else:
        assert len(experts_calls) == len(experts)
    if limit is not None:
        assert spy.clamp_hits() == (True, True)
        assert all(kw["limit"] == getattr(experts[0], limit) for _, _, kw in experts_calls)
    logits0 = ref(ids).logits
    torch.testing.assert_close(logits, logits0, atol=1e-5, rtol=1e-5)
    w = torch.randn_like(logits)
    (logits * w).sum().backward()
    (logits0 * w).sum().backward()
    _grads_equal(model, ref)

    prompt = ids[:1, :5]
    out = model.generate(prompt, max_new_tokens=3, do_sample=False, attention_mask=torch.ones_like(prompt))
    out0 = ref.generate(prompt, max_new_tokens=3, do_sample=False, attention_mask=torch.ones_like(prompt))
    assert out.shape == (1, 8) and torch.equal(out, out0)
    assert ffn_ext.hf.unpatch_model(model) == len(todo)


# JetMoE: each layer's MoE (JetMoeMoE: router, experts and their gating in one forward, the [S, 2I] projection from a
# JetMoeParallelExperts submodule); its attention experts (JetMoeMoA) have no gating. Not @use_experts_implementation
JETMOE = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_key_value_heads=2,
    kv_channels=8,
    intermediate_size=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    vocab_size=97,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.2,
    output_router_logits=True,
)


def test_jetmoe_moe_layers_are_patched_and_match(monkeypatch):
    """Tiny JetMoE in fp32: both JetMoeMoE layers are patched (forward replaced), nothing else (JetMoeMoA, the
    attention experts, untouched); the gating runs on gated_packed, once per layer and forward, on input_linear's
    [S, 2I] output itself (in place, no copy or chunk); logits, the router's aux loss, all parameter gradients and
    greedy generate() equal the unpatched model's; unpatch restores the class's forward."""
    torch.manual_seed(0)
    model = transformers.JetMoeForCausalLM(transformers.JetMoeConfig(**JETMOE)).eval()
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__ in ("JetMoeMoE", "JetMoeMoA"):
                m.bias.normal_()
    ref = copy.deepcopy(model)
    moe = [m for m in model.modules() if type(m).__name__ == "JetMoeMoE"]
    moa = [m for m in model.modules() if type(m).__name__ == "JetMoeMoA"]
    assert len(moe) == len(moa) == 2 and [m for _, m in _patchable(model)] == moe
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ffn_ext.patch_hf_model(model, strict=True) == 2
    assert all(isinstance(vars(m)["forward"], hf._BoundExperts) and getattr(m, hf._MARK) == "experts" for m in moe)
    assert not any(hasattr(m, hf._MARK) or "forward" in vars(m) for m in model.modules() if m not in moe)

    spy = Spy(monkeypatch)
    projections = []
    for m in moe:
        m.input_linear.register_forward_hook(lambda mod, i, o: projections.append(o))
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    out, out0 = model(ids), ref(ids)
    assert [c[0] for c in spy.calls] == ["gated_packed"] * 2
    assert all(c[1][0] is p and c[1][0].shape == (2 * 9 * 2, 2 * 16) for c, p in zip(spy.calls, projections))
    torch.testing.assert_close(out.logits, out0.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.aux_loss, out0.aux_loss, atol=1e-6, rtol=1e-5)
    w = torch.randn_like(out.logits)
    ((out.logits * w).sum() + out.aux_loss).backward()
    ((out0.logits * w).sum() + out0.aux_loss).backward()
    _grads_equal(model, ref)

    prompt = ids[:1, :5]
    gen = model.generate(prompt, max_new_tokens=3, do_sample=False, attention_mask=torch.ones_like(prompt))
    gen0 = ref.generate(prompt, max_new_tokens=3, do_sample=False, attention_mask=torch.ones_like(prompt))
    assert gen.shape == (1, 8) and torch.equal(gen, gen0)
    assert ffn_ext.hf.unpatch_model(model) == 2
    assert not any(hasattr(m, hf._MARK) or "forward" in vars(m) for m in model.modules())


# ---------------------------------------------------------------- the other forms, module by module
CONFIG = dict(
    hidden_size=16,
    intermediate_size=8,
    moe_intermediate_size=8,
    expert_ffn_hidden_size=8,
    ffn_hidden_size=8,
    dense_intermediate_size=8,
    moe_hidden_size=16,
    num_local_experts=4,
    num_experts=4,
    moe_num_experts=4,
    n_routed_experts=4,
    n_shared_experts=2,
    zero_expert_num=1,
    hidden_act="silu",
    ffn_act_fn={"name": "silu"},
    swiglu_limit=1.0,
    swiglu_alpha=1.702,
    post_norm_eps=1e-6,
    mlp_bias=False,
    _experts_implementation="eager",
)
# class: its modeling module, and how it is called ("routed": hidden [T, H], top-k ids and weights)
MODULES = {
    "AriaExperts": ("aria", "routed"),  # x @ gate_up_proj[e] (is_transposed)
    "MuseSparkExperts": ("muse_spark", "routed"),  # post_expert_norm
    "BeamExperts": ("beam", "routed"),  # act_fn(gate.float()) * up.float()
    "OpenAIPrivacyFilterExperts": ("openai_privacy_filter", "routed"),  # GPT-OSS's clamp, concat, biases
    "MiniMaxM3VLExperts": ("minimax_m3_vl", "routed"),
    "Glm5NextTextExperts": ("glm5_next", "routed"),
    "HYV4Experts": ("hy_v4", "routed"),
    "LongcatFlashExperts": ("longcat_flash", "routed"),  # identity ("zero") experts
    "DbrxExperts": ("dbrx", "routed"),  # patches its DbrxExpertGLU
    "Llama4TextExperts": ("llama4", "llama4"),
    "InklingSharedExperts": ("inkling", "gammas"),
    "MiniMaxM3VLDenseMLP": ("minimax_m3_vl", "mlp"),
    "Glm5NextTextMLP": ("glm5_next", "mlp"),
    "Glm5NextVisionMLP": ("glm5_next", "mlp"),
}


def _class(name, module):
    try:
        return getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)
    except (ImportError, AttributeError):
        pytest.skip(f"this transformers ({transformers.__version__}) has no {name}")


def _module(name, module):
    torch.manual_seed(0)
    m = _class(name, module)(types.SimpleNamespace(**CONFIG))
    with torch.no_grad():  # unit weights: projections of a unit input reach about 4, past the limits (1)
        for p in m.parameters():
            p.copy_(torch.randn_like(p))
    return m


def _spec(name):
    """The _Gate a class of MODULES computes (DbrxExperts: its DbrxExpertGLU's)."""
    return hf._KNOWN_CLAMPED.get(name) or hf._EXPERTS.get(name, (hf._PLAIN,))[0]


def _inputs(how, n_experts=4):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 16, generator=gen)
    if how == "routed":
        ids = torch.stack([torch.randperm(n_experts, generator=gen)[:2] for _ in range(6)])
        return (x, ids, torch.rand(6, 2, generator=gen).softmax(-1))
    if how == "llama4":
        return (torch.randn(4 * 3, 16, generator=gen),)
    if how == "gammas":
        return (x, torch.rand(6, 2, generator=gen))
    return (x,)


@pytest.mark.parametrize("name", list(MODULES))
def test_other_experts_forms_and_clamped_mlps_match(name, monkeypatch):
    """The experts and clamped MLP forms the models above do not cover, each module alone (random weights with unit
    scale, so the clamps of limit 1 act), for each experts implementation it has: patched, its output and the
    gradients of its input and parameters equal the unpatched module's, and the gating ran on ffn_ext's op."""
    module, how = MODULES[name]
    m = _module(name, module)
    ref = copy.deepcopy(m)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ffn_ext.patch_hf_model(m, strict=True) == 1
    spy = Spy(monkeypatch)
    dispatch = hasattr(m, "has_gate")  # @use_experts_implementation
    if dispatch:
        ref.config = m.config  # one config: both run the implementation set below
    for impl in IMPLS if dispatch else ("eager",):
        if dispatch:
            m.config._experts_implementation = impl
        args = _inputs(how, n_experts=5 if name == "LongcatFlashExperts" else 4)  # Longcat: its identity expert too
        args = [a.requires_grad_() if a.is_floating_point() else a for a in args]
        args0 = [a.detach().clone().requires_grad_() if a.is_floating_point() else a for a in args]
        spy.calls.clear()
        y, y0 = m(*args), ref(*args0)
        assert spy.calls, impl
        if _spec(name).limit is not None:
            assert spy.clamp_hits() == (True, True), impl
        torch.testing.assert_close(y, y0, atol=1e-5, rtol=1e-5)
        w = torch.randn_like(y)
        (y * w).sum().backward()
        (y0 * w).sum().backward()
        for a, a0 in zip(args, args0):
            if a.is_floating_point():
                torch.testing.assert_close(a.grad, a0.grad, atol=1e-5, rtol=1e-4)
        _grads_equal(m, ref)
        m.zero_grad(), ref.zero_grad()
    assert ffn_ext.hf.unpatch_model(m) == 1


# ---------------------------------------------------------------- what is not patched is named, once
def test_unpatched_experts_are_named_in_one_warning_and_strict_raises():
    """Qwen2-MoE with hidden_act="relu6" (an activation ffn_ext lacks): its routed experts and its shared-expert MLP are left unpatched, named in ONE
    RuntimeWarning; strict=True raises ValueError naming them and patches nothing; the model computes what it did."""
    model = _tiny("qwen2_moe", hidden_act="relu6")
    ids = torch.randint(3, 97, (1, 5), generator=torch.Generator().manual_seed(5))
    ref = model(ids).logits
    with pytest.raises(
        ValueError,
        match=r"activation ReLU6 is not one ffn_ext implements.*Qwen2MoeExperts at "
        r"'model.layers.0.mlp.experts' and 1 more.*Qwen2MoeMLP.*strict=True",
    ):
        ffn_ext.patch_hf_model(model, strict=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ffn_ext.patch_hf_model(model) == 0
    assert len(caught) == 1 and caught[0].category is RuntimeWarning
    assert "Qwen2MoeExperts" in str(caught[0].message) and "Qwen2MoeMLP" in str(caught[0].message)
    assert not any(hasattr(m, hf._MARK) or "_apply_gate" in vars(m) for m in model.modules())
    torch.testing.assert_close(model(ids).logits, ref, rtol=0, atol=0)


def test_experts_ffn_ext_cannot_run_are_named_with_the_reason(monkeypatch):
    """Each reason to leave experts alone, in one warning: a gating ffn_ext lacks (Step3p7's clamp after the
    activation), subclasses of known classes with their own _apply_gate or forward (not known), an activation
    ffn_ext lacks (JetMoE's MoE layer with ReLU), a clamped gating with a GELU, a limit that is not a number > 0,
    and a class whose _apply_gate disagrees with the op on a random input (self-check)."""
    step = _module("Step3p7Experts", "step3p7")

    class MyGate(_class("Glm5NextTextExperts", "glm5_next")):
        def _apply_gate(self, gate_up):
            return super()._apply_gate(gate_up) * 2

    jet_config = types.SimpleNamespace(**{**CONFIG, "activation_function": "relu6", "num_experts_per_tok": 2})

    class MyJet(_class("JetMoeMoE", "jetmoe")):
        def forward(self, layer_input):
            return super().forward(layer_input) * 2

    mine = MyGate(types.SimpleNamespace(**CONFIG))
    jet_relu, jet_sub = _class("JetMoeMoE", "jetmoe")(jet_config), MyJet(jet_config)
    gelu = _class("DeepseekV4Experts", "deepseek_v4")(types.SimpleNamespace(**{**CONFIG, "hidden_act": "gelu"}))
    no_limit = _module("HYV4Experts", "hy_v4")
    no_limit.swiglu_limit = None
    odd = _module("MiniMaxM3VLExperts", "minimax_m3_vl")
    cls = type(odd)
    orig = cls._apply_gate
    monkeypatch.setattr(cls, "_apply_gate", lambda self, gate_up: orig(self, gate_up) + 1)
    net = nn.ModuleDict(
        dict(step=step, mine=mine, jet_sub=jet_sub, jet_relu=jet_relu, gelu=gelu, no_limit=no_limit, odd=odd)
    )
    with pytest.raises(ValueError, match="strict=True: nothing patched"):
        ffn_ext.patch_hf_model(net, strict=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ffn_ext.patch_hf_model(net) == 0
    assert len(caught) == 1
    msg = str(caught[0].message)
    for part in (
        r"clamp the activation's output.*no ffn_ext op clamps after it.*Step3p7Experts at 'step'",
        r"MoE experts modules whose gating ffn_ext does not compute.*MyGate at 'mine', MyJet at 'jet_sub'",
        r"activation ReLU6 is not one ffn_ext implements.*JetMoeMoE at 'jet_relu'",
        r"clamped gating with activation GELUActivation \(gelu\).*DeepseekV4Experts at 'gelu'",
        r"clamp limit swiglu_limit = None is not a number > 0.*HYV4Experts at 'no_limit'",
        r"self-check.*MiniMaxM3VLExperts at 'odd'",
    ):
        assert re.search(part, msg), (part, msg)


def test_gatings_that_clamp_after_the_activation_are_named_with_what_they_compute():
    """Step-3.7's MLPs (shared expert and dense layers, nn.Linear gate_proj / up_proj / down_proj like a SwiGLU) and
    experts clamp the activation's output, clamp(silu(gate), max=limit) * clamp(up, -limit, limit), which no ffn_ext
    op computes; so does any experts class that sets transformers' _fp8_experts_clamp_after_activation. All are
    named in the one warning with that reason, also when listed in extra_classes (the forward is known), and
    refused with strict=True; they compute what they did."""
    config = types.SimpleNamespace(**CONFIG, share_expert_dim=8, swiglu_limits_shared=[1.0, 0.0])
    mlp_cls = _class("Step3p7MLP", "step3p7")

    class Flagged(nn.Module):
        _fp8_experts_clamp_after_activation = True

        def __init__(self):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.randn(4, 16, 16))
            self.down_proj = nn.Parameter(torch.randn(4, 16, 8))

        def _apply_gate(self, gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            return torch.tanh(gate).clamp(max=0.5) * up

    torch.manual_seed(0)
    net = nn.ModuleDict(
        dict(
            mlp=mlp_cls(config, 0),
            unclamped=mlp_cls(config, 1),  # limit 0.0: inf, "no clamp"
            experts=_class("Step3p7Experts", "step3p7")(config, swiglu_limit=1.0),
            flagged=Flagged(),
        )
    )
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn_like(p))
    assert net["mlp"].limit == 1.0 and net["unclamped"].limit == float("inf")
    x, ids, w = _inputs("routed")

    def run():
        return net["mlp"](x), net["unclamped"](x), net["experts"](x, ids, w)

    ref = run()
    with pytest.raises(ValueError, match=r"clamp the activation's output.*Step3p7MLP.*strict=True"):
        ffn_ext.patch_hf_model(net, strict=True, extra_classes=[mlp_cls])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ffn_ext.patch_hf_model(net, extra_classes=[mlp_cls]) == 0
    assert len(caught) == 1 and caught[0].category is RuntimeWarning
    assert re.search(
        r"clamp\(act_fn\(gate\), max=limit\).*clamps the gate before the activation.*: Step3p7MLP at "
        r"'mlp' and 1 more, Step3p7Experts at 'experts', Flagged at 'flagged' \(left unpatched\)$",
        str(caught[0].message),
    ), str(caught[0].message)
    assert not any(hasattr(m, hf._MARK) or "forward" in vars(m) or "_apply_gate" in vars(m) for m in net.modules())
    for y, y0 in zip(run(), ref):
        torch.testing.assert_close(y, y0, rtol=0, atol=0)


def test_non_gated_experts_are_not_this_patchs_business():
    """NemotronH's experts compute act(up) (has_gate=False), like a non-gated MLP: neither patched nor named."""
    cls = _class("NemotronHExperts", "nemotron_h")
    m = cls(types.SimpleNamespace(**CONFIG, moe_latent_size=None, mlp_hidden_act="relu2"))
    assert m.has_gate is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ffn_ext.patch_hf_model(m, strict=True) == 0


# ---------------------------------------------------------------- the patch's mechanics on experts
def test_experts_patch_is_reversible_and_survives_deepcopy_and_pickle():
    model = _tiny("gpt_oss")
    model.set_experts_implementation("grouped_mm")
    ids = torch.randint(3, 97, (2, 6), generator=torch.Generator().manual_seed(4))
    ref = model(ids).logits
    experts = [m for m in model.modules() if hf._is_experts(m)]
    assert ffn_ext.patch_hf_model(model) == 2
    assert ffn_ext.patch_hf_model(model) == 0  # already patched
    assert all(isinstance(vars(m)["_apply_gate"], hf._BoundGate) and "forward" not in vars(m) for m in experts)
    clone = copy.deepcopy(model)
    assert all(m._apply_gate.__self__ is m for m in clone.modules() if hf._is_experts(m))
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for m2 in (clone, loaded):
        torch.testing.assert_close(m2(ids).logits, ref, atol=1e-5, rtol=1e-5)
        assert all(
            isinstance(vars(m)["_apply_gate"], hf._BoundGate) and m._apply_gate.__self__ is m
            for m in m2.modules()
            if hf._is_experts(m)
        )
    assert ffn_ext.hf.unpatch_model(model) == 2
    assert all("_apply_gate" not in vars(m) and not hasattr(m, hf._MARK) for m in experts)
    torch.testing.assert_close(model(ids).logits, ref, atol=1e-5, rtol=1e-5)

    model = _tiny("mixtral")  # inline eager: forward and _apply_gate both patched, both restored
    experts = [m for m in model.modules() if hf._is_experts(m)]
    assert ffn_ext.patch_hf_model(model) == 2
    assert all(isinstance(vars(m)["forward"], hf._BoundExperts) and "_apply_gate" in vars(m) for m in experts)
    assert ffn_ext.hf.unpatch_model(model) == 2
    assert all("forward" not in vars(m) and "_apply_gate" not in vars(m) for m in experts)


@pytest.mark.parametrize("impl", IMPLS)
def test_hooks_on_the_experts_activation_see_it_run(impl, monkeypatch):
    """A hook on an experts module's act_fn fires as in the unpatched model (the gating then runs as the class
    wrote it, under every implementation), and a replaced activation is the one that runs."""
    model = _tiny("qwen3_moe")
    model.set_experts_implementation(impl)
    ref = copy.deepcopy(model)
    ffn_ext.patch_hf_model(model)
    ids = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(2))
    seen = []
    for m in (model, ref):
        m.model.layers[0].mlp.experts.act_fn.register_forward_hook(lambda mod, i, o: seen.append(o.shape))
    spy = Spy(monkeypatch)
    torch.testing.assert_close(model(ids).logits, ref(ids).logits, atol=1e-5, rtol=1e-5)
    assert seen and len(seen) % 2 == 0  # as often in both models
    assert len(spy.calls) == 1 if impl != "eager" else len(spy.calls) >= 1  # layer 1's experts: still fused
    for m in (model, ref):
        m.model.layers[1].mlp.experts.act_fn = nn.Mish()
    torch.testing.assert_close(model(ids).logits, ref(ids).logits, atol=1e-5, rtol=1e-5)


def test_meta_and_half_precision_moe_models_patch_without_a_false_self_check():
    """The experts' self-check runs the gating on the CPU in float32 (it has no parameters): meta models patch,
    and bf16 models patch and stay close to the unpatched model."""
    with torch.device("meta"):
        meta = getattr(transformers, MODELS["gpt_oss"][1])(
            getattr(transformers, MODELS["gpt_oss"][0])(**{**BASE, **MODELS["gpt_oss"][2]})
        )
    bf16 = _tiny("gpt_oss").bfloat16()
    ref = copy.deepcopy(bf16)
    for model in (meta, bf16):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert ffn_ext.patch_hf_model(model) == 2
    ids = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(bf16(ids).logits.float(), ref(ids).logits.float(), atol=0.05, rtol=0.05)


# ---------------------------------------------------------------- transformers' source, read with ast
def _src(body) -> str:
    return "\n".join(
        ast.unparse(s) for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
    )


def _norm(text: str) -> str:
    return _src(ast.parse(textwrap.dedent(text)).body)


# _apply_gate bodies (None: the class has none; transformers' default, act_fn(gate) * up, or inline) -> the _Gate
GATES = {
    None: hf._Gate(),
    "gate, up = gate_up.chunk(2, dim=-1)\nreturn (self.act_fn(gate.float()) * up.float()).to(gate.dtype)": hf._Gate(),
    """gate, up = gate_up.chunk(2, dim=-1)
gate = gate.clamp(max=self.limit)
up = up.clamp(min=-self.limit, max=self.limit)
return self.act_fn(gate) * up""": hf._Gate(limit="limit"),
    """gate, up = gate_up.chunk(2, dim=-1)
gate = gate.clamp(min=None, max=self.swiglu_limit)
up = up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
return F.silu(gate) * up""": hf._Gate(act=None, limit="swiglu_limit"),
    """gate, up = (gate_up[..., ::2], gate_up[..., 1::2])
gate = gate.clamp(min=None, max=self.limit)
up = up.clamp(min=-self.limit, max=self.limit)
glu = gate * torch.sigmoid(gate * self.alpha)
gated_output = (up + 1) * glu
return gated_output""": hf._Gate(act=None, limit="limit", alpha="alpha", up_offset=1.0, layout="interleaved"),
    """gate, up = gate_up.chunk(2, dim=-1)
gate = gate.clamp(min=None, max=self.limit)
up = up.clamp(min=-self.limit, max=self.limit)
glu = gate * torch.sigmoid(gate * self.alpha)
gated_output = (up + 1) * glu
return gated_output""": hf._Gate(act=None, limit="limit", alpha="alpha", up_offset=1.0),
    """gate, up = gate_up.chunk(2, dim=-1)
gate = gate.clamp(max=self.swiglu_limit)
up = up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
glu = gate * torch.sigmoid(gate * self.swiglu_alpha)
return (up + 1.0) * glu""": hf._Gate(act=None, limit="swiglu_limit", alpha="swiglu_alpha", up_offset=1.0),
}
_LOOP = """
final_hidden_states = torch.zeros_like(hidden_states)
with torch.no_grad():
    expert_mask = {one_hot}(top_k_index, num_classes=self.num_experts + 1)
    expert_mask = expert_mask.permute(2, 1, 0)
    expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
for expert_idx in expert_hit:
    expert_idx = expert_idx[0]
    if expert_idx == self.num_experts:
        continue
    top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
    current_state = hidden_states[token_idx]
    {gate_up}
    current_hidden_states = self.act_fn(gate) * up
    current_hidden_states = {down}
    {norm}current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
    final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))
return final_hidden_states
"""
_LINEAR = dict(
    one_hot="torch.nn.functional.one_hot",
    gate_up="gate, up = nn.functional.linear(current_state, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)",
    down="nn.functional.linear(current_hidden_states, self.down_proj[expert_idx])",
    norm="",
)
_CALLS_GATE = {  # eager loops that call self._apply_gate
    """final = torch.zeros_like(hidden_states)
with torch.no_grad():
    mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
    hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
for expert_idx in hit:
    expert_idx = expert_idx[0]
    if expert_idx == self.num_experts:
        continue
    top_k_pos, token_idx = torch.where(mask[expert_idx])
    current = self._apply_gate(F.linear(hidden_states[token_idx], self.gate_up_proj[expert_idx]))
    current = F.linear(current, self.down_proj[expert_idx]) * top_k_weights[token_idx, top_k_pos, None]
    final.index_add_(0, token_idx, current.to(final.dtype))
return final""",
    """next_states = torch.zeros_like(hidden_states, dtype=hidden_states.dtype, device=hidden_states.device)
with torch.no_grad():
    expert_mask = torch.nn.functional.one_hot(router_indices, num_classes=self.num_experts)
    expert_mask = expert_mask.permute(2, 1, 0)
    expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
for expert_idx in expert_hit:
    expert_idx = expert_idx[0]
    if expert_idx == self.num_experts:
        continue
    top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
    current_state = hidden_states[token_idx]
    gate_up = current_state @ self.gate_up_proj[expert_idx] + self.gate_up_proj_bias[expert_idx]
    gated_output = self._apply_gate(gate_up)
    out = gated_output @ self.down_proj[expert_idx] + self.down_proj_bias[expert_idx]
    weighted_output = out * routing_weights[token_idx, top_k_pos, None]
    next_states.index_add_(0, token_idx, weighted_output.to(hidden_states.dtype))
return next_states""",
    """original_dtype = hidden_states.dtype
next_states = torch.zeros_like(hidden_states, dtype=torch.float32, device=hidden_states.device)
with torch.no_grad():
    expert_mask = torch.nn.functional.one_hot(router_indices, num_classes=self.num_experts)
    expert_mask = expert_mask.permute(2, 1, 0)
    expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
for expert_idx in expert_hit:
    expert_idx = expert_idx[0]
    if expert_idx == self.num_experts:
        continue
    top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
    current_state = hidden_states[token_idx]
    gate_up = current_state.float() @ self.gate_up_proj[expert_idx].float() + self.gate_up_proj_bias[expert_idx].float()
    gated_output = self._apply_gate(gate_up).float()
    out = gated_output.float() @ self.down_proj[expert_idx].float() + self.down_proj_bias[expert_idx].float()
    weighted_output = out * routing_weights[token_idx, top_k_pos, None].float()
    next_states.index_add_(0, token_idx, weighted_output)
return next_states.to(original_dtype)""",
}
# form -> the forward bodies it stands for (what hf._FORMS' replacement reproduces, with ffn_ext for the gating)
FORMS = {
    "linear": {_LOOP.format(**_LINEAR)},
    "matmul": {
        _LOOP.format(
            **{
                **_LINEAR,
                "one_hot": "nn.functional.one_hot",
                "gate_up": "gate, up = (current_state @ self.gate_up_proj[expert_idx]).chunk(2, dim=-1)",
                "down": "current_hidden_states @ self.down_proj[expert_idx]",
            }
        )
    },
    "linear_norm": {
        _LOOP.format(
            **{**_LINEAR, "norm": "current_hidden_states = self.post_expert_norm(current_hidden_states)\n    "}
        )
    },
    "gate": set(_CALLS_GATE),
    "llama4": {
        """hidden_states = hidden_states.view(self.gate_up_proj.shape[0], -1, self.hidden_size)
gate_up = torch.bmm(hidden_states, self.gate_up_proj)
gate, up = gate_up.chunk(2, dim=-1)
next_states = torch.bmm(up * self.act_fn(gate), self.down_proj)
next_states = next_states.view(-1, self.hidden_size)
return next_states"""
    },
    "longcat": {
        """final_hidden_states = torch.zeros_like(hidden_states)
if top_k_index.numel() == 0:
    return final_hidden_states
expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.total_experts).permute(2, 1, 0)
expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero(as_tuple=False)
for expert_idx_tensor in expert_hit:
    expert_idx = int(expert_idx_tensor.item())
    selection_idx, token_idx = torch.where(expert_mask[expert_idx].squeeze(0))
    if token_idx.numel() == 0:
        continue
    current_state = hidden_states[token_idx]
    if expert_idx >= self.num_routed_experts or self.gate_up_proj is None:
        current_hidden_states = self.identity_expert(current_state)
    else:
        gate, up = F.linear(current_state, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
        current_hidden_states = self.act_fn(gate) * up
        current_hidden_states = F.linear(current_hidden_states, self.down_proj[expert_idx])
    current_hidden_states = current_hidden_states * top_k_weights[token_idx, selection_idx, None]
    final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(hidden_states.dtype))
return final_hidden_states"""
    },
    "dbrx": {
        """gate_proj = x.matmul(expert_w1.T)
up_proj = x.matmul(expert_v1.T)
gate_proj = self.activation_fn(gate_proj)
intermediate_states = gate_proj * up_proj
down_proj = intermediate_states.matmul(expert_w2)
return down_proj"""
    },
    "shared": {
        """input_shape = hidden_states.shape
hidden_states = hidden_states.reshape(1, -1, input_shape[-1]).expand(self.n_shared_experts, -1, -1)
gammas = gammas.reshape(-1, self.n_shared_experts, 1).transpose(0, 1)
gate = torch.bmm(hidden_states, self.gate_proj.transpose(1, 2))
up = torch.bmm(hidden_states, self.up_proj.transpose(1, 2))
activated = self.act_fn(gate) * up * gammas
down = torch.bmm(activated, self.down_proj.transpose(1, 2))
out = down.float().sum(dim=0).to(hidden_states.dtype)
return out.view(input_shape)"""
    },
    "jetmoe": {
        """bsz, length, emb_size = layer_input.size()
layer_input = layer_input.reshape(-1, emb_size)
_, batch_index, batch_gates, expert_size, router_logits = self.router(layer_input)
expert_inputs = layer_input[batch_index]
hidden_states = self.input_linear(expert_inputs, expert_size)
chunked_hidden_states = hidden_states.chunk(2, dim=-1)
hidden_states = self.activation(chunked_hidden_states[0]) * chunked_hidden_states[1]
expert_outputs = self.output_linear(hidden_states, expert_size)
expert_outputs = expert_outputs * batch_gates[:, None]
zeros = torch.zeros((bsz * length, self.input_size), dtype=expert_outputs.dtype, device=expert_outputs.device)
layer_output = zeros.index_add(0, batch_index, expert_outputs)
layer_output = layer_output.view(bsz, length, self.input_size)
layer_output = layer_output + self.bias
return layer_output"""
    },
}
# each body of FORMS, CLAMPED and GATES has one of these (routed loops, llama4, dbrx, shared, jetmoe, clamps)
FORM_KEYS = (
    "[token_idx",
    "self.gate_up_proj)",
    "expert_w1",
    "gammas",
    "self.input_linear(expert_inputs",
    "clamp(min=-self.",
)
FORM_ACT = {"dbrx": "activation_fn", "jetmoe": "activation"}  # an inline form's activation attribute, if not act_fn
# clamped MLP forwards (input renamed x) -> the _Gate; the first three gated, the last packed
CLAMPED = {
    """gate = self.gate_proj(x).clamp(max=self.limit)
up = self.up_proj(x).clamp(min=-self.limit, max=self.limit)
return self.down_proj(self.act_fn(gate) * up)""": hf._Gate(limit="limit"),
    """gate = self.gate_proj(x)
up = self.up_proj(x)
gate = gate.clamp(min=None, max=self.swiglu_limit)
up = up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
return self.down_proj(self.act_fn(gate) * up)""": hf._Gate(limit="swiglu_limit"),
    """gate_up = self.gate_up_proj(x)
gate, up = gate_up.chunk(2, dim=-1)
gate = gate.clamp(max=self.swiglu_limit)
up = up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
glu = gate * torch.sigmoid(gate * self.swiglu_alpha)
return self.down_proj((up + 1.0) * glu)""": hf._Gate(
        act=None, limit="swiglu_limit", alpha="swiglu_alpha", up_offset=1.0
    ),
}
# transformers' default _apply_gate, and its experts implementations' calls of it (integrations/moe.py)
MOE_SOURCE = {
    "_default_apply_gate": "gate, up = gate_up_out.chunk(2, dim=-1)\nreturn self.act_fn(gate) * up",
    "grouped_mm_experts_forward": "proj_out = self._apply_gate(proj_out)",
    "batched_mm_experts_forward": "proj_out = self._apply_gate(proj_out)",
    "use_experts_implementation": "experts_forward = experts_interface.get_interface(self.config."
    "_experts_implementation, original_forward)",
}


# gatings that clamp the activation's output (hf._CLAMP_AFTER: named, never patched): Step3p7MLP's forward (input
# renamed x) and Step3p7Experts' _apply_gate; what _clamps_after_activation must find (and not in CLAMPED or GATES)
CLAMPS_AFTER = (
    """gate = self.act_fn(self.gate_proj(x)).clamp(max=self.limit)
up = self.up_proj(x).clamp(min=-self.limit, max=self.limit)
return self.down_proj(gate * up)""",
    """gate, up = gate_up.chunk(2, dim=-1)
gate = self.act_fn(gate).clamp(max=self.limit)
up = up.clamp(min=-self.limit, max=self.limit)
return gate * up""",
)
_ACT_CALL = re.compile(r"self\.\w*act\w*|(F|nn\.functional|torch\.nn\.functional|torch)\.(silu|gelu|sigmoid|relu)")


def _statements(body):
    """The statements of body and of the blocks nested in them (not in nested functions), in source order."""
    for stmt in body:
        yield stmt
        if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for field in ("body", "handlers", "orelse", "finalbody"):
                inner = getattr(stmt, field, None)
                if isinstance(inner, list):
                    yield from _statements(inner)


def _own_expressions(stmt) -> list:
    """What stmt itself evaluates: a compound statement's header, not its blocks."""
    if isinstance(stmt, (ast.If, ast.While)):
        return [stmt.test]
    if isinstance(stmt, ast.For):
        return [stmt.iter]
    if isinstance(stmt, ast.With):
        return [i.context_expr for i in stmt.items]
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Try, ast.ExceptHandler)):
        return []
    return [stmt]


def _clamps_after_activation(fn: ast.FunctionDef) -> bool:
    """Whether fn clamps an activation's output: .clamp / .clip / torch.clamp of a call of self.<...act...> or of
    F.silu-like functions, or of a variable last assigned one (statement by statement, in source order)."""
    acts = set()

    def activated(node):
        if isinstance(node, ast.Call) and _ACT_CALL.fullmatch(ast.unparse(node.func)):
            return True
        return isinstance(node, ast.Name) and node.id in acts

    for stmt in _statements(fn.body):
        for node in (n for e in _own_expressions(stmt) for n in ast.walk(e)):
            if isinstance(node, ast.Call):
                f = node.func
                if (
                    isinstance(f, ast.Attribute)
                    and f.attr in ("clamp", "clamp_", "clip", "clip_")
                    and activated(f.value)
                ):
                    return True
                if ast.unparse(f) in ("torch.clamp", "torch.clip") and node.args and activated(node.args[0]):
                    return True
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            names = {t.id for t in targets if isinstance(t, ast.Name)}
            acts = acts | names if activated(stmt.value) else acts - names
    return False


def _init_assignments(cls: ast.ClassDef) -> dict:
    """{attribute: [source of each value assigned to self.<attribute> in cls.__init__]}"""
    init = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    out = {}
    for node in ast.walk(init) if init else ():
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Attribute) and ast.unparse(t.value) == "self":
                    out.setdefault(t.attr, []).append(ast.unparse(node.value))
    return out


def _method(cls: ast.ClassDef, name: str):
    return next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def _renamed(fwd: ast.FunctionDef) -> str:
    a = fwd.args
    for node in ast.walk(fwd):
        if isinstance(node, ast.Name) and len(a.args) > 1 and node.id == a.args[1].arg:
            node.id = "x"
    return _src(fwd.body)


def test_known_experts_and_clamped_classes_compute_what_the_patch_assumes():
    """Read from transformers' source with ast: every class of hf._EXPERTS has the forward of its form (the code
    hf._FORMS' replacement reproduces) and the _apply_gate of its _Gate (none: transformers' default, act_fn(gate) *
    up), @use_experts_implementation exactly when the form relies on it, the parameters it takes (names and order:
    what _BoundExperts binds) and, in __init__, its activation attribute set once to ACT2FN[...] and its limit and
    alpha attributes set; every class of hf._KNOWN_CLAMPED has the clamped forward of its _Gate with nn.Linear
    projections. And no class of these forms is missing from the lists; transformers' default _apply_gate and its
    grouped_mm / batched_mm still compute and call what the patch relies on. hf._CLAMP_AFTER is exactly the gated
    MLP and experts classes (gate_proj and up_proj, or gate_up_proj, or an _apply_gate) whose forward or
    _apply_gate clamps an activation's output."""
    for text in [*CLAMPED, *(b for bodies in FORMS.values() for b in bodies)]:
        assert any(k in text for k in FORM_KEYS), text

    def detects(text):
        return _clamps_after_activation(ast.parse("def f(self, x, gate_up):\n" + textwrap.indent(text, "    ")).body[0])  # noqa: E731

    assert all(map(detects, CLAMPS_AFTER)) and not any(map(detects, [*CLAMPED, *filter(None, GATES)]))
    clamp_after = set()
    gates = {(_norm(k) if k else None): v for k, v in GATES.items()}
    forms = {form: {_norm(b) for b in bodies} for form, bodies in FORMS.items()}
    clamped = {_norm(k): v for k, v in CLAMPED.items()}
    found, qualifying, bad = {}, {}, {}
    root = pathlib.Path(transformers.__file__).parent
    for path in sorted(root.glob("models/*/modeling_*.py")):
        src = path.read_text()
        clamps = ("clamp" in src or "clip" in src) and any(
            k in src for k in ("gate_proj", "gate_up_proj", "_apply_gate")
        )
        if not clamps and not any(k in src for k in FORM_KEYS):  # parsing every modeling file would take seconds
            continue
        for node in ast.parse(src).body:
            if not isinstance(node, ast.ClassDef):
                continue
            fwd = _method(node, "forward")
            own = (fwd, _method(node, "_apply_gate"))
            if clamps and any(f is not None and _clamps_after_activation(f) for f in own):
                assigned = _init_assignments(node)
                if (
                    _method(node, "_apply_gate")
                    or {"gate_proj", "up_proj"} <= assigned.keys()
                    or "gate_up_proj" in assigned
                ):
                    clamp_after.add(node.name)
            if fwd is None:
                continue
            body = _src(fwd.body)
            gate_fn = _method(node, "_apply_gate")
            gate = gates.get(_src(gate_fn.body) if gate_fn else None, "other")
            decorated = any("use_experts_implementation" in ast.unparse(d) for d in node.decorator_list)
            form = next((f for f, bodies in forms.items() if body in bodies), None)
            if form is not None and gate != "other" and (form == "gate") == (gate_fn is not None):
                qualifying[node.name] = (gate._replace(act=FORM_ACT.get(form, gate.act)), form)
            if _renamed(fwd) in clamped:
                qualifying[node.name] = clamped[_renamed(fwd)]
            known = hf._EXPERTS.get(node.name) or hf._KNOWN_CLAMPED.get(node.name)
            if known is None:
                continue
            found[node.name] = path.name
            assigned = _init_assignments(node)
            want_gate = known[0] if node.name in hf._EXPERTS else known
            problems = []
            if qualifying.get(node.name) != known:
                problems.append(f"computes {qualifying.get(node.name)}, listed as {known}")
            if node.name in hf._EXPERTS:
                spec = hf._FORMS[known[1]]
                if spec is not None and decorated != spec[2]:
                    problems.append(f"@use_experts_implementation: {decorated}")
                if spec is not None and tuple(a.arg for a in fwd.args.args[1:]) != spec[1]:
                    problems.append(f"parameters {[a.arg for a in fwd.args.args]}")
                if known[1] == "gate" and not decorated:
                    problems.append("not @use_experts_implementation")
            else:
                kind = "packed" if "gate_up_proj" in body else "gated"
                projs = ("gate_up_proj", "down_proj") if kind == "packed" else ("gate_proj", "up_proj", "down_proj")
                if not all(v.startswith("nn.Linear(") for p in projs for v in assigned.get(p, ["?"])):
                    problems.append(f"projections {[assigned.get(p) for p in projs]}")
            if want_gate.act and not (
                len(assigned.get(want_gate.act, [])) == 1
                and re.fullmatch(r"ACT2FN\[.+\]|nn\.SiLU\(\)|F\.silu", assigned[want_gate.act][0])
            ):
                problems.append(f"{want_gate.act} = {assigned.get(want_gate.act)}")
            for attr in (want_gate.limit, want_gate.alpha):
                if isinstance(attr, str) and attr not in assigned:
                    problems.append(f"{attr} not set in __init__")
            if problems:
                bad.setdefault(node.name, {})[path.name] = problems
    expected = {
        "GptOssExperts",
        "Qwen3MoeExperts",
        "Qwen2MoeExperts",
        "MixtralExperts",
        "DeepseekV3Experts",
        "DeepseekV4Experts",
        "DeepseekV4MLP",
    }
    assert expected <= found.keys(), expected - found.keys()
    assert not bad, bad
    missing = {n: q for n, q in qualifying.items() if n not in hf._EXPERTS and n not in hf._KNOWN_CLAMPED}
    assert not missing, f"classes of a form ffn_ext patches, missing from hf._EXPERTS / _KNOWN_CLAMPED: {missing}"
    assert set(found) == set(hf._EXPERTS) | set(hf._KNOWN_CLAMPED), set(hf._EXPERTS) ^ set(found)
    assert clamp_after == hf._CLAMP_AFTER, f"gatings that clamp the activation's output: {sorted(clamp_after)}"

    moe = ast.parse((root / "integrations" / "moe.py").read_text())
    funcs = {n.name: n for n in moe.body if isinstance(n, ast.FunctionDef)}
    assert _src(funcs["_default_apply_gate"].body) == MOE_SOURCE["_default_apply_gate"]
    for name in ("grouped_mm_experts_forward", "batched_mm_experts_forward", "use_experts_implementation"):
        assert MOE_SOURCE[name] in ast.unparse(funcs[name]), name


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss", "deepseek_v3", "qwen2_moe"])
def test_patching_under_a_default_device_context(kind):
    """torchtitan's and FSDP2's deferred init: the model built under torch.device("meta") patches completely, without
    a warning (the self-checks make their own tensors on the CPU: the experts' gating check used to land on meta and
    fail with "Tensor.item() cannot be called on meta tensors"); after to_empty + the weights and buffers loaded
    (as from a checkpoint) it computes what the unpatched model does. And a CPU model patched under another default
    device (meta here stands in for "cuda" on a machine without one) self-checks on its own device."""
    ref = _tiny(kind)
    ids = torch.randint(3, 97, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids).logits
    expected = len(_patchable(ref))
    with torch.device("meta"):
        model = _tiny_meta(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ffn_ext.patch_hf_model(model) == expected
    model.to_empty(device="cpu")
    model.load_state_dict(ref.state_dict())
    for name, buf in ref.named_buffers():
        model.get_buffer(name).copy_(buf)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, want, atol=1e-4, rtol=1e-4)
    cpu = _tiny(kind)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ffn_ext.patch_hf_model(cpu) == expected
    with torch.no_grad():
        torch.testing.assert_close(cpu(ids).logits, want, atol=1e-4, rtol=1e-4)


def _tiny_meta(kind):
    """_tiny's model without its weights (under a meta context: the 20x scaling would run on meta)."""
    cfg_name, model_name, kw, _, _ = MODELS[kind]
    return getattr(transformers, model_name)(getattr(transformers, cfg_name)(**{**BASE, **kw})).eval()
