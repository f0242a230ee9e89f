"""The ffn_ext ops from Python: loading the native library and the functional API.

The ops themselves (schemas; Meta, CPU, CUDA and Autograd kernels, double backward included) are registered in C++
when the native library loads: the installed ``ffn_ext._C`` or a JIT build (``ffn_ext.jit.load``). The functional
API calls them, and falls back to plain ATen when no native library could be loaded or the tensor's device has no
ffn_ext kernel.
"""
from __future__ import annotations

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
    """Makes `module` (already imported, so its ops are registered) the native backend."""
    global _native, _native_source, _native_error
    with _lock:
        if _native is None:
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


# ---------------------------------------------------------------- functional API
# Input checks. The native ops check everything in C++ (csrc/shapes.cpp), but sparse, nested and quantized tensors
# never reach those checks: the dispatcher routes them to SparseCPU/NestedTensorCPU/QuantizedCPU/... keys where
# ffn_ext has no kernel and fails with an unclear "Could not run ..." error. So the API checks the tensor kind itself
# before dispatch (cheap attribute reads), and checks everything when it falls back to plain ATen, with the same
# messages as the C++ checks: TypeError (not a tensor, layout, dtype), ValueError (shape), RuntimeError (device).
_FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def _check_kind(op: str, name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: expected `{name}` to be a torch.Tensor, got {type(t).__name__}")
    if t.is_nested:
        raise TypeError(f"{op}: `{name}` is a nested tensor; expected a dense strided tensor")
    if t.layout != torch.strided:
        raise TypeError(f"{op}: expected `{name}` to be a dense strided tensor, got layout {t.layout}")
    if t.is_quantized:
        raise TypeError(f"{op}: `{name}` is a quantized tensor; expected a floating-point tensor")


def _check_dtype(op: str, name: str, t: torch.Tensor) -> None:  # ATen fallback only
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{op}: expected `{name}` to have dtype float64, float32, float16 or bfloat16, got {t.dtype}")


def _check_like(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:  # ATen fallback only
    _check_dtype(op, name, t)
    if t.dtype != ref.dtype:
        raise TypeError(f"{op}: expected `{name}` to have the dtype of `{ref_name}` ({ref.dtype}), got {t.dtype}")
    if t.device != ref.device:
        raise RuntimeError(f"{op}: expected `{name}` to be on the device of `{ref_name}` ({ref.device}), "
                           f"got {t.device}")
    if t.shape != ref.shape:
        raise ValueError(f"{op}: expected `{name}` to have the shape of `{ref_name}` {list(ref.shape)}, "
                         f"got {list(t.shape)}")


def _native_for(t: torch.Tensor) -> bool:
    return _native is not None and t.device.type in _NATIVE_DEVICES


def _check_packed(gate_up: torch.Tensor) -> None:  # ATen fallback only; the native ops check in C++
    op = "ffn_ext.swiglu_packed"
    _check_dtype(op, "gate_up", gate_up)
    if gate_up.dim() == 0:
        raise ValueError(f"{op}: expected `gate_up` to have at least 1 dimension ([..., 2*M]), got a 0-dim tensor")
    if gate_up.shape[-1] % 2:
        raise ValueError(f"{op}: expected the last dimension of `gate_up` to be even ([..., 2*M]), "
                         f"got shape {list(gate_up.shape)}")


def gelu(x: torch.Tensor) -> torch.Tensor:
    """Exact (erf) GELU: 0.5 * x * (1 + erf(x / sqrt(2)))."""
    _check_kind("ffn_ext.gelu", "x", x)
    if _native_for(x):
        return torch.ops.ffn_ext.gelu(x)
    _check_dtype("ffn_ext.gelu", "x", x)
    return F.gelu(x)


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU (swish): x * sigmoid(x)."""
    _check_kind("ffn_ext.silu", "x", x)
    if _native_for(x):
        return torch.ops.ffn_ext.silu(x)
    _check_dtype("ffn_ext.silu", "x", x)
    return F.silu(x)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, fused. gate and up: same shape, dtype and device (views such as chunk(2, -1) are fine)."""
    op = "ffn_ext.swiglu"
    _check_kind(op, "gate", gate)
    _check_kind(op, "up", up)
    if _native_for(gate):
        return torch.ops.ffn_ext.swiglu(gate, up)
    _check_dtype(op, "gate", gate)
    _check_like(op, "up", up, "gate", gate)
    return F.silu(gate) * up


def swiglu_packed(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up with gate, up = gate_up.chunk(2, -1): [..., 2M] -> [..., M]."""
    _check_kind("ffn_ext.swiglu_packed", "gate_up", gate_up)
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
