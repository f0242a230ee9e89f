"""patch_hf_model recognises forms from the code and checks them over every regime: the hostile cases (a listed name
whose forward clamps beyond what small inputs reach), a new class of a known form, `if` guards, T5, and the
transformers 5.25 changes (Bailing-Hybrid's clamps, LongCat's experts). Tiny random models, no downloads."""

import copy
import functools
import linecache
import re
import sys
import textwrap
import types
import warnings

import hf_oracle
import pytest
import torch
import torch.nn as nn
from hf_oracle import raise_errors  # noqa: F401  (autouse: a recogniser's error fails the test)

import ffn_ext
from ffn_ext.hf import common, forms, recognise

transformers = pytest.importorskip("transformers")
from transformers.activations import ACT2FN  # noqa: E402


class _Config(types.SimpleNamespace):
    pass


def _llama_like(forward, name="LlamaMLP", module="transformers.models.llama.modeling_llama", **attrs):
    """A class named and placed like transformers' LlamaMLP with the given forward."""

    def __init__(self, h=32, f=64):
        nn.Module.__init__(self)
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(h, f), nn.Linear(h, f), nn.Linear(f, h)
        self.act_fn = ACT2FN["silu"]
        self.__dict__.update(attrs)

    cls = type(name, (nn.Module,), {"__init__": __init__, "forward": forward, "__module__": module})
    return cls


def _clamp_after_16(self, x):
    return self.down_proj(self.act_fn(self.gate_proj(x)).clamp(max=16) * self.up_proj(x))


def _plain(self, x):
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _fused(module, x):
    """The fused gated MLP (SiLU) on a module's gate_proj, up_proj and down_proj."""
    plan = forms.Plan(forms.GATED_NAMES)
    return forms.GatedMLP().run(module, plan, x, common.Gating("swiglu"))


def _old_self_check(module) -> bool:
    """The self-check before this design: two randn rows, no scaling, relative norm 1e-4."""
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, out = module(x), _fused(module, x)
    return bool((out - ref).norm() <= 1e-4 * ref.norm())


@pytest.mark.parametrize("scale", [0.1, 1.0, 10.0, 100.0, 1000.0])
def test_a_listed_name_that_clamps_after_the_activation_is_never_computed_wrong(scale):
    """A class named and placed like transformers' LlamaMLP (a name the old lists held) whose forward clamps the
    activation's output at 16: the old self-check (two randn rows) passes it, so the old patch computed it wrong
    for large inputs; now its code is not recognised (named), and listed in extra_classes the self-check over
    every regime refuses it. At every input scale the model computes what the class does."""
    Cls = _llama_like(_clamp_after_16)
    torch.manual_seed(0)
    mlp = Cls()
    assert _old_self_check(mlp)  # the old check would have patched it
    x = torch.randn(3, 32) * scale
    ref = mlp(x)
    with pytest.warns(RuntimeWarning, match="not known to compute.*LlamaMLP at 'model'"):
        assert ffn_ext.patch_hf_model(mlp) == 0
    with pytest.warns(RuntimeWarning, match="self-check.*LlamaMLP at 'model'"):
        assert ffn_ext.patch_hf_model(mlp, extra_classes=[Cls]) == 0
    assert "forward" not in vars(mlp)
    torch.testing.assert_close(mlp(x), ref, rtol=0, atol=0)
    if scale >= 100:  # large inputs do reach the clamp: fusing it would have been wrong
        assert (_fused(mlp, x) - ref).abs().max() > 1.0


def test_the_check_over_every_regime_catches_a_clamp_hidden_behind_unreadable_code():
    """Code the recogniser cannot read (getattr calls) but that clamps after the activation at a limit stored on the
    module (2.5e3, beyond the fixed scales): vouched for in extra_classes, it is refused because the check drives
    the inputs past every limit-like number on the module."""

    def forward(self, x):
        gate = getattr(self, "act_fn")(getattr(self, "gate_proj")(x))  # noqa: B009  (code the recogniser does not read)
        return self.down_proj(gate.clamp(max=self.cap) * self.up_proj(x))

    Cls = _llama_like(forward, name="MyMLP", module=__name__, cap=2.5e3)
    torch.manual_seed(1)
    mlp = Cls()
    assert forms.recognised(mlp) is None
    fused = functools.partial(_fused, mlp)
    assert common.self_check(mlp, fused, type(mlp).forward, mlp.gate_proj) == common.DISAGREE
    with pytest.warns(RuntimeWarning, match="self-check.*MyMLP"):
        assert ffn_ext.patch_hf_model(mlp, extra_classes=[Cls]) == 0


def test_a_new_class_of_the_plain_gated_form_is_patched_by_its_code():
    """A class no list knows, under new attribute names, computing the plain gated form: patched with no
    extra_classes; output and input gradient equal the original's; the fused MLP runs."""

    class BrandNewFFN(nn.Module):
        def __init__(self):
            super().__init__()
            self.w_in, self.w_gate, self.w_out = nn.Linear(24, 40), nn.Linear(24, 40), nn.Linear(40, 24)
            self.nonlin = nn.GELU(approximate="tanh")

        def forward(self, hidden):
            gate = self.nonlin(self.w_gate(hidden))
            out = gate * self.w_in(hidden)
            return self.w_out(out)

    torch.manual_seed(2)
    net = BrandNewFFN()
    ref = copy.deepcopy(net)
    form, plan = forms.recognised(net)
    assert form.name == "gated" and plan.names == ("w_gate", "w_in", "w_out") and plan.gate.act == "nonlin"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ffn_ext.patch_hf_model(net) == 1
    x = (torch.randn(5, 24) * 3).requires_grad_()
    x0 = x.detach().clone().requires_grad_()
    y, y0 = net(x), ref(x0)
    assert "_GatedMLP" in type(y.grad_fn).__name__
    torch.testing.assert_close(y, y0, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(y)
    y.backward(g)
    y0.backward(g)
    torch.testing.assert_close(x.grad, x0.grad, atol=1e-5, rtol=1e-5)


class _Step(nn.Module):
    """Bailing-Hybrid's 5.25 shared MLP (and Step-3.7's): the clamp after the activation only with a limit."""

    def __init__(self, limit):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(16, 32), nn.Linear(16, 32), nn.Linear(32, 16)
        self.act_fn = ACT2FN["silu"]
        self.limit = limit

    def forward(self, x) -> torch.Tensor:
        gate, up = self.act_fn(self.gate_proj(x)), self.up_proj(x)
        if self.limit is not None:
            gate = gate.clamp(max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
        return self.down_proj(gate * up)


def test_if_guards_decide_the_form_on_the_instance_and_are_checked_on_every_call():
    """Without a limit the code is the plain gated MLP: patched, with its `if` test's attribute as a guard; with a
    limit it clamps after the activation: named. A limit set after patching makes the patched forward run the
    class's code (the guard no longer holds)."""
    torch.manual_seed(3)
    plain, clamped = _Step(None), _Step(16.0)
    assert forms.recognised(plain)[1].guards == (("limit", None),)
    assert forms.recognised(clamped)[1] == recognise.Named(recognise.CLAMPS_AFTER)
    net = nn.Sequential(plain, clamped)
    with pytest.warns(RuntimeWarning, match="clamp the activation's output.*_Step at '1'"):
        assert ffn_ext.patch_hf_model(net) == 1
    x = torch.randn(4, 16) * 50
    plain.limit = 1.0
    with torch.no_grad():
        want = _Step.forward(plain, x)
    torch.testing.assert_close(plain(x), want, rtol=0, atol=0)


def _tiny_t5(feed_forward_proj, d_ff=64):
    config = transformers.T5Config(
        vocab_size=97,
        d_model=32,
        d_kv=8,
        d_ff=d_ff,
        num_layers=2,
        num_heads=4,
        feed_forward_proj=feed_forward_proj,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(4)
    return transformers.T5ForConditionalGeneration(config).eval()


@pytest.mark.parametrize("d_ff", [64, 32])
@pytest.mark.parametrize("proj, cls", [("relu", "T5DenseActDense"), ("gated-gelu", "T5DenseGatedActDense")])
def test_t5_feed_forwards_are_named_not_skipped_silently(proj, cls, d_ff):
    """T5's feed-forwards cast to wo's dtype in forward (code the recogniser does not read) and have a dropout
    before wo: they run as they are and are named in the warning, not left out silently, also where they do not
    widen (transformers' own test config: d_ff = d_model); outputs unchanged."""
    model = _tiny_t5(proj, d_ff)
    ids = torch.randint(1, 97, (2, 7), generator=torch.Generator().manual_seed(5))
    ref = model(input_ids=ids, decoder_input_ids=ids).logits
    with pytest.warns(RuntimeWarning, match=f"{cls} at "):
        ffn_ext.patch_hf_model(model)
    torch.testing.assert_close(model(input_ids=ids, decoder_input_ids=ids).logits, ref, rtol=0, atol=0)


def _compare_patched(model, seed):
    """Patches `model`; its logits and every parameter gradient (fp32) equal those of a copy left unpatched. Returns
    how many modules were patched."""
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        n = ffn_ext.patch_hf_model(model)
    ids = torch.randint(2, 97, (2, 7), generator=torch.Generator().manual_seed(seed))
    hf_oracle.same_outputs(model, ref, model(ids).logits, ref(ids).logits, atol=1e-4, grad_atol=1e-4)
    return n


def _has(config, *fields):
    cls = getattr(transformers, config, None)
    if cls is None or not all(hasattr(cls(), f) for f in fields):
        pytest.skip(f"this transformers ({transformers.__version__}) has no {config} with {fields}")
    return cls


@pytest.mark.parametrize("limit", [1.0, 16.0])
def test_bailing_hybrid_with_limits_computes_what_it_did(limit):
    """transformers 5.25's Bailing-Hybrid clamps after the activation in its MLPs and experts (swiglu_limits_shared,
    swiglu_limits): named, never computed as the plain form; outputs and gradients equal the unpatched modules' at
    inputs well past the limit, under grouped_mm (which calls _apply_gate) and eager. Runs where the installed
    transformers has those fields (CI's second transformers)."""
    Config = _has("BailingHybridConfig", "swiglu_limits", "swiglu_limits_shared")
    from transformers.models.bailing_hybrid import modeling_bailing_hybrid as mod

    config = Config(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=4, num_hidden_layers=1)
    config.swiglu_limits, config.swiglu_limits_shared = [limit], [limit]
    torch.manual_seed(6)
    mlp, experts = mod.BailingHybridMLP(config, layer_idx=0), mod.BailingHybridExperts(config, 0)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 1)
        experts.down_proj.normal_(0, 0.1)
    net = nn.ModuleDict({"mlp": mlp, "experts": experts})
    ref = copy.deepcopy(net)
    with pytest.warns(RuntimeWarning, match="clamp the activation's output.*BailingHybridMLP at 'mlp'"):
        assert ffn_ext.patch_hf_model(net) == 0
    x = torch.randn(6, 32) * 20
    torch.testing.assert_close(net["mlp"](x), ref["mlp"](x), rtol=0, atol=0)
    idx = torch.randint(0, 4, (6, 2), generator=torch.Generator().manual_seed(7))
    w = torch.rand(6, 2, generator=torch.Generator().manual_seed(8))
    for impl in ("grouped_mm", "eager"):
        config._experts_implementation = impl
        torch.testing.assert_close(net["experts"](x, idx, w), ref["experts"](x, idx, w), rtol=0, atol=0)


def _bailing_hybrid_limits(limit: float) -> dict:
    if not limit:
        return {}
    _has("BailingHybridConfig", "swiglu_limits", "swiglu_limits_shared")
    return {"swiglu_limits": [limit, limit], "swiglu_limits_shared": [limit, limit]}


@pytest.mark.parametrize("limit", [0.0, 1.0, 16.0])
def test_bailing_hybrid_model_is_patched_where_exact_and_computes_what_it_did(limit):
    """A whole tiny Bailing-Hybrid (a dense layer, then an MoE layer with shared experts): its logits and every
    parameter gradient equal the unpatched model's. The dense MLP (no limit: built without a layer index) is patched
    at every transformers; with a limit (5.25: 0 means none) the shared experts and the routed experts clamp after
    the activation and are named, without one they are patched too."""
    if getattr(transformers, "BailingHybridConfig", None) is None:
        pytest.skip(f"this transformers ({transformers.__version__}) has no BailingHybridConfig")
    config = transformers.BailingHybridConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=8,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        head_dim=8,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=2,
        num_local_experts=4,
        first_k_dense_replace=1,
        layer_types=["full_attention", "linear_attention"],
        pad_token_id=0,
        eos_token_id=1,
        num_mtp_layers=0,
        **_bailing_hybrid_limits(limit),
    )
    torch.manual_seed(10)
    model = transformers.AutoModelForCausalLM.from_config(config)
    ref = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ffn_ext.patch_hf_model(ref)
    named = " ".join(str(w.message) for w in caught if issubclass(w.category, RuntimeWarning))
    assert ("clamp the activation's output" in named) == bool(limit), named
    if limit:
        assert "'model.layers.1.mlp.shared_experts'" in named and "'model.layers.1.mlp.experts'" in named, named
    assert _compare_patched(model, 11) == (1 if limit else 3)


def test_longcat_flash_runs_after_patching():
    """LongCat-Flash (rewritten onto @use_experts_implementation in 5.25; its own loop at 5.24): patching never
    breaks its forward; logits and gradients equal the unpatched model's."""
    Config = getattr(transformers, "LongcatFlashConfig", None)
    if Config is None:
        pytest.skip(f"this transformers ({transformers.__version__}) has no LongcatFlashConfig")
    config = Config(
        vocab_size=97,
        hidden_size=32,
        ffn_hidden_size=64,
        expert_ffn_hidden_size=16,
        num_layers=1,
        num_attention_heads=4,
        n_routed_experts=4,
        moe_topk=2,
        zero_expert_num=2,
        kv_lora_rank=8,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        head_dim=8,
        num_key_value_heads=4,
    )
    torch.manual_seed(8)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    _compare_patched(model, 9)


def test_the_recogniser_reads_no_class_names():
    """No class list in the product: the recogniser's and the planner's modules hold no transformers class names."""
    import inspect

    for mod in ("recognise", "patch", "forms", "common"):
        src = inspect.getsource(sys.modules[f"ffn_ext.hf.{mod}"])
        code = "\n".join(line for line in src.splitlines() if not line.lstrip().startswith("#"))
        assert "_KNOWN" not in code and "LlamaMLP\"" not in code, mod


def test_an_error_in_the_recogniser_fails_the_tests_and_names_the_module_for_users(monkeypatch):
    """Only "this code is not a form" reads as not recognised: an error inside the recogniser (here a KeyError in
    the gating matcher) raises in the tests (forms.RAISE_ERRORS, set by hf_oracle's fixture), and for users leaves
    the module unpatched and names it in the warning with the error, never silently."""
    torch.manual_seed(5)
    mlp = _llama_like(_plain)()
    x = torch.randn(3, 32)
    ref = mlp(x)
    monkeypatch.setattr(forms, "gating", lambda v: {}["a bug"])
    with pytest.raises(KeyError, match="a bug"):
        ffn_ext.patch_hf_model(mlp)
    monkeypatch.setattr(forms, "RAISE_ERRORS", False)
    with pytest.warns(RuntimeWarning, match=re.escape(f"{forms.FAILED} (KeyError: 'a bug'): LlamaMLP at 'model'")):
        assert ffn_ext.patch_hf_model(mlp) == 0
    assert "forward" not in vars(mlp)
    torch.testing.assert_close(mlp(x), ref, rtol=0, atol=0)


@pytest.mark.parametrize(
    "body",
    [
        "return self.down_proj(-None * self.up_proj(x))",
        "return self.down_proj(self.up_proj(x)[True])",
        "return self.down_proj(F.gelu(self.up_proj(x), approximate=-'tanh'))",
        "y = self.up_proj(x) + None\ny += 1\nreturn self.down_proj(y)",
        "return self.down_proj(self.act_fn(self.gate_proj(x), 2) * self.up_proj(x))",
        "return self.down_proj(self.act_fn(self.gate_proj(x)).clamp(max='a') * self.up_proj(x))",
        "if self.act_fn:\n    return self.down_proj(x)\nreturn x",
    ],
)
def test_code_outside_the_subset_reads_as_no_form_without_an_error(body):
    """Code the interpreter does not read (values that are no numbers where it computes, odd indices and
    arguments) is no form, without an error (hf_oracle's fixture makes one fail the test)."""
    src = "def forward(self, x):\n" + textwrap.indent(body, "    ") + "\n"
    name = f"<hf-test-{abs(hash(body))}>"
    linecache.cache[name] = (len(src), None, src.splitlines(True), name)  # inspect.getsource reads it from here
    namespace: dict = {"F": torch.nn.functional}
    exec(compile(src, name, "exec"), namespace)
    mlp = _llama_like(namespace["forward"], name="MyMLP", module=__name__)()
    assert forms.recognised(mlp) is None
    with pytest.warns(RuntimeWarning, match="not known to compute.*MyMLP"):
        assert ffn_ext.patch_hf_model(mlp) == 0


def test_ffns_that_do_not_widen_are_recognised_by_their_code():
    """Recognition does not depend on the sizes: a gated (Llama's) and a classic (ViT's) MLP whose inner size is the
    model size are patched by their code and compute what they did (T5's and Whisper's, whose code is not read, are
    named: test_t5_feed_forwards_are_named_not_skipped_silently, tests/test_hf_classic.py)."""
    from transformers.models.llama.modeling_llama import LlamaMLP
    from transformers.models.vit.modeling_vit import ViTMLP

    torch.manual_seed(9)
    llama = LlamaMLP(transformers.LlamaConfig(hidden_size=16, intermediate_size=16, num_attention_heads=2))
    net = nn.Sequential(llama, ViTMLP(transformers.ViTConfig(hidden_size=16, intermediate_size=16)))
    x = torch.randn(3, 16) * 4
    ref = net(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ffn_ext.patch_hf_model(net) == 2
    torch.testing.assert_close(net(x), ref, atol=1e-5, rtol=1e-5)
