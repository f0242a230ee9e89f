"""A patched module whose fused path does not run says so, once, with the module and the reason (hooks on its
submodules, an implementation switched after patching, an instance forward wrapper, an input it does not take, and
recompute / token_chunk that cannot act); DeepSpeed ZeRO-3 as patch_model meets it, simulated without deepspeed
(tests/test_zero3.py runs the real one): partitioned weights gathered for the self-check, the ZeRO-3 leaf flag, and
submodules already hooked by deepspeed.initialize. An error in a module's own code during the self-check is named
as that error, never as a different result."""

from __future__ import annotations

import contextlib
import sys
import types
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ffn_ext
from ffn_ext.hf import forms

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaMLP  # noqa: E402


def _mlp():
    torch.manual_seed(0)
    return LlamaMLP(transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2))


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ffn_ext ops that run inside it."""

    n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += str(func).startswith("ffn_ext.")
        return func(*args, **(kwargs or {}))


def _run(module, *args, calls=3, **kwargs):
    """(the output, the RuntimeWarnings, the ffn_ext ops that ran) of `calls` calls."""
    with warnings.catch_warnings(record=True) as seen, _Ops() as ops:
        warnings.simplefilter("always")
        for _ in range(calls):
            y = module(*args, **kwargs)
    return y, [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)], ops.n


def _one(msgs, *parts):
    assert len(msgs) == 1, msgs
    for p in parts:
        assert p in msgs[0], (p, msgs[0])


def test_fused_path_runs_silently():
    mlp = _mlp()
    x = torch.randn(2, 3, 16)
    ref = mlp(x)
    assert ffn_ext.patch_hf_model(mlp) == 1
    y, msgs, n = _run(mlp, x)
    assert msgs == [] and n > 0
    torch.testing.assert_close(y, ref)


@pytest.mark.parametrize("hook", ["forward_pre", "forward", "full_backward"])
def test_hooks_on_a_submodule_warn_once(hook):
    """Hooks on the activation (what DeepSpeed ZeRO-3 puts on every submodule): the module's own forward runs,
    which the first call names, with the hooked submodule."""
    mlp = _mlp()
    x = torch.randn(2, 3, 16)
    ref = mlp(x)
    assert ffn_ext.patch_hf_model(mlp) == 1
    fn = {"forward_pre": lambda m, a: None, "forward": lambda m, a, o: None, "full_backward": lambda m, gi, go: None}
    getattr(mlp.act_fn, f"register_{hook}_hook")(fn[hook])
    y, msgs, n = _run(mlp, x)
    _one(msgs, "model (LlamaMLP), patched, runs without ffn_ext's fused forward", "(act_fn)")
    assert n == 0
    torch.testing.assert_close(y, ref)


def test_global_hooks_warn():
    mlp = _mlp()
    assert ffn_ext.patch_hf_model(mlp) == 1
    handle = nn.modules.module.register_module_forward_pre_hook(lambda m, a: None)
    try:
        _, msgs, n = _run(mlp, torch.randn(3, 16))
    finally:
        handle.remove()
    _one(msgs, "global module hooks")
    assert n == 0


def test_an_activation_switched_after_patching_warns():
    mlp = _mlp()
    x = torch.randn(2, 3, 16)
    assert ffn_ext.patch_hf_model(mlp) == 1
    mlp.act_fn = nn.Softplus()
    y, msgs, n = _run(mlp, x)
    _one(msgs, "implementation was switched after patching", "Softplus")
    assert n == 0
    torch.testing.assert_close(y, mlp.down_proj(F.softplus(mlp.gate_proj(x)) * mlp.up_proj(x)))


def test_an_experts_implementation_switched_after_patching_warns():
    """Experts patched at _apply_gate, then switched to "eager", whose loop inlines the gating: _apply_gate never
    runs, which the experts' first forward names."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = transformers.Qwen3MoeConfig(
        hidden_size=16, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2, num_attention_heads=2
    )
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    experts = Qwen3MoeExperts(cfg)
    nn.init.normal_(experts.gate_up_proj)
    nn.init.normal_(experts.down_proj)
    assert ffn_ext.patch_hf_model(experts) == 1
    x = torch.randn(6, 16)
    idx = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]])
    w = torch.full((6, 2), 0.5)
    _, msgs, n = _run(experts, x, idx, w)
    assert msgs == [] and n > 0
    cfg._experts_implementation = "eager"
    _, msgs, n = _run(experts, x, idx, w)
    _one(msgs, "Qwen3MoeExperts", "implementation was switched after patching")
    assert n == 0


def test_an_instance_forward_wrapper_warns():
    """A wrapper the instance had when patched runs (it must: accelerate's offload brings the weights in), and it
    calls the class's forward: the fused path never runs, which the first call names."""
    mlp = _mlp()
    x = torch.randn(2, 3, 16)
    ref = mlp(x)
    mlp._old_forward = mlp.forward

    def wrapper(*args, **kwargs):
        return mlp._old_forward(*args, **kwargs)

    mlp.forward = wrapper
    assert ffn_ext.patch_hf_model(mlp) == 1
    y, msgs, n = _run(mlp, x)
    _one(msgs, "forward wrapper", "wrapper")
    assert n == 0
    torch.testing.assert_close(y, ref)


class GatedWithScale(nn.Module):
    """A gated MLP whose forward takes an optional second input, which the fused forward does not."""

    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)
        self.act_fn = nn.SiLU()

    def forward(self, x, scale=None):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def test_an_input_it_does_not_take_warns():
    torch.manual_seed(0)
    mlp = GatedWithScale()
    x = torch.randn(3, 8)
    assert ffn_ext.patch_hf_model(mlp, extra_classes=[GatedWithScale]) == 1  # (the extra parameter is not read)
    _, msgs, n = _run(mlp, x)
    assert msgs == [] and n > 0
    y, msgs, n = _run(mlp, x, 2.0)
    _one(msgs, "called with inputs it does not take (Tensor, float", "GatedWithScale")
    assert n == 0
    torch.testing.assert_close(y, GatedWithScale.forward(mlp, x))


@pytest.mark.parametrize("opts", [dict(recompute=True), dict(token_chunk=2)])
def test_options_that_cannot_act_warn(opts):
    """recompute / token_chunk with a hooked projection: the projections run as modules around ffn_ext's activation
    op (which still runs), without the lean autograd the options act in; named with the projection."""
    mlp = _mlp()
    x = torch.randn(2, 3, 16)
    assert ffn_ext.patch_hf_model(mlp, **opts) == 1
    mlp.up_proj.register_forward_hook(lambda m, a, o: None)
    _, msgs, n = _run(mlp, x)
    what = "recompute=True" if "recompute" in opts else "token_chunk=2"
    _one(msgs, "(up_proj)", f"the {what} asked for does not act")
    assert n > 0  # the activation op
    # without options, hooked projections are not worth a warning: ffn_ext's activation op runs
    assert ffn_ext.patch_hf_model(mlp) == 0
    _, msgs, _ = _run(mlp, x)
    assert msgs == []


# ---------------------------------------------------------------- DeepSpeed ZeRO-3, simulated
@contextlib.contextmanager
def _fake_deepspeed(monkeypatch):
    """A `deepspeed` module with zero.GatheredParameters, and partition(p) that empties a parameter as ZeRO-3 does
    (ds_id set, its data an empty tensor until gathered)."""
    full: dict = {}

    def partition(p, ds_id):
        full[p] = p.data
        p.ds_id = ds_id
        p.data = torch.empty(0, dtype=p.dtype)

    @contextlib.contextmanager
    def gathered(params, modifier_rank=None):
        params = list(params)
        for p in params:
            p.data = full[p]
        try:
            yield
        finally:
            for p in params:
                p.data = torch.empty(0, dtype=p.dtype)

    ds = types.ModuleType("deepspeed")
    ds.zero = types.SimpleNamespace(GatheredParameters=gathered)
    monkeypatch.setitem(sys.modules, "deepspeed", ds)
    yield partition


def test_partitioned_weights_are_gathered_for_the_self_check(monkeypatch):
    """Built under deepspeed.zero.Init, the weights are empty until gathered: the self-check runs on them gathered
    (an MLP whose code is not the form still disagrees), and the patched MLP is a ZeRO-3 leaf."""
    with _fake_deepspeed(monkeypatch) as partition:
        mlp = _mlp()
        for i, p in enumerate(mlp.parameters()):
            partition(p, i)
        assert ffn_ext.patch_hf_model(mlp) == 1
        assert mlp._z3_leaf is True and mlp.gate_proj.weight.numel() == 0
        assert ffn_ext.hf.unpatch_model(mlp) == 1
        assert "_z3_leaf" not in vars(mlp)

        class Doubled(LlamaMLP):
            def forward(self, x):
                return 2 * self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

        torch.manual_seed(0)
        odd = Doubled(transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2))
        for i, p in enumerate(odd.parameters()):
            partition(p, i)
        with pytest.warns(RuntimeWarning, match="self-check"):
            assert ffn_ext.patch_hf_model(odd, extra_classes=[Doubled]) == 0


def test_an_error_in_the_self_check_is_named_as_an_error():
    """Weights that do not fit (what ZeRO-3's empty partitions gave before they were gathered): the module's own
    code raises, and the warning names that error, not a different result."""
    mlp = _mlp()
    with torch.no_grad():
        mlp.up_proj.weight = nn.Parameter(torch.randn(32, 15))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert ffn_ext.patch_hf_model(mlp, extra_classes=[LlamaMLP]) == 0
    msg = " ".join(str(w.message) for w in seen)
    assert "raised an error on the self-check's input" in msg and "(RuntimeError: mat1 and mat2" in msg
    assert "different result" not in msg


def test_patching_after_deepspeed_initialize_says_what_to_do():
    """deepspeed.initialize registered (ds_id on) every submodule, so their hooks keep the fused forward from
    running: the MLP is left unpatched and named, with what to do (patch before initialize)."""
    mlp = _mlp()
    for i, m in enumerate(mlp.modules()):
        m.ds_id = i
    with pytest.warns(RuntimeWarning, match=r"already hooked.*call ffn_ext.patch_hf_model\(model\) before deepspeed"):
        assert ffn_ext.patch_hf_model(mlp) == 0
    with pytest.raises(ValueError, match="already hooked"):
        ffn_ext.patch_hf_model(mlp, strict=True)


def test_the_leaf_flag_goes_with_the_patch():
    mlp = _mlp()
    assert ffn_ext.patch_hf_model(mlp) == 1
    assert vars(mlp)[forms.ZERO3_LEAF] is True
    assert ffn_ext.hf.unpatch_model(mlp) == 1 and forms.ZERO3_LEAF not in vars(mlp)
    mlp._z3_leaf = False  # the user's own setting is theirs
    assert ffn_ext.patch_hf_model(mlp) == 1 and ffn_ext.hf.unpatch_model(mlp) == 1
    assert vars(mlp)[forms.ZERO3_LEAF] is False
