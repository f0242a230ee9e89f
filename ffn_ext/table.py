"""The table of ffn_ext's activations, Python side. csrc/ops_table.h is the C++ side, with the same names; the
functional API (ops.py), the modules, Hugging Face patching, ``python -m ffn_ext`` and the tests take their op lists
from here, so an activation is one entry (README, "Adding an activation").

Each activation ``act`` gives six dispatcher ops, torch.ops.ffn_ext.<op>:

    <name>(x)                           act(x)
    <name>_backward(grad, x)            grad * act'(x)
    <gated>(gate, up)                   act(gate) * up
    <gated>_backward(grad, gate, up)    (grad * up * act'(gate), grad * act(gate))
    <gated>_packed(gate_up)             [..., 2M] -> [..., M], gate = gate_up[..., :M], up = gate_up[..., M:]
    <gated>_packed_backward(grad, gate_up)   -> [dgate | dup], [..., 2M]

Every entry also carries its float64 reference (the value and derivative formulas with the mathematical limits at
+-inf that the CUDA kernels implement, and the size of the terms the kernels' formulas cancel, which the host-math
test's tolerance needs), written without the cancellations the kernels avoid.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

__all__ = ["Activation", "ACTIVATIONS", "BY_NAME", "OpSpec", "OPS", "op_spec", "activation_for"]

_INF = math.inf
_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_K_TANH = math.sqrt(2.0 / math.pi)  # tanh GELU: u = K (x + 0.044715 x^3)


@dataclass(frozen=True)
class Activation:
    name: str  # its unary ops: <name>, <name>_backward
    gated: str  # its gated ops: <gated>, <gated>_backward, <gated>_packed, <gated>_packed_backward
    api: tuple  # how the public API names it: (function, {keyword: value}), e.g. ("gelu", {"approximate": "tanh"})
    aten: Callable  # act(x) with ATen ops: the fallback without the native library
    aten_backward: Callable  # (grad, x) -> grad * act'(x) with ATen ops
    hf_names: tuple  # transformers' ACT2FN names that compute exactly this function
    ref: Callable  # float64 x -> (act(x), act'(x)), mathematical limits at +-inf, NaN propagates
    cancel: Callable  # float64 x -> (S, S'): size of the terms the kernels' formulas for act, act' cancel
    doc: str


def _limits(x, f, d):
    """f, d with the limits act(-inf) = -0, act(+inf) = +inf, act'(-inf) = 0, act'(+inf) = 1."""
    f = torch.where(x == -_INF, torch.full_like(x, -0.0), torch.where(x == _INF, x, f))
    d = torch.where(x == -_INF, torch.zeros_like(x), torch.where(x == _INF, torch.ones_like(x), d))
    return f, d


def _finite(t):
    return torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0)


# ---- exact GELU: Phi(x) = erfc(-x / sqrt 2) / 2, which does not cancel for x < 0 as 1 + erf does
def _gelu_ref(x):
    cdf = 0.5 * torch.special.erfc(-x * _INV_SQRT2)
    return _limits(x, x * cdf, cdf + x * torch.exp(-0.5 * x * x) * _INV_SQRT_2PI)


def _gelu_cancel(x):  # x - x Q(|x|) / 1 + erf; Phi + x phi
    return x.abs(), _finite(1.0 + (x * torch.exp(-0.5 * x * x)).abs() * _INV_SQRT_2PI)


# ---- tanh GELU: 0.5 x (1 + tanh(u)) = x sigmoid(2u): no cancellation, but the kernels round z = 2u, and
# sigmoid(z)'s relative error is (1 - s) |z| times z's. The derivative's s (1 - s) takes 1 - s from the rounded s,
# which cancels as s -> 1: an error of ulps of s^2 |x z'| (the reference takes 1 - s = sigmoid(-z) instead).
def _tanh_z(x):
    return 2.0 * _K_TANH * (x + 0.044715 * x**3), 2.0 * _K_TANH * (1.0 + 3 * 0.044715 * x * x)


def _gelu_tanh_ref(x):
    z, dz = _tanh_z(x)
    s = torch.sigmoid(z)
    sp = s * torch.sigmoid(-z)
    # where s (1 - s) is 0 (|x| large; x^3 and z' may overflow) the derivative's limit is s, not x z' * 0
    return _limits(x, x * s, torch.where(sp == 0, s, s + x * dz * sp))


def _gelu_tanh_cancel(x):
    z, dz = _tanh_z(x)
    s = torch.sigmoid(z)
    sp = s * torch.sigmoid(-z)
    return _finite((x * z).abs() * sp), _finite(s + (x * dz).abs() * (s * s + sp * (1.0 + z.abs())))


# ---- SiLU
def _silu_ref(x):
    s = torch.sigmoid(x)
    return _limits(x, x * s, s * (1.0 + x * (1.0 - s)))


def _silu_cancel(x):
    return torch.zeros_like(x), _finite(torch.sigmoid(x) * (1.0 + x.abs()))


ACTIVATIONS = (
    Activation(
        name="gelu", gated="geglu", api=("gelu", {"approximate": "none"}),
        aten=F.gelu, aten_backward=lambda g, x: torch.ops.aten.gelu_backward(g, x),
        hf_names=("gelu", "gelu_python"), ref=_gelu_ref, cancel=_gelu_cancel,
        doc="exact GELU, 0.5 x (1 + erf(x / sqrt 2)) (F.gelu)"),
    Activation(
        name="gelu_tanh", gated="geglu_tanh", api=("gelu", {"approximate": "tanh"}),
        aten=lambda x: F.gelu(x, approximate="tanh"),
        aten_backward=lambda g, x: torch.ops.aten.gelu_backward(g, x, approximate="tanh"),
        hf_names=("gelu_pytorch_tanh", "gelu_python_tanh", "gelu_new", "gelu_accurate", "gelu_fast"),
        ref=_gelu_tanh_ref, cancel=_gelu_tanh_cancel,
        doc="tanh GELU, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (F.gelu(approximate='tanh'))"),
    Activation(
        name="silu", gated="swiglu", api=("silu", {}),
        aten=F.silu, aten_backward=lambda g, x: torch.ops.aten.silu_backward(g, x),
        hf_names=("silu", "swish"), ref=_silu_ref, cancel=_silu_cancel,
        doc="SiLU (swish), x sigmoid(x) (F.silu)"),
)
BY_NAME = {a.name: a for a in ACTIVATIONS}


def activation_for(function: str, **options) -> Activation:
    """The entry the public API reaches as ``ffn_ext.<function>(..., **options)``, e.g. ("gelu", approximate="tanh")
    -> gelu_tanh; a ValueError naming the option and the values it takes otherwise."""
    entries = [a for a in ACTIVATIONS if a.api[0] == function]
    for key, value in options.items():
        allowed = [a.api[1].get(key) for a in entries]
        if value not in allowed:
            raise ValueError(f"ffn_ext.{function}: `{key}` must be one of {allowed}, got {value!r}")
        entries = [a for a in entries if a.api[1].get(key) == value]
    return entries[0]


# ---------------------------------------------------------------- the ops, derived
@dataclass(frozen=True)
class OpSpec:
    name: str  # torch.ops.ffn_ext.<name>
    act: Activation
    kind: str  # "unary" | "gated" | "packed"
    backward: bool
    args: tuple  # argument names, as in the schema and the error messages
    n_outputs: int

    @property
    def forward_name(self) -> str:
        return self.name[: -len("_backward")] if self.backward else self.name


def _specs(act: Activation):
    g = act.gated
    return (
        OpSpec(act.name, act, "unary", False, ("x",), 1),
        OpSpec(act.name + "_backward", act, "unary", True, ("grad", "x"), 1),
        OpSpec(g, act, "gated", False, ("gate", "up"), 1),
        OpSpec(g + "_backward", act, "gated", True, ("grad", "gate", "up"), 2),
        OpSpec(g + "_packed", act, "packed", False, ("gate_up",), 1),
        OpSpec(g + "_packed_backward", act, "packed", True, ("grad", "gate_up"), 1),
    )


OPS = {s.name: s for act in ACTIVATIONS for s in _specs(act)}


def op_spec(name: str) -> OpSpec:
    return OPS[name]
