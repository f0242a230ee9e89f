"""The classic FFN, fc2(act(fc1(x))): ffn_ext.plain_mlp's lean autograd (saves x and fc1's output z only,
recomputes act(z) in backward), its memory options (recompute, token_chunk), GPT-2's Conv1D layout, and ffn_ext.FFN
on it; every activation of the table, against the eager formula with the entry's ATen expression in float64. The
compositions (double backward, compile, autocast, checkpoint, torch.func, jit.trace) as the gated MLP's."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_ffn_layer import OPTIONS as GATED_OPTIONS
from test_ffn_layer import _Largest, _saved
from test_modules import _LiveBytes

import ffn_ext
import ffn_ext.mlp as M
from ffn_ext.table import ACTIVATIONS

ACTS = [pytest.param(a, id=a.name) for a in ACTIVATIONS]
LAYOUTS = [pytest.param(False, id="linear"), pytest.param(True, id="conv1d")]
OPTIONS = [pytest.param(False, None, id="default"), *GATED_OPTIONS]  # (recompute, token_chunk) on 74 tokens


def _weights(d_model, d_ff, bias, transposed, dtype=torch.float64, scale=0.3):
    """(w_fc1, w_fc2, b_fc1, b_fc2): leaves that require grad, in nn.Linear or (transposed) Conv1D layout."""

    def leaf(*shape):
        return (torch.randn(*shape, dtype=dtype) * scale).requires_grad_()

    w1, w2 = (leaf(d_model, d_ff), leaf(d_ff, d_model)) if transposed else (leaf(d_ff, d_model), leaf(d_model, d_ff))
    return w1, w2, leaf(d_ff) if bias else None, leaf(d_model) if bias else None


def _eager(act, w1, w2, b1, b2, transposed):
    """The eager MLP: what nn.Linear / GPT-2's Conv1D and the activation's ATen function compute."""
    if transposed:

        def lin(t, w, b):
            y = t.matmul(w)
            return y if b is None else y + b

        return lambda x: lin(act.aten(lin(x, w1, b1)), w2, b2)
    return lambda x: F.linear(act.aten(F.linear(x, w1, b1)), w2, b2)


def _ours(act, w1, w2, b1, b2, transposed, **opts):
    return lambda x: ffn_ext.plain_mlp(x, w1, w2, b1, b2, activation=act.name, transposed=transposed, **opts)


def _leaves(x, *ts):
    return [t for t in (x, *ts) if t is not None]


@pytest.mark.parametrize("recompute,chunk", OPTIONS)
@pytest.mark.parametrize("transposed", LAYOUTS)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("act", ACTS)
def test_plain_mlp_matches_eager_fp64(act, bias, transposed, recompute, chunk):
    ps = _weights(12, 20, bias, transposed)
    x = torch.randn(2, 37, 12, dtype=torch.float64, requires_grad=True)
    gy = torch.randn(2, 37, 12, dtype=torch.float64)
    leaves = _leaves(x, *ps)
    y0 = _eager(act, *ps, transposed)(x)
    g0 = torch.autograd.grad(y0, leaves, gy)
    y = _ours(act, *ps, transposed, recompute=recompute, token_chunk=chunk)(x)
    assert type(y.grad_fn).__name__ == "_PlainMLPBackward"
    g = torch.autograd.grad(y, leaves, gy)
    torch.testing.assert_close(y, y0, rtol=1e-12, atol=1e-12)
    for a, b, t in zip(g, g0, leaves):
        assert a.shape == t.shape and a.is_contiguous()
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    with torch.no_grad():  # the plain path (inference), chunked too
        torch.testing.assert_close(_ours(act, *ps, transposed, token_chunk=chunk)(x), y0, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("transposed", LAYOUTS)
def test_backward_over_row_blocks_matches_one_block(monkeypatch, transposed):
    """The default backward runs over blocks of mlp._PLAIN_BLOCK_ROWS rows (here 8, on 37 rows: a short last block);
    partial requires_grad: only what is wanted is computed."""
    act = ACTIVATIONS[0]
    ps = _weights(6, 10, True, transposed)
    x = torch.randn(37, 6, dtype=torch.float64, requires_grad=True)
    gy = torch.randn(37, 6, dtype=torch.float64)
    want = torch.autograd.grad(_eager(act, *ps, transposed)(x), _leaves(x, *ps), gy)
    monkeypatch.setattr(M, "_PLAIN_BLOCK_ROWS", 8)
    got = torch.autograd.grad(_ours(act, *ps, transposed)(x), _leaves(x, *ps), gy)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for k in range(len(ps)):  # one leaf at a time: x only, w_fc1 only, ...
        (g,) = torch.autograd.grad(_ours(act, *ps, transposed)(x), [ps[k]], gy)
        torch.testing.assert_close(g, want[1 + k], rtol=1e-12, atol=1e-12)


def _big(shapes, tokens, d_ff):
    return [s for s in shapes if math.prod(s) >= tokens * d_ff]  # the weights have far fewer elements


@pytest.mark.parametrize("transposed", LAYOUTS)
@pytest.mark.parametrize("act", ACTS)
def test_saves_one_tokens_by_dff_tensor_eager_two(act, transposed):
    """saved_tensors_hooks: the lean autograd saves 1 [tokens, d_ff] tensor (z), 0 with recompute or token_chunk;
    eager autograd saves 2 (z and act(z)), so the count can fail."""
    tokens, d_model, d_ff = 74, 12, 20
    ps = _weights(d_model, d_ff, True, transposed)
    x = torch.randn(2, 37, d_model, dtype=torch.float64, requires_grad=True)
    shapes, y = _saved(_ours(act, *ps, transposed), x)
    assert _big(shapes, tokens, d_ff) == [(2, 37, d_ff)], shapes
    y.sum().backward()
    eager, _ = _saved(_eager(act, *ps, transposed), x)
    # eager (the entry's eager form) keeps z and act(z) with a one-op activation whose backward reads its input
    # (gelu, silu: 2), only act(z) with relu (its backward reads its output, also fc2's input: 1, no saving there),
    # more with a composite form (relu2's square(relu(z)), quick_gelu's z * sigmoid(1.702 z))
    assert len(_big(eager, tokens, d_ff)) >= 1, eager
    for opts in ({"recompute": True}, {"token_chunk": 8}):
        shapes, y = _saved(_ours(act, *ps, transposed, **opts), x)
        assert _big(shapes, tokens, d_ff) == [], (opts, shapes)
        assert (2, 37, d_model) in shapes  # x: what backward recomputes from
        y.sum().backward()


@pytest.mark.parametrize("act", ACTS)
def test_token_chunk_bounds_every_tensor_inside_the_mlp(act):
    """No op inside the MLP makes a tensor of more than N x d_ff elements with token_chunk=N, forward and backward,
    training and inference; the default path does (so this can fail)."""
    tokens, d_model, d_ff, n = 96, 8, 48, 8
    ps = _weights(d_model, d_ff, True, False, dtype=torch.float32)
    x = torch.randn(tokens, d_model, requires_grad=True)
    for chunk in (None, n):
        fn = _ours(act, *ps, False, token_chunk=chunk)
        with _Largest(d_model, d_ff) as train:
            torch.autograd.grad(fn(x), _leaves(x, *ps), torch.randn(tokens, d_model))
        with torch.no_grad(), _Largest(d_model, d_ff) as infer:
            fn(x)
        if chunk is None:
            assert train.largest >= tokens * d_ff and infer.largest >= tokens * d_ff
        else:
            assert train.largest <= n * d_ff and infer.largest <= n * d_ff, (train.largest, infer.largest)


def _fwd_bwd_peak(fn, x, params, g):
    """Peak bytes of the storages forward + backward create (what they save, their temporaries, y and the gradients;
    views of x, g and the parameters are not new memory): the dispatch-mode counter of tests/test_modules.py and
    bench_ffn's CPU peak."""
    live = _LiveBytes()
    live.ptrs.update(t.untyped_storage().data_ptr() for t in (x, g, *params))
    with live:
        grads = torch.autograd.grad(fn(x), [x, *params], g)
    del grads
    return live.peak


def test_peak_memory_at_4096_tokens_below_three_quarters_of_eager():
    """Peak memory of forward + backward, BERT-base/GPT-2's 768 -> 3072 at 4096 tokens, GELU, with biases: <= 0.75x
    eager autograd's (z, y, dx, the weight gradients and one 512-row block's three temporaries, against eager's z,
    act(z), d act(z), y and dW2, 3.2 [tokens, d_ff] tensors); recompute no higher (from mlp._SPLIT_ROWS rows the
    forward makes act(z) in blocks and the backward works in 512-row blocks: all three peak alike, at the gradients
    and a block) and token_chunk no higher."""
    tokens, d_model, d_ff = 4096, 768, 3072
    act = ACTIVATIONS[0]
    w1, w2, b1, b2 = _weights(d_model, d_ff, True, False, dtype=torch.float32, scale=0.03)
    params = [w1, w2, b1, b2]
    x = torch.randn(tokens, d_model, requires_grad=True)
    g = torch.randn(tokens, d_model)
    eager = _fwd_bwd_peak(_eager(act, *params, False), x, params, g)
    ours = _fwd_bwd_peak(_ours(act, *params, False), x, params, g)
    recompute = _fwd_bwd_peak(_ours(act, *params, False, recompute=True), x, params, g)
    chunked = _fwd_bwd_peak(_ours(act, *params, False, token_chunk=1024), x, params, g)
    unit = tokens * d_ff * 4
    assert eager >= 3 * unit, eager / unit  # z, act(z) and d act(z) at once: the test can fail
    assert ours <= 0.75 * eager, (ours / eager, ours / unit, eager / unit)
    assert recompute <= ours and chunked <= recompute, (recompute / unit, chunked / unit)


@pytest.mark.parametrize("transposed", LAYOUTS)
@pytest.mark.parametrize("act", ACTS)
def test_gradcheck_and_double_backward(act, transposed):
    ps = _weights(5, 7, True, transposed, scale=1.0)
    x = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)

    def fn(x, w1, w2, b1, b2):
        return ffn_ext.plain_mlp(x, w1, w2, b1, b2, act.name, transposed=transposed)

    assert torch.autograd.gradcheck(fn, (x, *ps))
    assert torch.autograd.gradgradcheck(fn, (x, *ps))

    def chunked(x, w1, w2, b1, b2):
        return ffn_ext.plain_mlp(x, w1, w2, b1, b2, act.name, transposed=transposed, token_chunk=4)

    assert torch.autograd.gradgradcheck(chunked, (x, *ps))


@pytest.mark.parametrize("opts", [{}, {"recompute": True}, {"token_chunk": 8}], ids=["default", "recompute", "chunk8"])
def test_ffn_under_compile_fullgraph(opts):
    torch.manual_seed(6)
    ffn = ffn_ext.FFN(16, 40, activation="gelu_tanh", bias=True, **opts)
    ref = copy.deepcopy(ffn)
    ref.recompute, ref.token_chunk = False, None
    x = torch.randn(2, 20, 16, requires_grad=True)
    y, y0 = torch.compile(ffn, fullgraph=True, backend="aot_eager")(x), ref(x)
    torch.testing.assert_close(y, y0, rtol=1e-5, atol=1e-5)
    g = torch.autograd.grad(y.sum(), [x, *ffn.parameters()])
    g0 = torch.autograd.grad(y0.sum(), [x, *ref.parameters()])
    for a, b in zip(g, g0):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("chunk", [None, 16], ids=["default", "chunk16"])
def test_autocast_bf16_weight_gradients_in_fp32(chunk):
    """fp32 parameters under bf16 autocast: computes in bf16 as eager does; the gradients come back fp32 (token_chunk:
    accumulated in fp32 across chunks) and match eager's to bf16 rounding."""
    act = ACTIVATIONS[0]
    ps = _weights(32, 64, True, False, dtype=torch.float32)
    x = torch.randn(3, 40, 32, requires_grad=True)
    gy = torch.randn(3, 40, 32)
    leaves = _leaves(x, *ps)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = _ours(act, *ps, False, token_chunk=chunk)(x)
        y0 = _eager(act, *ps, False)(x)
    assert y.dtype == y0.dtype == torch.bfloat16
    g, g0 = torch.autograd.grad(y, leaves, gy), torch.autograd.grad(y0, leaves, gy)
    torch.testing.assert_close(y, y0, rtol=2e-2, atol=2e-2)
    for a, b, leaf in zip(g, g0, leaves):
        assert a.dtype == leaf.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-2 * b.abs().max().item())


def test_activation_checkpointing():
    from torch.utils.checkpoint import checkpoint

    ffn = ffn_ext.FFN(16, 40, bias=True, dtype=torch.float64, token_chunk=6)
    x = torch.randn(3, 10, 16, dtype=torch.float64, requires_grad=True)
    y = checkpoint(ffn, x, use_reentrant=False)
    g = torch.autograd.grad(y.sum(), [x, *ffn.parameters()])
    ffn.token_chunk = None
    y0 = ffn(x)
    g0 = torch.autograd.grad(y0.sum(), [x, *ffn.parameters()])
    torch.testing.assert_close(y, y0, rtol=1e-12, atol=1e-12)
    for a, b in zip(g, g0):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("transposed", LAYOUTS)
def test_torch_func_grad_vmap_and_functional_call(transposed):
    act = ACTIVATIONS[-1]
    ps = _weights(6, 10, True, transposed)
    x = torch.randn(4, 6, dtype=torch.float64)

    def loss(w1, fn):
        return fn(w1)(x).square().sum()

    def ours(w1):
        return _ours(act, w1, *ps[1:], transposed)

    def eager(w1):
        return _eager(act, w1, *ps[1:], transposed)

    w1 = ps[0].detach()
    torch.testing.assert_close(
        torch.func.grad(loss)(w1, ours), torch.func.grad(loss)(w1, eager), rtol=1e-12, atol=1e-12
    )
    xs = torch.randn(3, 4, 6, dtype=torch.float64)
    torch.testing.assert_close(
        torch.func.vmap(_ours(act, *ps, transposed))(xs), _eager(act, *ps, transposed)(xs), rtol=1e-12, atol=1e-12
    )
    ffn = ffn_ext.FFN(6, 10, activation=act.name, bias=True, dtype=torch.float64)
    new = {k: torch.randn_like(v) for k, v in ffn.state_dict().items()}
    want = F.linear(
        act.aten(F.linear(x, new["up_proj.weight"], new["up_proj.bias"])),
        new["down_proj.weight"],
        new["down_proj.bias"],
    )
    torch.testing.assert_close(torch.func.functional_call(ffn, new, (x,)), want, rtol=1e-12, atol=1e-12)


def test_jit_trace_records_the_plain_ops():
    ffn = ffn_ext.FFN(8, 24, bias=True)
    x = torch.randn(5, 8, requires_grad=True)
    traced = torch.jit.trace(ffn, (x,), check_trace=False)
    torch.testing.assert_close(traced(x), ffn(x), rtol=1e-6, atol=1e-6)


def test_bad_arguments_raise_naming_them():
    x, w1, w2 = torch.randn(4, 8), torch.randn(12, 8), torch.randn(8, 12)
    for bad in ("relu6", "swiglu", None, ""):
        with pytest.raises(ValueError, match="plain_mlp: `activation` must be one of"):
            ffn_ext.plain_mlp(x, w1, w2, activation=bad)
    with pytest.raises(ValueError, match="plain_mlp: `transposed` must be True or False"):
        ffn_ext.plain_mlp(x, w1, w2, transposed="yes")
    for kw, name in (({"token_chunk": 0}, "token_chunk"), ({"recompute": 1}, "recompute")):
        with pytest.raises(ValueError, match=f"plain_mlp: `{name}` must be"):
            ffn_ext.plain_mlp(x, w1, w2, **kw)
        with pytest.raises(ValueError, match=f"FFN: `{name}` must be"):
            ffn_ext.FFN(8, 12, **kw)
    with pytest.raises(ValueError, match="plain_mlp: the weights are on the meta device"):
        ffn_ext.plain_mlp(x, w1.to("meta"), w2.to("meta"))


# ---------------------------------------------------------------- ffn_ext.FFN
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("act", ACTS)
def test_ffn_runs_the_lean_autograd_and_matches_eager_fp64(act, bias):
    ffn = ffn_ext.FFN(24, 56, activation=act.name, bias=bias, dtype=torch.float64)
    assert set(ffn._modules) == {"up_proj", "act", "down_proj"}
    x = torch.randn(3, 11, 24, dtype=torch.float64, requires_grad=True)
    y = ffn(x)
    assert type(y.grad_fn).__name__ == "_PlainMLPBackward"
    y0 = ffn.down_proj(act.aten(ffn.up_proj(x)))
    torch.testing.assert_close(y, y0, rtol=1e-12, atol=1e-12)
    gy = torch.randn_like(y)
    for a, b in zip(
        torch.autograd.grad(y, [x, *ffn.parameters()], gy), torch.autograd.grad(y0, [x, *ffn.parameters()], gy)
    ):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_ffn_options_are_attributes_and_hooks_run_the_modules():
    ffn = ffn_ext.FFN(16, 40, bias=True, dtype=torch.float64)
    x = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    y0 = ffn(x)
    g0 = torch.autograd.grad(y0.sum(), [x, *ffn.parameters()])
    ffn.recompute, ffn.token_chunk = True, 8
    shapes, y = _saved(ffn, x)
    assert _big(shapes, 50, 40) == [], shapes
    torch.testing.assert_close(y, y0, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad(y.sum(), [x, *ffn.parameters()]), g0):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert repr(ffn).startswith("FFN(\n  activation='gelu', recompute=True, token_chunk=8")
    seen = []
    ffn.act.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    y = ffn(x)
    assert seen == [torch.Size([50, 40])] and type(y.grad_fn).__name__ != "_PlainMLPBackward"
    torch.testing.assert_close(y, y0, rtol=1e-12, atol=1e-12)


def test_ffn_runs_a_replaced_activation():
    ffn = ffn_ext.FFN(16, 40, dtype=torch.float64)
    ffn.act = nn.Tanh()
    x = torch.randn(7, 16, dtype=torch.float64)
    torch.testing.assert_close(ffn(x), ffn.down_proj(torch.tanh(ffn.up_proj(x))), rtol=0, atol=0)


# ---------------------------------------------------------------- forward-mode AD and torch.func
def _cpu_forms(act, wg, wu, wd):
    """(ffn_ext's functional form, its eager expression, the weights it uses) on the CPU for the gated MLP (separate
    and packed projections) and the classic one (wg as fc1)."""
    aten = act.aten
    w_gu = torch.cat([wg, wu]).detach().requires_grad_(wg.requires_grad or wu.requires_grad)
    return [
        (
            lambda t: ffn_ext.gated_mlp(t, wg, wu, wd, activation=act.name),
            lambda t: F.linear(aten(F.linear(t, wg)) * F.linear(t, wu), wd),
            (wg, wu, wd),
        ),
        (
            lambda t: ffn_ext.gated_mlp_packed(t, w_gu, wd, activation=act.name),
            lambda t: F.linear((lambda g, u: aten(g) * u)(*F.linear(t, w_gu).chunk(2, -1)), wd),
            (w_gu, wd),
        ),
        (
            lambda t: ffn_ext.plain_mlp(t, wg, wd, activation=act.name),
            lambda t: F.linear(aten(F.linear(t, wg)), wd),
            (wg, wd),
        ),
    ]


@pytest.mark.parametrize("act", ACTS)
def test_mlps_under_forward_ad_and_torch_func(act):
    """The MLPs under forward-mode AD (a dual x, with and without grad mode), torch.func.jvp and vmap(grad): eager's
    tangents and gradients."""
    import torch.autograd.forward_ad as fwAD
    import torch.func as torch_func

    torch.manual_seed(1)
    wg, wu, wd = (torch.randn(*s, dtype=torch.float64) for s in ((10, 6), (10, 6), (6, 10)))
    x, t = torch.randn(4, 6, dtype=torch.float64) * 2, torch.randn(4, 6, dtype=torch.float64)
    for ours, eager, _ in _cpu_forms(act, wg, wu, wd):
        for mode in (torch.enable_grad, torch.no_grad):
            with mode(), fwAD.dual_level():
                got = fwAD.unpack_dual(ours(fwAD.make_dual(x, t)))
                want = fwAD.unpack_dual(eager(fwAD.make_dual(x, t)))
            torch.testing.assert_close(got.primal, want.primal, rtol=0, atol=0)
            torch.testing.assert_close(got.tangent, want.tangent)
        torch.testing.assert_close(torch_func.jvp(ours, (x,), (t,)), torch_func.jvp(eager, (x,), (t,)))
        torch.testing.assert_close(
            torch_func.vmap(torch_func.grad(lambda s, f=ours: f(s).sum()))(x),
            torch_func.vmap(torch_func.grad(lambda s, f=eager: f(s).sum()))(x),
        )
