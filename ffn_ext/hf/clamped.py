"""Clamped SwiGLU MLPs: down(swiglu_clamped(gate(x), up(x))) and the packed form, as recognised from their code
(ffn_ext/hf/recognise.py: DeepSeek-V4's shared expert, GLM-5-Next, MiniMax-M3's dense MLP, ...)."""

from __future__ import annotations

from .. import ops as _ops
from .common import _fused_gate


def _clamped_forward(self, x, c, gate="gate_proj", up="up_proj", down="down_proj"):
    mods = self._modules
    g, u, d = mods[gate], mods[up], mods[down]
    return d(_ops.swiglu_clamped(g(x), u(x), limit=c.limit, alpha=c.alpha, up_offset=c.up_offset))


def _clamped_packed_forward(self, x, c, proj="gate_up_proj", out="down_proj", layout=None):
    # `layout`: the packed names' third entry where the halves interleave; the _Clamp `c` carries it too
    mods = self._modules
    return mods[out](_fused_gate(c, mods[proj](x)))
