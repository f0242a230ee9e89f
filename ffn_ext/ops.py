"""The ffn_ext ops from Python: loading the native library and the functional API.

The native library (the installed ``ffn_ext._C`` or a JIT build, ``ffn_ext.jit.load``) registers the ops' schemas
and CUDA kernels when it loads; their CPU and fake kernels and their autograd (every order, torch.func included) are
registered from the table when the package adopts it (ffn_ext/_kernels.py). Without a native library ffn_ext defines
the schemas itself, and the ops run PyTorch's own ops on every device. Every public function calls its op's Op
(_kernels.OP: the dispatcher op by one route), and a Gating is one gated op with its parameters and layout.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

from . import _kernels
from .table import BY_NAME, GATED_BY_NAME, LAYOUTS, activation_for, bind_params, check_params, split_packed

__all__ = [
    "gelu",
    "silu",
    "relu",
    "relu2",
    "quick_gelu",
    "act",
    "swiglu",
    "swiglu_packed",
    "geglu",
    "geglu_packed",
    "swiglu_clamped",
    "swiglu_clamped_packed",
    "gated",
    "gated_packed",
    "Gating",
    "has_cuda_kernels",
    "build_info",
    "build_summary",
]

NO_C_ENV = "FFN_EXT_NO_C"  # set to 1 to skip importing ffn_ext._C (e.g. to use ffn_ext.jit.load instead)

_lock = threading.Lock()
_native: Any = None  # the loaded native module (ffn_ext._C or the JIT module), or a _loader.Registered
_native_source: str | None = None  # "ffn_ext._C" or "jit"
_native_error: str | None = None  # why no native module is loaded


def _adopt(module, source: str) -> None:
    """Makes `module` (already imported, so its ops are registered) the native backend."""
    global _native, _native_source, _native_error
    with _lock:
        if _native is None:
            _native, _native_source = module, source
            if source != "python":
                _native_error = None
            cuda = _cuda_info()
            _kernels.register(cuda["cuda_kernels"] == "yes", cuda.get("cuda_kernels_off"), _register_dtensor)
            _register_dtensor()


def _register_dtensor() -> bool:
    """Registers the ops' DTensor sharding strategies (ffn_ext.distributed) when torch.distributed.tensor is loaded
    and they are not yet; True when it did. Called when the native ops are adopted and when a call fails (a DTensor
    reaching an op without strategies raises NotImplementedError), so that importing torch.distributed.tensor (1.3 s)
    is never ffn_ext's cost. torch.ops.ffn_ext.* called directly on DTensors, with torch.distributed.tensor imported
    after ffn_ext and no functional API call before, needs ffn_ext.distributed.register_strategies()."""
    if _dtensor_registrar is None or "torch.distributed.tensor" not in sys.modules:
        return False
    return _dtensor_registrar()


# Set by ffn_ext.distributed (a higher layer, imported by the package): registers the strategies once and returns
# True when it did. A hook, not an import, so that ops depends on nothing above it.
_dtensor_registrar: Callable[[], bool] | None = None


def _load_installed() -> None:
    global _native_error
    if os.environ.get(NO_C_ENV, "0") not in ("", "0"):
        _native_error = f"{NO_C_ENV} is set"
        return _define_here()  # (ffn_ext.jit.load replaces these with the library it builds)
    from . import _loader  # ops registered before this import, _C built for another torch, the advice

    registered = _loader.registered_elsewhere()  # importing _C next to them would abort the process
    if registered is not None:
        return _adopt(registered, registered.source)
    try:
        _loader.check_installed_C()
        from . import _C  # type: ignore[attr-defined]  # the compiled extension: mypy sees no module (no stub)

        _loader.load_cuda_library()  # before the Python kernels register: they serve CUDA tensors only without it
    except ImportError as e:
        _native_error = f"ffn_ext._C could not be imported ({e})"
        warnings.warn(
            f"{_native_error}; the ops run PyTorch's own ops on every device (correct, not fused). {_loader.remedy()}",
            RuntimeWarning,
            stacklevel=3,
        )
        return _define_here()
    _adopt(_C, "ffn_ext._C")


def _define_here() -> None:
    """Without a native library: the ops' schemas defined from the table here, their Python kernels on every device."""
    _kernels.define()
    _adopt(_Python(), "python")


def _undefine_here() -> None:
    """Drops the ops _define_here registered, so that a native library (ffn_ext.jit.load) can register them."""
    global _native, _native_source
    with _lock:
        _kernels.undefine()
        _native, _native_source = None, None


class _Python:
    """Stands in for the native module when ffn_ext defined the ops itself (no native library): no CUDA kernels."""

    source = "python"

    @staticmethod
    def build_info() -> dict:
        return {
            "cuda_kernels": "no",
            "cuda_kernels_off": _native_error or "no native library",
            "pointwise_tags": "yes",  # (_kernels.define tags them)
        }


# ---------------------------------------------------------------- functional API
# Every public function calls its op's Op (ffn_ext._kernels): the dispatcher op by one route, with one fast path.
# Floating-point inputs of different dtypes, which the kernels refuse, are promoted to their common dtype, as ATen's
# act(gate) * up promotes; another error is explained by the op's checks when they find its cause.
_OP = _kernels.OP
_SILU, _SWIGLU = _OP["silu"], _OP["swiglu"]  # (looked up once: the commonest calls)


def call_op(name: str, *args, **kwargs):
    """Any op of the table (backward ops too) by name, by the functional API's route: what the MLPs' lean autograd
    and Gating call."""
    return _OP[name](*args, **kwargs)


def backward_recompute(grad: torch.Tensor, x: torch.Tensor, activation: str) -> tuple:
    """(grad * act'(x), act(x)) in one pass over grad and x (torch.ops.ffn_ext.<act>_backward_recompute): the
    classic FFN's lean backward, which recomputes act(z) for fc2's weight gradient instead of saving it. Internal;
    it has no autograd (RuntimeError where a gradient would be recorded)."""
    return _OP[_act(activation).name + "_backward_recompute"](grad, x)


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU with F.gelu's `approximate`: "none" (the default) is the exact form 0.5 x (1 + erf(x / sqrt 2)),
    "tanh" is 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). Any other value is a ValueError."""
    return _OP[activation_for("gelu", approximate=approximate).name](x)


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU (swish): x * sigmoid(x)."""
    return _SILU(x)


def relu(x: torch.Tensor) -> torch.Tensor:
    """ReLU: max(x, 0); its derivative is 0 at 0 (as F.relu's)."""
    return _OP["relu"](x)


def relu2(x: torch.Tensor) -> torch.Tensor:
    """Squared ReLU: relu(x)**2 (Primer, Nemotron-H, Arcee AFM). Its derivative 2 relu(x) is unbounded; the backward
    computes grad * 2 relu(x) so that it is finite wherever that product is."""
    return _OP["relu2"](x)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """Quick GELU: x * sigmoid(1.702 x) (CLIP, transformers' QuickGELUActivation). Not the exact GELU: it differs
    from it by up to about 0.02."""
    return _OP["quick_gelu"](x)


def act(x: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """act(x) for any activation of the table by its name ("gelu", "gelu_tanh", "silu", "relu", "relu2",
    "quick_gelu", ...): act(x, "gelu_tanh") is gelu(x, approximate="tanh")."""
    return _OP[_act(activation).name](x)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, fused. gate and up: same shape, dtype and device (views such as chunk(2, -1) are fine)."""
    return _SWIGLU(gate, up)


def swiglu_packed(gate_up: torch.Tensor, *, layout: str = "concat") -> torch.Tensor:
    """silu(gate) * up from one [..., 2M] tensor -> [..., M], read in place. layout="concat": gate, up =
    gate_up.chunk(2, -1); "interleaved": gate, up = gate_up[..., ::2], gate_up[..., 1::2] (GPT-OSS)."""
    return _OP["swiglu_packed"](gate_up, layout=layout)


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """gelu(gate, approximate) * up, fused (Gemma's MLP with approximate="tanh"). gate and up as for swiglu."""
    return _OP[activation_for("gelu", "geglu", approximate=approximate).gated](gate, up)


def geglu_packed(gate_up: torch.Tensor, approximate: str = "none", *, layout: str = "concat") -> torch.Tensor:
    """gelu(gate, approximate) * up from one [..., 2M] tensor in `layout` (as for swiglu_packed) -> [..., M]."""
    return _OP[activation_for("gelu", "geglu_packed", approximate=approximate).gated + "_packed"](
        gate_up, layout=layout
    )


def swiglu_clamped(
    gate: torch.Tensor, up: torch.Tensor, *, limit: float, alpha: float = 1.0, up_offset: float = 0.0
) -> torch.Tensor:
    """(clamp(up, -limit, limit) + up_offset) * g * sigmoid(alpha * g) with g = clamp(gate, max=limit), fused:
    GPT-OSS's experts (alpha=1.702, up_offset=1.0, limit=7.0) and DeepSeek-V4 (alpha=1.0, up_offset=0.0,
    limit=config.swiglu_limit). limit must be > 0 (ValueError; inf: no clamp). Gradients are those of that
    expression under torch's autograd (torch.clamp's: passed inside the bounds, 0 beyond)."""
    return _OP["swiglu_clamped"](gate, up, limit=limit, alpha=alpha, up_offset=up_offset)


def swiglu_clamped_packed(
    gate_up: torch.Tensor, *, limit: float, alpha: float = 1.0, up_offset: float = 0.0, layout: str = "concat"
) -> torch.Tensor:
    """swiglu_clamped of one [..., 2M] tensor in `layout` (as for swiglu_packed; GPT-OSS: "interleaved")."""
    return _OP["swiglu_clamped_packed"](gate_up, limit=limit, alpha=alpha, up_offset=up_offset, layout=layout)


def _act(activation: str):
    act = BY_NAME.get(activation) if isinstance(activation, str) else None
    if act is None:
        raise ValueError(f"ffn_ext: `activation` must be one of {sorted(BY_NAME)}, got {activation!r}")
    return act


def gated(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """act(gate) * up for any activation of the table by its name ("silu", "gelu", "gelu_tanh", "relu", "relu2",
    "quick_gelu", ...): gated(g, u, "silu") is swiglu(g, u), gated(g, u, "gelu_tanh") is geglu(g, u,
    approximate="tanh"), gated(g, u, "relu") is ReGLU."""
    return _OP[_act(activation).gated](gate, up)


def gated_packed(gate_up: torch.Tensor, activation: str = "silu", *, layout: str = "concat") -> torch.Tensor:
    """act(gate) * up from one [..., 2M] tensor in `layout` (as for swiglu_packed), for any activation of the
    table by its name."""
    return _OP[_act(activation).gated + "_packed"](gate_up, layout=layout)


# ---------------------------------------------------------------- a gated activation as one op
class Gating:
    """A gated activation as one gated op of the table computes it: the op (``"swiglu"``, ``"geglu_tanh"``,
    ``"swiglu_clamped"``, ...), its parameters (the clamped SwiGLU's limit, alpha, up_offset) and, for one packed
    ``[..., 2M]`` input, the layout of its halves (``"concat"`` or ``"interleaved"``). The gated activation modules
    (SwiGLU, GeGLU, Gated) compute through theirs, and everything that fuses a module (the FFN modules, the MLPs'
    lean autograd, FP8 conversion) asks the module for it, so a fused MLP computes exactly what its activation
    module computes::

        g = ffn_ext.Gating("swiglu_clamped", limit=7.0, alpha=1.702, up_offset=1.0, layout="interleaved")
        h = g(gate_up)                  # [..., 2M] -> [..., M]; g(gate, up) for two tensors
        y = ffn_ext.gated_mlp(x, w_gate, w_up, w_down, activation=g)

    Immutable and hashable; its checks are the op's (a ValueError naming the bad argument)."""

    __slots__ = ("op", "params", "layout", "_ops", "_kwargs", "_packed_kwargs")
    op: str
    params: tuple  # ((name, value), ...) in schema order, every parameter (defaults filled in)
    layout: str
    _ops: tuple  # its ops' Op objects: (op, op_packed, op_backward, op_packed_backward, op_backward_recompute)
    _kwargs: dict  # their keyword arguments: the parameters, then (packed) the layout
    _packed_kwargs: dict

    def __init__(self, op: str = "swiglu", *, layout: str = "concat", **params: float) -> None:
        entry = GATED_BY_NAME.get(op) if isinstance(op, str) else None
        if entry is None:
            raise ValueError(f"ffn_ext.Gating: `op` must be one of {sorted(GATED_BY_NAME)}, got {op!r}")
        values = bind_params(f"ffn_ext.Gating({op})", entry, params)
        check_params(f"ffn_ext.Gating({op})", entry, values)
        if layout not in LAYOUTS:
            raise ValueError(f"ffn_ext.Gating: `layout` must be one of {list(LAYOUTS)}, got {layout!r}")
        set_ = object.__setattr__
        set_(self, "op", op)
        set_(self, "params", tuple((k, float(v)) for k, v in values.items()))
        set_(self, "layout", layout)
        set_(
            self,
            "_ops",
            tuple(
                _OP[op + suffix] for suffix in ("", "_packed", "_backward", "_packed_backward", "_backward_recompute")
            ),
        )
        set_(self, "_kwargs", dict(self.params))
        set_(self, "_packed_kwargs", {**self._kwargs, "layout": layout})

    @classmethod
    def of(cls, activation: str | Gating, layout: str = "concat", **params: float) -> Gating:
        """`activation` itself when it is a Gating; else the Gating of an activation of the table by name ("silu" ->
        swiglu, "gelu_tanh" -> geglu_tanh, ...) or of a gated op by name ("swiglu_clamped", with its `params`)."""
        if isinstance(activation, Gating):
            return activation
        if isinstance(activation, str) and activation in GATED_BY_NAME:
            return cls(activation, layout=layout, **params)
        return cls(_act(activation).gated, layout=layout, **params)

    @property
    def kwargs(self) -> dict:
        """The op's parameters as keyword arguments."""
        return dict(self.params)

    @property
    def activation(self) -> str:
        """The table name of the activation applied to the gate (``"silu"`` for swiglu and swiglu_clamped)."""
        return GATED_BY_NAME[self.op].act.name

    def __call__(self, gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
        """The op on (gate, up), or on one packed [..., 2M] tensor in this layout."""
        if up is None:
            return self._ops[1](gate, **self._packed_kwargs)
        return self._ops[0](gate, up, **self._kwargs)

    def backward(self, grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor | None = None) -> tuple:
        """The input gradients of __call__(gate, up) for the output gradient `grad`: (dgate, dup), or (d gate_up,)
        for one packed tensor (in its layout)."""
        if up is None:
            return (self._ops[3](grad, gate, **self._packed_kwargs),)
        return tuple(self._ops[2](grad, gate, up, **self._kwargs))

    def backward_recompute(self, grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor | None = None) -> tuple:
        """(dgate, dup, h) in one pass: backward(grad, gate, up)'s gradients and h = self(gate, up), the op's
        <gated>_backward_recompute (no autograd: it serves backward passes). For one packed tensor its halves in this
        layout are read as views, and dgate and dup come separate."""
        if up is None:
            gate, up = split_packed(gate, self.layout)
        return tuple(self._ops[4](grad, gate, up, **self._kwargs))

    def cache(self, gate: torch.Tensor, up: torch.Tensor, group_size: int = 128) -> tuple:
        """(h, q, scale) in one pass: h = self(gate, up), and gate and up in FP8 (float8_e4m3fn) for backward, q
        [..., 2M] holding gate's values then up's, scale [..., 2M / group_size] their float32 scale per group
        (ffn_ext.quant's formula): the op's <gated>_cache."""
        return tuple(_OP[self.op + "_cache"](gate, up, group_size=group_size, **self._kwargs))

    def cached_backward(self, grad: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> tuple:
        """(dgate, dup, h) of gate and up read back from cache()'s q and scale, in grad's dtype, in one pass: the
        op's <gated>_cached_backward."""
        return tuple(_OP[self.op + "_cached_backward"](grad, q, scale, **self._kwargs))

    def __setattr__(self, name, value):
        raise AttributeError("ffn_ext.Gating is immutable")

    def __eq__(self, other) -> bool:
        return isinstance(other, Gating) and (self.op, self.params, self.layout) == (
            other.op,
            other.params,
            other.layout,
        )

    def __hash__(self) -> int:
        return hash((self.op, self.params, self.layout))

    def __reduce__(self):
        return (_gating, (self.op, self.layout, self.params))

    def __repr__(self) -> str:
        args = [repr(self.op)] + [f"{k}={v!r}" for k, v in self.params]
        return f"Gating({', '.join(args + ([] if self.layout == 'concat' else [f'layout={self.layout!r}']))})"


def _gating(op: str, layout: str, params: tuple) -> Gating:  # pickle's constructor
    return Gating(op, layout=layout, **dict(params))


# ---------------------------------------------------------------- build information
def build_info() -> dict:
    """What is loaded: the native library (or none: the ops defined by ffn_ext itself), CUDA kernels (and why not),
    CUDA version and archs, torch versions."""
    native = (
        "none: the ops are defined by ffn_ext (PyTorch's own ops)" if _native_source == "python" else _native_source
    )
    info: dict[str, Any] = {"native": native or "none", "torch_version": torch.__version__}
    if _native is None or _native_source == "python":
        info.update(reason=_native_error, cuda_kernels="no")
    else:
        info.update(_native.build_info())
        info.update(_cuda_info())
    return info


def _cuda_info() -> dict:
    """The CUDA kernels' part of build_info(): _C has none; the CUDA library the loader loaded (or why not), or the
    ops another library registered."""
    if _native_source == "ffn_ext._C":
        from . import _loader

        status = _loader.cuda_status()
        info = {
            "cuda_kernels": "yes" if status["loaded"] else "no",
            "cuda_version": status.get("cuda_version", ""),
            "cuda_archs": status.get("cuda_archs", ""),
        }
        if not status["loaded"]:
            info["cuda_kernels_off"] = status["reason"]
        return info
    return {k: v for k, v in _native.build_info().items() if k.startswith("cuda_")}


def native_ops() -> bool:
    """True when the torch.ops.ffn_ext ops are registered (by a native library, or by ffn_ext itself without one);
    False only with FFN_EXT_NO_C=1 between ffn_ext.jit.load's replacing them and its loading its library."""
    return _native is not None


def has_cuda_kernels() -> bool:
    """True when ffn_ext's CUDA kernels are loaded (built, and their CUDA major is the running torch's)."""
    return build_info().get("cuda_kernels") == "yes"


def build_summary() -> str:
    """Where the ops run (whether the CUDA kernels are built, for which architectures, whether a GPU is visible),
    then build_info() as readable lines."""
    from . import _loader

    info = build_info()
    width = max(map(len, info))
    lines = [f"{k:<{width}} : {v if v not in ('', None) else '-'}" for k, v in info.items()]
    return "\n".join([_loader.where_it_runs(info), *lines])


_load_installed()
