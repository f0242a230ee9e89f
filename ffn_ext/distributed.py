"""ffn_ext under torch.distributed: DTensor sharding strategies for every op of the table, a tensor-parallel plan for
the gated FFNs, and the per-rank packed layout.

    import ffn_ext                       # imports ffn_ext.distributed: the strategies register when
                                         # torch.distributed.tensor is imported before ffn_ext, or on the first
                                         # DTensor call (ffn_ext.distributed.register_strategies() does it now)
    h = ffn_ext.swiglu(gate_dt, up_dt)                     # DTensors in, DTensor out
    parallelize_module(model, mesh, ffn_ext.distributed.tp_plan(model))   # colwise gate/up (fc1), rowwise down (fc2)
    ffn_ext.distributed.shard_gated_ffns(model, mesh)      # the same placements without hooks: the lean autograd
    ffn_ext.distributed.shard_plain_ffns(model, mesh)      # ffn_ext.FFN: fc1 (up_proj) Shard(0), fc2 Shard(1)

Sharding (registered once from the op table, ffn_ext.table.OPS, forward and backward ops):
- unary and gated ops (x; gate, up; and their backward ops' grad): Replicate, or Shard(d) for any d, the same on
  every input and output. Never Partial: the functions are nonlinear, act(a + b) != act(a) + act(b); a Partial
  input is reduced first.
- packed ops (gate_up [..., 2M]): Replicate or Shard(d) for any d but the last. A DTensor sharded on its last dim
  holds a slice of the global [gate | up] (rank 0: gate's first half), not a [gate_shard | up_shard] pair, so that
  placement is redistributed (to another dim or Replicate) before the op: correct, never computed on the wrong
  pairs. Placements that disagree between inputs are redistributed to one strategy the same way.
- the quantizing ops (ffn_ext.quant, quant_strategies): row and group scales Shard(d) on any dim but the last (a
  row's scale needs the whole row), a static per-tensor scale as an elementwise op, a dynamic one Replicate (the
  whole tensor's amax).
- the per-rank packed layout: when each rank's local gate_up is its own [gate_shard | up_shard] (a gate_up
  projection split per rank, as Megatron's / vLLM's MergedColumnParallelLinear: rank r holds rows
  [gate rows of r; up rows of r] of the weight), the packed op runs on the local shards: ``per_rank_packed``.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch

from . import mlp as _mlp
from . import modules as _modules
from . import ops as _ops
from .table import OPS, QUANT_SCHEMAS

if TYPE_CHECKING:  # annotations only: torch.distributed.tensor stays unloaded until used
    from torch.distributed.tensor import DTensor

__all__ = [
    "register_strategies",
    "strategies",
    "quant_strategies",
    "per_rank_packed",
    "tp_plan",
    "tp_gated_mlp",
    "tp_plain_mlp",
    "shard_gated_ffns",
    "shard_plain_ffns",
    "GATED_FFN_PLAN",
    "PLAIN_FFN_PLAN",
]

_registered = False


def strategies(name: str, ndim: int) -> list:
    """The acceptable shardings of op `name` on inputs of `ndim` dims (the packed ops': gate_up's), for
    register_sharding: (output placements, input placements) pairs, one per mesh dim, Replicate first."""
    from torch.distributed.tensor import Replicate, Shard

    spec = OPS[name]
    n_in, n_out = len(spec.args), spec.n_outputs
    dims = range(ndim - 1 if spec.kind == "packed" else ndim)
    return [([p] * n_out, [p] * n_in) for p in [Replicate(), *(Shard(d) for d in dims)]]


def quant_strategies(name: str, ndim: int, scaling: str, static_scale) -> list:
    """The acceptable shardings of a quantizing op (ffn_ext.quant) on inputs of `ndim` dims, outputs (q, scale): a
    dynamic per-tensor scale needs the whole tensor's amax, so Replicate only (a sharded input is gathered first);
    a static one is elementwise: q as any elementwise op, the 0-dim scale replicated; a row's scale (and its
    groups') needs the whole row: Shard(d) for any dim but the last, q and scale alike (a group-aligned shard of
    the last dim is not offered: shards of uneven size would split groups)."""
    from torch.distributed.tensor import Replicate, Shard

    packed = name.endswith("_packed_quant")
    n_in = 1 if packed or name == "quantize" else 2
    rep = [([Replicate(), Replicate()], [Replicate()] * n_in)]
    if scaling == "tensor" and static_scale is None:
        return rep
    if scaling == "tensor":
        dims = range(ndim - 1 if packed else ndim)
        return rep + [([Shard(d), Replicate()], [Shard(d)] * n_in) for d in dims]
    return rep + [([Shard(d), Shard(d)], [Shard(d)] * n_in) for d in range(ndim - 1)]


def _register_quant_strategies(register_sharding) -> None:
    """The quantizing ops' strategies depend on the recipe (scaling, static_scale): DTensor caches a sharding
    decision per op and per its int arguments only (register_sharding's schema info), so a decision made for a row
    recipe would be reused for a dynamic per-tensor one (computed on the shards: wrong values, silently). The schema
    info is widened to the recipe's arguments where DTensor's propagator exposes it; where it does not, only the
    decision every recipe accepts (Replicate) is registered."""
    from torch.distributed.tensor import DTensor

    try:
        from torch.distributed.tensor._op_schema import RuntimeSchemaInfo

        infos = DTensor._op_dispatcher.sharding_propagator.op_to_schema_info
    except (ImportError, AttributeError):
        infos = None
    for name in QUANT_SCHEMAS:
        if not hasattr(torch.ops.ffn_ext, name):
            continue
        overload = getattr(torch.ops.ffn_ext, name).default

        def quant_rule(*args, _name=name, _keyed=infos is not None, **kwargs):
            if not _keyed:  # the decision would be shared by every recipe
                return quant_strategies(_name, args[0].ndim, "tensor", None)
            return quant_strategies(_name, args[0].ndim, kwargs["scaling"], kwargs["static_scale"])

        register_sharding(overload)(quant_rule)
        if infos is not None:
            keys = ["scaling", "group_size", "static_scale"]
            infos[overload] = RuntimeSchemaInfo(static_kwargkey=keys, needs_pytree=True)


def register_strategies() -> bool:
    """Registers the sharding strategies of every op of the table with DTensor, once; True when this call did."""
    global _registered
    if _registered or not _ops.native_ops():
        return False  # once; and only once the ops are registered
    from torch.distributed.tensor.experimental import register_sharding

    for name, spec in OPS.items():
        r = 1 if spec.kind == "packed" and spec.backward else 0  # the argument whose ndim sets the dims: gate_up

        def rule(*args, _name=name, _r=r, **kwargs):
            return strategies(_name, args[_r].ndim)

        register_sharding(getattr(torch.ops.ffn_ext, name).default)(rule)
    _register_quant_strategies(register_sharding)
    _registered = True
    return True


def per_rank_packed(fn, gate_up, *args, **kwargs):
    """fn(gate_up, *args, **kwargs) (a packed function: ffn_ext.swiglu_packed, gated_packed, ...) on a DTensor
    gate_up sharded on its last dim whose every local shard is that rank's own [gate_shard | up_shard] (in fn's
    layout): each rank runs fn on its shard; the result is a DTensor with the same placements (its last dim
    sharded, rank r's [..., M/world] slice). Gradients flow back to gate_up's shards. A gate_up projection split
    per rank gives this layout: rank r's weight shard is torch.cat([w_gate.chunk(world)[r], w_up.chunk(world)[r]]),
    and F.linear(x, that shard) is the local gate_up."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(gate_up, DTensor):
        return fn(gate_up, *args, **kwargs)
    last = gate_up.ndim - 1
    if not any(isinstance(p, Shard) and p.dim in (last, -1) for p in gate_up.placements):
        raise ValueError(
            "ffn_ext.distributed.per_rank_packed: gate_up is not sharded on its last dim "
            f"(placements {gate_up.placements}); call the packed op directly"
        )
    out = fn(gate_up.to_local(), *args, **kwargs)
    return DTensor.from_local(out, gate_up.device_mesh, gate_up.placements, run_check=False)


# projection names of ffn_ext's gated FFNs (GatedFFN, SwiGLUFFN, GeGLUFFN) and Llama/Gemma/Qwen-style HF MLPs
_COLWISE, _ROWWISE = ("gate_proj", "up_proj"), ("down_proj",)
GATED_FFN_PLAN = {**{n: "colwise" for n in _COLWISE}, **{n: "rowwise" for n in _ROWWISE}}


def _is_gated_ffn(mod) -> bool:
    separate = all(isinstance(getattr(mod, n, None), torch.nn.Linear) for n in (*_COLWISE, *_ROWWISE))
    if isinstance(mod, _modules.GatedFFN) and not separate:
        # a packed gate_up projection (fused_gate_up=True): ColwiseParallel would give rank 0 the global
        # [gate | up]'s first rows (gate only), not its own [gate_shard | up_shard]
        raise ValueError(
            f"ffn_ext.distributed.tp_plan: {type(mod).__name__} has no separate gate_proj/up_proj "
            "nn.Linear (a fused gate_up projection?); colwise sharding of a packed [gate | up] weight "
            "would pair the wrong rows. Use separate projections, or split the packed weight per rank "
            "(per_rank_packed)"
        )
    return separate


# ffn_ext.FFN: fc1 is up_proj (column parallel), fc2 down_proj (row parallel)
PLAIN_FFN_PLAN = {"up_proj": "colwise", "down_proj": "rowwise"}


def _is_plain_ffn(mod) -> bool:
    return isinstance(mod, _modules.FFN) and all(
        isinstance(getattr(mod, n, None), torch.nn.Linear) for n in PLAIN_FFN_PLAN
    )


def tp_plan(model: torch.nn.Module, *, use_local_output: bool = True) -> dict:
    """The tensor-parallel plan (for torch.distributed.tensor.parallel.parallelize_module) of every gated FFN in
    `model` (ffn_ext's GatedFFN/SwiGLUFFN/GeGLUFFN, and MLPs with nn.Linear gate_proj, up_proj, down_proj, such as
    transformers' Llama/Qwen2/Gemma MLPs, patched or not): gate_proj and up_proj ColwiseParallel, down_proj
    RowwiseParallel, keyed by their fully qualified names; and of every ffn_ext.FFN (the classic FFN): up_proj
    (fc1) ColwiseParallel, down_proj (fc2) RowwiseParallel. The activation between them runs fused on the local
    shards (use_local_output=True, the default) or on DTensors Shard(-1) (use_local_output=False: the op's
    sharding strategy), with the same result; down_proj's output is reduced to a replicated (local) tensor."""
    from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

    plan: dict[str, ParallelStyle] = {}
    for prefix, mod in model.named_modules():
        if _is_gated_ffn(mod):
            p = prefix + "." if prefix else ""
            for n in _COLWISE:
                plan[p + n] = ColwiseParallel(use_local_output=use_local_output)
            for n in _ROWWISE:
                plan[p + n] = RowwiseParallel()
        elif _is_plain_ffn(mod):
            p = prefix + "." if prefix else ""
            plan[p + "up_proj"] = ColwiseParallel(use_local_output=use_local_output)
            plan[p + "down_proj"] = RowwiseParallel()
    return plan


class _SumOverRanks(torch.autograd.Function):
    """Forward: the sum of every rank's tensor (all_reduce); backward: the gradient as it is (the loss is computed
    on the same summed tensor on every rank). Megatron's reduce_from_tensor_model_parallel_region."""

    @staticmethod
    def forward(ctx, t, group):
        t = t.clone()
        torch.distributed.all_reduce(t, group=group)
        return t

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SumGradOverRanks(torch.autograd.Function):
    """Forward: the tensor as it is; backward: the sum of every rank's gradient (each rank's is a partial sum over
    its d_ff shard). Megatron's copy_to_tensor_model_parallel_region."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


def tp_gated_mlp(
    x: torch.Tensor,
    w_gate: DTensor,
    w_up: DTensor,
    w_down: DTensor,
    b_gate: DTensor | None = None,
    b_up: DTensor | None = None,
    b_down: DTensor | None = None,
    activation: str = "silu",
    *,
    recompute: bool = False,
    token_chunk: int | None = None,
    saved_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """ffn_ext.gated_mlp (the lean autograd: saves x, gate, up; recomputes h) with tensor-parallel weights on a 1-D
    mesh: w_gate, w_up (and b_gate, b_up) DTensors Shard(0) (column parallel), w_down Shard(1) (row parallel),
    b_down Replicate; x a local tensor, the same on every rank. Each rank runs the lean MLP on its d_ff shard and
    the partial outputs are summed across ranks (one all_reduce forward, one for x's gradient backward); the
    weights' gradients are DTensors with the weights' placements. Returns a local tensor, the same on every rank.
    recompute, token_chunk and saved_dtype as gated_mlp's, on each rank's shard. What tp_plan's module hooks cost instead: the
    projections run as modules (no lean autograd), 4 saved tensors; shard_gated_ffns places the weights without
    hooks, so the FFN modules (and patched Hugging Face MLPs) call this."""
    from torch.distributed.tensor import Replicate, Shard

    _check_placed(
        "tp_gated_mlp",
        (
            ("w_gate", w_gate, Shard(0)),
            ("w_up", w_up, Shard(0)),
            ("w_down", w_down, Shard(1)),
            ("b_gate", b_gate, Shard(0)),
            ("b_up", b_up, Shard(0)),
            ("b_down", b_down, Replicate()),
        ),
    )
    group = w_gate.device_mesh.get_group()
    # the shards as plain tensors (None: no bias), Any: gated_mlp checks them as it checks its own arguments
    local: list[Any] = [None if t is None else t.to_local() for t in (w_gate, w_up, w_down, b_gate, b_up)]
    y = _mlp.gated_mlp(
        _SumGradOverRanks.apply(x, group),
        local[0],  # indexed, not *local[:3]: a star-call of unknown length is no call mypy can check
        local[1],
        local[2],
        local[3],
        local[4],
        None,
        activation=activation,
        recompute=recompute,
        token_chunk=token_chunk,
        saved_dtype=saved_dtype,
    )
    y = _SumOverRanks.apply(y, group)
    return y if b_down is None else y + b_down.to_local()


def _check_placed(fn: str, named: tuple) -> None:
    from torch.distributed.tensor import DTensor

    for name, w, want in named:
        if w is not None and (not isinstance(w, DTensor) or tuple(w.placements) != (want,)):
            raise ValueError(
                f"ffn_ext.distributed.{fn}: expected `{name}` to be a DTensor placed "
                f"[{want}] on a 1-D mesh, got "
                f"{list(w.placements) if isinstance(w, DTensor) else type(w).__name__}"
            )


def tp_plain_mlp(
    x: torch.Tensor,
    w_fc1: DTensor,
    w_fc2: DTensor,
    b_fc1: DTensor | None = None,
    b_fc2: DTensor | None = None,
    activation: str = "gelu",
    *,
    recompute: bool = False,
    token_chunk: int | None = None,
    saved_dtype: torch.dtype | None = None,
    transposed: bool = False,
) -> torch.Tensor:
    """ffn_ext.plain_mlp (the lean autograd: saves x and fc1's output) with tensor-parallel weights on a 1-D mesh:
    fc1 column parallel, fc2 row parallel (nn.Linear layout: w_fc1 and b_fc1 Shard(0), w_fc2 Shard(1); Conv1D
    layout, transposed=True: w_fc1 Shard(1), b_fc1 Shard(0), w_fc2 Shard(0)), b_fc2 Replicate; x a local tensor,
    the same on every rank. Each rank runs the lean MLP on its d_ff shard (the activation is elementwise, so the
    shards are independent) and the partial outputs are summed (one all_reduce forward, one for x's gradient
    backward); the weights' gradients are DTensors with the weights' placements. Returns a local tensor."""
    from torch.distributed.tensor import Replicate, Shard

    s1, s2 = (Shard(1), Shard(0)) if transposed else (Shard(0), Shard(1))
    _check_placed(
        "tp_plain_mlp",
        (("w_fc1", w_fc1, s1), ("w_fc2", w_fc2, s2), ("b_fc1", b_fc1, Shard(0)), ("b_fc2", b_fc2, Replicate())),
    )
    group = w_fc1.device_mesh.get_group()
    local: list[Any] = [None if t is None else t.to_local() for t in (w_fc1, w_fc2, b_fc1)]  # as tp_gated_mlp's
    y = _mlp.plain_mlp(
        _SumGradOverRanks.apply(x, group),
        local[0],
        local[1],
        local[2],
        None,
        activation=activation,
        recompute=recompute,
        token_chunk=token_chunk,
        saved_dtype=saved_dtype,
        transposed=transposed,
    )
    y = _SumOverRanks.apply(y, group)
    return y if b_fc2 is None else y + b_fc2.to_local()


def _place(lin, mesh, place, bias_place) -> None:
    from torch.distributed.tensor import distribute_tensor

    for pname, p in list(lin.named_parameters(recurse=False)):
        where = bias_place if pname == "bias" else place
        lin.register_parameter(
            pname, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [where]), requires_grad=p.requires_grad)
        )


def shard_plain_ffns(model: torch.nn.Module, mesh) -> int:
    """Tensor parallel with the lean autograd for every ffn_ext.FFN in `model`: up_proj (fc1) Shard(0), down_proj
    (fc2) Shard(1) (its bias Replicate) as DTensor parameters, no module hooks; FFN's forward then runs
    tp_plain_mlp on a local input (recompute and token_chunk as set). Returns the number of FFNs placed."""
    from torch.distributed.tensor import Replicate, Shard

    count = 0
    for _, mod in model.named_modules():
        if _is_plain_ffn(mod):
            _place(mod.up_proj, mesh, Shard(0), Shard(0))
            _place(mod.down_proj, mesh, Shard(1), Replicate())
            count += 1
    return count


def shard_gated_ffns(model: torch.nn.Module, mesh) -> int:
    """Tensor parallel with the lean autograd: places the weights of every gated FFN in `model` (as tp_plan finds
    them: ffn_ext's GatedFFN/SwiGLUFFN/GeGLUFFN with separate projections, Llama/Qwen2/Gemma-style MLPs) on the
    1-D `mesh` as DTensor parameters, gate_proj/up_proj Shard(0) (column parallel), down_proj Shard(1) (row
    parallel; its bias Replicate), and adds no module hooks. Their forward (ffn_ext's modules; transformers' MLPs
    patched by patch_hf_model) then runs tp_gated_mlp on a local input, the same on every rank: the lean autograd on
    each rank's d_ff shard, one all_reduce of the output forward and of x's gradient backward, recompute and
    token_chunk as set. The weights' gradients are DTensors (an optimizer steps them as they are; FSDP2 composes as
    with tp_plan on a 2-D mesh). Returns the number of FFNs placed. A fused gate_up module raises ValueError."""
    from torch.distributed.tensor import Replicate, Shard

    count = 0
    for _, mod in model.named_modules():
        if not _is_gated_ffn(mod):
            continue
        for name in _COLWISE:
            _place(getattr(mod, name), mesh, Shard(0), Shard(0))
        _place(mod.down_proj, mesh, Shard(1), Replicate())
        count += 1
    return count


# The lower layers reach this one through hooks, not imports: ops registers the strategies on a DTensor call
# (torch.distributed.tensor imported after ffn_ext), the MLPs' functional forms route DTensor weights here.
if torch.distributed.is_available():
    _ops._dtensor_registrar = register_strategies
    _mlp._tp_mlps.update(gated=tp_gated_mlp, plain=tp_plain_mlp)
    if "torch.distributed.tensor" in sys.modules:  # imported before ffn_ext: register now (else on a first call)
        register_strategies()
