"""nn.Modules on top of the ffn_ext ops: activations, a standard FFN and a memory-lean SwiGLU FFN.

    act = ffn_ext.SwiGLU();  h = act(gate, up)  or  act(gate_up)      # [..., 2M] -> [..., M]
    mlp = ffn_ext.SwiGLUFFN(896, 4864)   # gate_proj / up_proj / down_proj: loads a Llama/Qwen2 MLP state_dict
    ffn = ffn_ext.FFN(768, 3072, activation="gelu")

SwiGLUFFN's training memory: its autograd (``swiglu_mlp``) saves the input x and the two projections gate and up,
and recomputes h = silu(gate) * up in backward (for the down projection's weight gradient) instead of keeping it.
Eager PyTorch keeps four [tokens, d_ff] tensors (gate, silu(gate), up, h); this keeps two. The recompute is one
memory-bound elementwise pass (ffn_ext.swiglu) next to three GEMMs.

Double backward (create_graph=True, e.g. gradient penalties) is supported: when backward runs with grad mode on,
it recomputes gate and up from the saved x and weights with differentiable ops, so second derivatives flow to x,
the weights and the incoming gradient (checked with gradgradcheck). Plain backward never recomputes the GEMMs.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import ops as _ops
from .sizing import swiglu_hidden_dim

__all__ = ["GELU", "SiLU", "SwiGLU", "FFN", "SwiGLUFFN", "swiglu_mlp", "swiglu_mlp_packed"]


# ---------------------------------------------------------------- activation modules
class GELU(nn.Module):
    """GELU with nn.GELU's signature. approximate='none' (the default): exact (erf) GELU by ffn_ext.gelu.
    approximate='tanh' runs ATen's tanh form (ffn_ext implements only the exact one), so the module stays a drop-in
    for nn.GELU(approximate='tanh')."""

    approximate = "none"  # class defaults: modules pickled before these arguments existed still load

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"ffn_ext.GELU: approximate must be 'none' or 'tanh' (as nn.GELU), got {approximate!r}")
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ops.gelu(x) if self.approximate == "none" else F.gelu(x, approximate="tanh")

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class SiLU(nn.Module):
    """SiLU / swish, x * sigmoid(x), with nn.SiLU's signature; uses ffn_ext.silu. inplace=True overwrites x as
    nn.SiLU(inplace=True) does, with ATen's silu_ (ffn_ext has no in-place kernel)."""

    inplace = False

    def __init__(self, inplace: bool = False) -> None:
        super().__init__()
        self.inplace = inplace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(x, inplace=True) if self.inplace else _ops.silu(x)

    def extra_repr(self) -> str:
        return "inplace=True" if self.inplace else ""


class SwiGLU(nn.Module):
    """silu(gate) * up. ``SwiGLU()(gate, up)``; with one argument it takes the packed tensor [..., 2M] (gate first,
    then up, as ``chunk(2, -1)``) and returns [..., M]."""

    def forward(self, gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
        return _ops.swiglu_packed(gate) if up is None else _ops.swiglu(gate, up)


# ---------------------------------------------------------------- backward ops with an ATen fallback
_swiglu, _swiglu_packed = _ops.swiglu, _ops.swiglu_packed


def _swiglu_backward(grad, gate, up):
    if _ops._native_for(gate):
        return torch.ops.ffn_ext.swiglu_backward(grad, gate, up)
    s = torch.sigmoid(gate)
    return grad * up * (s * (1 + gate * (1 - s))), grad * (gate * s)


def _swiglu_packed_backward(grad, gate_up):
    if _ops._native_for(gate_up):
        return torch.ops.ffn_ext.swiglu_packed_backward(grad, gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.cat(_swiglu_backward(grad, gate, up), dim=-1)


def _cast(t, dtype):
    return t if t is None or t.dtype == dtype else t.to(dtype)


def _rows(t):  # [..., K] -> [N, K]
    return t.reshape(-1, t.shape[-1])


def _input_grads(x, d_pre, w_pre, need_x, need_w_pre, need_b_pre):
    """dx (contribution), dW and db of one input projection pre = x @ W^T + b, given d_pre."""
    dx = d_pre.matmul(w_pre) if need_x else None
    dw = _rows(d_pre).t().matmul(_rows(x)) if need_w_pre else None
    db = _rows(d_pre).sum(0) if need_b_pre else None
    return dx, dw, db


class _SwiGLUMLP(torch.autograd.Function):
    """y = down(silu(gate(x)) * up(x)); saves x, gate, up; recomputes h in backward."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, b_gate, b_up, b_down):
        gate = F.linear(x, w_gate, b_gate)
        up = F.linear(x, w_up, b_up)
        y = F.linear(_swiglu(gate, up), w_down, b_down)
        ctx.save_for_backward(x, gate, up, w_gate, w_up, w_down, b_gate, b_up)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, gate, up, w_gate, w_up, w_down, b_gate, b_up = ctx.saved_tensors
        n_x, n_wg, n_wu, n_wd, n_bg, n_bu, n_bd = ctx.needs_input_grad
        if torch.is_grad_enabled():  # create_graph=True: make gate/up functions of x and the weights again
            gate, up = F.linear(x, w_gate, b_gate), F.linear(x, w_up, b_up)
        dtype = gate.dtype  # differs from the parameters' dtype under autocast
        dy, x = _cast(dy, dtype), _cast(x, dtype)
        w_gate, w_up, w_down = _cast(w_gate, dtype), _cast(w_up, dtype), _cast(w_down, dtype)
        # Peak memory: each [tokens, d_ff] gradient is dropped as soon as it is used and h is recomputed last, so
        # at most three such tensors (dh, d_gate, d_up) live beside the saved gate and up; eager autograd has up to
        # seven (tests/test_modules.py::test_backward_peak_memory_below_eager).
        d_x = d_wg = d_wu = d_bg = d_bu = None
        if n_x or n_wg or n_wu or n_bg or n_bu:
            d_gate, d_up = _swiglu_backward(dy.matmul(w_down), gate, up)
            dx_g, d_wg, d_bg = _input_grads(x, d_gate, w_gate, n_x, n_wg, n_bg)
            del d_gate
            dx_u, d_wu, d_bu = _input_grads(x, d_up, w_up, n_x, n_wu, n_bu)
            del d_up
            d_x = dx_g + dx_u if n_x else None
        d_wd = _rows(dy).t().matmul(_rows(_swiglu(gate, up))) if n_wd else None  # the recompute
        d_bd = _rows(dy).sum(0) if n_bd else None
        return d_x, d_wg, d_wu, d_wd, d_bg, d_bu, d_bd


class _SwiGLUMLPPacked(torch.autograd.Function):
    """y = down(swiglu_packed(gate_up(x))); saves x and gate_up; recomputes h in backward."""

    @staticmethod
    def forward(ctx, x, w_gate_up, w_down, b_gate_up, b_down):
        gate_up = F.linear(x, w_gate_up, b_gate_up)
        y = F.linear(_swiglu_packed(gate_up), w_down, b_down)
        ctx.save_for_backward(x, gate_up, w_gate_up, w_down, b_gate_up)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, gate_up, w_gate_up, w_down, b_gate_up = ctx.saved_tensors
        n_x, n_wgu, n_wd, n_bgu, n_bd = ctx.needs_input_grad
        if torch.is_grad_enabled():
            gate_up = F.linear(x, w_gate_up, b_gate_up)
        dtype = gate_up.dtype
        dy, x, w_gate_up, w_down = _cast(dy, dtype), _cast(x, dtype), _cast(w_gate_up, dtype), _cast(w_down, dtype)
        d_x = d_wgu = d_bgu = None
        if n_x or n_wgu or n_bgu:  # the same order as _SwiGLUMLP.backward, for the same peak
            d_gate_up = _swiglu_packed_backward(dy.matmul(w_down), gate_up)
            d_x, d_wgu, d_bgu = _input_grads(x, d_gate_up, w_gate_up, n_x, n_wgu, n_bgu)
            del d_gate_up
        d_wd = _rows(dy).t().matmul(_rows(_swiglu_packed(gate_up))) if n_wd else None
        d_bd = _rows(dy).sum(0) if n_bd else None
        return d_x, d_wgu, d_wd, d_bgu, d_bd


def _lean_autograd(fn: str, x, weights: tuple) -> bool:
    """Whether swiglu_mlp(_packed) runs its autograd.Function. Not without grad mode (nothing to save; the plain
    ops skip its bookkeeping), under torch.jit.trace (it cannot record or save a Python autograd.Function), or
    under torch.func transforms and forward-mode AD (which it does not support; ops._transformed): the plain ops
    serve those. Weights on the meta device with a real x raise ValueError, as F.linear would return
    uninitialised memory."""
    if not x.is_meta and any(w.is_meta for w in weights):
        raise ValueError(f"ffn_ext.{fn}: the weights are on the meta device (not loaded, or offloaded) but x is on "
                         f"{x.device}; F.linear would read uninitialised memory. Load the weights first, or call "
                         "the projections as modules so their hooks (accelerate's offload) bring them in")
    return torch.is_grad_enabled() and not torch.jit.is_tracing() and not _ops._transformed((x, *weights))


def swiglu_mlp(x, w_gate, w_up, w_down, b_gate=None, b_up=None, b_down=None) -> torch.Tensor:
    """down(silu(x @ w_gate^T + b_gate) * (x @ w_up^T + b_up)) with the lean autograd (saves x, gate, up).

    Weights in nn.Linear layout: w_gate, w_up [d_ff, d_model], w_down [d_model, d_ff]. Without grad mode (no_grad,
    inference_mode), under torch.jit.trace and under torch.func transforms or forward-mode AD, the plain ops run
    instead (_lean_autograd). Weights on the meta device with a real x raise ValueError."""
    if _lean_autograd("swiglu_mlp", x, (w_gate, w_up, w_down)):
        return _SwiGLUMLP.apply(x, w_gate, w_up, w_down, b_gate, b_up, b_down)
    return F.linear(_swiglu(F.linear(x, w_gate, b_gate), F.linear(x, w_up, b_up)), w_down, b_down)


def swiglu_mlp_packed(x, w_gate_up, w_down, b_gate_up=None, b_down=None) -> torch.Tensor:
    """Same for a packed gate/up projection (Phi-3): w_gate_up [2*d_ff, d_model], gate rows first. Saves x and
    gate_up [tokens, 2*d_ff]."""
    if _lean_autograd("swiglu_mlp_packed", x, (w_gate_up, w_down)):
        return _SwiGLUMLPPacked.apply(x, w_gate_up, w_down, b_gate_up, b_down)
    return F.linear(_swiglu_packed(F.linear(x, w_gate_up, b_gate_up)), w_down, b_down)


# ---------------------------------------------------------------- FFN modules
# A decode step's MLP is bound by host time, so the fused forward reads submodules and parameters from the
# modules' dicts (nn.Module.__getattr__ costs about a microsecond per attribute) and checks hooks as
# nn.Module.__call__ does, without building generators.
_module_mod = nn.modules.module


def _fusable(linears: tuple, others: tuple = ()) -> bool:
    """True when `linears` are plain nn.Linear and no hook (forward or backward, on these modules or global) would
    see them or `others` run, nor a forward set on the instance (accelerate's add_hook_to_module wraps forward so,
    and with CPU/disk offload only that wrapper brings the weights in from meta); otherwise the modules must run
    as modules."""
    m = _module_mod
    if (m._global_forward_hooks or m._global_forward_pre_hooks or m._global_backward_hooks
            or m._global_backward_pre_hooks):
        return False
    for lin in linears:
        if type(lin) is not nn.Linear:
            return False
    for mod in linears + others:
        if (mod._forward_hooks or mod._forward_pre_hooks or mod._backward_hooks or mod._backward_pre_hooks
                or "forward" in mod.__dict__ or "_hf_hook" in mod.__dict__):
            return False
    return True


def _linear_args(*linears: nn.Linear) -> tuple:
    """The weights, then the biases, of nn.Linear modules (the argument order of swiglu_mlp and
    swiglu_mlp_packed), as lin.weight and lin.bias would give them."""
    weights, biases = [], []
    for lin in linears:  # a plain loop: generators cost microseconds here
        p = lin._parameters
        weights.append(p["weight"] if "weight" in p else lin.weight)
        biases.append(p["bias"] if "bias" in p else lin.bias)
    return (*weights, *biases)


_ACTIVATIONS = {"gelu": GELU, "silu": SiLU, "relu": nn.ReLU}


class FFN(nn.Module):
    """Standard transformer FFN: down_proj(act(up_proj(x))), d_model -> d_ff -> d_model.

    activation: "gelu" (exact erf GELU), "silu" or "relu"."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "gelu", bias: bool = False,
                 device=None, dtype=None):
        super().__init__()
        key = activation.lower() if isinstance(activation, str) else activation
        if key not in _ACTIVATIONS:
            raise ValueError(f"ffn_ext.FFN: unknown activation {activation!r}; expected one of "
                             f"{sorted(_ACTIVATIONS)} (for SwiGLU use ffn_ext.SwiGLUFFN)")
        self.activation = key
        self.up_proj = nn.Linear(d_model, d_ff, bias=bias, device=device, dtype=dtype)
        self.act = _ACTIVATIONS[key]()
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"


class SwiGLUFFN(nn.Module):
    """SwiGLU FFN: down_proj(silu(gate_proj(x)) * up_proj(x)), with the Llama/Qwen2 submodule names, so a Hugging
    Face MLP's state_dict loads unchanged.

    d_ff=None: the 8/3 rule rounded up to `multiple_of` (swiglu_hidden_dim). Training keeps two [tokens, d_ff]
    tensors (gate, up) instead of eager PyTorch's four; h is recomputed in backward. When hooks (forward or
    backward) are registered on the projections or on `act` (or globally), one of them has a forward wrapper set
    on the instance (accelerate's hooks, CPU/disk offload), a projection is not a plain nn.Linear (LoRA, quantized
    layers) or `act` was replaced by another module, the submodules run as modules, so the hooks and wrappers run
    and the replacement is what runs. torch.jit.trace records the plain ops (F.linear, ffn_ext.swiglu).
    """

    def __init__(self, d_model: int, d_ff: int | None = None, bias: bool = False, multiple_of: int = 256,
                 device=None, dtype=None):
        super().__init__()
        d_ff = swiglu_hidden_dim(d_model, multiple_of) if d_ff is None else d_ff
        self.d_model, self.d_ff = d_model, d_ff
        self.gate_proj = nn.Linear(d_model, d_ff, bias=bias, device=device, dtype=dtype)
        self.up_proj = nn.Linear(d_model, d_ff, bias=bias, device=device, dtype=dtype)
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias, device=device, dtype=dtype)
        self.act = SwiGLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mods = self._modules
        g, u, d, act = mods["gate_proj"], mods["up_proj"], mods["down_proj"], mods["act"]
        if type(act) is SwiGLU and _fusable((g, u, d), (act,)):
            return swiglu_mlp(x, *_linear_args(g, u, d))
        return d(act(g(x), u(x)))

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, d_ff={self.d_ff}"
