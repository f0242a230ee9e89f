#!/usr/bin/env python
"""Host time per call at decode size, split into the layers a call goes through.

    python benchmarks/host_overhead.py --device cuda --out $OUT/bench   # the device check's `host` stage
    python benchmarks/host_overhead.py --device cpu --only call          # one small call, next to ATen and a plain
                                                                         # custom op (docs/performance.md)
    python benchmarks/host_overhead.py --device meta                     # here: Python + dispatch + checks only
    python benchmarks/host_overhead.py --smoke --device cpu --out /tmp/x # CI's pipeline check

The "call" group first: SwiGLU at 1 token of 64 (one thread on the CPU), the public call `ffn_ext.swiglu`, the
dispatcher op `torch.ops.ffn_ext.swiglu`, ATen's two ops `F.silu(g) * u`, and the pattern torch documents for an
extension op (`torch.library.custom_op` with `register_autograd`, its body ATen's two ops): without grad, and
forward + backward with grads. Its ratios are the public call against ATen, torch.ops against the custom op, and
forward + backward against ATen's.

At 16x4864 (a decode step's MLP activation) a kernel takes a few microseconds of GPU time and a call costs more
host time than that, so what decides the latency is the host path. ATen's `F.gelu` reaches its kernel through a
generated Python binding; `ffn_ext.gelu` through a Python wrapper, `torch.ops` (a boxed call parsed against the
schema; started below autograd when nothing is recorded) and the CUDA kernel's checks (a direct `torch.ops` call
also passes the ops' Python autograd kernel, ffn_ext/_kernels.py). Each row times one layer of that path, so the
differences between rows say where the time goes:

    ffn_ext.<op>            - torch.ops ffn_ext    = the Python wrapper (ffn_ext/ops.py _call); the ops are the op
                                                     table's (gelu, gelu_tanh, silu, geglu, ..., swiglu_packed), each
                                                     by its public call (ffn_ext.gelu(approximate='tanh'), ...)
    torch.ops ffn_ext       - OpOverload._op       = OpOverload.__call__ (Python)
    torch.ops ffn_ext       - torch.ops aten       = ffn_ext's path (autograd kernel, checks, alloc, launch) minus ATen's
                                                     (gelu and silu: the same boxed path around both)
    torch.ops aten          - ATen eager           = torch.ops' boxed call minus ATen's generated binding

The last group is a whole decode-step MLP (1 token, Qwen2.5-0.5B widths 896 -> 4864): ffn_ext.SwiGLUFFN against
the eager form with three nn.Linear modules (not on meta tensors, where ATen's Linear is a Python meta function).

Timing: rounds that cycle through every row (so a drift of the machine affects all rows alike); in each round a
row issues `--calls` calls with no synchronization between them, then synchronizes. "issue µs" is the time to
issue a call, "total µs" includes waiting for the GPU: when they are about equal the GPU was idle waiting for the
host (host-bound, as intended at this size); when total is much larger the row is GPU-bound and its issue time
is not its cost. Medians over rounds; inputs do not require grad (inference).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (also puts the repository root on sys.path)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import ffn_ext  # noqa: E402

KINDS = common.table_ops()  # op -> (kind, Activation), from the op table
OPS = tuple(KINDS)  # gelu, gelu_tanh, silu, geglu, geglu_tanh, swiglu, geglu_packed, geglu_tanh_packed, swiglu_packed
EAGER_MLP = "eager MLP (3 nn.Linear, F.silu(g) * u)"
BASELINES = ("ATen eager", EAGER_MLP)  # the row each group's last column is relative to


def rows_for(op: str, dev: torch.device) -> list:
    """(label, callable) for each layer of `op`, fastest-path first. ATen rows are left out on meta tensors, where
    ATen's kernels are Python meta functions and so not comparable."""
    ours = getattr(torch.ops.ffn_ext, op).default if ffn_ext.ops._native is not None else None
    rows = []
    if dev.type != "meta":
        rows.append(("ATen eager", common.eager_fn(op)))
        if hasattr(torch.ops.aten, op):  # gelu, silu: ATen's own op through torch.ops
            rows.append(("torch.ops aten", getattr(torch.ops.aten, op).default))
    rows.append((common.ffn_ext_label(op), common.ffn_ext_fn(op)))
    if ours is not None:
        rows.append(("torch.ops ffn_ext", ours))
        if callable(getattr(ours, "_op", None)):  # private attribute: a diagnostic row only
            rows.append(("OpOverload._op", ours._op))
    if dev.type != "meta":
        rows.append(("torch.empty_like (alloc only)", lambda x, *rest: torch.empty_like(x)))
    return rows


def make_args(op, shape, dtype, dev):
    rows, cols = shape
    kind = KINDS[op][0]
    if kind == "packed":
        cols *= 2
    n_in = 2 if kind == "gated" else 1
    return tuple(
        torch.randn(rows, cols, dtype=torch.float32, device="cpu" if dev.type == "meta" else dev).to(
            dtype=dtype, device=dev
        )
        for _ in range(n_in)
    )


def _plain_custom_op():
    """SwiGLU as the documented pattern of a Python extension op: torch.library.custom_op with register_fake and
    register_autograd (setup_context), its body and backward ATen's ops: the host time every such op pays."""

    @torch.library.custom_op("ffn_ext_bench::swiglu", mutates_args=())
    def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up

    swiglu.register_fake(lambda gate, up: torch.empty_like(gate))

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        return torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)

    swiglu.register_autograd(backward, setup_context=setup_context)
    return swiglu


CALL_SHAPE = (1, 64)


def call_rows(dev) -> tuple[list, list]:
    """(rows without grad, rows of forward + backward with grads) of the call group."""
    custom = _plain_custom_op()
    nograd = [
        ("ATen F.silu(g) * u", lambda g, u: F.silu(g) * u),
        ("ffn_ext.swiglu", ffn_ext.swiglu),
        ("torch.ops.ffn_ext.swiglu", torch.ops.ffn_ext.swiglu),
        ("custom_op + register_autograd", custom),
    ]

    def fwd_bwd(fn):
        def run(g, u, dy):
            fn(g, u).backward(dy)

        return run

    grad = [(f"{label} fwd+bwd", fwd_bwd(fn)) for label, fn in nograd if not label.startswith("torch.ops")]
    return nograd, grad


def measure(rows, args, dev, rounds: int, calls: int, grad: bool = False) -> list[dict]:
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    issue = {label: [] for label, _ in rows}
    total = {label: [] for label, _ in rows}
    with torch.enable_grad() if grad else torch.no_grad():
        for _, fn in rows:  # warm-up: caches, allocator, lazy loading of the kernels
            for _ in range(max(10, calls // 10)):
                fn(*args)
        sync()
        for _ in range(rounds):
            for label, fn in rows:
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn(*args)
                t1 = time.perf_counter()
                sync()
                t2 = time.perf_counter()
                issue[label].append((t1 - t0) / calls * 1e6)
                total[label].append((t2 - t0) / calls * 1e6)
    return [
        {
            "layer": label,
            "issue_us": statistics.median(issue[label]),
            "issue_min_us": min(issue[label]),
            "total_us": statistics.median(total[label]),
        }
        for label, _ in rows
    ]


def run(args) -> dict:
    dev = torch.device(args.device) if args.device == "meta" else common.resolve_device(args.device)
    mode = "smoke" if args.smoke else "quick"
    shape = (4, 256) if args.smoke else tuple(int(s) for s in args.shape.lower().split("x"))
    dtype = common.DTYPES[args.dtype]
    rounds, calls = (3, 20) if args.smoke else (args.rounds, args.calls)
    notes = []
    if dev.type == "cpu":
        notes.append("CPU: the ops compute here, so rows include the CPU kernels' time; this is not host overhead")
    if dev.type == "meta":
        notes.append("meta tensors: no kernels run; the rows time Python, dispatch and the shape checks only")
    if dev.type == "cuda" and not ffn_ext.has_cuda_kernels():
        notes.append("WARNING: the loaded ffn_ext has no CUDA kernels")
    results = []
    if dev.type != "meta":
        nograd, grad = call_rows(dev)
        g, u = (torch.randn(CALL_SHAPE, device=dev) for _ in range(2))
        for r in measure(nograd, (g, u), dev, rounds, calls):
            results.append({"op": "call", **r})
        gr, ur = (t.clone().requires_grad_() for t in (g, u))
        for r in measure(grad, (gr, ur, torch.randn(CALL_SHAPE, device=dev)), dev, rounds, calls, grad=True):
            results.append({"op": "call", **r})
    if args.only == "call":
        return _payload(args, dev, mode, shape, rounds, calls, notes, results)
    for op in OPS:
        rows = rows_for(op, dev)
        for r in measure(rows, make_args(op, shape, dtype, dev), dev, rounds, calls):
            results.append({"op": op, **r})
    if dev.type != "meta":  # a whole decode-step MLP (meta: ATen's Linear is a Python meta function)
        tokens, d_model, d_ff = (1, 8, 16) if args.smoke else (1, 896, 4864)
        mlp = ffn_ext.SwiGLUFFN(d_model, d_ff, device=dev, dtype=dtype)
        g, u, d = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        rows = [(EAGER_MLP, lambda x: d(F.silu(g(x)) * u(x))), ("ffn_ext.SwiGLUFFN", mlp)]
        x = torch.randn(tokens, d_model, device=dev, dtype=dtype)
        for r in measure(rows, (x,), dev, rounds, calls):
            results.append({"op": f"MLP {tokens}x{d_model}->{d_ff}", **r})
    return _payload(args, dev, mode, shape, rounds, calls, notes, results)


# the call group's ratios: (what, row, against)
CALL_RATIOS = [
    ("public call / ATen's two ops", "ffn_ext.swiglu", "ATen F.silu(g) * u"),
    ("torch.ops / a plain custom op", "torch.ops.ffn_ext.swiglu", "custom_op + register_autograd"),
    ("fwd+bwd / ATen's", "ffn_ext.swiglu fwd+bwd", "ATen F.silu(g) * u fwd+bwd"),
]


def _payload(args, dev, mode, shape, rounds, calls, notes, results) -> dict:
    meta = common.metadata(dev, mode, sys.argv)
    if dev.type == "meta":
        meta["device_name"] = "meta tensors"
    meta.update(
        shape=list(shape),
        dtype=args.dtype,
        rounds=rounds,
        calls_per_round=calls,
        timing="time.perf_counter around back-to-back calls; median over rounds",
        threads=torch.get_num_threads(),
        call_shape=list(CALL_SHAPE),
    )
    by = {r["layer"]: r["issue_us"] for r in results if r["op"] == "call"}
    ratios = {what: by[a] / by[b] for what, a, b in CALL_RATIOS if a in by and b in by}
    return {"meta": meta, "notes": notes, "results": results, "call_ratios": ratios}


def markdown(payload: dict) -> str:
    meta = payload["meta"]
    shape = "x".join(map(str, meta["shape"]))
    lines = [
        f"# ffn_ext host time per call — {meta['device_name']}",
        "",
        f"torch {meta['torch_version']}, commit {meta['git_commit']}, {meta['dtype']} {shape}, "
        f"{meta['rounds']} rounds x {meta['calls_per_round']} calls, no grad; {meta['timing']}",
        "",
    ]
    lines += [f"- {n}" for n in payload["notes"]] + [""]
    if payload.get("call_ratios"):
        lines += [
            f"One call (group `call`: SwiGLU {'x'.join(map(str, meta['call_shape']))} float32, "
            f"{meta['threads']} thread(s)):",
            "",
        ]
        lines += [f"- {what}: {ratio:.2f}x" for what, ratio in payload["call_ratios"].items()] + [""]
    table = []
    for op in dict.fromkeys(r["op"] for r in payload["results"]):
        rs = [r for r in payload["results"] if r["op"] == op]
        base = next((r["issue_us"] for r in rs if r["layer"] in BASELINES), None)
        for r in rs:
            table.append(
                [
                    op,
                    r["layer"],
                    common.fmt(r["issue_us"], ".2f"),
                    common.fmt(r["issue_min_us"], ".2f"),
                    common.fmt(r["total_us"], ".2f"),
                    common.fmt(None if base is None else r["issue_us"] - base, "+.2f"),
                ]
            )
    lines.append(
        common.markdown_table(
            ["op", "layer", "issue µs (median)", "issue µs (min)", "total µs", "issue − eager µs"], table
        )
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N, meta")
    p.add_argument("--shape", default="16x4864", help="rows x cols of the op's output (default 16x4864)")
    p.add_argument("--dtype", default="bf16", choices=sorted(common.DTYPES))
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=200, help="back-to-back calls per row and round")
    p.add_argument("--smoke", action="store_true", help="tiny shape, few calls: a CI check of the pipeline")
    p.add_argument("--only", choices=["call"], default=None, help="call: only the one-call group")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads on the CPU (default 1)")
    p.add_argument("--out", type=Path, default=None, help="output directory for host.md / host.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    payload = run(args)
    md = markdown(payload)
    print(md)
    if args.out is not None:
        files = common.write_outputs(args.out, "host", payload, md)
        print("\nwrote: " + ", ".join(str(f) for f in files), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
