"""The ffn_ext ops as the tests see them: op lists, inputs, the float64 reference and tolerances, all derived from
the op table (ffn_ext/table.py), so an activation or a gated op added there is tested by every test file without
editing it.

Import it from a test file as ``from optable import ...`` (tests/ is on sys.path: pytest puts the directory of
the rootdir conftest there, and ``python tests/<script>.py`` runs with tests/ first on the path). conftest.py holds
only pytest's hooks, fixtures and markers.

Gated ops with keyword parameters (the table's Gated.params, e.g. swiglu_clamped's limit, alpha, up_offset) are
called with their example values (spec.example) unless `params` says otherwise; packed ops take a `packing`, the
op's layout= argument ("concat" [gate | up] or "interleaved" [g0, u0, g1, u1, ...]; PACKINGS), default "concat".
(LAYOUTS are memory layouts of one tensor: strides, offsets; make_layout.)

  SPECS, OPS, FORWARD_OPS, BACKWARD_OPS, UNARY_OPS, GATED_OPS, PACKED_OPS   op names from the table
  PARAM_OPS, HOST_OPS          the ops with keyword parameters; the ops _host_math (tests/native.py) runs (not packed)
  NO_AUTOGRAD_OPS              the ops without an autograd formula (OpSpec.differentiable: the recompute ops)
  GATED, GATED_IDS, PACKINGS   the table's Gated entries and their names; the packed ops' gate_up layouts
  N_INPUTS, N_OUTPUTS, ARG_NAMES, ACTIVATIONS, ACT_NAMES                      per op / per activation
  op(name), spec(name), is_packed(name), activation_arg(name), ops_of(kind, backward, act, gated)
  params_of(name, params)      the parameters an op is called with (default: the table's examples)
  applied_params(name, params, dtype)   ... as torch applies them to a dtype (a clamp bound rounded to it)
  op_kwargs(name, packing, params)   an op call's keyword arguments (parameters, layout=packing)
  host_params(name, params)    the test paths' params list ([limit, alpha, up_offset], or [])
  call(name, packing, params)
                               the op with its keyword arguments
  api_call(name, packing, params)    the public API callable of forward op `name` (gelu(approximate=),
                               gated(activation=), gated_packed(layout=), swiglu_clamped(limit=, ...), ...)
  terms(name, inputs, params)  an op (not packed) as products: which act value, times what, where (mask)
  value(name, *inputs, params=)   a forward op (not packed) in float64 from its terms, differentiable (autograd)
  unpack(name, inputs, packing) / repack(name, outs, packing)
                               a packed op as its gated op on the two halves of gate_up and back
  reference(name, *inputs, inf_limits=False, packing=, params=)   float64 result (ATen semantics, or the limits)
  aten_result(name, *inputs, packing=, params=)   ATen's composite in the inputs' own dtype (the CPU kernels)
  error_scale(name, *inputs, packing=, params=)   size of the terms the kernels' formulas cancel (act.cancel, and
                               the rounding of a computed activation argument)
  limit_terms(name, inputs, params)  per output: fp64 value with the limits at +-inf, spread, |factors|
  tolerance(dtype), assert_close_to, assert_matches_reference(..., packing=, params=)
  make_layout, make_chunk_pair, make_inputs(..., packing=, params=, at_bounds=), input_shapes, LAYOUTS,
  FLOAT_DTYPES, CPU_DTYPES, DEVICES, RecordOps, poison_cuda_cache, as_tuple
  gating_cases(), gated_modules(op, params, layout), unary_module(entry), y0_weight(y)
                               the modules' side: every gated op with its parameters, the modules computing one,
                               a loss weighting
"""

from __future__ import annotations

import functools
import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ffn_ext
from ffn_ext import table as _table
from ffn_ext.table import ACTIVATIONS, BY_NAME, GATED
from ffn_ext.table import OPS as SPECS

try:  # the plain scripts (cuda_sanitize_cases.py) import this module without pytest
    import pytest
except ImportError:  # pragma: no cover
    pytest = None

__all__ = [
    "ACTIVATIONS",
    "ACT_NAMES",
    "BY_NAME",
    "GATED",
    "GATED_IDS",
    "SPECS",
    "OPS",
    "FORWARD_OPS",
    "BACKWARD_OPS",
    "UNARY_OPS",
    "GATED_OPS",
    "PACKED_OPS",
    "NO_AUTOGRAD_OPS",
    "PARAM_OPS",
    "HOST_OPS",
    "N_INPUTS",
    "N_OUTPUTS",
    "ARG_NAMES",
    "FLOAT_DTYPES",
    "CPU_DTYPES",
    "DEVICES",
    "LAYOUTS",
    "PACKINGS",
    "op",
    "call",
    "spec",
    "is_packed",
    "activation_arg",
    "api_call",
    "ops_of",
    "params_of",
    "applied_params",
    "op_kwargs",
    "host_params",
    "terms",
    "value",
    "gating_cases",
    "gated_modules",
    "unary_module",
    "y0_weight",
    "limit_terms",
    "unpack",
    "repack",
    "reference",
    "aten_result",
    "error_scale",
    "tolerance",
    "assert_close_to",
    "assert_matches_reference",
    "make_layout",
    "make_chunk_pair",
    "make_inputs",
    "input_shapes",
    "as_tuple",
    "RecordOps",
    "poison_cuda_cache",
]

# ---------------------------------------------------------------- ops, from the table
OPS = tuple(SPECS)  # every op of torch.ops.ffn_ext, forward and backward
FORWARD_OPS = tuple(n for n, s in SPECS.items() if not s.backward)
BACKWARD_OPS = tuple(n for n, s in SPECS.items() if s.backward)
UNARY_OPS = tuple(n for n in FORWARD_OPS if SPECS[n].kind == "unary")  # forward ops only, as GATED/PACKED_OPS
GATED_OPS = tuple(n for n in FORWARD_OPS if SPECS[n].kind == "gated")
PACKED_OPS = tuple(n for n in FORWARD_OPS if SPECS[n].kind == "packed")
NO_AUTOGRAD_OPS = tuple(n for n, s in SPECS.items() if not s.differentiable)  # the table says: <act>_backward_recompute
PARAM_OPS = tuple(n for n, s in SPECS.items() if s.params)  # ops with keyword parameters, forward and backward
HOST_OPS = tuple(n for n in OPS if SPECS[n].kind != "packed")  # what _host_math (tests/native.py) runs
ACT_NAMES = tuple(a.name for a in ACTIVATIONS)
GATED_IDS = tuple(g.name for g in GATED)  # the gated ops of the table (GATED: their entries)
N_INPUTS = {n: len(s.args) for n, s in SPECS.items()}
N_OUTPUTS = {n: s.n_outputs for n, s in SPECS.items()}
ARG_NAMES = {n: s.args for n, s in SPECS.items()}  # as in the schemas and the error messages
PACKINGS = tuple(_table.LAYOUTS)  # the packed ops' gate_up layouts (their `layout` argument): concat, interleaved

FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
CPU_DTYPES = (torch.float64, torch.float32, torch.bfloat16)

# A device parameter list: `@pytest.mark.parametrize("device", DEVICES)`.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)] if pytest is not None else ["cpu", "cuda"]


def op(name: str):
    """torch.ops.ffn_ext.<name> (the packet: a gated op with parameters needs them as keyword arguments)."""
    return getattr(torch.ops.ffn_ext, name)


def spec(name: str):
    """The table's OpSpec of op `name` (act, kind, backward, args, n_outputs, gated, params)."""
    return SPECS[name]


def params_of(name: str, params: dict | None = None) -> dict:
    """The parameters op `name` is called with: `params`, or the table's example values (spec.example; {} for the
    ops without parameters)."""
    return dict(SPECS[name].example if params is None else params)


def op_kwargs(name: str, packing: str | None = None, params: dict | None = None) -> dict:
    """The keyword arguments of a call of op `name`: its parameters (params_of) and, for a packed op given a
    `packing`, layout=packing (None: the op's default, "concat", by leaving it out)."""
    kw = params_of(name, params)
    if packing is not None:
        assert SPECS[name].kind == "packed", f"{name}: only the packed ops take a layout"
        kw["layout"] = packing
    return kw


def applied_params(name: str, params: dict | None, dtype: torch.dtype) -> dict:
    """The parameters as torch applies them to inputs of `dtype`: a clamp bound (`limit`) rounded to the dtype, as
    torch.clamp rounds its scalar bounds (so GPT-OSS's expression in bfloat16 with limit 2.3 clamps at, and stops
    the gradient of, 2.296875). The float64 reference uses these, so that it clamps where torch does for any limit,
    not only for limits the dtype holds exactly (2.5, 7.0)."""
    p = params_of(name, params)
    if "limit" in p and dtype != torch.float64:
        p["limit"] = float(torch.tensor(p["limit"], dtype=torch.float64).to(dtype))
    return p


def host_params(name: str, params: dict | None = None) -> list:
    """The `params` list of _host_math / _emulate_cuda (tests/native.py): the op's parameters in schema order ([limit,
    alpha, up_offset] for swiglu_clamped; [] for the ops without parameters)."""
    p = params_of(name, params)
    return [float(p.get(q.name, q.default)) for q in SPECS[name].params]


def call(name: str, packing: str | None = None, params: dict | None = None):
    """op(name) with its keyword arguments (op_kwargs: the example parameters, layout=packing)."""
    kw = op_kwargs(name, packing, params)
    o = op(name)
    return functools.partial(o, **kw) if kw else o


def ops_of(kind: str | None = None, backward: bool | None = None, act=None, gated=None) -> tuple:
    """The op names of the table with the given kind ("unary", "gated", "packed"), direction, activation and gated
    op (a Gated entry or its name)."""
    g = getattr(gated, "name", gated)
    return tuple(
        n
        for n, s in SPECS.items()
        if (kind is None or s.kind == kind)
        and (backward is None or s.backward == backward)
        and (act is None or s.act.name == getattr(act, "name", act))
        and (g is None or (s.gated is not None and s.gated.name == g))
    )


def as_tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def is_packed(name: str) -> bool:
    """True for the packed ops (<gated>_packed and <gated>_packed_backward: gate_up is [..., 2M])."""
    return SPECS[name].kind == "packed"


def activation_arg(name: str) -> int:
    """Index of the argument the activation applies to: x, gate or gate_up (which holds the gate)."""
    return 1 if SPECS[name].backward else 0


def api_call(name: str, packing: str | None = None, params: dict | None = None):
    """The public API callable that runs forward op `name`: ffn_ext.gelu(x, approximate="tanh") for gelu_tanh,
    ffn_ext.gated(gate, up, activation=...) for the gated ops over an activation, ffn_ext.gated_packed(...,
    layout=packing) for their packed ones, and a gated op with parameters by its own name with them
    (ffn_ext.swiglu_clamped(gate, up, limit=, alpha=, up_offset=), ffn_ext.swiglu_clamped_packed(..., layout=))."""
    s = SPECS[name]
    assert not s.backward, f"{name}: backward ops have no public API"
    if s.kind == "unary":
        function, options = s.act.api
        return functools.partial(getattr(ffn_ext, function), **options)
    kw = op_kwargs(name, packing, params)
    if s.params:
        return functools.partial(getattr(ffn_ext, name), **kw)
    fn = ffn_ext.gated if s.kind == "gated" else ffn_ext.gated_packed
    return functools.partial(fn, activation=s.act.name, **kw)


def input_shapes(name: str, shape, packing: str | None = None) -> tuple:
    """Input shapes of op `name` whose (first) output has shape `shape`. Packed ops: gate_up is [..., 2M] for an
    output [..., M], in either packing (accepted for symmetry: the shapes do not depend on it); their `grad` has
    the forward output's shape [..., M]."""
    assert packing is None or packing in PACKINGS, packing
    shape = tuple(shape)
    if is_packed(name):
        packed = shape[:-1] + (2 * shape[-1],)
        return (shape, packed) if SPECS[name].backward else (packed,)
    return (shape,) * N_INPUTS[name]


# ---------------------------------------------------------------- the ops as formulas
def terms(name: str, inputs, params: dict | None = None):
    """Op `name` (not packed) written as products, one per output: (which, x, factors, mask) where the output is
    prod(factors) * act(x) for which == "f" and prod(factors) * act'(x) for which == "d" where `mask` (a bool
    tensor, or None: everywhere) holds, and 0 elsewhere (a select: also where the product is NaN). Factors multiply
    left to right, first of all (grad * up before the derivative, as the kernels do). Gated ops come from the
    table's gated_terms (with parameters: x may be computed from the inputs, e.g. alpha * clamp(gate))."""
    s = SPECS[name]
    assert s.kind != "packed", f"{name}: unpack() a packed op first"
    if s.kind == "unary":
        if s.backward:
            grad, x = inputs
            return [("d", x, (grad,), None)] + ([("f", x, (), None)] if s.recompute else [])
        return [("f", inputs[0], (), None)]
    p = params_of(name, params)
    if s.backward:
        grad, gate, up = inputs
        back = list(_table.gated_terms(s.gated, gate, up, grad, **p))
        return back + (list(_table.gated_terms(s.gated, gate, up, **p)) if s.recompute else [])
    gate, up = inputs
    return list(_table.gated_terms(s.gated, gate, up, **p))


def unpack(name: str, inputs, packing: str = "concat"):
    """A packed op's inputs as its gated op's: (gated op name, inputs with gate, up = the two halves of gate_up in
    `packing`: chunk(2, -1) for "concat", [..., 0::2] and [..., 1::2] for "interleaved")."""
    s = SPECS[name]
    assert s.kind == "packed", name
    gated = s.gated.name + ("_backward" if s.backward else "")
    if s.backward:
        grad, gate_up = inputs
        return gated, (grad, *_table.split_packed(gate_up, packing))
    return gated, tuple(_table.split_packed(inputs[0], packing))


def repack(name: str, outs, packing: str = "concat"):
    """The gated op's outputs as packed op `name`'s: the backward's (dgate, dup) joined to [..., 2M] in
    `packing`."""
    outs = as_tuple(outs)
    return (_table.join_packed(*outs, packing),) if SPECS[name].backward else outs


def _prod(factors):
    out = None
    for f in factors:
        out = f if out is None else out * f
    return out


def _select(mask, t):
    return t if mask is None else torch.where(mask, t, torch.zeros((), dtype=t.dtype, device=t.device))


def _untuple(outs):
    outs = tuple(outs)
    return outs if len(outs) > 1 else outs[0]


def value(name: str, *inputs: torch.Tensor, params: dict | None = None) -> torch.Tensor:
    """Forward op `name` (not packed) on float64 inputs from its terms and the table's act.ref, without detaching
    them: autograd through it gives the op's gradients, so a module's float64 composition is written with it."""
    ((_, x, factors, mask),) = terms(name, inputs, params)
    v = SPECS[name].act.ref(x)[0]
    return _select(mask, v if not factors else _prod(factors) * v)


def _aten(name, inputs, packing, params):
    """Op `name` with the table's ATen composites (OpSpec.compute), in the inputs' dtype."""
    return SPECS[name].compute(tuple(inputs), params_of(name, params), packing)


def _with_limits(name, inputs, packing, params):
    """Op `name` from its terms and the table's act.ref (the limits at +-inf), masks applied."""
    if is_packed(name):
        gated, ins = unpack(name, inputs, packing)
        return _untuple(repack(name, _with_limits(gated, ins, packing, params), packing))
    return _untuple(v for v, _, _ in limit_terms(name, inputs, params))


def _second_derivative(act, x):
    """act''(x) in float64 (autograd through the table's act.ref; 0 where it is not finite)."""
    with torch.enable_grad():
        xg = x.detach().clone().requires_grad_(True)
        (d2,) = torch.autograd.grad(act.ref(xg)[1].sum(), xg)
    return torch.nan_to_num(d2, nan=0.0, posinf=0.0, neginf=0.0)


def limit_terms(name: str, inputs, params: dict | None = None):
    """Op `name` (not packed) on float64 inputs, per output: (value, spread, size), where value is the result with
    the mathematical limits the CUDA kernels implement (the table's act.ref), spread the size of what the kernels'
    formulas cancel (act.cancel, times |factors|) and size = |prod(factors)|, the factor the activation's value or
    derivative is multiplied by; masks applied (0 where the op selects 0).

    Where the activation's argument x is computed from the inputs (not one of them: a gated op with parameters,
    x = alpha * clamp(gate)), the kernels round it, so ulps of |x| propagate: the spread also holds |x act'(x)| for
    a value and |x act''(x)| for a derivative (times |factors|)."""
    act = SPECS[name].act
    out = []
    for which, x, factors, mask in terms(name, inputs, params):
        k = 0 if which == "f" else 1
        v, s = act.ref(x)[k], act.cancel(x)[k]
        if not any(x is t for t in inputs):
            slope = act.ref(x)[1] if k == 0 else _second_derivative(act, x)
            s = s + torch.nan_to_num((x * slope).abs(), nan=0.0, posinf=0.0)
        m = _prod(factors)
        size = torch.ones_like(x) if m is None else m.abs()
        mv = v if m is None else (act.times_derivative(m, x) if k == 1 else m * v)  # an unbounded act' overflows alone
        out.append((_select(mask, mv), _select(mask, s * size), _select(mask, size)))
    return out


def reference(
    name: str, *inputs: torch.Tensor, inf_limits: bool = False, packing: str = "concat", params: dict | None = None
):
    """The result of op `name` on `inputs` (called with op_kwargs(name, packing, params)) in float64 from the same
    input values (upcast exactly), on the inputs' device. A tensor, or a tuple for the gated backward ops, like the
    op.

    inf_limits=False: ATen's semantics (the table's act.aten / act.aten_backward, a gated op's Gated.forward /
    backward, in float64; e.g. NaN for silu(-inf)), what the CPU kernels return.
    inf_limits=True: the mathematical limits the CUDA kernels implement (the table's act.ref: act(-inf) = -0,
    act(+inf) = +inf, act'(-inf) = 0, act'(+inf) = 1; NaN propagates; the terms' masks select 0).
    A clamp bound applies as torch applies it to the inputs' dtype (applied_params)."""
    d = [t.detach().double() for t in inputs]
    params = applied_params(name, params, inputs[-1].dtype)
    if inf_limits:
        return _with_limits(name, d, packing, params)
    return _aten(name, d, packing, params)


def aten_result(name: str, *inputs: torch.Tensor, packing: str = "concat", params: dict | None = None):
    """Op `name` with the table's ATen composites in the inputs' own dtype and device (what the CPU kernels
    compute, intermediates rounded to the dtype)."""
    return _aten(name, [t.detach() for t in inputs], packing, params)


def error_scale(name: str, *inputs: torch.Tensor, packing: str = "concat", params: dict | None = None):
    """Per output of op `name` (a tuple of float64 tensors): S, the size of the terms the kernels' formulas cancel
    (limit_terms' spread: the table's act.cancel times the factors the activation value is multiplied by, |up|,
    |grad|, ..., and the rounding of a computed activation argument). Rounding errors of a few ulps of the compute
    type are relative to |result| + S, not to |result| alone: e.g. the exact GELU's 1 + erf(x / sqrt 2) cancels
    for x < 0, so geglu's error in float32 is ulps of |gate| |up|."""
    d = [t.detach().double() for t in inputs]
    params = applied_params(name, params, inputs[-1].dtype)
    if is_packed(name):
        gated, d = unpack(name, d, packing)
        return repack(name, error_scale(gated, *d, params=params), packing)
    return tuple(s for _, s, _ in limit_terms(name, d, params))


# ---------------------------------------------------------------- tolerances
_TOL = {
    # A fused kernel rounds once (error <= 0.5 ulp of the storage type, plus the float math's few ulp); the CPU
    # composites round an intermediate too (act(gate) before * up), hence bf16/fp16 rtol of about 2-3 ulp.
    torch.float64: dict(rtol=1e-12, atol=1e-12),
    torch.float32: dict(rtol=1e-5, atol=1e-6),
    torch.float16: dict(rtol=1e-3, atol=1e-5),
    torch.bfloat16: dict(rtol=1e-2, atol=1e-5),
}


def tolerance(dtype: torch.dtype) -> dict:
    """dict(rtol=, atol=) for comparing a result computed in `dtype` with the float64 reference(). The atol covers
    results near the zero crossings of the derivatives (silu' at x ~ -1.28, gelu' and the tanh gelu' at
    x ~ -0.75), where the float math cancels."""
    return dict(_TOL[dtype])


def _close(a, e, rtol, atol, spread=None):
    """Elementwise: a == e (infinities), both NaN, or |a - e| <= atol + rtol * (|e| + spread) where e is finite."""
    bound = e.abs() if spread is None else e.abs() + torch.nan_to_num(spread.double(), nan=0.0, posinf=0.0)
    return (a == e) | (a.isnan() & e.isnan()) | (e.isfinite() & ((a - e).abs() <= atol + rtol * bound))


def assert_close_to(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, msg: str = "", scale=1.0, spread=None, alt=None
):
    """actual (any float dtype) vs an fp64 expected, with tolerance(dtype) times `scale`; NaN must match NaN.
    spread: error_scale(), added to |expected| for the rtol. alt: alternative expected values (a tensor or a list:
    ATen's results in the same dtype, for the ATen composites), each accepted element by element where it is
    within the tolerance."""
    tol = tolerance(dtype)
    rtol, atol = tol["rtol"] * scale, tol["atol"] * scale
    if spread is None and alt is None:
        torch.testing.assert_close(
            actual.double(),
            expected.double(),
            rtol=rtol,
            atol=atol,
            equal_nan=True,
            check_device=True,
            msg=(lambda m: f"{msg}\n{m}") if msg else None,
        )
        return
    a, e = actual.double(), expected.double()
    assert a.shape == e.shape and a.device == e.device, (msg, a.shape, e.shape, a.device, e.device)
    ok = _close(a, e, rtol, atol, spread)
    alts = [] if alt is None else list(as_tuple(alt))
    for t in alts:
        ok |= _close(a, t.double(), rtol, atol)
    if not bool(ok.all()):
        bad = (~ok).nonzero()[:5].tolist()
        sp = torch.zeros_like(e) if spread is None else spread.double()
        raise AssertionError(
            f"{msg}\n{int((~ok).sum())} of {ok.numel()} elements out of tolerance (rtol={rtol:g}, atol={atol:g}, "
            f"times |expected| + spread); first: "
            + "; ".join(
                f"{tuple(i)}: got {a[tuple(i)].item()!r} expected {e[tuple(i)].item()!r} spread "
                f"{sp[tuple(i)].item():.3g}" + "".join(f" alt {t[tuple(i)].item()!r}" for t in alts)
                for i in bad
            )
        )


def _stepped(t):
    """A copy of t whose last dimension has stride 2 (ATen then runs its scalar loop, not the vectorized one)."""
    if t.dim() == 0 or t.numel() == 0:
        return t.clone()
    buf = torch.empty(t.shape[:-1] + (2 * t.shape[-1],), dtype=t.dtype, device=t.device)[..., ::2]
    return buf.copy_(t)


def _loop_variants(inputs):
    return (tuple(inputs), tuple(t.contiguous() for t in inputs), tuple(_stepped(t) for t in inputs))


def assert_matches_reference(
    name: str,
    inputs,
    out,
    msg: str = "",
    inf_limits: bool = False,
    scale=1.0,
    aten=None,
    packing: str = "concat",
    params: dict | None = None,
):
    """Checks op `name`'s result `out` (tensor or tuple) for `inputs` (called with op_kwargs(name, packing,
    params)): shape, dtype, device, contiguity, and values against reference() within tolerance(dtype) * scale,
    relative to |reference| + error_scale().
    aten (default: inputs on the CPU, no inf_limits): also accept, element by element, ATen's own result in the
    dtype (aten_result, on the inputs as given, on contiguous copies and on copies with a step, as ATen's
    vectorized and scalar loops differ in the last bits): the CPU kernels are ATen's composites, whose accuracy is
    ATen's (e.g. the float32 backward of F.gelu(approximate="tanh") loses ~1e-6 absolute to the 1 - tanh^2 it
    cancels)."""
    kw = dict(packing=packing, params=params)
    outs, refs = as_tuple(out), as_tuple(reference(name, *inputs, inf_limits=inf_limits, **kw))
    assert len(outs) == N_OUTPUTS[name], f"{name}: expected {N_OUTPUTS[name]} outputs, got {len(outs)}"
    spreads = error_scale(name, *inputs, **kw)
    if aten is None:
        aten = inputs[0].device.type == "cpu" and not inf_limits
    alts = (
        list(zip(*(as_tuple(aten_result(name, *ins, **kw)) for ins in _loop_variants(inputs))))
        if aten
        else (None,) * len(outs)
    )
    dtype = inputs[0].dtype
    for k, (o, r, s, a) in enumerate(zip(outs, refs, spreads, alts)):
        where = f"{name} output {k} {msg}"
        assert isinstance(o, torch.Tensor), where
        assert o.shape == r.shape, f"{where}: shape {tuple(o.shape)} != expected {tuple(r.shape)}"
        assert o.dtype == dtype, f"{where}: dtype {o.dtype} != input dtype {dtype}"
        assert o.device == inputs[0].device, f"{where}: device {o.device} != {inputs[0].device}"
        # the ops' outputs are fresh contiguous tensors
        assert o.is_contiguous(), f"{where}: output is not contiguous (strides {o.stride()})"
        assert_close_to(o, r, dtype, where, scale=scale, spread=s, alt=a)


# ---------------------------------------------------------------- the modules' side
def gating_cases():
    """(op, params, id) of every gated op of the table: its plain form, and for an op with parameters their examples
    together and each alone (the others at their defaults, a required one at its neutral value inf)."""
    for g in GATED:
        if not g.params:
            yield g.name, {}, g.name
            continue
        neutral = {p.name: math.inf if p.default is None else p.default for p in g.params}
        yield g.name, g.example, f"{g.name}-all"
        for p in g.params:
            yield g.name, {**neutral, p.name: p.example}, f"{g.name}-{p.name}"


def gated_modules(op: str, params: dict, layout: str) -> list:
    """ffn_ext's gated modules computing (op, params, layout): the generic Gated(Gating) and the constructor that
    names the activation (SwiGLU(**params), GeGLU(approximate), Gated(name))."""
    gated = _table.GATED_BY_NAME[op]
    kind, options = gated.act.api
    if kind == "silu":
        named = ffn_ext.SwiGLU(layout=layout, **params)
    elif kind == "gelu":
        named = ffn_ext.GeGLU(layout=layout, **options)
    else:
        named = ffn_ext.Gated(gated.act.name, layout=layout)
    return [ffn_ext.Gated(ffn_ext.Gating(op, layout=layout, **params)), named]


def unary_module(entry):
    """The activation module named for table entry `entry`: GELU(approximate), SiLU() or Act(name)."""
    kind, options = entry.api
    cls = {"gelu": ffn_ext.GELU, "silu": ffn_ext.SiLU}.get(kind)
    return ffn_ext.Act(entry.name) if cls is None else cls(**options)


def y0_weight(y):
    """A fixed, non-uniform weighting of the output for the loss (a sum alone would hide sign errors in dy)."""
    return torch.linspace(-1.0, 2.0, y.numel(), dtype=y.dtype).reshape(y.shape)


# ---------------------------------------------------------------- input layouts
# Every layout gives a tensor of the requested logical shape; they differ in strides / storage offset:
LAYOUTS = (
    "contiguous",
    "transposed",  # last two dims swapped in memory (not row-like: a kernel must copy or gather)
    "step",  # x[..., ::2] slicing with a step along the last dim (stride(-1) == 2)
    "row_step",  # x[..., ::2, :]: rows with a gap between them (row stride 2*cols)
    "padded",  # rows of an odd-width buffer: x[..., :cols] of [..., cols + 3] (rows at odd alignments)
    "offset",  # buf[1:].view(shape): contiguous but misaligned by one element
    "expanded",  # one row expanded over the rows (stride 0 along dim -2)
    "chunk_hi",  # the upper half of [..., 2*cols].chunk(2, -1) (row stride 2*cols, storage offset cols)
    "scalar",  # one value expanded to the whole shape (every stride 0), e.g. the grad of .sum()
)


def _randn(shape, dtype, device, scale):
    return (torch.randn(shape, dtype=torch.float32, device=device) * scale).to(dtype)


def make_layout(shape, dtype=torch.float32, device="cpu", layout="contiguous", scale=3.0) -> torch.Tensor:
    """A random tensor (N(0, scale^2) values, never all zeros) of logical `shape`, laid out as `layout` (one of
    LAYOUTS). Layouts that need 2 dims fall back to the nearest meaningful one for 0-d/1-d shapes ("transposed",
    "row_step", "expanded" -> "contiguous" / "step" on 1-d)."""
    shape = tuple(shape)
    nd = len(shape)
    if layout == "contiguous" or nd == 0 and layout not in ("offset", "scalar"):
        return _randn(shape, dtype, device, scale)
    if layout == "scalar":
        return _randn((), dtype, device, scale).expand(shape)
    if layout == "offset":
        n = math.prod(shape)
        return _randn((n + 1,), dtype, device, scale)[1:].view(shape)
    cols = shape[-1]
    if layout == "step":
        return _randn(shape[:-1] + (2 * cols,), dtype, device, scale)[..., ::2]
    if layout == "padded":
        return _randn(shape[:-1] + (cols + 3,), dtype, device, scale)[..., :cols]
    if layout == "chunk_hi":
        return (
            _randn(shape[:-1] + (2 * cols,), dtype, device, scale).chunk(2, dim=-1)[1]
            if cols
            else _randn(shape, dtype, device, scale)
        )
    if nd < 2:
        return make_layout(shape, dtype, device, "step", scale)
    if layout == "transposed":
        return _randn(shape[:-2] + (shape[-1], shape[-2]), dtype, device, scale).transpose(-1, -2)
    if layout == "row_step":
        return _randn(shape[:-2] + (2 * shape[-2], cols), dtype, device, scale)[..., ::2, :]
    if layout == "expanded":
        return _randn(shape[:-2] + (1, cols), dtype, device, scale).expand(shape)
    raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS} or 'chunk' (make_inputs)")


def make_chunk_pair(shape, dtype=torch.float32, device="cpu", offset=0, scale=3.0):
    """gate, up = t.chunk(2, -1) of one random [..., 2*cols] tensor t (views with row stride 2*cols; up starts
    `cols` elements after gate, so for odd cols they sit at different alignments). offset > 0 shifts t's storage
    by that many elements (t = buf[offset:].view(...))."""
    shape = tuple(shape)
    if len(shape) == 0 or shape[-1] == 0:  # nothing to chunk: two plain tensors
        return _randn(shape, dtype, device, scale), _randn(shape, dtype, device, scale)
    full = shape[:-1] + (2 * shape[-1],)
    n = math.prod(full)
    t = _randn((n + offset,), dtype, device, scale)[offset:].view(full)
    return t.chunk(2, dim=-1)


def make_inputs(
    name: str,
    shape,
    dtype=torch.float32,
    device="cpu",
    layout="contiguous",
    grad_layout=None,
    scale=3.0,
    packing: str = "concat",
    params: dict | None = None,
    at_bounds: bool = True,
):
    """Random inputs for op `name` whose output has shape `shape`. Every input gets `layout`, except `grad`
    (backward ops), which gets grad_layout (default: `layout`). layout="chunk": the gated ops (and their
    backward) take gate, up = t.chunk(2, -1); the packed ops take gate_up as the upper half of a [..., 4M] chunk;
    unary ops take a "chunk_hi" view.

    at_bounds (ops with a `limit` parameter, a clamp bound: swiglu_clamped): the first two columns of gate and up
    (of gate_up's halves in `packing`, for the packed ops) hold the bounds themselves, gate = +limit, -limit and
    up = -limit, +limit (params_of(name, params)'s limit; where the input's elements are distinct: not in the
    stride-0 layouts), so that every test meets the clamps' gradient convention at the bound."""
    shape = tuple(shape)
    grad_layout = layout if grad_layout is None else grad_layout
    s = SPECS[name]
    if layout == "chunk":
        if s.kind == "gated":
            pair = make_chunk_pair(shape, dtype, device, scale=scale)
            ins = (
                pair
                if not s.backward
                else (
                    make_layout(
                        shape, dtype, device, "chunk_hi" if grad_layout == "chunk" else grad_layout, scale=scale
                    ),
                )
                + pair
            )
            return _put_bounds(name, ins, packing, params) if at_bounds else ins
        layout = "chunk_hi"
        grad_layout = "chunk_hi" if grad_layout == "chunk" else grad_layout
    shapes = input_shapes(name, shape)
    names = ARG_NAMES[name]
    ins = tuple(
        make_layout(sh, dtype, device, grad_layout if n == "grad" else layout, scale=scale)
        for sh, n in zip(shapes, names)
    )
    return _put_bounds(name, ins, packing, params) if at_bounds else ins


def _writable(t):
    return t.dim() > 0 and t.numel() > 0 and all(st != 0 for st, n in zip(t.stride(), t.shape) if n > 1)


def _put_bounds(name, inputs, packing, params):
    """make_inputs' at_bounds: gate[..., :2] = (+limit, -limit), up[..., :2] = (-limit, +limit), in place."""
    s = SPECS[name]
    if not any(p.name == "limit" for p in s.params):
        return inputs
    limit = params_of(name, params)["limit"]
    if not math.isfinite(limit):
        return inputs
    if s.kind == "packed":
        gate_up = inputs[-1]
        if not _writable(gate_up) or gate_up.shape[-1] < 2:
            return inputs
        pair = _table.split_packed(gate_up, packing)
    else:
        pair = inputs[-2:]
    for t, values in zip(pair, ((limit, -limit), (-limit, limit))):
        if _writable(t):
            for j, v in enumerate(values[: t.shape[-1]]):
                t[..., j] = v
    return inputs


# ---------------------------------------------------------------- recording the ops a call dispatches
class RecordOps(TorchDispatchMode):
    """A dispatch mode that records the name of every op it sees (str of the OpOverload, e.g.
    'ffn_ext.gelu.default') and runs it unchanged."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------- CUDA caching allocator poison
def poison_cuda_cache(device="cuda", nbytes: int = 256 << 20, small_blocks: int = 16) -> None:
    """Fills the CUDA caching allocator's free memory with NaN bytes (0xFF: NaN in fp16, bf16, fp32 and fp64):
    releases the unused cache, allocates one large block (`nbytes`) and `small_blocks` blocks of the small pool
    (<= 1 MiB), fills them with 0xFF and frees them. The next allocations (inputs, then the op's outputs) are
    carved from this memory, so an element a kernel forgets to write reads as NaN and fails the comparison."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    big = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(0xFF)
    small = [torch.empty(1 << 20, dtype=torch.uint8, device=device).fill_(0xFF) for _ in range(small_blocks)]
    torch.cuda.synchronize(device)
    del big, small
