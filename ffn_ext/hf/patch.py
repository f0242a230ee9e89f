"""patch_model and unpatch_model: walk the model, sort each module into a form, self-check, warn once, patch."""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch.nn as nn

from ..mlp import _options
from .clamped import _CLAMPS_AFTER, _clamped_entry, _clamped_forward, _clamped_packed_forward, _clamps_after
from .classic import plan as _classic_plan
from .common import (
    _ACT,
    _DEFAULT_OPTS,
    _DISAGREES,
    _MARK,
    _OPTS,
    _agrees,
    _attr,
    _BoundForward,
    _gate_problem,
    _gate_state,
    _input_name,
    _table_activation,
    _unsupported,
    _where,
)
from .dense import _UNKNOWN, _check_shapes, _gated_forward, _kind, _named_reason, _packed_forward, _vouched
from .experts import (
    _DISAGREES_GATE,
    _FORMS,
    _UNKNOWN_EXPERTS,
    _BoundExperts,
    _BoundGate,
    _experts_entry,
    _gate_agrees,
    _is_experts,
)

_OPTIONED = ("gated", "packed", "classic", "pair")  # marks of the patched modules that take recompute / token_chunk


def patch_model(
    model: nn.Module,
    strict: bool = False,
    extra_classes: Iterable[type] = (),
    *,
    recompute: bool = False,
    token_chunk: int | None = None,
) -> int:
    """Patches in place every MLP of `model` that computes a gated MLP with an activation of ffn_ext's table
    (SwiGLU, GeGLU with the exact or the tanh GELU), every known clamped SwiGLU MLP, every known MoE experts
    module whose gating ffn_ext computes, and every known classic MLP fc2(act(fc1(x))) and BERT-style layer (see
    the module docstring and ffn_ext/hf/classic.py) to use ffn_ext; returns how many modules were patched now
    (already patched ones are not counted again). Classic MLPs with an activation the table lacks, and modules with an
    FFN's fc1 / fc2 whose forward is not known (Whisper's layers: the FFN inline, a dropout between the activation
    and fc2), are named in the same warning.

    extra_classes: your own MLP classes (nn.Linear gate_proj/up_proj/down_proj or gate_up_proj/down_proj, an
    act_fn or activation_fn of the table: nn.SiLU, nn.GELU(approximate=...), transformers' ACT2FN["silu"],
    ACT2FN["gelu"], ACT2FN["gelu_pytorch_tanh"], ...; or input_linear/output_linear and activation, as Granite MoE's
    shared experts; or, with a packed MLP's shapes, Wi/Wo and act or fc1/fc2 and activation_fn) whose forward
    computes exactly down_proj(act_fn(gate_proj(x)) * up_proj(x)), or the packed form with gate first. Modules
    with these submodules that are not known to compute that, whose activation is not one of the table's or that
    fail the self-check, and gated MoE experts modules ffn_ext does not accelerate, are left
    unpatched with one RuntimeWarning naming their classes (and why); with strict=True that is a ValueError and
    nothing is patched. extra_classes does not apply to experts modules, nor to gatings known to clamp the
    activation's output (_CLAMP_AFTER), nor to the packed MLPs of _NAMED (dropout before the projection back, the
    up half first).

    recompute, token_chunk: the patched gated and packed MLPs run ffn_ext.mlp.gated_mlp(_packed), the classic ones
    and BERT-style layers ffn_ext.mlp.plain_mlp, with these
    (recompute=True: backward recomputes the projections from the saved input; token_chunk=N: forward and backward
    over chunks of N tokens, for long sequences). A later call sets them anew on the MLPs patched before. They do
    not apply to the clamped MLPs and the MoE experts modules (their projections run as modules): with other than
    the defaults, those are named in a RuntimeWarning (strict=True: a ValueError, nothing patched)."""
    opts = _options("patch_model", recompute, token_chunk)
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
            entry = _experts_entry(type(module))
            if entry is None:
                reason: str | None = _CLAMPS_AFTER if _clamps_after(type(module)) else _UNKNOWN_EXPERTS
            else:
                gate, form = entry
                reason = _gate_problem(module, gate) or (None if _gate_agrees(module, gate) else _DISAGREES_GATE)
            if reason is None:
                spec = _FORMS[form]  # None: the class's forward calls _apply_gate
                fwd = spec and _BoundExperts(module, spec[0], spec[1], prev, gate, spec[2])
                gate_fn = _BoundGate(module, gate) if callable(getattr(type(module), "_apply_gate", None)) else None
                todo.append(
                    (
                        module,
                        "experts" if fwd else "experts_gate",
                        fwd,
                        gate_fn,
                        (gate.act, gate.act and _attr(module, gate.act)),
                    )
                )
                if opts != _DEFAULT_OPTS:
                    not_chunked.setdefault(type(module).__name__, []).append(name or "model")
        else:
            found = _kind(module)
            if found is None:
                classic = _classic_plan(module, prev)
                if classic is None:
                    continue
                reason, patch = classic
                if reason is None:
                    todo.append((module, patch[0], patch[1], None, patch[2]))
                else:
                    skipped.setdefault(reason, {}).setdefault(type(module).__name__, []).append(name or "model")
                continue
            kind, act_name, names = found
            clamp = _clamped_entry(type(module))
            named = _named_reason(type(module))
            if _clamps_after(type(module)):  # whatever extra_classes says: its forward is known
                reason = _CLAMPS_AFTER
            elif named is not None:  # the same
                reason = named
            elif clamp is not None:
                func = _clamped_forward if kind == "gated" else _clamped_packed_forward
                act_name, act = clamp.act, clamp.act and _attr(module, clamp.act)
                reason = _gate_problem(module, clamp)
                if reason is None:
                    _check_shapes(name, module, kind, names)
                    state = _gate_state(module, clamp)
                    if not (prev is not None or state is None or _agrees(module, func, state, names, state.limit)):
                        reason = _DISAGREES
            else:
                act, func = getattr(module, act_name, None), _gated_forward if kind == "gated" else _packed_forward
                entry = _table_activation(act)
                if entry is None:
                    reason = _unsupported(act)
                elif not _vouched(type(module), extra):
                    reason = _UNKNOWN
                else:
                    _check_shapes(name, module, kind, names)
                    reason = None if prev is not None or _agrees(module, func, entry, names) else _DISAGREES
            if reason is None:
                todo.append(
                    (
                        module,
                        kind,
                        _BoundForward(module, func, _input_name(module.forward), prev, clamp, names),
                        None,
                        (act_name, act),
                    )
                )
                if clamp is not None and opts != _DEFAULT_OPTS:
                    not_chunked.setdefault(type(module).__name__, []).append(name or "model")
        if reason:
            skipped.setdefault(reason, {}).setdefault(type(module).__name__, []).append(name or "model")
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
