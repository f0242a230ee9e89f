"""Clamped SwiGLU MLPs (_KNOWN_CLAMPED) and the gatings that clamp the activation's output (_CLAMP_AFTER: named,
never patched)."""

from __future__ import annotations

from .. import ops as _ops
from .common import _defining, _fused_gate, _Gate

# transformers MLP classes with nn.Linear projections (gate_proj/up_proj/down_proj, or packed gate_up_proj/down_proj)
# whose forward is down_proj of a clamped SwiGLU, with the _Gate it computes (tests/test_hf_moe.py checks the source)
_KNOWN_CLAMPED = {
    "DeepseekV4MLP": _Gate(limit="limit"),  # the shared expert; act_fn = ACT2FN[hidden_act], SiLU
    "Glm5NextTextMLP": _Gate(limit="swiglu_limit"),
    "Glm5NextVisionMLP": _Gate(limit="swiglu_limit"),
    "MiniMaxM3VLDenseMLP": _Gate(act=None, limit="swiglu_limit", alpha="swiglu_alpha", up_offset=1.0),
}
_CLAMPS_AFTER = (
    "gated MLPs and experts that clamp the activation's output, down(clamp(act_fn(gate), max=limit) * "
    "clamp(up, -limit, limit)) (Step-3.7; transformers' _fp8_experts_clamp_after_activation): ffn_ext's "
    "clamped SwiGLU clamps the gate before the activation, silu(clamp(gate, max=limit)), and no ffn_ext "
    "op clamps after it (they run as they are, unaccelerated)"
)

# transformers 5.24 classes with the gated MLP modules' children (or experts' _apply_gate) whose gating clamps
# the activation's output (_CLAMPS_AFTER; tests/test_hf_moe.py checks the source and that none is missing); also
# any class that sets transformers' _fp8_experts_clamp_after_activation = True itself
_CLAMP_AFTER = frozenset({"Step3p7MLP", "Step3p7Experts"})


def _clamped_forward(self, x, c):
    mods = self._modules
    g, u, d = mods["gate_proj"], mods["up_proj"], mods["down_proj"]
    return d(_ops.swiglu_clamped(g(x), u(x), limit=c.limit, alpha=c.alpha, up_offset=c.up_offset))


def _clamped_packed_forward(self, x, c, proj="gate_up_proj", out="down_proj"):
    mods = self._modules
    return mods[out](_fused_gate(c, mods[proj](x)))


def _clamped_entry(cls):
    """The _Gate of a clamped MLP class: its forward is that of a transformers class of _KNOWN_CLAMPED; else None."""
    c = _defining(cls, "forward")
    if c is not None and c.__name__ in _KNOWN_CLAMPED and c.__module__.startswith("transformers."):
        return _KNOWN_CLAMPED[c.__name__]
    return None


def _clamps_after(cls) -> bool:
    """Whether cls's gating clamps the activation's output (_CLAMPS_AFTER): the class defining its _apply_gate (else
    its forward) is a transformers class of _CLAMP_AFTER, or sets _fp8_experts_clamp_after_activation = True."""
    c = _defining(cls, "_apply_gate") or _defining(cls, "forward")
    return c is not None and (
        (c.__name__ in _CLAMP_AFTER and c.__module__.startswith("transformers."))
        or vars(c).get("_fp8_experts_clamp_after_activation") is True
    )
