"""The ffn_ext ops from Python: loading the native library, autograd, and the functional API.

The ops themselves (schemas, Meta/CPU/CUDA kernels) are registered in C++ (csrc/registration.cpp) when the native
library loads: the installed ``ffn_ext._C`` or a JIT build (``ffn_ext.jit.load``). This module adds autograd to
every op (the backward ops too, so double backward works) and the functional API, which falls back to plain ATen
when no native library could be loaded or the tensor's device has no ffn_ext kernel.
"""
from __future__ import annotations

import math
import os
import threading
import warnings

import torch
import torch.nn.functional as F

__all__ = ["gelu", "silu", "swiglu", "swiglu_packed", "has_cuda_kernels", "build_info", "build_summary"]

NO_C_ENV = "FFN_EXT_NO_C"  # set to 1 to skip importing ffn_ext._C (e.g. to use ffn_ext.jit.load instead)
_NATIVE_DEVICES = ("cpu", "cuda", "meta")

_lock = threading.Lock()
_native = None  # the loaded native module (ffn_ext._C or the JIT module)
_native_source = None  # "ffn_ext._C" or "jit"
_native_error = None  # why no native module is loaded


def _adopt(module, source: str) -> None:
    """Makes `module` (already imported, so its ops are registered) the native backend and adds autograd."""
    global _native, _native_source, _native_error
    with _lock:
        if _native is not None:
            return
        _register_autograd()
        _native, _native_source, _native_error = module, source, None


def _load_installed() -> None:
    global _native_error
    if os.environ.get(NO_C_ENV, "0") not in ("", "0"):
        _native_error = f"{NO_C_ENV} is set"
        return
    try:
        from . import _C
    except ImportError as e:
        _native_error = f"ffn_ext._C could not be imported ({e})"
        warnings.warn(
            f"{_native_error}; ffn_ext falls back to plain ATen ops (correct, not fused). Build the extension with "
            "`pip install --no-build-isolation -e .` in the source tree, or call ffn_ext.jit.load().",
            RuntimeWarning,
            stacklevel=3,
        )
        return
    _adopt(_C, "ffn_ext._C")


# ---------------------------------------------------------------- autograd
# Second derivatives for double backward, in ATen ops (themselves differentiable).
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _gelu_grad2(x):  # gelu''(x) = phi(x) * (2 - x^2)
    return torch.exp(-0.5 * x * x) * _INV_SQRT_2PI * (2.0 - x * x)


def _silu_derivs(x):  # silu(x), silu'(x), silu''(x)
    s = torch.sigmoid(x)
    return x * s, s * (1.0 + x * (1.0 - s)), s * (1.0 - s) * (2.0 + x * (1.0 - 2.0 * s))


def _save_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _unary_backward(op_backward):
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return op_backward(grad, x) if ctx.needs_input_grad[0] else None

    return backward


def _unary_double_backward(op_backward, grad2):
    def backward(ctx, gg):
        grad, x = ctx.saved_tensors
        d_grad = op_backward(gg, x) if ctx.needs_input_grad[0] else None
        d_x = gg * grad * grad2(x) if ctx.needs_input_grad[1] else None
        return d_grad, d_x

    return backward


def _swiglu_second(grad, gate, up, gg_gate, gg_up):
    """Gradients of (dgate, dup) = swiglu_backward(grad, gate, up) given the incoming gg_gate, gg_up (None = 0)."""
    silu, d1, d2 = _silu_derivs(gate)
    zero = torch.zeros_like(gate)
    gg_gate = zero if gg_gate is None else gg_gate
    gg_up = zero if gg_up is None else gg_up
    d_grad = gg_gate * up * d1 + gg_up * silu
    d_gate = grad * (gg_gate * up * d2 + gg_up * d1)
    d_up = grad * gg_gate * d1
    return d_grad, d_gate, d_up


def _swiglu_backward(ctx, grad):
    gate, up = ctx.saved_tensors
    dgate, dup = torch.ops.ffn_ext.swiglu_backward(grad, gate, up)
    return (dgate if ctx.needs_input_grad[0] else None, dup if ctx.needs_input_grad[1] else None)


def _swiglu_backward_backward(ctx, gg_gate, gg_up):
    grad, gate, up = ctx.saved_tensors
    grads = _swiglu_second(grad, gate, up, gg_gate, gg_up)
    return tuple(g if need else None for g, need in zip(grads, ctx.needs_input_grad))


def _swiglu_packed_backward(ctx, grad):
    (gate_up,) = ctx.saved_tensors
    return torch.ops.ffn_ext.swiglu_packed_backward(grad, gate_up) if ctx.needs_input_grad[0] else None


def _swiglu_packed_backward_backward(ctx, gg):
    grad, gate_up = ctx.saved_tensors
    gate, up = gate_up.chunk(2, dim=-1)
    gg_gate, gg_up = gg.chunk(2, dim=-1)
    d_grad, d_gate, d_up = _swiglu_second(grad, gate, up, gg_gate, gg_up)
    return (d_grad if ctx.needs_input_grad[0] else None,
            torch.cat([d_gate, d_up], dim=-1) if ctx.needs_input_grad[1] else None)


def _register_autograd() -> None:
    ops = torch.ops.ffn_ext
    reg = torch.library.register_autograd
    reg("ffn_ext::gelu", _unary_backward(ops.gelu_backward), setup_context=_save_inputs)
    reg("ffn_ext::silu", _unary_backward(ops.silu_backward), setup_context=_save_inputs)
    reg("ffn_ext::gelu_backward", _unary_double_backward(ops.gelu_backward, _gelu_grad2), setup_context=_save_inputs)
    reg("ffn_ext::silu_backward", _unary_double_backward(ops.silu_backward, lambda x: _silu_derivs(x)[2]),
        setup_context=_save_inputs)
    reg("ffn_ext::swiglu", _swiglu_backward, setup_context=_save_inputs)
    reg("ffn_ext::swiglu_backward", _swiglu_backward_backward, setup_context=_save_inputs)
    reg("ffn_ext::swiglu_packed", _swiglu_packed_backward, setup_context=_save_inputs)
    reg("ffn_ext::swiglu_packed_backward", _swiglu_packed_backward_backward, setup_context=_save_inputs)


# ---------------------------------------------------------------- functional API
def _native_for(t: torch.Tensor) -> bool:
    return _native is not None and t.device.type in _NATIVE_DEVICES


def _check_packed(gate_up: torch.Tensor) -> None:  # ATen fallback only; the native ops check in C++
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ValueError("ffn_ext.swiglu_packed: expected the last dimension of `gate_up` to be even ([..., 2*M]), "
                         f"got shape {tuple(gate_up.shape)}")


def gelu(x: torch.Tensor) -> torch.Tensor:
    """Exact (erf) GELU: 0.5 * x * (1 + erf(x / sqrt(2)))."""
    return torch.ops.ffn_ext.gelu(x) if _native_for(x) else F.gelu(x)


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU (swish): x * sigmoid(x)."""
    return torch.ops.ffn_ext.silu(x) if _native_for(x) else F.silu(x)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, fused. gate and up: same shape, dtype and device (views such as chunk(2, -1) are fine)."""
    if _native_for(gate):
        return torch.ops.ffn_ext.swiglu(gate, up)
    if gate.shape != up.shape:
        raise ValueError(f"ffn_ext.swiglu: expected `up` to have the shape of `gate` {tuple(gate.shape)}, "
                         f"got {tuple(up.shape)}")
    return F.silu(gate) * up


def swiglu_packed(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up with gate, up = gate_up.chunk(2, -1): [..., 2M] -> [..., M]."""
    if _native_for(gate_up):
        return torch.ops.ffn_ext.swiglu_packed(gate_up)
    _check_packed(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---------------------------------------------------------------- build information
def build_info() -> dict:
    """What is loaded: native library or ATen fallback, CUDA kernels, CUDA version and archs, torch versions."""
    info = {"native": _native_source or "none (ATen fallback)", "torch_version": torch.__version__}
    if _native is None:
        info.update(reason=_native_error, cuda_kernels="no")
    else:
        info.update(_native.build_info())
    return info


def has_cuda_kernels() -> bool:
    """True when the loaded native library was compiled with the ffn_ext CUDA kernels."""
    return build_info().get("cuda_kernels") == "yes"


def build_summary() -> str:
    """build_info() as readable lines."""
    info = build_info()
    width = max(map(len, info))
    return "\n".join(f"{k:<{width}} : {v if v not in ('', None) else '-'}" for k, v in info.items())


_load_installed()
