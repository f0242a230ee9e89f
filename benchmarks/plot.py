#!/usr/bin/env python
"""PNG plots of the benchmark JSON files (matplotlib optional: without it, plots are skipped with a note).

    python benchmarks/plot.py benchmarks/results/<dir>        # re-plot ops.json / ffn.json found there

ops: one figure per op, bandwidth (GB/s) vs size, a panel per (dtype, direction), the measured copy bandwidth
drawn as the ceiling (MoE-shaped cases as unconnected stars at their size); one figure per dtype with the speedup
over ATen eager vs size.
ffn: time of forward+backward and saved activation memory per implementation and model (SwiGLU, GeGLU).
model: a whole model's training step, tokens/s, saved-for-backward and peak memory per variant (bench_model.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

IMPL_STYLE = {
    "ffn_ext": ("ffn_ext", "tab:red", "o"),
    "eager": ("ATen eager", "tab:blue", "s"),
    "compile": ("torch.compile", "tab:green", "^"),
    "liger": ("Liger", "tab:purple", "D"),
    "vllm": ("vLLM", "tab:orange", "v"),
    "te": ("TransformerEngine", "tab:brown", "P"),
    "fused": ("ffn_ext fused_gate_up", "tab:pink", "x"),
    "recompute": ("ffn_ext recompute", "tab:olive", "*"),
    "chunk": ("ffn_ext token_chunk", "tab:cyan", "h"),
    "liger_tiled": ("Liger tiled", "tab:gray", "d"),
}


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; plots skipped (pip install matplotlib)", file=sys.stderr)
        return None
    return plt


def _start(payload: dict, out_dir: Path):
    """pyplot, with out_dir made, or None when there is nothing to plot (no matplotlib, or no results)."""
    if not payload["results"]:
        return None
    plt = _plt()
    if plt is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    _plt().close(fig)
    return path


def _label(meta: dict) -> str:
    return f"{meta['device_name']} ({meta['device_type'].upper()}), {meta['mode']}, {meta['date'][:10]}"


def _ordered(keys, order):
    return [k for k in order if k in keys] + sorted(k for k in keys if k not in order)


def plot_ops(payload: dict, out_dir: Path) -> list[Path]:
    plt = _start(payload, out_dir)
    if plt is None:
        return []
    res, copies, meta = payload["results"], payload["copy"], payload["meta"]
    dtypes = _ordered({r["dtype"] for r in res}, ["bf16", "fp16", "fp32"])
    dirs = _ordered({r["direction"] for r in res}, ["fwd", "bwd", "fwd+bwd"])
    ops = list(dict.fromkeys(r["op"] for r in res))  # the benchmark's order (the op table's)
    files = []
    for op in ops:
        fig, axes = plt.subplots(
            len(dtypes), len(dirs), figsize=(4.2 * len(dirs), 3.2 * len(dtypes)), squeeze=False, sharex=True
        )
        for i, dt in enumerate(dtypes):
            cp = sorted(
                (c for c in copies if c["dtype"] == dt and not c["size"].startswith("MoE")), key=lambda c: c["numel"]
            )
            for j, d in enumerate(dirs):
                ax = axes[i][j]
                if cp:
                    ax.plot([c["numel"] for c in cp], [c["gbps"] for c in cp], "k--", lw=1.2, label="copy (ceiling)")
                for impl, (lab, col, mk) in IMPL_STYLE.items():
                    pts = sorted(
                        (r["numel"], r["gbps"])
                        for r in res
                        if r["op"] == op
                        and r["dtype"] == dt
                        and r["direction"] == d
                        and r["impl"] == impl
                        and not r.get("moe")
                    )
                    if pts:
                        ax.plot(*zip(*pts), color=col, marker=mk, ms=4, label=lab)
                    moe = [
                        r
                        for r in res
                        if r["op"] == op
                        and r["dtype"] == dt
                        and r["direction"] == d
                        and r["impl"] == impl
                        and r.get("moe")
                    ]
                    if moe:
                        ax.plot(
                            [r["numel"] for r in moe],
                            [r["gbps"] for r in moe],
                            color=col,
                            marker="*",
                            ms=9,
                            ls="none",
                            label=f"{lab}, {moe[0]['moe']} MoE",
                        )
                ax.set_xscale("log", base=2)
                ax.set_title(f"{op} {d} {dt}", fontsize=9)
                ax.grid(alpha=0.3)
                if j == 0:
                    ax.set_ylabel("effective GB/s")
                if i == len(dtypes) - 1:
                    ax.set_xlabel("elements per tensor (N)")
        axes[0][0].legend(fontsize=7)
        fig.suptitle(f"ffn_ext {op}: bandwidth vs size — {_label(meta)}", fontsize=10)
        files.append(_save(fig, out_dir / f"ops_bandwidth_{op}.png"))
    ncols = min(3, len(ops))  # unary, gated, packed: one row per kind with the table's three activations
    nrows = -(-len(ops) // ncols)
    for dt in dtypes:
        fig, axes = plt.subplots(nrows, ncols, figsize=(4.0 * ncols, 3.0 * nrows), squeeze=False, sharey=True)
        for j, op in enumerate(ops):
            ax = axes[j // ncols][j % ncols]
            for impl, (lab, col, _) in IMPL_STYLE.items():
                if impl == "eager":
                    continue
                for d, ls, mk in (("fwd", "-", "o"), ("bwd", "--", "s"), ("fwd+bwd", ":", "^")):
                    pts = sorted(
                        (r["numel"], r["speedup_vs"]["eager"])
                        for r in res
                        if r["op"] == op
                        and r["dtype"] == dt
                        and r["direction"] == d
                        and r["impl"] == impl
                        and "eager" in r["speedup_vs"]
                        and not r.get("moe")
                    )
                    if pts:
                        ax.plot(*zip(*pts), color=col, ls=ls, marker=mk, ms=4, label=f"{lab} {d}")
            ax.axhline(1.0, color="k", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{op} {dt}", fontsize=9)
            if j // ncols == nrows - 1:
                ax.set_xlabel("elements per tensor (N)")
            ax.grid(alpha=0.3)
        for j in range(len(ops), nrows * ncols):
            axes[j // ncols][j % ncols].set_visible(False)
        for i in range(nrows):
            axes[i][0].set_ylabel("speedup vs ATen eager (×)")
        axes[0][0].legend(fontsize=6)
        fig.suptitle(f"speedup over ATen eager, {dt} — {_label(meta)}", fontsize=10)
        files.append(_save(fig, out_dir / f"ops_speedup_{dt}.png"))
    return files


def plot_ffn(payload: dict, out_dir: Path) -> list[Path]:
    plt = _start(payload, out_dir)
    if plt is None:
        return []
    res, meta = payload["results"], payload["meta"]
    configs = []
    for r in res:
        key = (r["model"], r["tokens"], r["dtype"])
        if key not in configs:
            configs.append(key)
    impls = [i for i in ("ffn_ext", "eager", "compile") if any(r["impl"] == i for r in res)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    width = 0.8 / max(len(impls), 1)
    for k, impl in enumerate(impls):
        lab, col, _ = IMPL_STYLE[impl]
        xs, ts, ms = [], [], []
        for i, key in enumerate(configs):
            r = next((r for r in res if (r["model"], r["tokens"], r["dtype"]) == key and r["impl"] == impl), None)
            if r is None:
                continue
            xs.append(i + (k - (len(impls) - 1) / 2) * width)
            ts.append(r["median_ms"] or 0)  # None: --memory-only
            ms.append(r["activation_bytes"] / 2**20)
        axes[0].bar(xs, ts, width, color=col, label=lab)
        axes[1].bar(xs, ms, width, color=col, label=lab)
    mlp = {r["model"]: r.get("mlp", "SwiGLU") for r in res}
    names = [f"{m} ({mlp[m]})\n{t} tok {d}" for m, t, d in configs]
    for ax, yl in ((axes[0], "forward+backward time (ms)"), (axes[1], "saved activations (MiB)")):
        ax.set_xticks(range(len(configs)))
        ax.set_xticklabels(names, fontsize=7)
        ax.set_ylabel(yl)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"gated FFNs — {_label(meta)}", fontsize=10)
    return [_save(fig, out_dir / "ffn.png"), *_plot_ffn_memory(plt, res, meta, out_dir)]


def _plot_ffn_memory(plt, res, meta, out_dir):
    """Peak memory of forward+backward against tokens, per model and implementation (where there are 2+ token
    counts): ffn_memory.png."""
    models = [
        m
        for m in dict.fromkeys(r["model"] for r in res)
        if len({r["tokens"] for r in res if r["model"] == m and r["peak_extra_bytes"]}) > 1
    ]
    if not models:
        return []
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 3.8), squeeze=False)
    for ax, model in zip(axes[0], models):
        for impl, (lab, col, mk) in IMPL_STYLE.items():
            pts = sorted(
                (r["tokens"], r["peak_extra_bytes"] / 2**20)
                for r in res
                if r["model"] == model and r["impl"] == impl and r["peak_extra_bytes"]
            )
            if pts:
                ax.plot(*zip(*pts), marker=mk, color=col, label=lab)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens")
        ax.set_ylabel("peak memory of fwd+bwd (MiB)")
        ax.set_title(model, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"gated FFN peak memory — {_label(meta)}", fontsize=10)
    return [_save(fig, out_dir / "ffn_memory.png")]


def plot_model(payload: dict, out_dir: Path) -> list[Path]:
    """bench_model.py: per model (a row of panels), each variant's tokens/s, saved-for-backward MiB, its forward +
    backward peak and the variant's peak memory side by side, the unpatched variant's values drawn as a dashed line:
    model.png."""
    plt = _start(payload, out_dir)
    if plt is None:
        return []
    res, meta = payload["results"], payload["meta"]
    groups = list(dict.fromkeys((r["model"], r["tokens"], r.get("layers")) for r in res))
    cpu = meta["device_type"] == "cpu"
    panels = (
        ("tokens_per_s", "tokens/s", 1.0),
        ("saved_bytes", "saved for backward (MiB)", 2**-20),
        ("step_peak_bytes", "forward+backward peak (MiB)", 2**-20),
        ("peak_bytes", "peak RSS above start (MiB)" if cpu else "peak allocated (MiB)", 2**-20),
    )
    fig, axes = plt.subplots(len(groups), len(panels), figsize=(16, 2.6 * len(groups) + 0.6), squeeze=False)
    for i, (model, tokens, layers) in enumerate(groups):
        rows = [r for r in res if (r["model"], r["tokens"], r.get("layers")) == (model, tokens, layers)]
        names = [r["variant"] for r in rows]
        colours = [
            "tab:blue"
            if n == "unpatched"
            else "tab:green"
            if n.startswith("compile") and "ffn_ext" not in n
            else "tab:purple"
            if n.startswith("liger") and "ffn_ext" not in n
            else "tab:red"
            for n in names
        ]
        for j, (key, label, scale) in enumerate(panels):
            ax = axes[i][j]
            vals = [(r.get(key) or 0) * scale for r in rows]
            ax.barh(range(len(rows)), vals, color=colours)
            base = next((r.get(key) for r in rows if r["variant"] == "unpatched" and r.get(key)), None)
            if base:
                ax.axvline(base * scale, color="k", ls="--", lw=0.8)
            for y, r in enumerate(rows):
                if r.get(key) is None:
                    ax.text(0, y, " n/a", va="center", fontsize=7)
            ax.set_yticks(range(len(rows)))
            ax.set_yticklabels(names if j == 0 else [], fontsize=7)
            ax.invert_yaxis()
            ax.grid(axis="x", alpha=0.3)
            ax.tick_params(axis="x", labelsize=7)
            if i == len(groups) - 1:
                ax.set_xlabel(label, fontsize=8)
            if j == 0:
                depth = "" if layers is None else f", {layers} layer{'s' if layers != 1 else ''}"
                ax.set_title(f"{model}, {tokens} tokens{depth}", fontsize=8, loc="left")
            elif i == 0:
                ax.set_title(label, fontsize=8)
    fig.suptitle(f"whole-model training step (forward, loss, backward, optimizer) — {_label(meta)}", fontsize=10)
    paths = [_save(fig, out_dir / "model.png")]
    if len({r.get("layers") for r in res}) > 1:
        paths.append(_plot_model_stack(plt, res, meta, out_dir))
    return paths


def _plot_model_stack(plt, res, meta, out_dir: Path) -> Path:
    """The step's forward + backward peak against the layer count, a line per variant, a panel per model and
    tokens: model_stack.png (the per-layer figures of bench_model are these lines' slopes)."""
    groups = list(dict.fromkeys((r["model"], r["tokens"]) for r in res))
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 3.8), squeeze=False)
    for ax, (model, tokens) in zip(axes[0], groups):
        rows = [r for r in res if (r["model"], r["tokens"]) == (model, tokens) and r.get("step_peak_bytes")]
        for variant in dict.fromkeys(r["variant"] for r in rows):
            pts = sorted((r["layers"], r["step_peak_bytes"] / 2**30) for r in rows if r["variant"] == variant)
            style = dict(color="k", ls="--") if variant == "unpatched" else {}
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=variant, **style)
        ax.set_title(f"{model}, {tokens} tokens", fontsize=9)
        ax.set_xlabel("layers", fontsize=8)
        ax.set_ylabel("forward+backward peak (GiB)", fontsize=8)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"a stack's training step peak against its layers — {_label(meta)}", fontsize=10)
    return _save(fig, out_dir / "model_stack.png")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    d = Path(argv[0])
    files = []
    if (d / "ops.json").exists():
        files += plot_ops(json.loads((d / "ops.json").read_text()), d)
    if (d / "ffn.json").exists():
        files += plot_ffn(json.loads((d / "ffn.json").read_text()), d)
    if (d / "model.json").exists():
        files += plot_model(json.loads((d / "model.json").read_text()), d)
    print("wrote: " + ", ".join(map(str, files)) if files else "no plots written", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
