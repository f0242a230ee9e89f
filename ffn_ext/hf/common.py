"""What every form of ffn_ext.hf shares: the patch marks, which table entry an activation is, the gatings one
ffn_ext op computes (_Gate, read from the module at each call), the self-check (_agrees) and the picklable bound
forward (_BoundForward) the patched modules get."""
from __future__ import annotations

import inspect
import math
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import ops as _ops
from ..mlp import fusable
from ..modules import GELU, SiLU
from ..table import ACTIVATIONS, BY_NAME

_MARK = "_ffn_ext_patched"  # 'gated' | 'packed' (MLPs) | 'experts' (forward, maybe _apply_gate) | 'experts_gate'
_ACT = "_ffn_ext_act"        # (attribute name of the activation, the activation patched over)
_OPTS = "_ffn_ext_mlp_options"  # (recompute, token_chunk) of a patched gated/packed MLP: patch_model's arguments
_GATED_NAMES = ("gate_proj", "up_proj", "down_proj")
_DISAGREES = ("their forward gave a different result from the fused gated MLP on a random input (self-check), so "
              "it is not a plain gated MLP and must run as it is")


class _Gate(NamedTuple):
    """A gating that one ffn_ext op computes: act(gate) * up with `act` a table entry, or, with a `limit`, the
    clamped SwiGLU (clamp(up, -limit, limit) + up_offset) * g * sigmoid(alpha * g), g = clamp(gate, max=limit)
    (ffn_ext.swiglu_clamped). Packed projections are split by `layout`."""
    act: str | None = "act_fn"   # the attribute holding the activation (clamped: must be SiLU); None: SiLU written out
    limit: str | None = None     # the attribute holding the clamp limit; None: no clamp
    alpha: str | float = 1.0     # the attribute holding alpha, or its value
    up_offset: float = 0.0
    layout: str = "concat"       # of a packed [..., 2I] projection: "concat" [gate | up] or "interleaved" [g0, u0, ...]


_PLAIN = _Gate()


def _unsupported(act) -> str:
    what = type(act).__name__ if isinstance(act, nn.Module) or act is None else getattr(act, "__qualname__",
                                                                                         type(act).__name__)
    ours = "; ".join(f"{a.name}: {', '.join(a.hf_names)}" for a in ACTIVATIONS)
    return (f"activation {what} is not one ffn_ext implements (ffn_ext's, with the transformers ACT2FN names "
            f"that are the same function: {ours})")


# ---------------------------------------------------------------- which activation of the table is `act`?
_GELUS = {a.api[1]["approximate"]: a for a in ACTIVATIONS if a.api[0] == "gelu"}  # "none", "tanh" -> entry
_SILU = BY_NAME["silu"]
# transformers.activations classes -> the ACT2FN name whose function each computes (for every constructor argument
# ACT2FN passes); the table's hf_names says which entry that name is. As of transformers 5.24 (PytorchGELUTanh:
# GELUTanh's earlier name, now an alias); tests/test_hf.py checks these against ACT2FN.
_HF_CLASSES = {"SiLUActivation": "silu", "GELUActivation": "gelu", "GELUTanh": "gelu_pytorch_tanh",
               "PytorchGELUTanh": "gelu_pytorch_tanh", "NewGELUActivation": "gelu_new",
               "FastGELUActivation": "gelu_fast", "AccurateGELUActivation": "gelu_accurate"}
_HF_ENTRIES = {cls: a for cls, hf_name in _HF_CLASSES.items() for a in ACTIVATIONS if hf_name in a.hf_names}
_FUNCTIONS = ((F.silu, _SILU), (_ops.silu, _SILU), (F.gelu, _GELUS["none"]), (_ops.gelu, _GELUS["none"]))


def _table_activation(act):
    """The table entry (ffn_ext/table.py) that `act` computes, or None: nn.SiLU / nn.GELU(approximate) and
    ffn_ext's SiLU / GELU (these exact types: a subclass may compute something else), F.silu / F.gelu and ffn_ext's
    functions, and transformers' activation classes of _HF_CLASSES (matched by name and module, without importing
    transformers)."""
    cls = type(act)
    if cls is nn.SiLU or cls is SiLU:
        return _SILU
    if cls is nn.GELU or cls is GELU:
        return _GELUS.get(act.approximate)
    if cls.__module__ == "transformers.activations":
        return _HF_ENTRIES.get(cls.__name__)
    for fn, entry in _FUNCTIONS:
        if act is fn:
            return entry
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
    return ", ".join(f"{cls} at {names[0]!r}" + (f" and {len(names) - 1} more" if len(names) > 1 else "")
                     for cls, names in by_class.items())


class _Clamp(NamedTuple):
    """The arguments of ffn_ext.swiglu_clamped(_packed) for a clamped _Gate, read from the module when it runs."""
    limit: float
    alpha: float
    up_offset: float
    layout: str


def _attr(module, name):
    mods = module._modules
    return mods[name] if name in mods else getattr(module, name, None)


def _real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)


def _gate_state(module, gate: _Gate):
    """What ffn_ext's op needs to stand in for `module`'s gating now, else None (then its own code runs): the table
    entry of its activation, which must run no hook (on it or global) and, clamped, be SiLU; or, clamped, the
    _Clamp of its current limit (a number > 0) and alpha (a finite number)."""
    entry = _SILU
    if gate.act is not None:
        act = _attr(module, gate.act)
        entry = _table_activation(act)
        if entry is None or (gate.limit is not None and entry is not _SILU) or (
                isinstance(act, nn.Module) and not fusable((), (act,))):
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
            return (f"clamped gating with activation {type(act).__name__} ({entry.name}): ffn_ext's clamped op is "
                    "SiLU's")
    if gate.limit is not None:
        limit = getattr(module, gate.limit, None)
        alpha = getattr(module, gate.alpha, None) if isinstance(gate.alpha, str) else gate.alpha
        if not (_real(limit) and limit > 0):
            return f"clamp limit {gate.limit} = {limit!r} is not a number > 0"
        if not (_real(alpha) and math.isfinite(alpha)):
            return f"{gate.alpha} = {alpha!r} is not a finite number"
    return None


def _fused_gate(state, gate_up):
    """gate_up [..., 2I] -> [..., I] by ffn_ext's op, reading gate_up in place."""
    if isinstance(state, _Clamp):
        return _ops.swiglu_clamped_packed(gate_up, limit=state.limit, alpha=state.alpha, up_offset=state.up_offset,
                                          layout=state.layout)
    return _ops.gated_packed(gate_up, state.name)


def _bind(names: tuple, args: tuple, kwargs: dict):
    """args and kwargs as a positional list over `names` (all of them, each once), else None."""
    if len(args) + len(kwargs) != len(names) or len(args) > len(names):
        return None
    out = list(args)
    for n in names[len(args):]:
        if n not in kwargs:
            return None
        out.append(kwargs[n])
    return out


class _BoundForward:
    """The patched forward, bound to its MLP like a method, but picklable: a types.MethodType pickles as
    getattr(mlp, '_gated_forward') and so made torch.save(model) write checkpoints that torch.load could not read.
    This pickles the module-level function by name and the MLP by reference.

    A call with one tensor, positional or named `arg` (the original forward's parameter), runs the fused form with
    the activation's table entry while the activation may be bypassed (_act_now); every other call runs the
    original forward: `prev`, the forward the instance had when patched (a wrapper such as accelerate's hook, which
    must run), else the class's. `gate`: None for the MLPs of _KNOWN (and extra_classes), whose activation attribute
    is recorded on the module (_ACT); the clamped MLPs' _Gate, whose _gate_state the fused form runs with. `names`:
    the packed MLPs' projection attributes (to [..., 2I], back), passed on to `func`; () for the gated form."""

    arg, prev, gate, names = "x", None, None, ()  # class defaults: patched models pickled before these existed load

    def __init__(self, module, func, arg, prev, gate=None, names=()):
        self.__self__, self.__func__, self.arg, self.prev, self.gate = module, func, arg, prev, gate
        self.names = names

    def __call__(self, *args, **kwargs):
        mlp, prev = self.__self__, self.prev
        if prev is not None:
            return prev(*args, **kwargs)
        if len(args) + len(kwargs) == 1:
            x = args[0] if args else kwargs.get(self.arg)
            if isinstance(x, torch.Tensor):
                state = _act_now(mlp) if self.gate is None else _gate_state(mlp, self.gate)
                if state is not None:
                    return self.__func__(mlp, x, state, *self.names)
        return type(mlp).forward(mlp, *args, **kwargs)


def _defining(cls, attr):
    """The first class of cls's MRO that defines `attr`, or None."""
    return next((c for c in cls.__mro__ if attr in vars(c)), None)


def _agrees(module, func, act, names=(), limit=None) -> bool:
    """The self-check: whether func (the fused forward) with table activation `act` (clamped MLPs: their _Clamp) and
    projection names `names` (packed: _kind's; gated: ()) computes what the class's forward does on two random rows
    (the module's device and dtype, no_grad, a private generator: the global RNG is untouched; with a clamp `limit`,
    scaled so that the first projection's largest output is 3 * limit and the clamps act). True without running
    anything when running would be neither cheap nor free of side effects: parameters on meta (offloaded) or not
    plain floating nn.Parameters of one dtype and device (quantized, sharded), a Linear that is not a plain
    nn.Linear (LoRA), hooks or forward wrappers on any submodule (or global hooks). Also True when the result is not
    finite (weights not initialised): nothing can be told from it. False when the class's forward fails on the rows
    (as [2, H] and as [1, 2, H]): it is not the form, and is left unpatched with the warning, never an exception."""
    params, subs = list(module.parameters()), tuple(module.modules())[1:]
    if not params or not fusable(tuple(m for m in subs if isinstance(m, nn.Linear)), subs):
        return True
    w = params[0]
    if not w.is_floating_point() or any(type(p) is not nn.Parameter or p.is_meta or p.dtype != w.dtype
                                        or p.device != w.device for p in params):
        return True
    mods, (first, last) = module._modules, (names or _GATED_NAMES[::2])
    x = torch.randn(2, mods[last].out_features, generator=torch.Generator().manual_seed(0), device="cpu")
    x = x.to(w.device, w.dtype)
    with torch.no_grad():
        if limit is not None:
            peak = float(mods[first](x).abs().max())
            if math.isfinite(peak) and peak > 0:
                x = x * (3 * min(limit, 1e4) / peak)
        try:  # two rows; a forward that wants [batch, seq, hidden] (MoshiGatingMLP) gets them as one sequence
            ref = type(module).forward(module, x).float()
        except Exception:
            try:
                x = x.unsqueeze(0)
                ref = type(module).forward(module, x).float()
            except Exception:
                return False  # its own forward fails on plain rows: not the form the fused forward computes
        out = func(module, x, act, *names).float()
        if out.shape != ref.shape:
            return False
    tol = 2e-2 if w.element_size() <= 2 else 1e-4  # relative, in norm; half types: ffn_ext rounds h once, ATen twice
    return not bool(ref.isfinite().all()) or bool((out - ref).norm() <= tol * ref.norm())


def _input_name(forward) -> str:
    """The name of the first parameter of a bound forward ('x' when there is none to name)."""
    try:
        return next(iter(inspect.signature(forward).parameters), "x")
    except (TypeError, ValueError):
        return "x"
