"""CPU: ffn_ext's FFN layers against the eager PyTorch MLP, the same weights, fwd and fwd+bwd.

    python benchmarks/bench_cpu.py                 # the grid below, 1 and 2 threads, 6 blocks of 10 runs (minutes)
    python benchmarks/bench_cpu.py --quick         # tiny shapes, 1 thread, min of 3: a smoke test (seconds)

Each row: an implementation at (d_model, d_ff, tokens) and a thread count, fwd (under no_grad) or fwd+bwd (forward,
then backward into the input and every weight), timed as the minimum of --reps runs in one process, ffn_ext and
eager alternating run by run (so that a busy spell of a shared machine hits both alike); ratio = eager time /
ffn_ext time (>= 1: ffn_ext is as fast or faster), the median over --blocks blocks of the runs of the ratio of the
blocks' minima (one lucky or unlucky spell moves a block, not the figure: the set of 2026-12-02 timed as one min of
30 left the A/A control at 0.945-1.218x). A run is `calls` calls back to back, the same count on both
sides, chosen once per case so that a run lasts at least --run-ms (default 2 ms): a 1-token MLP is a 15-150 us
call, and timing one call at a time left the A/A control (eager against itself) spread over 0.83-1.07x, wider than
the differences it is there to bound. Implementations:

  SwiGLUFFN, GeGLUFFN (tanh), GatedFFN (gelu)   ffn_ext's modules, vs down(act(gate(x)) * up(x)) with their Linears
  FFN (gelu)                                     the classic FFN, vs down(gelu(up(x)))
  swiglu_mlp, geglu_mlp (+ plain_mlp if there)   the functional forms on the same weights, vs the F.linear forms
  LlamaMLP (patched)                             transformers' LlamaMLP patched by ffn_ext.patch_hf_model, vs its
                                                 own forward's expression on its modules
  eager vs eager (A/A)                           the control: the eager gated MLP against itself; its ratios are the
                                                 measurement's noise at each shape (the worst-ratio line leaves it out)

The grid spans d_model 64..4096, d_ff 256..14336 and 1..4096 tokens at its corners and middle; a shape whose single
fwd+bwd run is estimated (from a matmul rate measured at the start) above --max-run-s is skipped, and the output
says which. Writes cpu.json and cpu.md (the ratio per row and the worst ratio) into --out.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import ffn_ext  # noqa: E402
from ffn_ext._timing import blocked_pair  # noqa: E402

# (d_model, d_ff): the ranges' corners and a middle (Qwen2.5-0.5B's 896 -> 4864; GPT-2 / BERT-base 768 -> 3072)
PAIRS = [(64, 256), (64, 14336), (768, 3072), (896, 4864), (4096, 256), (4096, 14336)]
TOKENS = [1, 64, 512, 4096]
CONTROL = "eager vs eager (A/A)"  # the A/A control row's name (implementations)
QUICK_PAIRS, QUICK_TOKENS = [(64, 256), (96, 320)], [1, 33]


def _linear(w, b=None):
    """An nn.Linear holding the given parameters (no copy, no initialisation of throwaway weights)."""
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device="meta")
    lin.weight = w
    if b is not None:
        lin.bias = b
    return lin


def _gated_module(cls, weights, **kw):
    wg, wu, wd = weights
    m = cls(wg.shape[1], wg.shape[0], device="meta", **kw)
    m.gate_proj, m.up_proj, m.down_proj = _linear(wg), _linear(wu), _linear(wd)
    return m


def _classic_module(weights):
    w1, w2 = weights
    m = ffn_ext.FFN(w1.shape[1], w1.shape[0], activation="gelu", device="meta")
    lin = [n for n, c in m.named_children() if isinstance(c, torch.nn.Linear)]
    setattr(m, lin[0], _linear(w1))
    setattr(m, lin[1], _linear(w2))
    return m, (getattr(m, lin[0]), getattr(m, lin[1]))


def _llama(weights):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    wg, wu, wd = weights
    cfg = LlamaConfig(hidden_size=wg.shape[1], intermediate_size=wg.shape[0], hidden_act="silu", mlp_bias=False)
    with torch.device("meta"):
        mlp = LlamaMLP(cfg)
    mlp.gate_proj, mlp.up_proj, mlp.down_proj = _linear(wg), _linear(wu), _linear(wd)
    eager = copy.copy(mlp)  # shares the modules; the patch below acts on `mlp` only
    holder = torch.nn.Sequential(mlp)
    if ffn_ext.patch_hf_model(holder) != 1:
        raise RuntimeError("patch_hf_model did not patch LlamaMLP")
    return mlp, lambda x: eager.down_proj(eager.act_fn(eager.gate_proj(x)) * eager.up_proj(x))


def implementations(d_model: int, d_ff: int, dtype) -> list:
    """(name, ffn_ext callable, eager callable, parameters) for every implementation at this shape, on one set of
    weights per form (gated, classic)."""

    def p(*shape):
        return torch.nn.Parameter(torch.randn(*shape, dtype=dtype) / shape[-1] ** 0.5)

    gated_w = (p(d_ff, d_model), p(d_ff, d_model), p(d_model, d_ff))
    classic_w = (p(d_ff, d_model), p(d_model, d_ff))
    wg, wu, wd = gated_w
    gate, up, down = _linear(wg), _linear(wu), _linear(wd)
    tanh = lambda t: F.gelu(t, approximate="tanh")  # noqa: E731
    impls = [
        ("SwiGLUFFN", _gated_module(ffn_ext.SwiGLUFFN, gated_w), lambda x: down(F.silu(gate(x)) * up(x)), gated_w),
        (
            "GeGLUFFN (tanh)",
            _gated_module(ffn_ext.GeGLUFFN, gated_w, approximate="tanh"),
            lambda x: down(tanh(gate(x)) * up(x)),
            gated_w,
        ),
        (
            "GatedFFN (gelu)",
            _gated_module(ffn_ext.GatedFFN, gated_w, activation="gelu"),
            lambda x: down(F.gelu(gate(x)) * up(x)),
            gated_w,
        ),
    ]
    ffn, (fc1, fc2) = _classic_module(classic_w)
    impls.append(("FFN (gelu)", ffn, lambda x: fc2(F.gelu(fc1(x))), classic_w))
    impls += [
        (
            "swiglu_mlp",
            lambda x: ffn_ext.swiglu_mlp(x, wg, wu, wd),
            lambda x: F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd),
            gated_w,
        ),
        (
            "swiglu_mlp (fp8 cache)",
            lambda x: ffn_ext.swiglu_mlp(x, wg, wu, wd, saved_dtype=torch.float8_e4m3fn),
            lambda x: F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd),
            gated_w,
        ),
        (
            "geglu_mlp (tanh)",
            lambda x: ffn_ext.geglu_mlp(x, wg, wu, wd, approximate="tanh"),
            lambda x: F.linear(tanh(F.linear(x, wg)) * F.linear(x, wu), wd),
            gated_w,
        ),
    ]
    plain = getattr(ffn_ext, "plain_mlp", None)
    if plain is not None:
        w1, w2 = classic_w
        impls.append(
            (
                "plain_mlp (gelu)",
                lambda x: plain(x, w1, w2, activation="gelu"),
                lambda x: F.linear(F.gelu(F.linear(x, w1)), w2),
                classic_w,
            )
        )
    # The A/A control: eager PyTorch against itself, the same work on both sides, timed the same way. Its ratio's
    # spread is the measurement's noise at that shape; a row within it is not a difference of the code.
    impls.append(
        (
            CONTROL,
            lambda x: down(F.silu(gate(x)) * up(x)),
            lambda x: down(F.silu(gate(x)) * up(x)),
            gated_w,
        )
    )
    try:
        llama, eager = _llama(gated_w)
        impls.append(("LlamaMLP (patched)", llama, eager, gated_w))
    except ImportError as e:
        print(f"LlamaMLP skipped: transformers not importable ({e})", file=sys.stderr)
    return impls


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _per_call(fns, calls: int, k: int) -> float:
    """Seconds per call of one run of fns[k]: `calls` calls."""
    return _time(functools.partial(fns[k], calls)) / calls


def measure(ours, eager, params, x, reps: int, warmup: int, run_s: float = 0.0, blocks: int = 1) -> dict:
    """{"fwd": (ours_s, eager_s, calls, ratio), "fwd+bwd": (...)}: seconds per call, the min of `reps` runs each,
    alternating; a run is `calls` calls, enough for the eager side's to last `run_s`. The runs fall into `blocks`
    blocks; ratio (eager / ours) is the median over blocks of the ratio of the blocks' minima: a busy spell that
    spares one side's best run moves one block, not the figure (ffn_ext._timing.blocked_pair says by how much)."""
    gy = torch.randn(x.shape[:-1] + (params[-1].shape[0],), dtype=x.dtype)
    xg = x.detach().requires_grad_()

    def clear():
        xg.grad = None
        for q in params:
            q.grad = None

    def fwd(f):
        def run(calls):
            with torch.no_grad():
                for _ in range(calls):
                    f(x)

        return run

    def train(f):
        def run(calls):
            for _ in range(calls):  # the gradients cleared before each call on both sides: no accumulation
                clear()
                f(xg).backward(gy)

        return run

    out = {}
    per_block = max(1, reps // blocks)
    for what, wrap in (("fwd", fwd), ("fwd+bwd", train)):
        fns = [wrap(ours), wrap(eager)]
        for _ in range(warmup):
            for f in fns:
                f(1)
        one = min(_time(functools.partial(fns[1], 1)) for _ in range(3))
        calls = max(1, min(1000, int(run_s / one) + 1)) if run_s > 0 else 1
        ours_s, eager_s, ratio = blocked_pair(functools.partial(_per_call, fns, calls), blocks, per_block)
        out[what] = (ours_s, eager_s, calls, ratio)
    clear()
    return out


def matmul_rate(dtype) -> float:
    """FLOP/s of one [512, 1024] x [1024, 1024] matmul on this thread count (best of 5)."""
    a, b = torch.randn(512, 1024, dtype=dtype), torch.randn(1024, 1024, dtype=dtype)
    best = min(_time(lambda: a @ b) for _ in range(5))
    return 2 * 512 * 1024 * 1024 / best


def estimate_s(d_model: int, d_ff: int, tokens: int, rate: float) -> float:
    """A gated fwd+bwd: 3 matmuls forward, 6 backward, of 2 T D F flops each (the classic FFN does 2/3 of it)."""
    return 9 * 2 * tokens * d_model * d_ff / rate


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes, 1 thread, 3 reps: a smoke test")
    ap.add_argument("--threads", default=None, help="comma-separated torch thread counts (default 1,2; quick: 1)")
    ap.add_argument("--reps", type=int, default=None, help="runs per case and side (default 60; quick: 3)")
    ap.add_argument(
        "--blocks",
        type=int,
        default=None,
        help="the runs fall into this many blocks; the ratio is the median of the blocks' (default 6; quick: 1)",
    )
    ap.add_argument(
        "--run-ms",
        type=float,
        default=None,
        help="a timed run is as many calls as last this long (default 2 ms; quick: 0, one call a run)",
    )
    ap.add_argument(
        "--max-run-s",
        type=float,
        default=0.3,
        help="skip shapes whose single fwd+bwd run is estimated above this (default 0.3 s)",
    )
    ap.add_argument("--pairs", default=None, help="d_model x d_ff pairs, e.g. 768x3072,4096x14336 (replace the grid's)")
    ap.add_argument("--tokens", default=None, help="comma-separated token counts (replace the grid's)")
    ap.add_argument("--impls", default=None, help="comma-separated implementations to run (default: all)")
    ap.add_argument(
        "--out", type=Path, default=None, help="output directory (default benchmarks/results/<date>_<device>/)"
    )
    args = ap.parse_args(argv)
    dtype = torch.float32
    pairs, tokens = (QUICK_PAIRS, QUICK_TOKENS) if args.quick else (PAIRS, TOKENS)
    if args.pairs:
        pairs = [tuple(int(v) for v in p.split("x")) for p in args.pairs.split(",")]
    if args.tokens:
        tokens = [int(t) for t in args.tokens.split(",")]
    wanted = None if args.impls is None else set(args.impls.split(","))
    threads = [int(t) for t in (args.threads or ("1" if args.quick else "1,2")).split(",")]
    blocks = args.blocks or (1 if args.quick else 6)
    reps = blocks * max(1, (args.reps or (3 if args.quick else 60)) // blocks)  # whole blocks: what the report says
    warmup = 1 if args.quick else 3
    run_s = (args.run_ms if args.run_ms is not None else (0.0 if args.quick else 2.0)) / 1e3
    dev = torch.device("cpu")
    t_start = time.perf_counter()
    torch.manual_seed(0)
    torch.set_num_threads(threads[0])
    rate = matmul_rate(dtype)
    shapes, skipped = [], []
    for d, f in pairs:
        for t in tokens:
            est = estimate_s(d, f, t, rate)
            (shapes if est <= args.max_run_s else skipped).append((d, f, t, est))
    print(
        f"matmul rate {rate / 1e9:.1f} GFLOP/s (1 thread); {len(shapes)} shapes, skipped {len(skipped)} whose single "
        f"fwd+bwd run is estimated above {args.max_run_s} s: "
        + (", ".join(f"{d}x{f}x{t} ({e:.1f} s)" for d, f, t, e in skipped) or "none"),
        file=sys.stderr,
    )
    rows = []
    for d, f, t, _ in shapes:
        impls = implementations(d, f, dtype)
        x = torch.randn(t, d, dtype=dtype)
        for n_threads in threads:
            torch.set_num_threads(n_threads)
            for name, ours, eager, params in impls:
                if wanted is not None and name not in wanted:
                    continue
                res = measure(ours, eager, params, x, reps, warmup, run_s, blocks)
                for what, (a, b, calls, ratio) in res.items():
                    rows.append(
                        {
                            "impl": name,
                            "d_model": d,
                            "d_ff": f,
                            "tokens": t,
                            "threads": n_threads,
                            "pass": what,
                            "calls": calls,
                            "ffn_ext_ms": a * 1e3,
                            "eager_ms": b * 1e3,
                            "ratio": ratio,
                        }
                    )
                print(
                    f"{name:<20} {d:>5} {f:>6} {t:>5} {n_threads}t  "
                    + "  ".join(f"{w} {r[3]:.3f}x" for w, r in res.items()),
                    file=sys.stderr,
                    flush=True,
                )
        del impls
    measured = [r for r in rows if r["impl"] != CONTROL]
    control = [r["ratio"] for r in rows if r["impl"] == CONTROL]
    worst = min(measured, key=lambda r: r["ratio"]) if measured else None
    payload = {
        "meta": common.metadata(dev, "quick" if args.quick else "full", sys.argv),
        "reps": reps,
        "blocks": blocks,
        "timing": (
            f"CPU wall-clock per call, min of {reps} runs, ffn_ext and eager alternating, a run being `calls` calls "
            f"(as many as last {run_s * 1e3:g} ms on the eager side); ratio: the median over {blocks} blocks of "
            f"{reps // blocks} runs of the ratio of the blocks' minima"
        ),
        "rows": rows,
        "skipped": [{"d_model": d, "d_ff": f, "tokens": t, "estimated_s": e} for d, f, t, e in skipped],
        "worst": worst,
        "seconds": time.perf_counter() - t_start,
    }
    headers = ["impl", "d_model", "d_ff", "tokens", "threads", "pass", "calls", "ffn_ext ms", "eager ms", "ratio"]
    table = [
        [
            r["impl"],
            r["d_model"],
            r["d_ff"],
            r["tokens"],
            r["threads"],
            r["pass"],
            r["calls"],
            f"{r['ffn_ext_ms']:.3f}",
            f"{r['eager_ms']:.3f}",
            f"{r['ratio']:.3f}",
        ]
        for r in rows
    ]
    lines = [
        f"# CPU: ffn_ext vs the eager PyTorch MLP ({common.cpu_name()}, torch {torch.__version__})",
        "",
        f"{payload['timing']}; ratio = eager / ffn_ext (>= 1: ffn_ext as fast or faster); fp32.",
        "",
        f"Command: `{' '.join(['python'] + sys.argv)}`",
        "",
    ]
    if worst is not None:
        lines.append(
            f"**Worst ratio: {worst['ratio']:.3f}** ({worst['impl']}, {worst['d_model']} -> {worst['d_ff']}, "
            f"{worst['tokens']} tokens, {worst['threads']} thread(s), {worst['pass']}); rows below 0.98: "
            f"{sum(r['ratio'] < 0.98 for r in measured)} of {len(measured)}; the A/A control (eager against itself)"
            f" spans {min(control):.3f}-{max(control):.3f}."
        )
        lines.append("")
    if skipped:
        lines.append(
            f"Skipped (single fwd+bwd run estimated above {args.max_run_s} s at "
            f"{rate / 1e9:.1f} GFLOP/s): "
            + ", ".join(f"{d} -> {f} x {t} tokens ({e:.1f} s)" for d, f, t, e in skipped)
            + "."
        )
        lines.append("")
    lines.append(common.markdown_table(headers, table))
    markdown = "\n".join(lines)
    out_dir = args.out or common.default_out_dir(dev)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "cpu.md").write_text(markdown + "\n")
    (out_dir / "cpu.json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
    print(markdown)
    print(f"\nwrote {out_dir / 'cpu.md'}, {out_dir / 'cpu.json'} in {payload['seconds']:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
