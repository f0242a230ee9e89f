"""Training steps of a model patched with ffn_ext on several processes - FSDP2 (fully_shard) and tensor parallelism
(parallelize_module with ffn_ext.distributed.tp_plan, and shard_gated_ffns: the lean autograd on the shards) - on
CPU ranks with gloo, against the same steps on one process: the loss of every step, and the memory of each rank.

    python benchmarks/train_distributed.py                 # starts torchrun itself: 2 ranks, every mode
    python benchmarks/train_distributed.py --quick         # tiny widths (seconds of compute; the CI test runs this)
    torchrun --nproc-per-node 2 benchmarks/train_distributed.py --model qwen3_moe --json out.json

Every rank runs every mode in turn, each from the same seeded weights and batches:
- 1proc: the patched model on this process alone, the whole batch (the reference; each rank computes it);
- 1proc_unpatched: the same without ffn_ext (what the patch is checked against in tests/test_training.py);
- fsdp2: fully_shard on every decoder layer and on the model, the batch split between the ranks (the loss shown is
  the ranks' mean, which is the whole batch's: every rank has as many tokens);
- tp: parallelize_module(model, mesh, ffn_ext.distributed.tp_plan(model)): the gated MLPs' gate/up column
  parallel, down row parallel, with DTensor hooks (the projections run as modules around the fused activation);
  attention and embeddings replicated; every rank the whole batch;
- tp_lean: ffn_ext.distributed.shard_gated_ffns(model, mesh): the same placements without hooks; the patched MLPs
  run tp_gated_mlp, the lean autograd on each rank's shard.
- zero3, zero3_init, trainer_zero3 (not run by default; DeepSpeed with DS_ACCELERATOR=cpu): ZeRO-3 with the model
  patched before deepspeed.initialize, built under deepspeed.zero.Init, and transformers' Trainer with a ZeRO-3
  config and from_pretrained; each compared with the same run unpatched (losses, gathered final weights), its
  ffn_ext ops counted over every step (docs/distributed.md; tests/test_zero3.py):
    python benchmarks/train_distributed.py --quick --modes zero3,zero3_init,trainer_zero3
A mode passes when every step's loss is within --rtol of 1proc's (fp32: the sums of a step run in another order on
other shapes, so the losses agree to rounding, not bitwise; AdamW then amplifies that a little from step to step).

Memory per rank: the bytes of the rank's own parameters, gradients (after the last backward) and AdamW state (a
DTensor counts its local shard), and the peak RSS while the mode ran (the process's high-water mark reset before
each mode through /proc/self/clear_refs; it includes the interpreter, torch and transformers, the "start" column,
and the whole model each rank builds before it is sharded). The MLPs run ffn_ext's lean autograd, as on every device.

--model: llama (Hugging Face LlamaForCausalLM), qwen3_moe (Qwen3-MoE, layer 0 dense, the others MoE under
experts_implementation="ffn_ext"; tensor parallelism shards the dense MLP only, the experts stay replicated), or
titan_llama3 (torchtitan's llama3 debugmodel through ffn_ext.torchtitan.FFNExtConverter, FlexAttention swapped for
SDPA since FlexAttention has no CPU backward; 1proc and fsdp2 only: its tensor parallelism is torchtitan's own).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.utils._python_dispatch

BENCH_DIR = Path(__file__).resolve().parent
if str(BENCH_DIR.parent) not in sys.path:  # as benchmarks/common.py: an installed ffn_ext wins over the checkout's
    sys.path.append(str(BENCH_DIR.parent))

import ffn_ext  # noqa: E402
import ffn_ext.distributed  # noqa: E402

MODES = ("1proc", "1proc_unpatched", "fsdp2", "tp", "tp_lean", "trainer_ddp", "trainer_fsdp2")
# DeepSpeed ZeRO-3 (run where deepspeed is installed; each against the same run unpatched): patched before
# deepspeed.initialize, built under deepspeed.zero.Init, and transformers' Trainer with from_pretrained
ZERO3_MODES = ("zero3", "zero3_init", "trainer_zero3")
MiB = float(1 << 20)
# (hidden, intermediate, layers, heads, kv heads, vocab, batch, seq): full and --quick
SIZES = {"full": (512, 1792, 2, 8, 4, 2048, 4, 256), "quick": (64, 192, 2, 4, 2, 256, 4, 32)}


# ---------------------------------------------------------------- memory
def _status_kib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return float(line.split()[1])
    return float("nan")


def _reset_peak_rss() -> bool:
    """Resets the process's RSS high-water mark (VmHWM; Linux 4.0+); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _release_freed_memory() -> None:
    """Hands the heap's freed pages back to the OS (glibc's malloc_trim), so that one mode's peak RSS does not start
    from the last mode's leftovers."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class _FFNExtOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the names of the ffn_ext ops that run inside it (forward and backward), and how often each ran."""

    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()
        self.counts: dict[str, int] = {}
        self.steps: list[int] = []  # the ops each step ran, where the caller notes them

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith("ffn_ext."):
            op = name.split(".")[1]
            self.seen.add(op)
            self.counts[op] = self.counts.get(op, 0) + 1
        return func(*args, **(kwargs or {}))


def _local_bytes(t) -> int:
    """The bytes this rank holds of t: a DTensor's local shard, else the tensor."""
    return (t.to_local() if hasattr(t, "to_local") else t).nbytes


def _tracked(model, opt) -> dict:
    params = sum(_local_bytes(p) for p in model.parameters())
    grads = sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    state = sum(_local_bytes(v) for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.ndim)
    return {"params_mib": params / MiB, "grads_mib": grads / MiB, "optim_mib": state / MiB}


# ---------------------------------------------------------------- models
def _hf_model(kind: str, size: tuple, patched: bool, pad_token_id: int | None = 0):
    import transformers

    hidden, inter, layers, heads, kv, vocab, _, _ = size
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=4096,
        pad_token_id=pad_token_id,
        bos_token_id=1,
        eos_token_id=2,
    )
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(intermediate_size=inter, **common))
    else:
        cfg = transformers.Qwen3MoeConfig(
            intermediate_size=inter,
            moe_intermediate_size=inter // 4,
            num_experts=8,
            num_experts_per_tok=2,
            mlp_only_layers=[0],
            **common,
        )
        model = transformers.Qwen3MoeForCausalLM(cfg)
        if patched:
            model.set_experts_implementation("ffn_ext")
    if patched:
        ffn_ext.patch_hf_model(model, strict=True)
    return model, list(model.model.layers)


def _titan_model(size: tuple, patched: bool):
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    from ffn_ext.torchtitan import FFNExtConverter

    cfg = model_registry("debugmodel", converters=[FFNExtConverter.Config()] if patched else None).model
    for _, _, parent, attr in list(cfg.traverse(FlexAttention.Config)):  # FlexAttention: no backward on the CPU
        if isinstance(parent, list):
            parent[attr] = ScaledDotProductAttention.Config()
        else:
            setattr(parent, attr, ScaledDotProductAttention.Config())
    model = cfg.build()
    model.init_states(buffer_device=torch.device("cpu"))
    return model, list(model.layers.values())


def build(kind: str, size: tuple, patched: bool, seed: int):
    torch.manual_seed(seed)  # the same weights on every rank and in every mode
    model, layers = _titan_model(size, patched) if kind == "titan_llama3" else _hf_model(kind, size, patched)
    return model.train(), layers


def loss_of(kind: str, model, ids):
    if kind == "titan_llama3":
        logits = model(ids)
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    return model(ids, labels=ids).loss


# ---------------------------------------------------------------- one mode
def run_mode(mode: str, args, size: tuple, batches, mesh) -> dict:
    import torch.distributed as dist

    _release_freed_memory()
    peak_ok = _reset_peak_rss()
    start_rss = _status_kib("VmRSS") / 1024
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    model, layers = build(args.model, size, patched=mode != "1proc_unpatched", seed=args.seed)
    ids_of = lambda ids: ids  # noqa: E731
    if mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        ids_of = lambda ids: ids.tensor_split(world)[rank]  # noqa: E731
    elif mode == "tp":
        from torch.distributed.tensor.parallel import parallelize_module

        plan = ffn_ext.distributed.tp_plan(model)
        if not plan:
            return {"mode": mode, "skipped": "no gated MLP with gate_proj/up_proj/down_proj for tp_plan"}
        parallelize_module(model, mesh, plan)
    elif mode == "tp_lean":
        if not ffn_ext.distributed.shard_gated_ffns(model, mesh):
            return {"mode": mode, "skipped": "no gated MLP with gate_proj/up_proj/down_proj to shard"}
    # foreach=False: under tensor parallelism the parameters mix DTensors (the MLPs) and tensors (the rest)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, foreach=False)
    losses, times, tracked = [], [], {}
    ops = _FFNExtOps()
    for i, ids in enumerate(batches):
        t0 = time.perf_counter()
        with ops if i == 0 else contextlib.nullcontext():  # the first step: which ffn_ext ops ran
            loss = loss_of(args.model, model, ids_of(ids))
            loss.backward()
        if i == len(batches) - 1:
            tracked = _tracked(model, opt)  # gradients now; the optimizer state from the steps before (all shapes)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        reported = loss.detach().clone()
        if mode == "fsdp2":  # each rank's loss is its half's mean: the whole batch's is their mean
            dist.all_reduce(reported)
            reported /= world
        losses.append(float(reported))
    tracked["optim_mib"] = _tracked(model, opt)["optim_mib"]
    del model, opt
    return {**_row(mode, losses, times, start_rss, peak_ok, ops), **tracked}


def _row(mode: str, losses: list, times: list, start_rss: float, peak_ok: bool, ops) -> dict:
    """A run's row: its losses, step times (the median leaves out the first step), memory and ffn_ext ops."""
    return {
        "mode": mode,
        "losses": losses,
        "step_s_median": statistics.median(times[1:] or times),
        "total_s": sum(times),
        "rss_start_mib": start_rss,
        "rss_peak_mib": _status_kib("VmHWM") / 1024 if peak_ok else float("nan"),
        "ffn_ext_ops": sorted(ops.seen),
    }


def run_trainer(mode: str, args, size: tuple, batches) -> dict:
    """The same steps through transformers' Trainer (accelerate underneath): trainer_ddp as Trainer runs on CPU
    ranks (accelerate selects DistributedDataParallel there, whatever fsdp_config says), trainer_fsdp2 with
    accelerate's FSDP2 (fsdp_version 2, the decoder layers wrapped): accelerate selects FSDP on accelerator devices
    only, so on the CPU its state is set to FSDP once the Accelerator exists; from there on everything is
    accelerate's and Trainer's own code (fsdp2_prepare_model, the training loop). Trainer's settings match the
    other modes: AdamW, constant learning rate, no weight decay, no gradient clipping, the batches in order."""
    import tempfile

    import torch.distributed as dist

    try:
        import accelerate  # noqa: F401
        from transformers import Trainer, TrainerCallback, TrainingArguments
    except ImportError as e:
        return {"mode": mode, "skipped": f"needs transformers and accelerate ({e})"}
    if args.model == "titan_llama3":
        return {"mode": mode, "skipped": "a torchtitan model has no Trainer"}
    _release_freed_memory()
    peak_ok = _reset_peak_rss()
    start_rss = _status_kib("VmRSS") / 1024
    world = dist.get_world_size()
    model, layers = build(args.model, size, patched=True, seed=args.seed)
    steps, batch, seq = batches.shape
    data = batches.reshape(steps * batch, seq)  # in order: step i's global batch is sequences i*batch..(i+1)*batch

    class Sequences(torch.utils.data.Dataset):
        def __len__(self):
            return len(data)

        def __getitem__(self, i):
            return {"input_ids": data[i], "labels": data[i]}

    fsdp = {}
    if mode == "trainer_fsdp2":
        cfg = {"fsdp_version": 2, "transformer_layer_cls_to_wrap": [type(layers[0]).__name__]}
        fsdp = dict(fsdp=True, fsdp_config={**cfg, "reshard_after_forward": True})
    targs = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="ffn_ext_trainer_"),
        per_device_train_batch_size=batch // world,
        max_steps=steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,
        optim="adamw_torch",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        train_sampling_strategy="sequential",
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=args.seed,
        **fsdp,
    )
    ops, times, tracked = _FFNExtOps(), [], {}

    class Watch(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            if state.global_step == 0:
                ops.__enter__()
            times.append(time.perf_counter())

        def on_pre_optimizer_step(self, a, state, control, model=None, optimizer=None, **kw):
            if state.global_step == steps - 1:
                tracked["grads_mib"] = _tracked(model, getattr(optimizer, "optimizer", optimizer))["grads_mib"]

        def on_step_end(self, a, state, control, **kw):
            times[-1] = time.perf_counter() - times[-1]
            if state.global_step == 1:
                ops.__exit__(None, None, None)

    class CPUTrainer(Trainer):
        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            if mode == "trainer_fsdp2" and getattr(self.accelerator.state, "fsdp_plugin", None) is None:
                from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

                state = self.accelerator.state
                state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
                state.distributed_type = DistributedType.FSDP
                self.is_fsdp_enabled = True

    trainer = CPUTrainer(model=model, args=targs, train_dataset=Sequences(), callbacks=[Watch()])
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # its per-step dicts on stdout: the table says it
    trainer.train()
    from torch.distributed.fsdp import FSDPModule

    wrapped = "FSDP2 (fully_shard)" if isinstance(layers[0], FSDPModule) else type(trainer.model_wrapped).__name__
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    full = _tracked(trainer.model, opt)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    del trainer, model, opt
    return {
        **_row(mode, losses, times, start_rss, peak_ok, ops),
        "wrapped": wrapped,
        "params_mib": full["params_mib"],
        "grads_mib": tracked.get("grads_mib", float("nan")),
        "optim_mib": full["optim_mib"],
    }


# ---------------------------------------------------------------- DeepSpeed ZeRO-3
def zero3_config(batch_per_rank) -> dict:
    """ZeRO-3 with every weight partitioned (no persistence threshold) and torch's AdamW (DeepSpeed's own needs its
    ops built); no gradient clipping, as the other modes."""
    return {
        "train_micro_batch_size_per_gpu": batch_per_rank,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
    }


def _patch(model, kind: str, opts: dict, row: dict) -> int:
    """Patches as _hf_model does, with `opts`; notes in `row` whether the weights were partitioned then."""
    row["partitioned_at_patch"] = any(hasattr(p, "ds_id") for p in model.parameters())
    if kind == "qwen3_moe":
        model.set_experts_implementation("ffn_ext")
    return ffn_ext.patch_hf_model(model, strict=True, **opts)


def _load_partitioned(model, args, size: tuple) -> None:
    """The seeded model's weights (built plainly) into `model`'s ZeRO-3 partitions: rank 0 writes them gathered,
    DeepSpeed partitions them anew (Qwen3-MoE's experts, torch.empty until initialised, were memory's garbage)."""
    import deepspeed
    import torch.distributed as dist

    torch.manual_seed(args.seed)
    plain = dict(_hf_model(args.model, size, patched=False, pad_token_id=None)[0].named_parameters())
    params = dict(model.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=0), torch.no_grad():
        if dist.get_rank() == 0:
            for k, p in params.items():
                p.copy_(plain[k])


def _gathered_weights(model) -> dict:
    import deepspeed

    params = dict(model.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
        return {k: p.detach().clone() for k, p in params.items()}


def run_zero3(mode: str, args, size: tuple, batches, patched: bool = True, opts=None, path=None) -> dict:
    """One ZeRO-3 run on this rank (the process group up, DS_ACCELERATOR=cpu): `mode` zero3 (the model built
    plainly, patched, then deepspeed.initialize), zero3_init (built under deepspeed.zero.Init: partitioned before the
    patch) or trainer_zero3 (Trainer with a ZeRO-3 config and from_pretrained of the model saved at `path`, patched
    before the Trainer); each rank its half of the batch. Returns its row with the patched count, the ffn_ext op
    counts over every step, and the gathered final weights ("weights", not printed)."""
    import deepspeed
    import torch.distributed as dist

    opts = opts or {}
    rank, world = dist.get_rank(), dist.get_world_size()
    steps, batch, seq = batches.shape
    cfg = zero3_config(batch // world)
    _release_freed_memory()
    peak_ok = _reset_peak_rss()
    start_rss = _status_kib("VmRSS") / 1024
    ops, times, losses = _FFNExtOps(), [], []
    if mode == "trainer_zero3":
        return _trainer_zero3(args, batches, patched, opts, path, cfg, ops, start_rss, peak_ok)
    import transformers

    # the modeling modules imported outside zero.Init: its patched torch.Tensor.__new__ fails torch._dynamo's imports
    transformers.LlamaForCausalLM, transformers.Qwen3MoeForCausalLM  # noqa: B018
    torch.manual_seed(args.seed)
    init = deepspeed.zero.Init(config_dict_or_path=cfg) if mode == "zero3_init" else contextlib.nullcontext()
    with init:  # (no padding row: transformers' init zeroes it by indexing the weight, empty when partitioned)
        model, _ = _hf_model(args.model, size, patched=False, pad_token_id=None if mode == "zero3_init" else 0)
    if mode == "zero3_init":  # transformers' init ran on the empty partitions: load the weights, as from_pretrained
        _load_partitioned(model, args, size)
    row: dict = {}
    n = _patch(model, args.model, opts, row) if patched else 0
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    engine, *_ = deepspeed.initialize(model=model.train(), optimizer=opt, config=cfg)
    for ids in batches:
        t0 = time.perf_counter()
        with ops:
            mine = ids.tensor_split(world)[rank]
            loss = engine(input_ids=mine, labels=mine).loss
            engine.backward(loss)
        ops.steps.append(sum(ops.counts.values()) - sum(ops.steps))
        engine.step()
        times.append(time.perf_counter() - t0)
        reported = loss.detach().clone()
        dist.all_reduce(reported)
        losses.append(float(reported) / world)
    row.update(_row(mode, losses, times, start_rss, peak_ok, ops), patched=n, op_counts=ops.counts, op_steps=ops.steps)
    row["params_mib"] = sum(p.ds_tensor.nbytes for p in model.parameters()) / MiB  # this rank's partitions
    row["weights"] = _gathered_weights(engine.module)
    if not patched:  # patching after deepspeed.initialize: the hooked MLPs are named with what to do, not patched
        import warnings

        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            ffn_ext.patch_hf_model(engine.module)
        row["late_named"] = any("already hooked" in str(w.message) for w in seen)
    del engine, model, opt
    return row


def _trainer_zero3(args, batches, patched, opts, path, cfg, ops, start_rss, peak_ok) -> dict:
    import tempfile

    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    steps, batch, seq = batches.shape
    data = batches.reshape(steps * batch, seq)

    class Sequences(torch.utils.data.Dataset):
        def __len__(self):
            return len(data)

        def __getitem__(self, i):
            return {"input_ids": data[i], "labels": data[i]}

    targs = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="ffn_ext_trainer_"),
        deepspeed=cfg,
        per_device_train_batch_size=cfg["train_micro_batch_size_per_gpu"],
        max_steps=steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,
        optim="adamw_torch",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        train_sampling_strategy="sequential",
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=args.seed,
    )
    model = AutoModelForCausalLM.from_pretrained(path)  # under deepspeed.zero.Init: the TrainingArguments say ZeRO-3
    row: dict = {}
    n = _patch(model, args.model, opts, row) if patched else 0
    times: list = []

    class Watch(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            ops.__enter__()
            times.append(time.perf_counter())

        def on_step_end(self, a, state, control, **kw):
            ops.__exit__(None, None, None)
            ops.steps.append(sum(ops.counts.values()) - sum(ops.steps))
            times[-1] = time.perf_counter() - times[-1]

    trainer = Trainer(model=model, args=targs, train_dataset=Sequences(), callbacks=[Watch()])
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    row.update(_row("trainer_zero3", losses, times, start_rss, peak_ok, ops), patched=n, op_counts=ops.counts)
    row.update(op_steps=ops.steps, params_mib=sum(p.ds_tensor.nbytes for p in model.parameters()) / MiB)
    row["weights"] = _gathered_weights(trainer.model)
    del trainer, model
    return row


def save_tiny(args, size: tuple, path: str) -> None:
    """The seeded model, saved for from_pretrained (trainer_zero3)."""
    torch.manual_seed(args.seed)
    model, _ = _hf_model(args.model, size, patched=False)
    model.save_pretrained(path)


def zero3_row(mode: str, args, size: tuple, batches) -> dict:
    """A ZeRO-3 mode's row for the table: the patched run, its losses compared with the same run unpatched
    ("ref_losses"; trainer_zero3's Trainer shuffles nothing but seeds its own way, so 1proc's are others)."""
    import importlib.util
    import tempfile

    import torch.distributed as dist

    if importlib.util.find_spec("deepspeed") is None:
        return {"mode": mode, "skipped": "deepspeed is not installed (DS_BUILD_OPS=0 pip install deepspeed)"}
    path = os.path.join(tempfile.gettempdir(), f"ffn_ext_zero3_{args.model}_{os.getppid()}")  # the ranks' torchrun
    if mode == "trainer_zero3" and dist.get_rank() == 0 and not os.path.isdir(path):
        save_tiny(args, size, path)
    dist.barrier()
    ref = run_zero3(mode, args, size, batches, patched=False, path=path)
    row = run_zero3(mode, args, size, batches, path=path)
    diff = max(float((row["weights"][k] - w).abs().max()) for k, w in ref["weights"].items())
    del row["weights"], ref["weights"]
    nan = float("nan")  # DeepSpeed holds the gradients and AdamW state in its own partitioned buffers: not counted
    return {**row, "ref_losses": ref["losses"], "weights_max_diff": diff, "grads_mib": nan, "optim_mib": nan}


def zero3_check(modes=ZERO3_MODES, opts=None, path=None, **overrides) -> tuple[list, dict]:
    """For a test inside an initialised 2-rank process group (tests/test_zero3.py): each of `modes` at the --quick
    size, patched with `opts` and unpatched; returns (failures, {mode: its patched row, without the weights, plus
    "weights_max_diff"}). A mode fails unless every gated MLP was patched (zero3_init and trainer_zero3: on weights
    partitioned then, as zero.Init leaves them), every step ran ffn_ext's ops, and every loss and gathered final
    weight is within 1e-5 of the unpatched run's."""
    args = parser().parse_args(["--quick"])
    vars(args).update(overrides)
    size = SIZES["quick"]
    g = torch.Generator().manual_seed(args.seed + 1)
    batches = torch.randint(3, size[5], (args.steps, size[6], size[7]), generator=g)
    failures, rows = [], {}
    for mode in modes:
        ref = run_zero3(mode, args, size, batches, patched=False, path=path)
        got = run_zero3(mode, args, size, batches, opts=opts, path=path)
        w_ref, w = ref.pop("weights"), got.pop("weights")
        diff = max(float((w[k] - w_ref[k]).abs().max()) for k in w_ref)
        loss_diff = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"]))
        rows[mode] = {**got, "weights_max_diff": diff, "loss_max_diff": loss_diff}
        if got["patched"] < size[2]:
            failures.append(f"{mode}: {got['patched']} modules patched, of {size[2]} gated MLPs")
        if len(got["losses"]) != args.steps or not loss_diff <= 1e-5:
            failures.append(f"{mode}: losses {got['losses']} against unpatched {ref['losses']}")
        if not diff <= 1e-5:
            failures.append(f"{mode}: gathered weights differ from unpatched by {diff:.2e}")
        if len(got["op_steps"]) != args.steps or not all(got["op_steps"]):
            failures.append(f"{mode}: ffn_ext ops per step {got['op_steps']}: some step ran none")
        if got["partitioned_at_patch"] != (mode != "zero3"):
            failures.append(
                f"{mode}: the weights were {'' if got['partitioned_at_patch'] else 'not '}partitioned at patch"
            )
        if ref.get("late_named") is False:
            failures.append(f"{mode}: patching after deepspeed.initialize did not name the hooked MLPs")
        if ref["op_counts"]:
            failures.append(f"{mode}: the unpatched run ran ffn_ext ops {ref['op_counts']}")
    return failures, rows


# ---------------------------------------------------------------- the ranks
def worker(args) -> int:
    import torch.distributed as dist

    if any(m in ZERO3_MODES for m in args.modes.split(",")):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed is first imported

    torch.set_num_threads(args.threads)
    size = SIZES["quick" if args.quick else "full"]
    vocab, batch, seq = size[5], size[6], size[7]
    g = torch.Generator().manual_seed(args.seed + 1)
    batches = torch.randint(3, vocab, (args.steps, batch, seq), generator=g)
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    mesh = None
    if distributed:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
    modes = [m for m in args.modes.split(",") if m]
    if args.model == "titan_llama3":
        modes = [m for m in modes if m in ("1proc", "1proc_unpatched", "fsdp2")]
    if not distributed:
        modes = [m for m in modes if m.startswith("1proc")]
    results = []
    t_all = time.perf_counter()
    for mode in modes:
        if mode in ZERO3_MODES:
            r = zero3_row(mode, args, size, batches)
        elif mode.startswith("trainer"):
            r = run_trainer(mode, args, size, batches)
        else:
            r = run_mode(mode, args, size, batches, mesh)
        results.append(r)
        if rank == 0:
            print(f"[{mode}] done in {r.get('total_s', 0):.1f}s", file=sys.stderr, flush=True)
    wall = time.perf_counter() - t_all
    per_rank = [results]
    if distributed:
        per_rank = [None] * world
        dist.all_gather_object(per_rank, results)
        # the modes' models (Trainer's DistributedDataParallel among them) go before their process group: one left to
        # the interpreter's exit aborted a rank ("terminate called without an active exception")
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    if rank != 0:
        return 0
    return report(args, size, world, per_rank, wall)


def report(args, size, world, per_rank, wall) -> int:
    ref = next((r for r in per_rank[0] if r["mode"] == "1proc"), None)
    rows, failed, ops_seen = [], [], {}
    what = (
        "torchtitan llama3 debugmodel (dim 256 -> 768, 6 layers, SDPA attention)"
        if args.model == "titan_llama3"
        else f"{args.model}, hidden {size[0]} -> {size[1]}, {size[2]} layers"
    )
    print(
        f"\nffn_ext: {what}, batch {size[6]} x {size[7]} tokens, {args.steps} AdamW steps (lr {args.lr}, no weight "
        f"decay), {world} gloo rank(s), CPU, "
        f"lean autograd, torch {torch.__version__}"
    )
    head = (
        f"{'mode':16s} {'max rel diff':>12s} {'params':>8s} {'grads':>8s} {'AdamW':>8s} {'peak RSS':>17s} "
        f"{'start':>7s} {'step s':>7s}  losses"
    )
    print(head + "\n" + "-" * len(head))
    for i, r0 in enumerate(per_rank[0]):
        if "skipped" in r0:
            print(f"{r0['mode']:16s} skipped: {r0['skipped']}")
            rows.append(r0)
            continue
        ranks = [pr[i] for pr in per_rank]
        base = r0.get("ref_losses", ref["losses"] if ref else None)  # ZeRO-3: its run unpatched
        diff = max(abs(a - b) / abs(b) for a, b in zip(r0["losses"], base)) if base else float("nan")
        ok = diff <= args.rtol
        if not ok:
            failed.append(r0["mode"])
        peaks = "/".join(f"{r['rss_peak_mib']:.0f}" for r in ranks)
        print(
            f"{r0['mode']:16s} {diff:12.2e} {r0['params_mib']:8.2f} {r0['grads_mib']:8.2f} {r0['optim_mib']:8.2f} "
            f"{peaks:>17s} {r0['rss_start_mib']:7.0f} {r0['step_s_median']:7.3f}  "
            + " ".join(f"{x:.6f}" for x in r0["losses"])
            + ("" if ok else "  FAIL")
        )
        ops_seen[r0["mode"]] = r0["ffn_ext_ops"]
        if "op_counts" in r0:  # ZeRO-3: counted over every step
            counts = ", ".join(f"{k} x{v}" for k, v in sorted(r0["op_counts"].items()))
            ops_seen[r0["mode"]] = [
                f"{counts or 'none'} over the {len(r0['op_steps'])} steps ({r0['op_steps']} a step; "
                f"{r0['patched']} modules patched; gathered weights {r0['weights_max_diff']:.1e} "
                "from unpatched)"
            ]
        rows.append({**r0, "max_rel_diff_vs_1proc": diff, "per_rank": ranks})
    for mode, ops in ops_seen.items():
        wrapped = next((r.get("wrapped") for r in per_rank[0] if r["mode"] == mode), None)
        wrapped = f"; Trainer wrapped the model in {wrapped}" if wrapped else ""
        when = "" if mode in ZERO3_MODES else " in step 1"
        print(f"  {mode}: ffn_ext ops{when}: {', '.join(ops) or 'none'}{wrapped}")
    print(
        f"(MiB per rank, rank 0's; peak RSS of every rank; max rel diff: the largest of the steps' "
        f"|loss - 1proc| / 1proc (ZeRO-3 modes: their run unpatched), tolerance {args.rtol:g}; whole run {wall:.1f}s)"
    )
    if args.json:
        meta = {"model": args.model, "size": size, "steps": args.steps, "lr": args.lr, "world": world}
        meta.update(torch=torch.__version__, rtol=args.rtol, wall_s=wall)
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    if failed:
        print(f"FAILED: {', '.join(failed)} not within {args.rtol:g} of one process", file=sys.stderr)
        return 1
    return 0


def check(mesh, modes=("fsdp2", "tp", "tp_lean"), **overrides) -> list:
    """For a test inside an initialised process group (tests/test_distributed.py): `modes` at the --quick size
    against 1proc, run on this rank in the group of `mesh`; returns what failed (empty when every mode's losses are
    within rtol of one process's and its first step ran ffn_ext's ops)."""
    args = parser().parse_args(["--quick"])
    vars(args).update(overrides)
    size = SIZES["quick"]
    g = torch.Generator().manual_seed(args.seed + 1)
    batches = torch.randint(3, size[5], (args.steps, size[6], size[7]), generator=g)
    ref = run_mode("1proc", args, size, batches, mesh)
    failures = []
    for mode in modes:
        r = (
            run_trainer(mode, args, size, batches)
            if mode.startswith("trainer")
            else run_mode(mode, args, size, batches, mesh)
        )
        if "skipped" in r:
            failures.append(f"{mode}: skipped ({r['skipped']})")
            continue
        diff = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"]))
        if len(r["losses"]) != len(ref["losses"]) or not diff <= args.rtol:
            failures.append(f"{mode}: losses {r['losses']} against one process's {ref['losses']} ({diff:.2e})")
        if not r["ffn_ext_ops"]:
            failures.append(f"{mode}: no ffn_ext op ran in the first step")
    return failures


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=("llama", "qwen3_moe", "titan_llama3"), default="llama")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES + ZERO3_MODES)}")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rtol", type=float, default=1e-4, help="per-step loss tolerance against 1proc (relative)")
    p.add_argument("--quick", action="store_true", help="tiny widths: seconds of compute")
    p.add_argument("--nproc", type=int, default=2, help="ranks, when this script starts torchrun itself")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--json", help="write the results here (rank 0)")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if "RANK" in os.environ or args.nproc == 1:
        return worker(args)
    # not under torchrun: start it, with the same arguments
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}"]
    return subprocess.call(cmd + [__file__, *(argv if argv is not None else sys.argv[1:])])


if __name__ == "__main__":
    sys.exit(main())
