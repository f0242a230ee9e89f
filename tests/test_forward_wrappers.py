"""Forward wrappers set on a module instance (accelerate's add_hook_to_module: device alignment, CPU/disk offload
whose weights live on the meta device until the wrapper runs) must run: SwiGLUFFN and patched HF MLPs then call
their submodules as modules, patch_model keeps a wrapper the MLP already had, and unpatch_model restores it."""

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ffn_ext


def add_hook(module, offload=False):
    """What accelerate's add_hook_to_module does to a module: keeps its forward as `_old_forward`, sets `_hf_hook`,
    and sets a wrapper as the instance's forward. offload=True: the module's own parameters move to the meta device
    and the wrapper brings the real ones in for the call (AlignDevicesHook(offload=True)); else the wrapper doubles
    the output, which shows whether it ran."""
    real = {}
    if offload:
        for name, p in list(module.named_parameters(recurse=False)):
            real[name] = p
            module._parameters[name] = nn.Parameter(p.detach().to("meta"), p.requires_grad)
    module._hf_hook, module._old_forward = object(), module.forward

    def new_forward(mod, *args, **kwargs):
        if not real:
            return 2 * mod._old_forward(*args, **kwargs)
        meta = dict(mod._parameters)
        mod._parameters.update(real)
        try:
            return mod._old_forward(*args, **kwargs)
        finally:
            mod._parameters.update(meta)

    module.forward = functools.update_wrapper(functools.partial(new_forward, module), module._old_forward)
    return module


@pytest.mark.parametrize("bias", [False, True])
def test_swiglu_ffn_runs_forward_wrappers(bias):
    torch.manual_seed(0)
    m = ffn_ext.SwiGLUFFN(8, 16, bias=bias)
    x = torch.randn(3, 8)
    ref = m(x)
    for lin in (m.gate_proj, m.up_proj, m.down_proj):
        add_hook(lin)
    torch.testing.assert_close(m(x), m.down_proj(F.silu(m.gate_proj(x)) * m.up_proj(x)), rtol=0, atol=0)
    add_hook(m.act)
    torch.testing.assert_close(m(x), m.down_proj(m.act(m.gate_proj(x), m.up_proj(x))), rtol=0, atol=0)

    # offloaded: the weights are on meta until each projection's wrapper runs
    torch.manual_seed(0)
    m = ffn_ext.SwiGLUFFN(8, 16, bias=bias)
    for lin in (m.gate_proj, m.up_proj, m.down_proj):
        add_hook(lin, offload=True)
    assert m.gate_proj.weight.is_meta
    torch.testing.assert_close(m(x), ref)


def test_swiglu_ffn_with_meta_weights_and_no_wrapper_raises():
    """Not loaded (meta) weights and a real input: an error, not the uninitialised memory F.linear returns."""
    m = ffn_ext.SwiGLUFFN(8, 16).to("meta")
    for grad in (True, False):
        with torch.set_grad_enabled(grad), pytest.raises(ValueError, match="gated_mlp: the weights are on the meta"):
            m(torch.randn(3, 8))
    assert m(torch.randn(3, 8, device="meta")).shape == (3, 8)  # all on meta: shape inference works
    w = torch.randn(16, 8)
    with pytest.raises(ValueError, match="swiglu_mlp_packed: the weights are on the meta device"):
        ffn_ext.swiglu_mlp_packed(torch.randn(3, 8), w.to("meta"), torch.randn(8, 8))


def _llama_mlp():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    return LlamaMLP(transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2))


@pytest.mark.parametrize("when", ["before", "after"])
def test_patched_mlp_with_offloaded_projections(when):
    """Offloaded projections (meta until their wrapper runs), offloaded before or after patching: the patched MLP
    calls them as modules and computes what the unpatched one did."""
    mlp = _llama_mlp()
    x = torch.randn(2, 3, 16)
    ref = mlp(x)
    if when == "after":
        assert ffn_ext.patch_hf_model(mlp) == 1
    for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        add_hook(lin, offload=True)
    if when == "before":
        assert ffn_ext.patch_hf_model(mlp) == 1  # meta weights: no self-check
    assert mlp.up_proj.weight.is_meta
    torch.testing.assert_close(mlp(x), ref)


def test_patch_keeps_the_wrapper_an_mlp_has_and_unpatch_restores_it():
    mlp = _llama_mlp()
    x = torch.randn(2, 3, 16)
    ref = mlp(x)
    wrapper = add_hook(mlp).forward
    assert ffn_ext.patch_hf_model(mlp) == 1
    assert vars(mlp)["forward"] is not wrapper
    torch.testing.assert_close(mlp(x), 2 * ref)  # the wrapper still runs
    assert ffn_ext.hf.unpatch_model(mlp) == 1
    assert vars(mlp)["forward"] is wrapper


def test_unpatch_under_a_wrapper_added_after_patching():
    """accelerate wraps the patched forward (keeping it as _old_forward): the wrapper runs the fused form, and
    unpatch_model takes the patched forward out from under the wrapper instead of dropping the wrapper."""
    mlp = _llama_mlp()
    x = torch.randn(2, 3, 16, requires_grad=True)
    ref = mlp(x)
    assert ffn_ext.patch_hf_model(mlp) == 1
    wrapper = add_hook(mlp).forward
    y = mlp._old_forward(x)
    assert "_GatedMLP" in type(y.grad_fn).__name__
    torch.testing.assert_close(mlp(x), 2 * y)
    assert ffn_ext.hf.unpatch_model(mlp) == 1
    assert vars(mlp)["forward"] is wrapper and not hasattr(mlp, "_ffn_ext_patched")
    assert "_GatedMLP" not in type(mlp._old_forward(x).grad_fn).__name__
    torch.testing.assert_close(mlp(x), 2 * ref)


def test_patched_mlp_runs_its_forward_when_the_activation_has_a_wrapper():
    mlp = _llama_mlp()
    x = torch.randn(2, 3, 16)
    assert ffn_ext.patch_hf_model(mlp) == 1
    add_hook(mlp.act_fn)
    torch.testing.assert_close(mlp(x), mlp.down_proj(2 * F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)))


def test_unpatch_leaves_a_patched_forward_it_cannot_take_out_with_a_warning():
    mlp = _llama_mlp()
    x = torch.randn(2, 3, 16)
    ref = mlp(x)
    assert ffn_ext.patch_hf_model(mlp) == 1
    patched = mlp.forward
    mlp.forward = lambda h: 2 * patched(h)  # a wrapper that does not keep it as _old_forward
    with pytest.warns(RuntimeWarning, match="LlamaMLP.*wrapped by something other than accelerate's hook"):
        assert ffn_ext.hf.unpatch_model(mlp) == 0
    torch.testing.assert_close(mlp(x), 2 * ref)
