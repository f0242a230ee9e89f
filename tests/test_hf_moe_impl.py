"""transformers' experts implementation "ffn_ext" (ffn_ext/hf/moe.py) on tiny random Qwen3-MoE, Mixtral and GPT-OSS
models (no downloads): the same logits and gradients as the eager experts, the ffn_ext path really taken, the
fallback to grouped_mm named once, fewer saved bytes than grouped_mm. Skips without transformers."""

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import ffn_ext
from ffn_ext.hf import common, moe

transformers = pytest.importorskip("transformers")
import hf_oracle  # noqa: E402
from hf_oracle import one_thread, raise_errors  # noqa: E402,F401  (autouse fixtures)
from test_hf_moe import BASE  # noqa: E402
from test_hf_moe import MODELS as _MOE_MODELS  # noqa: E402

tf_moe = pytest.importorskip("transformers.integrations.moe")
if not hasattr(tf_moe, "ExpertsInterface"):
    pytest.skip("this transformers has no ExpertsInterface", allow_module_level=True)

# the tiny configs of tests/test_hf_moe.py; GPT-OSS: clamped, interleaved gating, biases, transposed weights
MODELS = {k: v[:3] for k, v in _MOE_MODELS.items() if k in ("qwen3_moe", "mixtral", "gpt_oss")}
IDS = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(1))


@pytest.fixture(autouse=True, scope="module")
def _registered():
    assert moe.register()


def _tiny(kind, **extra):
    cfg_name, model_name, kw = MODELS[kind]
    config = getattr(transformers, cfg_name)(**{**BASE, **kw, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():  # expert weights 20x: GPT-OSS's projections well past its clamp limit
        for name, p in model.named_parameters():
            if ".mlp." in name:
                p.mul_(20)
            if ".experts." in name and name.endswith("_bias"):  # GPT-OSS's start at zero: they must count
                p.copy_(torch.randn(p.shape, generator=g))
    return model


def _experts(model):
    return [m for m in model.modules() if type(m).__name__.endswith("Experts")]


class Counts:
    """Counts the calls of moe._gating (one per experts module and forward on the ffn_ext path), of
    common.Gating (ffn_ext's gating: forward, and backward's recomputation) and of transformers'
    grouped_mm_experts_forward (the fallback)."""

    def __init__(self, monkeypatch):
        self.gating = self.fused = self.fallback = 0
        gating, fused, fallback = moe._gating, common.Gating.__call__, tf_moe.grouped_mm_experts_forward

        def count_gating(module):
            self.gating += 1
            return gating(module)

        def count_fused(*args, **kwargs):
            self.fused += 1
            return fused(*args, **kwargs)

        def count_fallback(*args):
            self.fallback += 1
            return fallback(*args)

        monkeypatch.setattr(moe, "_gating", count_gating)
        monkeypatch.setattr(common.Gating, "__call__", count_fused)
        monkeypatch.setattr(tf_moe, "grouped_mm_experts_forward", count_fallback)


def _against(model, monkeypatch, reference="eager"):
    """Switches model to the ffn_ext experts implementation (its experts planned); returns an unchanged copy that
    runs `reference`, and the call counts from here on."""
    ref = copy.deepcopy(model)
    ref.set_experts_implementation(reference)
    model.set_experts_implementation("ffn_ext")
    for m in _experts(model):
        moe._gating(m)  # its plan and self-check, once, before the counts start
    return ref, Counts(monkeypatch)


@pytest.mark.parametrize("kind", list(MODELS))
def test_patched_experts_run_the_ffn_ext_implementation(kind, monkeypatch):
    """patch_hf_model first, then experts_implementation="ffn_ext": the experts run ffn_ext's (its gating from the
    patch's own plan: recognising the patched instance again would see the patch and refuse), not grouped_mm."""
    model = _tiny(kind)
    ref = copy.deepcopy(model)
    assert ffn_ext.patch_hf_model(model) >= 2
    model.set_experts_implementation("ffn_ext")
    counts = Counts(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        logits = model(IDS).logits
    assert counts.fallback == 0 and counts.gating == len(_experts(model)) == 2
    torch.testing.assert_close(logits, ref(IDS).logits, atol=1e-4, rtol=1e-4)


def test_register_is_idempotent():
    assert moe.register() and moe.register()
    assert tf_moe.ExpertsInterface._global_mapping["ffn_ext"] is moe.ffn_ext_experts_forward
    assert "ffn_ext" in tf_moe.ALL_EXPERTS_FUNCTIONS


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "loop"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_matches_eager(kind, grouped, monkeypatch):
    """fp32 logits and every parameter's gradient (the router's through the routing weights) equal the eager
    experts'; each experts module ran ffn_ext's gating once forward and once backward, never the fallback. `loop`:
    the per-expert loop that stands in where grouped_mm cannot serve."""
    if not grouped:
        monkeypatch.setattr(moe, "_can_group", lambda *t: False)
    model = _tiny(kind)
    ref, counts = _against(model, monkeypatch)
    n = len(_experts(model))
    assert n == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        logits = model(IDS).logits
    assert (counts.gating, counts.fused, counts.fallback) == (n, n, 0)
    logits0 = ref(IDS).logits
    torch.testing.assert_close(logits, logits0, atol=1e-4, rtol=1e-4)
    w = torch.randn_like(logits)
    (logits * w).sum().backward()
    (logits0 * w).sum().backward()
    assert counts.fused == 2 * n
    hf_oracle.grads_equal(model, ref, atol=1e-4)
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, logits0, atol=1e-4, rtol=1e-4)
    with torch.inference_mode():
        torch.testing.assert_close(model(IDS).logits, logits0, atol=1e-4, rtol=1e-4)
    assert (counts.gating, counts.fallback) == (3 * n, 0)


def test_from_pretrained_and_config(tmp_path, monkeypatch):
    """from_pretrained(..., experts_implementation="ffn_ext") and a config's _experts_implementation reach it."""
    model = _tiny("mixtral")
    model.save_pretrained(tmp_path)
    counts = Counts(monkeypatch)
    # use_kernels=False: transformers 5.25 kernelizes by default and then needs the `kernels` package
    loaded = transformers.MixtralForCausalLM.from_pretrained(
        tmp_path, experts_implementation="ffn_ext", use_kernels=False
    ).eval()
    assert loaded.config._experts_implementation == "ffn_ext"
    with torch.no_grad():
        loaded(IDS)
    assert counts.gating == 2
    config = copy.deepcopy(model.config)
    config._experts_implementation = "ffn_ext"
    with torch.no_grad():
        transformers.MixtralForCausalLM(config).eval()(IDS)
    assert counts.gating == 4 and counts.fallback == 0


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_bf16(kind, monkeypatch):
    """bf16 on the CPU: forward and backward run, close to grouped_mm's (both bf16 GEMMs, other rounding)."""
    model = _tiny(kind).to(torch.bfloat16)
    ref, counts = _against(model, monkeypatch, "grouped_mm")
    logits, logits0 = model(IDS).logits, ref(IDS).logits
    assert logits.dtype == torch.bfloat16 and counts.gating == 2
    scale = float(logits0.detach().abs().max())
    torch.testing.assert_close(logits.float(), logits0.float(), atol=0.05 * scale, rtol=0.05)
    logits.float().sum().backward()
    logits0.float().sum().backward()
    grads = {n: p.grad for n, p in ref.named_parameters()}
    for name, p in model.named_parameters():
        if ".experts." in name:
            assert p.grad is not None and p.grad.dtype == torch.bfloat16, name
            g0 = grads[name].float()
            assert (p.grad.float() - g0).norm() <= 0.05 * g0.norm() + 1e-3, name


@pytest.mark.parametrize("why", ["gating", "expert_parallel"])
def test_fallback_warns_once_and_matches(why, monkeypatch):
    """A gating ffn_ext does not compute (an activation no table entry can be) or expert parallelism: transformers'
    grouped_mm runs, with one RuntimeWarning naming the class and the reason, whatever the number of modules and
    calls."""
    monkeypatch.setattr(moe, "_warned", set())
    model = _tiny("qwen3_moe", **({"hidden_act": hf_oracle.not_an_activation(monkeypatch)} if why == "gating" else {}))
    if why == "expert_parallel":
        for m in _experts(model):
            m._is_expert_parallel = True
    ref, counts = _against(model, monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logits = model(IDS).logits
        model(IDS)
    ours = [w for w in caught if "ffn_ext experts implementation" in str(w.message)]
    assert len(ours) == 1 and ours[0].category is RuntimeWarning
    assert "Qwen3MoeExperts" in str(ours[0].message)
    assert ("gating" if why == "gating" else "expert parallelism") in str(ours[0].message)
    assert counts.fallback == 4 and counts.fused == 0
    logits0 = ref(IDS).logits
    torch.testing.assert_close(logits, logits0, atol=1e-4, rtol=1e-4)
    w = torch.randn_like(logits)
    (logits * w).sum().backward()
    (logits0 * w).sum().backward()
    hf_oracle.grads_equal(model, ref, atol=1e-4)


def test_a_gating_the_self_check_refuses_falls_back(monkeypatch):
    """The experts implementation runs ffn_ext's gating only where patch_model would (forms.plan): with ffn_ext's
    op made 1% off where the self-check sees it, the check disagrees, and transformers' grouped_mm runs, named
    once; logits equal eager's."""
    monkeypatch.setattr(moe, "_warned", set())
    real = common.Gating.__call__
    monkeypatch.setattr(common.Gating, "__call__", lambda *a: real(*a) * 1.01)
    model = _tiny("qwen3_moe")
    ref, counts = _against(model, monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logits = model(IDS).logits
    ours = [str(w.message) for w in caught if "ffn_ext experts implementation" in str(w.message)]
    assert len(ours) == 1 and "Qwen3MoeExperts" in ours[0], ours
    assert counts.fused == 0 and counts.fallback == 2
    torch.testing.assert_close(logits, ref(IDS).logits, atol=1e-4, rtol=1e-4)


def _experts_call(kind, impl, tokens=24, **extra):
    """An experts module of `kind` with `impl`, its inputs (requiring grad: the layer's input and the router's
    weights train), and the call."""
    model = _tiny(kind, **extra)
    experts = _experts(model)[0]
    experts.config._experts_implementation = impl
    g = torch.Generator().manual_seed(2)
    hidden = experts.gate_up_proj.shape[-1 if not experts.is_transposed else -2]
    x = torch.randn(tokens, hidden, generator=g).requires_grad_()
    k = model.config.num_experts_per_tok
    index = torch.rand(tokens, experts.gate_up_proj.shape[0], generator=g).topk(k, dim=-1).indices
    weights = torch.rand(tokens, k, generator=g).softmax(-1).requires_grad_()
    return experts, (x, index, weights)


def _saved_bytes(module, args) -> int:
    """Bytes autograd keeps for backward of module(*args): unique storages of the saved tensors, parameters not
    counted."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(*args)
    return sum(storages.values())


@pytest.mark.parametrize("kind", list(MODELS))
def test_saved_bytes_below_grouped_mm(kind):
    """ffn_ext keeps the layer's input [T, H], the [S, 2I] projection and [S]-sized indices and weights; grouped_mm
    more (the sorted input [S, H], act(gate) and up or the gating's output, the down projection's output)."""
    experts, args = _experts_call(kind, "ffn_ext")
    ours = _saved_bytes(experts, args)
    experts.config._experts_implementation = "grouped_mm"
    theirs = _saved_bytes(experts, args)
    tokens, hidden = args[0].shape
    rows = args[1].numel()
    two_i = experts.gate_up_proj.shape[-2 if not experts.is_transposed else -1]
    assert ours <= 4 * (tokens * hidden + rows * two_i) + 32 * rows + 64 * experts.gate_up_proj.shape[0]
    assert ours < theirs, (ours, theirs)


def test_post_expert_norm_and_bias_grads_match_grouped_mm():
    """has_post_expert_norm (the norm outside the lean Function, the routing weights after it): output and the
    gradients of the input, the routing weights, the weights and the norm equal transformers' grouped_mm's."""
    experts, (x, index, weights) = _experts_call("qwen3_moe", "grouped_mm")
    experts.has_post_expert_norm = True
    torch.manual_seed(3)
    experts.post_expert_norm = nn.LayerNorm(x.shape[-1])
    nn.init.normal_(experts.post_expert_norm.weight)
    ref = copy.deepcopy(experts)
    experts.config = copy.copy(experts.config)
    experts.config._experts_implementation = "ffn_ext"
    out = experts(x, index, weights)
    x0, w0 = x.detach().clone().requires_grad_(), weights.detach().clone().requires_grad_()
    out0 = ref(x0, index, w0)
    torch.testing.assert_close(out, out0, atol=1e-4, rtol=1e-4)
    g = torch.randn_like(out)
    (out * g).sum().backward()
    (out0 * g).sum().backward()
    torch.testing.assert_close(x.grad, x0.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(weights.grad, w0.grad, atol=1e-4, rtol=1e-4)
    hf_oracle.grads_equal(experts, ref, atol=1e-4)


@pytest.mark.parametrize("kind", list(MODELS))
def test_retain_graph_second_backward_is_right(kind):
    """The backward writes d_gate_up over the gate_up it saved; under retain_graph=True a second backward recomputes
    gate_up from the layer's input (the first spent it) and gives grouped_mm's gradients again, for a new output
    gradient each time."""
    experts, (x, index, weights) = _experts_call(kind, "ffn_ext")
    ref = copy.deepcopy(experts)
    ref.config = copy.copy(ref.config)
    ref.config._experts_implementation = "grouped_mm"
    x0, w0 = x.detach().clone().requires_grad_(), weights.detach().clone().requires_grad_()
    out, out0 = experts(x, index, weights), ref(x0, index, w0)
    params, params0 = list(experts.parameters()), list(ref.parameters())
    for _ in range(2):
        g = torch.randn_like(out)
        got = torch.autograd.grad(out, [x, weights, *params], g, retain_graph=True)
        want = torch.autograd.grad(out0, [x0, w0, *params0], g, retain_graph=True)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", list(MODELS))
def test_backward_holds_no_sorted_gradient_nor_spent_gate_up(kind):
    """The sum over top_k is inside the experts' Function, which gathers the sorted rows' gradient from the tokens'
    [T, H] itself and drops it before the gating's backward (autograd's index backward would make an [S, H] one and
    hold it through the whole backward); the saved [S, 2I] gate_up that the backward writes d_gate_up over is freed
    once used, before the input's gradient is made. The gradients are grouped_mm's."""
    experts, (x, index, weights) = _experts_call(kind, "ffn_ext")
    ref = copy.deepcopy(experts)
    ref.config = copy.copy(ref.config)
    ref.config._experts_implementation = "grouped_mm"
    saved = []  # the saved [S, 2I] projection's storage (the pack hook's reference keeps the object alive)

    def pack(t):
        if t.dim() == 2 and t.shape[0] == index.numel() and t.is_floating_point():
            saved.append(t.untyped_storage())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = experts(x, index, weights)
    assert type(out.grad_fn).__name__ == "_ExpertsBackward" and out.shape == x.shape
    assert len(saved) == 1 and saved[0].nbytes() > 0
    x0, w0 = x.detach().clone().requires_grad_(), weights.detach().clone().requires_grad_()
    out0 = ref(x0, index, w0)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, weights, *experts.parameters()], g)
    assert saved[0].nbytes() == 0
    want = torch.autograd.grad(out0, [x0, w0, *ref.parameters()], g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
