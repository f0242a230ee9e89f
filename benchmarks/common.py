"""Shared pieces of the ffn_ext benchmarks: timing, byte counting, memory probes, metadata, output files.

Nothing here needs a GPU; on CPU every time is a wall-clock median and is labelled CPU. matplotlib and tqdm are
optional (plots are skipped with a note, the progress bar falls back to a plain stderr counter).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.utils._python_dispatch
import torch.utils._pytree

BENCH_DIR = Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent
if str(REPO_DIR) not in sys.path:  # run as `python benchmarks/x.py` from anywhere; last, so that an installed (or
    sys.path.append(str(REPO_DIR))  # PYTHONPATH's) ffn_ext, the one under test, wins over the checkout's

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
MiB = float(1 << 20)


# ---------------------------------------------------------------- progress
class _Counter:
    """A minimal progress counter on stderr for when tqdm is not installed."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.n, self._t0, self._last = total, desc, 0, time.time(), 0.0

    def update(self, k: int = 1) -> None:
        self.n += k
        now = time.time()
        if now - self._last > 1.0 or self.n >= self.total:
            self._last = now
            print(f"\r{self.desc}: {self.n}/{self.total} ({now - self._t0:.0f}s)", end="", file=sys.stderr, flush=True)

    def set_postfix_str(self, s: str) -> None:  # tqdm-compatible no-op
        pass

    def close(self) -> None:
        print(file=sys.stderr, flush=True)


def progress(total: int, desc: str, disable: bool = False):
    """tqdm on stderr when importable, else a plain counter. `disable` gives a silent counter."""
    if disable:
        c = _Counter(total, desc)
        c.update = lambda k=1: None  # type: ignore[method-assign]
        c.close = lambda: None  # type: ignore[method-assign]
        return c
    try:
        from tqdm import tqdm
    except ImportError:
        return _Counter(total, desc)
    return tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=True)


# ---------------------------------------------------------------- device / metadata
def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU is visible to torch")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"CPU ({cpu_name()}, {os.cpu_count()} logical cores)"


def device_slug(dev: torch.device) -> str:
    if dev.type == "cuda":
        raw = torch.cuda.get_device_name(dev)
    else:
        raw = f"cpu-{os.cpu_count()}core"
    slug = re.sub(r"[^a-z0-9]+", "-", raw.lower()).strip("-")
    return slug[:40] or "device"


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_DIR, capture_output=True, text=True, timeout=10)
        commit = out.stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_DIR,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return (commit + ("+dirty" if dirty else "")) if commit else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def metadata(dev: torch.device, mode: str, argv: list[str]) -> dict:
    import ffn_ext

    meta = {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device_type": dev.type,
        "device_name": device_name(dev),
        "timing": "CUDA events, median" if dev.type == "cuda" else "CPU wall-clock (time.perf_counter), median",
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "git_commit": git_commit(),
        "ffn_ext_build_info": ffn_ext.build_info(),
        "mode": mode,
        "argv": argv,
        "cpu_threads": torch.get_num_threads(),
        "load_average_1_5_15": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        meta.update(
            gpu_sms=p.multi_processor_count,
            gpu_memory_bytes=p.total_memory,
            gpu_l2_bytes=getattr(p, "L2_cache_size", None),
            cudnn=torch.backends.cudnn.version(),
        )
    return meta


def default_out_dir(dev: torch.device) -> Path:
    return BENCH_DIR / "results" / f"{_dt.date.today().isoformat()}_{device_slug(dev)}"


def l2_bytes(dev: torch.device) -> int:
    if dev.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0) or 60 * (1 << 20))
    return 32 * (1 << 20)  # a guess at a CPU's last-level cache


def num_sets(set_bytes: int, dev: torch.device, max_sets: int = 32, budget_bytes: int | None = None) -> int:
    """How many independent input sets to rotate among so that the working set is at least twice the L2
    (large sizes are then never served from cache), capped by `max_sets` and a memory budget."""
    if budget_bytes is None:
        budget_bytes = (8 << 30) if dev.type == "cuda" else (1 << 30)
    want = math.ceil(2 * l2_bytes(dev) / max(set_bytes, 1))
    cap = max(1, budget_bytes // max(set_bytes, 1))
    return int(max(2, min(want, max_sets, cap))) if set_bytes * 2 <= budget_bytes else 1


def synchronize(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# ---------------------------------------------------------------- timing
def time_fn(
    fn,
    arg_sets: list,
    dev: torch.device,
    target_ms: float = 100.0,
    min_reps: int = 5,
    max_reps: int = 2000,
    warmup: int = 3,
) -> dict:
    """Median time of fn(*arg_sets[i % len(arg_sets)]) in milliseconds.

    CUDA: one pair of CUDA events around every call (so launch overhead of multi-kernel implementations counts,
    as it does for a decode step), after warm-up; CPU: time.perf_counter around every call. The number of
    repetitions is chosen from the warm-up so the measurement takes about `target_ms`.
    """
    k = len(arg_sets)
    # warm-up: every set at least once, and at least `warmup` calls
    t0 = time.perf_counter()
    for i in range(max(warmup, k)):
        fn(*arg_sets[i % k])
    synchronize(dev)
    est_ms = (time.perf_counter() - t0) * 1e3 / max(warmup, k)
    reps = int(min(max_reps, max(min_reps, target_ms / max(est_ms, 1e-4))))
    times = []
    if dev.type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            args = arg_sets[i % k]
            starts[i].record()
            fn(*args)
            ends[i].record()
        torch.cuda.synchronize(dev)
        times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    else:
        for i in range(reps):
            args = arg_sets[i % k]
            t = time.perf_counter()
            fn(*args)
            times.append((time.perf_counter() - t) * 1e3)
    times.sort()
    q = statistics.quantiles(times, n=10) if len(times) >= 2 else [times[0]] * 9
    return {"median_ms": statistics.median(times), "p10_ms": q[0], "p90_ms": q[-1], "reps": reps, "sets": k}


# ---------------------------------------------------------------- memory probes
class SavedTensors:
    """Context manager: records the unique storages saved for backward (saved_tensors_hooks) while active.

    total_bytes: sum of untyped_storage().nbytes() over unique storages; extra_bytes: the same without the
    storages of `exclude` tensors (inputs, parameters), i.e. the memory autograd keeps alive beyond what the
    caller already holds.
    """

    def __init__(self, exclude=()):
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.storages: dict[int, int] = {}
        self._ctx = None

    def _pack(self, t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            s = t.untyped_storage()
            self.storages[s.data_ptr()] = s.nbytes()
        return t

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        return False

    @property
    def total_bytes(self) -> int:
        return sum(self.storages.values())

    @property
    def extra_bytes(self) -> int:
        return sum(n for p, n in self.storages.items() if p not in self._exclude)


class _LiveStorages(torch.utils._python_dispatch.TorchDispatchMode):
    """CPU: bytes of the storages that ops create inside the mode and that are still alive, and their peak (CPU
    memory has no allocator statistics; every tensor a forward or backward makes is some op's output)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.ptrs = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import weakref

        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                st = t.untyped_storage()
                if st.data_ptr() not in self.ptrs:
                    self.ptrs.add(st.data_ptr())
                    self.live += st.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(st, self._freed, st.data_ptr(), st.nbytes())
        return out

    def _freed(self, ptr, nbytes):
        self.live -= nbytes
        self.ptrs.discard(ptr)


def peak_extra_bytes(fn, dev: torch.device, existing=(), cpu: bool = False) -> int | None:
    """Peak memory allocated during fn() above what was allocated before it: CUDA's allocator statistics; on CPU
    (cpu=True) the peak of the storages ops create inside fn (views of `existing` tensors are not new memory), else
    None. Not for torch.compile'd callables on CPU (a dispatch mode changes what they run)."""
    if dev.type != "cuda":
        if not cpu:
            return None
        live = _LiveStorages()
        live.ptrs.update(t.untyped_storage().data_ptr() for t in existing)
        with live:
            fn()
        return live.peak
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    fn()
    torch.cuda.synchronize(dev)
    return int(torch.cuda.max_memory_allocated(dev) - base)


def free_memory(dev: torch.device) -> None:
    import gc

    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- the ops, from the op table
def table_ops() -> dict:
    """{op: (kind, Activation)} for the forward ops of ffn_ext's op table (ffn_ext/table.py) that a model calls:
    per activation its unary op ("unary"), then per activation its gated op ("gated"), then the packed forms
    ("packed"): gelu, gelu_tanh, silu, geglu, geglu_tanh, swiglu, geglu_packed, geglu_tanh_packed, swiglu_packed.
    (The backward ops are reached through autograd.)"""
    from ffn_ext.table import ACTIVATIONS

    out = {a.name: ("unary", a) for a in ACTIVATIONS}
    out.update({a.gated: ("gated", a) for a in ACTIVATIONS})
    out.update({a.gated + "_packed": ("packed", a) for a in ACTIVATIONS})
    return out


# GPT-OSS's routed experts (transformers' GptOssExperts._apply_gate): alpha 1.702, limit 7, (up + 1). The benchmarks
# run a gated op that has parameters with the values here (else with the table's example values).
GPT_OSS = {"limit": 7.0, "alpha": 1.702, "up_offset": 1.0}
BENCH_PARAMS = {"swiglu_clamped": GPT_OSS}
# Inputs of the clamped ops are randn * CLAMP_SCALE, so that the clamps are active (at limit 7: about 4% of gate
# above the limit, 8% of up outside [-7, 7]). It does not change the speed of a branch-free kernel; it keeps the
# comparison honest (no implementation may skip the clamp's cases).
CLAMP_SCALE = 4.0
# The plain gated ops that also run in the interleaved layout ([g0, u0, g1, u1, ...]); every gated op with
# parameters (swiglu_clamped) runs in both layouts.
INTERLEAVED_PLAIN = ("swiglu",)


class BenchOp:
    """One op the benchmarks time: a forward op of the table, in a layout, with parameters.

    name: the row's op (the table's op name; "_interleaved" appended for the interleaved layout of a packed op);
    kind: "unary" | "gated" | "packed" (inputs and bytes moved); act: the Activation; gated: the table's Gated (None
    for unary); params: the gated op's keyword parameters; layout: "concat" | "interleaved" (packed); scale: inputs
    are randn * scale."""

    def __init__(self, name, kind, act, gated=None, params=None, layout="concat", scale=1.0):
        self.name, self.kind, self.act, self.gated = name, kind, act, gated
        self.params, self.layout, self.scale = dict(params or {}), layout, scale

    def __repr__(self) -> str:
        return f"BenchOp({self.name!r})"


def bench_ops() -> dict:
    """{name: BenchOp}: first the op table's 9 (table_ops(), in its order), then the interleaved layout of
    swiglu_packed (swiglu_packed_interleaved), then each gated op with parameters (swiglu_clamped, with GPT-OSS's
    parameters) separate, packed (concat) and packed interleaved: swiglu_clamped, swiglu_clamped_packed,
    swiglu_clamped_packed_interleaved."""
    from ffn_ext.table import GATED, GATED_BY_NAME

    out = {}
    for op, (kind, act) in table_ops().items():
        out[op] = BenchOp(op, kind, act, None if kind == "unary" else GATED_BY_NAME[act.gated])
    for name in INTERLEAVED_PLAIN:
        g = GATED_BY_NAME[name]
        out[name + "_packed_interleaved"] = BenchOp(
            name + "_packed_interleaved", "packed", g.act, g, layout="interleaved"
        )
    for g in GATED:
        if not g.params:
            continue
        params = BENCH_PARAMS.get(g.name, g.example)
        scale = CLAMP_SCALE if "limit" in params else 1.0
        out[g.name] = BenchOp(g.name, "gated", g.act, g, params, scale=scale)
        for layout, suffix in (("concat", ""), ("interleaved", "_interleaved")):
            out[g.name + "_packed" + suffix] = BenchOp(
                g.name + "_packed" + suffix, "packed", g.act, g, params, layout=layout, scale=scale
            )
    return out


def split(gate_up, layout: str):
    """gate, up of a packed [..., 2M] tensor as a model writes it: gate_up.chunk(2, -1) (concat), or
    gate_up[..., ::2], gate_up[..., 1::2] (interleaved: GPT-OSS)."""
    return gate_up.chunk(2, dim=-1) if layout == "concat" else (gate_up[..., ::2], gate_up[..., 1::2])


def chunked(fn):
    """fn(g, u) as a function of gate_up: g, u = gate_up.chunk(2, -1)."""

    def packed(gu):
        g, u = gu.chunk(2, dim=-1)
        return fn(g, u)

    return packed


def gpt_oss_apply_gate(gate, up, limit, alpha, up_offset):
    """transformers' GptOssExperts._apply_gate after its split, line by line (up_offset is its `+ 1`): 7 ATen
    kernels forward (clamp, clamp, mul, sigmoid, mul, add, mul), autograd's backward."""
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return (up + up_offset) * glu


def eager_fn(op: str):
    """op with ATen ops, as a model writes it: act(x); act(g) * u; the clamped SwiGLU as transformers' GPT-OSS
    experts write it (gpt_oss_apply_gate); packed ops split as in split(). act is the table entry's eager form
    (F.gelu, F.gelu(x, approximate="tanh"), F.silu, torch.square(F.relu(x)), ...)."""
    b = bench_ops()[op]
    f = b.act.eager
    if b.kind == "unary":
        return f
    if b.gated.name == "swiglu_clamped":
        p = b.params

        def gated(g, u):
            return gpt_oss_apply_gate(g, u, p["limit"], p["alpha"], p["up_offset"])
    elif b.params:

        def gated(g, u):
            return b.gated.forward(g, u, **b.params)
    else:

        def gated(g, u):
            return f(g) * u

    if b.kind == "gated":
        return gated
    if b.layout == "concat" and not b.params:
        return chunked(gated)

    def packed(gu):
        return gated(*split(gu, b.layout))

    return packed


def ffn_ext_fn(op: str):
    """The public API's function for op: ffn_ext.<op> where the API has one that computes op with its defaults
    (gelu, silu, swiglu, swiglu_packed, geglu, geglu_packed), else the API's keyword form: ffn_ext.gelu(x,
    approximate="tanh"), ffn_ext.gated(g, u, activation="gelu_tanh"), ffn_ext.gated_packed(gu, activation=...),
    ffn_ext.swiglu_packed(gu, layout="interleaved"), ffn_ext.swiglu_clamped(g, u, limit=7.0, alpha=1.702,
    up_offset=1.0), ffn_ext.swiglu_clamped_packed(gu, limit=..., layout=...)."""
    import functools

    import ffn_ext

    b = bench_ops()[op]
    if b.kind == "unary":
        fn = getattr(ffn_ext, op, None)
        return fn if callable(fn) else functools.partial(getattr(ffn_ext, b.act.api[0]), **b.act.api[1])
    name = b.gated.name + ("_packed" if b.kind == "packed" else "")
    fn = getattr(ffn_ext, name, None)
    kw = dict(b.params)
    if not callable(fn):
        fn, kw = (ffn_ext.gated if b.kind == "gated" else ffn_ext.gated_packed), {"activation": b.act.name}
    if b.kind == "packed" and b.layout != "concat":
        kw["layout"] = b.layout
    return functools.partial(fn, **kw) if kw else fn


def ffn_ext_label(op: str) -> str:
    """How the public API call of op reads: ffn_ext.swiglu, ffn_ext.gelu(approximate='tanh'), ..."""
    fn = ffn_ext_fn(op)
    if not hasattr(fn, "keywords"):
        return f"ffn_ext.{fn.__name__}"
    kw = ", ".join(f"{k}={v!r}" for k, v in fn.keywords.items())
    return f"ffn_ext.{fn.func.__name__}({kw})"


# ---------------------------------------------------------------- optional peers
# Liger-Kernel's gated activations, by the table's activation name: (module, autograd Function) computing
# act(a) * b. LigerGELUMulFunction is the tanh GeGLU (Gemma's MLP); Liger has no exact-erf GeGLU.
LIGER_GATED = {
    "silu": ("liger_kernel.ops.swiglu", "LigerSiLUMulFunction"),
    "gelu_tanh": ("liger_kernel.ops.geglu", "LigerGELUMulFunction"),
}


def _why_not(e: Exception, package: str, what: str) -> str:
    if isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] == package:
        return f"{package} not installed"
    return f"{what} not importable ({type(e).__name__}: {str(e)[:200]})"


def liger_gated() -> dict:
    """{activation: (Function.apply, None)} where liger_kernel is importable, else {activation: (None, reason)}."""
    import importlib

    out = {}
    for act, (module, name) in LIGER_GATED.items():
        try:
            out[act] = (getattr(importlib.import_module(module), name).apply, None)
        except Exception as e:  # noqa: BLE001  (ImportError, or triton missing inside it)
            out[act] = (None, _why_not(e, "liger_kernel", f"{module}.{name}"))
    return out


def vllm_swigluoai() -> tuple:
    """(fn, None) with fn(gate_up, limit, alpha) -> vLLM's forward-only GPT-OSS activation: torch.ops._C.
    swigluoai_and_mul(out, gate_up, alpha, limit), interleaved layout, (up + 1) built in; (None, reason) where vLLM
    is not installed (or its library does not load)."""
    try:
        import vllm._C  # noqa: F401  (registers torch.ops._C)

        op = torch.ops._C.swigluoai_and_mul
    except Exception as e:  # noqa: BLE001
        return None, _why_not(e, "vllm", "vllm._C / torch.ops._C.swigluoai_and_mul")

    def swigluoai(gate_up, limit, alpha):
        out = torch.empty(gate_up.shape[:-1] + (gate_up.shape[-1] // 2,), dtype=gate_up.dtype, device=gate_up.device)
        op(out, gate_up, alpha, limit)
        return out

    return swigluoai, None


def te_clamped_swiglu() -> tuple:
    """(make, None) with make(limit, alpha, up_offset, layout) -> TransformerEngine's ClampedSwiGLU
    (transformer_engine.pytorch.ops.ClampedSwiGLU, forward and backward) on a [..., 2M] gate_up: concat layout
    natively; interleaved with glu_interleave_size=1 (TE then de-interleaves with a copy, forward and backward: what
    a TE user pays for GPT-OSS's layout); (None, reason) where TransformerEngine is not installed."""
    try:
        import transformer_engine.pytorch as te

        cls = te.ops.ClampedSwiGLU
    except Exception as e:  # noqa: BLE001
        return None, _why_not(e, "transformer_engine", "transformer_engine.pytorch.ops.ClampedSwiGLU")

    def make(limit, alpha, up_offset, layout):
        kw = {"limit": limit, "alpha": alpha}
        if layout == "interleaved":
            kw["glu_interleave_size"] = 1
        try:  # TransformerEngine 2.x before glu_linear_offset: (up + 1) built in
            return cls(**kw, glu_linear_offset=up_offset)
        except TypeError:
            if up_offset != 1.0:
                raise
            return cls(**kw)

    return make, None


def setup_compile() -> None:
    """Room for one compiled graph per (op, dtype, direction) and a static + a dynamic-shape recompile each."""
    import torch._dynamo

    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 256))
    if hasattr(cfg, "accumulated_recompile_limit"):
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 4096)
    elif hasattr(cfg, "accumulated_cache_size_limit"):
        cfg.accumulated_cache_size_limit = max(cfg.accumulated_cache_size_limit, 4096)


# ---------------------------------------------------------------- output
def fmt(v, spec: str = ".3g", none: str = "-") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return none
    if isinstance(v, str):
        return v
    return format(v, spec)


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def targets_block(targets: list[dict]) -> str:
    lines = ["Targets (reported, not asserted):"]
    for t in targets:
        status = {True: "MET", False: "NOT MET", None: "n/a"}[t["met"]]
        lines.append(
            f"  [{status:>7}] {t['target']}: measured {t['measured_str']}"
            + (f"  ({t['note']})" if t.get("note") else "")
        )
    return "\n".join(lines)


def make_target(
    target: str,
    value,
    threshold: float,
    higher_is_better: bool,
    unit: str = "",
    note: str = "",
    spec_conditions_met: bool = True,
) -> dict:
    if value is None:
        met = None
        measured_str = "not measured"
    else:
        met = bool(value >= threshold) if higher_is_better else bool(value <= threshold)
        measured_str = f"{value:.3g}{unit}"
    if not spec_conditions_met and value is not None:
        note = (note + "; " if note else "") + "measured outside the target's conditions"
    return {
        "target": target,
        "measured": value,
        "measured_str": measured_str,
        "threshold": threshold,
        "higher_is_better": higher_is_better,
        "met": met,
        "note": note,
        "conditions_met": spec_conditions_met,
    }


def write_outputs(out_dir: Path, stem: str, payload: dict, markdown: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    md, js = out_dir / f"{stem}.md", out_dir / f"{stem}.json"
    md.write_text(markdown + "\n")
    js.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    return [md, js]


def report(args, stem: str, payload: dict, markdown: str, plot_fn) -> int:
    """The end of every benchmark script: print the table, write <stem>.md/.json and the plots (plot_fn(payload,
    out_dir) -> paths) into --out or the default results folder."""
    out_dir = args.out or default_out_dir(resolve_device(args.device))
    print(markdown)
    files = write_outputs(out_dir, stem, payload, markdown)
    if not args.no_plots:
        files += plot_fn(payload, out_dir)
    print("\nwrote: " + ", ".join(str(f) for f in files), file=sys.stderr)
    return 0


def add_common_args(p) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="fewer sizes and dtypes (default)")
    g.add_argument("--full", action="store_true", help="every size and dtype (GPU: minutes)")
    g.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes, fp32, no torch.compile: a CI check of the pipeline (numbers are meaningless)",
    )
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output directory (default benchmarks/results/<YYYY-MM-DD>_<device-slug>/)",
    )
    p.add_argument("--dtypes", default=None, help="comma-separated subset of fp32,fp16,bf16")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--target-ms", type=float, default=None, help="approximate measuring time per timed case (after warm-up)"
    )
    p.add_argument("--seed", type=int, default=0)


def mode_of(args) -> str:
    return "full" if args.full else "smoke" if args.smoke else "quick"


# ---------------------------------------------------------------- process memory (CPU whole-model runs)
def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def rss_bytes() -> int | None:
    """The process's resident set now (Linux /proc; None elsewhere)."""
    return _status_kib("VmRSS")


def reset_peak_rss() -> bool:
    """Resets the kernel's RSS high-water mark (VmHWM) to the current RSS, so that peak_rss_bytes() measures from
    here (Linux: writing 5 to /proc/self/clear_refs). False where that is not possible: the peak is then the
    process's since it started."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int | None:
    """The process's peak resident set since reset_peak_rss() (or its start): VmHWM, else ru_maxrss."""
    hwm = _status_kib("VmHWM")
    if hwm is not None:
        return hwm
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    except (ImportError, OSError):
        return None


def release_heap() -> None:
    """Hands freed heap pages back to the kernel (glibc's malloc_trim), so that an RSS baseline taken next does not
    count memory that the process merely kept from before."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class CpuAllocPeak:
    """Context manager (CPU): the peak of the bytes that the CPU allocator handed out within the block and had not
    taken back, above the block's start, from the profiler's allocation events (torch.profiler with
    profile_memory=True: every allocation and free of c10's CPU allocator, in order). Unlike a dispatch mode
    (_LiveStorages) it does not change what runs: the ops take their ordinary paths. `peak` is None where this
    torch's profiler gives no allocation events. Kineto's start and stop lines on stderr are silenced."""

    def __init__(self):
        self.peak: int | None = None
        self.live: int | None = None
        self._prof = None

    @staticmethod
    @contextlib.contextmanager
    def _quiet_stderr():
        sys.stderr.flush()
        saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            os.close(null)

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with self._quiet_stderr():
            self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        with self._quiet_stderr():
            self._prof.__exit__(*exc)
        prof, self._prof = self._prof, None  # its event buffers go with it
        try:
            from torch._C._profiler import _EventType

            allocs, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
            while todo:
                e = todo.pop()
                todo.extend(e.children)
                if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
                    allocs.append((e.start_time_ns, e.extra_fields.alloc_size))
        except (AttributeError, ImportError, RuntimeError):
            return False
        live = peak = 0
        for _, n in sorted(allocs):
            live += n
            peak = max(peak, live)
        self.peak = peak if allocs else None
        self.live = live if allocs else None  # what the block left allocated
        return False
