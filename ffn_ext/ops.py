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
import torch.autograd.forward_ad as _fwAD
import torch.nn.functional as F

__all__ = ["gelu", "silu", "swiglu", "swiglu_packed", "has_cuda_kernels", "build_info", "build_summary"]

NO_C_ENV = "FFN_EXT_NO_C"  # set to 1 to skip importing ffn_ext._C (e.g. to use ffn_ext.jit.load instead)
_API_OPS = ("gelu", "silu", "swiglu", "swiglu_packed")

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
            _fast.update((name, getattr(module, "_fast_" + name)) for name in _API_OPS
                         if hasattr(module, "_fast_" + name))


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
# (and non-tensors) never reach those checks: the dispatcher routes them to SparseCPU/NestedTensorCPU/QuantizedCPU/...
# keys where ffn_ext has no kernel and fails with an unclear "Could not run ..." error. The API therefore calls the
# native op first (no Python checks on the hot path: decode-sized calls are bound by host time) and, only if it
# raises, looks at the tensor kinds to raise the clear error instead. When it falls back to plain ATen it checks
# everything, with the same messages as the C++ checks: TypeError (not a tensor, layout, dtype), ValueError (shape),
# RuntimeError (device).
_FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def _kind_error(op: str, name: str, t) -> Exception | None:
    if not isinstance(t, torch.Tensor):
        return TypeError(f"{op}: expected `{name}` to be a torch.Tensor, got {type(t).__name__}")
    if t.is_nested:
        return TypeError(f"{op}: `{name}` is a nested tensor; expected a dense strided tensor")
    if t.layout != torch.strided:
        return TypeError(f"{op}: expected `{name}` to be a dense strided tensor, got layout {t.layout}")
    if t.is_quantized:
        return TypeError(f"{op}: `{name}` is a quantized tensor; expected a floating-point tensor")
    return None


def _check_kinds(op: str, names: tuple, args: tuple) -> None:
    for name, t in zip(names, args):
        err = _kind_error(op, name, t)
        if err is not None:
            raise err from None


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
    """True when the native ops serve t's device (cpu, cuda, meta); other devices take the ATen fallback."""
    return _native is not None and (t.is_cuda or t.is_cpu or t.is_meta)


_overloads: dict = {}  # op name -> torch.ops.ffn_ext.<name>.default, looked up once
_fast: dict = {}  # op name -> the native library's fast entry point (csrc/python_module.cpp), set by _adopt
_is_compiling = torch.compiler.is_compiling


def _transformed(args: tuple) -> bool:
    """True under a torch.func transform (grad, vmap, jacrev, jvp, ...) or for a forward-mode dual tensor: the
    ops' autograd is a C++ autograd::Function, which supports neither, so these calls take ATen's ops (which
    support all of them; no fusion there). False while torch.compile traces (what it traces is the ops)."""
    if _is_compiling():
        return False
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return True
    return _fwAD._current_level >= 0 and any(isinstance(t, torch.Tensor) and _fwAD.unpack_dual(t).tangent is not None
                                             for t in args)


def _call(name: str, arg_names: tuple, args: tuple, fallback):
    """The op on args, by the cheapest path that serves them:
    1. the native library's fast entry point: plain tensors on cpu/cuda/meta, no __torch_function__ mode, not
       under torch.compile. It calls the op through the dispatcher as ATen's own bindings do: on a CPU core
       ffn_ext.gelu takes about 1.1 us instead of 2.3 (meta tensors; benchmarks/host_overhead.py). It returns
       NotImplemented for everything else;
    2. torch.ops.ffn_ext.<name> when the native ops serve args[0]'s device (tensor subclasses, torch function
       modes, and what torch.compile traces);
    3. else fallback(*args) after the fallback's own checks: devices without ffn_ext kernels, no native library,
       torch.func transforms and forward-mode AD (_transformed).
    Bad tensor kinds get the clear error on every path."""
    try:
        fast = _fast.get(name)
        if fast is not None and not _is_compiling():
            out = fast(*args)
            if out is not NotImplemented:
                return out
        if _native_for(args[0]) and not _transformed(args):
            overload = _overloads.get(name)
            if overload is None:
                overload = _overloads[name] = getattr(torch.ops.ffn_ext, name).default
            return overload(*args)
    except Exception:
        _check_kinds(f"ffn_ext.{name}", arg_names, args)  # raises the clear error if a kind is the cause
        raise
    op = f"ffn_ext.{name}"
    _check_kinds(op, arg_names, args)
    return fallback(op, *args)


def _gelu_fallback(op, x):
    _check_dtype(op, "x", x)
    return F.gelu(x)


def _silu_fallback(op, x):
    _check_dtype(op, "x", x)
    return F.silu(x)


def _swiglu_fallback(op, gate, up):
    _check_dtype(op, "gate", gate)
    _check_like(op, "up", up, "gate", gate)
    return F.silu(gate) * up


def _swiglu_packed_fallback(op, gate_up):
    _check_dtype(op, "gate_up", gate_up)
    if gate_up.dim() == 0:
        raise ValueError(f"{op}: expected `gate_up` to have at least 1 dimension ([..., 2*M]), got a 0-dim tensor")
    if gate_up.shape[-1] % 2:
        raise ValueError(f"{op}: expected the last dimension of `gate_up` to be even ([..., 2*M]), "
                         f"got shape {list(gate_up.shape)}")
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu(x: torch.Tensor) -> torch.Tensor:
    """Exact (erf) GELU: 0.5 * x * (1 + erf(x / sqrt(2)))."""
    return _call("gelu", ("x",), (x,), _gelu_fallback)


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU (swish): x * sigmoid(x)."""
    return _call("silu", ("x",), (x,), _silu_fallback)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, fused. gate and up: same shape, dtype and device (views such as chunk(2, -1) are fine)."""
    return _call("swiglu", ("gate", "up"), (gate, up), _swiglu_fallback)


def swiglu_packed(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up with gate, up = gate_up.chunk(2, -1): [..., 2M] -> [..., M]."""
    return _call("swiglu_packed", ("gate_up",), (gate_up,), _swiglu_packed_fallback)


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
