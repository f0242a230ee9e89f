"""The lean autograd of a gated MLP, y = down(act(gate(x)) * up(x)), for every activation of the table.

    y = ffn_ext.swiglu_mlp(x, w_gate, w_up, w_down)                       # silu (Llama, Qwen2, Mistral)
    y = ffn_ext.geglu_mlp(x, w_gate, w_up, w_down, approximate="tanh")    # tanh GELU (Gemma)
    y = ffn_ext.gated_mlp(x, w_gate, w_up, w_down, activation="gelu")     # any table activation by name
    y = ffn_ext.swiglu_mlp_packed(x, w_gate_up, w_down)                   # packed gate/up projection (Phi-3)

Weights in nn.Linear layout: w_gate, w_up [d_ff, d_model], w_down [d_model, d_ff], w_gate_up [2*d_ff, d_model]
(gate rows first); biases optional. Training memory: the autograd.Function saves the input x and the projections
gate and up (packed: gate_up) and recomputes h = act(gate) * up in backward (for the down projection's weight
gradient) instead of keeping it. Eager PyTorch keeps four [tokens, d_ff] tensors (gate, act(gate), up, h); this
keeps two. The recompute is one memory-bound elementwise pass next to three GEMMs. The activation is a table entry
(ffn_ext/table.py): the forward runs its gated op <gated> (or <gated>_packed), the backward <gated>_backward and
the recompute through ops.call_op / the functional API, natively where the native ops serve the tensors, else by
their ATen fallback.

Double backward (create_graph=True, e.g. gradient penalties) is supported: when backward runs with grad mode on,
it recomputes gate and up from the saved x and weights with differentiable ops, so second derivatives flow to x,
the weights and the incoming gradient (checked with gradgradcheck). Plain backward never recomputes the GEMMs.

Without grad mode (no_grad, inference_mode), under torch.jit.trace and under torch.func transforms or forward-mode
AD, the plain ops run instead of the autograd.Function (F.linear and the fused activation; see _lean_autograd).

``fusable`` and ``linear_args`` are what the modules (ffn_ext.GatedFFN) and Hugging Face patching (ffn_ext.hf) use
to decide whether a module's projections may be bypassed and to read their parameters cheaply.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import _compat
from . import ops as _ops
from .table import ACTIVATIONS

__all__ = ["gated_mlp", "gated_mlp_packed", "swiglu_mlp", "swiglu_mlp_packed", "geglu_mlp", "geglu_mlp_packed",
           "fusable", "linear_args"]


# activation name -> (its gated op, its packed op); _call is the functional API's path to an op (the native fast
# entry point, the dispatcher op or the ATen fallback), without the public functions' argument lookups: a decode
# step's MLP is bound by host time.
_OPS = {a.name: (a.gated, a.gated + "_packed") for a in ACTIVATIONS}
_call, _call_op = _ops._call, _ops.call_op


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


# The Functions take the activation's table name (a str, so torch.compile treats it as a constant) first; its
# gradient is None.
class _GatedMLP(torch.autograd.Function):
    """y = down(act(gate(x)) * up(x)) for the table activation `activation`; saves x, gate, up; recomputes h in
    backward."""

    @staticmethod
    def forward(ctx, activation, x, w_gate, w_up, w_down, b_gate, b_up, b_down):
        gate = F.linear(x, w_gate, b_gate)
        up = F.linear(x, w_up, b_up)
        y = F.linear(_call(_OPS[activation][0], (gate, up)), w_down, b_down)
        ctx.activation = activation
        ctx.save_for_backward(x, gate, up, w_gate, w_up, w_down, b_gate, b_up)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, gate, up, w_gate, w_up, w_down, b_gate, b_up = ctx.saved_tensors
        _, n_x, n_wg, n_wu, n_wd, n_bg, n_bu, n_bd = ctx.needs_input_grad
        activation = ctx.activation
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
            d_gate, d_up = _call_op(_OPS[activation][0] + "_backward", dy.matmul(w_down), gate, up)
            dx_g, d_wg, d_bg = _input_grads(x, d_gate, w_gate, n_x, n_wg, n_bg)
            del d_gate
            dx_u, d_wu, d_bu = _input_grads(x, d_up, w_up, n_x, n_wu, n_bu)
            del d_up
            d_x = dx_g + dx_u if n_x else None
        d_wd = _rows(dy).t().matmul(_rows(_call(_OPS[activation][0], (gate, up)))) if n_wd else None  # recompute
        d_bd = _rows(dy).sum(0) if n_bd else None
        return None, d_x, d_wg, d_wu, d_wd, d_bg, d_bu, d_bd


class _GatedMLPPacked(torch.autograd.Function):
    """y = down(act(gate) * up) with gate, up = gate_up(x).chunk(2, -1); saves x and gate_up; recomputes h in
    backward."""

    @staticmethod
    def forward(ctx, activation, x, w_gate_up, w_down, b_gate_up, b_down):
        gate_up = F.linear(x, w_gate_up, b_gate_up)
        y = F.linear(_call(_OPS[activation][1], (gate_up,)), w_down, b_down)
        ctx.activation = activation
        ctx.save_for_backward(x, gate_up, w_gate_up, w_down, b_gate_up)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, gate_up, w_gate_up, w_down, b_gate_up = ctx.saved_tensors
        _, n_x, n_wgu, n_wd, n_bgu, n_bd = ctx.needs_input_grad
        activation = ctx.activation
        if torch.is_grad_enabled():
            gate_up = F.linear(x, w_gate_up, b_gate_up)
        dtype = gate_up.dtype
        dy, x, w_gate_up, w_down = _cast(dy, dtype), _cast(x, dtype), _cast(w_gate_up, dtype), _cast(w_down, dtype)
        d_x = d_wgu = d_bgu = None
        if n_x or n_wgu or n_bgu:  # the same order as _GatedMLP.backward, for the same peak
            d_gate_up = _call_op(_OPS[activation][1] + "_backward", dy.matmul(w_down), gate_up)
            d_x, d_wgu, d_bgu = _input_grads(x, d_gate_up, w_gate_up, n_x, n_wgu, n_bgu)
            del d_gate_up
        d_wd = _rows(dy).t().matmul(_rows(_call(_OPS[activation][1], (gate_up,)))) if n_wd else None
        d_bd = _rows(dy).sum(0) if n_bd else None
        return None, d_x, d_wgu, d_wd, d_bgu, d_bd


def _lean_autograd(fn: str, x, weights: tuple) -> bool:
    """Whether the functional forms run their autograd.Function. Not without grad mode (nothing to save; the plain
    ops skip its bookkeeping), under torch.jit.trace (it cannot record or save a Python autograd.Function), or
    under torch.func transforms and forward-mode AD (which it does not support; ops._transformed): the plain ops
    serve those. Weights on the meta device with a real x raise ValueError, as F.linear would return
    uninitialised memory."""
    if not x.is_meta and any(w.is_meta for w in weights):
        raise ValueError(f"ffn_ext.{fn}: the weights are on the meta device (not loaded, or offloaded) but x is on "
                         f"{x.device}; F.linear would read uninitialised memory. Load the weights first, or call "
                         "the projections as modules so their hooks (accelerate's offload) bring them in")
    return torch.is_grad_enabled() and not torch.jit.is_tracing() and not _ops._transformed((x, *weights))


def _activation(fn: str, activation) -> str:
    if not (isinstance(activation, str) and activation in _OPS):
        raise ValueError(f"ffn_ext.{fn}: `activation` must be one of {sorted(_OPS)}, got {activation!r}")
    return activation


_GELUS = {a.api[1]["approximate"]: a.name for a in ACTIVATIONS if a.api[0] == "gelu"}  # "none" | "tanh" -> name


def _gelu(fn: str, approximate) -> str:
    act = _GELUS.get(approximate) if isinstance(approximate, str) else None
    if act is None:
        raise ValueError(f"ffn_ext.{fn}: `approximate` must be one of {sorted(_GELUS)}, got {approximate!r}")
    return act


# Each functional form: the activation's name, then the autograd.Function or the plain ops (written out in each:
# a decode step's MLP is bound by host time, and a shared helper is one more Python call).
def gated_mlp(x, w_gate, w_up, w_down, b_gate=None, b_up=None, b_down=None, activation: str = "silu"):
    """down(act(x @ w_gate^T + b_gate) * (x @ w_up^T + b_up)) with the lean autograd (saves x, gate, up), for the
    table activation `activation` ("silu", "gelu", "gelu_tanh", ...; a ValueError otherwise).

    Weights in nn.Linear layout: w_gate, w_up [d_ff, d_model], w_down [d_model, d_ff]. Without grad mode (no_grad,
    inference_mode), under torch.jit.trace and under torch.func transforms or forward-mode AD, the plain ops run
    instead (_lean_autograd). Weights on the meta device with a real x raise ValueError."""
    a = _activation("gated_mlp", activation)
    if _lean_autograd("gated_mlp", x, (w_gate, w_up, w_down)):
        return _GatedMLP.apply(a, x, w_gate, w_up, w_down, b_gate, b_up, b_down)
    return F.linear(_call(_OPS[a][0], (F.linear(x, w_gate, b_gate), F.linear(x, w_up, b_up))), w_down, b_down)


def gated_mlp_packed(x, w_gate_up, w_down, b_gate_up=None, b_down=None, activation: str = "silu"):
    """Same for a packed gate/up projection: w_gate_up [2*d_ff, d_model], gate rows first. Saves x and gate_up
    [tokens, 2*d_ff]."""
    a = _activation("gated_mlp_packed", activation)
    if _lean_autograd("gated_mlp_packed", x, (w_gate_up, w_down)):
        return _GatedMLPPacked.apply(a, x, w_gate_up, w_down, b_gate_up, b_down)
    return F.linear(_call(_OPS[a][1], (F.linear(x, w_gate_up, b_gate_up),)), w_down, b_down)


def swiglu_mlp(x, w_gate, w_up, w_down, b_gate=None, b_up=None, b_down=None) -> torch.Tensor:
    """down(silu(x @ w_gate^T + b_gate) * (x @ w_up^T + b_up)) with the lean autograd (saves x, gate, up):
    gated_mlp(..., activation="silu")."""
    if _lean_autograd("swiglu_mlp", x, (w_gate, w_up, w_down)):
        return _GatedMLP.apply("silu", x, w_gate, w_up, w_down, b_gate, b_up, b_down)
    return F.linear(_call(_OPS["silu"][0], (F.linear(x, w_gate, b_gate), F.linear(x, w_up, b_up))), w_down, b_down)


def swiglu_mlp_packed(x, w_gate_up, w_down, b_gate_up=None, b_down=None) -> torch.Tensor:
    """Same for a packed gate/up projection (Phi-3): w_gate_up [2*d_ff, d_model], gate rows first. Saves x and
    gate_up [tokens, 2*d_ff]."""
    if _lean_autograd("swiglu_mlp_packed", x, (w_gate_up, w_down)):
        return _GatedMLPPacked.apply("silu", x, w_gate_up, w_down, b_gate_up, b_down)
    return F.linear(_call(_OPS["silu"][1], (F.linear(x, w_gate_up, b_gate_up),)), w_down, b_down)


def geglu_mlp(x, w_gate, w_up, w_down, b_gate=None, b_up=None, b_down=None, approximate: str = "none"):
    """down(gelu(x @ w_gate^T + b_gate, approximate) * (x @ w_up^T + b_up)) with the lean autograd; approximate as
    F.gelu's: "none" (exact, erf) or "tanh" (Gemma's gelu_pytorch_tanh): gated_mlp with "gelu" / "gelu_tanh"."""
    a = _gelu("geglu_mlp", approximate)
    if _lean_autograd("geglu_mlp", x, (w_gate, w_up, w_down)):
        return _GatedMLP.apply(a, x, w_gate, w_up, w_down, b_gate, b_up, b_down)
    return F.linear(_call(_OPS[a][0], (F.linear(x, w_gate, b_gate), F.linear(x, w_up, b_up))), w_down, b_down)


def geglu_mlp_packed(x, w_gate_up, w_down, b_gate_up=None, b_down=None, approximate: str = "none"):
    """Same for a packed gate/up projection: w_gate_up [2*d_ff, d_model], gate rows first."""
    a = _gelu("geglu_mlp_packed", approximate)
    if _lean_autograd("geglu_mlp_packed", x, (w_gate_up, w_down)):
        return _GatedMLPPacked.apply(a, x, w_gate_up, w_down, b_gate_up, b_down)
    return F.linear(_call(_OPS[a][1], (F.linear(x, w_gate_up, b_gate_up),)), w_down, b_down)


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
