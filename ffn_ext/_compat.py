"""The torch-private APIs ffn_ext uses for torch's public behaviour (transforms, forward AD, module hooks), in one
place, each with the behaviour it stands for. When a torch release moves one of these, this file is what changes.
The dispatcher's private calls (below autograd, kernel lookups, mode stacks) stay where the ops are called and
registered: _kernels.py, quant.py, _loader.py. The C++ side has none: it is on torch's stable ABI
(docs/internals/stable-abi.md).
"""

from __future__ import annotations

import sys

import torch
import torch.autograd.forward_ad as _fwAD
import torch.nn.modules.module as _module_mod

__all__ = [
    "functorch_active",
    "vmap_only",
    "forward_ad_level",
    "has_tangent",
    "has_dtensor",
    "global_module_hooks",
    "module_hooks",
]


_layer_depth = torch._C._functorch.get_dynamic_layer_stack_depth
# dynamo folds the depth to its value at trace time, under a guard, from torch 2.13; before, it cannot trace the
# call at all (a graph break, and torch.compile(fullgraph=True) fails), so there the trace reads it through
# assume_constant_result, which folds it the same way without that guard
_DYNAMO_FOLDS_DEPTH = torch.torch_version.TorchVersion(torch.__version__) >= "2.13"


def _depth_while_traced() -> int:
    return _layer_depth()


if not _DYNAMO_FOLDS_DEPTH:
    # what torch.compiler.assume_constant_result does in those (released, unchanging) 2.10 to 2.12, without calling it:
    # the call imports dynamo at ffn_ext's import, and torch.distributed.tensor with it (0.7 s; and the DTensor
    # strategies would then register at import, not on a first DTensor call)
    _depth_while_traced._dynamo_marked_constant = True  # type: ignore[attr-defined]


def functorch_active() -> bool:
    """True inside a torch.func transform (grad, vmap, jacrev, jvp, ...), also while torch.compile traces one."""
    # the dynamic layer stack's depth, not peek_interpreter_stack() is not None: dynamo traces the peek as not None
    # outside any transform (torch 2.14), the depth as it is (tests/test_compile_export.py)
    if not _DYNAMO_FOLDS_DEPTH and torch.compiler.is_compiling():
        return _depth_while_traced() > 0
    return _layer_depth() > 0


def vmap_only() -> bool:
    """True inside torch.func transforms that are all vmap (no grad, jvp or functionalize level). Eager only: dynamo
    cannot trace CInterpreter.key()."""
    vmap = torch._C._functorch.TransformType.Vmap
    return all(i.key() == vmap for i in torch._C._functorch.get_interpreter_stack() or ())


def forward_ad_level() -> bool:
    """True while a forward-mode AD level is open (torch.autograd.forward_ad.dual_level)."""
    return _fwAD._current_level >= 0


def has_tangent(args) -> bool:
    """True when a forward-mode AD level is open and one of args is a dual tensor with a tangent."""
    return _fwAD._current_level >= 0 and any(
        isinstance(t, torch.Tensor) and _fwAD.unpack_dual(t).tangent is not None for t in args
    )


def has_dtensor(args) -> bool:
    """True when one of args is a DTensor (torch.distributed.tensor loaded: ffn_ext never imports it, 1.3 s)."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return dtensor is not None and any(isinstance(a, dtensor) for a in args)


def global_module_hooks() -> bool:
    """True when a global nn.Module hook is registered (register_module_forward_hook and friends)."""
    m = _module_mod
    return bool(
        m._global_forward_hooks
        or m._global_forward_pre_hooks
        or m._global_backward_hooks
        or m._global_backward_pre_hooks
    )


def module_hooks(mod) -> bool:
    """True when `mod` has a forward, forward-pre, backward or backward-pre hook of its own. Reads the hook dicts
    directly: a decode step's MLP is bound by host time, and nn.Module attribute access costs about a microsecond."""
    return bool(mod._forward_hooks or mod._forward_pre_hooks or mod._backward_hooks or mod._backward_pre_hooks)
