"""patch_model and unpatch_model: walk the model, plan each module by the forms' registry (forms.py), warn once,
patch."""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch
import torch.nn as nn

from ..mlp import check_options, check_saved_dtype
from .forms import EXPERTS, MARK, OPTS, ZERO3_LEAF, Patched, asked, experts_watch, plan


def _where(by_class: dict) -> str:
    """'Cls at 'name' and 3 more, ...' for class -> module names."""
    return ", ".join(
        f"{cls} at {names[0]!r}" + (f" and {len(names) - 1} more" if len(names) > 1 else "")
        for cls, names in by_class.items()
    )


def patch_model(
    model: nn.Module,
    strict: bool = False,
    extra_classes: Iterable[type] = (),
    *,
    recompute: bool = False,
    token_chunk: int | None = None,
    saved_dtype: torch.dtype | None = None,
) -> int:
    """Patches in place every module of `model` whose code ffn_ext recognises as a form it computes (docs/hf.md):
    gated MLPs down(act(gate(x)) * up(x)) and their packed forms, clamped SwiGLU MLPs, classic MLPs
    fc2(act(fc1(x))), BERT-style layers, and MoE experts' gating (_apply_gate, where the experts' forward calls it),
    with an activation of ffn_ext's table; each one only when its self-check, run over every regime (inputs scaled
    across the activation's range and past every limit-like number on the module or its config; forward, and
    backward where it trains), does not disagree. Returns how many modules were patched now (already patched ones
    are not counted again).

    What is not patched but looks like an MLP (MLP-shaped modules whose code is not recognised, recognised forms no
    ffn_ext op computes, activations the table lacks, self-check failures, experts whose forward computes the
    gating inline in its loop, under experts_implementation="eager" too) runs as it is and is named with the reason
    in one RuntimeWarning; with strict=True that is a ValueError and nothing is patched.

    extra_classes: your own MLP classes whose code ffn_ext does not recognise but which compute exactly
    down_proj(act_fn(gate_proj(x)) * up_proj(x)) (or the packed form under gate_up_proj / down_proj): patched when
    their self-check runs and agrees (subclasses that do not override forward count too).

    recompute, token_chunk: the patched gated (clamped too), packed (either layout) and classic MLPs and BERT-style
    layers run ffn_ext.mlp's lean autograd with these (recompute=True: backward recomputes the projections from the
    saved input; token_chunk=N: forward and backward over chunks of N tokens). A later call sets them anew on the
    MLPs patched before. They do not apply to the MoE experts (transformers' experts implementation runs their
    projections): with other than the defaults, those are named in a RuntimeWarning (strict=True: a ValueError,
    nothing patched).

    saved_dtype (torch.float8_e4m3fn or torch.bfloat16): the dtype the same MLPs keep their projections in for
    backward (ffn_ext.mlp's saved_dtype; a module whose d_ff no FP8 group divides raises at its forward), and the
    experts' [tokens, 2 x d_ff] projection where their experts implementation is "ffn_ext" (a forward under
    another names it, once, as not acting)."""
    opts = (
        *check_options("patch_model", recompute, token_chunk),
        check_saved_dtype("patch_model", saved_dtype, None, recompute, token_chunk),
    )
    extra = tuple(extra_classes)
    if not all(isinstance(c, type) for c in extra):
        raise TypeError(f"ffn_ext.hf.patch_model: extra_classes must be classes (nn.Module subclasses), got {extra!r}")
    todo: list[Patched] = []
    skipped: dict[str, dict[str, list[str]]] = {}  # reason -> class -> names
    not_chunked: dict[str, list[str]] = {}  # class -> names of what recompute / token_chunk do not apply to
    for name, module in model.named_modules():
        patched = module.__dict__.get(MARK)
        if patched is None:
            found = plan(module, extra)
            if isinstance(found, tuple):
                form, p = found
                found = form.unused(module)
                prev = module.__dict__.get("forward") if form.method == "forward" else None
                patched = Patched(module, form, p, prev, name or "model") if found is None else None
            if found is not None:
                skipped.setdefault(found, {}).setdefault(type(module).__name__, []).append(name or "model")
        if patched is not None:
            todo.append(patched)
            if asked(opts, patched.form is EXPERTS) and not patched.form.options(module, patched.plan):
                not_chunked.setdefault(type(module).__name__, []).append(name or "model")
    msgs = []  # (message, what happens to them without strict)
    if skipped:
        msgs.append(
            ("; ".join(f"{reason}: {_where(by_class)}" for reason, by_class in skipped.items()), " (left unpatched)")
        )
    if not_chunked:
        what = asked(opts, experts=True)
        msgs.append(
            (
                f"{what} does not apply to {_where(not_chunked)}: MoE experts, whose projections transformers' "
                "experts implementation runs",
                " (patched without it)",
            )
        )
    for msg, outcome in msgs:
        if strict:
            raise ValueError(f"ffn_ext.hf.patch_model: {msg} (strict=True: nothing patched)")
        warnings.warn(f"ffn_ext.hf.patch_model: {msg}{outcome}", RuntimeWarning, stacklevel=2)
    count = 0
    for patched in todo:
        module = patched.__self__
        module.__dict__[OPTS] = opts
        patched.warned = False  # a new call, new options: what cannot act is named anew
        if module.__dict__.get(MARK) is not patched:
            module.__dict__[patched.form.method] = module.__dict__[MARK] = patched
            # whether or not DeepSpeed runs (it may be initialised later): a flag only ZeRO-3 reads (forms.ZERO3_LEAF)
            patched.leaf = ZERO3_LEAF not in module.__dict__
            module.__dict__.setdefault(ZERO3_LEAF, True)
            if patched.form is EXPERTS:
                patched.watch = module.register_forward_pre_hook(experts_watch)
            count += 1
    return count


def unpatch_model(model: nn.Module) -> int:
    """Undoes patch_model: each patched module gets back the method it had (its class's, or the instance forward that
    was there); under a forward wrapper added after patching by accelerate (which keeps the patched forward as
    `_old_forward`), that is where it is restored. Returns how many modules were restored."""
    count = 0
    for name, module in model.named_modules():
        d = module.__dict__
        patched = d.get(MARK)
        if patched is None:
            continue
        method = patched.form.method
        attr = next((a for a in (method, "_old_forward") if d.get(a) is patched), None)
        if attr is None:
            warnings.warn(
                f"ffn_ext.hf.unpatch_model: {name or 'model'} ({type(module).__name__}): its patched "
                f"{method} was wrapped by something other than accelerate's hook and cannot be taken "
                "out; remove that wrapper first. Left patched.",
                RuntimeWarning,
                stacklevel=2,
            )
            continue
        if patched.prev is not None:
            d[attr] = patched.prev
        elif attr == "_old_forward":
            d[attr] = getattr(type(module), method).__get__(module)
        else:
            del d[attr]
        if patched.leaf:
            d.pop(ZERO3_LEAF, None)
        if patched.watch is not None:
            patched.watch.remove()
        del d[MARK], d[OPTS]
        count += 1
    return count
