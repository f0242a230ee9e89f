"""ffn_ext.hf.patch_model on MoE experts and clamped SwiGLU MLPs of transformers (tiny random models, no downloads).

transformers 5.x keeps a layer's routed experts in one *Experts module with 3-D parameters (gate_up_proj [E, 2I, H],
down_proj); its experts implementations (config._experts_implementation: "eager", "grouped_mm", "batched_mm" run on
the CPU) reach the gating through the class's _apply_gate, except the eager forwards that inline act_fn(gate) * up.
ffn_ext patches experts only there: the instance's _apply_gate (recognised from its code, ffn_ext/hf/recognise.py);
the experts' forwards and loops stay transformers'. Experts whose forward, as it runs, never calls _apply_gate
(without one, or under "eager" with the gating inline in the loop), and gatings it does not compute, run as they are
and are named in one RuntimeWarning. Every comparison is against the unpatched model (deepcopy), in
fp32. Skips without transformers."""

import ast
import copy
import dataclasses
import inspect
import pathlib
import re
import textwrap
import types
import warnings

import pytest
import torch
import torch.nn as nn
from hf_oracle import modeling_class as _class
from hf_oracle import one_thread, patched_as, raise_errors  # noqa: F401  (autouse fixtures)

import ffn_ext
from ffn_ext.hf import common, forms, recognise
from ffn_ext.hf.common import GateSpec

transformers = pytest.importorskip("transformers")

import hf_oracle  # noqa: E402  (transformers 5.24's class lists, from ffn_ext/hf at 1952e74: test oracles only)

IMPLS = ("eager", "grouped_mm", "batched_mm")  # the experts implementations that run on the CPU
BASE = dict(hf_oracle.TINY_DECODER, hidden_size=32)
# name: (config, model, config kwargs, the classes patch_model patches (all its MLP and experts modules),
#        the attribute of the clamp limit or None, whether the experts class's own (eager) forward calls
#        self._apply_gate: True for GPT-OSS and DeepSeek-V4; the others inline act_fn(gate) * up in their loop)
MODELS = {
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        hf_oracle.TINY_GPT_OSS,
        {"GptOssExperts"},
        "limit",
        True,
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(intermediate_size=48, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, head_dim=8),
        {"Qwen3MoeExperts"},
        None,
        False,
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
        False,
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, head_dim=8),
        {"MixtralExperts"},
        None,
        False,
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
        False,
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
        True,
    ),
}


def _tiny(kind, **extra):
    cfg_name, model_name, kw = MODELS[kind][:3]
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
    return [(n, m) for n, m in model.named_modules() if forms.identify(m) is not None]


class Spy:
    """Records every call of ffn_ext's gating (ffn_ext.ops.Gating, what ffn_ext.hf runs, fused or not) with its inputs,
    named as the functional API names it: gated, gated_packed, swiglu_clamped, swiglu_clamped_packed."""

    def __init__(self, monkeypatch):
        self.calls = []
        orig = ffn_ext.ops.Gating.__call__

        def spy(g, gate, up=None):
            name = ("swiglu_clamped" if g.op == "swiglu_clamped" else "gated") + ("_packed" if up is None else "")
            self.calls.append((name, (gate,) if up is None else (gate, up), dict(g.kwargs, layout=g.layout)))
            return orig(g, gate, up)

        monkeypatch.setattr(ffn_ext.ops.Gating, "__call__", spy)

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


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", list(MODELS))
def test_moe_models_patch_every_expert_module_and_match(kind, impl, monkeypatch):
    """Tiny GPT-OSS, Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3 and DeepSeek-V4 in fp32, for each experts
    implementation: every experts module and (clamped) MLP is patched, without a warning; the experts only at their
    _apply_gate (a Patched on the instance, the forward the class's). The gating runs on ffn_ext's op once per
    experts module and forward with grouped_mm / batched_mm (which call _apply_gate), under "eager" per expert hit
    where the class's forward calls _apply_gate (GPT-OSS, DeepSeek-V4). Where it inlines act_fn(gate) * up (the
    others under "eager"), the experts are not patched but named (INLINE_EXPERTS) and no gating op runs. With the
    clamps active, logits, all parameter gradients and greedy generate() equal the unpatched model's."""
    model = _tiny(kind)
    model.set_experts_implementation(impl)
    ref = copy.deepcopy(model)
    classes, limit, calls_gate = MODELS[kind][3:]
    todo = _patchable(model)
    assert {type(m).__name__ for _, m in todo} == classes
    experts = [m for _, m in todo if forms.is_experts(m)]
    assert len(experts) == (1 if kind == "deepseek_v3" else 2)
    if impl == "eager" and not calls_gate:  # what runs never calls _apply_gate: named, not counted
        where = [n for n, m in todo if forms.is_experts(m)]
        with pytest.warns(
            RuntimeWarning, match=re.escape(f"{forms.INLINE_EXPERTS}: {type(experts[0]).__name__} at '{where[0]}'")
        ):
            assert ffn_ext.patch_hf_model(model) == len(todo) - len(experts)
        todo = [(n, m) for n, m in todo if not forms.is_experts(m)]
        assert not any(hasattr(m, forms.MARK) or "_apply_gate" in vars(m) for m in experts)
        experts = []
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert ffn_ext.patch_hf_model(model, strict=True) == len(todo)
    assert all(patched_as(m) for _, m in todo)
    for m in experts:
        assert patched_as(m) == "experts_gate" and "forward" not in vars(m)
        assert isinstance(vars(m)["_apply_gate"], forms.Patched) and m._apply_gate.__self__ is m

    spy = Spy(monkeypatch)
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    logits = model(ids).logits
    experts_calls = [c for c in spy.calls if c[0] in ("gated_packed", "swiglu_clamped_packed")]
    if impl != "eager" or not experts:
        assert len(experts_calls) == len(experts)
    else:
        assert len(experts_calls) >= len(experts)
    if limit is not None:
        assert spy.clamp_hits() == (True, True)
        assert all(kw["limit"] == getattr(experts[0], limit) for _, _, kw in experts_calls)
    hf_oracle.same_outputs(model, ref, logits, ref(ids).logits)
    hf_oracle.same_generate(model, ref, ids, new=3)
    assert ffn_ext.hf.unpatch_model(model) == len(todo)
    assert not any(hasattr(m, forms.MARK) or "_apply_gate" in vars(m) or "forward" in vars(m) for m in model.modules())


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


def test_jetmoe_moe_layers_run_unpatched_and_are_named(monkeypatch):
    """Tiny JetMoE in fp32: its MoE layers (JetMoeMoE, gating inline in their forward, no _apply_gate) are not
    patched: nothing is set on any module, no ffn_ext op runs, logits, the router's aux loss, all parameter gradients
    and greedy generate() are the unpatched model's bit for bit. They are named in one RuntimeWarning with
    experts._INLINE_EXPERTS (strict=True: ValueError), its attention experts (JetMoeMoA, no gating) not at all."""
    torch.manual_seed(0)
    model = transformers.JetMoeForCausalLM(transformers.JetMoeConfig(**JETMOE)).eval()
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__ in ("JetMoeMoE", "JetMoeMoA"):
                m.bias.normal_()
    ref = copy.deepcopy(model)
    moe = [n for n, m in model.named_modules() if type(m).__name__ == "JetMoeMoE"]
    assert len(moe) == 2 and sum(type(m).__name__ == "JetMoeMoA" for m in model.modules()) == 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ffn_ext.patch_hf_model(model) == 0
    assert not any(hasattr(m, forms.MARK) or "forward" in vars(m) or "_apply_gate" in vars(m) for m in model.modules())
    spy = Spy(monkeypatch)
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    out, out0 = model(ids), ref(ids)  # bit for bit: the same code on the same numbers, the router's loss too
    torch.testing.assert_close(out.aux_loss, out0.aux_loss, rtol=0, atol=0)
    hf_oracle.same_outputs(model, ref, out.logits + out.aux_loss, out0.logits + out0.aux_loss, atol=0, grad_atol=0)
    assert spy.calls == []
    hf_oracle.same_generate(model, ref, ids, new=3)

    msgs = [str(w.message) for w in caught if w.category is RuntimeWarning]
    assert len(msgs) == 1, msgs
    assert re.search(re.escape(forms.INLINE_EXPERTS) + rf": JetMoeMoE at '{re.escape(moe[0])}' and 1 more", msgs[0]), (
        msgs[0]
    )
    assert "JetMoeMoA" not in msgs[0]
    with pytest.raises(ValueError, match=r"JetMoeMoE at .*strict=True: nothing patched"):
        ffn_ext.patch_hf_model(model, strict=True)


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


def _module(name, module):
    torch.manual_seed(0)
    m = _class(name, module)(types.SimpleNamespace(**CONFIG))
    with torch.no_grad():  # unit weights: projections of a unit input reach about 4, past the limits (1)
        for p in m.parameters():
            p.copy_(torch.randn_like(p))
    return m


# ---------------------------------------------------------------- the oracle: 1952e74's experts list (test data)
# transformers 5.24's MoE experts classes as ffn_ext's _EXPERTS held them before the recogniser (copied from
# `git show 1952e74:ffn_ext/hf/experts.py`): name -> (the _Gate of its gating, how its eager forward reached it).
# Forms with an _apply_gate at 5.24 (the recogniser must read it as the _Gate): "gate" (the forward calls it),
# "linear" / "matmul" / "linear_norm" (@use_experts_implementation, the eager loop inlines act_fn(gate) * up,
# transformers' default _apply_gate serves grouped_mm / batched_mm). Forms without one (named, never patched now):
# "llama4", "longcat", "dbrx", "shared", "jetmoe".
_PLAIN = GateSpec()
_GPT_OSS = GateSpec(act=None, limit="limit", alpha="alpha", up_offset=1.0)
EXPERTS = {
    **{
        name: (_PLAIN, "linear")
        for name in """
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
    """.split()
    },
    "AriaExperts": (_PLAIN, "matmul"),
    "MuseSparkExperts": (_PLAIN, "linear_norm"),
    "BeamExperts": (_PLAIN, "gate"),  # act_fn(gate.float()) * up.float(), rounded once
    "GptOssExperts": (dataclasses.replace(_GPT_OSS, layout="interleaved"), "gate"),
    "OpenAIPrivacyFilterExperts": (_GPT_OSS, "gate"),
    "MiniMaxM3VLExperts": (GateSpec(act=None, limit="swiglu_limit", alpha="swiglu_alpha", up_offset=1.0), "gate"),
    "DeepseekV4Experts": (GateSpec(limit="limit"), "gate"),
    "Glm5NextTextExperts": (GateSpec(act=None, limit="swiglu_limit"), "gate"),
    "HYV4Experts": (GateSpec(act=None, limit="swiglu_limit"), "gate"),
    "HYV4VLExperts": (GateSpec(act=None, limit="swiglu_limit"), "gate"),
    "Llama4TextExperts": (_PLAIN, "llama4"),
    "LongcatFlashExperts": (_PLAIN, "longcat"),
    "DbrxExpertGLU": (GateSpec(act="activation_fn"), "dbrx"),
    "InklingSharedExperts": (_PLAIN, "shared"),
    "JetMoeMoE": (GateSpec(act="activation"), "jetmoe"),
}
WITH_APPLY_GATE = ("gate", "linear", "matmul", "linear_norm")  # the oracle's forms with an _apply_gate at 5.24
# gatings with an _apply_gate that the recogniser reads as none it computes, by design: the dtype casts
UNRECOGNISED = {"BeamExperts": "act_fn(gate.float()) * up.float(), cast back: casts are outside the recogniser"}
# the clamped MLPs of hf_oracle.KNOWN_CLAMPED, with the _Gate 1952e74's _KNOWN_CLAMPED gave them
CLAMPED_GATES = {
    "DeepseekV4MLP": GateSpec(limit="limit"),
    "Glm5NextTextMLP": GateSpec(limit="swiglu_limit"),
    "Glm5NextVisionMLP": GateSpec(limit="swiglu_limit"),
    "MiniMaxM3VLDenseMLP": GateSpec(act=None, limit="swiglu_limit", alpha="swiglu_alpha", up_offset=1.0),
}
assert set(CLAMPED_GATES) == set(hf_oracle.KNOWN_CLAMPED)


def _spec(name):
    """The _Gate the oracle gives a class (its limit says whether the clamps act)."""
    return CLAMPED_GATES.get(name) or EXPERTS[name][0]


# the modules alone, beyond the models above. Patched (experts at their _apply_gate, clamped MLPs at forward):
# class -> (its modeling module, how it is called: "routed" hidden [T, H], top-k ids and weights, or "mlp"; whether
# the experts class's own eager forward calls self._apply_gate, None for the MLPs)
PATCHED = {
    "AriaExperts": ("aria", "routed", False),  # eager inlines x @ gate_up_proj[e] (is_transposed)
    "MuseSparkExperts": ("muse_spark", "routed", False),  # eager inlines, then post_expert_norm
    "OpenAIPrivacyFilterExperts": ("openai_privacy_filter", "routed", True),  # GPT-OSS's clamp, concat, biases
    "MiniMaxM3VLExperts": ("minimax_m3_vl", "routed", True),
    "Glm5NextTextExperts": ("glm5_next", "routed", True),
    "HYV4Experts": ("hy_v4", "routed", True),
    "MiniMaxM3VLDenseMLP": ("minimax_m3_vl", "mlp", None),
    "Glm5NextTextMLP": ("glm5_next", "mlp", None),
    "Glm5NextVisionMLP": ("glm5_next", "mlp", None),
}
# Not patched, named in the warning: class -> (module, how it is called, the reason (in ffn_ext.hf.forms), the
# class named and its name in the module)
NAMED_EXPERTS = {
    "BeamExperts": ("beam", "routed", "UNKNOWN_EXPERTS", "BeamExperts", "model"),  # the casts
    "LongcatFlashExperts": ("longcat_flash", "routed", "INLINE_EXPERTS", "LongcatFlashExperts", "model"),
    "DbrxExperts": ("dbrx", "routed", "INLINE_EXPERTS", "DbrxExpertGLU", "mlp"),
    "Llama4TextExperts": ("llama4", "llama4", "INLINE_EXPERTS", "Llama4TextExperts", "model"),
    "InklingSharedExperts": ("inkling", "gammas", "INLINE_EXPERTS", "InklingSharedExperts", "model"),
}


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


def _args(how, name):
    """The module's inputs twice, as leaves that take gradients (the second for the unpatched copy)."""
    args = _inputs(how, n_experts=5 if name == "LongcatFlashExperts" else 4)  # Longcat: its identity expert too
    args = [a.requires_grad_() if a.is_floating_point() else a for a in args]
    args0 = [a.detach().clone().requires_grad_() if a.is_floating_point() else a for a in args]
    return args, args0


@pytest.mark.parametrize("name", list(PATCHED))
def test_other_patched_experts_and_clamped_mlps_match(name, monkeypatch):
    """The experts and clamped MLP forms the models above do not cover, each module alone (random weights with unit
    scale, so the clamps of limit 1 act), for each experts implementation it has: patched (experts only at
    _apply_gate), its output and the gradients of its input and parameters equal the unpatched module's (fp32
    rounding), and the gating ran on ffn_ext's op: once per call with grouped_mm / batched_mm and for the MLPs, per
    expert hit where the class's eager forward calls _apply_gate, never where it inlines the gating (Aria,
    MuseSpark under "eager": named when patched under it, patched under grouped_mm and run as written if switched
    back)."""
    module, how, calls_gate = PATCHED[name]
    m = _module(name, module)
    ref = copy.deepcopy(m)
    if calls_gate is False:
        with pytest.warns(RuntimeWarning, match=re.escape(f"{forms.INLINE_EXPERTS}: {name} at 'model'")):
            assert ffn_ext.patch_hf_model(m) == 0
        m.config._experts_implementation = "grouped_mm"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ffn_ext.patch_hf_model(m, strict=True) == 1
    if calls_gate is None:
        assert patched_as(m) in ("gated", "packed") and isinstance(vars(m)["forward"], forms.Patched)
    else:
        assert patched_as(m) == "experts_gate" and "forward" not in vars(m)
        assert isinstance(vars(m)["_apply_gate"], forms.Patched)
    spy = Spy(monkeypatch)
    dispatch = hasattr(m, "has_gate")  # @use_experts_implementation
    if dispatch:
        ref.config = m.config  # one config: both run the implementation set below
    for impl in IMPLS if dispatch else ("eager",):
        if dispatch:
            m.config._experts_implementation = impl
        args, args0 = _args(how, name)
        spy.calls.clear()
        y, y0 = m(*args), ref(*args0)
        if calls_gate is False and impl == "eager":
            assert spy.calls == [], impl
        elif calls_gate and impl == "eager":
            assert spy.calls, impl
        else:
            assert len(spy.calls) == 1, (impl, [c[0] for c in spy.calls])
        if _spec(name).limit is not None:
            assert spy.clamp_hits() == (True, True), impl
        hf_oracle.same_outputs(m, ref, y, y0, inputs=zip(args, args0))
        m.zero_grad(), ref.zero_grad()
    assert ffn_ext.hf.unpatch_model(m) == 1
    assert not any(hasattr(s, forms.MARK) or "forward" in vars(s) or "_apply_gate" in vars(s) for s in m.modules())


@pytest.mark.parametrize("name", NAMED_EXPERTS)
def test_experts_ffn_ext_does_not_patch_run_as_they_are_and_are_named(name, monkeypatch):
    """Experts whose gating ffn_ext does not inject: without an _apply_gate (Longcat-Flash, DBRX's DbrxExpertGLU,
    Llama 4, Inkling's shared experts: the gating is inline in their loops, which ffn_ext no longer copies) or with
    one it does not read (Beam's, with its float casts). Not patched (nothing set on any module), no ffn_ext op
    runs, the output and every gradient are the unpatched module's bit for bit, for each experts implementation it
    has; named in one RuntimeWarning with the reason (strict=True: ValueError)."""
    module, how, reason, named, where = NAMED_EXPERTS[name]
    m = _module(name, module)
    sub = m.get_submodule("" if where == "model" else where)
    assert type(sub).__name__ == named
    if reason == "INLINE_EXPERTS" and callable(getattr(type(sub), "_apply_gate", None)):
        pytest.skip(f"{named} has an _apply_gate in this transformers: test_every_experts_class_is_recognised reads it")
    ref = copy.deepcopy(m)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ffn_ext.patch_hf_model(m) == 0
    assert not any(hasattr(s, forms.MARK) or "forward" in vars(s) or "_apply_gate" in vars(s) for s in m.modules())
    spy = Spy(monkeypatch)
    dispatch = hasattr(m, "has_gate")
    if dispatch:
        ref.config = m.config
    for impl in IMPLS if dispatch else ("eager",):
        if dispatch:
            m.config._experts_implementation = impl
        args, args0 = _args(how, name)
        hf_oracle.same_outputs(m, ref, m(*args), ref(*args0), atol=0, grad_atol=0, inputs=zip(args, args0))
        m.zero_grad(), ref.zero_grad()
    assert spy.calls == []
    msgs = [str(w.message) for w in caught if w.category is RuntimeWarning]
    assert len(msgs) == 1, msgs
    assert msgs[0].endswith(f"{getattr(forms, reason)}: {named} at '{where}' (left unpatched)"), msgs[0]
    with pytest.raises(ValueError, match=re.escape(f"{named} at '{where}' (strict=True: nothing patched)")):
        ffn_ext.patch_hf_model(m, strict=True)


# ---------------------------------------------------------------- what is not patched is named, once
def test_unpatched_experts_are_named_in_one_warning_and_strict_raises():
    """Qwen2-MoE with hidden_act="relu6" (an activation ffn_ext lacks): its routed experts and its shared-expert MLP
    are left unpatched, named in ONE
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
    assert not any(hasattr(m, forms.MARK) or "_apply_gate" in vars(m) for m in model.modules())
    torch.testing.assert_close(model(ids).logits, ref, rtol=0, atol=0)


def _step3p7_experts():
    """Step-3.7's experts with limit 1.0 (5.24: a constructor argument; 5.25: the config's per-layer list), unit
    weights."""
    cls = _class("Step3p7Experts", "step3p7")
    torch.manual_seed(0)
    if "layer_idx" in inspect.signature(cls.__init__).parameters:
        m = cls(types.SimpleNamespace(**CONFIG, swiglu_limits=[1.0], limit_after_act=True), 0)
    else:
        m = cls(types.SimpleNamespace(**CONFIG), swiglu_limit=1.0)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p))
    assert m.limit == 1.0
    return m


def test_experts_ffn_ext_cannot_run_are_named_with_the_reason(monkeypatch):
    """Each reason to leave experts alone, in one warning: a gating ffn_ext lacks (Step3p7's clamp after the
    activation), an _apply_gate the recogniser does not read (a subclass's that calls super(); Beam's casts), no
    _apply_gate (Llama 4's inline gating), an activation ffn_ext lacks, a clamped gating with a GELU, a limit that is
    not a number > 0, and a recognised gating whose self-check disagrees (ffn_ext's op made to differ by 1e-3 here:
    the check must see it). Nothing is patched; strict=True refuses."""
    step = _step3p7_experts()

    class MyGate(_class("MiniMaxM3VLExperts", "minimax_m3_vl")):
        def _apply_gate(self, gate_up):
            return super()._apply_gate(gate_up) * 2

    mine = MyGate(types.SimpleNamespace(**CONFIG))
    beam = _module("BeamExperts", "beam")
    loop = _module("Llama4TextExperts", "llama4")
    relu6 = _class("Qwen3MoeExperts", "qwen3_moe")(types.SimpleNamespace(**{**CONFIG, "hidden_act": "relu6"}))
    gelu = _class("DeepseekV4Experts", "deepseek_v4")(types.SimpleNamespace(**{**CONFIG, "hidden_act": "gelu"}))
    no_limit = _module("MiniMaxM3VLExperts", "minimax_m3_vl")
    no_limit.swiglu_limit = None
    odd = _module("OpenAIPrivacyFilterExperts", "openai_privacy_filter")
    fused = common.Gating.__call__
    monkeypatch.setattr(common.Gating, "__call__", lambda *a: fused(*a) * (1 + 1e-3))
    net = nn.ModuleDict(
        dict(step=step, mine=mine, beam=beam, loop=loop, relu6=relu6, gelu=gelu, no_limit=no_limit, odd=odd)
    )
    with pytest.raises(ValueError, match="strict=True: nothing patched"):
        ffn_ext.patch_hf_model(net, strict=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ffn_ext.patch_hf_model(net) == 0
    assert len(caught) == 1 and caught[0].category is RuntimeWarning
    assert not any(hasattr(m, forms.MARK) or "forward" in vars(m) or "_apply_gate" in vars(m) for m in net.modules())
    msg = str(caught[0].message)
    for part in (
        re.escape(recognise.CLAMPS_AFTER) + ": Step3p7Experts at 'step'",
        re.escape(forms.UNKNOWN_EXPERTS) + ": MyGate at 'mine', BeamExperts at 'beam'",
        re.escape(forms.INLINE_EXPERTS) + ": Llama4TextExperts at 'loop'",
        r"activation ReLU6 is not one ffn_ext implements.*: Qwen3MoeExperts at 'relu6'",
        r"clamped gating with activation GELUActivation \(gelu\).*: DeepseekV4Experts at 'gelu'",
        r"clamp limit swiglu_limit = None is not a number > 0: MiniMaxM3VLExperts at 'no_limit'",
        re.escape(forms.DISAGREES_GATE) + ": OpenAIPrivacyFilterExperts at 'odd'",
    ):
        assert re.search(part, msg), (part, msg)
    monkeypatch.undo()  # with ffn_ext's op as it is, the same module passes its self-check
    assert ffn_ext.patch_hf_model(nn.ModuleDict(dict(odd=odd))) == 1


def test_gatings_that_clamp_after_the_activation_are_named_with_what_they_compute():
    """Step-3.7's MLPs (shared expert and dense layers, nn.Linear gate_proj / up_proj / down_proj like a SwiGLU) and
    experts with a limit clamp the activation's output, clamp(silu(gate), max=limit) * clamp(up, -limit, limit),
    which no ffn_ext op computes; so does a class of one's own that writes the same gating another way (torch.clamp,
    positional bounds). All are recognised from their code and named in the one warning with
    recognise.CLAMPS_AFTER, also when listed in extra_classes, and refused with strict=True; they compute what they
    did, bit for bit. (A layer without a limit differs by release: 5.24 clamps at inf, 5.25 skips the clamp by an
    `if`; tests/test_hf_recognise.py covers the guards.)"""
    config = types.SimpleNamespace(**CONFIG, share_expert_dim=8, swiglu_limits_shared=[1.0, 0.0])
    mlp_cls = _class("Step3p7MLP", "step3p7")

    class MyClampAfter(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.randn(4, 16, 16))
            self.down_proj = nn.Parameter(torch.randn(4, 16, 8))
            self.act_fn = nn.SiLU()
            self.limit = 0.5

        def _apply_gate(self, gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            return torch.clamp(self.act_fn(gate), max=self.limit) * up.clamp(-self.limit, self.limit)

    torch.manual_seed(0)
    net = nn.ModuleDict(
        dict(
            mlp=mlp_cls(config, 0),
            experts=_step3p7_experts(),
            mine=MyClampAfter(),
        )
    )
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn_like(p))
    assert net["mlp"].limit == 1.0
    x, ids, w = _inputs("routed")
    gate_up = torch.randn(6, 16, generator=torch.Generator().manual_seed(2)) * 4

    def run():
        return net["mlp"](x), net["experts"](x, ids, w), net["mine"]._apply_gate(gate_up)

    ref = run()
    with pytest.raises(ValueError, match=r"clamp the activation's output.*Step3p7MLP.*strict=True"):
        ffn_ext.patch_hf_model(net, strict=True, extra_classes=[mlp_cls])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ffn_ext.patch_hf_model(net, extra_classes=[mlp_cls]) == 0
    assert len(caught) == 1 and caught[0].category is RuntimeWarning
    assert str(caught[0].message) == (
        f"ffn_ext.hf.patch_model: {recognise.CLAMPS_AFTER}: Step3p7MLP at 'mlp', Step3p7Experts at "
        "'experts', MyClampAfter at 'mine' (left unpatched)"
    ), str(caught[0].message)
    assert not any(hasattr(m, forms.MARK) or "forward" in vars(m) or "_apply_gate" in vars(m) for m in net.modules())
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
    experts = [m for m in model.modules() if forms.is_experts(m)]
    assert ffn_ext.patch_hf_model(model) == 2
    assert ffn_ext.patch_hf_model(model) == 0  # already patched
    assert all(isinstance(vars(m)["_apply_gate"], forms.Patched) and "forward" not in vars(m) for m in experts)
    clone = copy.deepcopy(model)
    assert all(m._apply_gate.__self__ is m for m in clone.modules() if forms.is_experts(m))
    for m2 in (clone, hf_oracle.reloaded(model)):
        torch.testing.assert_close(m2(ids).logits, ref, atol=1e-5, rtol=1e-5)
        assert all(
            isinstance(vars(m)["_apply_gate"], forms.Patched) and m._apply_gate.__self__ is m
            for m in m2.modules()
            if forms.is_experts(m)
        )
    assert ffn_ext.hf.unpatch_model(model) == 2
    assert all("_apply_gate" not in vars(m) and not hasattr(m, forms.MARK) for m in experts)
    torch.testing.assert_close(model(ids).logits, ref, atol=1e-5, rtol=1e-5)

    model = _tiny("mixtral")  # eager inlines its gating: still only _apply_gate is patched, never the forward
    experts = [m for m in model.modules() if forms.is_experts(m)]
    assert ffn_ext.patch_hf_model(model) == 2
    assert all(isinstance(vars(m)["_apply_gate"], forms.Patched) and "forward" not in vars(m) for m in experts)
    assert ffn_ext.hf.unpatch_model(model) == 2
    assert all("forward" not in vars(m) and "_apply_gate" not in vars(m) for m in experts)


@pytest.mark.parametrize("impl", IMPLS)
def test_hooks_on_the_experts_activation_see_it_run(impl, monkeypatch):
    """A hook on an experts module's act_fn fires as in the unpatched model (the gating then runs as the class
    wrote it, under every implementation), and a replaced activation is the one that runs. Layer 1's experts stay
    fused where _apply_gate is called (grouped_mm, batched_mm); Qwen3-MoE's eager forward inlines the gating, so
    there they are named, not patched, and no ffn_ext op runs at all."""
    model = _tiny("qwen3_moe")
    model.set_experts_implementation(impl)
    ref = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ffn_ext.patch_hf_model(model) == (2 if impl != "eager" else 0)
    assert len(caught) == (impl == "eager")
    ids = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(2))
    seen = []
    for m in (model, ref):
        m.model.layers[0].mlp.experts.act_fn.register_forward_hook(lambda mod, i, o: seen.append(o.shape))
    spy = Spy(monkeypatch)
    torch.testing.assert_close(model(ids).logits, ref(ids).logits, atol=1e-5, rtol=1e-5)
    assert seen and len(seen) % 2 == 0  # as often in both models
    assert len(spy.calls) == (1 if impl != "eager" else 0)
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
# what the patch relies on in transformers' integrations/moe.py: its experts implementations call self._apply_gate,
# and @use_experts_implementation gives a class without one the default (act_fn(gate) * up)
MOE_SOURCE = {
    "grouped_mm_experts_forward": "proj_out = self._apply_gate(proj_out)",
    "batched_mm_experts_forward": "proj_out = self._apply_gate(proj_out)",
    "use_experts_implementation": "experts_class._apply_gate = _default_apply_gate",
}


# a detector independent of the recogniser: code that clamps an activation's output (the form ffn_ext names)
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
            pairs = []  # (target, value); `a, b = f(x), g(x)` pairs element by element
            for t in targets:
                v = stmt.value
                if isinstance(t, ast.Tuple) and isinstance(v, ast.Tuple) and len(t.elts) == len(v.elts):
                    pairs.extend(zip(t.elts, v.elts))
                else:
                    pairs.append((t, v))
            for t, v in pairs:
                if isinstance(t, ast.Name):
                    acts = acts | {t.id} if activated(v) else acts - {t.id}
    return False


def _if_attrs(fn) -> set:
    """The self.<attr> names that fn's `if` tests read (none where its source cannot be read)."""
    try:
        node = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(fn)))).body[0]
    except (OSError, TypeError, SyntaxError):
        return set()
    return {
        n.attr
        for st in ast.walk(node)
        if isinstance(st, ast.If)
        for n in ast.walk(st.test)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
    }


GATE = (forms.EXPERTS,)  # the readers: the experts' gating, and the MLP forms
MLP = tuple(f for f in forms.FORMS if f.method == "forward")


def _recognised(module, which):
    """(form name, plan without its guards), Named or None, as the forms `which` read the module's code."""
    found = forms.recognised(module, which)
    if found is None or isinstance(found[1], recognise.Named):
        return found and found[1]
    return found[0].name, dataclasses.replace(found[1], guards=())


def _read(which, cls, fn, limits=(), others=None):
    """_recognised on a bare instance of cls. Where that is None and the code has `if` tests on attributes (a bare
    instance has none: a later transformers may add `if self.limit is not None:`), read again with them set:
    `limits` to 1.0, the others to `others`."""
    form = _recognised(hf_oracle.bare(cls), which)
    attrs = _if_attrs(fn)
    if form is None and attrs:
        form = _recognised(hf_oracle.bare(cls, **{a: 1.0 if a in limits else others for a in attrs}), which)
    return form


def _gate(spec):
    return "experts_gate", forms.Plan(gate=spec)


def _experts_classes() -> dict:
    """transformers' experts classes: every class of its modeling files that is decorated with
    use_experts_implementation or defines an _apply_gate, {name: class} (abstract ones left out). Only the files
    that mention either are parsed and imported."""
    found = {}
    for node, methods, path in hf_oracle.modeling_classes("_apply_gate|use_experts_implementation"):
        decorated = any("use_experts_implementation" in ast.unparse(d) for d in node.decorator_list)
        cls = hf_oracle.load(node.name, path) if decorated or "_apply_gate" in methods else None
        if cls is not None and not inspect.isabstract(cls):
            assert node.name not in found, f"{node.name} in two modeling files"
            found[node.name] = cls
    return found


# the oracle's experts without an _apply_gate at 5.24, by modeling module
INLINE_MODULES = {
    "Llama4TextExperts": "llama4",
    "LongcatFlashExperts": "longcat_flash",
    "DbrxExpertGLU": "dbrx",
    "InklingSharedExperts": "inkling",
    "JetMoeMoE": "jetmoe",
}


def test_every_experts_class_is_recognised_as_the_oracle_says():
    """Every experts class of transformers (decorated with use_experts_implementation, or with an _apply_gate of its
    own): the experts' form reads an uninitialised instance without an error, and as expected: for the classes of
    1952e74's list (EXPERTS) whose gating was at their _apply_gate then ("gate", "linear", "matmul", "linear_norm"
    forms), a plan with the list's gating (BeamExperts: None, its dtype
    casts); for hf_oracle.CLAMP_AFTER's experts, Named(_CLAMPS_AFTER); for any other class with transformers'
    default _apply_gate, the plain gating. The list's experts without an _apply_gate (Llama 4, Longcat-Flash,
    DBRX, Inkling's shared, JetMoE) have none still and are refused with _INLINE_EXPERTS (a later transformers that
    gives one an _apply_gate: it must read as the list's _Gate). A class whose code gains an `if` on a limit reads
    as None when bare, so it is read again with the attributes set."""
    from transformers.integrations.moe import _default_apply_gate

    classes = _experts_classes()
    core = {"GptOssExperts", "Qwen3MoeExperts", "Qwen2MoeExperts", "MixtralExperts", "DeepseekV3Experts"}
    assert core | {"DeepseekV4Experts"} <= classes.keys()
    wrong = {}
    for name, cls in sorted(classes.items()):
        fn = getattr(cls, "_apply_gate", None)
        assert callable(fn), f"{name}: @use_experts_implementation gives every class an _apply_gate"
        _recognised(hf_oracle.bare(cls), GATE)  # whatever it reads, without an error
        entry = EXPERTS.get(name)
        if entry is not None and entry[1] in WITH_APPLY_GATE:
            gate = entry[0]
            want = None if name in UNRECOGNISED else _gate(gate)
            got = _read(GATE, cls, fn, limits=(gate.limit, gate.alpha))
        elif name in hf_oracle.CLAMP_AFTER:
            want = recognise.Named(recognise.CLAMPS_AFTER)
            got = _read(GATE, cls, fn, limits=_if_attrs(fn))
        elif inspect.unwrap(fn) is _default_apply_gate:
            want, got = _gate(_PLAIN), _read(GATE, cls, fn)
        else:
            continue  # a gating the list does not know (Inkling2's act_fn(gate, up)): read or not, it must not raise
        if got != want:
            wrong[name] = f"read as {got}, expected {want}"
    listed = [n for n, (_, how) in EXPERTS.items() if how in WITH_APPLY_GATE]
    assert len(set(listed) & classes.keys()) >= len(listed) - 5, set(listed) - classes.keys()
    for name, module in INLINE_MODULES.items():
        assert EXPERTS[name][1] not in WITH_APPLY_GATE
        cls = _class(name, module)
        fn = getattr(cls, "_apply_gate", None)
        if fn is None:  # nothing to read: named with INLINE_EXPERTS (test_experts_ffn_ext_does_not_patch_...)
            if _recognised(hf_oracle.bare(cls), GATE) is not None:
                wrong[name] = "read without an _apply_gate"
        else:
            gate = EXPERTS[name][0]
            got = _read(GATE, cls, fn, limits=(gate.limit, gate.alpha))
            if got != _gate(gate):
                wrong[name] = f"its new _apply_gate read as {got}, expected {gate}"
    assert not wrong, wrong


def test_clamped_mlps_and_clamps_after_the_activation_are_recognised_from_their_code():
    """hf_oracle.KNOWN_CLAMPED's MLPs read (the MLP forms, on an uninitialised instance) as 1952e74's clamped gating,
    gated or packed by their projections; and every gated MLP or experts class of transformers' modeling files
    (gate_proj and up_proj, or gate_up_proj, or an _apply_gate) whose forward or _apply_gate clamps an activation's
    output, as a detector independent of the recogniser finds it in the source, reads as Named(_CLAMPS_AFTER);
    hf_oracle.CLAMP_AFTER's classes among them (a later transformers may add some: Bailing-Hybrid with a limit)."""
    clamp_after, clamped, seen = {}, {}, set()
    for node, methods, path in hf_oracle.modeling_classes(
        r"(?s)^(?=.*(clamp|clip))(?=.*(gate_proj|gate_up_proj|_apply_gate))"
    ):
        seen.add(node.name)
        assigned = hf_oracle.init_assignments(node)
        if node.name in CLAMPED_GATES:
            clamped[node.name] = path, "gate_up_proj" in assigned
        gated = {"gate_proj", "up_proj"} <= assigned.keys() or "gate_up_proj" in assigned or "_apply_gate" in methods
        for method in ("_apply_gate", "forward"):
            if method in methods and _clamps_after_activation(methods[method]) and gated:
                clamp_after.setdefault(node.name, (path, method))
    assert clamp_after and hf_oracle.CLAMP_AFTER & seen <= clamp_after.keys(), sorted(clamp_after)
    assert clamped.keys() == hf_oracle.KNOWN_CLAMPED & seen and "DeepseekV4MLP" in clamped

    wrong = {}
    for name, (path, method) in sorted(clamp_after.items()):
        cls = hf_oracle.load(name, path)
        fn = getattr(cls, method)
        got = _read(GATE if method == "_apply_gate" else MLP, cls, fn, limits=_if_attrs(fn))
        if got != recognise.Named(recognise.CLAMPS_AFTER):
            wrong[name] = got
    for name, (path, packed) in sorted(clamped.items()):
        cls = hf_oracle.load(name, path)
        gate = CLAMPED_GATES[name]
        if packed:
            want = "packed", forms.Plan(("gate_up_proj", "down_proj"), gate)
        else:
            want = "gated", forms.Plan(("gate_proj", "up_proj", "down_proj"), gate)
        got = _read(MLP, cls, cls.forward, limits=(gate.limit, gate.alpha))
        if got != want:
            wrong[name] = f"read as {got}, expected {want}"
    assert not wrong, wrong


def test_transformers_calls_the_gating_where_the_patch_injects_it():
    """What patching only _apply_gate relies on, in transformers' integrations/moe.py: grouped_mm and batched_mm
    call self._apply_gate on the [S, 2I] projection, @use_experts_implementation gives a class without one the
    default, and the default is the plain gating (recognised as such)."""
    from transformers.integrations import moe

    tree = ast.parse((pathlib.Path(transformers.__file__).parent / "integrations" / "moe.py").read_text())
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    for name, line in MOE_SOURCE.items():
        assert line in ast.unparse(funcs[name]), name
    default = hf_oracle.bare(type("E", (nn.Module,), {"_apply_gate": moe._default_apply_gate}))
    assert _recognised(default, GATE) == _gate(_PLAIN)


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
    hf_oracle.loaded_into(model, ref)
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
    cfg_name, model_name, kw = MODELS[kind][:3]
    return getattr(transformers, model_name)(getattr(transformers, cfg_name)(**{**BASE, **kw})).eval()
