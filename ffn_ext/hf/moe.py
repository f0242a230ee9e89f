"""transformers' experts implementation "ffn_ext": `model.set_experts_implementation("ffn_ext")` (or
`from_pretrained(..., experts_implementation="ffn_ext")`) after `register()` routes the forward of every
@use_experts_implementation experts class to `ffn_ext_experts_forward`.

It computes what transformers' grouped_mm_experts_forward computes (tokens sorted by expert, grouped GEMMs, biases
per row, transposed weights, post-expert norm, routing weights, the sum over top_k), with the gating by ffn_ext's op
read in place from the [S, 2I] projection, and a lean autograd: backward keeps the layer's input and that projection
only (not act(gate), up, their product, the down projection's output), and recomputes the gating from it. Classes
whose gating is not an ffn_ext op, non-gated experts and expert parallelism run transformers' grouped_mm, named once
per class in a RuntimeWarning.

transformers is imported by register() only, and only when it is installed."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings

import torch
import torch.nn.functional as F

from .. import mlp
from . import forms
from .common import Gating, guards_hold

_BLOCKS = mlp._INPLACE_BLOCKS  # the gating's backward in blocks of rows, each copied over its block of gate_up

_RECOGNISED = "_ffn_ext_experts_gate"  # the instance's recognised and checked gating, once (guards: every call)


def _gating(module) -> Gating | None:
    """`module`'s gating by ffn_ext's op (gate_up [S, 2I] -> [S, I], read in place), or None when it is not one
    ffn_ext computes: recognised from the class's _apply_gate and self-checked as patch_model does (forms.plan with
    the experts' form)."""
    found = module.__dict__.get(_RECOGNISED)
    if found is None:
        patched = module.__dict__.get("_apply_gate")
        if isinstance(patched, forms.Patched):  # patch_model recognised and checked it: its plan (recognising the
            found = (patched.form, patched.plan)  # instance again would see its own patch there, and refuse)
        else:
            found = forms.plan(module, forms=(forms.EXPERTS,)) or "not gated experts"
        module.__dict__[_RECOGNISED] = found
    if isinstance(found, str) or not guards_hold(module, found[1].guards):
        return None
    return forms.EXPERTS.gating(module, found[1])


IMPLEMENTATION = "ffn_ext"


def register() -> bool:
    """Register ffn_ext_experts_forward as transformers' experts implementation "ffn_ext" (idempotent). False, and
    nothing imported, when transformers is not installed; False when its version has no ExpertsInterface."""
    if importlib.util.find_spec("transformers") is None:
        return False
    try:
        from transformers.integrations import moe
    except ImportError:
        return False
    interface = getattr(moe, "ExpertsInterface", None)
    if interface is None:
        return False
    if interface._global_mapping.get(IMPLEMENTATION) is not ffn_ext_experts_forward:
        interface.register(IMPLEMENTATION, ffn_ext_experts_forward)
    return True


_warned: set = set()


def _fallback(module, reason: str, hidden_states, top_k_index, top_k_weights):
    cls = type(module)
    if cls not in _warned:
        _warned.add(cls)
        warnings.warn(
            f"ffn_ext experts implementation: {cls.__module__}.{cls.__qualname__} runs transformers' grouped_mm "
            f"instead ({reason})",
            RuntimeWarning,
            stacklevel=3,
        )
    from transformers.integrations.moe import grouped_mm_experts_forward

    return grouped_mm_experts_forward(module, hidden_states, top_k_index, top_k_weights)


# ---------------------------------------------------------------- grouped GEMMs over the expert-sorted rows
def _grouped_fn():
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _aligned(t: torch.Tensor) -> bool:
    # the CPU kernel requires 16-byte aligned data and strides (a hidden size not a multiple of 4 in fp32 fails)
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all(s * size % 16 == 0 for s, n in zip(t.stride(), t.shape) if s != 1 and n > 1)


def _can_group(*tensors) -> bool:
    """Whether torch's grouped_mm serves these operands, as transformers' _can_use_grouped_mm decides (SM80+ on
    CUDA; a CPU kernel from torch 2.9), plus the CPU kernel's 16-byte alignment of data and strides, which not every
    size meets; not under torch.compile with other dtypes than bf16 (inductor lowers it for bf16 only)."""
    fn = _grouped_fn()
    t = tensors[-1]
    if fn is None or (torch.compiler.is_compiling() and t.dtype != torch.bfloat16):
        return False
    if t.device.type == "cuda":
        return torch.cuda.get_device_capability(t.device) >= (8, 0)
    if t.device.type == "cpu":
        major, minor = (int(v) for v in torch.__version__.split(".")[:2])
        return (major, minor) >= (2, 9) and all(_aligned(x) for x in tensors)
    return True


class _Groups:
    """The expert groups of the sorted rows: offs (int32, where each ends, on the rows' device) and, for the
    per-expert loop only, the same on the host (one sync, taken when a loop first needs it)."""

    def __init__(self, offs: torch.Tensor):
        self.offs = offs
        self._bounds: list | None = None

    @property
    def bounds(self) -> list:
        if self._bounds is None:
            self._bounds = self.offs.tolist()
        return self._bounds


def _gmm(a: torch.Tensor, b: torch.Tensor, groups: _Groups) -> torch.Tensor:
    """Rows of a [S, K] (sorted by expert) times b[e] [K, N] of their expert: [S, N]."""
    if _can_group(a, b):
        return _grouped_fn()(a, b, offs=groups.offs)
    out = a.new_zeros(a.shape[0], b.shape[-1])
    start = 0
    for e, end in enumerate(groups.bounds):
        if end > start:
            torch.mm(a[start:end], b[e], out=out[start:end])
        start = end
    return out


def _gmm_weight(a: torch.Tensor, b: torch.Tensor, groups: _Groups) -> torch.Tensor:
    """Per expert e, a[:, its rows] [M, S_e] times b[its rows] [S_e, N]: [E, M, N] (weight gradients; zeros for an
    expert without rows)."""
    if _can_group(a, b):
        return _grouped_fn()(a, b, offs=groups.offs)
    out = a.new_zeros(groups.offs.numel(), a.shape[0], b.shape[-1])
    start = 0
    for e, end in enumerate(groups.bounds):
        if end > start:
            torch.mm(a[:, start:end], b[start:end], out=out[e])
        start = end
    return out


def _rows_sum(rows: torch.Tensor, ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """A bias's gradient: the rows of each expert summed, in fp32."""
    out = torch.zeros(num_experts, rows.shape[-1], device=rows.device, dtype=torch.float32)
    return out.index_add_(0, ids, rows.float())


def _as_right(w: torch.Tensor, transposed: bool) -> torch.Tensor:
    # the [E, K, N] operand of x @ w[e]: transformers' weights are [E, N, K] unless is_transposed
    return w if transposed else w.transpose(-2, -1)


def _weight_grad(x, dy, transposed, groups):
    # the gradient of a weight of _as_right's layout, [E, K, N] if transposed else [E, N, K]: computed in its own
    # layout so that it comes out contiguous
    return _gmm_weight(x.t(), dy, groups) if transposed else _gmm_weight(dy.t(), x, groups)


# ---------------------------------------------------------------- the experts' forward and its lean backward
def _up(hidden_states, rows, ids, w_up, b_up, transposed, groups):
    """The [S, 2I] projection of the expert-sorted rows (plus their experts' biases)."""
    x = hidden_states[rows].to(w_up.dtype)
    gate_up = _gmm(x, _as_right(w_up, transposed), groups)
    if b_up is not None:
        gate_up += b_up[ids]
    return gate_up


def _down(h, ids, w_down, b_down, transposed, groups):
    y = _gmm(h, _as_right(w_down, transposed), groups)
    if b_down is not None:
        y += b_down[ids]
    return y


def _weighted(y, weights):
    return y if weights is None else y * weights.unsqueeze(-1)


def _inverse(perm):
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def _unsorted_sum(y, inv, top_k):
    """The expert-sorted rows y [S, H] back in token order, summed over top_k as transformers' implementations do it
    (a reshape and sum, deterministic): [S / top_k, H]."""
    return y[inv].view(-1, top_k, y.shape[-1]).sum(dim=1)


class _Experts(torch.autograd.Function):
    """The experts' output: with `inv` (the sorted rows' inverse permutation) the tokens' [T, H], the rows (times
    their routing weights) summed over top_k; without it (a post-expert norm comes between) the sorted rows' [S, H].
    Saves the unsorted input [T, H] (which the router's linear keeps alive too), the [S, 2I] projection and
    [S]-sized indices and weights; backward recomputes the gating from the projection, and gathers the rows'
    gradient from the tokens' itself (autograd's index backward would hold an [S, H] one through it)."""

    @staticmethod
    def forward(
        ctx,
        hidden_states,
        rows,
        ids,
        groups,
        w_up,
        b_up,
        w_down,
        b_down,
        weights,
        gating,
        transposed,
        saved,
        inv,
        top_k,
    ):
        gate_up = _up(hidden_states, rows, ids, w_up, b_up, transposed, groups)
        ctx.dtype, ctx.saved = gate_up.dtype, None if saved == gate_up.dtype else saved
        ctx.fused = ctx.saved is not None and mlp.cache_fusable(gating, saved, 1)
        if ctx.fused:  # h and the FP8 cache in one pass; backward's d_gate_up read from it in one too
            h, *kept = mlp.cache(gating, (gate_up,))
        else:
            h = gating(gate_up)
            kept = (gate_up, None) if ctx.saved is None else mlp.keep((gate_up,), saved, 2)  # saved_dtype: (q, scale)
        del gate_up  # (with saved_dtype: gone before the down projection's output is made)
        y = _down(h, ids, w_down, b_down, transposed, groups)
        del h
        biased = b_up is not None or b_down is not None  # (ids: the biases' rows only)
        ctx.save_for_backward(
            hidden_states, rows, ids if biased else None, groups.offs, *kept, w_up, b_up, w_down, b_down, weights
        )
        ctx.gating, ctx.transposed, ctx.bounds = gating, transposed, groups._bounds
        ctx.spent = False  # the backward writes d_gate_up over gate_up: a second one (retain_graph) recomputes it
        y = _weighted(y, weights)
        ctx.rows_dtype, ctx.reduced = y.dtype, inv is not None
        return y if inv is None else _unsorted_sum(y, inv, top_k)

    @staticmethod
    def backward(ctx, grad):
        hidden_states, rows, ids, offs, gate_up, scale, w_up, b_up, w_down, b_down, weights = ctx.saved_tensors
        gating, transposed = ctx.gating, ctx.transposed
        groups = _Groups(offs)
        groups._bounds = ctx.bounds
        need = ctx.needs_input_grad
        if ctx.reduced:  # the tokens' gradient to the sorted rows' (the sum's and the reorder's backward)
            grad = grad.to(ctx.rows_dtype)[rows]
        # Without grad mode (no create_graph) the gradients go over buffers this backward owns: d_gate_up over the
        # saved gate_up (or its recomputation, after an earlier backward wrote over it), dh over q; h is dropped once
        # the down projection's weight gradient is made. Peak: gate_up, h and q (4 [S, I] tensors; grouped_mm's
        # autograd: about 7), then gate_up, q and 2 / _BLOCKS of gate_up.
        inplace = not torch.is_grad_enabled() and not torch.compiler.is_compiling()
        kept, owned = None, False
        if ctx.saved is not None:  # kept in saved_dtype: read a block at a time in place (h, then d_gate_up into a
            # buffer made once h is gone), else whole
            kept = mlp.Kept(gate_up, scale, ctx.dtype)
            gate_up = None if inplace else kept.whole()
        elif ctx.spent:
            gate_up = _up(hidden_states, rows, ids, w_up, b_up, transposed, groups)
        elif inplace:
            ctx.spent = owned = True
            gate_up = mlp._owned(gate_up)
        gu = None
        if inplace and kept is not None:
            n, step = kept.q.shape[0], max(1, -(-kept.q.shape[0] // _BLOCKS))
            h = hidden_states.new_empty((n, kept.q.shape[-1] // 2), dtype=ctx.dtype)
            for s in range(0, n, step):
                h[s : s + step] = gating(kept[s : s + step])
        elif inplace:
            h = gating(gate_up)
        else:
            with torch.enable_grad():
                gu = gate_up.detach().requires_grad_()
                h = gating(gu)
        g = grad.to(w_down.dtype)
        # q = grad @ w_down[e]^T unweighted: the hidden gradient is q * weight, and the routing weight's gradient
        # <grad, y> = <q, h> + <grad, b_down[e]>, so y need not be recomputed
        q = _gmm(g, _as_right(w_down, transposed).transpose(-2, -1), groups)
        d_weights = None
        if weights is not None:
            if need[8]:
                d_weights = (q.float() * h.detach().float()).sum(-1)
                if b_down is not None:
                    d_weights += (grad.float() * b_down[ids].float()).sum(-1)
                d_weights = d_weights.to(weights.dtype)
            w = weights.unsqueeze(-1)
            if inplace and q.dtype == h.dtype:
                # dh over q, and the routing weights onto h, not onto a new [S, H] copy of grad: the down
                # projection's weight gradient (h w)^T grad is h^T (grad w) (in place: computed in the promoted
                # dtype and rounded once, as the product's .to would)
                dh, hw = q.mul_(w), h.mul_(w)
                gw = None
            else:
                dh, hw = (q * w).to(h.dtype), h.detach()
                g = gw = (grad * w).to(w_down.dtype)
        else:
            dh, hw, gw = q, h.detach(), g
        del q
        d_w_down = _weight_grad(hw, g, transposed, groups) if need[6] else None
        del hw, g
        d_b_down = None
        if b_down is not None and need[7]:
            gw = (grad * weights.unsqueeze(-1)).to(w_down.dtype) if gw is None else gw
            d_b_down = _rows_sum(gw, ids, w_down.shape[0]).to(b_down.dtype)
        del gw, grad  # (the rows' gradient: gone before the gating's backward)
        if inplace:
            h = None
            if kept is not None:
                gate_up = dh.new_empty(kept.q.shape, dtype=ctx.dtype)
            n = gate_up.shape[0]
            step = max(1, -(-n // _BLOCKS))
            for s in range(0, n, step):
                if ctx.fused:  # the FP8 cache read inside the kernel (its h is dropped at once: made above)
                    part = slice(s, s + step)
                    dg, du = gating.cached_backward(dh[part], kept.q[part], kept.scale[part])[:2]
                    half = dg.shape[-1]
                    gate_up[s : s + step, :half].copy_(dg)
                    gate_up[s : s + step, half:].copy_(du)
                    del dg, du
                    continue
                block = gate_up[s : s + step] if kept is None else kept[s : s + step]
                (d,) = gating.backward(dh[s : s + step], block)
                gate_up[s : s + step].copy_(d)
                del d, block
            d_gate_up = gate_up
        else:
            (d_gate_up,) = torch.autograd.grad(h, gu, dh)
        del h, gu, dh, gate_up
        d_b_up = _rows_sum(d_gate_up, ids, w_up.shape[0]).to(w_up.dtype) if b_up is not None and need[5] else None
        d_w_up = d_hidden = None
        if need[4]:
            x = hidden_states[rows].to(w_up.dtype)
            d_w_up = _weight_grad(x, d_gate_up, transposed, groups)
            del x  # (an [S, H] tensor: gone before dx, another)
        dx = _gmm(d_gate_up, _as_right(w_up, transposed).transpose(-2, -1), groups) if need[0] else None
        if owned:  # the saved gate_up, spent: autograd's reference would hold it to the end of this backward
            mlp._release(d_gate_up)
        del d_gate_up
        if need[0]:
            d_hidden = torch.zeros_like(hidden_states).index_add_(0, rows, dx.to(hidden_states.dtype))
        return d_hidden, None, None, None, d_w_up, d_b_up, d_w_down, d_b_down, d_weights, None, None, None, None, None


def ffn_ext_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' experts forward (hidden_states [T, H], top_k_index and top_k_weights [T, K]) -> [T, H] in
    hidden_states' dtype: grouped_mm_experts_forward's computation, the gating by ffn_ext's op (see the module
    docstring)."""
    if not getattr(self, "has_gate", True):
        return _fallback(self, "non-gated experts: act(up) is not a gating", hidden_states, top_k_index, top_k_weights)
    if getattr(self, "_is_expert_parallel", False):
        return _fallback(self, "expert parallelism", hidden_states, top_k_index, top_k_weights)
    gating = _gating(self)
    if gating is None:
        return _fallback(self, "its gating is not one ffn_ext op computes", hidden_states, top_k_index, top_k_weights)

    num_top_k = top_k_index.shape[-1]
    num_experts = self.gate_up_proj.shape[0]
    ids, perm = torch.sort(top_k_index.reshape(-1), stable=True)
    rows = perm // num_top_k
    # histc, as transformers: bincount's output size depends on the data (CUDA graphs); histc takes floats on the
    # CPU (and MPS) only, ints on CUDA
    counts = torch.histc(
        ids.float() if ids.device.type in ("cpu", "mps") else ids.int(), bins=num_experts, min=0, max=num_experts - 1
    )
    groups = _Groups(torch.cumsum(counts, 0, dtype=torch.int32))
    transposed = bool(getattr(self, "is_transposed", False))
    has_bias = bool(getattr(self, "has_bias", False))
    b_up = self.gate_up_proj_bias if has_bias else None
    b_down = self.down_proj_bias if has_bias else None
    norm = getattr(self, "has_post_expert_norm", False)
    weights = top_k_weights.reshape(-1)[perm]

    args = (hidden_states, rows, ids, groups, self.gate_up_proj, b_up, self.down_proj, b_down)
    fused_weights = None if norm else weights
    tensors = (hidden_states, self.gate_up_proj, self.down_proj, b_up, b_down, fused_weights)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        saved = forms.saved_dtype_of(self)
        if saved is not None:
            d_ff = self.down_proj.shape[-2 if transposed else -1]
            mlp.check_saved_dtype(f"experts of {type(self).__name__}", saved, d_ff)
        inv = None if norm else _inverse(perm)  # (the sum over top_k inside: see _Experts)
        out = _Experts.apply(*args, fused_weights, gating, transposed, saved, inv, num_top_k)
        if not norm:
            return out.to(hidden_states.dtype)
    else:
        gate_up = _up(hidden_states, rows, ids, self.gate_up_proj, b_up, transposed, groups)
        h = gating(gate_up)
        del gate_up
        out = _weighted(_down(h, ids, self.down_proj, b_down, transposed, groups), fused_weights)
    if norm:
        out = _weighted(self.post_expert_norm(out), weights)

    return _unsorted_sum(out, _inverse(perm), num_top_k).to(hidden_states.dtype)


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Registers "ffn_ext" right after transformers.integrations.moe is first imported, so that `import ffn_ext`
    need not import transformers (1.6 s) and a later from_pretrained(..., experts_implementation="ffn_ext") finds it."""

    def find_spec(self, name, path, target=None):
        if name != "transformers.integrations.moe":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            register()

        spec.loader.exec_module = exec_module
        return spec


def register_when_imported() -> None:
    """register() now if transformers' experts interface is loaded, else as soon as it is."""
    if "transformers.integrations.moe" in sys.modules:
        register()
    elif not any(isinstance(f, _RegisterOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport())
