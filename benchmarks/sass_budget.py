#!/usr/bin/env python
"""Instructions per element on each CUDA kernel's vector path, read from the SASS (no GPU needed), what that
count predicts for bandwidth on an H200, and how it compares with the budgets the kernels were written to.

    python benchmarks/sass_budget.py                 # the loaded ffn_ext native library, sm_90
    python benchmarks/sass_budget.py --lib build/libffn_ext_ops.so --arch 80

A report, not a check: a kernel over its budget gets an OVER BUDGET line and the exit status stays 0, since the
counts move with each nvcc release while the code stays right. It exits 2 only when there is nothing to read (no
binary with CUDA kernels, no cuobjdump). What a regression would break (the kernel inventory, 128-bit accesses,
no local memory, every load issued before the math) is checked by tests/test_sass.py.

The SASS reader and the vector-path tracer are tests/sass_reader.py (its docstring says how the count is made);
the calibration of the count against Nsight Compute, and the issue ceiling below, are in docs/performance.md. The
FP8 quantizing kernels (csrc/cuda/quant_kernels.cuh) follow in a second table: their steady state per element
(sass_reader.quant_budget: one loop iteration, group / row / tensor and the tensor kernel's amax launch).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent
for _path in (_REPO, _REPO / "tests"):  # the checkout's ffn_ext when none is installed, and the SASS reader
    if str(_path) not in sys.path:
        sys.path.append(str(_path))

import sass_reader as S  # noqa: E402

# An H200's issue ceiling over its copy bandwidth (docs/performance.md): a kernel needing D instructions per byte
# moved reaches at most H200_INSTR_PER_BYTE / D of copy bandwidth.
H200_INSTR_PER_BYTE = 6.45
# The row ops' budgets: float32 kernels at 92% of copy bandwidth (the CUDA kernels' target), 16-bit kernels
# memory-bound. float64 issues at half rate, so instruction count alone does not bound it: no budget.
ROW_TARGET = 0.92
# The FP8 quantizing kernels (docs/fp8.md): bf16 SwiGLU's instructions per element per kind, a little above the
# sm_90 counts they were tuned to; every 16-bit kernel at 90% of copy bandwidth and within 7.2 per byte.
QUANT_SWIGLU_BF16 = {"group": 31.5, "row": 29.5, "tensor": 23.5, "tensor amax": 21.5}
QUANT_TARGET = 0.9
QUANT_BYTE_LIMIT = 7.2


def h200_bound(instr_per_byte: float) -> float:
    """The fraction of copy bandwidth an H200 can issue `instr_per_byte` at (1: memory-bound)."""
    return min(1.0, H200_INSTR_PER_BYTE / instr_per_byte)


def row_over_budget(rows: list[dict], arch: int) -> list[str]:
    """The rows_kernels of budget() over theirs (sm_90 only: the budgets are an H200's), one line each."""
    if arch != 90:
        return []
    out = []
    for r in rows:
        where = f"sm_{arch} {r['op']} ({r['kernel']}) {r['dtype']}"
        per_byte = r["instr_per_byte"]
        if r["dtype"] == "float64":
            continue
        if S.DTYPE_SIZE[r["dtype"]] == 2 and per_byte > H200_INSTR_PER_BYTE:
            out.append(f"{where}: {per_byte:.2f} instructions per byte, above the issue ceiling {H200_INSTR_PER_BYTE}")
        elif per_byte > H200_INSTR_PER_BYTE / ROW_TARGET:
            out.append(
                f"{where}: {per_byte:.2f} instructions per byte, predicted at {h200_bound(per_byte):.0%} of copy"
            )
    return out


def quant_over_budget(rows: list[dict], arch: int) -> list[str]:
    """The quantizing kernels of quant_budget() over theirs (sm_90 only), one line each."""
    if arch != 90:
        return []
    out = []
    for r in rows:
        where = f"sm_{arch} {r['op']} {r['layout']} {r['kind']} {r['dtype']}".replace("  ", " ")
        if r["op"] == "swiglu" and not r["layout"] and r["dtype"] == "bfloat16":
            if r["instr_per_elem"] > QUANT_SWIGLU_BF16[r["kind"]]:
                out.append(
                    f"{where}: {r['instr_per_elem']:.1f} instructions per element, "
                    f"budget {QUANT_SWIGLU_BF16[r['kind']]}"
                )
        if S.DTYPE_SIZE[r["dtype"]] == 2:
            bound = h200_bound(r["instr_per_byte"])
            if bound < QUANT_TARGET or r["instr_per_byte"] > QUANT_BYTE_LIMIT:
                out.append(
                    f"{where}: {r['instr_per_byte']:.2f} instructions per byte (budget {QUANT_BYTE_LIMIT}), "
                    f"predicted at {bound:.0%} of copy (budget {QUANT_TARGET:.0%})"
                )
    return out


def table(rows: list[dict], arch: int) -> str:
    """budget's rows as a markdown table."""
    lines = [
        f"Vector path of each rows_kernel, sm_{arch} SASS (a prediction, not a measurement; see tests/sass_reader.py)",
        "",
        "| op | kernel | dtype | instr / elem | instr / byte | H200 issue bound (x copy) | 128-bit loads / stores "
        "| math before the last load |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b = h200_bound(r["instr_per_byte"])
        bound = (
            "- (fp64 pipe: half rate)" if r["dtype"] == "float64" else ">= 1 (memory-bound)" if b >= 1 else f"{b:.0%}"
        )
        op = f"{r['op']} ({r['layout']})" if r["layout"] else r["op"]
        lines.append(
            f"| {op} | {r['kernel']} | {r['dtype']} | {r['instr_per_elem']:.1f} | "
            f"{r['instr_per_byte']:.2f} | {bound} | {r['loads']} / {r['stores']} | "
            f"{r['math_before_last_load']} |"
        )
    return "\n".join(lines)


def quant_table(rows: list[dict], arch: int) -> str:
    """quant_budget's rows as a markdown table."""
    lines = [
        f"FP8 quantizing kernels, sm_{arch} SASS, steady state (a prediction, not a measurement; see quant_budget)",
        "",
        "| op | kernel | dtype | instr / elem | instr / byte | H200 issue bound (x copy) | fp8 cvt instruction |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b = h200_bound(r["instr_per_byte"])
        op = f"{r['op']} ({r['layout']})" if r["layout"] else r["op"]
        cvt = ", ".join(f"F2FP {f}" for f in r["f2fp"]) or "software"
        lines.append(
            f"| {op} | {r['kind']} | {r['dtype']} | {r['instr_per_elem']:.1f} | {r['instr_per_byte']:.2f} | "
            f"{'>= 1 (memory-bound)' if b >= 1 else f'{b:.0%}'} | {cvt} |"
        )
    return "\n".join(lines)


def spill_report(funcs: dict, res: dict, arch: int) -> str:
    """Registers per rows_kernel of `arch` and the kernels with a stack frame, local memory or local loads and
    stores (spills): a report (tests/test_sass.py is the check)."""
    ours = {n: r for (a, n), r in res.items() if a == arch and S.kernel_of(n) is not None}
    if not ours:
        return f"sm_{arch}: no resource usage for the rows_kernels"
    regs = sorted((r.get("REG", 0), str(S.kernel_of(n))) for n, r in ours.items())
    lines = [
        f"sm_{arch} registers per thread: {regs[0][0]} ({regs[0][1]}) to {regs[-1][0]} ({regs[-1][1]}); "
        f"{sum(r == regs[-1][0] for r, _ in regs)} of {len(regs)} kernels at {regs[-1][0]}"
    ]
    bad = []
    for n, r in sorted(ours.items(), key=lambda kv: str(S.kernel_of(kv[0]))):
        local = sum(S.LOCAL_MEM.search(op) is not None for _, op in funcs.get((arch, n), []))
        if r.get("STACK") or r.get("LOCAL") or local:
            bad.append(
                f"  {S.kernel_of(n)}: REG {r.get('REG')}, STACK {r.get('STACK')} bytes, LOCAL {r.get('LOCAL')} "
                f"bytes, {local} local loads/stores (LDL/STL)"
            )
    lines += (["SPILLS (stack or local memory):"] + bad) if bad else ["no stack, local memory or LDL/STL in any kernel"]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="benchmarks/sass_budget.py",
        description="Instructions per element on each CUDA kernel's vector path, read from "
        "the SASS (no GPU needed), the H200 bandwidth they predict, and the kernels over budget.",
    )
    ap.add_argument("--lib", help="binary to read (default: the loaded ffn_ext native library)")
    ap.add_argument("--arch", type=int, default=90, help="SASS architecture, e.g. 80 or 90 (default 90)")
    args = ap.parse_args(argv)
    name = ap.prog
    lib = args.lib
    if lib is None:
        lib, why = S.native_library()
        if lib is None:
            print(f"{name}: {why}; pass --lib", file=sys.stderr)
            return 2
    if S.cuobjdump() is None:
        print(f"{name}: cuobjdump not found (pip install triton, or set CUDA_HOME)", file=sys.stderr)
        return 2
    funcs = S.parse_sass(S.dump(lib, "sass", args.arch))
    rows = S.budget(funcs, args.arch)
    if not rows:
        print(f"{name}: no rows_kernel SASS for sm_{args.arch} in {lib}", file=sys.stderr)
        return 2
    print(table(rows, args.arch))
    over = row_over_budget(rows, args.arch)
    quant = S.quant_budget(funcs, args.arch)
    if quant:
        print("\n" + quant_table(quant, args.arch))
        over += quant_over_budget(quant, args.arch)
    print("\n" + spill_report(funcs, S.parse_resources(S.dump(lib, "res", args.arch)), args.arch))
    if args.arch != 90:
        print(f"\nbudgets: none for sm_{args.arch} (they are an H200's, sm_90)")
    elif over:
        print(f"\nOVER BUDGET: {len(over)} kernels (a report, not a failure)")
        print("\n".join(f"OVER BUDGET {line}" for line in over))
    else:
        print("\nbudgets: every sm_90 kernel within its budget")
    return 0


if __name__ == "__main__":
    sys.exit(main())
