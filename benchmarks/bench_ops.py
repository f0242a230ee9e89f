#!/usr/bin/env python
"""Per-op benchmark of ffn_ext's activation kernels against ATen eager, torch.compile and Liger-Kernel.

    python benchmarks/bench_ops.py --quick                       # CPU here, GPU where there is one
    python benchmarks/bench_ops.py --quick --device cuda --out $OUT/bench
    python benchmarks/bench_ops.py --full --device cuda          # every dtype at 2**12 .. 2**28 elements
    python benchmarks/bench_ops.py --smoke --out /tmp/x          # tiny CI check of the pipeline

Ops, from the op table (ffn_ext/table.py): per activation (gelu = exact erf, gelu_tanh, silu) its unary op, its
gated op (geglu, geglu_tanh, swiglu) and the packed form (<gated>_packed); then swiglu_packed in the interleaved
layout ([g0, u0, g1, u1, ...]: swiglu_packed_interleaved) and the clamped SwiGLU with GPT-OSS's parameters (limit 7,
alpha 1.702, up + 1) separate (swiglu_clamped), packed (swiglu_clamped_packed) and packed interleaved
(swiglu_clamped_packed_interleaved, GPT-OSS's form), on inputs scaled so that the clamps act; directions fwd, bwd,
fwd+bwd; dtypes fp32, fp16, bf16. Peers: ATen eager (the table's ATen form: F.gelu, F.gelu(approximate="tanh"),
F.silu, times up; the clamped SwiGLU as transformers' GptOssExperts._apply_gate writes it), torch.compile of it,
Liger-Kernel's gated kernels where liger_kernel is installed (LigerSiLUMulFunction for swiglu, LigerGELUMulFunction
for geglu_tanh: Liger's GeGLU is the tanh form; concat layout only), vLLM's forward-only swigluoai_and_mul
(interleaved clamped op) and TransformerEngine's ClampedSwiGLU (packed clamped ops) where installed; a note says
which peers were skipped and why. MoE cases: the packed op of a MoE model's experts on tokens x top-k rows of
[rows, 2I] (GPT-OSS-20B: I = 2880, top-4, clamped interleaved; Qwen3-30B-A3B: I = 768, top-8, swiglu_packed).
"Size" is the number of elements N of the op's output (a packed op reads a [.., 2M] input: 2N elements). Bytes
moved are counted per op (see BYTES_PER_ELEMENT and benchmarks/README.md) and compared with a device copy of N
elements measured in the same run. Writes ops.md, ops.json and plots into the output directory.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (also puts the repository root on sys.path)
import torch  # noqa: E402

import ffn_ext  # noqa: E402

# The ops (common.bench_ops): the op table's (per activation its unary op, its gated op and the packed form of the
# gated op), then the interleaved layout of swiglu_packed, then the clamped SwiGLU (GPT-OSS's parameters) separate,
# packed and packed interleaved; the backward ops run through autograd (directions bwd and fwd+bwd).
BOPS = common.bench_ops()  # op -> common.BenchOp (kind "unary" | "gated" | "packed", activation, params, layout)
KINDS = {op: (b.kind, b.act) for op, b in BOPS.items()}
OPS = tuple(BOPS)  # gelu, gelu_tanh, silu, geglu, geglu_tanh, swiglu, geglu_packed, geglu_tanh_packed, swiglu_packed,
# swiglu_packed_interleaved, swiglu_clamped, swiglu_clamped_packed, swiglu_clamped_packed_interleaved
CLAMPED = tuple(op for op, b in BOPS.items() if "limit" in b.params)
DIRECTIONS = ("fwd", "bwd", "fwd+bwd")
IMPLS = ("ffn_ext", "eager", "compile", "liger", "vllm", "te")
IMPL_LABEL = {
    "ffn_ext": "ffn_ext",
    "eager": "ATen eager",
    "compile": "torch.compile",
    "liger": "Liger",
    "vllm": "vLLM",
    "te": "TE",
}
FORWARD_ONLY = {"vllm"}  # peers without a backward: timed forward only

# Elements moved per output element N, by a kernel that reads each input once and writes each output once:
#   unary  (gelu, gelu_tanh, silu)        fwd: read x, write y = 2N;           bwd: read grad, x, write dx = 3N
#   gated  (geglu, geglu_tanh, swiglu,    fwd: read g, u, write h = 3N;        bwd: read grad, g, u, write dg, du = 5N
#           swiglu_clamped)
#   packed (<gated>_packed, either        fwd: read gate_up (2N), write h = 3N; bwd: read grad (N), gate_up (2N),
#           layout)                       write dgate_up (2N) = 5N
#   fwd+bwd: the sum.  Implementations that move more (ATen eager) are still credited with these bytes only, so
#   GB/s is "effective" bandwidth and comparable across implementations.
_BYTES = {"unary": {"fwd": 2, "bwd": 3}, "gated": {"fwd": 3, "bwd": 5}, "packed": {"fwd": 3, "bwd": 5}}
BYTES_PER_ELEMENT = {op: dict(_BYTES[kind]) for op, (kind, _) in KINDS.items()}
for _v in BYTES_PER_ELEMENT.values():
    _v["fwd+bwd"] = _v["fwd"] + _v["bwd"]

DECODE = ("16x4864", (16, 4864))
# MoE experts: the activation of the routed experts runs on tokens x top-k rows of the [rows, 2I] gate_up
# projection (transformers 5.x *Experts, grouped_mm). (model, top-k, I, op): GPT-OSS-20B (top-4 of 32 experts,
# I = 2880, the clamped SwiGLU, interleaved) and Qwen3-30B-A3B (top-8 of 128, I = 768, SwiGLU, concat).
MOE = (("GPT-OSS-20B", 4, 2880, "swiglu_clamped_packed_interleaved"), ("Qwen3-30B-A3B", 8, 768, "swiglu_packed"))


def moe_sizes(tokens: int) -> list:
    """[(size name, (rows, I), op, model)] of the MoE cases at `tokens` routed tokens."""
    return [(f"MoE {tokens}x{k}x{i}", (tokens * k, i), op, model) for model, k, i, op in MOE]


def pow2_size(k: int):
    n = 1 << k
    cols = 4096 if n >= 4096 else n
    return (f"2^{k}", (n // cols, cols))


def sizes_for(mode: str, dev: torch.device) -> tuple:
    """{dtype: [(name, (rows, cols))]}, the (dtype, size-name) pairs that also run torch.compile (None: all), and
    the MoE cases (dtype, tokens): each MoE op at its model's shape (moe_sizes)."""
    if mode == "smoke":
        sz = [("4x256", (4, 256)), ("64x512", (64, 512))]
        return {"fp32": sz}, None, ("fp32", 2)
    if dev.type == "cuda":
        if mode == "full":
            allsz = [DECODE] + [pow2_size(k) for k in range(12, 29, 2)]
            return {d: allsz for d in ("fp32", "fp16", "bf16")}, None, ("bf16", 4096)
        return (
            {
                "bf16": [DECODE, pow2_size(20), pow2_size(24), pow2_size(28)],
                "fp16": [DECODE, pow2_size(24)],
                "fp32": [DECODE, pow2_size(24)],
            },
            None,
            ("bf16", 4096),
        )
    # CPU: wall-clock, small sizes; torch.compile (C++ codegen, slow to compile on few cores) at a few sizes only
    if mode == "full":
        allsz = [DECODE] + [pow2_size(k) for k in (12, 16, 20, 22)]
        return {d: allsz for d in ("fp32", "bf16", "fp16")}, None, ("fp32", 64)
    return (
        {"fp32": [DECODE, pow2_size(16), pow2_size(20)], "bf16": [DECODE, pow2_size(20)]},
        {("fp32", "2^16")},
        ("fp32", 64),
    )


# ---------------------------------------------------------------- implementations
EAGER = {op: common.eager_fn(op) for op in OPS}  # act(x), act(g) * u, split then act(g) * u, GPT-OSS's _apply_gate
FFN = {op: common.ffn_ext_fn(op) for op in OPS}  # the public API: ffn_ext.gelu(x, approximate="tanh"), ...


def build_impls(dev: torch.device, use_compile: bool, notes: list) -> dict:
    impls = {"ffn_ext": dict(FFN), "eager": dict(EAGER)}
    if use_compile:
        common.setup_compile()
        impls["compile"] = {op: torch.compile(fn) for op, fn in EAGER.items()}
    liger = {}
    for act_name, (fn, why) in common.liger_gated().items():  # Liger's gated kernels, by activation
        if fn is None:
            notes.append(f"Liger skipped for {act_name}: {why}")
            continue
        for op, b in BOPS.items():  # plain gated ops; packed on chunk halves (Liger has no interleaved layout)
            if b.act.name == act_name and b.kind != "unary" and not b.params and b.layout == "concat":
                liger[op] = fn if b.kind == "gated" else common.chunked(fn)
    if liger and dev.type != "cuda":
        notes.append("Liger skipped: its kernels are Triton (CUDA only)")
    elif liger:
        impls["liger"] = liger
    # clamped SwiGLU peers: vLLM's forward-only swigluoai_and_mul (interleaved, up + 1 built in) and
    # TransformerEngine's ClampedSwiGLU (forward and backward; concat, interleaved through its de-interleaving copy)
    vllm, why = common.vllm_swigluoai()
    if vllm is None:
        notes.append(f"vLLM swigluoai_and_mul (forward only) skipped: {why}")
    elif dev.type != "cuda":
        notes.append("vLLM swigluoai_and_mul skipped: CUDA only")
    else:
        impls["vllm"] = {
            op: (lambda gu, p=BOPS[op].params: vllm(gu, p["limit"], p["alpha"]))
            for op in CLAMPED
            if BOPS[op].kind == "packed" and BOPS[op].layout == "interleaved" and BOPS[op].params["up_offset"] == 1.0
        }
    make_te, why = common.te_clamped_swiglu()
    if make_te is None:
        notes.append(f"TransformerEngine ClampedSwiGLU skipped: {why}")
    elif dev.type != "cuda":
        notes.append("TransformerEngine ClampedSwiGLU skipped: CUDA only")
    else:
        te = {}
        for op in CLAMPED:
            b = BOPS[op]
            if b.kind != "packed":
                continue
            try:
                te[op] = make_te(b.params["limit"], b.params["alpha"], b.params["up_offset"], b.layout)
            except Exception as e:  # noqa: BLE001  (e.g. a TE without glu_interleave_size)
                notes.append(f"TransformerEngine ClampedSwiGLU skipped for {op}: {type(e).__name__}: {e}")
        if te:
            impls["te"] = te
            if any(BOPS[op].layout == "interleaved" for op in te):
                notes.append(
                    "TE on the interleaved layout: ClampedSwiGLU(glu_interleave_size=1), which "
                    "de-interleaves with a copy forward and backward"
                )
    return impls


def make_inputs(op: str, shape, dtype, dev, requires_grad: bool, gen: torch.Generator):
    rows, cols = shape
    b = BOPS[op]
    in_shape = (rows, 2 * cols) if b.kind == "packed" else (rows, cols)
    n_in = 2 if b.kind == "gated" else 1

    def rnd(s):
        t = torch.randn(s, generator=gen, device=dev, dtype=torch.float32)
        if b.scale != 1.0:
            t *= b.scale  # the clamped ops: values beyond the limit
        return t.to(dtype).requires_grad_(requires_grad)

    return tuple(rnd(in_shape) for _ in range(n_in))


def clamp_activity(dev: torch.device) -> str:
    """What share of the clamped ops' inputs the clamps act on (2**20 fp32 samples of make_inputs' distribution)."""
    b = BOPS[CLAMPED[0]]
    x = torch.randn(1 << 20, generator=torch.Generator(device=dev).manual_seed(1), device=dev) * b.scale
    lim = b.params["limit"]
    return (
        f"clamped ops ({', '.join(CLAMPED)}; {', '.join(f'{k}={v}' for k, v in b.params.items())}): "
        f"inputs randn x {b.scale:g}, so {100 * (x > lim).float().mean().item():.1f}% of gate is above the "
        f"limit and {100 * (x.abs() > lim).float().mean().item():.1f}% of up outside [-limit, limit]"
    )


def input_bytes(op: str, numel: int, es: int, direction: str) -> int:
    """Bytes of one input set: the op's inputs (+ the incoming gradient unless fwd)."""
    n_in = numel if KINDS[op][0] == "unary" else 2 * numel
    return (n_in + (numel if direction != "fwd" else 0)) * es


def runner(fn, direction: str):
    if direction == "fwd":

        def run(*ins):
            with torch.no_grad():
                return fn(*ins)

        return run
    if direction == "fwd+bwd":

        def run(*args):
            *ins, grad = args
            return torch.autograd.grad(fn(*ins), ins, grad)

        return run

    def run(y, ins, grad):  # bwd: the graph was recorded once per input set
        return torch.autograd.grad(y, ins, grad, retain_graph=True)

    return run


# ---------------------------------------------------------------- measuring
def agreement(impls: dict, ops, dev: torch.device, gen: torch.Generator) -> list[str]:
    """Every implementation's forward and gradients against ATen eager's on one small fp32 input set (a peer wired
    to the wrong function must not be timed as if it were this op); one line per disagreement. Forward-only peers
    (vLLM) are checked on the forward. torch.compile is left out (it is eager's code, compiled: checking it would
    compile every op once more). The clamped ops' inputs reach beyond the limit (make_inputs)."""
    errors = []
    for op in ops:
        ins = make_inputs(op, (3, 40), torch.float32, dev, True, gen)
        y0 = EAGER[op](*ins)
        grad = torch.randn(y0.shape, generator=gen, device=dev)
        ref = (y0, *torch.autograd.grad(y0, ins, grad))
        for impl, table in impls.items():
            if impl in ("eager", "compile") or op not in table:
                continue
            try:
                if impl in FORWARD_ONLY:
                    with torch.no_grad():
                        got = (table[op](*ins),)
                else:
                    y = table[op](*ins)
                    got = (y, *torch.autograd.grad(y, ins, grad))
                err = max(((g - r).abs().max() / r.abs().max().clamp_min(1e-30)).item() for g, r in zip(got, ref))
            except Exception as e:  # noqa: BLE001
                errors.append(f"{impl} {op}: fails on a small fp32 input: {type(e).__name__}: {str(e)[:300]}")
                continue
            if not err <= 1e-4:
                errors.append(
                    f"{impl} {op}: differs from ATen eager (max error / max |ref| {err:.3g} over the "
                    + ("output" if impl in FORWARD_ONLY else "output and the input gradients")
                    + ", fp32 3x40)"
                )
    return errors


def bench_case(op, direction, impl, fn, shape, dtype, dev, n_sets, gen, target_ms):
    """Times one (op, direction, impl) at one shape; for fwd+bwd also the memory probes."""
    rows, cols = shape
    grad_needed = direction != "fwd"
    sets = []
    for _ in range(n_sets):
        ins = make_inputs(op, shape, dtype, dev, grad_needed, gen)
        if direction == "fwd":
            sets.append(ins)
            continue
        grad = torch.randn((rows, cols), generator=gen, device=dev, dtype=torch.float32).to(dtype)
        if direction == "fwd+bwd":
            sets.append((*ins, grad))
        else:
            sets.append((fn(*ins), ins, grad))
    res = common.time_fn(runner(fn, direction), sets, dev, target_ms=target_ms)
    if direction == "fwd+bwd":
        ins = sets[0][:-1]
        grad = sets[0][-1]
        with common.SavedTensors(exclude=ins) as saved:
            y = fn(*ins)
        res["saved_bytes"] = saved.total_bytes
        res["saved_extra_bytes"] = saved.extra_bytes
        del y
        res["peak_extra_bytes"] = common.peak_extra_bytes(lambda: torch.autograd.grad(fn(*ins), ins, grad), dev)
    del sets
    return res


def bench_copy(numel, dtype, dev, gen, target_ms):
    es = torch.empty((), dtype=dtype).element_size()
    k = common.num_sets(2 * numel * es, dev)
    sets = [
        (
            torch.empty(numel, device=dev, dtype=dtype),
            torch.randn(numel, generator=gen, device=dev, dtype=torch.float32).to(dtype),
        )
        for _ in range(k)
    ]
    res = common.time_fn(lambda dst, src: dst.copy_(src), sets, dev, target_ms=target_ms)
    res["gbps"] = 2 * numel * es / (res["median_ms"] * 1e-3) / 1e9
    return res


def run(args) -> dict:
    dev = common.resolve_device(args.device)
    mode = common.mode_of(args)
    use_compile = not args.no_compile and mode != "smoke"
    notes: list[str] = []
    if dev.type == "cpu":
        notes.append(
            "CPU run: wall-clock medians; ffn_ext's CPU ops are ATen composites, so CPU numbers say "
            "nothing about the CUDA kernels"
        )
    if dev.type == "cuda" and not ffn_ext.has_cuda_kernels():
        notes.append("WARNING: the loaded ffn_ext has no CUDA kernels; 'ffn_ext' rows are the ATen fallback")
    if mode == "smoke":
        notes.append("smoke run: tiny sizes, numbers are meaningless")
        if dev.type == "cpu":  # ATen's CPU kernels go parallel from 32768 elements; on a busy machine the OpenMP
            torch.set_num_threads(1)  # threads' waits cost milliseconds per call, and a smoke run only checks plumbing
            notes.append("smoke run on CPU: 1 torch thread")
    if not use_compile:
        notes.append("torch.compile skipped (" + ("--smoke" if mode == "smoke" else "--no-compile") + ")")
    plan, compile_only, (moe_dtype, moe_tokens) = sizes_for(mode, dev)
    if args.dtypes:
        keep = [d.strip() for d in args.dtypes.split(",") if d.strip()]
        bad = [d for d in keep if d not in common.DTYPES]
        if bad:
            raise SystemExit(f"--dtypes: unknown {bad}; choose from {list(common.DTYPES)}")
        plan = {d: plan.get(d) or next(iter(plan.values())) for d in keep}
    if moe_dtype not in plan:
        moe_dtype = next(iter(plan))
    if args.ops:
        ops = [o.strip() for o in args.ops.split(",") if o.strip()]
        bad = [o for o in ops if o not in OPS]
        if bad:
            raise SystemExit(f"--ops: unknown {bad}; choose from {list(OPS)}")
    else:
        ops = list(OPS)
    if use_compile and compile_only is not None:
        notes.append(
            "torch.compile measured only at "
            + ", ".join(f"{d} {s}" for d, s in sorted(compile_only))
            + " (compiling on CPU is slow)"
        )
    target_ms = args.target_ms or {"smoke": 5.0, "quick": 40.0 if dev.type == "cuda" else 20.0, "full": 150.0}[mode]
    impls = build_impls(dev, use_compile, notes)
    torch.manual_seed(args.seed)
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    errors = agreement(impls, ops, dev, gen)
    if any(op in CLAMPED for op in ops):
        notes.append(clamp_activity(dev))
    moe = {sname: model for sname, _, op, model in moe_sizes(moe_tokens) if op in ops}
    if moe:
        notes.append(
            f"MoE cases ({moe_dtype}, size 'MoE TxKxI'): the routed experts' activation on T tokens x "
            "top-K rows of [rows, 2I] -> [rows, I]: "
            + "; ".join(f"{model} ({op}): {moe_tokens} x top-{k}, I = {i}" for model, k, i, op in MOE if op in ops)
        )

    def add_cases(dname, sname, shape, case_ops):
        for op in case_ops:
            for direction in DIRECTIONS:
                for impl, table in impls.items():
                    if op not in table or (impl in FORWARD_ONLY and direction != "fwd"):
                        continue
                    if impl == "compile" and compile_only is not None and (dname, sname) not in compile_only:
                        continue
                    cases.append((dname, sname, shape, op, direction, impl))

    cases = []
    for dname, sizes in plan.items():
        for sname, shape in sizes:
            add_cases(dname, sname, shape, ops)
    for sname, shape, op, _ in moe_sizes(moe_tokens):
        if op in ops:
            add_cases(moe_dtype, sname, shape, [op])
    results, copies = [], []
    bar = common.progress(len(cases), f"bench_ops [{dev.type}, {mode}]", disable=args.no_progress)
    t_start = time.time()
    last_size = None
    for dname, sname, shape, op, direction, impl in cases:
        dtype = common.DTYPES[dname]
        es = torch.empty((), dtype=dtype).element_size()
        numel = shape[0] * shape[1]
        if (dname, sname) != last_size:
            common.free_memory(dev)
            last_size = (dname, sname)
            c = bench_copy(numel, dtype, dev, gen, target_ms)
            copies.append({"dtype": dname, "size": sname, "shape": list(shape), "numel": numel, **c})
            copy_gbps = c["gbps"]
        bar.set_postfix_str(f"{dname} {sname} {op} {direction} {impl}")
        max_sets = 2 if mode == "smoke" else 32 if dev.type == "cuda" else 8
        n_sets = common.num_sets(input_bytes(op, numel, es, direction), dev, max_sets=max_sets)
        try:
            r = bench_case(op, direction, impl, impls[impl][op], shape, dtype, dev, n_sets, gen, target_ms)
        except Exception as e:  # noqa: BLE001  (one failing peer must not end the run)
            errors.append(f"{impl} {op} {direction} {dname} {sname}: {type(e).__name__}: {str(e)[:300]}")
            bar.update()
            continue
        bytes_moved = BYTES_PER_ELEMENT[op][direction] * numel * es
        gbps = bytes_moved / (r["median_ms"] * 1e-3) / 1e9
        results.append(
            {
                "op": op,
                "direction": direction,
                "dtype": dname,
                "size": sname,
                "shape": list(shape),
                "numel": numel,
                "impl": impl,
                "bytes_moved": bytes_moved,
                "gbps": gbps,
                "copy_gbps": copy_gbps,
                "frac_copy": gbps / copy_gbps,
                **r,
                **({"moe": moe[sname]} if sname in moe else {}),
            }
        )
        bar.update()
    bar.close()
    add_ratios(results)
    meta = common.metadata(dev, mode, sys.argv)
    meta["elapsed_s"] = round(time.time() - t_start, 1)
    meta["ffn_ext_kind"] = "CUDA kernels" if dev.type == "cuda" and ffn_ext.has_cuda_kernels() else "ATen composite"
    payload = {
        "meta": meta,
        "notes": notes,
        "errors": errors,
        "bytes_per_element": BYTES_PER_ELEMENT,
        "results": results,
        "copy": copies,
    }
    payload["targets"] = targets(results, dev)
    return payload


def add_ratios(results: list) -> None:
    """speedup_vs[peer] = t_peer / t_this (> 1: this implementation is faster than the peer)."""
    index = {(r["op"], r["direction"], r["dtype"], r["size"], r["impl"]): r["median_ms"] for r in results}
    for r in results:
        r["speedup_vs"] = {}
        for peer in IMPLS:
            t = index.get((r["op"], r["direction"], r["dtype"], r["size"], peer))
            if peer != r["impl"] and t is not None:
                r["speedup_vs"][peer] = t / r["median_ms"]


# ---------------------------------------------------------------- targets
def _pick(results, op, direction, impl, size=None, peer=None):
    """The bf16 row at 2**28 (the targets' condition), else the closest available: bf16 first, largest size
    (among the rows that have a time of `peer`, if given; MoE-shaped rows are not candidates)."""
    rows = [
        r
        for r in results
        if r["op"] == op
        and r["direction"] == direction
        and r["impl"] == impl
        and (size is None or r["size"] == size)
        and (peer is None or peer in r["speedup_vs"])
        and not r.get("moe")
    ]
    if not rows:
        return None
    rows.sort(key=lambda r: (r["dtype"] == "bf16", r["numel"]))
    return rows[-1]


def targets(results: list, dev: torch.device) -> list:
    out = []

    def where(r):
        return f"{r['dtype']} {r['size']} on {dev.type.upper()}"

    def cond(r, size="2^28"):
        return dev.type == "cuda" and r["dtype"] == "bf16" and r["size"] == size

    measured = [op for op in OPS if any(r["op"] == op for r in results)] or list(OPS)
    for op in measured:
        for direction in ("fwd", "bwd"):
            r = _pick(results, op, direction, "ffn_ext")
            out.append(
                common.make_target(
                    f"{op} {direction}: ffn_ext >= 92% of copy bandwidth (H200 bf16 2^28)",
                    r and r["frac_copy"] * 100,
                    92.0,
                    True,
                    "%",
                    r and where(r),
                    bool(r) and cond(r),
                )
            )
    speedups = [("swiglu", peer, thr) for peer, thr in (("eager", 1.7), ("compile", 1.0), ("liger", 1.1))]
    # the clamped SwiGLU: ATen eager runs GPT-OSS's expression, about seven passes forward
    speedups += [
        (op, peer, thr)
        for op in CLAMPED
        if any(r["op"] == op for r in results)
        for peer, thr in (("eager", 3.0), ("compile", 1.0))
    ]
    for op, peer, thr in speedups:
        r = _pick(results, op, "fwd+bwd", "ffn_ext", peer=peer)
        v = r and r["speedup_vs"].get(peer)
        out.append(
            common.make_target(
                f"{op} fwd+bwd: ffn_ext >= {thr}x {IMPL_LABEL[peer]} (H200 bf16 2^28)",
                v,
                thr,
                True,
                "x",
                (r and where(r)) if v is not None else f"{IMPL_LABEL[peer]} not measured",
                bool(r) and cond(r),
            )
        )
    for op in measured:
        r = _pick(results, op, "fwd", "ffn_ext", size=DECODE[0])
        v = r and r["speedup_vs"].get("eager")
        out.append(
            common.make_target(
                f"{op} fwd decode 16x4864: ffn_ext latency <= 0.8x ATen eager (H200 bf16)",
                (1.0 / v) if v else None,
                0.8,
                False,
                "x",
                r and where(r),
                bool(r) and dev.type == "cuda" and r["dtype"] == "bf16",
            )
        )
    return out


# ---------------------------------------------------------------- report
def markdown(payload: dict) -> str:
    meta = payload["meta"]
    lines = [
        f"# ffn_ext op benchmark — {meta['device_name']} ({meta['device_type'].upper()})",
        "",
        f"date {meta['date']}, mode {meta['mode']}, torch {meta['torch_version']}, CUDA {meta['cuda_version']},"
        f" commit {meta['git_commit']}, ffn_ext: {meta['ffn_ext_kind']}; timing: {meta['timing']}",
        "",
    ]
    lines += [f"- {n}" for n in payload["notes"]] + [""]
    # the peers' speedup columns: eager, compile and Liger always, vLLM and TE where measured
    peers = [
        p for p in IMPLS[1:] if p in ("eager", "compile", "liger") or any(r["impl"] == p for r in payload["results"])
    ]
    headers = (
        ["op", "dir", "dtype", "size", "impl", "time µs", "GB/s", "% copy"]
        + [f"× {IMPL_LABEL[p].replace('ATen ', '').replace('torch.', '')}" for p in peers]
        + ["peak MiB", "saved MiB (extra)"]
    )
    rows = []
    for r in payload["results"]:
        sv = r["speedup_vs"]
        saved = (
            f"{r['saved_bytes'] / common.MiB:.3g} ({r['saved_extra_bytes'] / common.MiB:.3g})"
            if "saved_bytes" in r
            else ""
        )
        peak = (
            common.fmt(r["peak_extra_bytes"] / common.MiB)
            if r.get("peak_extra_bytes") is not None
            else ("n/a (CPU)" if "saved_bytes" in r else "")
        )
        rows.append(
            [
                r["op"],
                r["direction"],
                r["dtype"],
                r["size"],
                IMPL_LABEL[r["impl"]],
                common.fmt(r["median_ms"] * 1e3, ".4g"),
                common.fmt(r["gbps"], ".4g"),
                common.fmt(100 * r["frac_copy"], ".3g"),
            ]
            + [common.fmt(sv.get(p), ".3g") for p in peers]
            + [peak, saved]
        )
    lines += [common.markdown_table(headers, rows), ""]
    lines += ["Copy baseline (`dst.copy_(src)`, 2 x N x element size bytes):", ""]
    lines += [
        common.markdown_table(
            ["dtype", "size", "time µs", "GB/s"],
            [
                [c["dtype"], c["size"], common.fmt(c["median_ms"] * 1e3, ".4g"), common.fmt(c["gbps"], ".4g")]
                for c in payload["copy"]
            ],
        ),
        "",
    ]
    if payload["errors"]:
        lines += ["Errors:", ""] + [f"- {e}" for e in payload["errors"]] + [""]
    lines += ["```", common.targets_block(payload["targets"]), "```"]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(p)
    p.add_argument("--ops", default=None, help="comma-separated subset of " + ",".join(OPS))
    args = p.parse_args(argv)
    payload = run(args)
    import plot

    return common.report(args, "ops", payload, markdown(payload), plot.plot_ops)


if __name__ == "__main__":
    sys.exit(main())
