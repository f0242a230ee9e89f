#!/usr/bin/env python
"""One MLP's forward + backward peak on the CPU, every form of ffn_ext.mlp against its eager composition.

    python benchmarks/mlp_peak.py                              # 4096 tokens, 256 -> 1024, fp32 (issue 45's case)
    python benchmarks/mlp_peak.py --tokens 1024,4096 --d-model 256 --d-ff 1024 --out /tmp/x
    python benchmarks/mlp_peak.py --dtype bfloat16 --cases eager,default,fp8_cache    # the FP8 cache of bf16 training

The peak is the CPU allocator's live bytes above the step's start (common.CpuAllocPeak: the profiler's allocation
events, ops on their ordinary paths), for y = mlp(x); torch.autograd.grad(y, [x, *params], dy) with x, dy and the
parameters made before, and what the forward leaves allocated for backward (kept: its live bytes at the forward's
end, less y's). Reported in [tokens, d_ff] tensors of the dtype and as a fraction of the eager composition's (HF's down(act(gate(x)) * up(x)), fc2(act(fc1(x))) for the classic FFN): the smallest of
--repeats runs each (allocation order does not vary; the repeats catch a stray allocation). Writes mlp_peak.json and
mlp_peak.md into --out when given.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import ffn_ext  # noqa: E402

CLAMP = ffn_ext.Gating("swiglu_clamped", limit=7.0, alpha=1.702, up_offset=1.0)


def _eager_gated(act, clamp=False):
    def f(x, wg, wu, wd):
        g, u = F.linear(x, wg), F.linear(x, wu)
        if clamp:  # GPT-OSS's form
            g, u = g.clamp(max=7.0), u.clamp(-7.0, 7.0)
            return F.linear((u + 1) * g * torch.sigmoid(1.702 * g), wd)
        return F.linear(act(g) * u, wd)

    return f


def _eager_packed(x, wgu, wd):
    g, u = F.linear(x, wgu).chunk(2, -1)
    return F.linear(F.silu(g) * u, wd)


def _eager_plain(x, w1, w2, b1, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


def cases():
    """name -> (eager name, parameter shapes as (d_model, d_ff) -> shapes, the call)."""
    gated = lambda dm, dff: [(dff, dm), (dff, dm), (dm, dff)]  # noqa: E731
    packed = lambda dm, dff: [(2 * dff, dm), (dm, dff)]  # noqa: E731
    plain = lambda dm, dff: [(dff, dm), (dm, dff), (dff,), (dm,)]  # noqa: E731
    mlp, pk = ffn_ext.swiglu_mlp, ffn_ext.swiglu_mlp_packed
    return {
        "eager": ("eager", gated, _eager_gated(F.silu)),
        "default": ("eager", gated, mlp),
        "recompute": ("eager", gated, lambda *a: mlp(*a, recompute=True)),
        "token_chunk=1024": ("eager", gated, lambda *a: mlp(*a, token_chunk=1024)),
        "fp8_cache": ("eager", gated, lambda *a: mlp(*a, saved_dtype=torch.float8_e4m3fn)),
        "bf16_cache": ("eager", gated, lambda *a: mlp(*a, saved_dtype=torch.bfloat16)),
        "eager packed": ("eager packed", packed, _eager_packed),
        "packed": ("eager packed", packed, pk),
        "interleaved": (
            "eager packed",
            packed,
            lambda x, w, wd: ffn_ext.gated_mlp_packed(
                x, w, wd, activation=ffn_ext.Gating("swiglu", layout="interleaved")
            ),
        ),
        "eager clamped": ("eager clamped", gated, _eager_gated(None, clamp=True)),
        "clamped": ("eager clamped", gated, lambda x, wg, wu, wd: ffn_ext.gated_mlp(x, wg, wu, wd, activation=CLAMP)),
        "eager geglu": ("eager geglu", gated, _eager_gated(lambda g: F.gelu(g, approximate="tanh"))),
        "geglu": ("eager geglu", gated, lambda *a: ffn_ext.geglu_mlp(*a, approximate="tanh")),
        "eager classic": ("eager classic", plain, _eager_plain),
        "classic": ("eager classic", plain, lambda *a: ffn_ext.plain_mlp(*a, activation="gelu")),
    }


def peak(fn, shapes, tokens, d_model, dtype, repeats):
    """(the step's peak, the bytes the forward keeps for backward), the smallest over the repeats."""
    best = kept = None
    for _ in range(repeats):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(tokens, d_model, generator=gen, dtype=dtype).requires_grad_()
        params = [(torch.randn(s, generator=gen, dtype=dtype) / s[-1] ** 0.5).requires_grad_() for s in shapes]
        dy = torch.randn(tokens, d_model, generator=gen, dtype=dtype)
        with common.CpuAllocPeak() as p:
            grads = torch.autograd.grad(fn(x, *params), [x, *params], dy)
        del grads
        with common.CpuAllocPeak() as fwd:  # (a profiler of its own: they do not nest)
            y = fn(x, *params)
        left = fwd.live - y.untyped_storage().nbytes()
        del y
        best = p.peak if best is None else min(best, p.peak)
        kept = left if kept is None else min(kept, left)
    return best, kept


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="4096")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--d-ff", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--cases", default=None, help="comma-separated subset of: " + ", ".join(cases()))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    table = cases()
    names = args.cases.split(",") if args.cases else list(table)
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        unit = tokens * args.d_ff * dtype.itemsize
        got, kept = {}, {}
        for name in names:
            ref, shapes, fn = table[name]
            got[name], kept[name] = peak(fn, shapes(args.d_model, args.d_ff), tokens, args.d_model, dtype, args.repeats)
        for name in names:
            ref = table[name][0]
            base = got[ref] if ref in got else None
            kept_base = kept[ref] if ref in kept else None
            rows.append(
                dict(
                    tokens=tokens,
                    case=name,
                    peak_bytes=got[name],
                    tensors=got[name] / unit,
                    vs_eager=None if base is None else got[name] / base,
                    kept_bytes=kept[name],
                    kept_tensors=kept[name] / unit,
                    kept_vs_eager=None if not kept_base else kept[name] / kept_base,
                )
            )
            vs = "" if base is None else f"  {got[name] / base:.3f}x {ref}"
            kvs = "" if not kept_base else f"  {kept[name] / kept_base:.3f}x"
            print(
                f"{tokens:6d} {name:18s} {got[name] / 2**20:8.1f} MiB  {got[name] / unit:5.2f} [T, d_ff]{vs}"
                f"   kept {kept[name] / unit:5.2f} [T, d_ff]{kvs}"
            )
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = common.metadata(torch.device("cpu"), "mlp_peak", sys.argv if argv is None else argv)
        (out / "mlp_peak.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        md = common.markdown_table(
            [
                "tokens",
                "case",
                "peak MiB",
                "[tokens, d_ff] tensors",
                "vs eager",
                "kept [tokens, d_ff]",
                "kept vs eager",
            ],
            [
                [
                    str(r["tokens"]),
                    r["case"],
                    f"{r['peak_bytes'] / 2**20:.1f}",
                    f"{r['tensors']:.2f}",
                    common.fmt(r["vs_eager"]),
                    f"{r['kept_tensors']:.2f}",
                    common.fmt(r["kept_vs_eager"]),
                ]
                for r in rows
            ],
        )
        md = f"{args.dtype}, d_model {args.d_model}, d_ff {args.d_ff}; [tokens, d_ff] tensors of {args.dtype}\n\n" + md
        (out / "mlp_peak.md").write_text(md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
