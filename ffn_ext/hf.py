"""Hugging Face interop: make a loaded `transformers` model's gated MLPs run on ffn_ext, in place.

    model = AutoModelForCausalLM.from_pretrained(...)
    n = ffn_ext.hf.patch_model(model)      # == ffn_ext.patch_hf_model(model); returns the number patched

Patched (matched by structure, not by class name):
  * Llama / Qwen2 / Mistral style: submodules gate_proj, up_proj, down_proj (nn.Linear) and act_fn (SiLU);
  * Phi-3 style: gate_up_proj (packed, gate rows first) and down_proj (nn.Linear) and activation_fn (SiLU).
The patch replaces the MLP instance's ``forward`` (no class swap, no weight copy): the parameters stay the same
objects, state_dict / save_pretrained are unchanged, deepcopy keeps the patch. The new forward runs
ffn_ext.modules.swiglu_mlp / swiglu_mlp_packed (fused SwiGLU; training saves x and the projections and recomputes
h in backward), or, when a projection is not a plain nn.Linear (LoRA, quantized) or carries hooks, calls the
projections as modules with the fused ffn_ext.swiglu in between. The fused forms never call the activation module,
so when it carries hooks (or global module hooks are set), or it was replaced after patching by something that is
not a SiLU, the MLP runs its class's own forward: hooks fire and the replacement runs. MLPs with gate/up/down
projections whose activation is not SiLU (GELU-gated models such as Gemma) are skipped with a warning, or refused
with ValueError if strict=True.
``unpatch_model`` restores the original forward. transformers itself is not imported here.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import ops as _ops
from .modules import SiLU, _fusable, _linear_args, swiglu_mlp, swiglu_mlp_packed

__all__ = ["patch_model", "unpatch_model"]

_MARK = "_ffn_ext_patched"  # 'gated' | 'packed'
_ACT = "_ffn_ext_act"        # (attribute name of the activation, the activation patched over)


def _is_silu(act) -> bool:
    if isinstance(act, (nn.SiLU, SiLU)) or act in (F.silu, torch.nn.functional.silu, _ops.silu):
        return True
    # transformers' ACT2FN["silu"] is its own SiLUActivation class (x -> F.silu(x)); match it without importing it
    cls = type(act)
    return cls.__name__ == "SiLUActivation" and cls.__module__.startswith("transformers")


def _act_bypassable(self) -> bool:
    """Whether the fused kernels may stand in for the MLP's activation call: it still is the SiLU patched over
    (or another SiLU), and no hook, on it or global, expects to see it run."""
    name, patched = self.__dict__[_ACT]
    mods = self._modules
    act = mods[name] if name in mods else getattr(self, name, None)
    if act is not patched and not _is_silu(act):
        return False
    return not isinstance(act, nn.Module) or _fusable((), (act,))


def _gated_forward(self, x):
    if not _act_bypassable(self):
        return type(self).forward(self, x)
    mods = self._modules
    g, u, d = mods["gate_proj"], mods["up_proj"], mods["down_proj"]
    if _fusable((g, u, d)):
        return swiglu_mlp(x, *_linear_args(g, u, d))
    return d(_ops.swiglu(g(x), u(x)))


def _packed_forward(self, x):
    if not _act_bypassable(self):
        return type(self).forward(self, x)
    mods = self._modules
    gu, d = mods["gate_up_proj"], mods["down_proj"]
    if _fusable((gu, d)):
        return swiglu_mlp_packed(x, *_linear_args(gu, d))
    return d(_ops.swiglu_packed(gu(x)))


class _BoundForward:
    """The patched forward, bound to its MLP like a method, but picklable: a types.MethodType pickles as
    getattr(mlp, '_gated_forward') and so made torch.save(model) write checkpoints that torch.load could not read.
    This pickles the module-level function by name and the MLP by reference."""

    def __init__(self, module, func):
        self.__self__, self.__func__ = module, func

    def __call__(self, x):  # the signature the bound method had: inspect.signature(mlp.forward) == (x)
        return self.__func__(self.__self__, x)


def _kind(module):
    """('gated'|'packed', name of the activation attribute) for an MLP-shaped module, else None."""
    children = dict(module.named_children())
    if all(isinstance(children.get(n), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")):
        kind, names = "gated", ("act_fn", "activation_fn")
    elif all(isinstance(children.get(n), nn.Linear) for n in ("gate_up_proj", "down_proj")):
        kind, names = "packed", ("activation_fn", "act_fn")
    else:
        return None
    return kind, next((n for n in names if hasattr(module, n)), names[0])


def _check_shapes(name, module, kind):
    d = module.down_proj
    if kind == "gated":
        g, u = module.gate_proj, module.up_proj
        ok = g.in_features == u.in_features == d.out_features and g.out_features == u.out_features == d.in_features
    else:
        gu = module.gate_up_proj
        ok = gu.in_features == d.out_features and gu.out_features == 2 * d.in_features
    if not ok:
        raise ValueError(f"ffn_ext.hf.patch_model: {name or 'model'} ({type(module).__name__}) has MLP-named "
                         "projections with inconsistent shapes; not a gated MLP ffn_ext can run")


def patch_model(model: nn.Module, strict: bool = False) -> int:
    """Patches every SiLU-gated MLP of `model` in place to use ffn_ext; returns how many were patched now
    (already patched ones are not counted again). Gated MLPs whose activation is not SiLU are skipped with a
    RuntimeWarning, or raise ValueError when strict=True."""
    count, skipped = 0, []
    for name, module in model.named_modules():
        found = _kind(module)
        if found is None or getattr(module, _MARK, None):
            continue
        kind, act_name = found
        act = getattr(module, act_name, None)
        if not _is_silu(act):
            skipped.append(f"{name or 'model'} ({type(module).__name__}, activation {act!r})")
            continue
        _check_shapes(name, module, kind)
        module.forward = _BoundForward(module, _gated_forward if kind == "gated" else _packed_forward)
        setattr(module, _MARK, kind)
        setattr(module, _ACT, (act_name, act))
        count += 1
    if skipped:
        msg = ("ffn_ext.hf.patch_model: these gated MLPs are not SiLU-gated, ffn_ext implements SwiGLU only: "
               + "; ".join(skipped[:4]) + (f"; and {len(skipped) - 4} more" if len(skipped) > 4 else ""))
        if strict:
            raise ValueError(msg)
        warnings.warn(msg + " (left unpatched)", RuntimeWarning, stacklevel=2)
    return count


def unpatch_model(model: nn.Module) -> int:
    """Undoes patch_model (restores the class's forward); returns how many MLPs were restored."""
    count = 0
    for module in model.modules():
        if getattr(module, _MARK, None):
            module.__dict__.pop("forward", None)
            delattr(module, _MARK)
            module.__dict__.pop(_ACT, None)
            count += 1
    return count
