"""What every form of ffn_ext.hf shares: which table entry an activation is, a module's gating as ffn_ext's ops
run it (GateSpec, recognised; Gating, read from the module at each call), the projections' shapes and the
self-check."""

from __future__ import annotations

import contextlib
import functools
import math
import sys
from dataclasses import dataclass
from typing import TypeGuard

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import ops as _ops
from ..mlp import fusable
from ..modules import activation_of
from ..ops import Gating
from ..table import ACTIVATIONS, BY_NAME

MISSING = object()


# ---------------------------------------------------------------- which activation of the table is `act`?
_SILU = BY_NAME["silu"]
# torch's own activations, under the function name an entry's api shares with torch (api[0]): the module class
# (whose options, nn.GELU's approximate, must be the entry's api options) and the functions with their defaults
_TORCH = {"gelu": (nn.GELU, (F.gelu,)), "silu": (nn.SiLU, (F.silu,)), "relu": (nn.ReLU, (F.relu, torch.relu))}


def _api_entry(function: str, obj=None):
    """The entry reached as ffn_ext.<function> with the options `obj` carries as attributes (nn.GELU's approximate),
    or with the function's defaults when obj is None (the first entry of that function, as table.activation_for);
    None if the table has none."""
    entries = [a for a in ACTIVATIONS if a.api[0] == function]
    if obj is None:
        return entries[0] if entries else None
    return next((a for a in entries if all(getattr(obj, k, None) == v for k, v in a.api[1].items())), None)


_MODULES = {cls: f for f, (cls, _) in _TORCH.items()}
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


def table_activation(act):
    """The table entry (ffn_ext/table.py) that `act` computes, or None: torch's nn.SiLU / nn.GELU(approximate) /
    nn.ReLU (these exact types: a subclass may compute something else), ffn_ext's modules (modules.activation_of),
    their functions (F.silu, F.gelu, F.relu, torch.relu, ffn_ext.silu, ...), and transformers' activation classes by
    its ACT2CLS and the entries' hf_names (_hf_entry); each only where the table has that entry."""
    cls = type(act)
    function = _MODULES.get(cls)
    if function is not None:
        return _api_entry(function, act)
    ours = activation_of(act) if isinstance(act, nn.Module) else None
    if ours is not None:
        return BY_NAME[ours]
    if cls.__module__ == "transformers.activations":
        return _hf_entry(cls)
    try:
        return _FUNCTIONS.get(act)
    except TypeError:  # not hashable
        return None


def unsupported(act) -> str:
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


# ---------------------------------------------------------------- a module's gating
@dataclass(frozen=True)
class GateSpec:
    """A gating one ffn_ext op computes, as recognised on a module: act(gate) * up with the activation at attribute
    `act` (a table entry), or, with a `limit`, the clamped SwiGLU (clamp(up, -limit, limit) + up_offset) * g *
    sigmoid(alpha * g), g = clamp(gate, max=limit) (ffn_ext.swiglu_clamped). The attributes are read at each call
    (Gating); packed projections are split by `layout`."""

    act: str | None = "act_fn"  # the attribute holding the activation (clamped: must be SiLU); None: SiLU written out
    limit: str | None = None  # the attribute holding the clamp limit; None: no clamp
    alpha: str | float = 1.0  # the attribute holding alpha, or its value
    up_offset: float = 0.0
    layout: str = "concat"  # of a packed [..., 2I] projection: "concat" [gate | up] or "interleaved" [g0, u0, ...]


@functools.lru_cache(maxsize=256)
def _gating(op: str, layout: str, params: tuple = ()) -> Gating:
    """ffn_ext.ops.Gating, one per distinct (op, layout, params): resolve runs at every call of a patched module."""
    return Gating.of(op, layout, **dict(params))


def _attr(module, name):
    mods = module._modules
    return mods[name] if name in mods else getattr(module, name, None)


def _real(v: object) -> TypeGuard[int | float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)


def resolve(module, spec: GateSpec, why: bool = False) -> Gating | str | None:
    """The Gating ffn_ext's op runs for `module`'s gating now: its activation is one of the table's (SiLU where it
    is clamped) and, clamped, its limit a number > 0 and alpha finite. Else None: then the module's own code runs;
    with why=True (patch time) the reason instead, and an activation with hooks (on it or global) passes: with
    them the module's own code runs, call by call."""
    act = "silu"
    if spec.act is not None:
        module_act = _attr(module, spec.act)
        entry = table_activation(module_act)
        if entry is None:
            return unsupported(module_act) if why else None
        if spec.limit is not None and entry is not _SILU:
            name = type(module_act).__name__
            return (
                f"clamped gating with activation {name} ({entry.name}): ffn_ext's clamped op is SiLU's" if why else None
            )
        if not why and isinstance(module_act, nn.Module) and not fusable((), (module_act,)):
            return None
        act = entry.name
    if spec.limit is None:
        return _gating(act, spec.layout)
    limit = getattr(module, spec.limit, None)
    alpha = getattr(module, spec.alpha, None) if isinstance(spec.alpha, str) else spec.alpha
    if not (_real(limit) and limit > 0):
        return f"clamp limit {spec.limit} = {limit!r} is not a number > 0" if why else None
    if not (_real(alpha) and math.isfinite(alpha)):
        return f"{spec.alpha} = {alpha!r} is not a finite number" if why else None
    return _gating("swiglu_clamped", spec.layout, (("limit", limit), ("alpha", alpha), ("up_offset", spec.up_offset)))


def guards_hold(module, guards) -> bool:
    """Whether the attributes the recognised code's `if` tests read still have the values they had."""
    for name, value in guards:
        now = getattr(module, name, MISSING)
        if now is not value and now != value:
            return False
    return True


# ---------------------------------------------------------------- projections
# projection classes of transformers that compute x @ W.T + b as nn.Linear does (module, class name)
_LINEARS = {("transformers.models.falcon.modeling_falcon", "FalconLinear")}


def _conv1d(t) -> bool:
    return t.__name__ == "Conv1D" and t.__module__ == "transformers.pytorch_utils"


def linear_layout(*projections) -> str | None:
    """ "linear" (nn.Linear, or a class of _LINEARS) or "conv1d" (transformers' Conv1D: weight [in, out]) when all the
    projections are of that kind, exactly, and carry no hook or forward wrapper (ffn_ext.mlp.plain_mlp runs them);
    else None (they run as modules)."""
    kinds = set()
    for m in projections:
        t = type(m)
        if t is nn.Linear or (t.__module__, t.__name__) in _LINEARS:
            kinds.add("linear")
        elif _conv1d(t):
            kinds.add("conv1d")
        else:
            return None
    return kinds.pop() if len(kinds) == 1 and fusable((), projections) else None


def features(m) -> tuple[int, int] | None:
    """(in, out) features of a linear-like projection (nn.Linear and subclasses, LoRA-style wrappers with in_features,
    Conv1D), else None."""
    if isinstance(getattr(m, "in_features", None), int) and isinstance(getattr(m, "out_features", None), int):
        return m.in_features, m.out_features
    return (m.nx, m.nf) if _conv1d(type(m)) else None


# ---------------------------------------------------------------- the self-check
@contextlib.contextmanager
def _checking(module):
    """The self-check's setting, restored after: the module and its submodules in eval mode (dropout off: the results
    are deterministic); autograd whatever the caller's mode, outside inference mode and with saved-tensor hooks of its
    own, so that a caller's (activation offloading, a memory count) never see the check's tensors."""
    modes = [(m, m.training) for m in module.modules()]
    module.train(False)
    try:
        with torch.inference_mode(False), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
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


AGREE, DISAGREE, UNKNOWN = "agree", "disagree", "unknown"  # self_check's verdicts; else the error its code raised


# ---------------------------------------------------------------- DeepSpeed ZeRO-3, read from its attributes
def zero3_partitioned(module) -> list:
    """The module's parameters that DeepSpeed ZeRO-3 partitioned (deepspeed.zero.Init, or deepspeed.initialize on a
    model built outside it): they carry ds_id, and hold an empty tensor until gathered."""
    return [p for p in module.parameters() if hasattr(p, "ds_id")]


def zero3_hooked(module) -> list[str]:
    """The names of the module's submodules that deepspeed.initialize registered (a ds_id on the module: ZeRO-3's
    hooks on each one, which fetch its own weights when it runs); none where the module was a ZeRO-3 leaf then."""
    return [n for n, m in module.named_modules() if n and "ds_id" in m.__dict__]


@contextlib.contextmanager
def zero3_gathered(module):
    """The module's ZeRO-3 partitioned parameters gathered whole inside (deepspeed.zero.GatheredParameters, no
    rank modifying them; a collective: every rank plans the same modules in the same order), so that the self-check
    runs the module's code on its real weights; nothing where none is partitioned. deepspeed is not imported here:
    a partitioned parameter means it was."""
    params = zero3_partitioned(module)
    if not params:
        yield
        return
    with sys.modules["deepspeed"].zero.GatheredParameters(params, modifier_rank=None):
        yield


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


def _setting(module, first):
    """(dtype, device, rows, width) of the check's input, or None where it cannot run: `first`'s input for an MLP
    (parameters plain floating nn.Parameters of one dtype and device, not on meta; Linears and submodules without
    hooks or forward wrappers), an [8, 64] projection on the CPU in the module's dtype for a gating (first None: it
    has no parameters of its own)."""
    params = list(module.parameters())
    if first is None:
        p = params[0] if params else None
        return (p.dtype if p is not None and p.is_floating_point() else torch.float32), torch.device("cpu"), 8, 64
    subs = tuple(module.modules())[1:]
    width = features(first)
    if not params or width is None or not fusable(tuple(m for m in subs if isinstance(m, nn.Linear)), subs):
        return None
    w = params[0]
    if not w.is_floating_point() or any(
        type(p) is not nn.Parameter or p.is_meta or p.dtype != w.dtype or p.device != w.device for p in params
    ):
        return None
    return w.dtype, w.device, 4, width[0]


def self_check(module, fused, own, first, numbers=()) -> str:
    """The self-check: runs `fused` (x -> the fused form's output) and the module's own code (`own`: its class's
    function, own(module, x)) on the same random rows, in the module's device and dtype (_setting), over every
    regime: the rows scaled so that the first projection (`first`; None: the input itself, a gating's projection)
    peaks at each of _peaks (`numbers`: those written in its code), forward, and where the module has trainable
    parameters, backward too (the input's and the parameters' gradients, by autograd.grad: nothing accumulates into
    .grad). Returns AGREE, DISAGREE (a finite difference at any regime), UNKNOWN (not run: _setting; or no regime
    gave a finite result), or, where the module's own code raises on plain rows and on them as one sequence, that
    error ("TypeName: message"). In eval mode (_checking); a private
    generator: the global RNG is untouched."""
    setting = _setting(module, first)
    if setting is None:
        return UNKNOWN
    dtype, device, rows, width = setting
    scale = first or (lambda t: t)
    half = dtype.itemsize <= 2
    tol = 3e-2 if half else 1e-4  # half types: ffn_ext rounds h once, ATen twice
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(rows, width, generator=gen, device="cpu").to(device, dtype)
    params = [p for p in module.parameters() if p.requires_grad] if first is not None else []
    trains = first is None or bool(params)
    seen = False
    with _checking(module):
        with torch.no_grad():
            try:
                base = float(scale(x0).abs().max())
                own(module, x0)
            except Exception:
                try:  # a forward that wants [batch, seq, hidden] (MoshiGatingMLP) gets the rows as one sequence
                    x0 = x0.unsqueeze(0)
                    base = float(scale(x0).abs().max())
                    own(module, x0)
                except Exception as e:  # named as the error it is: a failure is not a different result
                    return f"{type(e).__name__}: {e}"
        if not (math.isfinite(base) and base > 0):
            return UNKNOWN
        peaks = _peaks(module, half, numbers)
        for peak in peaks:
            x = (x0.float() * (peak / base)).to(dtype)
            with torch.no_grad():
                same = _close(fused(x), own(module, x), tol)
            if same is False:
                return DISAGREE
            if same is None:
                continue
            seen = True
            if trains and peak in (4.0, peaks[-1]):
                x = x.detach().requires_grad_()
                with torch.enable_grad():
                    ref, out = own(module, x), fused(x)
                    g = torch.randn(ref.shape, generator=gen, device="cpu").to(ref.device, ref.dtype)
                    gref = torch.autograd.grad(ref, [x, *params], g, allow_unused=True)
                    gout = torch.autograd.grad(out, [x, *params], g, allow_unused=True)
                for a, b in zip(gout, gref):
                    if (a is None) != (b is None) or (a is not None and _close(a, b, 10 * tol) is False):
                        return DISAGREE
    return AGREE if seen else UNKNOWN
