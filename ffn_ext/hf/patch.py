"""patch_model and unpatch_model: walk the model, recognise each module's form from its code, check it over every
regime, warn once, patch."""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch.nn as nn

from ..mlp import check_options
from .clamped import _clamped_forward, _clamped_packed_forward
from .classic import (
    _DISAGREES_CLASSIC,
    _INLINE,
    _UNKNOWN_PAIR,
    _BoundChunk,
    _chunk_of,
    _classic_forward,
    _features,
    _inline,
    _pair_forward,
)
from .common import (
    _ACT,
    _AGREE,
    _DEFAULT_OPTS,
    _DISAGREE,
    _DISAGREES,
    _MARK,
    _OPTS,
    _UNKNOWN_CHECK,
    _attr,
    _BoundForward,
    _check,
    _Gate,
    _gate_problem,
    _gate_state,
    _input_name,
    _table_activation,
    _unsupported,
    _where,
)
from .dense import _UNKNOWN, _gated_forward, _kind, _packed_forward
from .experts import _BoundGate, _is_experts, experts_plan
from .recognise import Form, Named, mlp_form, numbers_in, pair_form

_OPTIONED = ("gated", "packed", "classic", "pair")  # marks of the patched modules that take recompute / token_chunk
_NOT_PROVEN = (
    "modules listed in extra_classes whose forward ffn_ext does not recognise and whose self-check could not run "
    "(weights on meta or not plain, hooks) or gave no finite result: nothing shows they compute the form"
)


def _vouched(cls, extra: tuple) -> bool:
    """Whether cls, or a base class up to the one that defines forward, is in `extra`."""
    for c in cls.__mro__:
        if c in extra:
            return True
        if "forward" in vars(c):
            return False
    return False


def _shapes_ok(module, kind: str, names: tuple) -> bool:
    """Whether the projections are linear-like modules with an MLP's chained shapes (d -> f -> d; packed d -> 2f)."""
    f = [_features(module._modules.get(n)) for n in names[: 3 if kind == "gated" else 2]]
    if any(v is None for v in f):
        return False
    if kind == "gated":
        (gi, go), (ui, uo), (di, do) = f
        return gi == ui == do and go == uo == di
    (pi, po), (oi, oo) = f
    if kind == "packed":
        return po == 2 * oi
    return po == oi  # classic: fc1 -> f -> fc2 (a projector may change the width)


def _dense(module, prev, extra):
    """(reason, None) to name the module, (None, todo entry) to patch it, or None when it is no MLP."""
    form = mlp_form(module)
    vouched = _vouched(type(module), extra)
    if isinstance(form, Named):
        return form.reason, None
    proven = form is not None
    if form is None:
        shaped = _kind(module)
        if shaped is None:
            return (_INLINE, None) if _inline(module) else None
        if not vouched:
            return _UNKNOWN, None
        kind, act_name, names = shaped
        form = Form(kind, names or ("gate_proj", "up_proj", "down_proj"), _Gate(act=act_name))
    kind, names, gate = form.kind, form.names, form.gate
    if not _shapes_ok(module, kind, names):
        if kind == "classic":
            return None  # a head or a conv block of the same code shape: no MLP
        return _UNKNOWN, None
    if gate.limit is not None:
        if kind == "classic":
            return None
        reason = _gate_problem(module, gate)
        if reason:
            return reason, None
        func = _clamped_forward if kind == "gated" else _clamped_packed_forward
        state = _gate_state(module, gate)
        bound_gate: _Gate | None = gate
    else:
        act = _attr(module, gate.act)
        state = _table_activation(act)
        if state is None:
            return _unsupported(act), None
        func = {"gated": _gated_forward, "packed": _packed_forward, "classic": _classic_forward}[kind]
        bound_gate = None
    args = names + ((gate.layout,) if kind == "packed" and gate.layout != "concat" else ())
    # not run under a forward wrapper the instance had (accelerate's hook) nor while the activation is hooked
    verdict = _UNKNOWN_CHECK
    if prev is None and state is not None:
        width = _features(module._modules[names[0]])[0]
        numbers = numbers_in(type(module).forward)
        verdict = _check(module, func, state, args, width=width, first=names[0], numbers=numbers)
    if verdict == _DISAGREE:
        return (_DISAGREES_CLASSIC if kind == "classic" else _DISAGREES), None
    if verdict != _AGREE and not proven:
        return _NOT_PROVEN, None
    fwd = _BoundForward(module, func, _input_name(module.forward), prev, bound_gate, args, form.guards)
    return None, (module, kind, fwd, None, (gate.act, gate.act and _attr(module, gate.act)))


def _pair(module):
    """The plan of a BERT-style layer (see _dense), or None when it is none."""
    mods = module._modules
    inter, out = mods.get("intermediate"), mods.get("output")
    if inter is None or out is None or not hasattr(inter, "dense") or not hasattr(out, "dense"):
        return None
    form = pair_form(module)
    if form is None or "feed_forward_chunk" in module.__dict__:
        return _UNKNOWN_PAIR, None
    act = _attr(inter, form.gate.act)
    entry = _table_activation(act)
    if entry is None:
        return _unsupported(act), None
    width = _features(inter.dense)
    if width is None or _features(out.dense) is None:
        return None
    verdict = _check(module, _pair_forward, entry, own=_chunk_of, width=width[0], first=inter.dense)
    if verdict == _DISAGREE:
        return _DISAGREES_CLASSIC, None
    fwd = _BoundChunk(module, _pair_forward, _input_name(module.feed_forward_chunk), None, None, (), form.guards)
    return None, (module, "pair", fwd, None, (form.gate.act, act))


def _experts(module):
    found = experts_plan(module)
    if isinstance(found, str):
        return found, None
    gate, guards = found
    act = (gate.act, gate.act and _attr(module, gate.act))
    return None, (module, "experts_gate", None, _BoundGate(module, gate, guards), act)


def patch_model(
    model: nn.Module,
    strict: bool = False,
    extra_classes: Iterable[type] = (),
    *,
    recompute: bool = False,
    token_chunk: int | None = None,
) -> int:
    """Patches in place every module of `model` whose code ffn_ext recognises as a form it computes (docs/hf.md):
    gated MLPs down(act(gate(x)) * up(x)) and their packed forms, clamped SwiGLU MLPs, classic MLPs
    fc2(act(fc1(x))), BERT-style layers, and MoE experts' gating (_apply_gate), with an activation of ffn_ext's
    table; each one only when its self-check, run over every regime (inputs scaled across the activation's range and
    past every limit-like number on the module or its config; forward, and backward where it trains), does not
    disagree. Returns how many modules were patched now (already patched ones are not counted again).

    What is not patched but looks like an MLP (MLP-shaped modules whose code is not recognised, recognised forms no
    ffn_ext op computes, activations the table lacks, self-check failures, experts whose gating is inline in their
    loop) runs as it is and is named with the reason in one RuntimeWarning; with strict=True that is a ValueError
    and nothing is patched.

    extra_classes: your own MLP classes whose code ffn_ext does not recognise but which compute exactly
    down_proj(act_fn(gate_proj(x)) * up_proj(x)) (or the packed form under gate_up_proj / down_proj): patched when
    their self-check runs and agrees (subclasses that do not override forward count too).

    recompute, token_chunk: the patched gated, packed and classic MLPs and BERT-style layers run ffn_ext.mlp's lean
    autograd with these (recompute=True: backward recomputes the projections from the saved input; token_chunk=N:
    forward and backward over chunks of N tokens). A later call sets them anew on the MLPs patched before. They do
    not apply to the clamped MLPs and the MoE experts (their projections run as modules): with other than the
    defaults, those are named in a RuntimeWarning (strict=True: a ValueError, nothing patched)."""
    opts = check_options("patch_model", recompute, token_chunk)
    extra = tuple(extra_classes)
    if not all(isinstance(c, type) for c in extra):
        raise TypeError(f"ffn_ext.hf.patch_model: extra_classes must be classes (nn.Module subclasses), got {extra!r}")
    todo: list[tuple] = []  # (module, mark, forward, _apply_gate, _ACT)
    skipped: dict[str, dict[str, list[str]]] = {}  # reason -> class -> names
    not_chunked: dict[str, list[str]] = {}  # class -> names of what recompute / token_chunk do not apply to
    for name, module in model.named_modules():
        mark = getattr(module, _MARK, None)
        if mark:
            if mark in _OPTIONED:
                todo.append((module, mark, None, None, None))
            elif opts != _DEFAULT_OPTS:
                not_chunked.setdefault(type(module).__name__, []).append(name or "model")
            continue
        prev = module.__dict__.get("forward")  # a forward wrapper set on the instance (e.g. accelerate's hook)
        if _is_experts(module):
            found = _experts(module)
        else:
            found = _pair(module) or _dense(module, prev, extra)
        if found is None:
            continue
        reason, entry = found
        if reason:
            skipped.setdefault(reason, {}).setdefault(type(module).__name__, []).append(name or "model")
            continue
        todo.append(entry)
        if opts != _DEFAULT_OPTS and (entry[1] == "experts_gate" or entry[2].gate is not None):
            not_chunked.setdefault(type(module).__name__, []).append(name or "model")
    msgs = []  # (message, what happens to them without strict)
    if skipped:
        msgs.append(
            ("; ".join(f"{reason}: {_where(by_class)}" for reason, by_class in skipped.items()), " (left unpatched)")
        )
    if not_chunked:
        what = " and ".join(
            t for t in (opts[0] and "recompute=True", opts[1] is not None and f"token_chunk={opts[1]}") if t
        )
        msgs.append(
            (
                f"{what} does not apply to {_where(not_chunked)}: their projections run as modules (clamped "
                "MLPs, MoE experts)",
                " (patched without it)",
            )
        )
    for msg, outcome in msgs:
        if strict:
            raise ValueError(f"ffn_ext.hf.patch_model: {msg} (strict=True: nothing patched)")
        warnings.warn(f"ffn_ext.hf.patch_model: {msg}{outcome}", RuntimeWarning, stacklevel=2)
    count = 0
    for module, mark, fwd, gate_fn, act in todo:
        if mark in _OPTIONED:
            module.__dict__[_OPTS] = opts
        if act is None:  # patched before: only its options are new
            continue
        if fwd is not None:
            module.__dict__["feed_forward_chunk" if mark == "pair" else "forward"] = fwd
        if gate_fn is not None:
            module._apply_gate = gate_fn
        setattr(module, _MARK, mark)
        setattr(module, _ACT, act)
        count += 1
    return count


def unpatch_model(model: nn.Module) -> int:
    """Undoes patch_model: each patched MLP gets back the forward it had (its class's, or the instance forward
    that was there); under a forward wrapper added after patching by accelerate (which keeps the patched forward
    as `_old_forward`), that is where it is restored. Returns how many MLPs were restored."""
    count = 0
    for name, module in model.named_modules():
        mark = getattr(module, _MARK, None)
        if not mark:
            continue
        d = module.__dict__
        if mark != "experts_gate":  # its forward (a BERT-style layer: its feed_forward_chunk) was patched
            attrs = ("feed_forward_chunk",) if mark == "pair" else ("forward", "_old_forward")
            attr = next((a for a in attrs if isinstance(d.get(a), _BoundForward)), None)
            if attr is None:
                warnings.warn(
                    f"ffn_ext.hf.unpatch_model: {name or 'model'} ({type(module).__name__}): its patched "
                    "forward was wrapped by something other than accelerate's hook and cannot be taken "
                    "out; remove that wrapper first. Left patched.",
                    RuntimeWarning,
                    stacklevel=2,
                )
                continue
            prev = d[attr].prev
            if prev is not None:
                d[attr] = prev
            elif attr != "_old_forward":
                del d[attr]
            else:
                d[attr] = type(module).forward.__get__(module)
        if isinstance(d.get("_apply_gate"), _BoundGate):
            del d["_apply_gate"]
        del d[_MARK], d[_ACT]
        d.pop(_OPTS, None)
        count += 1
    return count
