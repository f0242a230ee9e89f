"""The table of ffn_ext's activations: the one list of ffn_ext's ops. The C++ op table
(csrc/include/ffn_ext/ops_table.h) is generated from it at build time (ffn_ext/_build.py, write_ops_table); the
functional API (ops.py), the modules, Hugging Face patching, ``python -m ffn_ext`` and the tests take their op lists
from here, so an activation is one entry (README, "Adding an activation").

Each activation ``act`` gives two dispatcher ops, torch.ops.ffn_ext.<op>, and each gated op (GATED: act(gate) * up
for each activation, and gated ops with parameters of their own, such as swiglu_clamped) five:

    <name>(x)                           act(x)
    <name>_backward(grad, x)            grad * act'(x)
    <name>_backward_recompute(grad, x)  (grad * act'(x), act(x)), one pass, no autograd (the classic FFN's backward)
    <gated>(gate, up, *, params)        act(gate) * up, or the gated op's own function of (gate, up)
    <gated>_backward(grad, gate, up, *, params)   (dgate, dup)
    <gated>_backward_recompute(grad, gate, up, *, params)   (dgate, dup, h), one pass, no autograd (the lean MLPs'
                                        backward: h for the down projection's weight gradient, not saved)
    <gated>_packed(gate_up, *, params, layout="concat")   [..., 2M] -> [..., M]; layout "concat": gate, up =
                                        gate_up[..., :M], gate_up[..., M:]; "interleaved": gate_up[..., ::2], [..., 1::2]
    <gated>_packed_backward(grad, gate_up, *, params, layout="concat")   -> (dgate, dup) packed in that layout

Every entry also carries its float64 reference (the value and derivative formulas, and its `limits` at +-inf that the
CUDA kernels implement, and the size of the terms the kernels' formulas cancel, which the host-math test's tolerance
needs), written without the cancellations the kernels avoid, and its plain-PyTorch `eager` form.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "Activation",
    "ACTIVATIONS",
    "BY_NAME",
    "Param",
    "Gated",
    "GATED",
    "GATED_BY_NAME",
    "LAYOUTS",
    "OpSpec",
    "OPS",
    "op_spec",
    "activation_for",
]

_INF = math.inf
_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_K_TANH = math.sqrt(2.0 / math.pi)  # tanh GELU: u = K (x + 0.044715 x^3)


@dataclass(frozen=True)
class Activation:
    """One activation of the table: its ops, how Python reaches them, its ATen and eager forms, its float64
    reference and its limits. README "Adding an activation": this entry and its functor (csrc/ffn_math.h, named
    `functor`) are all an activation is; the C++ op table is generated from the entry."""

    name: str  # its unary ops: <name>, <name>_backward
    gated: str  # its gated ops: <gated>, <gated>_backward, <gated>_packed, <gated>_packed_backward
    aten: Callable  # act(x) with ATen ops: the CPU kernel's form
    aten_backward: Callable  # (grad, x) -> grad * act'(x) with ATen ops
    formula: Callable  # float64 x -> (act(x), act'(x)) for finite x, NaN propagating (ref() adds the limits)
    cancel: Callable  # float64 x -> (S, S'): size of the terms the kernels' formulas for act, act' cancel
    doc: str
    # (act(-inf), act(+inf), act'(-inf), act'(+inf)): the mathematical limits the CUDA kernels
    # return (signed zeros matter: gelu(-inf) = -0)
    limits: tuple = (-0.0, _INF, 0.0, 1.0)
    eager: Callable | None = None  # the plain-PyTorch form a model writes (benchmarks' "ATen eager"); None: aten
    # ATen's autograd of aten computes aten_backward, bit for bit (ATen's own derivative): then the CPU autograd of
    # its forward ops without parameters is ATen's (OpSpec.aten_autograd)
    aten_autograd: bool = False
    hf_names: tuple = ()  # transformers' ACT2FN names that compute exactly this function
    # how the public API names it: (function, {keyword: value}), e.g. ("gelu", {"approximate": "tanh"}); None (the
    # default): ffn_ext.act(x, activation=name), which serves every entry
    api: tuple[str, dict[str, Any]] = None  # type: ignore[assignment]  # None: set by __post_init__, never None after
    # float64 (m, x) -> m * act'(x) for an unbounded act', computed so that it is finite wherever the product is (as
    # the functor's bwd): relu2's 2 (m relu(x)); None: m * ref(x)[1]
    times_derivative_ref: Callable | None = None

    def __post_init__(self):
        if self.api is None:
            object.__setattr__(self, "api", ("act", {"activation": self.name}))
        if self.eager is None:
            object.__setattr__(self, "eager", self.aten)

    @property
    def functor(self) -> str:
        """Its functor in csrc/ffn_math.h: the CamelCase of its name (gelu_tanh -> GeluTanh)."""
        return _camel(self.name)

    @property
    def bounded_derivative(self) -> bool:
        """act' bounded (its limits finite): grad * act'(x) cannot overflow where grad and act'(x) are finite."""
        return all(math.isfinite(v) for v in self.limits[2:])

    def times_derivative(self, m, x):
        """float64 m * act'(x) (the limits at +-inf included), finite wherever the product is."""
        return m * self.ref(x)[1] if self.times_derivative_ref is None else self.times_derivative_ref(m, x)

    def ref(self, x):
        """float64 x -> (act(x), act'(x)) with the entry's limits at +-inf; NaN propagates."""
        f, d = self.formula(x)
        fn, fp, dn, dp = (torch.full_like(x, v) for v in self.limits)
        ninf, pinf = x == -_INF, x == _INF
        return torch.where(ninf, fn, torch.where(pinf, fp, f)), torch.where(ninf, dn, torch.where(pinf, dp, d))


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


def _finite(t):
    return torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0)


# ---- exact GELU: Phi(x) = erfc(-x / sqrt 2) / 2, which does not cancel for x < 0 as 1 + erf does
def _gelu_ref(x):
    cdf = 0.5 * torch.special.erfc(-x * _INV_SQRT2)
    return x * cdf, cdf + x * torch.exp(-0.5 * x * x) * _INV_SQRT_2PI


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
    return x * s, torch.where(sp == 0, s, s + x * dz * sp)


def _gelu_tanh_cancel(x):
    z, dz = _tanh_z(x)
    s = torch.sigmoid(z)
    sp = s * torch.sigmoid(-z)
    return _finite((x * z).abs() * sp), _finite(s + (x * dz).abs() * (s * s + sp * (1.0 + z.abs())))


# ---- SiLU
def _silu_ref(x):
    s = torch.sigmoid(x)
    return x * s, s * (1.0 + x * (1.0 - s))


def _silu_cancel(x):
    return torch.zeros_like(x), _finite(torch.sigmoid(x) * (1.0 + x.abs()))


# ---- ReLU and squared ReLU: exact in every dtype (one rounding of r * r), nothing cancels
def _relu_ref(x):
    return torch.relu(x), torch.where(x > 0, 1.0, torch.where(x <= 0, 0.0, x))


def _relu2_ref(x):
    r = torch.relu(x)
    return r * r, 2.0 * r


def _no_cancel(x):
    return torch.zeros_like(x), torch.zeros_like(x)


# ---- quick GELU: x sigmoid(a x), a = 1.702: SiLU at z = a x, whose rounding the kernels add (z is computed), so
# the value's relative error is (1 - s) |z| ulps and the derivative's |z silu''(z)| ulps, as for tanh GELU's z
_QUICK = 1.702


def _quick_gelu_ref(x):
    z = _QUICK * x
    s = torch.sigmoid(z)
    sp = s * torch.sigmoid(-z)
    return x * s, torch.where(sp == 0, s, s + z * sp)  # z overflows for huge finite x: the limit s, not inf * 0


def _quick_gelu_cancel(x):
    z = _QUICK * x
    s, sp = torch.sigmoid(z), torch.sigmoid(z) * torch.sigmoid(-z)
    return _finite((x * z).abs() * sp), _finite(s * (1.0 + z.abs()) + z.abs() * sp * (2.0 + z.abs()))


def _quick_gelu_aten_backward(g, x):
    s = torch.sigmoid(_QUICK * x)
    return g * (s * (1.0 + _QUICK * x * (1.0 - s)))


ACTIVATIONS = (
    Activation(
        name="gelu",
        gated="geglu",
        api=("gelu", {"approximate": "none"}),
        aten=F.gelu,
        aten_backward=lambda g, x: torch.ops.aten.gelu_backward(g, x),
        hf_names=("gelu", "gelu_python"),
        aten_autograd=True,
        formula=_gelu_ref,
        cancel=_gelu_cancel,
        doc="exact GELU, 0.5 x (1 + erf(x / sqrt 2)) (F.gelu)",
    ),
    Activation(
        name="gelu_tanh",
        gated="geglu_tanh",
        api=("gelu", {"approximate": "tanh"}),
        aten=lambda x: F.gelu(x, approximate="tanh"),
        aten_backward=lambda g, x: torch.ops.aten.gelu_backward(g, x, approximate="tanh"),
        hf_names=("gelu_pytorch_tanh", "gelu_python_tanh", "gelu_new", "gelu_accurate", "gelu_fast"),
        aten_autograd=True,
        formula=_gelu_tanh_ref,
        cancel=_gelu_tanh_cancel,
        doc="tanh GELU, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (F.gelu(approximate='tanh'))",
    ),
    Activation(
        name="silu",
        gated="swiglu",
        api=("silu", {}),
        aten=torch._C._nn.silu,  # F.silu without its Python frame (a decode step pays it per call)
        aten_backward=lambda g, x: torch.ops.aten.silu_backward(g, x),
        aten_autograd=True,
        eager=F.silu,
        hf_names=("silu", "swish"),
        formula=_silu_ref,
        cancel=_silu_cancel,
        doc="SiLU (swish), x sigmoid(x) (F.silu)",
    ),
    Activation(
        name="relu",
        gated="reglu",
        api=("relu", {}),  # ReGLU: the GLU-variants paper's name (Shazeer 2020)
        # grad * step(x), NaN for NaN as every entry (ATen's threshold_backward passes grad there)
        aten=F.relu,
        aten_backward=lambda g, x: g * torch.where(x.isnan(), x, (x > 0).to(x.dtype)),
        hf_names=("relu",),
        formula=_relu_ref,
        cancel=_no_cancel,
        limits=(0.0, _INF, 0.0, 1.0),
        doc="ReLU, max(x, 0) (F.relu; relu'(0) = 0 as ATen's)",
    ),
    Activation(
        name="relu2",
        gated="relu2_glu",
        api=("relu2", {}),
        aten=lambda x: torch.square(F.relu(x)),
        aten_backward=lambda g, x: g * F.relu(x) * 2,
        hf_names=("relu2",),
        formula=_relu2_ref,
        cancel=_no_cancel,
        limits=(0.0, _INF, 0.0, _INF),
        times_derivative_ref=lambda m, x: 2.0 * (m * torch.relu(x)),
        doc="squared ReLU, relu(x)^2 (Primer; Nemotron-H, Arcee AFM; transformers' ReLUSquaredActivation)",
    ),
    Activation(
        name="quick_gelu",
        gated="geglu_quick",
        api=("quick_gelu", {}),
        aten=lambda x: x * torch.sigmoid(_QUICK * x),
        aten_backward=_quick_gelu_aten_backward,
        hf_names=("quick_gelu",),
        formula=_quick_gelu_ref,
        cancel=_quick_gelu_cancel,
        doc="quick GELU, x sigmoid(1.702 x) (CLIP; transformers' QuickGELUActivation)",
    ),
)
BY_NAME = {a.name: a for a in ACTIVATIONS}


def activation_for(function: str, who: str | None = None, **options) -> Activation:
    """The entry the public API reaches as ``ffn_ext.<function>(..., **options)``, e.g. ("gelu", approximate="tanh")
    -> gelu_tanh (the one lookup of GELU's `approximate`); a ValueError naming the option, the values it takes and
    `who` asked (default: the function) otherwise."""
    entries = [a for a in ACTIVATIONS if a.api[0] == function]
    for key, value in options.items():
        allowed = [a.api[1].get(key) for a in entries]
        if not isinstance(value, str) or value not in allowed:
            raise ValueError(f"ffn_ext.{who or function}: `{key}` must be one of {allowed}, got {value!r}")
        entries = [a for a in entries if a.api[1].get(key) == value]
    return entries[0]


# ---------------------------------------------------------------- gated ops
@dataclass(frozen=True)
class Param:
    """A keyword parameter of a gated op (a float in the schema)."""

    name: str
    default: float | None  # None: required
    example: float  # the value the tests and the live check pass (chosen so that the parameter matters)
    doc: str


@dataclass(frozen=True)
class Gated:
    """A gated op: act(gate) * up over an activation, or a function of its own of (gate, up) and parameters, whose
    derivatives are the activation's at a transformed gate (terms)."""

    name: str  # its ops: <name>, <name>_backward, <name>_packed, <name>_packed_backward
    act: Activation
    params: tuple = ()  # Params, keyword-only, in schema order
    aten: Callable | None = None  # (gate, up, **params) -> out with ATen ops (the CPU kernel's); None: act(gate) * up
    aten_backward: Callable | None = None  # (grad, gate, up, **params) -> (dgate, dup); None: Glu's
    terms: Callable | None = None  # see gated_terms
    check: Callable | None = None  # (op, **params): the ValueErrors for bad parameters (check_params: every route)
    doc: str = ""
    # a gate of its own: (its functor, its parameters' struct), both in csrc/ffn_math.h; None: Glu<act>, no parameters
    cpp_gate: tuple[str, str] | None = None

    @property
    def functor(self) -> str:
        """Its gate functor in csrc/ffn_math.h (Glu<Act>: act(gate) * up, or its own)."""
        return f"Glu<math::{self.act.functor}>" if self.cpp_gate is None else self.cpp_gate[0]

    @property
    def example(self) -> dict:
        return {p.name: p.example for p in self.params}

    def forward(self, gate, up, **params):
        return self.act.aten(gate) * up if self.aten is None else self.aten(gate, up, **params)

    def backward(self, grad, gate, up, **params):
        if self.aten_backward is None:
            return self.act.aten_backward(grad * up, gate), grad * self.act.aten(gate)
        return self.aten_backward(grad, gate, up, **params)


def gated_terms(g: Gated, gate, up, grad=None, **params):
    """Gated op g as products of its activation's value or derivative, for float64 references: a list with one entry
    per output (the forward's out, or the backward's dgate, dup) of (which, x, factors, mask): the output is
    prod(factors) * act(x) for which == "f" and prod(factors) * act'(x) for "d", where `mask` (a bool tensor, or
    None) holds, and 0 elsewhere (a select: also where the product is NaN)."""
    if g.terms is not None:
        return g.terms(gate, up, grad, **params)
    if grad is None:
        return [("f", gate, (up,), None)]
    return [("d", gate, (grad, up), None), ("f", gate, (grad,), None)]


# ---- clamped SwiGLU: (clamp(up, -L, L) + up_offset) * x sigmoid(alpha x), x = clamp(gate, max=L) (GPT-OSS,
# DeepSeek-V4). x sigmoid(alpha x) = silu(alpha x) / alpha and its derivative is silu'(alpha x).
def _check_clamp(op, limit, alpha, up_offset):
    if not isinstance(limit, (int, float)) or not limit > 0:
        raise ValueError(f"{op}: `limit` must be > 0, got {limit!r}")
    for name, v in (("alpha", alpha), ("up_offset", up_offset)):
        if not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{op}: `{name}` must be finite, got {v!r}")


# torch.clamp's gradient at the bound itself: passed before torch 2.14, 0 since (pytorch#191142, the minimum-norm
# subgradient); the CUDA kernels follow the running torch too (csrc/shapes.cpp for_dtype).
CLAMP_GRAD_AT_BOUND = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 14)


def clamp_pass(gate, up, limit):
    """Where swiglu_clamped's clamps pass the gradient: (for gate, for up), bool tensors."""
    if CLAMP_GRAD_AT_BOUND:
        return gate <= limit, (up >= -limit) & (up <= limit)
    return gate < limit, (up > -limit) & (up < limit)


def _clamped(gate, up, limit, alpha=1.0, up_offset=0.0):
    g = gate.clamp(max=limit)  # transformers' GptOssExperts._apply_gate, in its order
    return (up.clamp(-limit, limit) + up_offset) * (g * torch.sigmoid(g * alpha))


def _clamped_backward(grad, gate, up, limit, alpha=1.0, up_offset=0.0):
    g = gate.clamp(max=limit)
    z = g * alpha
    s = torch.sigmoid(z)
    dh = s * (1 + z * (1 - s))
    zero = torch.zeros((), dtype=grad.dtype, device=grad.device)
    pass_g, pass_u = clamp_pass(gate, up, limit)
    return torch.where(pass_g, grad * (up.clamp(-limit, limit) + up_offset) * dh, zero), torch.where(
        pass_u, grad * (g * s), zero
    )


def _clamped_terms(gate, up, grad, limit, alpha=1.0, up_offset=0.0):
    x = alpha * gate.clamp(max=limit)
    c = up.clamp(-limit, limit) + up_offset
    if grad is None:
        return [("f", x, (c / alpha,), None)]
    pass_g, pass_u = clamp_pass(gate, up, limit)
    return [("d", x, (grad, c), pass_g), ("f", x, (grad / alpha,), pass_u)]


GATED = tuple(Gated(a.gated, a, doc=f"{a.name}(gate) * up") for a in ACTIVATIONS) + (
    Gated(
        "swiglu_clamped",
        BY_NAME["silu"],
        params=(
            Param("limit", None, 2.5, "clamp bound, > 0: gate <= limit, -limit <= up <= limit"),
            Param("alpha", 1.0, 1.702, "gate * sigmoid(alpha * gate)"),
            Param("up_offset", 0.0, 1.0, "added to the clamped up"),
        ),
        aten=_clamped,
        aten_backward=_clamped_backward,
        terms=_clamped_terms,
        check=_check_clamp,
        cpp_gate=("SwigluClamped", "ClampParams"),
        doc="(clamp(up, -limit, limit) + up_offset) * g * sigmoid(alpha * g), g = clamp(gate, max=limit) "
        "(GPT-OSS: alpha=1.702, up_offset=1, limit=7; DeepSeek-V4: alpha=1, up_offset=0)",
    ),
)
GATED_BY_NAME = {g.name: g for g in GATED}
LAYOUTS = ("concat", "interleaved")  # the packed ops' gate_up layouts


def bind_params(who: str, gated: Gated, params: dict, extra: tuple = ()) -> dict:
    """A gated op's parameters from keyword arguments: every one, in schema order, defaults filled in; an unknown
    keyword (but those in `extra`: a packed op's layout) or a missing required one is a TypeError naming `who`."""
    names = [p.name for p in gated.params]
    unknown = sorted(set(params) - set(names) - set(extra))
    if unknown:
        raise TypeError(f"{who}: unexpected keyword argument(s) {unknown}; {gated.name} takes {names}")
    out = {p.name: params.get(p.name, p.default) for p in gated.params}
    missing = [k for k, v in out.items() if v is None]
    if missing:
        raise TypeError(f"{who}: missing required keyword argument(s) {missing}")
    return out


def check_params(op: str, gated: Gated, params: dict) -> None:
    """The checks of a gated op's parameters (every route's: ffn_ext/_kernels.py check)."""
    if gated.check is not None:
        gated.check(op, **params)


def split_packed(t, layout: str):
    """gate, up of a packed [..., 2M] tensor in `layout` (views)."""
    return t.chunk(2, dim=-1) if layout == "concat" else (t[..., 0::2], t[..., 1::2])


def join_packed(a, b, layout: str):
    """The [..., 2M] tensor of a, b in `layout`."""
    return torch.cat((a, b), dim=-1) if layout == "concat" else torch.stack((a, b), dim=-1).flatten(-2)


# ---------------------------------------------------------------- the ops, derived
@dataclass(frozen=True)
class OpSpec:
    name: str  # torch.ops.ffn_ext.<name>
    act: Activation
    kind: str  # "unary" | "gated" | "packed"
    backward: bool
    args: tuple  # tensor argument names, as in the schema and the error messages
    n_outputs: int
    gated: Gated | None = None  # the gated op, for kind "gated" and "packed"
    params: tuple = ()  # its Params (keyword-only); packed ops also take layout="concat" | "interleaved"
    # <act>_backward_recompute(grad, x) -> (grad * act'(x), act(x)) and <gated>_backward_recompute(grad, gate, up) ->
    # (dgate, dup, h) in one pass: the lean MLPs' backward (h recomputed for the down projection's weight gradient,
    # not saved)
    recompute: bool = False
    differentiable: bool = True  # has an autograd formula (the recompute ops have none: they serve backward passes)

    @property
    def forward_name(self) -> str:
        if self.recompute:
            return self.name[: -len("_backward_recompute")]
        return self.name[: -len("_backward")] if self.backward else self.name

    def compute(self, args: tuple, params: dict, layout: str | None = "concat"):
        """The op on tensors `args` with the table's ATen forms (differentiable ATen ops throughout): the CPU
        kernel's result after its checks, and the ATen column of the main job's and the tests' checks. params: a
        gated op's parameters, all of them; layout: a packed op's."""
        if self.recompute and self.kind == "unary":
            return self.act.aten_backward(*args), self.act.aten(args[1])
        if self.recompute:
            assert self.gated is not None
            return (*self.gated.backward(*args, **params), self.gated.forward(*args[1:], **params))
        if self.kind == "unary":
            return self.act.aten_backward(*args) if self.backward else self.act.aten(*args)
        g = self.gated
        assert g is not None
        if self.kind == "packed":
            assert layout is not None
            if not self.backward:
                return g.forward(*split_packed(args[0], layout), **params)
            grad, gate_up = args
            dgate, dup = g.backward(grad, *split_packed(gate_up, layout), **params)
            return join_packed(dgate, dup, layout)
        return g.backward(*args, **params) if self.backward else g.forward(*args, **params)

    @property
    def aten_autograd(self) -> bool:
        """On the CPU its autograd is ATen's, of its CPU kernel's form: the forward ops whose backward op computes
        what ATen's autograd of the form does, bit for bit (their activation's aten_autograd), so that eager and a
        compiled graph (which keeps the op) agree. Not with parameters: ATen's autograd of the clamped SwiGLU's form
        rounds differently from the op's formula (up to 1e-3 relative in fp32 where it cancels)."""
        return self.act.aten_autograd and not self.backward and not self.params

    @property
    def example(self) -> dict:
        """Keyword arguments for a call with every parameter set to its example value (tests, live check)."""
        return {p.name: p.example for p in self.params}

    @property
    def pointwise(self) -> bool:
        """Elementwise over same-shaped inputs (torch.Tag.pointwise, as ATen's gelu and mul): every op but the
        packed ones, which pair elements along the last dimension."""
        return self.kind != "packed"

    @property
    def schema(self) -> str:
        """Its schema, as the native library registers it (csrc/registration.cpp)."""
        params = [f"float {p.name}" + ("" if p.default is None else f"={p.default!r}") for p in self.params]
        kw = params + (['str layout="concat"'] if self.kind == "packed" else [])
        ins = ", ".join([f"Tensor {a}" for a in self.args] + (["*", *kw] if kw else []))
        outs = "Tensor" if self.n_outputs == 1 else "(" + ", ".join(["Tensor"] * self.n_outputs) + ")"
        return f"{self.name}({ins}) -> {outs}"


def _specs(act: Activation):
    return (
        OpSpec(act.name, act, "unary", False, ("x",), 1),
        OpSpec(act.name + "_backward", act, "unary", True, ("grad", "x"), 1),
        OpSpec(
            act.name + "_backward_recompute", act, "unary", True, ("grad", "x"), 2, recompute=True, differentiable=False
        ),
    )


def _gated_specs(g: Gated):
    n, a, p = g.name, g.act, g.params
    return (
        OpSpec(n, a, "gated", False, ("gate", "up"), 1, g, p),
        OpSpec(n + "_backward", a, "gated", True, ("grad", "gate", "up"), 2, g, p),
        OpSpec(
            n + "_backward_recompute",
            a,
            "gated",
            True,
            ("grad", "gate", "up"),
            3,
            g,
            p,
            recompute=True,
            differentiable=False,
        ),
        OpSpec(n + "_packed", a, "packed", False, ("gate_up",), 1, g, p),
        OpSpec(n + "_packed_backward", a, "packed", True, ("grad", "gate_up"), 1, g, p),
    )


OPS = {s.name: s for specs in ([_specs(a) for a in ACTIVATIONS] + [_gated_specs(g) for g in GATED]) for s in specs}

# The quantizing ops (ffn_ext.quant): <gated>_quant(gate, up, *, recipe, params) and <gated>_packed_quant(gate_up,
# *, recipe, params, layout) for every gated op, and quantize(x, *, recipe); each returns (q, scale). The recipe's
# arguments (ffn_ext.QuantRecipe's fields, op_kwargs) in schema order:
QUANT_RECIPE_SCHEMA = (
    "ScalarType dtype, str scaling, int group_size, bool pow2_scales, ScalarType scale_dtype, str scale_layout, "
    "float? static_scale"
)


def _quant_schemas() -> dict:
    out = {}
    for g in GATED:
        for spec in (OPS[g.name], OPS[g.name + "_packed"]):
            kw = spec.schema[spec.schema.index("(") + 1 : spec.schema.index(")")].split(", ")
            tensors, rest = (
                [a for a in kw if a.startswith("Tensor")],
                [a for a in kw if not a.startswith(("Tensor", "*"))],
            )
            args = ", ".join([*tensors, "*", QUANT_RECIPE_SCHEMA, *rest])
            out[spec.name + "_quant"] = f"{spec.name}_quant({args}) -> (Tensor, Tensor)"
    out["quantize"] = f"quantize(Tensor x, *, {QUANT_RECIPE_SCHEMA}) -> (Tensor, Tensor)"
    return out


QUANT_SCHEMAS = _quant_schemas()  # name -> schema

# The FP8 activation cache's ops (saved_dtype=torch.float8_e4m3fn in ffn_ext.mlp), for every gated op:
#   <gated>_cache(gate, up, *, group_size=128, params) -> (h, q, scale): h the gated op's output; gate and up
#     quantized by ffn_ext.quant's formula (float8_e4m3fn, float32 scales per 1 x group_size group) into q [..., 2M]
#     (gate's values, then up's) and scale [..., 2M / group_size], in one pass;
#   <gated>_cached_backward(grad, q, scale, *, params) -> (dgate, dup, h): gate and up read back from the cache
#     (fp8 * scale, rounded to grad's dtype), then the gated op's backward and forward of them, in one pass.
# Forward only (they serve the MLPs' autograd); csrc/cache_kernel.h has their CUDA kernels.
CACHE_GROUP_SIZES = (128, 64, 32)


def _cache_schemas() -> dict:
    out = {}
    for g in GATED:
        params = [f"float {p.name}" + ("" if p.default is None else f"={p.default!r}") for p in g.params]
        kw = ", ".join(["*", "int group_size=128", *params])
        out[g.name + "_cache"] = f"{g.name}_cache(Tensor gate, Tensor up, {kw}) -> (Tensor, Tensor, Tensor)"
        back = ", ".join(["Tensor grad", "Tensor q", "Tensor scale", *(["*", *params] if params else [])])
        out[g.name + "_cached_backward"] = f"{g.name}_cached_backward({back}) -> (Tensor, Tensor, Tensor)"
    return out


CACHE_SCHEMAS = _cache_schemas()  # name -> schema
# Every schema of the ffn_ext namespace, (schema, pointwise) in registration order: what the native library
# registers (csrc/registration.cpp, from the generated ops_table.h) and, without one, ffn_ext._kernels.define.
SCHEMAS = (
    [(s.schema, s.pointwise) for s in OPS.values()]
    + [(q, False) for q in QUANT_SCHEMAS.values()]
    + [(c, False) for c in CACHE_SCHEMAS.values()]
)


def op_spec(name: str) -> OpSpec:
    return OPS[name]
