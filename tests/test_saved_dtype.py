"""saved_dtype (ffn_ext.mlp): the projections kept for backward in FP8 with a scale per 1 x 128 group, or in bf16.
The forward's output is the default's, bit for bit; the gradients are within the cache's rounding of float64's
(and not the default's: the cache is what backward read); the saved bytes are half of bf16's (FP8: a quarter of
eager's four bf16 tensors) or of fp32's (bf16); a bad value or a combination that keeps nothing is a ValueError naming `saved_dtype`; the modules,
patch_hf_model and the experts implementation "ffn_ext" take it."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import ffn_ext
from ffn_ext import mlp

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
# relative error in norm of a gradient against float64's: FP8's 3-bit mantissa rounds each kept value by up to
# 1/16 (about 2.6% measured), bf16's by 1/256
TOL = {FP8: 0.08, BF16: 0.01}
# ... but the clamped SwiGLU's kept gate, within a rounding step of the limit, may fall on the other side of it, where
# its gradient is zero: with most inputs past the limit, x's gradient is 10% off (FP8; 2.4% within it: the 8%
# missed there) and 2.6% (bf16)
CLAMPED_TOL = {FP8: 0.12, BF16: 0.04}
D_MODEL, D_FF = 32, 256
ROWS = (24, mlp._SPLIT_ROWS + 100)  # one block; the blocked backward that writes its gradients into new buffers
CLAMPED = ffn_ext.Gating("swiglu_clamped", limit=7.0, alpha=1.702, up_offset=1.0, layout="interleaved")


def _weights(packed: bool, gen):
    n = 2 * D_FF if packed else D_FF
    w = [torch.randn(n, D_MODEL, generator=gen) / D_MODEL**0.5 for _ in range(1 if packed else 2)]
    return [*w, torch.randn(D_MODEL, D_FF, generator=gen) / D_FF**0.5]


def _gated_ref(act, packed):
    def ref(x, *w):
        if packed:
            g, u = (t.squeeze(-1) for t in F.linear(x, w[0]).unflatten(-1, (D_FF, 2)).split(1, -1))
        else:
            g, u = F.linear(x, w[0]), F.linear(x, w[1])
        if act == "silu":
            h = F.silu(g) * u
        elif act == "gelu_tanh":
            h = F.gelu(g, approximate="tanh") * u
        else:  # the clamped SwiGLU (GPT-OSS), interleaved
            g, u = g.clamp(max=7.0), u.clamp(-7.0, 7.0)
            h = g * torch.sigmoid(1.702 * g) * (u + 1.0)
        return F.linear(h, w[-1])

    return ref


def _plain_ref(x, w1, w2):
    return F.linear(F.gelu(F.linear(x, w1)), w2)


# (id, the call with its saved_dtype, the float64 reference, packed)
FORMS = {
    "swiglu": (lambda x, w, s: ffn_ext.swiglu_mlp(x, *w, saved_dtype=s), _gated_ref("silu", False), False),
    "geglu_tanh_packed": (
        lambda x, w, s: ffn_ext.geglu_mlp_packed(x, *w, approximate="tanh", saved_dtype=s),
        None,
        True,
    ),
    "clamped_interleaved": (
        lambda x, w, s: ffn_ext.gated_mlp_packed(x, *w, activation=CLAMPED, saved_dtype=s),
        _gated_ref("clamped", True),
        True,
    ),
    "plain": (lambda x, w, s: ffn_ext.plain_mlp(x, w[0], w[1], saved_dtype=s), _plain_ref, False),
    "plain_conv1d": (
        lambda x, w, s: ffn_ext.plain_mlp(x, w[0].t(), w[1].t(), saved_dtype=s, transposed=True),
        _plain_ref,
        False,
    ),
}


def _concat_ref(x, w, wd):  # geglu packed, concat layout: gate rows first
    g, u = F.linear(x, w).chunk(2, -1)
    return F.linear(F.gelu(g, approximate="tanh") * u, wd)


def _rel(a, b) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("saved", [FP8, BF16], ids=["fp8", "bf16"])
@pytest.mark.parametrize("form", list(FORMS))
def test_output_unchanged_and_gradients_within_the_caches_rounding(form, saved, rows):
    call, ref, packed = FORMS[form]
    ref = ref or _concat_ref
    gen = torch.Generator().manual_seed(rows)
    x = (4 * torch.randn(rows, D_MODEL, generator=gen)).requires_grad_()  # past the clamp's limit
    ws = [w.requires_grad_() for w in _weights(packed, gen)]
    if form.startswith("plain"):  # fc1, fc2
        ws = [ws[0], ws[2]]
    leaves = [x, *ws]
    dy = torch.randn(rows, D_MODEL, generator=gen)
    y0 = call(x, ws, None)
    want = torch.autograd.grad(y0, leaves, dy)
    y = call(x, ws, saved)
    assert torch.equal(y, y0)  # the forward's output is the default's, bit for bit
    got = torch.autograd.grad(y, leaves, dy)
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    exact = torch.autograd.grad(ref(*leaves64), leaves64, dy.double())
    for i, (g, g0, e) in enumerate(zip(got, want, exact)):
        assert _rel(g0, e) < 1e-5, i  # the default: fp32's rounding only
        err = _rel(g, e)
        assert err < (CLAMPED_TOL if form.startswith("clamped") else TOL)[saved], (i, err)
        assert err > 1e-5 * (1 if saved == FP8 else 0.1), (i, err)  # backward read the cache, not the projections


@pytest.mark.cuda
@pytest.mark.parametrize("saved", [BF16, FP8], ids=["bf16", "fp8"])  # bf16 first: the one the CUDA stand-in runs
def test_cuda(saved):
    dtype = torch.float32 if saved == BF16 else BF16
    rows = mlp._SPLIT_ROWS + 100
    gen = torch.Generator().manual_seed(5)
    leaves = [
        t.to("cuda", dtype).requires_grad_() for t in (torch.randn(rows, D_MODEL, generator=gen), *_weights(False, gen))
    ]
    dy = torch.randn(rows, D_MODEL, generator=gen).to("cuda", dtype)
    y0 = ffn_ext.swiglu_mlp(*leaves)
    y = ffn_ext.swiglu_mlp(*leaves, saved_dtype=saved)
    assert torch.equal(y, y0)
    got = torch.autograd.grad(y, leaves, dy)
    leaves64 = [t.detach().cpu().double().requires_grad_() for t in leaves]
    exact = torch.autograd.grad(_gated_ref("silu", False)(*leaves64), leaves64, dy.cpu().double())
    for i, (g, e) in enumerate(zip(got, exact)):
        assert _rel(g.cpu(), e) < TOL[saved] + (0.01 if dtype == BF16 else 0), i  # (+ bf16 compute's own rounding)


def _saved_bytes(fn):
    """The bytes autograd keeps for backward of fn() (saved tensors' storages, each once), less the leaves'."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y, leaves = fn()
    mine = {t.untyped_storage().data_ptr() for t in leaves}
    return sum(n for p, n in seen.items() if p not in mine), y


@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
@pytest.mark.parametrize("saved, dtype, ratio", [(FP8, BF16, 0.5), (BF16, torch.float32, 0.5)], ids=["fp8", "bf16"])
def test_saved_bytes(saved, dtype, ratio, packed):
    rows = 512
    gen = torch.Generator().manual_seed(0)
    ws = [w.to(dtype).requires_grad_() for w in _weights(packed, gen)]
    x = torch.randn(rows, D_MODEL, generator=gen, dtype=dtype, requires_grad=True)
    fn = ffn_ext.swiglu_mlp_packed if packed else ffn_ext.swiglu_mlp

    def run(s):
        return lambda: (fn(x, *ws, saved_dtype=s), (x, *ws))

    default, _ = _saved_bytes(run(None))
    kept, _ = _saved_bytes(run(saved))
    assert default == 2 * rows * D_FF * dtype.itemsize  # gate and up
    scales = 2 * rows * (D_FF // 128) * 4 if saved == FP8 else 0  # a float32 per group of 128
    assert kept == ratio * default + scales
    if saved == FP8:  # against eager's four bf16 [rows, d_ff] tensors (gate, up, act(gate), h): the 0.27x
        assert kept / (4 * rows * D_FF * 2) < 0.26


def test_retain_graph_and_create_graph():
    gen = torch.Generator().manual_seed(3)
    rows = mlp._SPLIT_ROWS + 7
    x = torch.randn(rows, D_MODEL, generator=gen, dtype=torch.float64, requires_grad=True)
    ws = [w.double().requires_grad_() for w in _weights(False, gen)]
    y = ffn_ext.swiglu_mlp(x, *ws, saved_dtype=FP8)
    first = torch.autograd.grad(y.sum(), (x, *ws), retain_graph=True)
    again = torch.autograd.grad(y.sum(), (x, *ws))  # the cache is never written over: the same gradients
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    # create_graph: gate and up are recomputed from x (functions of it), so the gradients are the default's
    y = ffn_ext.swiglu_mlp(x, *ws, saved_dtype=FP8)
    got = torch.autograd.grad(y.sum(), (x, *ws), create_graph=True)
    want = torch.autograd.grad(ffn_ext.swiglu_mlp(x, *ws).sum(), (x, *ws))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert got[0].requires_grad


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(saved_dtype=torch.float16), "`saved_dtype` must be None, torch.float8_e4m3fn or torch.bfloat16"),
        (dict(saved_dtype=torch.float8_e5m2), "`saved_dtype` must be"),
        (dict(saved_dtype="fp8"), "`saved_dtype` must be"),
        (dict(saved_dtype=FP8, recompute=True), "recompute=True and token_chunk keep none"),
        (dict(saved_dtype=BF16, token_chunk=8), "recompute=True and token_chunk keep none"),
    ],
)
def test_bad_saved_dtype_is_a_value_error(kwargs, match):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, D_MODEL, requires_grad=True)
    ws = _weights(False, gen)
    with pytest.raises(ValueError, match=f"ffn_ext.swiglu_mlp: .*{match}"):
        ffn_ext.swiglu_mlp(x, *ws, **kwargs)
    with pytest.raises(ValueError, match=f"ffn_ext.SwiGLUFFN: .*{match}"):
        ffn_ext.SwiGLUFFN(D_MODEL, D_FF, **kwargs)
    with pytest.raises(ValueError, match=f"ffn_ext.patch_model: .*{match}"):
        ffn_ext.patch_hf_model(torch.nn.Linear(2, 2), **kwargs)


def test_fp8_needs_a_group_that_divides_d_ff():
    x = torch.randn(4, 8, requires_grad=True)
    w = [torch.randn(40, 8), torch.randn(40, 8), torch.randn(8, 40)]
    with pytest.raises(ValueError, match="d_ff=40 is a multiple of none"):
        ffn_ext.swiglu_mlp(x, *w, saved_dtype=FP8)
    with pytest.raises(ValueError, match="ffn_ext.FFN: .*d_ff=40"):
        ffn_ext.FFN(8, 40, saved_dtype=FP8)
    ffn_ext.swiglu_mlp(x, *w, saved_dtype=BF16).sum().backward()  # bf16 has no groups
    y = ffn_ext.swiglu_mlp(x, torch.randn(96, 8), torch.randn(96, 8), torch.randn(8, 96), saved_dtype=FP8)
    y.sum().backward()  # groups of 32


@pytest.mark.parametrize("cls", [ffn_ext.SwiGLUFFN, ffn_ext.GeGLUFFN, ffn_ext.FFN])
def test_modules(cls):
    torch.manual_seed(0)
    m = cls(D_MODEL, D_FF, saved_dtype=FP8)
    assert m.saved_dtype == FP8 and "saved_dtype=torch.float8_e4m3fn" in repr(m)
    ref = copy.deepcopy(m)
    ref.saved_dtype = None  # an attribute: settable at any time
    x = torch.randn(3, 40, D_MODEL, requires_grad=True)
    y, y0 = m(x), ref(x)
    assert torch.equal(y, y0)
    dy = torch.randn_like(y)
    (g,) = torch.autograd.grad(y, x, dy)
    (g0,) = torch.autograd.grad(y0, x, dy)
    assert 1e-5 < _rel(g, g0.double()) < TOL[FP8]


transformers = pytest.importorskip("transformers")


def _tiny_llama():
    import hf_oracle

    torch.manual_seed(9)
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**hf_oracle.TINY_DECODER, hidden_size=32, intermediate_size=128)
    )


@pytest.mark.parametrize("saved", [FP8, BF16], ids=["fp8", "bf16"])
def test_patch_hf_model_takes_saved_dtype(saved):
    ref = _tiny_llama()
    model = copy.deepcopy(ref)
    assert ffn_ext.patch_hf_model(model, saved_dtype=saved) == 2
    ids = torch.randint(3, 97, (2, 13), generator=torch.Generator().manual_seed(1))
    losses = [m(ids, labels=ids).loss for m in (ref, model)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-6)  # the forward: eager's up to fp32 order
    for (n, p), p0 in zip(model.named_parameters(), ref.parameters()):
        if ".mlp." in n:
            assert _rel(p.grad, p0.grad.double()) < TOL[saved], n
    seen = [m.__dict__["_ffn_ext_mlp_options"] for m in model.modules() if type(m).__name__ == "LlamaMLP"]
    assert seen == [(False, None, saved)] * 2


def test_experts_implementation_takes_saved_dtype():
    import test_hf_moe_impl as impl

    impl.moe.register()
    model = impl._tiny("qwen3_moe", moe_intermediate_size=32).train()
    ref, _ = copy.deepcopy(model), None
    ref.set_experts_implementation("grouped_mm")
    model.set_experts_implementation("ffn_ext")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # patched and run by "ffn_ext": no warning
        ffn_ext.patch_hf_model(model, saved_dtype=FP8)
        with _Calls() as calls:
            out = model(impl.IDS, labels=impl.IDS)
    assert calls.ops.get("swiglu_cache") and "quantize" not in calls.ops, calls.ops  # one pass: h and the cache
    out0 = ref(impl.IDS, labels=impl.IDS)
    torch.testing.assert_close(out.logits, out0.logits, rtol=1e-4, atol=1e-4)
    with _Calls() as calls:
        out.loss.backward(retain_graph=True)
    assert calls.ops.get("swiglu_cached_backward"), calls.ops  # d_gate_up read from the cache inside the kernel
    out0.loss.backward()
    experts = [(n, p, p0) for (n, p), p0 in zip(model.named_parameters(), ref.parameters()) if ".experts." in n]
    assert experts
    for n, p, p0 in experts:
        assert 1e-5 < _rel(p.grad, p0.grad.double()) < TOL[FP8], n
    first = [p.grad.clone() for _, p, _ in experts]
    model.zero_grad()
    out.loss.backward()  # again: the cache is read, never written over
    for (n, p, _), g in zip(experts, first):
        assert torch.equal(p.grad, g), n
    # under another experts implementation, it does not act: named once
    model.set_experts_implementation("grouped_mm")
    with pytest.warns(RuntimeWarning, match="saved_dtype=torch.float8_e4m3fn asked for does not act"):
        model(impl.IDS)


def test_torch_compile():
    # compiled, the forward makes the projections whole (inductor plans the buffers) and keeps them as eager does
    torch.manual_seed(0)
    m = ffn_ext.SwiGLUFFN(D_MODEL, D_FF, saved_dtype=FP8)
    x = torch.randn(mlp._SPLIT_ROWS + 3, D_MODEL, requires_grad=True)
    y = torch.compile(m, backend="aot_eager", fullgraph=True)(x)
    torch.testing.assert_close(y, m(x), rtol=1e-6, atol=1e-6)
    (g,) = torch.autograd.grad(y.sum(), x)
    (g0,) = torch.autograd.grad(m(x).sum(), x)
    torch.testing.assert_close(g, g0, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("d_model", [D_MODEL, mlp._SPLIT_ROWS + 200], ids=["rows>d_model", "rows<d_model"])
def test_both_blocked_backwards(d_model):
    # from _SPLIT_ROWS rows the backward reads the cache in blocks: accumulating the weight gradients across them
    # where rows > d_model, else writing whole projections' gradients a block at a time; the same numbers either way
    rows = mlp._SPLIT_ROWS + 100
    gen = torch.Generator().manual_seed(7)
    leaves = [
        t.double().requires_grad_()
        for t in (
            torch.randn(rows, d_model, generator=gen),
            torch.randn(D_FF, d_model, generator=gen) / d_model**0.5,
            torch.randn(D_FF, d_model, generator=gen) / d_model**0.5,
            torch.randn(d_model, D_FF, generator=gen) / D_FF**0.5,
        )
    ]
    dy = torch.randn(rows, d_model, generator=gen, dtype=torch.float64)
    y = ffn_ext.swiglu_mlp(*leaves, saved_dtype=FP8)
    got = torch.autograd.grad(y, leaves, dy)
    # the same FP8 values, read whole: the small path's (one block below _SPLIT_ROWS rows, run on halves)
    halves = [ffn_ext.swiglu_mlp(leaves[0][s], *leaves[1:], saved_dtype=FP8) for s in (slice(0, 562), slice(562, None))]
    want = torch.autograd.grad(torch.cat(halves), leaves, dy)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9)
    exact = torch.autograd.grad(_gated_ref("silu", False)(*leaves), leaves, dy)
    for g, e in zip(got, exact):
        assert 1e-4 < _rel(g, e) < TOL[FP8]


class _Calls(TorchDispatchMode):
    """Counts the ffn_ext ops the dispatcher runs (with a mode active every op call takes the dispatcher)."""

    def __init__(self):
        super().__init__()
        self.ops: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if name.startswith("ffn_ext::"):
            self.ops[name[9:]] = self.ops.get(name[9:], 0) + 1
        return func(*args, **kwargs or {})


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("form", ["swiglu", "geglu_tanh_packed", "clamped_interleaved"])
def test_the_gated_ops_own_pass_writes_and_reads_the_fp8_cache(form, rows):
    # gate and up separate or packed "concat": <gated>_cache makes h and the FP8 cache in one pass and
    # <gated>_cached_backward reads it (d_gate, d_up and h in one pass, no recompute of h, no widened copy); the
    # interleaved layout quantizes with ffn_ext.quantize and reads the cache with PyTorch's ops
    call, _, packed = FORMS[form]
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(rows, D_MODEL, generator=gen, requires_grad=True)
    w = [t.requires_grad_() for t in _weights(packed, gen)]
    with _Calls() as calls:
        y = call(x, w, FP8)
        torch.autograd.grad(y.sum(), [x, *w])
    op = {"swiglu": "swiglu", "geglu_tanh_packed": "geglu_tanh"}.get(form)
    if op is None:
        assert calls.ops.get("quantize") and not any("cache" in k for k in calls.ops), calls.ops
        return
    assert calls.ops.get(op + "_cache") and calls.ops.get(op + "_cached_backward"), calls.ops
    assert "quantize" not in calls.ops and op not in calls.ops and op + "_backward" not in calls.ops, calls.ops
