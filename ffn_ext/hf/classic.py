"""The classic FFN, fc2(act(fc1(x))): one-module MLPs of that form (GPT-2, GPT-NeoX, Falcon, Phi, CLIP, SigLIP, ViT,
the VLMs' vision MLPs, Nemotron, ...: recognised from their code, ffn_ext/hf/recognise.py), with nn.Linear or GPT-2's
Conv1D projections and at most a dropout after fc2, and the BERT-style *Intermediate (act(dense(x))) / *Output
(LayerNorm(dropout(dense(h)) + x)) pairs, patched at the layer that calls both (its feed_forward_chunk), so that the
activation's output is not kept for fc2's weight gradient. Modules that hold an FFN's projections (d -> f -> d) and
an activation but whose forward is not recognised (Whisper's and BART's layers, with the FFN inline in the layer's
forward and a dropout between the activation and fc2; T5's, with a dtype cast) are named (_INLINE)."""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import ops as _ops
from ..mlp import fusable, plain_mlp
from .common import (
    _DEFAULT_OPTS,
    _OPTS,
    _BoundForward,
    _guards_hold,
    _table_activation,
)

_INLINE = (
    "modules holding an FFN's projections (d -> f, f -> d) and an activation whose forward ffn_ext does not "
    "recognise as a form it computes: an FFN inline in a layer's forward (Whisper's and BART's encoder and decoder "
    "layers, with a dropout between the activation and fc2 that ffn_ext's fused MLP lacks, and the attention in "
    "the same forward), or an MLP with something between or around the projections (T5's dropout and dtype cast "
    "before wo) (they run as they are, unaccelerated)"
)
_UNKNOWN_PAIR = (
    "layers with a BERT-style *Intermediate / *Output pair whose feed_forward_chunk is not known to be "
    "exactly output(intermediate(x), x) (they run as they are, unaccelerated)"
)
# projection classes of transformers that compute x @ W.T + b as nn.Linear does (module, class name)
_LINEARS = {("transformers.models.falcon.modeling_falcon", "FalconLinear")}


def _layout(*projections) -> str | None:
    """ "linear" (nn.Linear, or a class of _LINEARS) or "conv1d" (transformers' Conv1D: weight [in, out]) when all the
    projections are of that kind, exactly, and carry no hook or forward wrapper (ffn_ext.mlp.plain_mlp runs them);
    else None (they run as modules)."""
    kinds = set()
    for m in projections:
        t = type(m)
        if t is nn.Linear or (t.__module__, t.__name__) in _LINEARS:
            kinds.add("linear")
        elif t.__name__ == "Conv1D" and t.__module__ == "transformers.pytorch_utils":
            kinds.add("conv1d")
        else:
            return None
    return kinds.pop() if len(kinds) == 1 and fusable((), projections) else None


def _features(m):
    """(in, out) features of a linear-like projection (nn.Linear and subclasses, LoRA-style wrappers with in_features,
    Conv1D), else None."""
    if isinstance(getattr(m, "in_features", None), int) and isinstance(getattr(m, "out_features", None), int):
        return m.in_features, m.out_features
    t = type(m)
    if t.__name__ == "Conv1D" and t.__module__ == "transformers.pytorch_utils":
        return m.nx, m.nf
    return None


def _ffn(x, fc1, fc2, act, opts):
    """fc2(act(fc1(x))) with ffn_ext: the fused plain MLP when the projections allow (_layout), else the projections
    as modules around ffn_ext's activation op."""
    layout = _layout(fc1, fc2)
    if layout is None:
        return fc2(_ops.call_op(act.name, fc1(x)))
    recompute, chunk = opts
    return plain_mlp(
        x,
        fc1.weight,
        fc2.weight,
        fc1.bias,
        fc2.bias,
        act.name,
        recompute=recompute,
        token_chunk=chunk,
        transposed=layout == "conv1d",
    )


def _classic_forward(self, x, act, fc1, fc2, drop=""):
    mods = self._modules
    y = _ffn(x, mods[fc1], mods[fc2], act, self.__dict__.get(_OPTS, _DEFAULT_OPTS))
    if not drop:
        return y
    if drop.startswith("p:"):
        return F.dropout(y, p=getattr(self, drop[2:]), training=self.training)
    return mods[drop](y)


def _pair_forward(self, x, act):
    inter, out = self._modules["intermediate"], self._modules["output"]
    y = _ffn(x, inter.dense, out.dense, act, self.__dict__.get(_OPTS, _DEFAULT_OPTS))
    return out.LayerNorm(out.dropout(y) + x)


def _pair_act(layer):
    """The table entry of a patched layer's activation, while the fused chunk may stand in for its *Intermediate and
    *Output calls (no hook or forward wrapper on them or on the activation, which may have been replaced), else None."""
    inter, out = layer._modules.get("intermediate"), layer._modules.get("output")
    act = getattr(inter, "intermediate_act_fn", None)
    entry = _table_activation(act)
    if entry is None or out is None or not fusable((), (inter, out) + ((act,) if isinstance(act, nn.Module) else ())):
        return None
    return entry


class _BoundChunk(_BoundForward):
    """The patched feed_forward_chunk of a BERT-style layer (set on the instance, picklable as _BoundForward): with
    one tensor, the pair by ffn_ext while _pair_act allows; every other call, the class's feed_forward_chunk."""

    @property
    def __signature__(self):  # the class's: transformers' apply_chunking_to_forward counts its parameters
        return inspect.signature(type(self.__self__).feed_forward_chunk.__get__(self.__self__))

    def __call__(self, *args, **kwargs):
        layer = self.__self__
        if len(args) + len(kwargs) == 1 and _guards_hold(layer, self.guards):
            x = args[0] if args else kwargs.get(self.arg)
            if isinstance(x, torch.Tensor):
                entry = _pair_act(layer)
                if entry is not None:
                    return _pair_forward(layer, x, entry)
        return type(layer).feed_forward_chunk(layer, *args, **kwargs)


def _activation_child(module) -> bool:
    return any(
        _table_activation(m) is not None
        or type(m).__module__ in ("transformers.activations", "torch.nn.modules.activation")
        for m in module._modules.values()
    )


def _inline(module) -> bool:
    """Whether `module` is MLP-shaped (named with _INLINE when its code is not recognised): an activation child and
    linear-like children chaining d -> f -> d (fc1 and fc2 of Whisper's and BART's layers; T5's wi / wi_0, wi_1 and
    wo), whatever their names."""
    if not _activation_child(module):
        return False
    f = [v for v in (_features(m) for m in module._modules.values()) if v is not None]
    return any(a[0] == b[1] and a[1] == b[0] and a[1] > a[0] for a in f for b in f)  # FFNs widen, then narrow


_DISAGREES_CLASSIC = (
    "their forward gave a different result from ffn_ext's plain MLP on a random input (self-check), "
    "so it is not fc2(act(fc1(x))) and must run as it is"
)


def _chunk_of(layer, x):
    return type(layer).feed_forward_chunk(layer, x)
