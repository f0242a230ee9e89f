"""The lean autograd of a gated MLP, y = down(act(gate(x)) * up(x)), and of the classic FFN, y = fc2(act(fc1(x))), for
every activation of the table.

    y = ffn_ext.swiglu_mlp(x, w_gate, w_up, w_down)                       # silu (Llama, Qwen2, Mistral)
    y = ffn_ext.geglu_mlp(x, w_gate, w_up, w_down, approximate="tanh")    # tanh GELU (Gemma)
    y = ffn_ext.gated_mlp(x, w_gate, w_up, w_down, activation="gelu")     # any table activation by name
    y = ffn_ext.gated_mlp(x, w_gate, w_up, w_down, activation=ffn_ext.Gating("swiglu_clamped", limit=7.0))
    y = ffn_ext.swiglu_mlp_packed(x, w_gate_up, w_down)                   # packed gate/up projection (Phi-3)
    y = ffn_ext.swiglu_mlp(x, w_gate, w_up, w_down, recompute=True)       # saves only x for backward
    y = ffn_ext.swiglu_mlp(x, w_gate, w_up, w_down, token_chunk=8192)     # long sequences: 8192 tokens at a time
    y = ffn_ext.plain_mlp(x, w_fc1, w_fc2, b_fc1, b_fc2, activation="gelu")   # the classic FFN (BERT, ViT)
    y = ffn_ext.plain_mlp(x, c_fc.weight, c_proj.weight, c_fc.bias, c_proj.bias, "gelu_tanh", transposed=True)  # GPT-2

Weights in nn.Linear layout: w_gate, w_up [d_ff, d_model], w_down [d_model, d_ff], w_gate_up [2*d_ff, d_model]
(gate rows first); biases optional. Training memory: the autograd.Function saves the input x and the projections
gate and up (packed: gate_up) and recomputes h = act(gate) * up in backward (for the down projection's weight
gradient) instead of keeping it. Eager PyTorch keeps four [tokens, d_ff] tensors (gate, act(gate), up, h); this
keeps two. The recompute is one memory-bound elementwise pass next to three GEMMs. recompute=True keeps none (x
only; backward recomputes the projections) and token_chunk=N bounds every tensor inside the MLP by N x 2*d_ff
elements, forward and backward, for sequences whose [tokens, d_ff] tensors do not fit (_OPTIONS_DOC).

The gated MLPs' activation is a Gating (ffn_ext.ops): a gated op of the table with its parameters and, packed, its
layout (an activation's table name stands for its plain gated op: "silu" for swiglu). The forward runs the Gating,
the backward its backward op and the recompute, through the ops' public API. The classic FFN (plain_mlp) saves x
and z = fc1(x) (one [tokens, d_ff] tensor; eager keeps z and act(z)) and recomputes act(z) in backward from the step
that computes dz, over blocks of _PLAIN_BLOCK_ROWS rows. Every device runs the same code: the ops' kernels differ
(on the CPU, PyTorch's own ops).

Double backward (create_graph=True, e.g. gradient penalties) is supported: when backward runs with grad mode on,
it recomputes gate and up from the saved x and weights with differentiable ops, so second derivatives flow to x,
the weights and the incoming gradient (checked with gradgradcheck). Plain backward never recomputes the GEMMs.

Without grad mode (no_grad, inference_mode), under torch.jit.trace and under torch.func transforms or forward-mode
AD, the plain ops run instead of the autograd.Function (F.linear and the fused activation; see _lean_autograd).

``fusable`` and ``linear_args`` are what the modules (ffn_ext.GatedFFN) and Hugging Face patching (ffn_ext.hf) use
to decide whether a module's projections may be bypassed and to read their parameters cheaply.
"""

from __future__ import annotations

import contextlib
from typing import overload

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import _compat
from . import ops as _ops
from .ops import Gating
from .table import ACTIVATIONS, BY_NAME, activation_for

__all__ = [
    "gated_mlp",
    "gated_mlp_packed",
    "swiglu_mlp",
    "swiglu_mlp_packed",
    "geglu_mlp",
    "geglu_mlp_packed",
    "plain_mlp",
    "fusable",
    "linear_args",
    "check_options",
]


def _activate(act, pre):
    """h from the projections `pre`: the gated MLPs' Gating on (gate, up) or (gate_up,); the plain MLP's activation
    (its table name) on (z,)."""
    return _ops.act(pre[0], act) if isinstance(act, str) else act(*pre)


def _act_backward(act, dh, pre) -> list:
    """The gradients of the projections `pre` from h's gradient dh (as _activate's act)."""
    return [_ops.call_op(act + "_backward", dh, pre[0])] if isinstance(act, str) else list(act.backward(dh, *pre))


def _cast(t, dtype):
    return t if t is None or t.dtype == dtype else t.to(dtype)


def _rows(t):  # [..., K] -> [N, K]
    return t.reshape(-1, t.shape[-1])


def _project(x, ws, bs):
    """The gate/up projection: (gate, up), or (gate_up,) for a packed weight."""
    return tuple(F.linear(x, w, b) for w, b in zip(ws, bs))


def _param_grads(x, d_pre, need_w, need_b, transposed=False):
    """dW and db of one input projection pre = x @ W^T + b, given d_pre (transposed: W is [in, out], Conv1D's)."""
    dw = (_wgrad(_rows(x), _rows(d_pre)) if transposed else _wgrad(_rows(d_pre), _rows(x))) if need_w else None
    db = _rows(d_pre).sum(0) if need_b else None
    return dw, db


def _wgrad(a, b):  # a^T @ b: a weight gradient from the rows of its output's gradient and its input
    return a.t().matmul(b)


def _acc_mm(acc, a, b, dtype):
    """acc + a^T @ b (acc None: a^T @ b) in `dtype`, the gradient's own precision: when the operands are 16-bit and
    the parameters fp32 (autocast), the product is not rounded to 16 bits per chunk (CUDA: mm with out_dtype; else
    the operands are widened)."""
    if a.dtype != dtype:
        if a.is_cuda and dtype == torch.float32 and a.dtype in (torch.float16, torch.bfloat16):
            return torch.mm(a.t(), b, out_dtype=dtype) if acc is None else torch.addmm(acc, a.t(), b, out_dtype=dtype)
        a, b = a.to(dtype), b.to(dtype)
    return a.t().matmul(b) if acc is None else acc.addmm_(a.t(), b)


def _acc_sum(acc, a, dtype):
    s = a.sum(0, dtype=dtype)
    return s if acc is None else acc.add_(s)


def _no_autocast(x):
    return torch.autocast(x.device.type, enabled=False)


def _chunked(op, x, ws, wd, bs, bd, chunk, functional=False, on_pre=None):
    """y = down(op(gate_up(x))) over chunks of `chunk` rows of x (leading dims flattened): no tensor larger than
    chunk x 2*d_ff is made. Computes in the dtype the first chunk's projection takes (autocast's, else x's) with
    every operand cast to it once. Writes each chunk of y in place (functional=True: concatenates, for torch.func
    transforms). on_pre(start row, projections) sees each chunk's projections, and may return their h (made in the
    same pass as what it keeps). Returns (y, that dtype)."""
    xr = _rows(x)
    first = _project(xr[:chunk], ws, bs)
    dtype = first[0].dtype
    xr, wd, bd = _cast(xr, dtype), _cast(wd, dtype), _cast(bd, dtype)
    ws, bs = tuple(_cast(w, dtype) for w in ws), tuple(_cast(b, dtype) for b in bs)
    n = xr.shape[0]
    outs = [] if functional else None
    yr = None if functional else xr.new_empty((n, wd.shape[0]))
    with _no_autocast(x):
        for s in range(0, n, chunk):
            pre = first if s == 0 else _project(xr[s : s + chunk], ws, bs)
            first = None
            h = None if on_pre is None else on_pre(s, pre)
            if h is None:
                h = _activate(op, pre)
            del pre
            if functional:
                outs.append(F.linear(h, wd, bd))
            elif bd is None:
                torch.mm(h, wd.t(), out=yr[s : s + chunk])
            else:
                torch.addmm(bd, h, wd.t(), out=yr[s : s + chunk])
            del h
    if functional:
        y = torch.cat(outs)
        return y.reshape(*x.shape[:-1], y.shape[-1]), dtype
    return _unview(yr, (*x.shape[:-1], yr.shape[-1])), dtype


def _chunks(x, chunk) -> bool:
    """Whether token_chunk=chunk splits x's rows (leading dims flattened): else the default path runs."""
    return chunk is not None and chunk < x.numel() // max(x.shape[-1], 1)


def _unview(y, shape):
    """y (a fresh tensor) in `shape`, as a tensor autograd does not take for a view: a custom Function's output that
    is a view refuses in-place ops (Falcon's `mlp_output += attention_output`) where eager's takes them. The same
    storage, no copy, as at::matmul reshapes its own result (_unsafe_view). A buffer allocated in its final shape
    with the chunks written into a 2-D view of it would not do: torch.compile's functionalization makes that
    output a view again (tests/test_inplace_outputs.py)."""
    return y if y.shape == shape else torch.ops.aten._unsafe_view(y, shape)


def _linear_out(h, wd, bd):
    """F.linear(h, wd, bd), not a view (as _unview): for a contiguous 3-D h with a bias F.linear returns a view of
    its 2-D GEMM's result. On every result but a 2-D one: torch.compile cannot trace Tensor._is_view."""
    y = F.linear(h, wd, bd)
    return y if y.dim() == 2 else torch.ops.aten._unsafe_view(y, y.shape)


def _forward(ctx, op, recompute, chunk, saved, x, ws, wd, bs, bd, plain=False, transposed=False):
    """The Functions' forward: ws, bs = (w_gate, w_up), (b_gate, b_up), or (w_gate_up,), (b_gate_up,), and `op` their
    gated op; the plain MLP's: (w_fc1,), (b_fc1,), wd = w_fc2 (nn.Linear layout, or transposed=True: Conv1D's
    [in, out] weights), `op` the activation's unary op. Saves the weights as given (views made here would not carry
    double backward to them), and the projections as `saved` (saved_dtype) says."""
    ctx.op, ctx.k, ctx.bd_dtype = op, len(ws), None if bd is None else bd.dtype
    ctx.plain, ctx.transposed, ctx.pre_spent, ctx.saved = plain, transposed, False, None
    saved_w = (*ws, wd)
    halves = 2 if ctx.k == 1 and not plain else 1  # a packed projection's FP8 groups stay within gate or up
    # the FP8 cache written by the gated op's own pass (<gated>_cache), read by its cached backward
    ctx.fused = fused = not plain and cache_fusable(op, saved, ctx.k)
    if transposed:  # compute on [out, in] views of Conv1D's [in, out] weights (F.linear reads them in place)
        ws, wd = (ws[0].t(),), wd.t()
    with _autocast_cache_off(x):
        if _chunks(x, chunk):
            y, ctx.dtype = _chunked(op, x, ws, wd, bs, bd, chunk)
            ctx.chunk, pre = chunk, ()
        elif saved is not None and _in_blocks(x):  # the projections made, used and kept a block of rows at a time
            rows = x.numel() // x.shape[-1]
            keeper = _Keeper(saved, halves, rows, op if fused else None)
            y, ctx.dtype = _chunked(op, x, ws, wd, bs, bd, _step(rows), on_pre=keeper.add)
            ctx.chunk, ctx.saved, pre = None, saved, keeper.tensors(tuple(x.shape[:-1]))
        else:
            pre = _project(x, ws, bs)
            ctx.chunk, ctx.dtype = None, pre[0].dtype
            if fused:  # (below _SPLIT_ROWS rows, or compiled)
                h, *kept = cache(op, pre)
                y = _linear_out(h, wd, bd)
                del h
                ctx.saved, pre = saved, tuple(c.view(*x.shape[:-1], -1) for c in kept)
            else:
                ctx.fused = False
                y = _blocked_down(op, pre, wd, bd, x) if _in_blocks(x) else None
                if y is None:
                    y = _linear_out(_activate(op, pre), wd, bd)
                if recompute:
                    pre = ()
                elif saved is not None and saved != ctx.dtype:
                    ctx.saved, pre = saved, keep(pre, saved, halves)
    ctx.save_for_backward(x, *saved_w, *bs, *pre)
    return y


@contextlib.contextmanager
def _cache_off():
    was = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(was)


def _autocast_cache_off(x):
    """Within it, autocast does not cache its casts of the weights. An autograd.Function's forward runs without grad
    mode, and torch 2.10's autocast caches the casts it makes there too (later releases do not): the region's next
    F.linear on the same weights would get that cast, which has no grad_fn, and lose the weights' gradients. In
    eager only (a compiled graph has no such cache)."""
    device = x.device.type  # autocast knows some device types only; is_autocast_enabled raises for the others
    if torch.compiler.is_compiling() or not (_autocast_available(device) and torch.is_autocast_enabled(device)):
        return contextlib.nullcontext()
    return _cache_off()


_autocast_available = torch.amp.is_autocast_available


# From this many rows (tokens) the gated backward writes its gradients over the projections (_inplace_backward):
# peak 3 [rows, d_ff] tensors instead of 5 (eager autograd: about 6). Below it the weight gradients dominate the
# peak, and one block saves the copies and launches.
_SPLIT_ROWS = 1024
# _inplace_backward's blocks: the gating's backward makes 2 / _INPLACE_BLOCKS of the projections' bytes before it
# copies them over the block
_INPLACE_BLOCKS = 8
# ... of at least this many rows: smaller blocks cut the GEMMs of dh and of the down projection's weight gradient
# too small on the CPU (bench_cpu: 0.76x eager at 1024 tokens with 128-row blocks)
_MIN_BLOCK_ROWS = 512
# The plain MLP's backward (one [rows, d_ff] tensor saved) runs over blocks of at most this many rows: each block
# makes dz, act(z) and fc2's input gradient (3 x block x d_ff), so at 4096 tokens the peak is the saved z plus
# 0.375 [tokens, d_ff] tensors instead of 3 (measured: tests/test_plain_mlp.py, benchmarks/bench_ffn.py --classic).
_PLAIN_BLOCK_ROWS = 512


def _plain_block(rows: int) -> int:
    return min(rows, _PLAIN_BLOCK_ROWS) if rows > 0 else 1


def _backward_recompute(act: str, grad, z):
    """(grad * act'(z), act(z)): the plain MLP's backward step, dz for fc1's gradients and the recomputed
    activation for fc2's weight gradient: one pass over grad and z (<act>_backward_recompute) instead of two."""
    return tuple(_ops.backward_recompute(grad, z, act))


def _fused_form(op, k: int) -> bool:
    """Whether the gated ops that take gate and up apart (<gated>_backward_recompute, _cache) serve a gated MLP's
    projections as they are: gate and up separate (k = 2), or packed "concat", whose halves they read in place (the
    interleaved halves are strided: they would be copied first)."""
    return isinstance(op, Gating) and (k == 2 or op.layout == "concat")


# saved_dtype: the projections kept for backward in FP8 (a float32 scale per 1 x 128 group of each row: DeepSeek-V3's
# activation cache; 64 or 32 where d_ff is no multiple of 128) or bf16 (fp32 training), read back a block at a time
SAVED_DTYPES = (torch.float8_e4m3fn, torch.bfloat16)
_SAVED_GROUPS = (128, 64, 32)


def _saved_group(d_ff: int) -> int | None:
    """The FP8 cache's group length for projections of width d_ff (a packed one's halves: never a group across
    gate and up), or None when none of _SAVED_GROUPS divides it."""
    return next((g for g in _SAVED_GROUPS if d_ff % g == 0), None)


def check_saved_dtype(fn: str, saved_dtype, d_ff: int | None, recompute=False, token_chunk=None):
    """saved_dtype when valid for `fn` with projections of width d_ff (None: not known yet, each call checks its
    own), else a ValueError naming it."""
    if saved_dtype is None:
        return None
    if not isinstance(saved_dtype, torch.dtype) or saved_dtype not in SAVED_DTYPES:
        raise ValueError(
            f"ffn_ext.{fn}: `saved_dtype` must be None, torch.float8_e4m3fn or torch.bfloat16, got {saved_dtype!r}"
        )
    if recompute or token_chunk is not None:
        raise ValueError(
            f"ffn_ext.{fn}: `saved_dtype` is the dtype the projections are kept in for backward; recompute=True and "
            "token_chunk keep none: pass one or the other"
        )
    if saved_dtype == torch.float8_e4m3fn and d_ff is not None and _saved_group(d_ff) is None:
        raise ValueError(
            f"ffn_ext.{fn}: `saved_dtype`=torch.float8_e4m3fn keeps the projections with a scale per group of "
            f"{' / '.join(map(str, _SAVED_GROUPS))} elements of a row: d_ff={d_ff} is a multiple of none (use "
            "torch.bfloat16 or None)"
        )
    return saved_dtype


def cache_fusable(op, saved, k: int) -> bool:
    """Whether the FP8 cache (saved = torch.float8_e4m3fn) of a gated MLP's projections is written and read by its
    Gating's cache ops (<gated>_cache, _cached_backward): gate and up separate (k = 2) or packed "concat" (k = 1).
    The classic FFN and the interleaved layout keep theirs through ffn_ext.quantize and read it with PyTorch's ops."""
    return saved == torch.float8_e4m3fn and _fused_form(op, k)


def cache(op, pre) -> tuple:
    """(h, q, scale) of the projections `pre` ((gate, up), or (gate_up,) "concat") by <gated>_cache: q [..., 2M]
    holds gate's FP8 values then up's."""
    gate, up = pre if len(pre) == 2 else pre[0].chunk(2, -1)
    group = _saved_group(gate.shape[-1])
    assert group is not None  # check_saved_dtype refused d_ff before the Function ran
    return op.cache(gate, up, group)


class _Keeper:
    """Writes the projections into their cache a block of rows at a time (`add`, blocks of [rows, width]), so that
    the quantization's temporaries stay a block's: FP8 values and a float32 scale per group, or bf16 values. With
    `op` (a Gating: cache_fusable) one (values, scale) pair for both projections, written by <gated>_cache, and
    `add` returns the block's h."""

    def __init__(self, saved, halves: int, rows: int, op=None):
        self.saved, self.halves, self.rows, self.op = saved, halves, rows, op
        self.bufs: list = []
        self.fp8 = saved == torch.float8_e4m3fn
        if self.fp8:
            from .quant import QuantRecipe, quantize  # (ops level: imported on the first use, not with ffn_ext.mlp)

            self.recipe_of, self.quantize = QuantRecipe, quantize

    def add(self, s: int, pre):
        if self.op is not None:
            h, qb, sb = cache(self.op, pre)
            if not self.bufs:
                self.bufs.append((qb.new_empty((self.rows, qb.shape[-1])), sb.new_empty((self.rows, sb.shape[-1]))))
            q, scale = self.bufs[0]
            q[s : s + qb.shape[0]].copy_(qb)
            scale[s : s + sb.shape[0]].copy_(sb)
            return h
        if not self.bufs:
            group = _saved_group(pre[0].shape[-1] // self.halves) if self.fp8 else None
            if self.fp8:
                assert group is not None  # check_saved_dtype refused d_ff before the Function ran
                self.recipe = self.recipe_of(group_size=group)
            for p in pre:
                q = p.new_empty((self.rows, p.shape[-1]), dtype=self.saved)
                scale = p.new_empty((self.rows, p.shape[-1] // group), dtype=torch.float32) if group else None
                self.bufs.append((q, scale))
        for (q, scale), p in zip(self.bufs, pre):
            e = s + p.shape[0]
            if scale is None:
                q[s:e].copy_(p)
            else:
                qb, sb = self.quantize(p, self.recipe)
                q[s:e].copy_(qb)
                scale[s:e].copy_(sb)
        return None

    def tensors(self, lead: tuple) -> tuple:
        """(values, scale) of each projection, in its shape lead + (width,); the scale None for bf16."""
        return tuple(t.view(*lead, -1) if t is not None else None for q, scale in self.bufs for t in (q, scale))


def keep(pre, saved, halves) -> tuple:
    """The projections `pre` as kept for backward in `saved` (halves: 2 for a packed [gate | up] projection, whose
    FP8 groups never span both): (values, scale) each, the scale None for bf16."""
    rows = [_rows(p) for p in pre]
    n = rows[0].shape[0]
    keeper, step = _Keeper(saved, halves, n), _step(n)
    for s in range(0, n, step):
        keeper.add(s, tuple(r[s : s + step] for r in rows))
    return keeper.tensors(tuple(pre[0].shape[:-1]))


class Kept:
    """A projection kept in saved_dtype, read back in the compute dtype: whole (`whole()`) or by rows of its
    [rows, width] view (`kept[s:e]`), so that the backward never holds more than a block of it widened."""

    def __init__(self, q, scale, dtype):
        self.q, self.scale, self.dtype = q, scale, dtype

    def _read(self, q, scale):
        if scale is None:
            return q.to(self.dtype)
        from .quant import dequantize  # (ops level: imported on the first use, not with ffn_ext.mlp)

        return dequantize(q, scale, self.dtype)

    def whole(self):
        return self._read(self.q, self.scale)

    def __getitem__(self, rows: slice):
        return self._read(_rows(self.q)[rows], None if self.scale is None else _rows(self.scale)[rows])


class Cached:
    """Both projections' FP8 cache as <gated>_cache wrote it (q [rows, 2M]: gate's values, then up's; its scales),
    read by the gated op's cached backward a block of rows at a time (`step`), which makes d_gate, d_up and h in one
    pass. k: 2 (gate and up) or 1 (gate_up "concat"): the gradients' form."""

    def __init__(self, q, scale, dtype, op, k: int):
        self.q, self.scale, self.dtype, self.op, self.k = _rows(q), _rows(scale), dtype, op, k

    def halves(self) -> tuple:
        """The cache as the projections' Kept (gate and up, or gate_up), for the paths that read the values."""
        if self.k == 1:
            return (Kept(self.q, self.scale, self.dtype),)
        m, n = self.q.shape[-1] // 2, self.scale.shape[-1] // 2
        return Kept(self.q[:, :m], self.scale[:, :n], self.dtype), Kept(self.q[:, m:], self.scale[:, n:], self.dtype)

    def step(self, dh, rows: slice = slice(None)) -> tuple:
        """([d_gate, d_up] or [d_gate_up], h) of `rows` from their h's gradient dh ([rows, M])."""
        dg, du, h = self.op.cached_backward(dh, self.q[rows], self.scale[rows])
        return ([dg, du] if self.k == 2 else [torch.cat((dg, du), -1)]), h


def _rows_of(p):
    """A saved projection as rows to slice: a tensor's [rows, width] view, or a Kept."""
    return p if isinstance(p, Kept) else _rows(p)


def _backward(ctx, dy, needs):
    """The gradients of (x, *ws, wd, *bs, bd) (needs: which are wanted, in that order)."""
    k, op, dtype = ctx.k, ctx.op, ctx.dtype
    saved = ctx.saved_tensors
    x, ws, wd, bs, pre = saved[0], saved[1 : 1 + k], saved[1 + k], saved[2 + k : 2 + 2 * k], saved[2 + 2 * k :]
    if ctx.transposed:
        ws, wd = (ws[0].t(),), wd.t()
    n_x, n_ws, n_wd, n_bs, n_bd = needs[0], needs[1 : 1 + k], needs[1 + k], needs[2 + k : 2 + 2 * k], needs[2 + 2 * k]
    rows = x.numel() // max(x.shape[-1], 1)
    if pre and ctx.pre_spent:  # an earlier backward (retain_graph=True) wrote its gradients over them: recompute
        pre = ()
    if pre and ctx.saved is not None:  # kept in saved_dtype (never written over)
        if ctx.fused:
            pre = (Cached(*pre, dtype, op, k),)
            if not (n_x or any(n_ws) or any(n_bs)):  # h alone: read the values (the cached backward makes d_pre)
                pre = pre[0].halves()
        else:
            pre = tuple(Kept(pre[i], pre[i + 1], dtype) for i in range(0, len(pre), 2))
    if not torch.is_grad_enabled() and ctx.plain:
        step = _plain_block(rows) if ctx.chunk is None else min(ctx.chunk, _plain_block(rows))
        return _chunked_backward(ctx, dy, x, ws, wd, bs, n_x, n_ws, n_wd, n_bs, n_bd, pre, step)
    if not torch.is_grad_enabled() and ctx.chunk is not None:
        return _chunked_backward(ctx, dy, x, ws, wd, bs, n_x, n_ws, n_wd, n_bs, n_bd, pre, max(1, ctx.chunk // 2))
    if not torch.is_grad_enabled() and rows >= _SPLIT_ROWS:
        if pre and isinstance(pre[0], (Kept, Cached)) and rows > x.shape[-1]:
            # blocks read from the cache, no [rows, d_ff] tensor made whole, and the weight gradients accumulated
            # across them: held through the blocks, they cost less than whole projections' gradients where rows >
            # d_model (else _inplace_backward: whole gradients, written a block at a time)
            return _chunked_backward(ctx, dy, x, ws, wd, bs, n_x, n_ws, n_wd, n_bs, n_bd, pre, _step(rows))
        if not torch.compiler.is_compiling():
            return _inplace_backward(ctx, dy, x, ws, wd, bs, n_x, n_ws, n_wd, n_bs, n_bd, pre)
        # compiled: halves without writes over the saved projections (inductor plans the buffers itself)
        return _chunked_backward(ctx, dy, x, ws, wd, bs, n_x, n_ws, n_wd, n_bs, n_bd, pre, -(-rows // 2))
    dy, x, wd = _cast(dy, dtype), _cast(x, dtype), _cast(wd, dtype)
    ws = tuple(_cast(w, dtype) for w in ws)
    cached = None
    if not pre or torch.is_grad_enabled():  # recompute or token_chunk, or create_graph=True (then gate and up must be
        # functions of x and the weights; with token_chunk that is the whole projection at once)
        pre = _project(x, ws, tuple(_cast(b, dtype) for b in bs))
    elif isinstance(pre[0], Cached):
        cached, pre = pre[0], ()
    elif isinstance(pre[0], Kept):
        pre = tuple(p.whole() for p in pre)
    # Peak memory (one block: fewer than _SPLIT_ROWS rows, or create_graph): each [tokens, d_ff] gradient is dropped
    # as soon as it is used and h is recomputed last, so at most three such tensors (dh, d_gate, d_up) live beside
    # gate and up; eager autograd has up to seven (tests/test_modules.py::test_backward_peak_memory_below_eager).
    d_x, d_ws, d_bs, d_wd = None, [None] * k, [None] * k, None
    want_pre = n_x or any(n_ws) or any(n_bs)
    if want_pre:
        if pre:
            d_pre = _act_backward(op, dy.matmul(wd), pre)
        else:  # the FP8 cache (want_pre: _backward kept it whole): d_pre and h from one pass, h used at once
            d_pre, h = cached.step(_rows(dy.matmul(wd)))
            if n_wd:
                d_wd = _wgrad(h, _rows(dy)) if ctx.transposed else _wgrad(_rows(dy), h)
            del h, cached
        for i in range(k):
            if n_x:  # dx = d_gate @ w_gate + d_up @ w_up: the sum in the second GEMM
                d_x = d_pre[i].matmul(ws[i]) if d_x is None else _rows(d_x).addmm_(_rows(d_pre[i]), ws[i])
            d_ws[i], d_bs[i] = _param_grads(x, d_pre[i], n_ws[i], n_bs[i], ctx.transposed)
            d_pre[i] = None
        d_x = None if d_x is None else d_x.reshape(x.shape)
    if n_wd and d_wd is None:  # recompute h
        h = _rows(_activate(op, pre))
        d_wd = _wgrad(h, _rows(dy)) if ctx.transposed else _wgrad(_rows(dy), h)
    d_bd = _rows(dy).sum(0) if n_bd else None
    return (d_x, *d_ws, d_wd, *d_bs, d_bd)


def _in_blocks(x) -> bool:
    """Whether the forward makes h (the plain MLP's act(z)) a block of rows at a time (_SPLIT_ROWS rows or more); not
    under torch.compile, whose inductor plans the buffers itself."""
    return x.numel() // max(x.shape[-1], 1) >= _SPLIT_ROWS and not torch.compiler.is_compiling()


def _step(rows: int) -> int:
    return max(1, _MIN_BLOCK_ROWS, -(-rows // _INPLACE_BLOCKS))


def _blocked_down(op, pre, wd, bd, x):
    """down(op(pre)) with h made _INPLACE_BLOCKS blocks of rows at a time, each block's output written into y: the
    forward's peak is the projections and a block of h (and, on the CPU, of act(gate)) instead of the projections,
    h and act(gate). None where F.linear would have cast differently (down's dtype not the projections', without
    autocast): the caller then runs it whole."""
    dtype = pre[0].dtype
    if (wd.dtype != dtype or (bd is not None and bd.dtype != dtype)) and not _autocasting(x):
        return None
    wd, bd = _cast(wd, dtype), _cast(bd, dtype)
    rows = [_rows(p) for p in pre]
    n = rows[0].shape[0]
    y = rows[0].new_empty((n, wd.shape[0]))
    step = _step(n)
    with _no_autocast(x):
        for s in range(0, n, step):
            h = _activate(op, tuple(p[s : s + step] for p in rows))
            if bd is None:
                torch.mm(h, wd.t(), out=y[s : s + step])
            else:
                torch.addmm(bd, h, wd.t(), out=y[s : s + step])
            del h
    return _unview(y, (*x.shape[:-1], wd.shape[0]))


def _autocasting(x) -> bool:
    device = x.device.type
    return _autocast_available(device) and torch.is_autocast_enabled(device)


def _owned(t):
    """A tensor on t's memory with a version counter of its own: the backward writes its gradients there over a
    projection it saved, so that a second backward (retain_graph=True) finds ctx.pre_spent and recomputes the
    projection instead of failing autograd's version check on it (tests/test_ffn_layer.py::test_retain_graph)."""
    return t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


def _release(t):
    """Frees t's memory now: a saved projection the backward has written over and used (_owned), which autograd's
    reference would otherwise hold to the end of the backward. Only spent buffers: ctx.pre_spent keeps a second
    backward from reading them."""
    t.untyped_storage().resize_(0)


def _inplace_backward(ctx, dy, x, ws, wd, bs, n_x, n_ws, n_wd, n_bs, n_bd, pre=()):
    """The gated MLPs' backward from _SPLIT_ROWS rows, written over buffers it owns: the saved projections (or those
    it recomputes, `pre` empty), or new ones where `pre` is the saved_dtype cache (Kept), which it reads a block at
    a time. Over _INPLACE_BLOCKS blocks of rows: the block's h, for the down projection's
    weight gradient (accumulated in its dtype), then its dh and the gating's backward of it, copied over the
    block's projections; then the input and weight gradients of the whole projections, one GEMM each. Peak: the
    projections (2 [rows, d_ff] tensors) and a few blocks (eager autograd: about 6 [rows, d_ff] tensors)."""
    k, op, dtype, wd_dtype = ctx.k, ctx.op, ctx.dtype, wd.dtype
    dy, x, wd = _cast(dy, dtype), _cast(x, dtype), _cast(wd, dtype)
    ws = tuple(_cast(w, dtype) for w in ws)
    want_pre = n_x or any(n_ws) or any(n_bs)
    kept = pre if pre and isinstance(pre[0], (Kept, Cached)) else None  # saved_dtype: read a block at a time, into
    # new buffers (the cached backward's: gate_up's [rows, 2M] or gate's and up's [rows, M])
    cached = kept[0] if kept and isinstance(kept[0], Cached) else None
    if cached is not None:
        m = cached.q.shape[-1] // 2
        pre = tuple(dy.new_empty((cached.q.shape[0], 2 * m // k), dtype=dtype) for _ in range(k))
    elif kept:
        pre = tuple(dy.new_empty(p.q.shape, dtype=dtype) for p in kept) if want_pre else ()
    owned = bool(pre) and not kept  # the saved projections, written over
    if owned:
        ctx.pre_spent = True  # before the first write: a backward that fails midway leaves them spent too
        pre = tuple(_owned(p) for p in pre)
    elif not kept:
        pre = _project(x, ws, tuple(_cast(b, dtype) for b in bs))
    dyr = _rows(dy)
    d_x, d_ws, d_bs, d_wd = None, [None] * k, [None] * k, None
    d_bd = dyr.sum(0) if n_bd else None
    d_pre = [_rows(p) for p in pre]  # (a view where pre is contiguous; else a copy, as much ours)
    del pre
    n = dyr.shape[0]
    step = _step(n)
    for s in range(0, n, step):
        out, dys = [p[s : s + step] for p in d_pre], dyr[s : s + step]
        if cached is not None:  # (want_pre: _backward made the cache Kept halves where only h is wanted)
            grads, h = cached.step(dys.matmul(wd), slice(s, s + step))
            if n_wd:
                d_wd = _acc_mm(d_wd, dys, h, wd_dtype)
            del h
            for i in range(k):
                out[i].copy_(grads[i])
            del grads, out
            continue
        block = [p[s : s + step] for p in kept] if kept else out
        if n_wd and want_pre and _fused_form(op, k):  # d_gate, d_up and h in one pass, h used at once
            *grads, h = op.backward_recompute(dys.matmul(wd), *block)
            d_wd = _acc_mm(d_wd, dys, h, wd_dtype)
            del h, block
            dst = out if k == 2 else out[0].chunk(2, -1)
            for i in range(2):
                dst[i].copy_(grads[i])
            del grads, out, dst
            continue
        if n_wd:  # h of the block, for the down projection's weight gradient, accumulated in its dtype
            h = _activate(op, block)
            d_wd = _acc_mm(d_wd, dys, h, wd_dtype)
            del h
        if want_pre:
            grads = _act_backward(op, dys.matmul(wd), block)
            for i in range(k):
                out[i].copy_(grads[i])
            del grads
        del block, out
    if want_pre:
        for i in range(k):
            if n_x:  # dx = d_gate @ w_gate + d_up @ w_up: the sum in the second GEMM
                d_x = d_pre[i].matmul(ws[i]) if d_x is None else d_x.addmm_(d_pre[i], ws[i])
            d_ws[i], d_bs[i] = _param_grads(x, d_pre[i], n_ws[i], n_bs[i])
            if owned:
                _release(d_pre[i])
            d_pre[i] = None
        d_x = None if d_x is None else d_x.reshape(x.shape)
    return (d_x, *d_ws, d_wd, *d_bs, d_bd)


def _chunked_backward(ctx, dy, x, ws, wd, bs, n_x, n_ws, n_wd, n_bs, n_bd, pre=(), step=1):
    """Backward over blocks of `step` rows: the block's projections (sliced from the saved `pre`, else recomputed),
    then its h (for the down projection's weight gradient; the plain MLP's comes with dz from one step), then its
    input gradients; weight and bias gradients
    accumulate across blocks in the parameters' dtype. Peak: the saved pre (2 x rows x d_ff elements, if any) and
    about 2.5 x step x d_ff (token_chunk: step = chunk // 2; the plain MLP: _PLAIN_BLOCK_ROWS; the default path under
    torch.compile: step = rows / 2)."""
    k, op, dtype = ctx.k, ctx.op, ctx.dtype
    xr, dyr = _cast(_rows(x), dtype), _cast(_rows(dy), dtype)
    wsc, wdc = tuple(_cast(w, dtype) for w in ws), _cast(wd, dtype)
    bsc = tuple(_cast(b, dtype) for b in bs)
    cached = pre[0] if pre and isinstance(pre[0], Cached) else None  # (want_pre: see _backward)
    pre_rows = () if cached is not None else tuple(_rows_of(p) for p in pre)
    n = xr.shape[0]
    d_x = xr.new_empty(xr.shape) if n_x else None
    d_ws, d_bs, d_wd, d_bd = [None] * k, [None] * k, None, None
    want_pre = n_x or any(n_ws) or any(n_bs)
    tr = ctx.transposed
    for s in range(0, n, step):
        xs, dys = xr[s : s + step], dyr[s : s + step]
        d_pre = None
        if cached is not None:  # d_pre and h from the FP8 cache in one pass
            pre = ()
            d_pre, h = cached.step(dys.matmul(wdc), slice(s, s + step))
        else:
            pre = tuple(p[s : s + step] for p in pre_rows) if pre_rows else _project(xs, wsc, bsc)
            if ctx.plain and want_pre and n_wd:  # d_fc1 and h = act(fc1) from one elementwise step
                d_pre, h = _backward_recompute(op, dys.matmul(wdc), pre[0])
                d_pre = [d_pre]
            elif want_pre and n_wd and k == 2:  # d_gate, d_up and h in one pass (a packed block's gradients would
                # be joined by a copy: its two passes cost no more)
                *d_pre, h = op.backward_recompute(dys.matmul(wdc), *pre)
            else:
                h = _activate(op, pre) if n_wd else None
        if n_wd:
            d_wd = _acc_mm(d_wd, h, dys, wd.dtype) if tr else _acc_mm(d_wd, dys, h, wd.dtype)
        del h  # before the gated backward's d_pre: a [step, d_ff] tensor fewer at its peak
        if n_bd:
            d_bd = _acc_sum(d_bd, dys, ctx.bd_dtype)
        if want_pre:
            if d_pre is None:
                d_pre = _act_backward(op, dys.matmul(wdc), pre)
            del pre
            for i in range(k):
                if n_x:
                    if i == 0:
                        torch.mm(d_pre[0], wsc[0], out=d_x[s : s + step])
                    else:
                        d_x[s : s + step].addmm_(d_pre[i], wsc[i])
                if n_ws[i]:
                    d_ws[i] = (
                        _acc_mm(d_ws[i], xs, d_pre[i], ws[i].dtype)
                        if tr
                        else _acc_mm(d_ws[i], d_pre[i], xs, ws[i].dtype)
                    )
                if n_bs[i]:
                    d_bs[i] = _acc_sum(d_bs[i], d_pre[i], bs[i].dtype)
                d_pre[i] = None
    if d_x is not None:
        d_x = d_x.reshape(x.shape)
    return (d_x, *d_ws, d_wd, *d_bs, d_bd)


# The Functions take the activation (the gated MLPs' Gating, the plain MLP's table name), recompute (bool),
# token_chunk (int or None) and saved_dtype (None or one of SAVED_DTYPES) first; their gradients are None.
class _GatedMLP(torch.autograd.Function):
    """y = down(gating(gate(x), up(x))); saves x, gate, up (recompute or token_chunk: x only); recomputes h in
    backward."""

    @staticmethod
    def forward(ctx, gating, recompute, chunk, saved, x, w_gate, w_up, w_down, b_gate, b_up, b_down):
        return _forward(ctx, gating, recompute, chunk, saved, x, (w_gate, w_up), w_down, (b_gate, b_up), b_down)

    @staticmethod
    def backward(ctx, dy):
        return (None, None, None, None, *_backward(ctx, dy, ctx.needs_input_grad[4:]))


class _GatedMLPPacked(torch.autograd.Function):
    """y = down(gating(gate_up(x))), the [..., 2*d_ff] projection's halves in the Gating's layout; saves x and gate_up
    (recompute or token_chunk: x only); recomputes h in backward."""

    @staticmethod
    def forward(ctx, gating, recompute, chunk, saved, x, w_gate_up, w_down, b_gate_up, b_down):
        return _forward(ctx, gating, recompute, chunk, saved, x, (w_gate_up,), w_down, (b_gate_up,), b_down)

    @staticmethod
    def backward(ctx, dy):
        return (None, None, None, None, *_backward(ctx, dy, ctx.needs_input_grad[4:]))


class _PlainMLP(torch.autograd.Function):
    """y = fc2(act(fc1(x))) for the table activation `activation`; saves x and z = fc1(x) (recompute or token_chunk:
    x only) and recomputes act(z) in backward (for fc2's weight gradient) from the step that computes dz. The
    weights come in nn.Linear layout, or (transposed=True) in Conv1D's [in, out] layout, read in place; their
    gradients come back in the layout given."""

    @staticmethod
    def forward(ctx, activation, recompute, chunk, saved, transposed, x, w_fc1, w_fc2, b_fc1, b_fc2):
        return _forward(
            ctx,
            activation,
            recompute,
            chunk,
            saved,
            x,
            (w_fc1,),
            w_fc2,
            (b_fc1,),
            b_fc2,
            plain=True,
            transposed=transposed,
        )

    @staticmethod
    def backward(ctx, dy):
        return (None, None, None, None, None, *_backward(ctx, dy, ctx.needs_input_grad[5:]))


def _plain(op, x, ws, wd, bs, bd, chunk):
    """The MLP without the autograd.Function (no grad mode, jit.trace, torch.func transforms): plain ops, over
    chunks with token_chunk."""
    if _chunks(x, chunk):
        return _chunked(op, x, ws, wd, bs, bd, chunk, functional=torch.is_grad_enabled() or torch.jit.is_tracing())[0]
    return F.linear(_activate(op, _project(x, ws, bs)), wd, bd)


def _no_meta(fn: str, x, weights: tuple) -> None:
    # A loop, not any(<generator>): this runs on every call, where a generator's cost is a visible share of a
    # 1-token MLP on the CPU (docs/performance.md#cpu-call-overhead).
    if x.is_meta:
        return
    for w in weights:
        if w.is_meta:
            raise ValueError(
                f"ffn_ext.{fn}: the weights are on the meta device (not loaded, or offloaded) but x is on "
                f"{x.device}; F.linear would read uninitialised memory. Load the weights first, or call "
                "the projections as modules so their hooks (accelerate's offload) bring them in"
            )


def _lean_autograd(fn: str, x, weights: tuple) -> bool:
    """Whether the functional forms run their autograd.Function. Not without grad mode (nothing to save; the plain
    ops skip its bookkeeping), under torch.jit.trace (it cannot record or save a Python autograd.Function), or
    under torch.func transforms and forward-mode AD (which it does not support): the plain ops serve those, and the
    ops' own autograd differentiates them. Weights on the meta device with a real x raise ValueError, as F.linear would return
    uninitialised memory."""
    _no_meta(fn, x, weights)
    return (
        torch.is_grad_enabled()
        and not torch.jit.is_tracing()
        and not _compat.functorch_active()
        and not _compat.has_tangent((x, *weights))
    )


def _activation(fn: str, activation) -> str:
    """The table name of a plain MLP's activation, or a ValueError naming it."""
    if not (isinstance(activation, str) and activation in BY_NAME):
        raise ValueError(f"ffn_ext.{fn}: `activation` must be one of {sorted(BY_NAME)}, got {activation!r}")
    return activation


def _gating(fn: str, activation) -> Gating:
    """The Gating of a gated MLP's `activation`: a table name ("silu", "gelu_tanh", ...: its gated op) or a Gating
    (any gated op with its parameters and, packed, its layout); a ValueError otherwise."""
    if isinstance(activation, Gating):
        return activation
    return _GATINGS.get(activation) or Gating.of(_activation(fn, activation))


_GATINGS = {a.name: Gating(a.gated) for a in ACTIVATIONS}
_SWIGLU = _GATINGS["silu"]


def _gelu(fn: str, approximate) -> Gating:
    return _GATINGS[activation_for("gelu", fn, approximate=approximate).name]


def check_options(fn: str, recompute, token_chunk) -> tuple:
    """(recompute, token_chunk) when valid for `fn` (the MLPs' memory options), else a ValueError naming the option."""
    if not isinstance(recompute, bool):
        raise ValueError(f"ffn_ext.{fn}: `recompute` must be True or False, got {recompute!r}")
    if token_chunk is not None and (
        isinstance(token_chunk, bool) or not isinstance(token_chunk, int) or token_chunk < 1
    ):
        raise ValueError(
            f"ffn_ext.{fn}: `token_chunk` must be None or a positive int (tokens per chunk), got {token_chunk!r}"
        )
    return recompute, token_chunk


_PLAIN = (torch.Tensor, nn.Parameter)
# "gated", "plain" -> the tensor-parallel MLP (DTensor weights, a local x), registered by ffn_ext.distributed (a
# higher layer: a hook, not an import)
_tp_mlps: dict = {}


def _tp(weights: tuple, x) -> bool:
    return bool(_tp_mlps) and _compat.has_dtensor(weights) and not _compat.has_dtensor((x,))


def _run(fn, g, x, ws, wd, bs, bd, recompute, token_chunk, saved_dtype=None):
    """Every gated functional form: its Gating `g`, the projections ((w_gate, w_up) or (w_gate_up,)), the options;
    the autograd.Function where _lean_autograd says so, else the plain ops."""
    if recompute is not False or token_chunk is not None:
        recompute, token_chunk = check_options(fn, recompute, token_chunk)
    if saved_dtype is not None:
        saved_dtype = check_saved_dtype(fn, saved_dtype, wd.shape[-1], recompute, token_chunk)
    if type(ws[0]) not in _PLAIN and len(ws) == 2 and _tp(ws, x):  # tensor-parallel weights (shard_gated_ffns)
        return _tp_mlps["gated"](
            x, *ws, wd, *bs, bd, activation=g, recompute=recompute, token_chunk=token_chunk, saved_dtype=saved_dtype
        )
    if _lean_autograd(fn, x, (*ws, wd)):
        if len(ws) == 1:
            return _GatedMLPPacked.apply(g, recompute, token_chunk, saved_dtype, x, ws[0], wd, bs[0], bd)
        return _GatedMLP.apply(g, recompute, token_chunk, saved_dtype, x, ws[0], ws[1], wd, bs[0], bs[1], bd)
    return _plain(g, x, ws, wd, bs, bd, token_chunk)


_OPTIONS_DOC = """
    Memory (training): by default the autograd saves x and the projections gate and up ([tokens, d_ff] each;
    packed: gate_up) and recomputes h in backward. recompute=True saves only x (and the weights) and recomputes the
    projections in backward: one more GEMM pass (two for the separate projections' halves: the same FLOPs as the
    forward's gate/up GEMMs), nothing [tokens, d_ff]-sized kept between forward and backward. token_chunk=N runs
    the forward (also without grad mode) and the backward over chunks of N tokens (leading dims flattened; the
    backward in chunks of N // 2), so no tensor inside the MLP has more than N x 2*d_ff elements; it implies
    recompute. Weight and bias gradients accumulate across chunks in the parameters' dtype (under autocast with
    fp32 parameters, not rounded to 16 bits per chunk). token_chunk >= the token count is the default path. Under
    create_graph=True (double backward) the backward of a token_chunk call recomputes the projections whole.

    saved_dtype=torch.float8_e4m3fn keeps gate and up for backward in FP8 with a float32 scale per 1 x 128 group of
    each row (64 or 32 where d_ff is no multiple of 128; DeepSeek-V3's activation cache): half of their bf16 bytes
    (a quarter of eager's four [tokens, d_ff] tensors); saved_dtype=torch.bfloat16 keeps half of fp32's. The
    forward's output is unchanged, bit for bit; the backward reads them back a block of rows at a time, so its
    gradients carry their rounding (FP8: a few percent). Not with recompute=True or token_chunk (nothing kept), and create_graph=True recomputes the
    projections from x; any other value is a ValueError."""


def gated_mlp(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    b_gate: torch.Tensor | None = None,
    b_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    activation: str | Gating = "silu",
    *,
    recompute: bool = False,
    token_chunk: int | None = None,
    saved_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """down(act(x @ w_gate^T + b_gate) * (x @ w_up^T + b_up)) with the lean autograd, for the table activation
    `activation` ("silu", "gelu", "gelu_tanh", ...; a ValueError otherwise).

    Weights in nn.Linear layout: w_gate, w_up [d_ff, d_model], w_down [d_model, d_ff]. Without grad mode (no_grad,
    inference_mode), under torch.jit.trace and under torch.func transforms or forward-mode AD, the plain ops run
    instead (_lean_autograd). Weights on the meta device with a real x raise ValueError."""
    return _run(
        "gated_mlp",
        _gating("gated_mlp", activation),
        x,
        (w_gate, w_up),
        w_down,
        (b_gate, b_up),
        b_down,
        recompute,
        token_chunk,
        saved_dtype,
    )


def gated_mlp_packed(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    activation: str | Gating = "silu",
    *,
    recompute: bool = False,
    token_chunk: int | None = None,
    saved_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Same for a packed gate/up projection: w_gate_up [2*d_ff, d_model], gate rows first (one GEMM for both; the
    backward's dx and weight gradient are one GEMM each too). Saves x and gate_up [tokens, 2*d_ff]."""
    return _run(
        "gated_mlp_packed",
        _gating("gated_mlp_packed", activation),
        x,
        (w_gate_up,),
        w_down,
        (b_gate_up,),
        b_down,
        recompute,
        token_chunk,
        saved_dtype,
    )


def swiglu_mlp(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    b_gate: torch.Tensor | None = None,
    b_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    *,
    recompute: bool = False,
    token_chunk: int | None = None,
    saved_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """down(silu(x @ w_gate^T + b_gate) * (x @ w_up^T + b_up)) with the lean autograd: gated_mlp(...,
    activation="silu")."""
    return _run(
        "swiglu_mlp", _SWIGLU, x, (w_gate, w_up), w_down, (b_gate, b_up), b_down, recompute, token_chunk, saved_dtype
    )


def swiglu_mlp_packed(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    *,
    recompute: bool = False,
    token_chunk: int | None = None,
    saved_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Same for a packed gate/up projection (Phi-3, SwiGLUFFN(fused_gate_up=True)): w_gate_up [2*d_ff, d_model],
    gate rows first. Saves x and gate_up [tokens, 2*d_ff]."""
    return _run(
        "swiglu_mlp_packed",
        _SWIGLU,
        x,
        (w_gate_up,),
        w_down,
        (b_gate_up,),
        b_down,
        recompute,
        token_chunk,
        saved_dtype,
    )


def geglu_mlp(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    b_gate: torch.Tensor | None = None,
    b_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    approximate: str = "none",
    *,
    recompute: bool = False,
    token_chunk: int | None = None,
    saved_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """down(gelu(x @ w_gate^T + b_gate, approximate) * (x @ w_up^T + b_up)) with the lean autograd; approximate as
    F.gelu's: "none" (exact, erf) or "tanh" (Gemma's gelu_pytorch_tanh): gated_mlp with "gelu" / "gelu_tanh"."""
    return _run(
        "geglu_mlp",
        _gelu("geglu_mlp", approximate),
        x,
        (w_gate, w_up),
        w_down,
        (b_gate, b_up),
        b_down,
        recompute,
        token_chunk,
        saved_dtype,
    )


def geglu_mlp_packed(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    approximate: str = "none",
    *,
    recompute: bool = False,
    token_chunk: int | None = None,
    saved_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Same for a packed gate/up projection: w_gate_up [2*d_ff, d_model], gate rows first."""
    return _run(
        "geglu_mlp_packed",
        _gelu("geglu_mlp_packed", approximate),
        x,
        (w_gate_up,),
        w_down,
        (b_gate_up,),
        b_down,
        recompute,
        token_chunk,
        saved_dtype,
    )


def plain_mlp(
    x: torch.Tensor,
    w_fc1: torch.Tensor,
    w_fc2: torch.Tensor,
    b_fc1: torch.Tensor | None = None,
    b_fc2: torch.Tensor | None = None,
    activation: str = "gelu",
    *,
    recompute: bool = False,
    token_chunk: int | None = None,
    saved_dtype: torch.dtype | None = None,
    transposed: bool = False,
) -> torch.Tensor:
    """The classic FFN, fc2(act(fc1(x))) = act(x @ w_fc1^T + b_fc1) @ w_fc2^T + b_fc2, with the lean autograd, for
    the table activation `activation` ("gelu", "gelu_tanh", "silu", ...; a ValueError otherwise).

    Weights in nn.Linear layout: w_fc1 [d_ff, d_model], w_fc2 [d_model, d_ff]; transposed=True takes GPT-2's Conv1D
    layout instead (w_fc1 [d_model, d_ff], w_fc2 [d_ff, d_model]: x @ W + b), read in place, never copied, and
    their gradients come back in that layout.

    Memory (training): saves x and z = fc1(x) (one [tokens, d_ff] tensor; eager autograd keeps two, z and act(z))
    and recomputes act(z) in backward from the step that computes dz = d(act) * act'(z); the backward runs over
    blocks of rows so that its temporaries stay a fraction of z. recompute=True saves only x (backward recomputes
    fc1: one more GEMM); token_chunk=N runs forward and backward over chunks of N tokens (implies recompute), so no
    tensor inside has more than N x d_ff elements; weight gradients accumulate in the parameters' dtype.
    saved_dtype keeps z in FP8 or bf16, as the gated MLPs' gate and up (_OPTIONS_DOC).

    Without grad mode, under torch.jit.trace and under torch.func transforms the plain ops run (_lean_autograd).
    Weights on the meta device with a real x raise ValueError."""
    a = _activation("plain_mlp", activation)
    if recompute is not False or token_chunk is not None:
        recompute, token_chunk = check_options("plain_mlp", recompute, token_chunk)
    transposed = _transposed(transposed)
    if saved_dtype is not None:
        d_ff = w_fc2.shape[0 if transposed else -1]
        saved_dtype = check_saved_dtype("plain_mlp", saved_dtype, d_ff, recompute, token_chunk)
    if type(w_fc1) not in _PLAIN and _tp((w_fc1, w_fc2), x):  # tensor-parallel weights (shard_plain_ffns)
        return _tp_mlps["plain"](
            x,
            w_fc1,
            w_fc2,
            b_fc1,
            b_fc2,
            activation=a,
            recompute=recompute,
            token_chunk=token_chunk,
            saved_dtype=saved_dtype,
            transposed=transposed,
        )
    if _lean_autograd("plain_mlp", x, (w_fc1, w_fc2)):
        return _PlainMLP.apply(a, recompute, token_chunk, saved_dtype, transposed, x, w_fc1, w_fc2, b_fc1, b_fc2)
    if transposed:
        w_fc1, w_fc2 = w_fc1.t(), w_fc2.t()  # views: F.linear's GEMM reads them transposed
    return _plain(a, x, (w_fc1,), w_fc2, (b_fc1,), b_fc2, token_chunk)


def _transposed(transposed) -> bool:
    if not isinstance(transposed, bool):
        raise ValueError(f"ffn_ext.plain_mlp: `transposed` must be True or False, got {transposed!r}")
    return transposed


for _f in (gated_mlp, gated_mlp_packed, swiglu_mlp, swiglu_mlp_packed, geglu_mlp, geglu_mlp_packed):
    assert _f.__doc__ is not None  # each has a docstring (python -OO: a TypeError below, as before)
    _f.__doc__ += _OPTIONS_DOC
del _f


# ---------------------------------------------------------------- may a module's submodules be bypassed?
# A decode step's MLP is bound by host time, so the fused forwards read submodules and parameters from the modules'
# dicts (nn.Module.__getattr__ costs about a microsecond per attribute) and check hooks as nn.Module.__call__ does,
# without building generators. The hook dicts are torch-private: _compat reads them.


def fusable(linears: tuple, others: tuple = ()) -> bool:
    """True when `linears` are plain nn.Linear and no hook (forward or backward, on these modules or global) would
    see them or `others` run, nor a forward set on the instance (accelerate's add_hook_to_module wraps forward so,
    and with CPU/disk offload only that wrapper brings the weights in from meta); otherwise the modules must run
    as modules."""
    if _compat.global_module_hooks():
        return False
    for lin in linears:
        if type(lin) is not nn.Linear:
            return False
    for mod in linears + others:
        if _compat.module_hooks(mod) or "forward" in mod.__dict__ or "_hf_hook" in mod.__dict__:
            return False
    return True


# overloads: the two or three projections the modules pass, so a call's *linear_args(...) has a known length
@overload
def linear_args(
    a: nn.Linear, b: nn.Linear, /
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]: ...
@overload
def linear_args(
    a: nn.Linear, b: nn.Linear, c: nn.Linear, /
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]: ...
@overload
def linear_args(*linears: nn.Linear) -> tuple: ...
def linear_args(*linears: nn.Linear) -> tuple:
    """The weights, then the biases, of nn.Linear modules (the argument order of gated_mlp and gated_mlp_packed),
    as lin.weight and lin.bias would give them (also what torch.func.functional_call swapped in, and plain tensor
    attributes assigned in place of the parameters)."""
    weights, biases = [], []
    for lin in linears:  # a plain loop: generators cost microseconds here
        p = lin._parameters
        weights.append(p["weight"] if "weight" in p else lin.weight)
        biases.append(p["bias"] if "bias" in p else lin.bias)
    return (*weights, *biases)
