"""Instructions per element on each kernel's vector path, read from the SASS (no GPU needed), and what that count
predicts for bandwidth on an H200.

    python benchmarks/sass_budget.py                 # the loaded ffn_ext._C, sm_90
    python benchmarks/sass_budget.py --lib build/libffn_ext_ops.so --arch 80

A memory-bound elementwise kernel is fast only while the SMs can issue its instructions faster than memory
moves its bytes. This script follows, in each rows_kernel's SASS, the path that almost every thread of a large
contiguous tensor takes: a block other than block 0 along the row (no head or tail elements), every operand
16-byte aligned, all kUnroll vectors in range, one row (rows.h's kFull body). At a conditional forward branch
the path jumps if the code jumped over holds a scalar global load or store (LDG/STG of one element: the head, an
element-wise fallback, the general body) and the target can still lead to kUnroll 128-bit loads per input and
stores per output; otherwise it falls through (into the vector access the branch guards, or into math). The row
loop's back edge is not taken. It counts the instructions on that path (NOPs excluded) and divides by the
elements a thread handles (kUnroll * VEC) and the bytes each element moves. It also counts the floating-point
instructions issued before the path's last load: 0 means every load of the thread is in flight before its math
starts, which is what keeps enough bytes in flight per multiprocessor.

Calibration. On the tree of commit cec8a58, this count matches Nsight Compute's smsp__inst_executed on the H200
(benchmarks/results/2026-11-30_h200/ncu.log, bf16, 2**26 elements) to within 2%: gelu 34.9 and 34.9 per element,
gelu_backward 56.5 and 56.5, silu 23.8 and 23.8, silu_backward 40.1 and 40.1, swiglu 31.9 and 31.9,
swiglu_backward 47.0 and 48.0. The same run gives the issue ceiling: 132 SMs x 4 schedulers x 1.92 GHz at the
~83% issue-active that issue-bound kernels reached, 2.69e13 instructions/s per thread lane, against a copy at
4172 GB/s: about 6.45 instructions per byte. A kernel needing D instructions per byte then reaches at most
6.45 / D of copy bandwidth; that bound gave 74% for GELU forward and 69% for GELU backward (measured: 73.6% and
70.6%), and above 96% for SiLU (measured 97.7-97.8%). It is a prediction for an H200 and this nvcc, not a
measurement: the device benchmarks measure. (The branch rule above gives the same counts as the rule used for
that calibration, which never took a branch into code with 128-bit accesses, on the kernels of cec8a58 and
2bfde8d; the kFull body came after.)
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

K_UNROLL = 4  # csrc/rows.h kUnroll
FUNCTORS = {"GeluFwd": ("gelu", 1, 1), "GeluBwd": ("gelu_backward", 2, 1), "SiluFwd": ("silu", 1, 1),
            "SiluBwd": ("silu_backward", 2, 1), "SwigluFwd": ("swiglu", 2, 1),
            "SwigluBwd": ("swiglu_backward", 3, 2)}  # functor -> (op, NI, NO), as in csrc/ffn_math.h
DTYPES = {"d": ("float64", 8), "f": ("float32", 4), "N3c104HalfE": ("float16", 2), "N3c108BFloat16E": ("bfloat16", 2)}
H200_INSTR_PER_BYTE = 6.45  # issue ceiling / copy bandwidth, from the 2026-11-30 H200 run (see above)

VECTOR_MEM = re.compile(r"\b(?:LDG|STG)(?:\.[A-Z0-9_]+)*\.128\b")         # 16 bytes: LDG.E.128, STG.E.128...
SCALAR_MEM = re.compile(r"\b(?:LDG|STG)(?:\.(?!128\b)[A-Z0-9_]+)*\s")      # one element: LDG.E.U16, STG.E.64...
PREDICATE = re.compile(r"^@!?U?P\w+\s+")
BRANCH = re.compile(r"BRA(?:\.[A-Z0-9_]+)*\s+(?:(!?U?P[T0-9]+),\s*)?(0x[0-9a-f]+)")  # BRA [!P0,] 0x1b60
FP_MATH = re.compile(r"(?:FFMA|FMUL|FADD|MUFU|DFMA|DMUL|DADD|HFMA2(?!\.MMA)|HMUL2|HADD2)\b")  # HFMA2.MMA: a move


def cuobjdump() -> str | None:
    """triton's copy (the CUDA build of torch installs it), else $CUDA_HOME/bin, else PATH."""
    spec = importlib.util.find_spec("triton")
    candidates = [Path(loc) / "backends" / "nvidia" / "bin" / "cuobjdump"
                  for loc in (spec.submodule_search_locations or [])] if spec else []
    if os.environ.get("CUDA_HOME"):
        candidates.append(Path(os.environ["CUDA_HOME"]) / "bin" / "cuobjdump")
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    return shutil.which("cuobjdump")


def kernel_of(mangled: str):
    """_ZN7ffn_ext4cuda11rows_kernelI<T>NS_4math<len><Functor>ELi<VEC>E... -> (functor, dtype, VEC) or None."""
    m = re.match(r"_ZN7ffn_ext4cuda11rows_kernelI(N3c108BFloat16E|N3c104HalfE|f|d)NS_4math(\d+)", mangled)
    if not m:
        return None
    n = int(m.group(2))
    rest = re.match(r"ELi(\d+)E", mangled[m.end() + n:])
    if rest is None:
        return None
    return mangled[m.end():m.end() + n], DTYPES[m.group(1)][0], int(rest.group(1))


def functions(sass_text: str, arch: int) -> dict[str, list[tuple[int, str]]]:
    """{mangled name: [(address, instruction)]} of one architecture in `cuobjdump --dump-sass` output."""
    out, cur_arch, cur = {}, None, None
    for line in sass_text.splitlines():
        m = re.match(r"\s*(?:arch = |code for )sm_(\d+)", line)  # a library's fatbin, or a bare cubin
        if m:
            cur_arch, cur = int(m.group(1)), None
            continue
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            cur = out.setdefault(m.group(1), []) if cur_arch == arch else None
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+([^;]*);", line)
        if cur is not None and m:
            cur.append((int(m.group(1), 16), m.group(2).strip()))
    return out


def _step(op: str, predicated: bool, addr: int, index: dict) -> tuple[tuple[int, int], list[int], bool]:
    """One instruction: its (128-bit loads, 128-bit stores), the indices the path can go on to (none: the path
    ends there), and whether it is a conditional forward branch (two ways on)."""
    vec = VECTOR_MEM.match(op) is not None
    add = (int(vec and op.startswith("LDG")), int(vec and op.startswith("STG")))
    nxt = index[addr] + 1
    if op.startswith("EXIT") and not predicated:
        return add, [], False
    m = BRANCH.match(op)
    if m is None:
        return add, [nxt], False
    target = int(m.group(2), 16)
    conditional = predicated or m.group(1) not in (None, "PT")
    if target <= addr:  # the row loop's back edge: one row only
        return add, [nxt] if conditional else [], False
    return add, [index[target], nxt] if conditional else [index[target]], conditional


def vector_path(ins: list[tuple[int, str]], want_loads: int, want_stores: int, path: list | None = None
                ) -> tuple[int, int, int]:
    """(instructions, 128-bit loads, 128-bit stores) on the path described at the top of this file, for a kernel
    whose vector path makes want_loads 128-bit loads and want_stores 128-bit stores. The path never passes an
    unpredicated scalar access (a predicated one is issued with its predicate off, and counted). If `path` is a
    list, the indices of the path's instructions are appended to it."""
    index = {a: i for i, (a, _) in enumerate(ins)}
    ops = [(PREDICATE.sub("", t), PREDICATE.match(t) is not None) for _, t in ins]
    want = (want_loads, want_stores)
    # can[i]: the (loads, stores) that some path from instruction i to its end makes (at most `want`)
    can: list[set] = [set() for _ in range(len(ins) + 1)]
    for i in range(len(ins) - 1, -1, -1):
        op, predicated = ops[i]
        if op.startswith("NOP"):
            can[i] = can[i + 1]
        elif not (SCALAR_MEM.search(op) and not predicated):
            add, nexts, _ = _step(op, predicated, ins[i][0], index)
            after = set.union(*(can[j] for j in nexts)) if nexts else {(0, 0)}
            can[i] = {(a + add[0], b + add[1]) for a, b in after if a + add[0] <= want[0] and b + add[1] <= want[1]}
    if want not in can[0]:
        raise RuntimeError(f"no path through the kernel makes {want_loads} 128-bit loads and {want_stores} stores "
                           "without a scalar access")
    i, count, done = 0, 0, (0, 0)
    while True:
        op, predicated = ops[i]
        if op.startswith("NOP"):
            i += 1
            continue
        add, nexts, two_ways = _step(op, predicated, ins[i][0], index)
        if path is not None:
            path.append(i)
        count, done = count + 1, (done[0] + add[0], done[1] + add[1])
        if not nexts:
            return count, done[0], done[1]
        rest = (want[0] - done[0], want[1] - done[1])
        options = [j for j in nexts if rest in can[j]]  # never empty: rest was in can[i]
        if two_ways and len(options) == 2:  # jump past scalar accesses, else fall through
            i = options[0] if any(SCALAR_MEM.search(t) for t, _ in ops[i + 1:options[0]]) else options[1]
        else:
            i = options[0]


def budget(sass_text: str, arch: int) -> list[dict]:
    """One row per rows_kernel of `arch`: op, dtype, instructions per element and per byte, the 128-bit
    loads/stores on the path (and how many there should be), the floating-point instructions the path issues
    before its last load (0: every load is in flight before the math starts) and the H200 bound (fraction of
    copy bandwidth)."""
    rows = []
    for name, ins in functions(sass_text, arch).items():
        parsed = kernel_of(name)
        if parsed is None:
            continue
        functor, dtype, vec = parsed
        op, ni, no = FUNCTORS[functor]
        size = dict(DTYPES.values())[dtype]
        path: list[int] = []
        per_thread, loads, stores = vector_path(ins, K_UNROLL * ni, K_UNROLL * no, path)
        ops = [PREDICATE.sub("", ins[i][1]) for i in path]
        last_load = max(n for n, op in enumerate(ops) if VECTOR_MEM.match(op) and op.startswith("LDG"))
        math_first = sum(FP_MATH.match(op) is not None for op in ops[:last_load])
        per_elem = per_thread / (K_UNROLL * vec)
        per_byte = per_elem / ((ni + no) * size)
        # float64 arithmetic issues at half rate on an H200 (and its exp/erf are long): no bound from issue alone
        bound = None if dtype == "float64" else min(1.0, H200_INSTR_PER_BYTE / per_byte)
        rows.append(dict(op=op, dtype=dtype, instr_per_elem=per_elem, instr_per_byte=per_byte,
                         loads=loads, stores=stores, want_loads=K_UNROLL * ni, want_stores=K_UNROLL * no,
                         math_before_last_load=math_first, h200_bound=bound))
    order = [f[0] for f in FUNCTORS.values()]
    return sorted(rows, key=lambda r: (order.index(r["op"]), r["dtype"]))


def table(rows: list[dict], arch: int) -> str:
    lines = [f"Vector path of each rows_kernel, sm_{arch} SASS (a prediction, not a measurement; see the top of "
             "benchmarks/sass_budget.py)", "",
             "| op | dtype | instr / elem | instr / byte | H200 issue bound (x copy) | 128-bit loads / stores | "
             "math before the last load |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        b = r["h200_bound"]
        bound = "- (fp64 pipe: half rate)" if b is None else ">= 1 (memory-bound)" if b >= 1 else f"{b:.0%}"
        lines.append(f"| {r['op']} | {r['dtype']} | {r['instr_per_elem']:.1f} | {r['instr_per_byte']:.2f} | "
                     f"{bound} | {r['loads']} / {r['stores']} | {r['math_before_last_load']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", help="binary to read (default: the loaded ffn_ext native library)")
    ap.add_argument("--arch", type=int, default=90, help="SASS architecture, e.g. 80 or 90 (default 90)")
    args = ap.parse_args(argv)
    lib = args.lib
    if lib is None:
        import ffn_ext
        if ffn_ext.ops._native is None or not ffn_ext.has_cuda_kernels():
            print("sass_budget: the loaded ffn_ext has no CUDA kernels; pass --lib", file=sys.stderr)
            return 2
        lib = ffn_ext.ops._native.__file__
    tool = cuobjdump()
    if tool is None:
        print("sass_budget: cuobjdump not found (pip install triton, or set CUDA_HOME)", file=sys.stderr)
        return 2
    text = subprocess.run([tool, "--dump-sass", "-arch", f"sm_{args.arch}", lib], capture_output=True, text=True,
                          check=True).stdout
    rows = budget(text, args.arch)
    if not rows:
        print(f"sass_budget: no rows_kernel SASS for sm_{args.arch} in {lib}", file=sys.stderr)
        return 2
    print(table(rows, args.arch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
