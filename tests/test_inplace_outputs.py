"""The MLPs' outputs take in-place ops as eager's do: `y += other; y.mul_(2)` under autograd, then backward, gives
eager's values and gradients, for every functional form of ffn_ext.mlp and every option (default, recompute,
token_chunk below and above the token count, both), with and without biases, and for the modules on them.
Models do this to an MLP's output (Falcon: `mlp_output += attention_output`); a custom autograd.Function whose
output is a view refuses it ("Output 0 of _PlainMLP is a view and is being modified inplace"), which token_chunk's
buffer and F.linear's 3-D-with-bias result both were. Float64 against the eager composition; the output buffer
is poisoned first, so a row the chunked forward forgets to write fails."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from optable import DEVICES, poison_cuda_cache

import ffn_ext
from ffn_ext.table import BY_NAME

D_MODEL, D_FF, SHAPE = 8, 12, (3, 7)  # 21 tokens

OPTIONS = [  # (recompute, token_chunk)
    pytest.param(False, None, id="default"),
    pytest.param(True, None, id="recompute"),
    pytest.param(False, 4, id="chunk4"),
    pytest.param(True, 5, id="recompute-chunk5"),
    pytest.param(False, 1, id="chunk1"),
    pytest.param(False, 64, id="chunk-above-tokens"),  # the default path
]


def _gated(act):
    def eager(x, wg, wu, wd, bg, bu, bd):
        return F.linear(BY_NAME[act].aten(F.linear(x, wg, bg)) * F.linear(x, wu, bu), wd, bd)

    return eager


def _packed(act):
    def eager(x, wgu, wd, bgu, bd):
        gate, up = F.linear(x, wgu, bgu).chunk(2, -1)
        return F.linear(BY_NAME[act].aten(gate) * up, wd, bd)

    return eager


def _plain(act, transposed=False):
    def eager(x, w1, w2, b1, b2):
        if transposed:
            w1, w2 = w1.t(), w2.t()
        return F.linear(BY_NAME[act].aten(F.linear(x, w1, b1)), w2, b2)

    return eager


GATED_SHAPES = ((D_FF, D_MODEL), (D_FF, D_MODEL), (D_MODEL, D_FF), (D_FF,), (D_FF,), (D_MODEL,))
PACKED_SHAPES = ((2 * D_FF, D_MODEL), (D_MODEL, D_FF), (2 * D_FF,), (D_MODEL,))
PLAIN_SHAPES = ((D_FF, D_MODEL), (D_MODEL, D_FF), (D_FF,), (D_MODEL,))
CONV1D_SHAPES = ((D_MODEL, D_FF), (D_FF, D_MODEL), (D_FF,), (D_MODEL,))

# id -> (ffn_ext's call, its parameters' shapes (weights, then biases), the eager composition): every functional
# form of ffn_ext.mlp
FORMS = {
    "gated_mlp-relu2": (lambda x, *p, **o: ffn_ext.gated_mlp(x, *p, "relu2", **o), GATED_SHAPES, _gated("relu2")),
    "gated_mlp_packed-gelu_tanh": (
        lambda x, *p, **o: ffn_ext.gated_mlp_packed(x, *p, "gelu_tanh", **o),
        PACKED_SHAPES,
        _packed("gelu_tanh"),
    ),
    "swiglu_mlp": (ffn_ext.swiglu_mlp, GATED_SHAPES, _gated("silu")),
    "swiglu_mlp_packed": (ffn_ext.swiglu_mlp_packed, PACKED_SHAPES, _packed("silu")),
    "geglu_mlp": (ffn_ext.geglu_mlp, GATED_SHAPES, _gated("gelu")),
    "geglu_mlp_packed-tanh": (
        lambda x, *p, **o: ffn_ext.geglu_mlp_packed(x, *p, "tanh", **o),
        PACKED_SHAPES,
        _packed("gelu_tanh"),
    ),
    "plain_mlp": (ffn_ext.plain_mlp, PLAIN_SHAPES, _plain("gelu")),
    "plain_mlp-conv1d-quick_gelu": (
        lambda x, *p, **o: ffn_ext.plain_mlp(x, *p, "quick_gelu", transposed=True, **o),
        CONV1D_SHAPES,
        _plain("quick_gelu", transposed=True),
    ),
}
assert {f for f in ffn_ext.mlp.__all__ if f.endswith("_mlp") or "_mlp_" in f} <= {k.split("-")[0] for k in FORMS}


def _poison(shape, device):
    """Free memory of the output's size filled with NaN, so the next allocation of that size (the output buffer)
    starts as NaN: rows left unwritten fail the comparison."""
    if device == "cuda":
        poison_cuda_cache(device)
    else:
        t = torch.full(shape, float("nan"), dtype=torch.float64)
        del t


def _leaf(shape, device, scale=0.4):
    return (torch.randn(shape, dtype=torch.float64, device=device) * scale).requires_grad_()


def _check(ours, eager, leaves, x, device):
    """ours() and eager() with `y += other; y.mul_(2)` after them: values, and the gradients of x, the parameters
    and `other`, equal."""
    other = _leaf(x.shape, device)
    gy = torch.randn(x.shape, dtype=torch.float64, device=device)
    results = []
    for f in (ours, eager):
        _poison(x.shape, device)
        y = f()
        y += other
        y.mul_(2)
        results.append((y.detach(), torch.autograd.grad(y, [*leaves, other], gy)))
    (y, g), (y0, g0) = results
    torch.testing.assert_close(y, y0, rtol=1e-12, atol=1e-12)
    for a, b in zip(g, g0):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _ffn_ext_output(y) -> None:
    """A custom Function's output must not be a view (no in-place op then): none of them is, nor a copy of one."""
    if y.grad_fn is not None and type(y.grad_fn).__name__.startswith("_"):
        assert not y._is_view(), type(y.grad_fn).__name__
        assert y.untyped_storage().nbytes() == y.numel() * y.element_size()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recompute,chunk", OPTIONS)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("form", list(FORMS))
def test_functional_output_takes_inplace_ops(form, bias, recompute, chunk, device):
    fn, shapes, eager = FORMS[form]
    n_w = len(shapes) // 2
    ps = [_leaf(s, device) if i < n_w or bias else None for i, s in enumerate(shapes)]
    x = _leaf((*SHAPE, D_MODEL), device, scale=1.0)
    leaves = [x, *(p for p in ps if p is not None)]
    opts = {"recompute": recompute, "token_chunk": chunk}

    def ours():
        y = fn(x, *ps, **opts)
        _ffn_ext_output(y)
        return y

    _check(ours, lambda: eager(x, *ps), leaves, x, device)


MODULES = {
    "SwiGLUFFN": lambda **o: ffn_ext.SwiGLUFFN(D_MODEL, D_FF, **o),
    "SwiGLUFFN-fused": lambda **o: ffn_ext.SwiGLUFFN(D_MODEL, D_FF, fused_gate_up=True, **o),
    "GeGLUFFN-tanh": lambda **o: ffn_ext.GeGLUFFN(D_MODEL, D_FF, approximate="tanh", **o),
    "GatedFFN-relu": lambda **o: ffn_ext.GatedFFN(D_MODEL, D_FF, activation="relu", **o),
    "FFN": lambda **o: ffn_ext.FFN(D_MODEL, D_FF, **o),
}


def _eager_module(m):
    """The eager composition of the module's parameters: its nn.Linear submodules and the activation's ATen form."""
    act = BY_NAME[m.activation].aten
    if isinstance(m, ffn_ext.FFN):
        return lambda x: m.down_proj(act(m.up_proj(x)))
    if m.fused_gate_up:

        def packed(x):
            gate, up = m.gate_up_proj(x).chunk(2, -1)
            return m.down_proj(act(gate) * up)

        return packed
    return lambda x: m.down_proj(act(m.gate_proj(x)) * m.up_proj(x))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recompute,chunk", OPTIONS)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("name", list(MODULES))
def test_module_output_takes_inplace_ops(name, bias, recompute, chunk, device):
    m = MODULES[name](bias=bias, device=device, dtype=torch.float64, recompute=recompute, token_chunk=chunk)
    x = _leaf((*SHAPE, D_MODEL), device, scale=1.0)
    leaves = [x, *m.parameters()]

    def ours():
        y = m(x)
        _ffn_ext_output(y)
        assert y.grad_fn is not None and type(y.grad_fn).__name__.startswith("_")  # the fused path ran
        return y

    _check(ours, lambda: _eager_module(m)(x), leaves, x, device)


@pytest.mark.parametrize("chunk", [None, 4], ids=["default", "chunk4"])
def test_compiled_output_takes_inplace_ops(chunk):
    """Under torch.compile(fullgraph=True) too: the Function's forward traces (no Tensor._is_view there)."""
    fn, shapes, eager = FORMS["swiglu_mlp"]
    ps = [_leaf(s, "cpu") for s in shapes]
    x = _leaf((*SHAPE, D_MODEL), "cpu", scale=1.0)
    compiled = torch.compile(lambda x: fn(x, *ps, token_chunk=chunk), backend="aot_eager", fullgraph=True)
    _check(lambda: compiled(x), lambda: eager(x, *ps), [x, *ps], x, "cpu")
