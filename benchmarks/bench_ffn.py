#!/usr/bin/env python
"""FFN-level benchmark: gated and classic FFNs on ffn_ext vs the eager MLP a model writes and its torch.compile form.

    python benchmarks/bench_ffn.py --quick                       # CPU here, GPU where there is one
    python benchmarks/bench_ffn.py --quick --device cuda --out $OUT/bench
    python benchmarks/bench_ffn.py --smoke --out /tmp/x          # tiny CI check of the pipeline
    python benchmarks/bench_ffn.py --classic --variants          # the classic FFN, fc2(act(fc1(x))), 512-16384 tokens

The classic FFN (--classic, or --models with the classic-* names): BERT-base / ViT-B / GPT-2 widths (768 -> 3072)
and ViT-L / CLIP-L (1024 -> 4096), GELU erf (BERT, ViT) and tanh (GPT-2), with biases, against
fc2(act(fc1(x))) in ATen ops; the ffn_ext side is ffn_ext.FFN (ffn_ext.plain_mlp), its lean autograd on every device.

Models: SwiGLU at Llama-7B (4096 -> 11008) and Qwen2.5-0.5B (896 -> 4864) widths, against Hugging Face's
LlamaMLP / Qwen2MLP form down(silu(gate(x)) * up(x)); tanh GeGLU at Gemma-2-2B widths (2304 -> 9216), against
GemmaMLP's down(gelu_tanh(gate(x)) * up(x)). All three implementations share the same weights. Measured: forward
(no grad) and forward+backward time (gradients of x and of every weight), the bytes autograd saves for backward
beyond the parameters and the input x ("activation memory"), and on GPU the peak memory allocated during
forward+backward above what was allocated before. The ffn_ext side is ffn_ext.SwiGLUFFN / ffn_ext.GeGLUFFN
(approximate="tanh") when the package has it, else a local module (gate/up/down Linear + ffn_ext.gated); the
results say which. Writes ffn.md, ffn.json and ffn.png into the output directory (--classic: classic_ffn.*;
with --memory-only: classic_ffn_memory.*).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import ffn_ext  # noqa: E402
from ffn_ext.table import BY_NAME  # noqa: E402

# model -> (d_model, d_ff, activation of ffn_ext's op table); silu: SwiGLU (Llama, Qwen2), gelu_tanh: GeGLU (Gemma)
MODELS = {
    "qwen2.5-0.5b": (896, 4864, "silu"),
    "llama-7b": (4096, 11008, "silu"),
    "llama-3-8b": (4096, 14336, "silu"),
    "gemma-2-2b": (2304, 9216, "gelu_tanh"),
    "tiny": (64, 176, "silu"),
    "tiny-geglu": (64, 176, "gelu_tanh"),
}
# the classic FFN, fc2(act(fc1(x))) with biases: 768 -> 3072 is BERT-base / ViT-B (erf) and GPT-2 (tanh), 1024 ->
# 4096 ViT-L (erf) and CLIP-L's width
CLASSIC = {
    "classic-768-gelu": (768, 3072, "gelu"),
    "classic-768-gelu_tanh": (768, 3072, "gelu_tanh"),
    "classic-1024-gelu": (1024, 4096, "gelu"),
    "classic-1024-gelu_tanh": (1024, 4096, "gelu_tanh"),
    "classic-tiny": (64, 256, "gelu"),
}
MODELS.update(CLASSIC)
MLP_NAME = {"silu": "SwiGLU", "gelu": "GeGLU (erf)", "gelu_tanh": "GeGLU (tanh)"}
CLASSIC_NAME = {"gelu": "FFN (GELU erf)", "gelu_tanh": "FFN (GELU tanh)"}
IMPL_LABEL = {
    "ffn_ext": "ffn_ext",
    "eager": "eager MLP",
    "compile": "torch.compile(eager)",
    "fused": "ffn_ext fused_gate_up",
    "recompute": "ffn_ext recompute",
    "chunk": "ffn_ext token_chunk",
    "liger": "Liger SwiGLUMLP",
    "liger_tiled": "Liger TiledSwiGLUMLP",
}
# --variants: ffn_ext's module with these options (token_chunk: a quarter of the tokens, at least 1)
VARIANTS = {"fused": {"fused_gate_up": True}, "recompute": {"recompute": True}, "chunk": {"token_chunk": 4}}


def liger_modules(d_model, d_ff, activation, tokens, dev, dtype, notes):
    """Liger's MLPs (LigerSwiGLUMLP, LigerTiledSwiGLUMLP) with Llama's names where liger_kernel is installed and
    can run here (Triton kernels: CUDA only); else a note saying why not."""
    if activation != "silu":
        return {}
    try:
        from liger_kernel.transformers.swiglu import LigerSwiGLUMLP
    except Exception as e:  # noqa: BLE001
        note = f"Liger skipped: liger_kernel not importable ({type(e).__name__})"
        if note not in notes:
            notes.append(note)
        return {}
    if dev.type != "cuda":
        if "Liger skipped: its Triton kernels need CUDA" not in notes:
            notes.append("Liger skipped: its Triton kernels need CUDA")
        return {}
    import types

    cfg = types.SimpleNamespace(hidden_size=d_model, intermediate_size=d_ff, hidden_act="silu")
    out = {"liger": LigerSwiGLUMLP(cfg).to(dev, dtype)}
    try:
        from liger_kernel.transformers.tiled_mlp import LigerTiledSwiGLUMLP

        out["liger_tiled"] = LigerTiledSwiGLUMLP(cfg, num_shards=4).to(dev, dtype)
    except Exception as e:  # noqa: BLE001
        notes.append(f"Liger's tiled MLP skipped ({type(e).__name__}: {str(e)[:120]})")
    return out


# ffn_ext's FFN module per activation: (attribute, keyword arguments); GeGLUFFN is looked up with getattr, so that
# an ffn_ext without it falls back to the local module (and says so)
FFN_EXT_MODULES = {
    "silu": ("SwiGLUFFN", {}),
    "gelu": ("GeGLUFFN", {"approximate": "none"}),
    "gelu_tanh": ("GeGLUFFN", {"approximate": "tanh"}),
}


class EagerMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with ATen ops, as Hugging Face's LlamaMLP / Qwen2MLP (act = F.silu) and
    GemmaMLP (act = F.gelu(approximate="tanh")) compute it; act is the op table's ATen form."""

    def __init__(self, d_model, d_ff, activation="silu", device=None, dtype=None):
        super().__init__()
        kw = dict(bias=False, device=device, dtype=dtype)
        self.gate_proj = nn.Linear(d_model, d_ff, **kw)
        self.up_proj = nn.Linear(d_model, d_ff, **kw)
        self.down_proj = nn.Linear(d_ff, d_model, **kw)
        self.activation = activation
        self.act_fn = BY_NAME[activation].aten

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class EagerClassicMLP(nn.Module):
    """fc2(act(fc1(x))) with ATen ops, as BERT's Intermediate/Output, ViT's and GPT-2's MLPs compute it (nn.Linear
    names of ffn_ext.FFN, so one state_dict loads into both)."""

    def __init__(self, d_model, d_ff, activation="gelu", device=None, dtype=None):
        super().__init__()
        self.up_proj = nn.Linear(d_model, d_ff, device=device, dtype=dtype)
        self.down_proj = nn.Linear(d_ff, d_model, device=device, dtype=dtype)
        self.act_fn = BY_NAME[activation].aten

    def forward(self, x):
        return self.down_proj(self.act_fn(self.up_proj(x)))


class LocalGatedFFN(EagerMLP):
    """The same projections with the activation fused by ffn_ext.gated (used when ffn_ext has no FFN module for
    the activation)."""

    def forward(self, x):
        return self.down_proj(ffn_ext.gated(self.gate_proj(x), self.up_proj(x), activation=self.activation))


def make_ffn_ext_module(d_model, d_ff, activation, dev, dtype, notes):
    name, kw = FFN_EXT_MODULES[activation]
    cls = getattr(ffn_ext, name, None)
    if cls is None:
        note = f"ffn_ext.{name} not in this ffn_ext: local module for {MLP_NAME[activation]}"
        if note not in notes:
            notes.append(note)
    else:
        try:
            mod = cls(d_model, d_ff, bias=False, device=dev, dtype=dtype, **kw)
            return mod, f"ffn_ext.{name}" + "".join(f"({k}={v!r})" for k, v in kw.items())
        except Exception as e:  # noqa: BLE001
            notes.append(f"ffn_ext.{name}({d_model}, {d_ff}, {kw}) failed ({type(e).__name__}: {e}); local module used")
    return (
        LocalGatedFFN(d_model, d_ff, activation, device=dev, dtype=dtype),
        f"local module (nn.Linear x3 + ffn_ext.gated(activation={activation!r}))",
    )


def plan_for(mode, dev, classic=False):
    """[(model, tokens, dtype)]"""
    if classic:
        if mode == "smoke":
            return [("classic-tiny", 32, "fp32")]
        if dev.type == "cuda":
            return [(m, t, "bf16") for m in CLASSIC if m != "classic-tiny" for t in (512, 4096, 16384)]
        if mode == "full":
            return [(m, t, "fp32") for m in CLASSIC if m != "classic-tiny" for t in (512, 4096)]
        return [
            ("classic-768-gelu", 512, "fp32"),
            ("classic-768-gelu_tanh", 512, "fp32"),
            ("classic-1024-gelu", 512, "fp32"),
        ]
    if mode == "smoke":
        return [("tiny", 32, "fp32"), ("tiny-geglu", 32, "fp32")]
    if dev.type == "cuda":
        if mode == "full":
            return [
                (m, t, d)
                for d in ("bf16", "fp16")
                for m in ("qwen2.5-0.5b", "llama-7b", "gemma-2-2b")
                for t in (1024, 4096, 16384)
            ]
        return [("qwen2.5-0.5b", 4096, "bf16"), ("llama-7b", 4096, "bf16"), ("gemma-2-2b", 4096, "bf16")]
    if mode == "full":
        return [
            ("qwen2.5-0.5b", 256, "fp32"),
            ("qwen2.5-0.5b", 1024, "fp32"),
            ("llama-7b", 64, "fp32"),
            ("gemma-2-2b", 64, "fp32"),
            ("qwen2.5-0.5b", 256, "bf16"),
        ]
    return [("qwen2.5-0.5b", 128, "fp32"), ("llama-7b", 16, "fp32"), ("gemma-2-2b", 16, "fp32")]


def measure(impl, module, x_sets, grad_sets, dev, target_ms, tf_bytes, memory_only=False):
    params = [p for p in module.parameters()]

    def fwd(x, g):
        with torch.no_grad():
            return module(x)

    def fwd_bwd(x, g):
        return torch.autograd.grad(module(x), [x, *params], g)

    sets = list(zip(x_sets, grad_sets))
    none = {"median_ms": None, "p10_ms": None, "p90_ms": None, "reps": 0}
    out = {
        "fwd": none if memory_only else common.time_fn(fwd, sets, dev, target_ms=target_ms, min_reps=3),
        "fwd+bwd": none if memory_only else common.time_fn(fwd_bwd, sets, dev, target_ms=target_ms, min_reps=3),
    }
    x, g = sets[0]
    with common.SavedTensors(exclude=[x, *params]) as saved:
        y = module(x)
    del y
    out["activation_bytes"] = saved.extra_bytes
    out["activation_tf_units"] = saved.extra_bytes / tf_bytes
    out["saved_total_bytes"] = saved.total_bytes
    # the peak of forward+backward above what existed before (x, g, the weights): what the layer allocates
    out["peak_extra_bytes"] = common.peak_extra_bytes(
        lambda: fwd_bwd(x, g), dev, existing=[x, g, *params], cpu=impl != "compile"
    )
    return out


def run(args) -> dict:
    dev = common.resolve_device(args.device)
    mode = common.mode_of(args)
    use_compile = not args.no_compile and mode != "smoke"
    notes: list[str] = []
    if dev.type == "cpu":
        notes.append(
            "CPU run: wall-clock medians; ffn_ext's CPU ops are ATen composites (the GEMMs dominate); peak MiB "
            "on CPU: the storages ops create during forward+backward (a dispatch mode; n/a for compile)"
        )
    if mode == "smoke":
        notes.append("smoke run: tiny width, numbers are meaningless")
        if dev.type == "cpu":  # as bench_ops: OpenMP waits on a busy machine cost more than these tiny GEMMs
            torch.set_num_threads(1)
            notes.append("smoke run on CPU: 1 torch thread")
    if not use_compile:
        notes.append("torch.compile skipped (" + ("--smoke" if mode == "smoke" else "--no-compile") + ")")
    if use_compile:
        common.setup_compile()
    plan = plan_for(mode, dev, args.classic)
    if args.dtypes:
        keep = {d.strip() for d in args.dtypes.split(",")}
        plan = [p for p in plan if p[2] in keep] or [(m, t, d) for m, t, _ in plan[:1] for d in sorted(keep)]
    if args.models:
        plan = [(m.strip(), t, d) for m in args.models.split(",") for t, d in dict.fromkeys((t, d) for _, t, d in plan)]
    if args.tokens:
        plan = [
            (m, int(t), d) for m, _, d in dict.fromkeys((m, 0, d) for m, _, d in plan) for t in args.tokens.split(",")
        ]
    target_ms = args.target_ms or {"smoke": 5.0, "quick": 150.0 if dev.type == "cuda" else 30.0, "full": 400.0}[mode]
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    torch.manual_seed(args.seed)
    results, errors = [], []
    n_impl = (3 if use_compile else 2) + (len(VARIANTS) if args.variants else 0)
    bar = common.progress(len(plan) * n_impl, f"bench_ffn [{dev.type}, {mode}]", disable=args.no_progress)
    t_start = time.time()
    ffn_kinds = {}
    for model, tokens, dname in plan:
        dtype = common.DTYPES[dname]
        d_model, d_ff, activation = MODELS[model]
        classic = model in CLASSIC
        es = torch.empty((), dtype=dtype).element_size()
        common.free_memory(dev)
        if classic:
            eager = EagerClassicMLP(d_model, d_ff, activation, device=dev, dtype=dtype)
            ours = ffn_ext.FFN(d_model, d_ff, activation=activation, bias=True, device=dev, dtype=dtype)
            ffn_kind = f"ffn_ext.FFN(activation={activation!r}, bias=True)"
        else:
            eager = EagerMLP(d_model, d_ff, activation, device=dev, dtype=dtype)
            ours, ffn_kind = make_ffn_ext_module(d_model, d_ff, activation, dev, dtype, notes)
        ffn_kinds[model] = ffn_kind
        ours.load_state_dict(eager.state_dict())
        mods = {"ffn_ext": ours, "eager": eager}
        if use_compile:
            mods["compile"] = torch.compile(eager)
        if args.variants and classic:
            chunk = args.token_chunk or max(1, tokens // 4)
            for v, opts in (("recompute", {"recompute": True}), ("chunk", {"token_chunk": chunk})):
                mods[v] = ffn_ext.FFN(d_model, d_ff, activation=activation, bias=True, device=dev, dtype=dtype, **opts)
                mods[v].load_state_dict(eager.state_dict())
        elif args.variants and activation in FFN_EXT_MODULES:
            name, kw = FFN_EXT_MODULES[activation]
            for v, opts in VARIANTS.items():
                opts = {
                    k: ((args.token_chunk or max(1, tokens // o)) if k == "token_chunk" else o) for k, o in opts.items()
                }
                mods[v] = getattr(ffn_ext, name)(d_model, d_ff, bias=False, device=dev, dtype=dtype, **kw, **opts)
                mods[v].load_state_dict(eager.state_dict())
            for v, m in liger_modules(d_model, d_ff, activation, tokens, dev, dtype, notes).items():
                m.load_state_dict(eager.state_dict())
                mods[v] = m
        k = 2
        x_sets = [
            torch.randn(tokens, d_model, generator=gen, device=dev, dtype=torch.float32).to(dtype).requires_grad_(True)
            for _ in range(k)
        ]
        grad_sets = [
            torch.randn(tokens, d_model, generator=gen, device=dev, dtype=torch.float32).to(dtype) for _ in range(k)
        ]
        # the implementations must agree before their times mean anything
        with torch.no_grad():
            ref = eager(x_sets[0]).float()
            for name, m in mods.items():
                err = (m(x_sets[0]).float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)
                if err > (1e-4 if dtype == torch.float32 else 5e-2):
                    errors.append(f"{name} {model} {tokens} {dname}: output differs from eager (rel {err:.3g})")
        for name, m in mods.items():
            bar.set_postfix_str(f"{model} {tokens} {dname} {name}")
            try:
                r = measure(name, m, x_sets, grad_sets, dev, target_ms, tokens * d_ff * es, args.memory_only)
            except Exception as e:  # noqa: BLE001
                errors.append(f"{name} {model} {tokens} {dname}: {type(e).__name__}: {str(e)[:300]}")
                bar.update()
                continue
            fb = r.pop("fwd+bwd")
            fw = r.pop("fwd")
            results.append(
                {
                    "model": model,
                    "mlp": (CLASSIC_NAME if classic else MLP_NAME)[activation],
                    "activation": activation,
                    "d_model": d_model,
                    "d_ff": d_ff,
                    "tokens": tokens,
                    "dtype": dname,
                    "impl": name,
                    "module": ffn_kind if name == "ffn_ext" else type(m).__name__,
                    "median_ms": fb["median_ms"],
                    "p10_ms": fb["p10_ms"],
                    "p90_ms": fb["p90_ms"],
                    "reps": fb["reps"],
                    "fwd_median_ms": fw["median_ms"],
                    "fwd_reps": fw["reps"],
                    "tf_bytes": tokens * d_ff * es,
                    **r,
                }
            )
            bar.update()
        del mods, eager, ours, x_sets, grad_sets
    bar.close()
    index = {(r["model"], r["tokens"], r["dtype"], r["impl"]): r for r in results}
    for r in results:
        r["speedup_vs"] = {
            p: index[key]["median_ms"] / r["median_ms"]
            for p in ("ffn_ext", "eager", "compile")
            if p != r["impl"]
            and (key := (r["model"], r["tokens"], r["dtype"], p)) in index
            and r["median_ms"]
            and index[key]["median_ms"]
        }
        e = index.get((r["model"], r["tokens"], r["dtype"], "eager"))
        r["activation_vs_eager"] = (
            r["activation_bytes"] / e["activation_bytes"] if e and e["activation_bytes"] else None
        )
        r["peak_vs_eager"] = (
            r["peak_extra_bytes"] / e["peak_extra_bytes"]
            if e and r["peak_extra_bytes"] and e["peak_extra_bytes"]
            else None
        )
    meta = common.metadata(dev, mode, sys.argv)
    meta["elapsed_s"] = round(time.time() - t_start, 1)
    meta["ffn_ext_module"] = "; ".join(f"{m}: {k}" for m, k in ffn_kinds.items())
    payload = {"meta": meta, "notes": notes, "errors": errors, "results": results}
    payload["targets"] = targets(results, dev)
    return payload


def targets(results, dev):
    out = []
    for model in MODELS:
        if model in CLASSIC:
            out += classic_targets(results, model, dev)
            continue
        rows = [
            r
            for r in results
            if r["model"] == model and r["impl"] == "ffn_ext" and r["activation_vs_eager"] is not None
        ]
        if not rows:
            continue
        rows.sort(key=lambda r: (r["dtype"] == "bf16", r["tokens"]))
        r = rows[-1]
        out.append(
            common.make_target(
                f"{model}: {r['module']} activation memory <= 0.5x eager's [tokens, d_ff] bytes",
                r["activation_vs_eager"],
                0.5,
                False,
                "x",
                f"{r['activation_tf_units']:.3g} vs "
                f"{r['activation_tf_units'] / r['activation_vs_eager']:.3g} [tokens, d_ff] tensors, "
                f"{r['dtype']} {r['tokens']} tokens on {dev.type.upper()}",
                True,
            )
        )
    if not out:
        out.append(
            common.make_target("gated FFN activation memory <= 0.5x eager's [tokens, d_ff] bytes", None, 0.5, False)
        )
    return out


def classic_targets(results, model, dev):
    """The classic FFN's: 1 [tokens, d_ff] tensor saved (eager 2) and a fwd+bwd peak <= 0.75x eager's at 4096
    tokens, and no slower than eager on the CPU (>= 0.98x)."""
    out = []
    for r in results:
        if r["model"] != model:
            continue
        where = f"{r['dtype']} {r['tokens']} tokens on {dev.type.upper()}"
        if r["impl"] == "ffn_ext" and r["activation_vs_eager"] is not None:
            out.append(
                common.make_target(
                    f"{model}: lean FFN saves <= 0.5x eager's [tokens, d_ff] bytes",
                    r["activation_vs_eager"],
                    0.5,
                    False,
                    "x",
                    f"{r['activation_tf_units']:.3g} [tokens, d_ff] tensors, {where}",
                    True,
                )
            )
            if r["tokens"] == 4096 and r["peak_vs_eager"] is not None:
                out.append(
                    common.make_target(
                        f"{model}: lean FFN fwd+bwd peak <= 0.75x eager's",
                        r["peak_vs_eager"],
                        0.75,
                        False,
                        "x",
                        where,
                        True,
                    )
                )
        if r["impl"] == "ffn_ext" and r["speedup_vs"].get("eager") is not None:
            out.append(
                common.make_target(
                    f"{model}: ffn_ext.FFN fwd+bwd >= 0.98x eager",
                    r["speedup_vs"]["eager"],
                    0.98,
                    True,
                    "x",
                    where + " (medians; the target: min of 30, 1 thread)",
                    False,
                )
            )
    return out


def markdown(payload):
    meta = payload["meta"]
    lines = [
        f"# ffn_ext FFN benchmark — {meta['device_name']} ({meta['device_type'].upper()})",
        "",
        f"date {meta['date']}, mode {meta['mode']}, torch {meta['torch_version']}, CUDA {meta['cuda_version']},"
        f" commit {meta['git_commit']}; timing: {meta['timing']}; ffn_ext side: {meta['ffn_ext_module']}",
        "",
    ]
    lines += [f"- {n}" for n in payload["notes"]] + [""]
    headers = [
        "model",
        "MLP",
        "d_model→d_ff",
        "tokens",
        "dtype",
        "impl",
        "fwd ms",
        "fwd+bwd ms",
        "× eager",
        "× compile",
        "activations MiB",
        "[T,d_ff] units",
        "vs eager",
        "peak MiB",
        "peak vs eager",
    ]
    rows = []
    for r in payload["results"]:
        sv = r["speedup_vs"]
        rows.append(
            [
                r["model"],
                r["mlp"],
                f"{r['d_model']}→{r['d_ff']}",
                r["tokens"],
                r["dtype"],
                IMPL_LABEL[r["impl"]],
                common.fmt(r["fwd_median_ms"], ".4g"),
                common.fmt(r["median_ms"], ".4g"),
                common.fmt(sv.get("eager")),
                common.fmt(sv.get("compile")),
                common.fmt(r["activation_bytes"] / common.MiB, ".4g"),
                common.fmt(r["activation_tf_units"], ".3g"),
                common.fmt(r["activation_vs_eager"]),
                common.fmt(r["peak_extra_bytes"] / common.MiB, ".4g") if r["peak_extra_bytes"] is not None else "n/a",
                common.fmt(r["peak_vs_eager"]),
            ]
        )
    lines += [common.markdown_table(headers, rows), ""]
    if payload["errors"]:
        lines += ["Errors:", ""] + [f"- {e}" for e in payload["errors"]] + [""]
    lines += ["```", common.targets_block(payload["targets"]), "```"]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(p)
    p.add_argument("--tokens", default=None, help="comma-separated token counts (replaces the mode's)")
    p.add_argument("--models", default=None, help=f"comma-separated models (replaces the mode's): {', '.join(MODELS)}")
    p.add_argument(
        "--token-chunk",
        type=int,
        default=None,
        help="token_chunk of the --variants module (default: a quarter of the tokens)",
    )
    p.add_argument(
        "--memory-only",
        action="store_true",
        help="measure saved bytes and peak memory only (no timing): long sequences on CPU",
    )
    p.add_argument(
        "--classic",
        action="store_true",
        help="the classic FFN (ffn_ext.FFN) at 768 -> 3072 and 1024 -> "
        "4096, GELU erf and tanh, instead of the gated FFNs",
    )
    p.add_argument(
        "--variants",
        action="store_true",
        help="also ffn_ext's module with fused_gate_up=True, "
        "recompute=True and token_chunk=tokens/4, and Liger's MLPs where installed (CUDA)",
    )
    args = p.parse_args(argv)
    payload = run(args)
    import plot

    name = ("classic_ffn" + ("_memory" if args.memory_only else "")) if args.classic else "ffn"
    return common.report(args, name, payload, markdown(payload), plot.plot_ffn)


if __name__ == "__main__":
    sys.exit(main())
