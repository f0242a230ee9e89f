"""nn.Modules on top of the ffn_ext ops: activations, a standard FFN and memory-lean gated FFNs (SwiGLU, GeGLU).

    act = ffn_ext.SwiGLU();  h = act(gate, up)  or  act(gate_up)      # [..., 2M] -> [..., M]
    act = ffn_ext.GeGLU(approximate="tanh")                           # gelu_tanh(gate) * up (Gemma)
    mlp = ffn_ext.SwiGLUFFN(896, 4864)   # gate_proj / up_proj / down_proj: loads a Llama/Qwen2 MLP state_dict
    mlp = ffn_ext.GeGLUFFN(2048, 16384, approximate="tanh")          # the same names: loads a Gemma MLP state_dict
    mlp = ffn_ext.GatedFFN(512, 1536, activation="gelu")             # any activation of the table by name
    ffn = ffn_ext.FFN(768, 3072, activation="gelu")                  # any activation of the table by name
    ffn = ffn_ext.FFN(768, 3072, recompute=True)                     # saves only x for backward

The classic FFN's training memory: its autograd (ffn_ext.mlp: ``plain_mlp``) saves x and up_proj's output z and
recomputes act(z) in backward; eager PyTorch keeps z and act(z). The gated FFNs' training memory: their autograd
(ffn_ext.mlp: ``gated_mlp``) saves the input x and the two projections gate and up, and recomputes h =
act(gate) * up in backward (for the down projection's weight gradient) instead of keeping it. Eager PyTorch keeps
four [tokens, d_ff] tensors (gate, act(gate), up, h); this keeps two. Double backward is supported (see
ffn_ext/mlp.py).

An activation module says what it computes in one place (Act.activation, Gated.gating), and the FFN modules fuse
with exactly that (activation_of, gating_of), or run their submodules as they are.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import ops as _ops
from .mlp import (  # noqa: F401  (their home before ffn_ext.mlp: still importable here)
    check_options,
    check_saved_dtype,
    fusable,
    gated_mlp,
    gated_mlp_packed,
    linear_args,
    plain_mlp,
    swiglu_mlp,
    swiglu_mlp_packed,
)
from .ops import Gating
from .sizing import swiglu_hidden_dim
from .table import BY_NAME, LAYOUTS, activation_for, join_packed, split_packed

__all__ = [
    "Act",
    "GELU",
    "SiLU",
    "Gated",
    "SwiGLU",
    "GeGLU",
    "FFN",
    "GatedFFN",
    "SwiGLUFFN",
    "GeGLUFFN",
    "activation_of",
    "formula_of",
    "gating_of",
]


# ---------------------------------------------------------------- activation modules
def _gelu_entry(who: str, approximate):
    """The table entry of GELU with nn.GELU's `approximate`, or a ValueError."""
    return activation_for("gelu", who, approximate=approximate)


def _entry(who: str, activation):
    """The table entry named `activation`, or a ValueError naming the choices."""
    act = BY_NAME.get(activation) if isinstance(activation, str) else None
    if act is None:
        raise ValueError(f"ffn_ext.{who}: `activation` must be one of {sorted(BY_NAME)}, got {activation!r}")
    return act


class Act(nn.Module):
    """act(x) for an activation of the table by name (``Act("relu2")``); GELU and SiLU are this with torch's
    signatures. ``activation`` is the table name of what it computes, which FFN fuses with."""

    activation = "silu"

    def __init__(self, activation: str = "silu") -> None:
        super().__init__()
        self.activation = _entry(type(self).__name__, activation).name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ops.act(x, self.activation)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"


class GELU(Act):
    """GELU with nn.GELU's signature, on ffn_ext's kernels: approximate='none' (the default) is the exact (erf)
    GELU, approximate='tanh' the tanh form (ffn_ext.gelu(x, approximate)), so the module is a drop-in for
    nn.GELU(approximate=...)."""

    approximate = "none"  # class defaults: modules pickled before these arguments existed still load

    def __init__(self, approximate: str = "none") -> None:
        nn.Module.__init__(self)
        _gelu_entry("GELU", approximate)
        self.approximate = approximate

    @property
    def activation(self) -> str:  # type: ignore[override]  # (Act's attribute, derived from approximate here)
        return _gelu_entry("GELU", self.approximate).name

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class SiLU(Act):
    """SiLU / swish, x * sigmoid(x), with nn.SiLU's signature; uses ffn_ext.silu. inplace=True overwrites x as
    nn.SiLU(inplace=True) does, with ATen's silu_ (ffn_ext has no in-place kernel); inside an FFN, whose input to it
    is its own intermediate, it computes the same and fuses as SiLU()."""

    inplace = False

    def __init__(self, inplace: bool = False) -> None:
        nn.Module.__init__(self)
        self.inplace = inplace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(x, inplace=True) if self.inplace else _ops.silu(x)

    def extra_repr(self) -> str:
        return "inplace=True" if self.inplace else ""


_ACT_FORWARDS = (Act.forward, SiLU.forward)


def activation_of(module: nn.Module | None) -> str | None:
    """The table name of what `module` computes when it is one of ffn_ext's activation modules (Act, GELU, SiLU, or a
    subclass that keeps their forward), else None: then FFN runs its modules as they are."""
    return module.activation if isinstance(module, Act) and type(module).forward in _ACT_FORWARDS else None


class Gated(nn.Module):
    """act(gate) * up for an activation of the table by name ("silu", "gelu", "gelu_tanh", ...):
    ``Gated("gelu")(gate, up)``; with one argument it takes the packed tensor [..., 2M] and returns [..., M]:
    layout="concat" (gate first, then up, as ``chunk(2, -1)``) or "interleaved" ([g0, u0, g1, u1, ...], GPT-OSS).
    ``activation`` may also be a Gating (any gated op of the table with its parameters and layout). SwiGLU and
    GeGLU are this with their activation fixed.

    What it computes is its ``gating`` (ffn_ext.Gating), one attribute: forward runs it, and the FFN modules, the
    MLPs and FP8 conversion fuse with it (gating_of), so they compute exactly what the module does."""

    def __init__(self, activation: str | Gating = "silu", *, layout: str = "concat") -> None:
        super().__init__()
        who = type(self).__name__
        if isinstance(activation, Gating):
            self.gating = activation
        else:
            self.gating = Gating(_entry(who, activation).gated, layout=_check_layout(who, layout))

    def forward(self, gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
        return self.gating(gate, up)

    @property
    def activation(self) -> str:
        """The table name of the activation applied to the gate ("silu" for the clamped SwiGLU too)."""
        return self.gating.activation

    @property
    def layout(self) -> str:
        return self.gating.layout

    def __setstate__(self, state: dict) -> None:
        # modules pickled by ffn_ext 0.1.0 kept activation, layout and SwiGLU's limit, alpha, up_offset as attributes
        if "gating" not in state:
            old = {k: state.pop(k) for k in ("activation", "layout", "limit", "alpha", "up_offset") if k in state}
            layout, clamp = (
                old.get("layout", "concat"),
                {k: old[k] for k in ("limit", "alpha", "up_offset") if k in old},
            )
            if clamp.get("limit") is None and clamp.get("alpha", 1.0) == 1.0 and clamp.get("up_offset", 0.0) == 0.0:
                state["gating"] = Gating.of(old.get("activation", type(self).__dict__.get("_default", "silu")), layout)
            else:
                clamp["limit"] = math.inf if clamp.get("limit") is None else clamp["limit"]
                state["gating"] = Gating("swiglu_clamped", layout=layout, **clamp)
        super().__setstate__(state)

    def _layout_repr(self) -> str:
        return "" if self.layout == "concat" else f"layout={self.layout!r}"

    def extra_repr(self) -> str:
        g = self.gating
        if g.params:
            return repr(g)[len("Gating(") : -1]
        return ", ".join(filter(None, (f"activation={self.activation!r}", self._layout_repr())))


def _check_layout(who: str, layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"ffn_ext.{who}: `layout` must be one of {list(LAYOUTS)}, got {layout!r}")
    return layout


class SwiGLU(Gated):
    """silu(gate) * up. ``SwiGLU()(gate, up)``; with one argument it takes the packed tensor [..., 2M] in `layout`
    (as Gated) and returns [..., M].

    Clamped (GPT-OSS, DeepSeek-V4): with `limit` (> 0), or alpha / up_offset other than their defaults, it computes
    ffn_ext.swiglu_clamped: (clamp(up, -limit, limit) + up_offset) * g * sigmoid(alpha * g), g = clamp(gate,
    max=limit); GPT-OSS is ``SwiGLU(limit=7.0, alpha=1.702, up_offset=1.0, layout="interleaved")``. Without a limit
    nothing is clamped (limit=inf)."""

    _default = "silu"

    def __init__(
        self, *, limit: float | None = None, alpha: float = 1.0, up_offset: float = 0.0, layout: str = "concat"
    ) -> None:
        layout = _check_layout("SwiGLU", layout)
        if limit is None and alpha == 1.0 and up_offset == 0.0:
            super().__init__("silu", layout=layout)
            return
        lim = math.inf if limit is None else limit
        super().__init__(_clamped("SwiGLU", layout, limit=lim, alpha=alpha, up_offset=up_offset))

    @property
    def clamped(self) -> bool:
        return self.gating.op == "swiglu_clamped"

    def _param(self, name: str, default):
        return self.gating.kwargs.get(name, default)

    @property
    def limit(self) -> float | None:
        lim = self._param("limit", None)
        return None if lim == math.inf else lim

    @property
    def alpha(self) -> float:
        return self._param("alpha", 1.0)

    @property
    def up_offset(self) -> float:
        return self._param("up_offset", 0.0)

    def extra_repr(self) -> str:
        parts = [f"limit={self.limit}"] if self.limit is not None else []
        parts += [f"alpha={self.alpha}"] if self.alpha != 1.0 else []
        parts += [f"up_offset={self.up_offset}"] if self.up_offset != 0.0 else []
        return ", ".join(parts + ([self._layout_repr()] if self.layout != "concat" else []))


def _clamped(who: str, layout: str, **params) -> Gating:
    """The clamped SwiGLU's Gating, its parameter errors named for `who`."""
    try:
        return Gating("swiglu_clamped", layout=layout, **params)
    except ValueError as e:
        raise ValueError(str(e).replace("ffn_ext.Gating(swiglu_clamped)", f"ffn_ext.{who}")) from None


class GeGLU(Gated):
    """gelu(gate, approximate) * up, approximate as nn.GELU's: "none" (exact, erf) or "tanh" (Gemma's
    gelu_pytorch_tanh). ``GeGLU()(gate, up)`` or packed ``GeGLU()(gate_up)``, as SwiGLU."""

    _default = "gelu"

    def __init__(self, approximate: str = "none", *, layout: str = "concat") -> None:
        super().__init__(_gelu_entry("GeGLU", approximate).name, layout=layout)

    @property
    def approximate(self) -> str:
        return BY_NAME[self.activation].api[1]["approximate"]

    def extra_repr(self) -> str:
        return ", ".join(filter(None, (f"approximate={self.approximate!r}", self._layout_repr())))


def gating_of(module: nn.Module | None) -> Gating | None:
    """The Gating `module` computes when it is one of ffn_ext's gated activation modules (Gated, SwiGLU, GeGLU, or a
    subclass that keeps their forward), else None: then the FFN runs its modules as they are."""
    return module.gating if isinstance(module, Gated) and type(module).forward is Gated.forward else None


def _gated_module(g: Gating) -> Gated:
    """The module of Gating g: SwiGLU (plain or clamped), GeGLU(approximate), or Gated."""
    act = BY_NAME[g.activation]
    cls = SwiGLU if act.api[0] == "silu" else GeGLU if act.api[0] == "gelu" else Gated
    module = cls.__new__(cls)
    Gated.__init__(module, g)
    return module


def _unary_module(act) -> nn.Module:
    """The module of table entry `act`: GELU(approximate), SiLU() or Act(name)."""
    if act.api[0] == "gelu":
        return GELU(**act.api[1])
    if act.api[0] == "silu":
        return SiLU(**act.api[1])
    return Act(act.name)


# ---------------------------------------------------------------- FFN modules
class FFN(nn.Module):
    """Standard (classic) transformer FFN: down_proj(act(up_proj(x))), d_model -> d_ff -> d_model, on the lean
    autograd of ffn_ext.plain_mlp.

    activation: an activation of the table by name ("gelu": exact erf GELU, "gelu_tanh": tanh GELU, "silu", "relu",
    ...; case-insensitive). Training keeps one [tokens, d_ff] tensor
    (up_proj's output; eager PyTorch keeps two: it and act's output) and recomputes the activation in backward.
    recompute=True keeps none (only x), token_chunk=N bounds every tensor inside by N x d_ff elements, forward and
    backward, and saved_dtype (torch.float8_e4m3fn or torch.bfloat16) is the dtype it is kept in; all three are
    attributes, settable at any time. Hooks on the submodules, a projection that is not a plain
    nn.Linear or an `act` replaced by a module that is not one of ffn_ext's activation modules (Act, GELU, SiLU:
    activation_of) make it run its submodules, as GatedFFN."""

    recompute, token_chunk, saved_dtype = False, None, None  # class defaults: older pickles load

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        activation: str = "gelu",
        bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        recompute: bool = False,
        token_chunk: int | None = None,
        saved_dtype: torch.dtype | None = None,
    ):
        super().__init__()
        key = activation.lower() if isinstance(activation, str) else activation
        if key not in BY_NAME:
            raise ValueError(
                f"ffn_ext.FFN: unknown activation {activation!r}; expected one of {sorted(BY_NAME)} (for a gated FFN "
                "use ffn_ext.GatedFFN, SwiGLUFFN or GeGLUFFN)"
            )
        check_options("FFN", recompute, token_chunk)
        check_saved_dtype("FFN", saved_dtype, d_ff, recompute, token_chunk)
        self.recompute, self.token_chunk, self.saved_dtype = recompute, token_chunk, saved_dtype
        self.up_proj = nn.Linear(d_model, d_ff, bias=bias, device=device, dtype=dtype)
        self.act = _unary_module(BY_NAME[key])
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias, device=device, dtype=dtype)

    @property
    def activation(self) -> str | None:
        """The table name of what `act` computes (None when `act` is not one of ffn_ext's activation modules)."""
        return activation_of(self._modules["act"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mods: dict[str, Any] = self._modules  # read directly (hot path); fusable and the type checks vet them
        u, act, d = mods["up_proj"], mods["act"], mods["down_proj"]
        name = activation_of(act)
        if name is not None and fusable((u, d), (act,)):
            w1, w2, b1, b2 = linear_args(u, d)
            return plain_mlp(
                x,
                w1,
                w2,
                b1,
                b2,
                name,
                recompute=self.recompute,
                token_chunk=self.token_chunk,
                saved_dtype=self.saved_dtype,
            )
        return d(act(u(x)))

    def extra_repr(self) -> str:
        opts = (
            "recompute=True" if self.recompute else "",
            "" if self.token_chunk is None else f"token_chunk={self.token_chunk}",
            "" if self.saved_dtype is None else f"saved_dtype={self.saved_dtype}",
        )
        return f"activation={self.activation!r}" + "".join(", " + o for o in opts if o)


_PROJ = ("gate_proj", "up_proj")  # the Llama names of the separate projections; fused: gate_up_proj


def _packed_layout(module) -> str:
    """The layout of a fused_gate_up module's gate_up_proj rows: its activation's (concat when that is not one of
    ffn_ext's gated modules)."""
    g = gating_of(module._modules["act"])
    return "concat" if g is None else g.layout


def _fuse_state(module, state_dict, prefix, *args):
    """Load pre-hook of a fused_gate_up module: a checkpoint's gate_proj / up_proj tensors become gate_up_proj's (its
    rows in the activation's layout)."""
    for kind in ("weight", "bias"):
        g, u = (prefix + p + "." + kind for p in _PROJ)
        if g in state_dict and u in state_dict:
            gu = join_packed(state_dict.pop(g).movedim(0, -1), state_dict.pop(u).movedim(0, -1), _packed_layout(module))
            state_dict[prefix + "gate_up_proj." + kind] = gu.movedim(-1, 0).contiguous()


def _split_state(module, state_dict, prefix, *args):
    """Load pre-hook of a module with separate projections: a checkpoint's packed gate_up_proj, its rows in the
    activation's layout (gate rows first for concat: Phi-3's; GPT-OSS's interleaved), becomes gate_proj / up_proj."""
    for kind in ("weight", "bias"):
        key = prefix + "gate_up_proj." + kind
        if key in state_dict:
            g, u = split_packed(state_dict.pop(key).movedim(0, -1), _packed_layout(module))
            state_dict[prefix + "gate_proj." + kind] = g.movedim(-1, 0).contiguous()
            state_dict[prefix + "up_proj." + kind] = u.movedim(-1, 0).contiguous()


def _save_split(module, state_dict, prefix, local_metadata):
    """state_dict hook of a fused_gate_up module: saves gate_proj / up_proj (Hugging Face's Llama names), its rows
    split by the activation's layout, as contiguous tensors of their own (safetensors refuses shared memory)."""
    for kind in ("weight", "bias"):
        key = prefix + "gate_up_proj." + kind
        if key in state_dict:
            g, u = split_packed(state_dict.pop(key).movedim(0, -1), _packed_layout(module))
            state_dict[prefix + "gate_proj." + kind] = g.movedim(-1, 0).contiguous()
            state_dict[prefix + "up_proj." + kind] = u.movedim(-1, 0).contiguous()


class GatedFFN(nn.Module):
    """Gated FFN: down_proj(act(gate_proj(x)) * up_proj(x)) for an activation of the table by name, with the
    Llama/Gemma submodule names (gate_proj, up_proj, down_proj: nn.Linear; act: the gated activation module), so a
    Hugging Face MLP's state_dict loads unchanged.

    fused_gate_up=True: one projection gate_up_proj (nn.Linear to 2*d_ff, gate rows first) instead of gate_proj and
    up_proj: one GEMM for both in forward, and in backward one GEMM for dx (K = 2*d_ff) and one for the weight
    gradient (ffn_ext.mlp.gated_mlp_packed). Its state_dict still saves and loads gate_proj.* / up_proj.* (hooks), so
    Hugging Face checkpoints load either way; a module with separate projections also loads a packed gate_up_proj
    checkpoint. Code that reads mlp.gate_proj (LoRA target names, ...) needs the default.

    Training keeps two [tokens, d_ff] tensors (gate, up) instead of eager PyTorch's four; h is recomputed in
    backward (ffn_ext.mlp.gated_mlp). recompute=True keeps none (only x; backward recomputes the projections) and
    token_chunk=N runs forward and backward over chunks of N tokens (long sequences: no tensor inside the MLP larger
    than N x 2*d_ff elements); saved_dtype=torch.float8_e4m3fn keeps gate and up in FP8 with a scale per 1 x 128
    group (half of their bf16 bytes; torch.bfloat16: half of fp32's), the output unchanged and the gradients
    within a few percent; all three are attributes, settable at any time (ffn_ext.mlp's docs give the trade).

    `activation` may also be a Gating (ffn_ext.Gating: any gated op of the table with its parameters, e.g. the
    clamped SwiGLU, and the layout of gate_up_proj's rows with fused_gate_up). The fused forward computes the Gating
    of `act` (gating_of), whatever `act` is set to later: an `act` replaced by another of ffn_ext's gated modules
    (SwiGLU(limit=...), GeGLU("tanh"), ...) is fused with what that module computes.

    When hooks (forward or backward) are registered on the projections or on `act` (or globally), one of them has a
    forward wrapper set on the instance (accelerate's hooks, CPU/disk offload), a projection is not a plain
    nn.Linear (LoRA, quantized layers) or `act` is not one of ffn_ext's gated modules (gating_of is None), the
    submodules run as modules, so the hooks and wrappers run and the replacement is what runs; recompute,
    token_chunk and saved_dtype do not apply then. torch.jit.trace records the plain ops.
    """

    fused_gate_up, recompute, token_chunk, saved_dtype = False, False, None, None  # class defaults: older pickles load

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        activation: str | Gating = "silu",
        bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        fused_gate_up: bool = False,
        recompute: bool = False,
        token_chunk: int | None = None,
        saved_dtype: torch.dtype | None = None,
    ):
        super().__init__()
        who = type(self).__name__
        g = activation if isinstance(activation, Gating) else Gating(_entry(who, activation).gated)
        if not isinstance(fused_gate_up, bool):
            raise ValueError(f"ffn_ext.{who}: `fused_gate_up` must be True or False, got {fused_gate_up!r}")
        check_options(who, recompute, token_chunk)
        check_saved_dtype(who, saved_dtype, d_ff, recompute, token_chunk)
        self.d_model, self.d_ff = d_model, d_ff
        self.fused_gate_up, self.recompute, self.token_chunk = fused_gate_up, recompute, token_chunk
        self.saved_dtype = saved_dtype
        if fused_gate_up:
            self.gate_up_proj = nn.Linear(d_model, 2 * d_ff, bias=bias, device=device, dtype=dtype)
            self.register_state_dict_post_hook(_save_split)
            self.register_load_state_dict_pre_hook(_fuse_state)
        else:
            self.gate_proj = nn.Linear(d_model, d_ff, bias=bias, device=device, dtype=dtype)
            self.up_proj = nn.Linear(d_model, d_ff, bias=bias, device=device, dtype=dtype)
            self.register_load_state_dict_pre_hook(_split_state)
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias, device=device, dtype=dtype)
        self.act = _gated_module(g)

    @property
    def activation(self) -> str | None:
        """The table name of the activation `act` applies to the gate (None when `act` is not one of ffn_ext's)."""
        g = gating_of(self._modules["act"])
        return None if g is None else g.activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mods: dict[str, Any] = self._modules  # read directly (hot path); fusable and gating_of vet them
        d, act = mods["down_proj"], mods["act"]
        g = gating_of(act)
        if "gate_up_proj" in mods:
            gu = mods["gate_up_proj"]
            if g is not None and fusable((gu, d), (act,)):
                w, wd, b, bd = linear_args(gu, d)
                return gated_mlp_packed(
                    x,
                    w,
                    wd,
                    b,
                    bd,
                    activation=g,
                    recompute=self.recompute,
                    token_chunk=self.token_chunk,
                    saved_dtype=self.saved_dtype,
                )
            return d(act(gu(x)))
        gp, up = mods["gate_proj"], mods["up_proj"]
        if g is not None and fusable((gp, up, d), (act,)):
            return gated_mlp(
                x,
                *linear_args(gp, up, d),
                activation=g,
                recompute=self.recompute,
                token_chunk=self.token_chunk,
                saved_dtype=self.saved_dtype,
            )
        return d(act(gp(x), up(x)))

    def _options_repr(self) -> str:
        opts = (
            "fused_gate_up=True" if self.fused_gate_up else "",
            "recompute=True" if self.recompute else "",
            "" if self.token_chunk is None else f"token_chunk={self.token_chunk}",
            "" if self.saved_dtype is None else f"saved_dtype={self.saved_dtype}",
        )
        return "".join(", " + o for o in opts if o)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, d_ff={self.d_ff}, activation={self.activation!r}" + self._options_repr()


# why a conversion leaves an FFN module as it is (formula_of): it would drop what the module runs besides the formula
OWN_FORWARD = "its class overrides forward: what it computes is its own code, which a conversion cannot carry over"
WRAPPED = "hooks, or a forward set on the instance, run on it or its submodules, and a conversion would drop them"
NOT_FFN_EXT = "its projections are not plain nn.Linear or its activation is not one of ffn_ext's"


def formula_of(module: nn.Module) -> tuple[Any, str | None]:
    """What an FFN or GatedFFN (or subclass) computes by its class's formula, when that is all it computes: (its
    Gating (GatedFFN) or activation name (FFN), None); else (None, why not: OWN_FORWARD, WRAPPED, NOT_FFN_EXT); and
    (None, None) for any other module. Conversions (quantize_fp8, ffn_ext's converters) convert only the first."""
    base = GatedFFN if isinstance(module, GatedFFN) else FFN if isinstance(module, FFN) else None
    if base is None:
        return None, None
    if type(module).forward is not base.forward or type(module).__call__ is not nn.Module.__call__:
        return None, OWN_FORWARD
    mods: dict[str, Any] = module._modules
    form = gating_of(mods["act"]) if base is GatedFFN else activation_of(mods["act"])
    if form is None or any(type(m) is not nn.Linear for k, m in mods.items() if k != "act"):
        return None, NOT_FFN_EXT
    if not fusable((), (module, *mods.values())):
        return None, WRAPPED
    return form, None


class SwiGLUFFN(GatedFFN):
    """SwiGLU FFN: down_proj(silu(gate_proj(x)) * up_proj(x)) (GatedFFN with activation="silu"), with the
    Llama/Qwen2 submodule names, so a Hugging Face MLP's state_dict loads unchanged.

    Clamped (DeepSeek-V4's shared expert, a GPT-OSS-style dense MLP): `limit`, `alpha`, `up_offset` as SwiGLU's
    (its act is ``SwiGLU(limit=, alpha=, up_offset=, layout=)``); `layout` is that of gate_up_proj's rows with
    fused_gate_up ("interleaved": GPT-OSS's [g0, u0, g1, u1, ...]). d_ff=None: the 8/3 rule rounded up to
    `multiple_of` (swiglu_hidden_dim). fused_gate_up, recompute, token_chunk, saved_dtype, training memory, hooks, wrappers and
    replaced submodules: as GatedFFN.
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int | None = None,
        bias: bool = False,
        multiple_of: int = 256,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        fused_gate_up: bool = False,
        recompute: bool = False,
        token_chunk: int | None = None,
        saved_dtype: torch.dtype | None = None,
        limit: float | None = None,
        alpha: float = 1.0,
        up_offset: float = 0.0,
        layout: str = "concat",
    ):
        d_ff = swiglu_hidden_dim(d_model, multiple_of) if d_ff is None else d_ff
        super().__init__(
            d_model,
            d_ff,
            SwiGLU(limit=limit, alpha=alpha, up_offset=up_offset, layout=layout).gating,
            bias=bias,
            device=device,
            dtype=dtype,
            fused_gate_up=fused_gate_up,
            recompute=recompute,
            token_chunk=token_chunk,
            saved_dtype=saved_dtype,
        )

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, d_ff={self.d_ff}" + self._options_repr()


class GeGLUFFN(GatedFFN):
    """GeGLU FFN: down_proj(gelu(gate_proj(x), approximate) * up_proj(x)) (GatedFFN with activation "gelu" or
    "gelu_tanh"), approximate as nn.GELU's: "none" (exact, erf) or "tanh" (Gemma: its MLP's state_dict loads
    unchanged). fused_gate_up, recompute, token_chunk, saved_dtype, training memory, hooks, wrappers and replaced submodules: as
    GatedFFN."""

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        approximate: str = "none",
        bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        fused_gate_up: bool = False,
        recompute: bool = False,
        token_chunk: int | None = None,
        saved_dtype: torch.dtype | None = None,
    ):
        act = _gelu_entry("GeGLUFFN", approximate)
        super().__init__(
            d_model,
            d_ff,
            act.name,
            bias=bias,
            device=device,
            dtype=dtype,
            fused_gate_up=fused_gate_up,
            recompute=recompute,
            token_chunk=token_chunk,
            saved_dtype=saved_dtype,
        )

    @property
    def approximate(self) -> str | None:
        """GELU's `approximate` of the activation `act` computes (None when it is not a GELU of ffn_ext's)."""
        act = BY_NAME.get(self.activation or "")  # "": no entry, as for None
        return None if act is None else act.api[1].get("approximate")

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, d_ff={self.d_ff}, approximate={self.approximate!r}" + self._options_repr()
