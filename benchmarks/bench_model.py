#!/usr/bin/env python
"""Whole-model training step: a Hugging Face causal LM's forward, loss, backward and AdamW step, unpatched and with
ffn_ext (and torch.compile, and Liger-Kernel where it runs), per variant: tokens/s, memory and the loss after K steps.

    python benchmarks/bench_model.py --quick                      # CPU here (< 5 min on 2 cores), GPU where there is one
    python benchmarks/bench_model.py --quick --device cuda --out $OUT/bench_model
    python benchmarks/bench_model.py --smoke --out /tmp/m         # tiny widths, seconds: CI's pipeline check
    python benchmarks/bench_model.py --device cuda --quick --plan # what would run, without running (no GPU needed)
    python benchmarks/bench_model.py --models llama-3-8b --tokens 512 --json /tmp/m.json

Models, random init from transformers configs (no downloads), at real widths with few layers and a vocabulary of
1024 (the embedding and LM head are not the MLP's business; at 128k-256k entries they dominate memory):
Llama-3-8B (SwiGLU, 4096 -> 14336), Qwen3-30B-A3B (2048, 128 experts of 768, top 8), GPT-OSS-20B (2880, 32 experts
of 2880, top 4, clamped SwiGLU, interleaved) and Gemma-3-4B (tanh GeGLU, 2560 -> 10240). On the CPU the MoE models
keep their widths and top-k with fewer experts (16 and 8): the saved activations depend on tokens x top-k, not on
the number of experts, which only sets the parameters' and AdamW's memory.

Variants (each a deep copy of one seeded model, so every variant starts from the same weights and trains on the
same batches, a new one of uniform random tokens each step): unpatched (MoE: transformers' grouped_mm experts);
ffn_ext.patch_hf_model default, recompute=True, token_chunk=N (dense models); experts_implementation="ffn_ext" (MoE);
torch.compile of the unpatched and of the patched model; Liger-Kernel (GPU only): its MLP kernel alone (SwiGLU,
GeGLU, Qwen3-MoE's experts) against ffn_ext's, all its kernels, and its other kernels (RMSNorm, RoPE, fused linear
cross-entropy) with ffn_ext's MLP. They run round the models in PRIORITY order, torch.compile last.

Figures: tokens/s (tokens of a step / the median step time over the steps after warm-up; CUDA: synchronised
wall-clock of the whole step); the bytes autograd saves for backward in one step (saved_tensors_hooks, each storage
once, parameters not counted); the peak of one step's forward + backward above its start (CUDA: max allocated; CPU:
the CPU allocator's allocations and frees through torch.profiler); the variant's peak memory (CUDA: max allocated
above what was allocated before the variant's model copy; CPU: peak RSS above the RSS before it, the kernel's
high-water mark reset per variant); the loss at step K (the last step's forward, after K - 1 AdamW updates)
relative to unpatched. Writes model.md, model.json (--json PATH: also there) and model.png; the JSON and the table
are rewritten after every variant, so a run cut short keeps what ran. Numbers on a CPU are not a GPU's: on a CPU
ffn_ext's ops are PyTorch's own (the lean autograd's recompute costs time there), and the time is wall-clock on
whatever else the machine runs.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import importlib.util
import inspect
import json
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import torch  # noqa: E402

import ffn_ext  # noqa: E402


# ---------------------------------------------------------------- models
@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    config: str  # transformers config class
    causal_lm: str  # transformers model class
    kind: str  # "dense" or "moe"
    mlp: str  # what its MLP computes, for the table (mlp_label fills in the widths)
    kw: dict  # the config at real widths (layers, vocabulary and experts set per run)
    tiny: dict  # the smoke run's widths
    liger: str  # liger_kernel.transformers.apply_liger_kernel_to_<liger>
    liger_mlp: str | None  # that function's MLP switch, None where Liger has no kernel for this MLP
    layer_types: tuple = ()  # the attention pattern, cut to the layers run


_ATTN_TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
MODELS = {
    m.name: m
    for m in (
        ModelSpec(
            "llama-3-8b",
            "LlamaConfig",
            "LlamaForCausalLM",
            "dense",
            "SwiGLU {H}->{I}",
            dict(
                hidden_size=4096,
                intermediate_size=14336,
                num_attention_heads=32,
                num_key_value_heads=8,
                head_dim=128,
                max_position_embeddings=131072,
                rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
            ),
            dict(_ATTN_TINY, intermediate_size=128),
            "llama",
            "swiglu",
        ),
        ModelSpec(
            "qwen3-30b-a3b",
            "Qwen3MoeConfig",
            "Qwen3MoeForCausalLM",
            "moe",
            "MoE SwiGLU {H}->{I} x{E} top {k}",
            dict(
                hidden_size=2048,
                intermediate_size=6144,
                moe_intermediate_size=768,
                num_experts=128,
                num_experts_per_tok=8,
                num_attention_heads=32,
                num_key_value_heads=4,
                head_dim=128,
                norm_topk_prob=True,
            ),
            dict(_ATTN_TINY, intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2),
            "qwen3_moe",
            "swiglu",
        ),
        ModelSpec(
            "gpt-oss-20b",
            "GptOssConfig",
            "GptOssForCausalLM",
            "moe",
            "MoE clamped SwiGLU {H}->{I} x{E} top {k}",
            dict(
                hidden_size=2880,
                intermediate_size=2880,
                num_local_experts=32,
                num_experts_per_tok=4,
                num_attention_heads=64,
                num_key_value_heads=8,
                head_dim=64,
                sliding_window=128,
            ),
            dict(_ATTN_TINY, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
            "gpt_oss",
            None,  # Liger leaves GPT-OSS's clamped experts alone (its swiglu switch is off and not implemented)
            ("sliding_attention", "full_attention"),
        ),
        ModelSpec(
            "gemma-3-4b",
            "Gemma3TextConfig",
            "Gemma3ForCausalLM",
            "dense",
            "GeGLU (tanh) {H}->{I}",
            dict(
                hidden_size=2560,
                intermediate_size=10240,
                num_attention_heads=8,
                num_key_value_heads=4,
                head_dim=256,
                query_pre_attn_scalar=256,
                sliding_window=1024,
            ),
            dict(_ATTN_TINY, intermediate_size=128, query_pre_attn_scalar=16, sliding_window=8),
            "gemma3_text",
            "geglu",
            ("sliding_attention", "full_attention"),
        ),
    )
}
EXPERTS_KEY = {"qwen3-30b-a3b": "num_experts", "gpt-oss-20b": "num_local_experts"}


# ---------------------------------------------------------------- variants
@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    what: str
    kinds: tuple = ("dense", "moe")
    patch: dict | None = None  # patch_hf_model's keyword arguments; None: not patched
    experts: str | None = None  # MoE: the experts implementation ("grouped_mm", "ffn_ext", "eager")
    compile: bool = False
    liger: str | None = None  # "mlp": Liger's MLP kernel only; "all": all its kernels; "rest": all but the MLP


def variants_for(token_chunk: int) -> list[Variant]:
    return [
        Variant("unpatched", "transformers as is (MoE: grouped_mm experts)", experts="grouped_mm"),
        Variant("ffn_ext", "patch_hf_model(model) (MoE: the experts' gating)", patch={}, experts="grouped_mm"),
        Variant("recompute", "patch_hf_model(model, recompute=True)", ("dense",), patch={"recompute": True}),
        Variant(
            "token_chunk",
            f"patch_hf_model(model, token_chunk={token_chunk})",
            ("dense",),
            patch={"token_chunk": token_chunk},
        ),
        Variant("experts=ffn_ext", 'set_experts_implementation("ffn_ext")', ("moe",), experts="ffn_ext"),
        Variant(
            "fp8 cache",
            "patch_hf_model(model, saved_dtype=torch.float8_e4m3fn) (MoE: with experts=ffn_ext)",
            patch={"saved_dtype": torch.float8_e4m3fn},
            experts="ffn_ext",
        ),
        Variant("experts=eager", 'set_experts_implementation("eager"), unpatched', ("moe",), experts="eager"),
        Variant("compile", "torch.compile(unpatched)", experts="grouped_mm", compile=True),
        Variant(
            "compile+ffn_ext",
            "torch.compile(patch_hf_model(model)) (MoE: of experts=ffn_ext)",
            patch={},
            experts="ffn_ext",
            compile=True,
        ),
        Variant(
            "liger-mlp", "Liger's MLP kernel only (SwiGLU / GeGLU / MoE experts)", experts="grouped_mm", liger="mlp"
        ),
        Variant("liger-all", "all of Liger's kernels for the model (its default)", experts="grouped_mm", liger="all"),
        Variant(
            "liger-rest+ffn_ext",
            "Liger's RMSNorm, RoPE, fused linear CE + patch_hf_model (MoE: experts=ffn_ext)",
            patch={},
            experts="ffn_ext",
            liger="rest",
        ),
    ]


# ---------------------------------------------------------------- plans
@dataclasses.dataclass
class Plan:
    models: list[str]
    tokens: list[int]
    batch: int
    layers: list[int]  # layer counts: a stack at each (the per-layer figures are the slopes over them)
    experts: dict  # model -> number of experts
    warmup: int
    steps: int
    dtype: str
    token_chunk: int | None
    variants: list[str]
    compile_models: list[str]
    lr: float
    optimizer: str = "adamw"  # or "sgd": no optimizer state, so that a stack at real widths fits a CPU's memory


# the run order (see main)
PRIORITY = [
    "unpatched",
    "recompute",
    "experts=ffn_ext",
    "ffn_ext",
    "fp8 cache",
    "token_chunk",
    "experts=eager",
    "liger-mlp",
    "liger-rest+ffn_ext",
    "liger-all",
    "compile",
    "compile+ffn_ext",
]
# --quick on a CPU starts no variant past this (the whole run then ends within 5 minutes on a loaded 2-core machine;
# unloaded it takes about 3)
CPU_QUICK_BUDGET_S = 240.0
QUICK_VARIANTS = ["unpatched", "ffn_ext", "recompute", "token_chunk", "experts=ffn_ext", "compile", "compile+ffn_ext"]
LIGER_VARIANTS = ["liger-mlp", "liger-all", "liger-rest+ffn_ext"]


def plan_for(mode: str, device_type: str) -> Plan:
    all_models = list(MODELS)
    real_experts = {m: MODELS[m].kw[k] for m, k in EXPERTS_KEY.items()}
    if mode == "smoke":
        return Plan(all_models, [32], 1, [2], {}, 1, 1, "fp32", 8, QUICK_VARIANTS + LIGER_VARIANTS, [], 1e-4)
    if device_type == "cuda":
        base = QUICK_VARIANTS + LIGER_VARIANTS
        if mode == "quick":  # a device check's stage: compile of one model only, last
            return Plan(all_models, [4096], 1, [2], real_experts, 2, 5, "bf16", 1024, base, ["llama-3-8b"], 1e-4)
        return Plan(
            all_models,
            [4096, 16384],
            1,
            [2],
            real_experts,
            3,
            10,
            "bf16",
            2048,
            base + ["experts=eager"],
            all_models,
            1e-4,
        )
    cpu_experts = {"qwen3-30b-a3b": 16, "gpt-oss-20b": 8}
    if mode == "quick":  # under 5 minutes on 2 cores: 1 layer, 128 tokens, 1 + 2 steps, no torch.compile
        return Plan(all_models, [128], 1, [1], cpu_experts, 1, 2, "fp32", 32, QUICK_VARIANTS + LIGER_VARIANTS, [], 1e-4)
    return Plan(
        all_models,
        [512],
        1,
        [1],
        cpu_experts,
        1,
        3,
        "fp32",
        128,
        QUICK_VARIANTS + LIGER_VARIANTS + ["experts=eager"],
        all_models,
        1e-4,
    )


# ---------------------------------------------------------------- building
def build_config(spec: ModelSpec, plan: Plan, tiny: bool, layers: int):
    import transformers

    kw = dict(spec.tiny if tiny else spec.kw)
    kw.update(vocab_size=128 if tiny else 1024, num_hidden_layers=layers, tie_word_embeddings=False)
    if spec.name in EXPERTS_KEY and not tiny and spec.name in plan.experts:
        kw[EXPERTS_KEY[spec.name]] = plan.experts[spec.name]
    if spec.layer_types:
        kw["layer_types"] = [spec.layer_types[i % len(spec.layer_types)] for i in range(layers)]
    return getattr(transformers, spec.config)(**kw)


def build_model(spec: ModelSpec, config, dev: torch.device, dtype: torch.dtype, seed: int):
    import transformers

    torch.manual_seed(seed)
    with torch.device(dev):
        model = getattr(transformers, spec.causal_lm)(config)
    return model.to(dtype).train()


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def experts_count(config) -> int | None:
    return getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)


def mlp_label(spec: ModelSpec, config) -> str:
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    k = getattr(config, "num_experts_per_tok", None)
    return spec.mlp.format(H=config.hidden_size, I=inter, E=experts_count(config), k=k)


@contextlib.contextmanager
def restored(*modules):
    """Liger's apply functions also rebind module-level names (modeling_llama.apply_rotary_pos_emb, the RMSNorm
    class, ...) that every later model would use: put each module's namespace back afterwards."""
    saved = [(m, dict(vars(m))) for m in modules]
    try:
        yield
    finally:
        for m, d in saved:
            for k in set(vars(m)) - set(d):
                delattr(m, k)
            for k, v in d.items():
                if vars(m).get(k) is not v:
                    setattr(m, k, v)


def apply_liger(spec: ModelSpec, model, which: str) -> str:
    """Applies Liger-Kernel's patch for this model to the instance; returns what it applied."""
    import liger_kernel.transformers as lk

    fn = getattr(lk, f"apply_liger_kernel_to_{spec.liger}", None)
    if fn is None:
        raise RuntimeError(f"liger_kernel has no apply_liger_kernel_to_{spec.liger}")
    params = inspect.signature(fn).parameters
    switches = [p for p in ("rope", "rms_norm", "fused_linear_cross_entropy") if p in params]
    mlp = spec.liger_mlp
    kw: dict = {"cross_entropy": False} if "cross_entropy" in params else {}
    if which == "mlp":
        kw.update({p: False for p in switches}, **({mlp: True} if mlp else {}))
    elif which == "all":
        kw.update({p: True for p in switches}, **({mlp: True} if mlp else {}))
    else:
        kw.update({p: True for p in switches}, **({mlp: False} if mlp and mlp in params else {}))
    fn(model=model, **kw)
    return f"{fn.__name__}({', '.join(f'{k}={v}' for k, v in kw.items())})"


def modeling_modules(model) -> list:
    mods = [sys.modules[type(model).__module__]]
    if "transformers.loss.loss_utils" in sys.modules:
        mods.append(sys.modules["transformers.loss.loss_utils"])
    return mods + [torch.nn.functional]


# ---------------------------------------------------------------- one variant
def run_variant(
    spec, variant: Variant, pristine, plan: Plan, tokens: int, dev, batches, log, notes, build=None
) -> dict:
    """Copies the pristine model (or, with `build`, builds it anew: the same seeded weights), applies the variant,
    runs warm-up + timed steps; the row of the table."""
    common.free_memory(dev)
    common.release_heap()
    base_rss = common.rss_bytes()
    common.reset_peak_rss()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        base_cuda = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    model = copy.deepcopy(pristine) if build is None else build()
    applied = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if spec.kind == "moe" and variant.experts:
            model.set_experts_implementation(variant.experts)
            applied.append(f"experts={model.config._experts_implementation}")
        if variant.liger:
            applied.append(apply_liger(spec, model, variant.liger))
        # under experts_implementation="ffn_ext" the experts compute their gating themselves: the patched
        # _apply_gate would not be called (these MoE models have no dense MLP to patch); a patch with options
        # (saved_dtype) still runs, as that implementation reads them from the patched experts
        moe_ffn_ext = spec.kind == "moe" and variant.experts == "ffn_ext"
        if variant.patch is not None and (variant.patch or not moe_ffn_ext):
            n = ffn_ext.patch_hf_model(model, **variant.patch)
            applied.append(f"patch_hf_model({', '.join(f'{k}={v}' for k, v in variant.patch.items())}): {n} modules")
    for w in caught:
        if issubclass(w.category, RuntimeWarning) and "ffn_ext" in str(w.message):
            notes.append(f"{spec.name} / {variant.name}: {str(w.message)[:300]}")
    params = list(model.parameters())
    opt = make_optimizer(plan.optimizer, params, plan.lr)
    step_model = torch.compile(model) if variant.compile else model
    times, losses, saved, step_peak, overall = [], [], None, None, 0
    total = plan.warmup + plan.steps
    # the step whose forward + backward is measured (saved bytes, its own peak): the first, or under compile the last
    # warm-up step (the first one compiles); none when a compiled variant has a single warm-up step
    probe = (plan.warmup - 1 if plan.warmup >= 2 else None) if variant.compile else 0
    for i in range(total):
        common.synchronize(dev)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if i == probe:
            if dev.type == "cuda":
                overall = max(overall, torch.cuda.max_memory_allocated(dev))
                torch.cuda.reset_peak_memory_stats(dev)
                start = torch.cuda.memory_allocated(dev)
            # the saved-tensors hooks would change what dynamo traces: not under compile
            hooks = contextlib.nullcontext() if variant.compile else common.SavedTensors(exclude=params)
            allocs = common.CpuAllocPeak() if dev.type == "cpu" else contextlib.nullcontext()
            with allocs:
                with hooks:  # the forward only: a backward that recomputes under grad mode saves tensors too
                    loss = step_model(input_ids=batches[i], labels=batches[i]).loss
                loss.backward()
            saved = None if variant.compile else hooks.extra_bytes
            if dev.type == "cuda":
                step_peak = int(torch.cuda.max_memory_allocated(dev) - start)
            else:
                step_peak = allocs.peak
                del allocs
                if i + 1 < total:  # the profiler's own buffers are no step's: the next steps redo this one's peak
                    common.reset_peak_rss()
        else:
            loss = step_model(input_ids=batches[i], labels=batches[i]).loss
            loss.backward()
        opt.step()
        common.synchronize(dev)
        dt = time.perf_counter() - t0
        losses.append(float(loss.detach()))
        if i >= plan.warmup:
            times.append(dt)
        log(f"step {i + 1}/{total} {dt:.2f}s loss {losses[-1]:.5f}")
    row = {
        "model": spec.name,
        "variant": variant.name,
        "what": variant.what,
        "applied": applied,
        "tokens": tokens,
        "median_s": statistics.median(times),
        "times_s": times,
        "tokens_per_s": tokens / statistics.median(times),
        "saved_bytes": saved,
        "step_peak_bytes": step_peak,
        "losses": losses,
        "loss_k": losses[-1],
    }
    if dev.type == "cuda":
        row["peak_bytes"] = int(max(overall, torch.cuda.max_memory_allocated(dev)) - base_cuda)
        row["peak_kind"] = "CUDA max allocated above the allocation before the variant"
    else:
        peak = common.peak_rss_bytes()
        row["peak_bytes"] = None if peak is None or base_rss is None else int(peak - base_rss)
        row["peak_rss_bytes"] = peak
        row["peak_kind"] = "peak RSS above the RSS before the variant"
    del step_model, model, opt, params, loss
    if variant.compile:
        torch._dynamo.reset()
    return row


def prime(spec: ModelSpec, plan: Plan, dev: torch.device, dtype: torch.dtype) -> None:
    """One step of the model's tiny form, unrecorded: the one-time allocations of its code path (thread pools, BLAS
    and cuBLAS workspaces, lazily imported kernels) would otherwise land in the first variant's peak memory."""
    model = build_model(spec, build_config(spec, plan, tiny=True, layers=1), dev, dtype, 0)
    ids = torch.randint(0, model.config.vocab_size, (1, 16), device=dev)
    opt = make_optimizer(plan.optimizer, list(model.parameters()), 1e-4)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    common.synchronize(dev)


def make_optimizer(kind: str, params, lr: float):
    if kind == "sgd":  # no state: a stack's parameters and gradients are what the step adds to the activations
        return torch.optim.SGD(params, lr=lr)
    try:  # fused: one kernel (CUDA) or loop (CPU) over every tensor, no foreach temporaries in the peak
        return torch.optim.AdamW(params, lr=lr, fused=True)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(params, lr=lr)


# ---------------------------------------------------------------- the run
def why_not(variant: Variant, spec: ModelSpec, plan: Plan, dev, args, mode: str) -> str | None:
    """Why this variant does not run for this model here, or None."""
    if spec.kind not in variant.kinds:
        return ""  # not applicable: not listed
    if variant.compile and spec.name not in plan.compile_models:
        if args.no_compile:
            return "--no-compile"
        if mode == "smoke":
            return "--smoke: no torch.compile (its compile time is what a smoke run cannot afford)"
        if dev.type == "cpu":
            return (
                "torch.compile on a CPU: inductor's C++ build of a whole model's forward and backward takes "
                f"minutes per graph on 2 cores; --{mode} skips it (--compile-models NAME runs it)"
            )
        return "--quick compiles llama-3-8b only (compiling costs device time; --full compiles every model)"
    if variant.liger:
        if dev.type != "cuda":
            return "Liger-Kernel's kernels are Triton GPU kernels: not run on a CPU"
        if importlib.util.find_spec("liger_kernel") is None:
            return "liger_kernel is not installed (pip install liger-kernel)"
        if variant.liger == "mlp" and spec.liger_mlp is None:
            return f"Liger has no kernel for {spec.name}'s MLP (GPT-OSS's clamped, interleaved experts)"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(ap)
    ap.add_argument("--models", default=None, help=f"comma-separated subset of {','.join(MODELS)}")
    ap.add_argument("--variants", default=None, help="comma-separated subset of the variants (see --plan)")
    ap.add_argument("--tokens", default=None, help="tokens per step, comma-separated (batch 1 unless --batch)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (tokens are per sequence)")
    ap.add_argument(
        "--layers",
        default=None,
        help="decoder layers, comma-separated: a stack at each count, and the per-layer figures (the slope of the "
        "step's peak and of the saved bytes against layers) when there are several",
    )
    ap.add_argument(
        "--optimizer",
        choices=("adamw", "sgd"),
        default=None,
        help="the step's optimizer (default adamw; sgd keeps no state, for stacks at real widths on a CPU)",
    )
    ap.add_argument("--experts", type=int, default=None, help="experts of the MoE models (CPU default: 16 and 8)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (K = warmup + steps)")
    ap.add_argument("--token-chunk", type=int, default=None, help="the token_chunk variant's N")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--compile-models", default=None, help="models whose torch.compile variants run")
    ap.add_argument("--json", type=Path, default=None, help="also write the JSON here")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="start no variant past this many seconds (what is left is printed as not run); 0: no limit. "
        f"Default: {CPU_QUICK_BUDGET_S:g} for --quick on a CPU, else none",
    )
    ap.add_argument("--threads", type=int, default=None, help="CPU: torch threads (default: torch's)")
    ap.add_argument("--compile-reserve-s", type=float, default=45.0, help="time a compile variant needs of --budget-s")
    ap.add_argument(
        "--rebuild",
        action="store_true",
        help="build each variant's model anew from the seed (the same weights) instead of copying one kept pristine "
        "model: one model less in memory, for deeper stacks at real widths on a CPU (the pristine is kept on the "
        "meta device)",
    )
    ap.add_argument("--plan", action="store_true", help="print what would run and exit (no model is built)")
    args = ap.parse_args(argv)
    mode = common.mode_of(args)
    if args.device == "auto":
        dev_type = "cuda" if torch.cuda.is_available() else "cpu"
    else:
        dev_type = torch.device(args.device).type
    if dev_type not in ("cpu", "cuda"):
        raise SystemExit(f"--device {args.device}: cpu or cuda")
    plan = plan_for(mode, dev_type)
    if args.dtypes:
        plan.dtype = args.dtypes.split(",")[0].strip()
        if plan.dtype not in common.DTYPES:
            raise SystemExit(f"--dtypes {args.dtypes}: one of {','.join(common.DTYPES)}")
    if args.models:
        plan.models = [m.strip() for m in args.models.split(",")]
        bad = [m for m in plan.models if m not in MODELS]
        if bad:
            raise SystemExit(f"--models: unknown {bad}; known: {','.join(MODELS)}")
    all_variants = {v.name: v for v in variants_for(1)}
    if args.variants:
        plan.variants = [v.strip() for v in args.variants.split(",")]
        bad = [v for v in plan.variants if v not in all_variants]
        if bad:
            raise SystemExit(f"--variants: unknown {bad}; known: {','.join(all_variants)}")
        if "unpatched" not in plan.variants:
            plan.variants.insert(0, "unpatched")  # every figure is relative to it
    if args.layers:
        plan.layers = [int(n) for n in args.layers.split(",")]
    for name in ("batch", "warmup", "steps", "token_chunk", "lr", "optimizer"):
        if getattr(args, name) is not None:
            setattr(plan, name, getattr(args, name))
    if args.tokens:
        plan.tokens = [int(t) for t in args.tokens.split(",")]
    if args.experts:
        plan.experts = {m: args.experts for m in EXPERTS_KEY}
    if args.compile_models is not None:
        plan.compile_models = [m.strip() for m in args.compile_models.split(",") if m.strip()]
    if args.no_compile:
        plan.compile_models = []
    if args.budget_s is None and mode == "quick" and dev_type == "cpu":
        args.budget_s = CPU_QUICK_BUDGET_S
    if args.budget_s == 0:
        args.budget_s = None
    if plan.steps < 1 or plan.warmup < 0 or min(plan.layers) < 1 or plan.batch < 1 or min(plan.tokens) < 2:
        raise SystemExit("--steps >= 1, --warmup >= 0, --layers >= 1, --batch >= 1 and --tokens >= 2")
    variants = {v.name: v for v in variants_for(plan.token_chunk)}

    # the work list: (model, tokens, variant) in run order: the eager variants first, compile last (it costs most)
    work, skipped = [], []
    for tokens in plan.tokens:
        for layers in plan.layers:
            for m in plan.models:
                spec = MODELS[m]
                for vname in plan.variants:
                    v = variants[vname]
                    reason = why_not(v, spec, plan, torch.device(dev_type), args, mode)
                    if reason is None:
                        work.append((m, tokens, layers, v))
                    elif reason and layers == plan.layers[0]:
                        skipped.append({"model": m, "tokens": tokens, "variant": vname, "reason": reason})
    # the run order: by PRIORITY, then model; every model's unpatched row first, the memory options next, torch.compile
    # last (it costs most): a --budget-s cut then drops the least telling rows of every model, not whole models
    work.sort(
        key=lambda w: (
            plan.tokens.index(w[1]),
            plan.layers.index(w[2]),
            PRIORITY.index(w[3].name),
            plan.models.index(w[0]),
        )
    )

    head = (
        f"bench_model {mode} on {dev_type}: {plan.dtype}, {'/'.join(map(str, plan.layers))} layer(s), batch {plan.batch} x tokens "
        f"{plan.tokens}, vocab {128 if mode == 'smoke' else 1024}, {plan.warmup} warm-up + {plan.steps} timed steps "
        f"(K = {plan.warmup + plan.steps}), {'AdamW' if plan.optimizer == 'adamw' else 'SGD'} lr {plan.lr}, token_chunk {plan.token_chunk}"
        + (f", experts {plan.experts}" if plan.experts and mode != "smoke" else "")
    )
    if args.plan:
        print(head)
        for m, tokens, layers, v in work:
            print(f"  run   {m:<14} {tokens:>6} tok {layers:>3} layers  {v.name:<20} {v.what}")
        for s in skipped:
            print(f"  skip  {s['model']:<14} {s['tokens']:>6} tok  {s['variant']:<20} {s['reason']}")
        return 0

    dev = common.resolve_device(args.device)
    # `import ffn_ext` registers experts_implementation="ffn_ext" when transformers' experts interface is imported
    import transformers

    if args.threads:
        torch.set_num_threads(args.threads)
    elif mode == "smoke" and dev.type == "cpu":
        torch.set_num_threads(1)  # as the other smoke runs: OpenMP waits on a busy machine dwarf tiny GEMMs
    if any(v.compile for *_, v in work):
        common.setup_compile()
    dtype = common.DTYPES[plan.dtype]
    notes = [head]
    if dev.type == "cpu":
        notes.append(
            "CPU run: wall-clock medians on a shared machine; on the CPU ffn_ext's ops are PyTorch's own (the lean "
            "autograd's recompute costs time there); memory: saved-for-backward bytes, the forward + backward peak of "
            "the CPU allocator, peak RSS"
        )
    for s in skipped:
        notes.append(f"not run: {s['model']} / {s['variant']}: {s['reason']}")
    out_dir = args.out or common.default_out_dir(dev)
    payload = {
        "meta": common.metadata(dev, mode, sys.argv if argv is None else ["bench_model.py", *argv]),
        "plan": dataclasses.asdict(plan),
        "models": {},
        "results": [],
        "skipped": skipped,
        "notes": notes,
        "errors": [],
    }
    payload["meta"].update(
        transformers_version=transformers.__version__, ffn_ext_path=str(Path(ffn_ext.__file__).parent)
    )
    t_start = time.perf_counter()
    quiet = args.no_progress

    def write_partial():  # after every variant: a run cut short (a device stage's time limit) keeps what ran
        out_dir.mkdir(parents=True, exist_ok=True)
        relate(payload["results"])
        payload["per_layer"] = per_layer(payload["results"], payload["models"])
        text = json.dumps(payload, indent=1, default=str) + "\n"
        (out_dir / "model.json").write_text(text)
        (out_dir / "model.md").write_text(render(payload) + "\n")
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(text)

    pristines: dict = {}  # (model, layers) -> its seeded, untouched copy (every model's: the run goes round them)
    took: dict = {}  # (model, tokens, layers) -> seconds its longest variant so far took
    for k, (m, tokens, layers, v) in enumerate(work, 1):
        spec = MODELS[m]
        elapsed = time.perf_counter() - t_start
        if args.budget_s is not None:
            # what it will take: as long as this model's longest variant so far, and a compile more
            need = took.get((m, tokens, layers), 0.0) + (args.compile_reserve_s if v.compile else 0.0)
            if elapsed + need > args.budget_s:
                reason = f"--budget-s {args.budget_s:g}: {elapsed:.0f} s spent" + (
                    f", this one needs ~{need:.0f} s" if need else ""
                )
                skipped.append({"model": m, "tokens": tokens, "variant": v.name, "reason": reason})
                notes.append(f"not run: {m} / {v.name}: {reason}")
                print(f"[{k}/{len(work)}] {m} / {v.name}: skipped ({reason})", file=sys.stderr, flush=True)
                continue
        prefix = f"[{k}/{len(work)} {elapsed:5.0f}s] {m} {tokens} tok {layers} layers / {v.name}"

        def log(msg, prefix=prefix):
            if not quiet:
                print(f"{prefix}: {msg}", file=sys.stderr, flush=True)

        if (m, layers) not in pristines:
            for key in [key for key in pristines if key[1] != layers]:  # the stacks of other depths are done
                del pristines[key]
            config = build_config(spec, plan, tiny=mode == "smoke", layers=layers)
            log("building the model")
            # --rebuild: the pristine has no storage (its counts, config and classes only); each variant builds its own
            pristines[m, layers] = pristine = build_model(
                spec, config, torch.device("meta") if args.rebuild else dev, dtype, args.seed
            )
            prime(spec, plan, dev, dtype)
            payload["models"].setdefault(m, {})
            payload["models"][m].update(
                {
                    "class": spec.causal_lm,
                    "mlp": mlp_label(spec, config),
                    f"params_{layers}_layers": n_params(pristine),
                    "layers": plan.layers,
                    "params_per_layer": n_params(pristine.model.layers[0]) if hasattr(pristine, "model") else None,
                    "experts": experts_count(config),
                    "dtype_bytes": torch.finfo(dtype).bits // 8,
                    "attn_implementation": pristine.config._attn_implementation,
                    "config": {k: v for k, v in config.to_dict().items() if isinstance(v, (int, float, str, list))},
                }
            )
        pristine = pristines[m, layers]
        # a new batch of uniform random tokens each step (one fixed batch would be memorised within a few steps, and
        # every variant's loss would collapse to ~0); the same batches for every variant
        g = torch.Generator().manual_seed(args.seed + 1)
        shape = (plan.warmup + plan.steps, plan.batch, tokens)
        batches = torch.randint(0, pristine.config.vocab_size, shape, generator=g).to(dev).unbind(0)
        t_variant = time.perf_counter()
        try:
            # Liger rebinds names in the modeling module that the forward looks up at each call: kept for the
            # variant's steps, then put back so that the next variants run transformers' code
            with restored(*modeling_modules(pristine)) if v.liger else contextlib.nullcontext():
                build = (
                    functools.partial(build_model, spec, pristine.config, dev, dtype, args.seed)
                    if args.rebuild
                    else None
                )
                row = run_variant(spec, v, pristine, plan, tokens * plan.batch, dev, batches, log, notes, build)
            row["mlp"], row["seq_len"], row["layers"] = payload["models"][m]["mlp"], tokens, layers
            payload["results"].append(row)
            log(f"{row['tokens_per_s']:.1f} tokens/s, saved {common.fmt(_mib(row['saved_bytes']), '.1f')} MiB")
        except Exception as e:  # a variant that fails is reported, the others still run
            payload["errors"].append(
                {
                    "model": m,
                    "variant": v.name,
                    "error": f"{type(e).__name__}: {e}"[:1000],
                    "trace": traceback.format_exc()[-3000:],
                }
            )
            print(f"{prefix}: ERROR {type(e).__name__}: {str(e)[:300]}", file=sys.stderr, flush=True)
            torch._dynamo.reset()
        took[m, tokens, layers] = max(took.get((m, tokens, layers), 0.0), time.perf_counter() - t_variant)
        write_partial()
    pristines.clear()
    pristine = batches = None
    payload["wall_s"] = time.perf_counter() - t_start
    relate(payload["results"])
    payload["per_layer"] = per_layer(payload["results"], payload["models"])
    markdown = render(payload)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    from plot import plot_model

    return common.report(args, "model", payload, markdown, plot_model) or (1 if payload["errors"] else 0)


def _mib(b):
    return None if b is None else b / common.MiB


def relate(rows: list[dict]) -> None:
    """Each row's figures relative to the unpatched row of its model and tokens."""
    base = {(r["model"], r["tokens"], r.get("layers")): r for r in rows if r["variant"] == "unpatched"}
    for r in rows:
        b = base.get((r["model"], r["tokens"], r.get("layers")))
        r["speedup"] = _ratio(r["tokens_per_s"], b and b["tokens_per_s"])
        r["saved_vs"] = _ratio(r["saved_bytes"], b and b["saved_bytes"])
        r["peak_vs"] = _ratio(r["peak_bytes"], b and b["peak_bytes"])
        r["step_peak_vs"] = _ratio(r.get("step_peak_bytes"), b and b.get("step_peak_bytes"))
        r["loss_rel"] = None if b is None else r["loss_k"] / b["loss_k"] - 1.0
        r["loss_max_rel"] = None if b is None else max(abs(x / y - 1.0) for x, y in zip(r["losses"], b["losses"]))


def _slope(points: list) -> float | None:
    """The least-squares slope of (x, y) points; None for fewer than two distinct x."""
    xs = [x for x, y in points if y is not None]
    ys = [y for x, y in points if y is not None]
    if len(set(xs)) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def per_layer(rows: list[dict], models: dict) -> list[dict]:
    """Per model, tokens and variant run at several layer counts: the slopes against layers of the step's forward +
    backward peak and of the saved bytes (what one more layer adds), the peak's less the layer's parameter gradients
    (its activations and the backward's transients), each also against unpatched's slope."""
    out = []
    for key in dict.fromkeys((r["model"], r["tokens"], r["variant"]) for r in rows):
        got = sorted((r for r in rows if (r["model"], r["tokens"], r["variant"]) == key), key=lambda r: r["layers"])
        peak = _slope([(r["layers"], r.get("step_peak_bytes")) for r in got])
        if peak is None:
            continue
        per = models.get(key[0], {}).get("params_per_layer")
        grads = None if per is None else per * models[key[0]].get("dtype_bytes", 4)
        out.append(
            {
                "model": key[0],
                "tokens": key[1],
                "variant": key[2],
                "layers": [r["layers"] for r in got],
                "step_peak_per_layer": peak,
                "saved_per_layer": _slope([(r["layers"], r.get("saved_bytes")) for r in got]),
                "grad_bytes_per_layer": grads,
                "activation_per_layer": None if grads is None else peak - grads,
            }
        )
    base = {(o["model"], o["tokens"]): o for o in out if o["variant"] == "unpatched"}
    for o in out:
        b = base.get((o["model"], o["tokens"]))
        for k in ("step_peak_per_layer", "saved_per_layer", "activation_per_layer"):
            o[k + "_vs"] = _ratio(o[k], b and b[k])
    return out


def _with_vs(value, vs, spec: str) -> str:
    return f"{common.fmt(_mib(value), spec, 'n/a')} ({common.fmt(vs, '.2f')})"


def _ratio(a, b):
    return None if a is None or not b else a / b


def render(payload: dict) -> str:
    meta, plan = payload["meta"], payload["plan"]
    order = {m: i for i, m in enumerate(plan["models"])}
    rows = sorted(
        payload["results"],
        key=lambda r: (
            plan["tokens"].index(r["seq_len"]),
            order[r["model"]],
            r.get("layers", 0),
            PRIORITY.index(r["variant"]),
        ),
    )
    cpu = meta["device_type"] == "cpu"
    peak_head = "peak RSS MiB (vs)" if cpu else "peak alloc MiB (vs)"
    headers = [
        "model",
        "MLP",
        "tokens",
        "layers",
        "variant",
        "tokens/s",
        "× unpatched",
        "saved MiB",
        "vs",
        "fwd+bwd peak MiB (vs)",
        peak_head,
        "loss@K",
        "Δ rel",
    ]
    table = []
    for r in rows:
        table.append(
            [
                r["model"],
                r["mlp"],
                r["tokens"],
                r.get("layers", "-"),
                r["variant"],
                common.fmt(r["tokens_per_s"], ".4g"),
                common.fmt(r["speedup"], ".2f"),
                common.fmt(_mib(r["saved_bytes"]), ".1f", "n/a"),
                common.fmt(r["saved_vs"], ".2f"),
                _with_vs(r.get("step_peak_bytes"), r.get("step_peak_vs"), ".1f"),
                _with_vs(r["peak_bytes"], r["peak_vs"], ".0f"),
                common.fmt(r["loss_k"], ".5f"),
                common.fmt(r["loss_rel"], ".1e"),
            ]
        )
    k = plan["warmup"] + plan["steps"]
    lines = [
        f"# Whole-model training step — {meta['device_name']} ({meta['device_type'].upper()}), {meta['mode']}, "
        f"{meta['date'][:10]}",
        "",
        f"torch {meta['torch_version']}, transformers {meta.get('transformers_version')}, commit "
        f"{meta['git_commit'][:12]}; {meta['cpu_threads']} CPU thread(s); {payload['notes'][0]}",
        "",
        common.markdown_table(headers, table),
        "",
        f"tokens/s: tokens of one step / the median step time (forward, loss, backward, AdamW) over the timed steps; "
        f"saved MiB: bytes autograd keeps for backward in one step, parameters not counted (n/a: under "
        f"torch.compile); fwd+bwd peak: the most memory allocated during one step's forward and backward above its "
        f"start (activations, gradients, temporaries; "
        f"{'the CPU allocator through torch.profiler' if cpu else 'torch.cuda.max_memory_allocated'}); peak: "
        f"{'peak RSS of the process' if cpu else 'torch.cuda.max_memory_allocated'} above the level before the "
        f"variant (its model copy, gradients, AdamW states, activations{', allocator slack' if cpu else ''}); "
        f"loss@K: the loss of "
        f"step K = {k}; Δ rel: loss@K / unpatched's - 1 (same weights, same batches). vs, × unpatched: against the "
        f"model's unpatched row.",
    ]
    stack = payload.get("per_layer") or []
    if stack:
        lines += [
            "",
            "Per layer (the slopes against the layer count of a stack, least squares over the counts run):",
            "",
            common.markdown_table(
                [
                    "model",
                    "tokens",
                    "variant",
                    "layers",
                    "fwd+bwd peak MiB/layer (vs)",
                    "less its gradients (vs)",
                    "saved MiB/layer (vs)",
                ],
                [
                    [
                        o["model"],
                        o["tokens"],
                        o["variant"],
                        ",".join(map(str, o["layers"])),
                        _with_vs(o["step_peak_per_layer"], o["step_peak_per_layer_vs"], ".1f"),
                        _with_vs(o["activation_per_layer"], o["activation_per_layer_vs"], ".1f"),
                        _with_vs(o["saved_per_layer"], o["saved_per_layer_vs"], ".1f"),
                    ]
                    for o in stack
                ],
            ),
            "",
            "less its gradients: the peak's slope less one layer's parameter gradients (its parameters' bytes): the "
            "activations a layer adds to the peak, and its backward's transients.",
        ]
    if payload["skipped"]:
        why: dict = {}  # (variant, reason) -> models
        for s in payload["skipped"]:
            why.setdefault((s["variant"], s["reason"]), []).append(s["model"])
        lines += ["", "Not run:"] + [f"- {v} ({', '.join(ms)}): {r}" for (v, r), ms in why.items()]
    extra = [n for n in payload["notes"][1:] if not n.startswith("not run:")]
    if extra:
        lines += ["", "Notes:"] + [f"- {n}" for n in extra]
    if payload["errors"]:
        lines += ["", "Errors:"] + [f"- {e['model']} / {e['variant']}: {e['error']}" for e in payload["errors"]]
    if "wall_s" in payload:
        lines += ["", f"Wall time: {payload['wall_s']:.0f} s."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
