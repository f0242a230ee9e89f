"""ffn_ext.torchtitan: the model converter (torchtitan 0.3's ModelConfigConverter) that swaps torchtitan's
FeedForward and GroupedExperts for ffn_ext's. Without torchtitan: the module imports and its names say what they
need. With it: the converter on the llama3 and qwen3 debug models' configs, a few AdamW steps of the llama3
debugmodel converted and not (fp32: the losses and weights as tests/test_training.py compares them), the experts
module by module against torchtitan's (bf16 compute, as torchtitan's experts) and a float64 reference, the
options, the fallback under hooks, and the subclasses named. torchtitan's FlexAttention has no backward on the CPU,
so the debug model trains here with torchtitan's SDPA attention in its place (the FFNs are what is tested).

torchtitan is not in CI's requirements: these tests skip there (install: pip install --no-deps torchtitan==0.3.0
spmd_types==0.2.3 tyro docstring-parser typeguard)."""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch
from hf_oracle import one_thread  # noqa: F401  (an autouse fixture: tiny tensors, one thread)
from optable import RecordOps

import ffn_ext.torchtitan as fft


def test_imports_without_torchtitan_and_says_what_it_needs(monkeypatch):
    """`import ffn_ext.torchtitan` never imports torchtitan; its classes, made on first use, raise an ImportError
    that names torchtitan when it is missing."""
    monkeypatch.setattr(fft, "_classes", {})
    for name in [m for m in sys.modules if m == "torchtitan" or m.startswith("torchtitan.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchtitan", None)  # import torchtitan -> ImportError
    with pytest.raises(ImportError, match="torchtitan"):
        fft.FFNExtConverter  # noqa: B018
    with pytest.raises(AttributeError):
        fft.NotAThing  # noqa: B018


try:
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.common.feed_forward import FeedForward, SigmoidGatedFeedForward
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import GroupedExperts

    MISSING = ""
except ImportError as e:  # the test above runs without it
    MISSING = str(e)
needs_titan = pytest.mark.skipif(bool(MISSING), reason=f"torchtitan (0.3) is not installed: {MISSING}")
K, LR = 3, 1e-3


def _llama3(converters=None):
    from torchtitan.models.llama3 import model_registry

    cfg = model_registry("debugmodel", converters=converters).model
    for _, _, parent, attr in list(cfg.traverse(FlexAttention.Config)):  # no FlexAttention backward on the CPU
        if isinstance(parent, list):
            parent[attr] = ScaledDotProductAttention.Config()
        else:
            setattr(parent, attr, ScaledDotProductAttention.Config())
    return cfg


def _configs(cfg, kind):
    return [c for _, c, _, _ in cfg.traverse(kind)]


@needs_titan
def test_converter_swaps_the_llama3_debugmodel_feed_forwards():
    cfg = _llama3([fft.FFNExtConverter.Config(recompute=True, token_chunk=5)])
    ffns = _configs(cfg, FeedForward.Config)
    assert len(ffns) == 6 and all(type(c) is fft.FFNExtFeedForward.Config for c in ffns)
    assert all(c.recompute and c.token_chunk == 5 for c in ffns)
    model, ref = cfg.build(), _llama3().build()
    assert sum(isinstance(m, fft.FFNExtFeedForward) for m in model.modules()) == 6
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in ref.state_dict().items()}
    # a second conversion changes the options only
    again = fft.FFNExtConverter(fft.FFNExtConverter.Config(token_chunk=None)).convert(cfg)
    assert all(
        type(c) is fft.FFNExtFeedForward.Config and c.token_chunk is None for c in _configs(again, FeedForward.Config)
    )


@needs_titan
def test_converter_swaps_the_qwen3_moe_debugmodel_experts():
    from torchtitan.models.qwen3 import model_registry

    cfg = model_registry("debugmodel_moe", converters=[fft.FFNExtConverter.Config()]).model
    experts = _configs(cfg, GroupedExperts.Config)
    assert len(experts) == 8 and all(type(c) is fft.FFNExtGroupedExperts.Config for c in experts)
    off = model_registry("debugmodel_moe", converters=[fft.FFNExtConverter.Config(grouped_experts=False)]).model
    assert all(type(c) is GroupedExperts.Config for c in _configs(off, GroupedExperts.Config))


@needs_titan
def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="token_chunk"):
        fft.FFNExtConverter(fft.FFNExtConverter.Config(token_chunk=0))


@needs_titan
def test_subclasses_are_named_and_left_alone():
    lin = lambda i, o: Linear.Config(in_features=i, out_features=o)  # noqa: E731
    cfg = SigmoidGatedFeedForward.Config(w1=lin(8, 16), w2=lin(16, 8), w3=lin(8, 16), gate=lin(8, 8))
    with pytest.warns(RuntimeWarning, match="SigmoidGatedFeedForward"):
        out = fft.FFNExtConverter(fft.FFNExtConverter.Config()).convert(cfg)
    assert out is cfg and type(out) is SigmoidGatedFeedForward.Config


def _distance(a, b, start, name):
    den = float((b[name] - start[name]).norm())
    return float((a[name] - b[name]).norm()) / den if den else float((a[name] - b[name]).norm())


@needs_titan
@pytest.mark.parametrize("opts", [{}, dict(recompute=True), dict(token_chunk=7)], ids=["default", "recompute", "chunk"])
def test_llama3_debugmodel_trains_as_torchtitans(opts):
    """K AdamW steps of the debug model converted and not, from the same weights on the same batches: the losses
    within 1e-6 relative, each weight tensor within 1e-3 of the distance it moved (tests/test_training.py says why
    a distance); ffn_ext's SwiGLU ran forward and backward."""
    ref = _llama3().build()
    ref.init_states(buffer_device=torch.device("cpu"))
    model = _llama3([fft.FFNExtConverter.Config(**opts)]).build()
    model.load_state_dict(ref.state_dict())
    start = {k: v.clone() for k, v in ref.state_dict().items()}
    batches = torch.randint(0, 2048, (K, 2, 24))

    def train(m, record=None):
        opt = torch.optim.AdamW(m.parameters(), lr=LR)
        losses = []
        for i, ids in enumerate(batches):
            with record if record is not None and i == 0 else contextlib.nullcontext():
                logits = m(ids)
                loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, {k: v.detach().clone() for k, v in m.state_dict().items()}

    rec = RecordOps()
    losses, weights = train(model, rec)
    assert {"ffn_ext.swiglu.default", "ffn_ext.swiglu_backward.default"} <= set(rec.ops)
    losses0, weights0 = train(ref)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(losses0), rtol=1e-6, atol=0)
    far = {
        n: d
        for n in weights0
        if weights0[n].is_floating_point() and (d := _distance(weights, weights0, start, n)) > 1e-3
    }
    assert not far, far


@needs_titan
def test_a_hooked_projection_runs_as_a_module():
    """Under a hook on a projection (as tensor parallelism's), FFNExtFeedForward runs its projections as modules
    around ffn_ext.swiglu: the hook fires and the result is the FeedForward's."""
    lin = lambda i, o: Linear.Config(in_features=i, out_features=o)  # noqa: E731
    cfg = dict(w1=lin(16, 40), w2=lin(40, 16), w3=lin(16, 40))
    ref = FeedForward.Config(**cfg).build()
    ffn = fft.FFNExtFeedForward.Config(**cfg).build()
    ffn.load_state_dict(ref.state_dict())
    fired = []
    ffn.w1.register_forward_hook(lambda *a: fired.append(1))
    x = torch.randn(5, 16)
    torch.testing.assert_close(ffn(x), ref(x), rtol=1e-5, atol=1e-6)
    assert fired == [1]


def _experts_pair(E=4, D=16, F=24):
    cfg = dict(dim=D, hidden_dim=F, num_experts=E)
    ref = GroupedExperts.Config(**cfg).build()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, D**-0.5)
    ffn = fft.FFNExtGroupedExperts.Config(**cfg).build()
    ffn.load_state_dict(ref.state_dict())
    return ffn, ref


def _experts_f64(mod, x, counts):
    """The experts' output in float64 from the bf16-rounded inputs and weights torchtitan's experts compute on."""
    r = lambda t: t.detach().bfloat16().double()  # noqa: E731
    out, start = [], 0
    for e, n in enumerate(counts.tolist()):
        xe = r(x[start : start + n])
        h = torch.nn.functional.silu(xe @ r(mod.w1_EFD[e]).T) * (xe @ r(mod.w3_EFD[e]).T)
        out.append(h @ r(mod.w2_EDF[e]).T)
        start += n
    return torch.cat(out)


@needs_titan
def test_grouped_experts_match_torchtitans():
    """Routed tokens through FFNExtGroupedExperts and torchtitan's GroupedExperts (the same weights; bf16 compute as
    torchtitan's): outputs and gradients within bf16 rounding of each other, and ffn_ext's output no farther from a
    float64 reference than torchtitan's (plus an ulp); ffn_ext's SwiGLU ran forward and backward."""
    ffn, ref = _experts_pair()
    counts = torch.tensor([5, 0, 9, 3])  # an expert with no token too
    x = torch.randn(int(counts.sum()), 16, requires_grad=True)
    x0 = x.detach().clone().requires_grad_()
    with RecordOps() as rec:
        y = ffn(x, counts)
        w = torch.randn_like(y)
        (y * w).sum().backward()
    assert {"ffn_ext.swiglu.default", "ffn_ext.swiglu_backward.default"} <= set(rec.ops)
    y0 = ref(x0, counts)
    (y0 * w).sum().backward()
    want = _experts_f64(ref, x0, counts)
    err, err0 = (y.double() - want).abs().max(), (y0.double() - want).abs().max()
    assert err <= err0 + 2**-8 * want.abs().max(), (err, err0)
    tol = dict(rtol=2**-6, atol=2**-6)
    torch.testing.assert_close(y, y0, **tol)
    torch.testing.assert_close(x.grad, x0.grad, **tol)
    for (name, p), p0 in zip(ffn.named_parameters(), ref.parameters()):
        scale = max(1.0, float(p0.grad.abs().max()))
        torch.testing.assert_close(p.grad, p0.grad, rtol=2**-6, atol=2**-6 * scale, msg=name)
