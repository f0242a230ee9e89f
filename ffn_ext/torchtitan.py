"""ffn_ext in torchtitan: a model converter, torchtitan's own kind (0.3: a ModelConfigConverter, which rewrites the
model's config tree before the model is built; the same kind as its Float8 and LoRA converters).

    from torchtitan.models.llama3 import model_registry
    from ffn_ext.torchtitan import FFNExtConverter

    spec = model_registry("debugmodel", converters=[FFNExtConverter.Config()])   # or recompute=True, token_chunk=N
    model = spec.model.build()

What it swaps (each swapped module keeps its parameters' names, shapes and init, so checkpoints load unchanged):
- FeedForward, the SwiGLU w2(silu(w1(x)) * w3(x)) of every model and of MoE shared experts, by FFNExtFeedForward:
  ffn_ext.swiglu_mlp, the lean autograd (backward keeps x, gate and up; recompute / token_chunk as configured), when
  its projections run as plain linears (plain tensor weights - FSDP2's unsharded parameters are - and no hooks);
  else (tensor parallel's hooks and DTensor weights, a Float8 or LoRA linear) the projections run as modules
  around ffn_ext.swiglu, and recompute / token_chunk do not apply.
- GroupedExperts, the routed experts' grouped GEMMs (w1_EFD gate, w3_EFD up, w2_EDF down), by FFNExtGroupedExperts:
  torchtitan's GEMMs (its _grouped_mm, so a low-precision converter applied after this one still reaches them), the
  gating silu(gate) * up as ffn_ext.swiglu (backward keeps gate and up, not silu(gate) as well).
Subclasses of either compute other forms or run their own collectives (SigmoidGatedFeedForward, the async-TP
AllGatherFusedFeedForward, GPT-OSS's clamped experts): they are left as they are and named in one RuntimeWarning.

torchtitan is imported when one of this module's names is first used, never by `import ffn_ext`."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch
import torch.nn as nn

from .mlp import check_options, fusable, swiglu_mlp
from .ops import swiglu

# the classes subclass torchtitan's, so they are made on first use (module __getattr__), not at import
__all__ = ["FFNExtConverter", "FFNExtFeedForward", "FFNExtGroupedExperts"]  # noqa: F822

_classes: dict[str, Any] = {}


def __getattr__(name: str) -> Any:
    """The classes, built on first use: they subclass torchtitan's, which this module does not import before."""
    if name in __all__:
        if not _classes:
            try:
                _classes.update(_build())
            except ImportError as e:
                raise ImportError(
                    f"ffn_ext.torchtitan.{name} needs torchtitan 0.3 or later (its ModelConfigConverter): {e}"
                ) from e
        return _classes[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _plain_linear(lin) -> bool:
    """Whether `lin` computes F.linear(x, lin.weight, lin.bias) and nothing else: nn.Linear's forward (torchtitan's
    Linear inherits it), plain tensor weights (not DTensors, not Float8 or other subclasses)."""
    return (
        isinstance(lin, nn.Linear)
        and type(lin).forward is nn.Linear.forward
        and type(lin.weight) in (nn.Parameter, torch.Tensor)
        and (lin.bias is None or type(lin.bias) in (nn.Parameter, torch.Tensor))
    )


def _swap(model_config, base_config: type, new_config: type, extra: dict, named: dict) -> Any:
    """Replaces every config of exactly `base_config` in the tree by `new_config` with the same fields (and
    `extra`); names the subclasses' configs (not swapped) in `named`. Returns the (possibly new) root."""
    for fqn, cfg, parent, attr in list(model_config.traverse(base_config)):
        if type(cfg) is new_config:
            if extra:  # converted before: only the options are new
                for k, v in extra.items():
                    setattr(cfg, k, v)
            continue
        if type(cfg) is not base_config:
            named.setdefault(type(cfg).__qualname__.rsplit(".", 1)[0], []).append(fqn or "model")
            continue
        old: Any = cfg  # a dataclass (torchtitan's configs are), whatever the narrowing above made of it
        fields = {f.name: getattr(old, f.name) for f in dataclasses.fields(old) if f.init}
        new = new_config(**fields, **extra)
        if parent is None:
            model_config = new
        elif isinstance(parent, list):
            parent[attr] = new
        else:
            setattr(parent, attr, new)
    return model_config


def _build() -> dict:
    from dataclasses import dataclass

    from torchtitan.models.common.feed_forward import FeedForward
    from torchtitan.models.common.moe import GroupedExperts
    from torchtitan.protocols.model import ModelConfigConverter

    class FFNExtFeedForward(FeedForward):
        """torchtitan's FeedForward (w2(silu(w1(x)) * w3(x))) on ffn_ext's lean SwiGLU MLP."""

        @dataclass(kw_only=True, slots=True)
        class Config(FeedForward.Config):
            recompute: bool = False
            token_chunk: int | None = None

        def __init__(self, config):
            super().__init__(config)
            self.recompute, self.token_chunk = check_options("FFNExtFeedForward", config.recompute, config.token_chunk)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            w1, w2, w3 = self.w1, self.w2, self.w3
            if _plain_linear(w1) and _plain_linear(w2) and _plain_linear(w3) and fusable((), (w1, w2, w3)):
                return swiglu_mlp(
                    x,
                    w1.weight,
                    w3.weight,
                    w2.weight,
                    w1.bias,
                    w3.bias,
                    w2.bias,
                    recompute=self.recompute,
                    token_chunk=self.token_chunk,
                )
            return w2(swiglu(w1(x), w3(x)))

    class FFNExtGroupedExperts(GroupedExperts):
        """torchtitan's GroupedExperts with ffn_ext's gating between its grouped GEMMs."""

        @dataclass(kw_only=True, slots=True)
        class Config(GroupedExperts.Config):
            pass

        def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
            import spmd_types
            from torchtitan.distributed.utils import get_spmd_backend

            if get_spmd_backend() == "spmd_types" and spmd_types.is_type_checking():
                return super().forward(
                    x_RD, num_tokens_per_expert_E
                )  # its type checks: torchtitan's forward knows them
            # the weights' local shards (expert or tensor parallel: the tokens were dispatched to match), in bf16
            # as torchtitan's experts compute
            w1, w2, w3 = (
                w.to_local() if hasattr(w, "to_local") else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD)
            )
            offsets = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
            x = x_RD.bfloat16()
            gate = self._grouped_mm(A=x, B_t=w1.bfloat16().transpose(-2, -1), offs=offsets)
            up = self._grouped_mm(A=x, B_t=w3.bfloat16().transpose(-2, -1), offs=offsets)
            h = swiglu(gate, up)
            return self._grouped_mm(A=h, B_t=w2.bfloat16().transpose(-2, -1), offs=offsets).type_as(x_RD)

    class FFNExtConverter(ModelConfigConverter):
        """Swaps the FeedForward and GroupedExperts configs of a torchtitan model for ffn_ext's (module docstring).
        Config: recompute, token_chunk (FeedForward's memory options); feed_forward, grouped_experts: which to
        swap."""

        @dataclass(kw_only=True, slots=True)
        class Config(ModelConfigConverter.Config):
            recompute: bool = False
            token_chunk: int | None = None
            feed_forward: bool = True
            grouped_experts: bool = True

        def __init__(self, config):
            check_options("FFNExtConverter", config.recompute, config.token_chunk)
            self.config = config

        def convert(self, model_config):
            c = self.config
            named: dict[str, list[str]] = {}
            if c.feed_forward:
                opts = dict(recompute=c.recompute, token_chunk=c.token_chunk)
                model_config = _swap(model_config, FeedForward.Config, FFNExtFeedForward.Config, opts, named)
            if c.grouped_experts:
                model_config = _swap(model_config, GroupedExperts.Config, FFNExtGroupedExperts.Config, {}, named)
            if named:
                where = "; ".join(f"{cls} at {', '.join(fqns)}" for cls, fqns in named.items())
                warnings.warn(
                    f"ffn_ext.torchtitan.FFNExtConverter: left as they are (subclasses computing another form or "
                    f"running their own collectives): {where}",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return model_config

    for cls in (FFNExtFeedForward, FFNExtGroupedExperts, FFNExtConverter):  # pickled and printed by these names
        cls.__qualname__ = cls.__name__
        cls.Config.__qualname__ = f"{cls.__name__}.Config"
    return {c.__name__: c for c in (FFNExtConverter, FFNExtFeedForward, FFNExtGroupedExperts)}
