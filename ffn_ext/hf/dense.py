"""The gated MLPs: down(act(gate(x)) * up(x)) and the packed form, run by ffn_ext.mlp's fused MLP (recognised from
their code: ffn_ext/hf/recognise.py), and the shapes by which unrecognised modules are named as MLPs."""

from __future__ import annotations

import torch.nn as nn

from .. import ops as _ops
from ..mlp import fusable, gated_mlp, gated_mlp_packed, linear_args
from .common import _DEFAULT_OPTS, _GATED_NAMES, _OPTS, _fused_gate

# Attribute names under which modules hold a gated MLP's projections (to [..., 2I] and back) and activation, for
# naming MLP-shaped modules whose code is not recognised (and for extra_classes): Phi-3's, Granite MoE's shared
# experts', ModernBERT's and Moonshine's decoder's. The last two name plain MLPs too, so they count only with a packed
# MLP's shapes.
_PACKED_FORMS = (
    ("gate_up_proj", "down_proj", ("activation_fn", "act_fn")),
    ("input_linear", "output_linear", ("activation",)),
)
_SHAPED_FORMS = (("Wi", "Wo", ("act",)), ("fc1", "fc2", ("activation_fn",)))

# why a module that looks like a gated MLP was left unpatched (the keys of patch_model's warning)
_UNKNOWN = (
    "MLP-shaped modules not known to compute a form of ffn_ext's: their forward is not recognised (extra "
    "multipliers, clamps, norms, dropout, casts or adapters: see docs/hf.md); if a class computes exactly "
    "down_proj(act_fn(gate_proj(x)) * up_proj(x)), pass it in extra_classes=[...] (it must then pass the self-check)"
)


def _gated_forward(self, x, act, gate="gate_proj", up="up_proj", down="down_proj"):
    mods = self._modules
    g, u, d = mods[gate], mods[up], mods[down]
    if fusable((g, u, d)):
        recompute, chunk = self.__dict__.get(_OPTS, _DEFAULT_OPTS)
        return gated_mlp(x, *linear_args(g, u, d), activation=act.name, recompute=recompute, token_chunk=chunk)
    return d(_ops.gated(g(x), u(x), act.name))


def _packed_forward(self, x, act, proj="gate_up_proj", out="down_proj", layout="concat"):
    mods = self._modules
    gu, d = mods[proj], mods[out]
    if layout != "concat":
        return d(_fused_gate(act, gu(x), layout))
    if fusable((gu, d)):
        recompute, chunk = self.__dict__.get(_OPTS, _DEFAULT_OPTS)
        return gated_mlp_packed(x, *linear_args(gu, d), activation=act.name, recompute=recompute, token_chunk=chunk)
    return d(_ops.gated_packed(gu(x), act.name))


def _kind(module):
    """(kind, name of the activation attribute, projection names) for an MLP-shaped module, else None: 'gated' with
    nn.Linear children gate_proj, up_proj, down_proj (names: ()), or 'packed' with nn.Linear children of a pair of
    _PACKED_FORMS, or of _SHAPED_FORMS with a packed MLP's shapes (names: that pair, the projection to [..., 2I]
    first)."""
    mods = dict(module.named_children())

    def linear(*names):
        return all(isinstance(mods.get(n), nn.Linear) for n in names)

    if linear(*_GATED_NAMES):
        kind, names, acts = "gated", (), ("act_fn", "activation_fn")
    else:
        form = next((f for f in _PACKED_FORMS if linear(f[0], f[1])), None) or next(
            (f for f in _SHAPED_FORMS if linear(f[0], f[1]) and _packed_shapes(mods[f[0]], mods[f[1]])), None
        )
        if form is None:
            return None
        kind, names, acts = "packed", form[:2], form[2]
    return kind, next((n for n in acts if hasattr(module, n)), acts[0]), names


def _packed_shapes(proj: nn.Linear, out: nn.Linear) -> bool:
    """Whether proj (to [..., 2I]) and out (back) have a packed gated MLP's shapes."""
    return proj.in_features == out.out_features and proj.out_features == 2 * out.in_features
