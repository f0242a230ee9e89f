"""MoE experts modules: their gating of the [S, 2I] projection by one ffn_ext op, injected where transformers' code
calls it (_apply_gate). The routing and the experts loop stay as transformers wrote them: its grouped_mm, batched_mm
and deepgemm implementations, and the classes' own forwards that call self._apply_gate, run the fused gating; a
class whose eager forward inlines the gating runs it as written there (experts_implementation="ffn_ext" serves
those: ffn_ext/hf/moe.py)."""

from __future__ import annotations

import torch

from .classic import _activation_child
from .common import (
    _AGREE,
    _DISAGREE,
    _UNKNOWN_CHECK,
    _close,
    _fused_gate,
    _Gate,
    _gate_problem,
    _gate_state,
    _guards_hold,
    _own_graph,
    _peaks,
)
from .recognise import Named, gate_form, numbers_in

_UNKNOWN_EXPERTS = (
    "MoE experts modules whose _apply_gate ffn_ext does not recognise as a gating it computes (their routed experts "
    "run as they are, unaccelerated)"
)
_INLINE_EXPERTS = (
    "MoE experts modules without an _apply_gate, whose forward computes the gating inside its own experts loop "
    "(Llama 4, DBRX, JetMoE, ...): ffn_ext plugs in where transformers calls the gating and does not copy "
    "transformers' loops (they run as they are, unaccelerated)"
)
_DISAGREES_GATE = (
    "their gating gave a different result from ffn_ext's op on random inputs at some scale (self-check), so it "
    "must run as it is"
)


def experts_gate(module):
    """(the _Gate of the module's _apply_gate, the guards of its code) when ffn_ext's op computes it and its
    activation and limits are ones ffn_ext takes; else why not (a reason string)."""
    form = gate_form(module)
    if isinstance(form, Named):
        return form.reason
    if form is None:
        return _INLINE_EXPERTS if not callable(getattr(type(module), "_apply_gate", None)) else _UNKNOWN_EXPERTS
    return _gate_problem(module, form.gate) or (form.gate, form.guards)


def experts_plan(module):
    """experts_gate's (the _Gate, its guards) once the self-check (_check_gate) does not disagree, else why not: what
    patch_model patches and the experts implementation "ffn_ext" runs."""
    found = experts_gate(module)
    if isinstance(found, str):
        return found
    return _DISAGREES_GATE if _check_gate(module, found[0]) == _DISAGREE else found


class _BoundGate:
    """The patched _apply_gate of an experts module (set on the instance; picklable, like _BoundForward): what
    transformers' experts implementations (grouped_mm, batched_mm, deepgemm) and the class's own forward call on the
    [S, 2I] projection. Runs ffn_ext's op on it in place while _gate_state allows and the recognised code's guards
    hold, else the class's _apply_gate."""

    guards = ()

    def __init__(self, module, gate: _Gate, guards=()):
        self.__self__, self.gate, self.guards = module, gate, guards

    def __call__(self, gate_up):
        module = self.__self__
        if isinstance(gate_up, torch.Tensor) and _guards_hold(module, self.guards):
            state = _gate_state(module, self.gate)
            if state is not None:
                return _fused_gate(state, gate_up, self.gate.layout)
        return type(module)._apply_gate(module, gate_up)


def _3d(params: dict, name: str) -> bool:
    t = params.get(name)
    return t is not None and t.dim() == 3


def _is_experts(module) -> bool:
    """Whether `module` holds gated MoE experts (patched, or named in the warning): an experts class of transformers'
    @use_experts_implementation, by its has_gate (non-gated experts, act(up), are no more this patch's business
    than non-gated MLPs); any module with an _apply_gate; one with a 3-D gate_up_proj parameter, or 3-D gate_proj
    and up_proj, or three 3-D weights and an activation child."""
    has_gate = module.__dict__.get("has_gate")
    if isinstance(has_gate, bool):
        return has_gate
    if callable(getattr(type(module), "_apply_gate", None)):
        return True
    p = module._parameters
    if _3d(p, "gate_up_proj") or (_3d(p, "gate_proj") and _3d(p, "up_proj")):
        return True
    if not _activation_child(module):
        return False
    # experts under other layouts, beside their activation: children holding [E, out, in] weights (JetMoE's
    # JetMoeParallelExperts), or three weights of one 2-D shape, [E * I, H] each (DBRX's w1, v1, w2)
    if sum(any(t.dim() == 3 for t in m._parameters.values() if t is not None) for m in module.children()) >= 2:
        return True
    shapes = [tuple(t.shape) for t in p.values() if t is not None and t.dim() == 2]
    return any(shapes.count(s) >= 3 for s in shapes)


def _check_gate(module, gate: _Gate) -> str:
    """The experts' self-check: the class's _apply_gate and ffn_ext's op on the same random [8, 64] projection, in the
    experts' dtype on the CPU (the gating has no parameters), scaled to each of _peaks (past every limit-like number
    on the module and its config); forward, and backward (the projection's gradient). "agree", "disagree" or
    "unknown" (not run while hooks on the activation would see it; or nothing finite)."""
    state = _gate_state(module, gate)
    if state is None:
        return _UNKNOWN_CHECK
    p = next(iter(module.parameters()), None)
    dtype = p.dtype if p is not None and p.is_floating_point() else torch.float32
    half = dtype.itemsize <= 2
    tol = 3e-2 if half else 1e-4
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(8, 64, generator=gen, device="cpu")
    seen = False
    with _own_graph():
        for peak in _peaks(module, half, numbers_in(type(module)._apply_gate)):
            x = (x0 * (peak / float(x0.abs().max()))).to(dtype).requires_grad_()  # CPU even under a device context
            with torch.enable_grad():
                ref = type(module)._apply_gate(module, x)
                out = _fused_gate(state, x, gate.layout)
                same = _close(out.detach(), ref.detach(), tol)
                if same is False:
                    return _DISAGREE
                if same is None:
                    continue
                g = torch.randn(ref.shape, generator=gen, device="cpu").to(dtype)
                (gref,) = torch.autograd.grad(ref, x, g)
                (gout,) = torch.autograd.grad(out, x, g)
            if _close(gout, gref, 10 * tol) is False:
                return _DISAGREE
            seen = True
    return _AGREE if seen else _UNKNOWN_CHECK
