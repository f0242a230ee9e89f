"""The forms ffn_ext patches, one class each, in one registry (FORMS) that patch_model walks: each recognises a
module's code (recognise.py) as a Plan or names it, says what keeps a recognised module from running on ffn_ext, and
gives the gating it runs now, its fused forward and its FP8 module for quantize_fp8 (or why none). A new form is a
class here, added to FORMS."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import _compat
from .. import fp8 as _fp8
from .. import ops as _ops
from ..mlp import fusable, gated_mlp, gated_mlp_packed, linear_args, plain_mlp
from ..modules import FFN, GatedFFN
from .common import (
    AGREE,
    DISAGREE,
    UNKNOWN,
    GateSpec,
    Gating,
    features,
    guards_hold,
    linear_layout,
    resolve,
    self_check,
    table_activation,
    zero3_gathered,
    zero3_hooked,
)
from .recognise import (
    Call,
    Dropout,
    Gated,
    Half,
    In,
    Named,
    Read,
    _act_of,
    _add,
    calls,
    evaluate,
    gating,
    halves,
    numbers_in,
    proj,
)

RAISE_ERRORS = False  # tests set it: an error while planning a module raises, instead of naming the module
MARK = "_ffn_ext_patched"  # the instance attribute holding a patched module's Patched
OPTS = "_ffn_ext_mlp_options"  # the one holding patch_model's (recompute, token_chunk, saved_dtype) for it
# DeepSpeed's ZeRO-3 leaf flag (deepspeed.utils.set_z3_leaf_module sets it so): deepspeed.initialize then hooks the
# patched module alone and gathers all its weights at its forward, instead of hooking each submodule, under which
# hooks the fused forward cannot run; nothing else reads it
ZERO3_LEAF = "_z3_leaf"
DEFAULT_OPTS = (False, None, None)
X = In(0)

# why a module was left unpatched (the keys of patch_model's warning)
UNKNOWN_MLP = (
    "MLP-shaped modules not known to compute a form of ffn_ext's: their forward is not recognised (extra "
    "multipliers, clamps, norms, dropout, casts or adapters: see docs/hf.md); if a class computes exactly "
    "down_proj(act_fn(gate_proj(x)) * up_proj(x)), pass it in extra_classes=[...] (it must then pass the self-check)"
)
INLINE = (
    "modules holding an FFN's projections (d -> f, f -> d) and an activation whose forward ffn_ext does not "
    "recognise as a form it computes: an FFN inline in a layer's forward (Whisper's and BART's encoder and decoder "
    "layers, with a dropout between the activation and fc2 that ffn_ext's fused MLP lacks, and the attention in "
    "the same forward), or an MLP with something between or around the projections (T5's dropout and dtype cast "
    "before wo) (they run as they are, unaccelerated)"
)
UNKNOWN_PAIR = (
    "layers with a BERT-style *Intermediate / *Output pair whose feed_forward_chunk is not known to be "
    "exactly output(intermediate(x), x) (they run as they are, unaccelerated)"
)
UNKNOWN_EXPERTS = (
    "MoE experts modules whose _apply_gate ffn_ext does not recognise as a gating it computes (their routed experts "
    "run as they are, unaccelerated)"
)
INLINE_EXPERTS = (
    "MoE experts modules whose forward, as it runs now, computes the gating inside its own experts loop and never "
    "calls _apply_gate, where ffn_ext plugs in: those without one (Llama 4, DBRX, JetMoE, ...) and, under "
    'experts_implementation="eager", those whose loop inlines act_fn(gate) * up (Mixtral, Qwen-MoE, DeepSeek-V3, '
    '...: patched under "grouped_mm" or "batched_mm", or run on "ffn_ext"); ffn_ext does not copy transformers\' '
    "loops (they run as they are, unaccelerated)"
)
DROPOUT_BETWEEN = (
    "packed gated MLPs with a dropout between the gating and the projection back (ModernBERT): ffn_ext's fused MLP "
    "has no dropout there"
)
DISAGREES = (
    "their forward gave a different result from the fused gated MLP on a random input (self-check), so "
    "it is not a plain gated MLP and must run as it is"
)
DISAGREES_CLASSIC = (
    "their forward gave a different result from ffn_ext's plain MLP on a random input (self-check), "
    "so it is not fc2(act(fc1(x))) and must run as it is"
)
DISAGREES_GATE = (
    "their gating gave a different result from ffn_ext's op on random inputs at some scale (self-check), so it "
    "must run as it is"
)
NOT_PROVEN = (
    "modules listed in extra_classes whose forward ffn_ext does not recognise and whose self-check could not run "
    "(weights on meta or not plain, hooks) or gave no finite result: nothing shows they compute the form"
)
OWN_FORWARD = (
    "subclasses of ffn_ext's FFN modules that override forward: they run their own forward (ffn_ext's fused one "
    "where it calls super().forward), which patch_model does not replace"
)
CHECK_RAISED = (
    "their own code raised an error on the self-check's input (random rows of their width, and those rows as one "
    "sequence), so nothing shows they compute the form"
)
ZERO3_LATE = (
    "modules whose submodules DeepSpeed ZeRO-3 has already hooked (deepspeed.initialize, or the HF Trainer's "
    "train(), ran before patch_hf_model), so ffn_ext's fused forward could not run: call ffn_ext.patch_hf_model("
    "model) before deepspeed.initialize / trainer.train(); it marks each patched MLP a ZeRO-3 leaf module "
    "(docs/distributed.md)"
)
FAILED = "modules on whose code ffn_ext's recogniser failed (a bug in ffn_ext: please report it with this message)"

# why quantize_fp8 leaves a patched MLP as it is (Form.fp8)
FP8_WRAPPED = (
    "it carries hooks or a forward wrapper (accelerate's), or global module hooks are set: the FP8 module would not "
    "run them"
)
FP8_OWN_CODE = (
    "it runs its own code now: its activation is no longer one ffn_ext computes or carries hooks, or an attribute "
    "its code's `if` tests read has changed (since patching)"
)
FP8_PROJECTIONS = "its projections are not plain nn.Linear (or GPT-2's Conv1D) modules without hooks"


@dataclass(frozen=True)
class Plan:
    """What a form patches on a module: its projections' attribute names in the form's roles (`names`), its gating
    (`gate`: attribute names, read at each call), the (attribute, value) `guards` its code's `if` tests read, a
    dropout after the classic FFN (`drop`: its module's name, or "p:<attribute>" for F.dropout), and whether its
    code `proven` the form (False: planned by its shape for extra_classes, patched only where its self-check
    agrees)."""

    names: tuple[str, ...] = ()
    gate: GateSpec = GateSpec()
    guards: tuple = ()
    drop: str = ""
    proven: bool = True


class Form:
    """A form ffn_ext computes. `name`: how patch_model and quantize_fp8 know it; `method`: the code it reads and the
    instance attribute its patch replaces; `disagrees`: why a module whose self-check disagrees is named."""

    name = ""
    method = "forward"
    disagrees = DISAGREES
    not_fp8 = "patched as a form quantize_fp8 does not convert"

    def recognise(self, module, read) -> Plan | Named | None:
        """The plan, or Named, when the module's code is of this form: read from its code (read(method, n_inputs))
        and its instance attributes only, so that an uninitialised instance is read too."""
        return None

    def fits(self, module, plan: Plan) -> bool:  # whether its parts fit the recognised plan
        return True

    def unrecognised(self, module, vouched: bool) -> Plan | Named | None:
        """For a module no form recognised: Named when it is shaped like this form, or, vouched for in
        extra_classes, a plan by its shape (proven=False)."""
        return None

    def problem(self, module, plan: Plan) -> str | None:  # why the recognised module cannot run on ffn_ext
        g = resolve(module, plan.gate, why=True)
        return g if isinstance(g, str) else None

    def gating(self, module, plan: Plan) -> Gating | None:  # the gating it runs now; None: its own code runs
        g = resolve(module, plan.gate)
        return g if isinstance(g, Gating) else None

    def options(self, module, plan: Plan) -> bool:  # whether recompute / token_chunk reach its fused forward
        return True

    def unused(self, module) -> str | None:  # why its patch would not run now (never called by what runs)
        return None

    def first(self, module, plan: Plan):  # the projection whose output the self-check scales; None: the input
        return module._modules[plan.names[0]]

    def run(self, module, plan: Plan, x: torch.Tensor, g: Gating) -> torch.Tensor:  # the fused forward
        raise NotImplementedError

    def fp8(self, module, plan: Plan, recipe: str) -> tuple[nn.Module | None, str | None]:
        """(the FP8 module of ffn_ext.fp8 computing what the patched module runs now, None), or (None, why
        quantize_fp8 leaves it as it is)."""
        return None, self.not_fp8


def _fp8_parts(module, form: Form, plan: Plan) -> tuple[list, Gating, str | None] | str:
    """The projections, gating and linear_layout an FP8 module of the patched `module` would compute with, or why it
    would not compute what the module runs now: it replaces the module, so hooks on it or global ones, and a forward
    wrapper on the instance (before patching: Patched.prev; after: accelerate's), would be dropped; and it computes
    the form, where Patched runs the module's own code (activation hooked or replaced, guards no longer hold)."""
    d = module.__dict__
    wrapped = d.get(form.method) is not d[MARK] or d[MARK].prev is not None or "_hf_hook" in d
    if wrapped or _compat.module_hooks(module) or _compat.global_module_hooks():
        return FP8_WRAPPED
    g = form.gating(module, plan)
    if g is None or not guards_hold(module, plan.guards):
        return FP8_OWN_CODE
    projs = [module._modules[n] for n in plan.names]
    return projs, g, linear_layout(*projs)


def _options(module) -> dict:
    """ffn_ext.mlp's recompute, token_chunk and saved_dtype for a patched module, as patch_model set them."""
    return dict(zip(("recompute", "token_chunk", "saved_dtype"), module.__dict__.get(OPTS, DEFAULT_OPTS)))


def saved_dtype_of(module):
    """The saved_dtype patch_model set on `module` (the experts implementation "ffn_ext" reads it), or None."""
    return module.__dict__.get(OPTS, DEFAULT_OPTS)[2]


def asked(opts, experts: bool = False) -> str:
    """patch_model's options `opts` that are not the defaults, as text ("recompute=True and token_chunk=8"); for
    experts, those that never act on them (recompute, token_chunk: their experts implementation runs the
    projections; saved_dtype acts through the implementation "ffn_ext")."""
    recompute, chunk, saved = opts
    return " and ".join(
        t
        for t in (
            recompute and "recompute=True",
            chunk is not None and f"token_chunk={chunk}",
            saved is not None and not experts and f"saved_dtype={saved}",
        )
        if t
    )


# ---------------------------------------------------------------- gated MLPs: down(g(gate(x), up(x))), packed
GATED_NAMES = ("gate_proj", "up_proj", "down_proj")
_ACT_NAMES = ("act_fn", "activation_fn")
# Attribute names under which modules hold a gated MLP's projections (to [..., 2I] and back) and activation, for
# naming MLP-shaped modules whose code is not recognised (and for extra_classes): Phi-3's, Granite MoE's shared
# experts', ModernBERT's and Moonshine's decoder's. The last two name plain MLPs too, so they count only with a packed
# MLP's shapes.
_PACKED_NAMES = (("gate_up_proj", "down_proj", _ACT_NAMES), ("input_linear", "output_linear", ("activation",)))
_SHAPED_NAMES = (("Wi", "Wo", ("act",)), ("fc1", "fc2", ("activation_fn",)))


def _linears(module, names) -> bool:
    return all(isinstance(module._modules.get(n), nn.Linear) for n in names)


def _act_name(module, candidates) -> str:
    return next((n for n in candidates if hasattr(module, n)), candidates[0])


class _GatedForm(Form):
    """What the gated MLP and its packed form share: the gating under the projection back, out(gating)."""

    def read_gating(self, read) -> tuple[str, Gated, tuple] | Named | None:
        """(the projection back, the gating, the guards) of forward(x) = out(gating), or Named, or None."""
        r: Read | None = read("forward")
        if r is None or not (isinstance(r.value, Call) and len(r.value.args) == 1):
            return None
        g = gating(r.value.args[0])
        return (r.value.attr, g, r.guards) if isinstance(g, Gated) else g

    @staticmethod
    def chained(f: list) -> bool:
        """Whether the projections' (in, out) features chain as an MLP's."""
        raise NotImplementedError

    def problem(self, module, plan):
        f = [features(module._modules.get(n)) for n in plan.names]
        if any(v is None for v in f) or not self.chained(f):
            return UNKNOWN_MLP
        return super().problem(module, plan)

    def options(self, module, plan):
        return isinstance(resolve(module, plan.gate, why=True), Gating)

    @staticmethod
    def gate_up(projs: list, g: Gating) -> tuple:  # the [gate | up] weight rows and bias, one GEMM's
        raise NotImplementedError

    def fp8(self, module, plan, recipe):
        found = _fp8_parts(module, self, plan)
        if isinstance(found, str):
            return None, found
        projs, g, layout = found
        if layout != "linear":
            return None, FP8_PROJECTIONS
        w, b = self.gate_up(projs, g)
        return _fp8.FP8GatedFFN(w, b, projs[-1].weight, projs[-1].bias, g, recipe=recipe), None


class GatedMLP(_GatedForm):
    """down(g(gate(x), up(x))), any attribute names (Llama, Qwen, Mistral, Gemma, DeepSeek's dense and shared
    experts; clamped: DeepSeek-V4's shared expert, GLM-5-Next): ffn_ext.mlp.gated_mlp, the lean autograd."""

    name = "gated"

    @staticmethod
    def chained(f):
        (gi, go), (ui, uo), (di, do) = f
        return gi == ui == do and go == uo == di

    def recognise(self, module, read):
        found = self.read_gating(read)
        if not isinstance(found, tuple):
            return found
        out, g, guards = found
        gate, up = proj(g.gate, X), proj(g.up, X)
        return Plan((gate, up, out), g.spec, guards) if gate and up and gate != up else None

    def unrecognised(self, module, vouched):
        if not _linears(module, GATED_NAMES):
            return None
        return (
            Plan(GATED_NAMES, GateSpec(_act_name(module, _ACT_NAMES)), proven=False) if vouched else Named(UNKNOWN_MLP)
        )

    @staticmethod
    def gate_up(projs, g):
        gate, up, _ = projs
        return torch.cat([gate.weight, up.weight]), None if gate.bias is None else torch.cat([gate.bias, up.bias])

    def run(self, module, plan, x, g):
        gate, up, down = (module._modules[n] for n in plan.names)
        if fusable((gate, up, down)):
            return gated_mlp(x, *linear_args(gate, up, down), activation=g, **_options(module))
        options_inert(module, (gate, up, down))
        return down(g(gate(x), up(x)))


class PackedMLP(_GatedForm):
    """out(g(h)) with h = proj(x) split into [gate | up] or interleaved halves (Phi-3, Granite MoE's shared experts;
    clamped: MiniMax-M3's dense MLP): ffn_ext.mlp.gated_mlp_packed."""

    name = "packed"

    @staticmethod
    def chained(f):
        return None not in f and f[0][1] == 2 * f[1][0]

    def recognise(self, module, read):
        found = self.read_gating(read)
        if isinstance(found, tuple):
            out, g, guards = found
            layout = halves(g.gate, g.up)  # Named: the up half first
            source = proj(g.gate.of, X) if isinstance(g.gate, Half) else None
            if not isinstance(layout, str) or source is None:
                return layout if isinstance(layout, Named) else None
            return Plan((source, out), dataclasses.replace(g.spec, layout=layout), guards)
        r = read("forward")  # out(drop(gating(proj(x)))): ModernBERT
        v = r.value.args[0] if r is not None and isinstance(r.value, Call) and len(r.value.args) == 1 else None
        between = gating(v.args[0]) if isinstance(v, Call) and len(v.args) == 1 else None
        if isinstance(between, Gated) and halves(between.gate, between.up) == "concat":
            return Named(DROPOUT_BETWEEN)
        return found

    def unrecognised(self, module, vouched):
        shaped = [f for f in _SHAPED_NAMES if self.chained([features(module._modules.get(n)) for n in f[:2]])]
        names = next((f for f in _PACKED_NAMES + tuple(shaped) if _linears(module, f[:2])), None)
        if names is None:
            return None
        return Plan(names[:2], GateSpec(_act_name(module, names[2])), proven=False) if vouched else Named(UNKNOWN_MLP)

    @staticmethod
    def gate_up(projs, g):  # interleaved rows reordered to [gate | up] once
        w, b = projs[0].weight, projs[0].bias
        if g.layout == "interleaved":
            return torch.cat([w[0::2], w[1::2]]), None if b is None else torch.cat([b[0::2], b[1::2]])
        return w, b

    def run(self, module, plan, x, g):
        gate_up, down = (module._modules[n] for n in plan.names)
        if fusable((gate_up, down)):
            return gated_mlp_packed(x, *linear_args(gate_up, down), activation=g, **_options(module))
        options_inert(module, (gate_up, down))
        return down(g(gate_up(x)))


# ---------------------------------------------------------------- the classic FFN and the BERT-style pair
def _ffn(module, x, fc1, fc2, act: str):
    """fc2(act(fc1(x))) with ffn_ext: the fused plain MLP when the projections allow (linear_layout), else the
    projections as modules around ffn_ext's activation op."""
    layout = linear_layout(fc1, fc2)
    if layout is None:
        options_inert(module, (fc1, fc2))
        return fc2(_ops.call_op(act, fc1(x)))
    w = (fc1.weight, fc2.weight, fc1.bias, fc2.bias)
    return plain_mlp(x, *w, act, transposed=layout == "conv1d", **_options(module))


def _activation_child(module) -> bool:
    return any(
        table_activation(m) is not None
        or type(m).__module__ in ("transformers.activations", "torch.nn.modules.activation")
        for m in module._modules.values()
    )


class ClassicMLP(Form):
    """fc2(act(fc1(x))), then a dropout (GPT-2, GPT-NeoX, Falcon, Phi, CLIP, SigLIP, ViT, the VLMs' vision MLPs,
    ...), with nn.Linear, FalconLinear or GPT-2's Conv1D projections: ffn_ext.mlp.plain_mlp. MLP-shaped modules
    whose code is not recognised (an FFN inline in Whisper's and BART's layers; T5's, with a dtype cast) are named:
    an activation and two projections chaining d -> f -> d, whatever f."""

    name = "classic"
    disagrees = DISAGREES_CLASSIC

    @staticmethod
    def _ffn_of(v) -> tuple[str, str, str | None] | None:
        """(fc1, fc2, the activation's attribute) for v = fc2(act(fc1(x))), else None."""
        act = _act_of(v.args[0]) if isinstance(v, Call) and len(v.args) == 1 else None
        fc1 = proj(act[1], X) if act else None
        return (fc1, v.attr, act[0]) if fc1 and act else None

    def recognise(self, module, read):
        r = read("forward")
        if r is None:
            return None
        v, drop = r.value, ""
        if isinstance(v, Dropout):  # F.dropout(y, p=self.p, training=self.training) after the projection back
            v, drop = v.of, f"p:{v.p}"
        found = self._ffn_of(v)
        if found is None and not drop and isinstance(v, Call) and len(v.args) == 1:
            found, drop = self._ffn_of(v.args[0]), v.attr  # drop(fc2(act(fc1(x)))): the outer call is the dropout
        return Plan(found[:2], GateSpec(found[2]), r.guards, drop) if found else None

    def fits(self, module, plan):
        f1, f2 = (features(module._modules.get(n)) for n in plan.names)
        return f1 is not None and f2 is not None and f1[1] == f2[0]  # else a head or a conv block of this code

    def unrecognised(self, module, vouched):
        if not _activation_child(module):
            return None
        f = [v for v in map(features, module._modules.values()) if v is not None]
        chained = any(a[0] == b[1] and a[1] == b[0] for i, a in enumerate(f) for b in f[i + 1 :])
        return Named(INLINE) if chained else None

    def run(self, module, plan, x, g):
        mods = module._modules
        y = _ffn(module, x, mods[plan.names[0]], mods[plan.names[1]], g.activation)
        if plan.drop.startswith("p:"):
            return F.dropout(y, p=getattr(module, plan.drop[2:]), training=module.training)
        return mods[plan.drop](y) if plan.drop else y

    def fp8(self, module, plan, recipe):
        found = _fp8_parts(module, self, plan)
        if isinstance(found, str):
            return None, found
        (fc1, fc2), g, layout = found
        if layout is None:
            return None, FP8_PROJECTIONS
        w1, w2 = (p.weight.t() if layout == "conv1d" else p.weight for p in (fc1, fc2))  # Conv1D: [in, out]
        act = functools.partial(_ops.call_op, g.activation)
        return _fp8.FP8FFN(w1, fc1.bias, w2, fc2.bias, act, recipe), None


class BertPair(Form):
    """A BERT-style layer's *Intermediate (act(dense(x))) and *Output (LayerNorm(dropout(dense(h)) + x)), patched at
    the layer's feed_forward_chunk, output(intermediate(x), x), so that the activation's output is not kept for
    the second projection's weight gradient: plain_mlp."""

    name, method = "pair", "feed_forward_chunk"
    disagrees = DISAGREES_CLASSIC
    not_fp8 = (
        "BERT-style *Intermediate / *Output layers: the projection back shares its module with the dropout, the "
        "residual and the LayerNorm, which an FP8 MLP would have to take over"
    )
    _CHUNK = Call("output", (Call("intermediate", (X,)), X))
    _OUTPUT = Call("LayerNorm", (_add(Call("dropout", (Call("dense", (X,)),)), In(1)),))

    @staticmethod
    def _pair(module):
        mods = vars(module).get("_modules", {})
        inter, out = mods.get("intermediate"), mods.get("output")
        if inter is None or out is None or "dense" not in inter._modules or "dense" not in out._modules:
            return None
        return inter, out

    def recognise(self, module, read):
        pair = self._pair(module)
        r = read(self.method) if pair is not None else None
        if r is None or r.value != self._CHUNK:
            return None
        inter, out = pair
        i, o = evaluate(inter, type(inter).forward, 1), evaluate(out, type(out).forward, 2)
        act = _act_of(i.value) if i is not None else None
        if act is None or proj(act[1], X) != "dense" or o is None or o.value != self._OUTPUT:
            return None
        return Plan((), GateSpec(act[0]), r.guards + i.guards + o.guards)

    def unrecognised(self, module, vouched):
        return Named(UNKNOWN_PAIR) if self._pair(module) is not None else None

    def problem(self, module, plan):
        g = resolve(module.intermediate, plan.gate, why=True)
        return g if isinstance(g, str) else None

    def gating(self, module, plan):
        inter, out = module._modules.get("intermediate"), module._modules.get("output")
        g = resolve(inter, plan.gate)
        return g if isinstance(g, Gating) and fusable((), (inter, out)) else None

    def first(self, module, plan):
        return module.intermediate.dense

    def run(self, module, plan, x, g):
        inter, out = module._modules["intermediate"], module._modules["output"]
        return out.LayerNorm(out.dropout(_ffn(module, x, inter.dense, out.dense, g.activation)) + x)


# ---------------------------------------------------------------- MoE experts: the gating at _apply_gate
def _3d(params: dict, name: str) -> bool:
    t = params.get(name)
    return t is not None and t.dim() == 3


def is_experts(module) -> bool:
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


def _running_forward(module):
    """The function an experts module's forward runs now: under transformers' @use_experts_implementation (a forward
    that picks the one its config's _experts_implementation names from its experts_interface) that one, under
    "eager" (or without one) the class's own forward; None where it cannot be told."""
    fwd = type(module).forward
    own = inspect.unwrap(fwd)
    impl = getattr(module.__dict__.get("config"), "_experts_implementation", None)
    if own is fwd or impl in (None, "eager"):
        return own
    interface = inspect.getclosurevars(fwd).nonlocals.get("experts_interface") if inspect.isfunction(fwd) else None
    return interface.get(impl) if interface is not None else None


class ExpertsGate(Form):
    """MoE experts' gating of the [S, 2I] projection, _apply_gate(gate_up): act(gate) * up, concat or interleaved, or
    clamped (Mixtral, Qwen-MoE, DeepSeek-V3, GPT-OSS, DeepSeek-V4, ...), by one ffn_ext op read in place, injected
    where transformers calls it (its grouped_mm, batched_mm and deepgemm implementations, the classes' own loops
    that call self._apply_gate). The routing and the experts loop stay transformers'; experts_implementation=
    "ffn_ext" (moe.py) runs the routed experts on ffn_ext."""

    name, method = "experts_gate", "_apply_gate"
    disagrees = DISAGREES_GATE
    not_fp8 = "MoE experts modules (3-D expert weights): ffn_ext has no FP8 grouped GEMM"

    def recognise(self, module, read):
        if vars(module).get("has_gate") is False or not callable(getattr(type(module), self.method, None)):
            return None  # non-gated experts, act(up), are no more this patch's business than non-gated MLPs
        r = read(self.method)
        g = gating(r.value) if r is not None else None
        if r is None or not isinstance(g, Gated):
            return g
        layout = halves(g.gate, g.up, X)
        return Plan((), dataclasses.replace(g.spec, layout=layout), r.guards) if isinstance(layout, str) else layout

    def unrecognised(self, module, vouched):
        if not is_experts(module):
            return None
        return Named(UNKNOWN_EXPERTS if callable(getattr(type(module), self.method, None)) else INLINE_EXPERTS)

    def options(self, module, plan):
        return False

    def unused(self, module):
        running = _running_forward(module)
        if running is None or getattr(running, "__module__", "").startswith("ffn_ext."):  # "ffn_ext": the same plan
            return None
        return INLINE_EXPERTS if calls(running, self.method) is False else None

    def first(self, module, plan):
        return None

    def run(self, module, plan, x, g):
        return g(x)


FORMS: tuple[Form, ...] = (ExpertsGate(), BertPair(), GatedMLP(), PackedMLP(), ClassicMLP())
EXPERTS = FORMS[0]
_UNUSED: dict = {}  # (experts class, implementation) -> EXPERTS.unused: it reads source code, the hook runs per call


def experts_watch(module, args) -> None:
    """A forward pre-hook on patched experts: their implementation switched after patching to one that never calls
    _apply_gate ("eager", whose loop inlines the gating) warns, once, where the patched method alone could not."""
    patched = module.__dict__.get(MARK)
    if patched is None or patched.warned:
        return
    key = (type(module), getattr(module.__dict__.get("config"), "_experts_implementation", None))
    if key not in _UNUSED:
        _UNUSED[key] = EXPERTS.unused(module)
    if _UNUSED[key]:
        patched.warn(f"its implementation was switched after patching (to {key[1]!r}), whose loop never calls it")
    elif saved_dtype_of(module) is not None and key[1] != "ffn_ext":
        patched.warned = True
        warnings.warn(
            f"ffn_ext.hf: {patched.name} ({type(module).__name__}): the saved_dtype={saved_dtype_of(module)} asked "
            f"for does not act: its experts implementation is {key[1]!r}, which keeps its own tensors for backward "
            "(saved_dtype acts through experts_implementation=\"ffn_ext\")",
            RuntimeWarning,
            stacklevel=2,
        )


# ---------------------------------------------------------------- a module's plan
def _vouched(cls, extra: tuple) -> bool:
    """Whether cls, or a base class up to the one that defines forward, is in `extra`."""
    mro = cls.__mro__
    return any(c in extra for c in mro[: 1 + next((i for i, c in enumerate(mro) if "forward" in vars(c)), -1)])


def recognised(module, forms=FORMS, fits=False) -> tuple[Form, Plan | Named] | None:
    """The first form whose recogniser reads the module's code (and, with fits=True, whose plan its parts fit), with
    its plan or Named; else None. Reads the code and the instance's attributes only (fits=False): an uninitialised
    instance is read too."""
    reads: dict = {}

    def read(method: str, n: int = 1) -> Read | None:
        if method not in reads:
            fn = getattr(type(module), method, None)
            reads[method] = evaluate(module, fn, n) if callable(fn) else None
        return reads[method]

    for form in forms:
        found = form.recognise(module, read)
        if found is not None and not (fits and isinstance(found, Plan) and not form.fits(module, found)):
            return form, found
    return None


def identify(module, vouched=False, forms=FORMS) -> tuple[Form, Plan | Named] | None:
    """recognised(), else the first form the module is shaped like (unrecognised: Named, or, vouched for, a plan by
    its shape); None: no form's business."""
    found = recognised(module, forms, fits=True)
    return found or next(((f, p) for f in forms if (p := f.unrecognised(module, vouched)) is not None), None)


def _why_not(module, form: Form, plan: Plan) -> str | None:
    prev = module.__dict__.get(form.method)
    if prev is not None and form.method != "forward":  # a forward wrapper (accelerate's hook) is kept, and runs
        return f"modules with a {form.method} of their own set on the instance"
    why = form.problem(module, plan)
    if why:
        return why
    if zero3_hooked(module) and not module.__dict__.get(ZERO3_LEAF):
        return ZERO3_LATE
    g = form.gating(module, plan)
    own = getattr(type(module), form.method)
    verdict = UNKNOWN  # not run under a forward wrapper the instance had, nor while the activation is hooked
    if prev is None and g is not None:
        fused = lambda x: form.run(module, plan, x, g)  # noqa: E731
        with zero3_gathered(module):
            verdict = self_check(module, fused, own, form.first(module, plan), numbers_in(own))
    if verdict == DISAGREE:
        return form.disagrees
    if verdict not in (AGREE, UNKNOWN):
        return f"{CHECK_RAISED} ({verdict})"
    return NOT_PROVEN if verdict != AGREE and not plan.proven else None


def plan(module, extra: tuple = (), forms=FORMS) -> tuple[Form, Plan] | str | None:
    """(the form, its plan) to patch the module with, the reason to name it, or None: no form's business. Planning
    never raises: an error in it (a bug of ffn_ext's) names the module with the error (RAISE_ERRORS: raises)."""
    if isinstance(module, (FFN, GatedFFN)):  # ffn_ext's own modules: fused already, by their class's forward
        return None if type(module).forward in (FFN.forward, GatedFFN.forward) else OWN_FORWARD
    try:
        found = identify(module, _vouched(type(module), extra), forms)
        if found is None:
            return None
        form, p = found
        if isinstance(p, Named):
            return p.reason
        why = _why_not(module, form, p)
        return (form, p) if why is None else why
    except Exception as e:
        if RAISE_ERRORS:
            raise
        return f"{FAILED} ({type(e).__name__}: {e})"


class Patched:
    """A patched method (forward, _apply_gate, feed_forward_chunk), set on the instance and as its mark (MARK): bound
    to its module like a method, but picklable (a types.MethodType pickles as getattr(module, name), which torch.load
    could not resolve): the form and plan pickle by value, the module by reference.

    A call with one tensor, positional or named as the method's parameter, runs the form's fused forward while the
    attributes the recognised code's `if` tests read still hold (guards) and the form's gating may run now
    (Form.gating: its activation neither hooked nor replaced by one ffn_ext lacks, its limit valid); every other call
    runs the original: `prev`, the forward the instance had when patched (a wrapper such as accelerate's hook, which
    must run), else the class's method. The first such call warns, naming the module (`name`, as patch_model found
    it) and why (why_own): a module counted as patched whose fused path does not run is never silent."""

    def __init__(self, module, form: Form, plan: Plan, prev=None, name: str = ""):
        self.__self__, self.form, self.plan, self.prev = module, form, plan, prev
        self.name = name or type(module).__name__
        self.warned = False
        self.leaf = False  # whether patch_model set the ZeRO-3 leaf flag (unpatch_model takes it out)
        self.watch = None  # experts: the handle of experts_watch, the hook patch_model registered
        try:
            self.arg = next(iter(inspect.signature(self._own()).parameters), "x")
        except (TypeError, ValueError):
            self.arg = "x"

    def _own(self):
        return getattr(type(self.__self__), self.form.method).__get__(self.__self__)

    @property
    def __signature__(self):  # the class's method's: transformers' apply_chunking_to_forward counts its parameters
        return inspect.signature(self._own())

    def __call__(self, *args, **kwargs):
        module, form, plan = self.__self__, self.form, self.plan
        if self.prev is not None:
            if not self.warned:
                self.warn(
                    f"the forward wrapper it had on the instance when patched ({_qualname(self.prev)}) runs instead "
                    "and calls the class's forward (patch before wrapping: accelerate's hook then keeps ffn_ext's)"
                )
            return self.prev(*args, **kwargs)
        if len(args) + len(kwargs) == 1 and guards_hold(module, plan.guards):
            x = args[0] if args else kwargs.get(self.arg)
            if isinstance(x, torch.Tensor):
                g = form.gating(module, plan)
                if g is not None:
                    return form.run(module, plan, x, g)
        if not self.warned:
            self.warn(self.why_own(args, kwargs))
        return getattr(type(module), form.method)(module, *args, **kwargs)

    def warn(self, why: str, what: str = "") -> None:
        """Warns, once per patch, that this module's fused path does not run (`what`: what of it does not), and
        why; the recompute / token_chunk asked for are named as not acting."""
        self.warned = True
        inert = asked(self.__self__.__dict__.get(OPTS, DEFAULT_OPTS))
        what = what or f"ffn_ext's fused {self.form.method}"
        warnings.warn(
            f"ffn_ext.hf: {self.name} ({type(self.__self__).__name__}), patched, runs without {what}: {why}"
            + (f"; the {inert} asked for does not act" if inert else ""),
            RuntimeWarning,
            stacklevel=3,
        )

    def why_own(self, args, kwargs) -> str:
        """Why a call ran the module's own code (what __call__ tests, in its order), for the warning."""
        module, plan = self.__self__, self.plan
        x = args[0] if args else kwargs.get(self.arg)
        if len(args) + len(kwargs) != 1 or not isinstance(x, torch.Tensor):
            given = [type(a).__name__ for a in args] + [f"{k}={type(v).__name__}" for k, v in kwargs.items()]
            return f"it was called with inputs it does not take ({', '.join(given)}; it takes one tensor)"
        changed = [n for n, v in plan.guards if not guards_hold(module, ((n, v),))]
        if changed:
            return f"attributes its code tests changed after patching ({', '.join(changed)})"
        hooked = hooked_parts(module)
        if hooked:
            return hooked
        why = self.form.problem(module, plan)
        return f"its implementation was switched after patching: {why}" if why else "its gating cannot run now"


def _qualname(fn) -> str:
    fn = getattr(fn, "func", fn)  # a functools.partial (accelerate's hook)
    return getattr(fn, "__qualname__", type(fn).__name__)


def hooked_parts(module, parts=None) -> str:
    """'hooks or forward wrappers on its submodules (names)' for the module's submodules (or `parts`, named) that
    ffn_ext.mlp.fusable would run as modules, with DeepSpeed ZeRO-3's named as such; '' when none is."""
    if not fusable(()):
        return "global module hooks (torch.nn.modules.module.register_module_*_hook) are registered"
    named = list(parts.items()) if parts is not None else list(module.named_modules())[1:]
    names = [n for n, m in named if not fusable((), (m,))]
    if not names:
        return ""
    ds = [n for n, m in named if "ds_id" in m.__dict__]
    return f"hooks or forward wrappers on its submodules ({', '.join(names)})" + (
        ": DeepSpeed ZeRO-3's, registered before the module was patched (patch before deepspeed.initialize)"
        if ds
        else ""
    )


def options_inert(module, parts: tuple) -> None:
    """Warns once that recompute / token_chunk, asked for, do not act on `module` because its projections (`parts`)
    run as modules, hooked or wrapped."""
    patched = module.__dict__.get(MARK)
    if patched is not None and not patched.warned and module.__dict__.get(OPTS, DEFAULT_OPTS) != DEFAULT_OPTS:
        named = {n: m for n, m in module.named_modules() if any(m is p for p in parts)}
        why = hooked_parts(module, named) or "its projections are not plain nn.Linear"
        patched.warn(why, "ffn_ext's fused MLP (its projections run as modules, around ffn_ext's activation op)")
