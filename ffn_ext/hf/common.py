"""What every form of ffn_ext.hf shares: the patch marks, which table entry an activation is, the gatings one
ffn_ext op computes (_Gate, read from the module at each call), the self-check (_agrees) and the picklable bound
forward (_BoundForward) the patched modules get."""

from __future__ import annotations

import contextlib
import inspect
import math
import sys
from typing import NamedTuple, TypeGuard

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import ops as _ops
from ..mlp import fusable
from ..modules import GELU, SiLU, _Unary
from ..table import ACTIVATIONS, BY_NAME

_MARK = "_ffn_ext_patched"  # 'gated' | 'packed' (MLPs) | 'experts' (forward, maybe _apply_gate) | 'experts_gate'
_ACT = "_ffn_ext_act"  # (attribute name of the activation, the activation patched over)
_OPTS = "_ffn_ext_mlp_options"  # (recompute, token_chunk) of a patched gated/packed MLP: patch_model's arguments
_GATED_NAMES = ("gate_proj", "up_proj", "down_proj")
_DISAGREES = (
    "their forward gave a different result from the fused gated MLP on a random input (self-check), so "
    "it is not a plain gated MLP and must run as it is"
)


class _Gate(NamedTuple):
    """A gating that one ffn_ext op computes: act(gate) * up with `act` a table entry, or, with a `limit`, the
    clamped SwiGLU (clamp(up, -limit, limit) + up_offset) * g * sigmoid(alpha * g), g = clamp(gate, max=limit)
    (ffn_ext.swiglu_clamped). Packed projections are split by `layout`."""

    act: str | None = "act_fn"  # the attribute holding the activation (clamped: must be SiLU); None: SiLU written out
    limit: str | None = None  # the attribute holding the clamp limit; None: no clamp
    alpha: str | float = 1.0  # the attribute holding alpha, or its value
    up_offset: float = 0.0
    layout: str = "concat"  # of a packed [..., 2I] projection: "concat" [gate | up] or "interleaved" [g0, u0, ...]


_PLAIN = _Gate()


def _unsupported(act) -> str:
    what = (
        type(act).__name__
        if isinstance(act, nn.Module) or act is None
        else getattr(act, "__qualname__", type(act).__name__)
    )
    ours = "; ".join(f"{a.name}: {', '.join(a.hf_names)}" for a in ACTIVATIONS)
    return (
        f"activation {what} is not one ffn_ext implements (ffn_ext's, with the transformers ACT2FN names "
        f"that are the same function: {ours})"
    )


# ---------------------------------------------------------------- which activation of the table is `act`?
_SILU = BY_NAME["silu"]
# torch's own activations, under the function name an entry's api shares with torch (api[0]): the module class
# (whose options, nn.GELU's approximate, must be the entry's api options) and the functions with their defaults
_TORCH = {"gelu": (nn.GELU, (F.gelu,)), "silu": (nn.SiLU, (F.silu,)), "relu": (nn.ReLU, (F.relu, torch.relu))}
_OURS = {"gelu": GELU, "silu": SiLU}  # ffn_ext.modules' classes of the same kind (their _Unary names its entry)


def _api_entry(function: str, obj=None):
    """The entry reached as ffn_ext.<function> with the options `obj` carries as attributes (nn.GELU's approximate),
    or with the function's defaults when obj is None (the first entry of that function, as table.activation_for);
    None if the table has none."""
    entries = [a for a in ACTIVATIONS if a.api[0] == function]
    if obj is None:
        return entries[0] if entries else None
    return next((a for a in entries if all(getattr(obj, k, None) == v for k, v in a.api[1].items())), None)


_MODULES = {cls: f for f, (cls, _) in _TORCH.items()} | {cls: f for f, cls in _OURS.items()}
_FUNCTIONS = {fn: _api_entry(f) for f, (_, fns) in _TORCH.items() for fn in fns} | {
    getattr(_ops, a.api[0]): _api_entry(a.api[0]) for a in ACTIVATIONS if hasattr(_ops, a.api[0])
}
_FUNCTIONS = {fn: a for fn, a in _FUNCTIONS.items() if a is not None}
_HF_ENTRIES: dict = {}  # transformers.activations class -> its entry or None (filled by _hf_entry, once per class)


def _hf_entry(cls):
    """The entry a class of transformers.activations computes: the one whose hf_names hold every name under which
    transformers' ACT2CLS lists that class (with whatever constructor arguments it passes: GELUTanh is
    gelu_pytorch_tanh and gelu_python_tanh), read from the transformers.activations the class comes from (never
    imported here); None when a name is in no entry's hf_names (ClippedGELUActivation: gelu_10) or in two."""
    if cls not in _HF_ENTRIES:
        table = getattr(sys.modules.get(cls.__module__), "ACT2CLS", {})
        names = [n for n, c in table.items() if (c[0] if isinstance(c, tuple) else c) is cls]
        found = {a.name: a for n in names for a in ACTIVATIONS if n in a.hf_names}  # (entries are not hashable)
        ok = len(found) == 1 and all(n in a.hf_names for a in found.values() for n in names)
        _HF_ENTRIES[cls] = next(iter(found.values())) if ok else None
    return _HF_ENTRIES[cls]


def _table_activation(act):
    """The table entry (ffn_ext/table.py) that `act` computes, or None: torch's nn.SiLU / nn.GELU(approximate) /
    nn.ReLU and ffn_ext's modules (these exact types: a subclass may compute something else), their functions
    (F.silu, F.gelu, F.relu, torch.relu, ffn_ext.silu, ...), and transformers' activation classes by its ACT2CLS and
    the entries' hf_names (_hf_entry); each only where the table has that entry."""
    cls = type(act)
    function = _MODULES.get(cls)
    if function is not None:
        return _api_entry(function, act)
    if cls is _Unary:
        return BY_NAME.get(act.activation)
    if cls.__module__ == "transformers.activations":
        return _hf_entry(cls)
    try:
        return _FUNCTIONS.get(act)
    except TypeError:  # not hashable
        return None


def _act_now(self):
    """The table entry the fused kernels may stand in for the MLP's activation call with, else None: its
    activation (looked up now: it may have been replaced since patching) is one of the table's, and no hook or
    forward wrapper, on it or global, expects to see it run."""
    name = self.__dict__[_ACT][0]
    mods = self._modules
    act = mods[name] if name in mods else getattr(self, name, None)
    entry = _table_activation(act)
    if entry is None or (isinstance(act, nn.Module) and not fusable((), (act,))):
        return None
    return entry


_DEFAULT_OPTS = (False, None)


def _where(by_class: dict) -> str:
    """'Cls at 'name' and 3 more, ...' for class -> module names."""
    return ", ".join(
        f"{cls} at {names[0]!r}" + (f" and {len(names) - 1} more" if len(names) > 1 else "")
        for cls, names in by_class.items()
    )


class _Clamp(NamedTuple):
    """The arguments of ffn_ext.swiglu_clamped(_packed) for a clamped _Gate, read from the module when it runs."""

    limit: float
    alpha: float
    up_offset: float
    layout: str


def _attr(module, name):
    mods = module._modules
    return mods[name] if name in mods else getattr(module, name, None)


def _real(v: object) -> TypeGuard[int | float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)


def _gate_state(module, gate: _Gate):
    """What ffn_ext's op needs to stand in for `module`'s gating now, else None (then its own code runs): the table
    entry of its activation, which must run no hook (on it or global) and, clamped, be SiLU; or, clamped, the
    _Clamp of its current limit (a number > 0) and alpha (a finite number)."""
    entry = _SILU
    if gate.act is not None:
        act = _attr(module, gate.act)
        entry = _table_activation(act)
        if (
            entry is None
            or (gate.limit is not None and entry is not _SILU)
            or (isinstance(act, nn.Module) and not fusable((), (act,)))
        ):
            return None
    if gate.limit is None:
        return entry
    limit = getattr(module, gate.limit, None)
    alpha = getattr(module, gate.alpha, None) if isinstance(gate.alpha, str) else gate.alpha
    if not (_real(limit) and limit > 0 and _real(alpha) and math.isfinite(alpha)):
        return None
    return _Clamp(float(limit), float(alpha), gate.up_offset, gate.layout)


def _gate_problem(module, gate: _Gate) -> str | None:
    """Why `module`'s gating (`gate`) cannot run on ffn_ext, or None (the patch-time form of _gate_state, which also
    lets hooks on the activation pass: with them the module's own code runs, call by call)."""
    if gate.act is not None:
        act = _attr(module, gate.act)
        entry = _table_activation(act)
        if entry is None:
            return _unsupported(act)
        if gate.limit is not None and entry is not _SILU:
            return f"clamped gating with activation {type(act).__name__} ({entry.name}): ffn_ext's clamped op is SiLU's"
    if gate.limit is not None:
        limit = getattr(module, gate.limit, None)
        alpha = getattr(module, gate.alpha, None) if isinstance(gate.alpha, str) else gate.alpha
        if not (_real(limit) and limit > 0):
            return f"clamp limit {gate.limit} = {limit!r} is not a number > 0"
        if not (_real(alpha) and math.isfinite(alpha)):
            return f"{gate.alpha} = {alpha!r} is not a finite number"
    return None


def _fused_gate(state, gate_up, layout="concat"):
    """gate_up [..., 2I] -> [..., I] by ffn_ext's op, reading gate_up in place (`layout`: the plain gating's; a
    _Clamp carries its own)."""
    if isinstance(state, _Clamp):
        return _ops.swiglu_clamped_packed(
            gate_up, limit=state.limit, alpha=state.alpha, up_offset=state.up_offset, layout=state.layout
        )
    return _ops.gated_packed(gate_up, state.name, layout=layout)


def _bind(names: tuple, args: tuple, kwargs: dict):
    """args and kwargs as a positional list over `names` (all of them, each once), else None."""
    if len(args) + len(kwargs) != len(names) or len(args) > len(names):
        return None
    out = list(args)
    for n in names[len(args) :]:
        if n not in kwargs:
            return None
        out.append(kwargs[n])
    return out


class _BoundForward:
    """The patched forward, bound to its MLP like a method, but picklable: a types.MethodType pickles as
    getattr(mlp, '_gated_forward') and so made torch.save(model) write checkpoints that torch.load could not read.
    This pickles the module-level function by name and the MLP by reference.

    A call with one tensor, positional or named `arg` (the original forward's parameter), runs the fused form with
    the activation's table entry while the activation may be bypassed (_act_now) and the attributes the class's
    code tested when it was recognised still hold (`guards`); every other call runs the original forward: `prev`,
    the forward the instance had when patched (a wrapper such as accelerate's hook, which must run), else the
    class's. `gate`: None for plain gatings, whose activation attribute is recorded on the module (_ACT); the
    clamped MLPs' _Gate, whose _gate_state the fused form runs with. `names`: the projection attributes, passed on
    to `func`."""

    arg, prev, gate, names, guards = "x", None, None, (), ()  # class defaults: older pickles load

    def __init__(self, module, func, arg, prev, gate=None, names=(), guards=()):
        self.__self__, self.__func__, self.arg, self.prev, self.gate = module, func, arg, prev, gate
        self.names, self.guards = names, guards

    def __call__(self, *args, **kwargs):
        mlp, prev = self.__self__, self.prev
        if prev is not None:
            return prev(*args, **kwargs)
        if len(args) + len(kwargs) == 1 and _guards_hold(mlp, self.guards):
            x = args[0] if args else kwargs.get(self.arg)
            if isinstance(x, torch.Tensor):
                state = _act_now(mlp) if self.gate is None else _gate_state(mlp, self.gate)
                if state is not None:
                    return self.__func__(mlp, x, state, *self.names)
        return type(mlp).forward(mlp, *args, **kwargs)


_MISSING = object()


def _guards_hold(module, guards) -> bool:
    """Whether the attributes the recognised code's `if` tests read still have the values they had."""
    for name, value in guards:
        now = getattr(module, name, _MISSING)
        if now is not value and now != value:
            return False
    return True


def _defining(cls, attr):
    """The first class of cls's MRO that defines `attr`, or None."""
    return next((c for c in cls.__mro__ if attr in vars(c)), None)


@contextlib.contextmanager
def _eval_mode(module):
    """The module and its submodules in eval mode (dropout off: the self-check compares deterministic results),
    restored after."""
    modes = [(m, m.training) for m in module.modules()]
    module.train(False)
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


def _limits(module) -> list[float]:
    """The numbers on the module and its config that may be limits the code compares with: positive finite numbers
    (not bools) among the instance's attributes and its config's, lists of them included, at most 1e4."""
    found = set()
    sources = [vars(module)]
    config = module.__dict__.get("config")
    if config is not None:
        sources.append(getattr(config, "__dict__", {}))
    for d in sources:
        for v in d.values():
            for n in v if isinstance(v, (list, tuple)) else (v,):
                if _real(n) and 0 < n <= 1e4 and math.isfinite(n):
                    found.add(float(n))
    return sorted(found)


# The peaks the self-check drives the first projection's outputs to: the activations' curved range, well past it,
# and twice every limit-like number (_limits): a clamp the code hides from small inputs shows at one of them.
_PEAKS = (0.5, 4.0, 30.0)


def _peaks(module, half: bool, numbers=()) -> list[float]:
    """_PEAKS and twice every limit-like number on the module, its config and in `numbers` (its code's), sorted."""
    peaks = sorted(set(_PEAKS) | {2 * v for v in [*_limits(module), *numbers]})
    return [p for p in peaks if not half or p <= 300]  # fp16 / bf16: past that, the products overflow


_AGREE, _DISAGREE, _UNKNOWN_CHECK = "agree", "disagree", "unknown"


def _close(out, ref, tol) -> bool | None:
    """True / False when out is / is not ref within tol (relative to ref's largest magnitude, elementwise); None
    when ref is not finite (nothing can be told)."""
    ref, out = ref.float(), out.float()
    if not bool(ref.isfinite().all()):
        return None
    if out.shape != ref.shape:
        return False
    scale = float(ref.abs().max()) or 1.0
    return bool(((out - ref).abs() <= tol * scale).all())


def _own_graph():
    """The self-checks' autograd, whatever the caller's mode: outside inference mode, and with saved-tensor hooks of
    its own, so that a caller's (activation offloading, a memory count) never see the check's tensors."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.inference_mode(False))
    stack.enter_context(torch.autograd.graph.saved_tensors_hooks(_same, _same))
    return stack


def _same(t):
    return t


def _check(module, func, act, names=(), own=None, width=None, first=None, numbers=()) -> str:
    """The self-check: runs `func` (the fused forward, with table activation or _Clamp `act` and projection names
    `names`) and the module's own code (`own`, default its class's forward) on the same random rows, in the module's
    device and dtype, over every regime: the rows scaled so that the first projection (`first`, default names[0])
    peaks at each of _peaks (`numbers`: those written in its code), forward, and where the module has trainable
    parameters, backward too (the input's and the parameters' gradients, by autograd.grad: nothing accumulates into
    .grad). Returns "agree", "disagree" (a
    finite difference at any regime, or the module's own code fails on plain rows) or "unknown": not run (parameters
    on meta or not plain floating nn.Parameters of one dtype and device, non-plain Linears, hooks or forward
    wrappers) or no regime gave a finite result. Eval mode (dropout off), the modes restored after; a private
    generator: the global RNG is untouched."""
    params, subs = list(module.parameters()), tuple(module.modules())[1:]
    if not params or not fusable(tuple(m for m in subs if isinstance(m, nn.Linear)), subs):
        return _UNKNOWN_CHECK
    w = params[0]
    if not w.is_floating_point() or any(
        type(p) is not nn.Parameter or p.is_meta or p.dtype != w.dtype or p.device != w.device for p in params
    ):
        return _UNKNOWN_CHECK
    mods = module._modules
    own = own or type(module).forward
    first = first if isinstance(first, nn.Module) else mods[first or names[0]]
    half = w.element_size() <= 2
    tol = 3e-2 if half else 1e-4  # half types: ffn_ext rounds h once, ATen twice
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(4, width or first.in_features, generator=gen, device="cpu").to(w.device, w.dtype)
    trains = any(p.requires_grad for p in params)
    seen = False
    with _eval_mode(module), _own_graph():
        with torch.no_grad():
            try:
                base = float(first(x0).abs().max())
                own(module, x0)
            except Exception:
                try:  # a forward that wants [batch, seq, hidden] (MoshiGatingMLP) gets the rows as one sequence
                    x0 = x0.unsqueeze(0)
                    base = float(first(x0).abs().max())
                    own(module, x0)
                except Exception:
                    return _DISAGREE  # its own code fails on plain rows: not the form the fused forward computes
        if not (math.isfinite(base) and base > 0):
            return _UNKNOWN_CHECK
        peaks = _peaks(module, half, numbers)
        for peak in peaks:
            x = (x0.float() * (peak / base)).to(w.dtype)
            with torch.no_grad():
                same = _close(func(module, x, act, *names), own(module, x), tol)
            if same is False:
                return _DISAGREE
            if same is None:
                continue
            seen = True
            if trains and peak in (4.0, peaks[-1]):
                x = x.detach().requires_grad_()
                wrt = [x] + [p for p in params if p.requires_grad]
                with torch.enable_grad():
                    ref = own(module, x)
                    out = func(module, x, act, *names)
                    g = torch.randn(ref.shape, generator=gen, device="cpu").to(ref.device, ref.dtype)
                    gref = torch.autograd.grad(ref, wrt, g, allow_unused=True)
                    gout = torch.autograd.grad(out, wrt, g, allow_unused=True)
                for a, b in zip(gout, gref):
                    if (a is None) != (b is None) or (a is not None and _close(a, b, 10 * tol) is False):
                        return _DISAGREE
    return _AGREE if seen else _UNKNOWN_CHECK


def _input_name(forward) -> str:
    """The name of the first parameter of a bound forward ('x' when there is none to name)."""
    try:
        return next(iter(inspect.signature(forward).parameters), "x")
    except (TypeError, ValueError):
        return "x"
