"""python -m ffn_ext: the FFN -> GELU -> SwiGLU walk, live, and a self-check of the installed ops, in one screen.

1. the build (one line);  2. the walk of the seed articles: the classic FFN (d_model 768, 4x, GELU) next to
Qwen2.5-0.5B's SwiGLU MLP (896 -> 4864) through ffn_ext.FFN and ffn_ext.SwiGLUFFN with forward hooks: shapes,
parameters, the 8/3 rule (ffn_ext.sizing) and the [tokens, d_ff] tensors autograd saves for backward, counted
while it runs, against the eager PyTorch MLP;  3. every op of the op table (ffn_ext/table.py; forward and
backward, fp64 / fp32 / bf16) against an fp64 reference from the table's ATen forms on the best device: one line per
activation (its unary ops and the gated ops over it) with the number of op x dtype checks and the worst error as a
fraction of the tolerance;  4. the FFN layers' fwd+bwd time against the eager PyTorch MLP on that device;
5. PASS/FAIL (exit status 1 on FAIL) with the time taken.

Options: --device cpu|cuda (default: cuda when available and the CUDA kernels are built, else cpu);
--quick (skip the timing); --verbose (the full op x dtype table and the op timings); --threads N (torch CPU
threads, default 1).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import ffn_ext
from ffn_ext import _loader
from ffn_ext._timing import blocked_pair
from ffn_ext.sizing import ffn_params, gated_ffn_params, swiglu_hidden_dim
from ffn_ext.table import BY_NAME
from ffn_ext.table import OPS as TABLE_OPS

OPS = tuple(TABLE_OPS)  # every op of the table (ffn_ext/table.py): per activation its six, forward and backward

# allclose tolerances against an fp64 ATen reference (outputs rounded once ~ 2^-9 relative for bf16)
TOLERANCES = {torch.float64: (1e-12, 1e-10), torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 2**-6)}
_REL_FLOOR = 1e-3  # relative errors are reported where |reference| >= this


def pick_device(requested: str | None) -> torch.device:
    if requested:
        dev = torch.device(requested)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise SystemExit("ffn_ext: --device cuda requested but torch.cuda.is_available() is False")
        return dev
    if torch.cuda.is_available() and ffn_ext.has_cuda_kernels():
        return torch.device("cuda")
    return torch.device("cpu")


def _label(device: torch.device) -> str:
    return "GPU" if device.type == "cuda" else "CPU"


def _dname(dtype) -> str:
    return str(dtype).replace("torch.", "")


# ---------------------------------------------------------------- 2. the walk
WALK_TOKENS = 16  # x: (1, 16, d_model), as the seed article's Qwen2.5-0.5B walk


def _linears(module) -> list:
    """The module's nn.Linear children in order (up then down; gate, up, down for the gated FFN)."""
    return [m for m in module.children() if isinstance(m, torch.nn.Linear)]


def eager_form(module):
    """The eager PyTorch MLP with `module`'s weights, as users write it: down(act(up(x))) for ffn_ext.FFN,
    down(act(gate(x)) * up(x)) for a gated FFN; act is the table entry's ATen form (F.gelu, F.silu, ...)."""
    name = module.activation
    act = BY_NAME[name].eager if name in BY_NAME else F.relu  # FFN's "relu" before the table had one
    if isinstance(module, ffn_ext.GatedFFN):
        gate, up, down = _linears(module)
        return lambda x: down(act(gate(x)) * up(x))
    up, down = _linears(module)
    return lambda x: down(act(up(x)))


def _hooked_shapes(module, x) -> str:
    """ "x (shape) -> child (its output's shape) -> ...", through forward hooks on the children, while module(x)
    runs (children that run on the same input, as gate_proj and up_proj, are joined with ", ")."""
    seen = []

    def hook(name):
        def fn(mod, inputs, output):
            src = next((t for t in inputs if isinstance(t, torch.Tensor)), None)
            seen.append((src is x, f"{name} {tuple(output.shape)}"))

        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in module.named_children()]
    try:
        with torch.no_grad():
            module(x)
    finally:
        for h in handles:
            h.remove()
    first = ", ".join(s for on_x, s in seen if on_x)
    return " -> ".join([f"x {tuple(x.shape)}", first] + [s for on_x, s in seen if not on_x])


def saved_activation_tensors(fn, tokens: int, width: int) -> tuple[int, int]:
    """(count, bytes) of the distinct storages autograd saves while running fn() for [tokens, width] activations
    (any leading shape with tokens rows in all; parameters excluded)."""
    seen = {}

    def pack(t):
        if (
            not isinstance(t, torch.nn.Parameter)
            and t.dim() >= 2
            and t.shape[-1] == width
            and t.numel() == tokens * width
        ):
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return len(seen), sum(seen.values())


def walk_layer(label: str, module, d_model: int, d_ff: int, params: int, out=print) -> tuple[int, int]:
    """One FFN of the walk: its shapes (hooks), parameters and the [tokens, d_ff] tensors saved for backward by
    ffn_ext's module and by the eager MLP with its weights; returns (ffn_ext's count, eager's count)."""
    x = torch.randn(1, WALK_TOKENS, d_model)
    counted = sum(p.numel() for p in module.parameters())
    assert counted == params, (label, counted, params)
    out(f"  {label}\n    {_hooked_shapes(module, x)}")
    xg = x.clone().requires_grad_()
    ours = saved_activation_tensors(lambda: module(xg), WALK_TOKENS, d_ff)[0]
    eager = saved_activation_tensors(lambda: eager_form(module)(xg), WALK_TOKENS, d_ff)[0]
    n = len(_linears(module))
    mine = f"{type(module).__name__} {ours}"
    out(
        f"    params {counted:,} = {n} x {d_model} x {d_ff}; saved [{WALK_TOKENS}, {d_ff}] tensors: eager PyTorch {eager}, "
        f"{mine}"
    )
    return ours, eager


def walk(out=print) -> None:
    """The seed articles' FFN -> GELU -> SwiGLU walk (module docstring, 2.)."""
    torch.manual_seed(0)
    d, d_ff = 768, 3072
    out(f"\n== The FFN -> SwiGLU walk (x: (1, {WALK_TOKENS}, d_model)) ==")
    walk_layer(
        f"classic FFN, GELU, {d} -> {d_ff} (4x)",
        ffn_ext.FFN(d, d_ff, activation="gelu"),
        d,
        d_ff,
        ffn_params(d, d_ff),
        out,
    )
    q, q_ff = 896, 4864
    walk_layer(
        f"Qwen2.5-0.5B SwiGLU, {q} -> {q_ff} ({q_ff / q:.2f}x)",
        ffn_ext.SwiGLUFFN(q, q_ff),
        q,
        q_ff,
        gated_ffn_params(q, q_ff),
        out,
    )
    big, m = 4096, swiglu_hidden_dim(4096)
    out(
        f"  8/3 rule at D = {big}: FFN (2 matrices at 4D) {ffn_params(big, 4 * big):,} params; SwiGLU (3 at 2/3 the "
        f"width,"
    )
    out(
        f"    256 * ceil({8 * big / 3:.1f} / 256) = {m}) {gated_ffn_params(big, m):,} params "
        f"({100 * (gated_ffn_params(big, m) / ffn_params(big, 4 * big) - 1):+.2f}%); Qwen's {q_ff} is not the rule:"
    )
    out(
        f"    swiglu_hidden_dim({q}) = {swiglu_hidden_dim(q)}; {q_ff} = swiglu_hidden_dim({q}, "
        f"ffn_dim_multiplier=2.0) = {swiglu_hidden_dim(q, 256, 2.0)}"
    )


# ---------------------------------------------------------------- 4. op checks
def aten_reference(spec, layout="concat"):
    """The op of table entry `spec` (an OpSpec) written with ATen ops (OpSpec.compute, at the example parameters):
    the reference of the checks (run in float64) and the ATen column (in the op's dtype). Packed ops in `layout`."""
    return lambda *args: spec.compute(args, spec.example, layout)


def _vjp(fn, grad, *inputs):
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in inputs]
        out = torch.autograd.grad(fn(*leaves), leaves, grad)
    return out if len(out) > 1 else out[0]


def api_op(spec, layout="concat"):
    """The op of table entry `spec` through the public functional API: the forward op's API call (ffn_ext.gelu(x,
    approximate="tanh"), ffn_ext.gated(g, u, activation=...), ffn_ext.gated_packed(..., layout=...),
    ffn_ext.swiglu_clamped(..., **example params)); a backward op as the vector-Jacobian product of it."""
    act = spec.act
    if spec.kind == "unary":
        function, options = act.api
        fwd = lambda x: getattr(ffn_ext, function)(x, **options)  # noqa: E731
    elif spec.params:
        fn = getattr(ffn_ext, spec.gated.name + ("_packed" if spec.kind == "packed" else ""))
        kw = dict(spec.example, **({"layout": layout} if spec.kind == "packed" else {}))
        fwd = lambda *a: fn(*a, **kw)  # noqa: E731
    elif spec.kind == "gated":
        fwd = lambda g, u: ffn_ext.gated(g, u, activation=act.name)  # noqa: E731
    else:
        fwd = lambda gu: ffn_ext.gated_packed(gu, activation=act.name, layout=layout)  # noqa: E731
    return (lambda grad, *inputs: _vjp(fwd, grad, *inputs)) if spec.backward else fwd


def _op(name: str, layout="concat"):
    """torch.ops.ffn_ext.<name> (with the table's example parameters, and `layout` for a packed op)."""
    spec = TABLE_OPS[name]
    kw = dict(spec.example, **({"layout": layout} if spec.kind == "packed" else {}))
    op = getattr(torch.ops.ffn_ext, name)
    return (lambda *a: op(*a, **kw)) if kw else op


def op_cases():
    """name -> (make inputs(rows, cols, dtype, device, gen), ffn_ext op, ATen reference), for every op of the
    table (ffn_ext.table.OPS), each gated op again on chunk(2, -1) views and each packed op again in the
    interleaved layout, right after it."""

    def rnd(gen, rows, cols, dtype, device, scale=3.0):
        return (torch.randn(rows, cols, generator=gen, dtype=torch.float64) * scale).to(device=device, dtype=dtype)

    def unary(r, c, dt, dev, g):
        return (rnd(g, r, c, dt, dev),)

    def unary_bw(r, c, dt, dev, g):
        return rnd(g, r, c, dt, dev, 1.0), rnd(g, r, c, dt, dev)

    def binary(r, c, dt, dev, g):
        return rnd(g, r, c, dt, dev), rnd(g, r, c, dt, dev, 1.0)

    def binary_bw(r, c, dt, dev, g):
        return rnd(g, r, c, dt, dev, 1.0), rnd(g, r, c, dt, dev), rnd(g, r, c, dt, dev, 1.0)

    def views(r, c, dt, dev, g):  # gate, up = gate_up.chunk(2, -1): row stride 2*cols
        return tuple(rnd(g, r, 2 * c, dt, dev).chunk(2, dim=-1))

    def packed(r, c, dt, dev, g):
        return (rnd(g, r, 2 * c, dt, dev),)

    def packed_bw(r, c, dt, dev, g):
        return rnd(g, r, c, dt, dev, 1.0), rnd(g, r, 2 * c, dt, dev)

    makers = {
        ("unary", False): unary,
        ("unary", True): unary_bw,
        ("gated", False): binary,
        ("gated", True): binary_bw,
        ("packed", False): packed,
        ("packed", True): packed_bw,
    }
    cases = {}
    for name, spec in TABLE_OPS.items():
        op, ref = _op(name), aten_reference(spec)
        cases[name] = (makers[(spec.kind, spec.backward)], op, ref)
        if spec.kind == "gated" and not spec.backward:
            cases[f"{name} (chunk views)"] = (views, op, ref)
        if spec.kind == "packed":
            cases[f"{name} (interleaved)"] = (
                makers[(spec.kind, spec.backward)],
                _op(name, "interleaved"),
                aten_reference(spec, "interleaved"),
            )
    return cases


def _as_tuple(out):
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _errors(out, ref):
    """max abs and max rel (|ref| >= _REL_FLOOR) error of out against the fp64 reference, over all outputs."""
    max_abs = max_rel = 0.0
    for o, r in zip(out, ref):
        diff = (o.double() - r).abs()
        if diff.numel() == 0:
            continue
        nan_mismatch = bool((o.isnan() != r.isnan()).any())
        diff = torch.where(r.isnan() & o.isnan(), torch.zeros_like(diff), diff)
        max_abs = max(max_abs, float("inf") if nan_mismatch else diff.max().item())
        big = r.abs() >= _REL_FLOOR
        if big.any():
            max_rel = max(max_rel, (diff[big] / r.abs()[big]).max().item())
    return max_abs, max_rel


def _within(out, ref, dtype) -> bool:
    atol, rtol = TOLERANCES[dtype]
    return all(
        o.shape == r.shape and torch.allclose(o.double(), r, rtol=rtol, atol=atol, equal_nan=True)
        for o, r in zip(out, ref)
    )


def _as_good_as(out, base, ref, dtype) -> bool:
    """Element by element within the tolerance plus twice ATen eager's own error in the same dtype: where ATen's
    formula loses accuracy (fp32 tanh-GELU backward: ATen's tanh saturates to -1 for x < ~-5, so it returns 0 for
    a derivative of ~1e-6, which grad * up scales past the absolute tolerance), ffn_ext may lose as much.
    NaN must be where the reference has NaN."""
    atol, rtol = TOLERANCES[dtype]
    for o, b, r in zip(out, base, ref):
        if o.shape != r.shape or b.shape != r.shape:
            return False
        o, b = o.double(), b.double()
        both_nan = o.isnan() & r.isnan()
        slack = atol + rtol * r.abs() + 2 * torch.where(b.isnan() & r.isnan(), torch.zeros_like(r), (b - r).abs())
        if not bool(((o - r).abs() <= slack).logical_or(both_nan).all()):
            return False
    return True


def _fraction(out, ref, dtype, base=None) -> float:
    """The worst error of out against the fp64 reference as a fraction of the tolerance, atol + rtol |ref| (plus
    twice ATen's own error in the same dtype when `base` is given: _as_good_as's allowance), element by element; NaN
    where the reference has NaN is no error, NaN elsewhere is inf."""
    atol, rtol = TOLERANCES[dtype]
    worst = 0.0
    for o, r, b in zip(out, ref, base if base is not None else ref):
        if o.numel() == 0:
            continue
        o = o.double()
        slack = atol + rtol * r.abs()
        if base is not None:
            b = b.double()
            slack = slack + 2 * torch.where(b.isnan() & r.isnan(), torch.zeros_like(r), (b - r).abs())
        err = torch.where(o.isnan() & r.isnan(), torch.zeros_like(r), (o - r).abs())
        worst = max(worst, (err / slack).nan_to_num(nan=float("inf")).max().item())
    return worst


def check_ops(
    device,
    dtypes=(torch.float64, torch.float32, torch.bfloat16),
    rows=64,
    cols=1030,
    cases=None,
    seed=0,
    out=print,
    record=None,
) -> bool:
    """Every op against an fp64 ATen reference (and ATen in the same dtype, for scale); True when all pass. `out`
    gets the table's lines; `record` (a list), if given, one (case, dtype, fraction of the tolerance, passed by
    ATen's own error, ok) per check."""
    cases = op_cases() if cases is None else cases
    out(f"  {'op':<28} {'dtype':<9} {'max abs':>10} {'max rel':>10} {'ATen abs':>10} {'ATen rel':>10}  result")
    all_ok, by_aten = True, []
    for name, (make, op, aten) in cases.items():
        for dtype in dtypes:
            gen = torch.Generator().manual_seed(seed)
            inputs = make(rows, cols, dtype, device, gen)
            ref = tuple(r.double() for r in _as_tuple(aten(*(t.double() for t in inputs))))
            got = _as_tuple(op(*inputs))
            base = _as_tuple(aten(*inputs))
            ok = len(got) == len(ref) and all(g.dtype == dtype and g.device == inputs[0].device for g in got)
            aten_rule = False
            if ok and not _within(got, ref, dtype):
                ok = aten_rule = _as_good_as(got, base, ref, dtype)
                by_aten += [f"{name} {_dname(dtype)}"] if ok else []
            all_ok &= ok
            if record is not None:
                shapes = all(g.shape == r.shape for g, r in zip(got, ref)) and len(got) == len(ref)
                frac = _fraction(got, ref, dtype, base if aten_rule else None) if shapes else float("inf")
                record.append((name, dtype, frac, aten_rule, ok))
            (a_abs, a_rel), (b_abs, b_rel) = _errors(got, ref), _errors(base, ref)
            out(
                f"  {name:<28} {_dname(dtype):<9} {a_abs:>10.2e} {a_rel:>10.2e} {b_abs:>10.2e} {b_rel:>10.2e}  "
                f"{'ok' if ok else 'FAIL'}"
            )
    if by_aten:
        out(
            f"  ok above the tolerance but within it plus twice ATen eager's own error in the same dtype, element by "
            f"element: {', '.join(by_aten)}"
        )
    return all_ok


_SHORT = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def family(case: str) -> str:
    """The activation a check belongs to (its unary ops and every gated op over it): "swiglu_clamped_packed
    (interleaved)" -> "silu"."""
    return TABLE_OPS[case.split(" (")[0]].act.name


def family_summary(record, out=print) -> None:
    """One line per activation of the table: its checks (op x dtype, views and layouts included), the worst error as
    a fraction of the tolerance (and of the wider allowance where ATen's own error was needed), the failures."""
    families: dict = {}
    for rec in record:
        families.setdefault(family(rec[0]), []).append(rec)
    width = max(map(len, families), default=0)
    for fam, recs in families.items():
        ops = {r[0].split(" (")[0] for r in recs}
        plain = [r for r in recs if not r[3]]
        worst = max(plain, key=lambda r: r[2]) if plain else None
        line = f"  {fam:<{width}} {len(recs):>3} checks ({len(ops)} ops)"
        if worst is not None:
            line += f", worst {worst[2]:.2f} of the tolerance: {worst[0]} {_SHORT[worst[1]]}"
        wider = [r for r in recs if r[3]]
        if wider:  # above the tolerance, within it plus twice ATen eager's own error (_as_good_as)
            line += f"; +{len(wider)} by ATen's error"
        bad = [f"{r[0]} {_dname(r[1])}" for r in recs if not r[4]]
        out(line + (f"  FAIL: {', '.join(bad)}" if bad else "  ok"))


def check_module(device, out=print) -> bool:
    """ffn_ext.FFN and ffn_ext.SwiGLUFFN (with biases) against the eager MLP with their weights (eager_form), fp32:
    the output and every gradient (input, weights, biases), worst error over the largest |reference|."""
    ok = True
    for module in (ffn_ext.FFN(96, 256, activation="gelu", bias=True), ffn_ext.SwiGLUFFN(96, 256, bias=True)):
        torch.manual_seed(1)
        module = module.to(device)
        x = torch.randn(3, 50, 96, device=device, requires_grad=True)
        y = module(x)
        gy = torch.randn_like(y)
        leaves = (x, *module.parameters())
        got = (y, *torch.autograd.grad(y, leaves, gy))
        y0 = eager_form(module)(x)
        ref = (y0, *torch.autograd.grad(y0, leaves, gy))
        worst = max(((g - r).abs().max() / r.abs().max().clamp_min(1e-30)).item() for g, r in zip(got, ref))
        ok &= worst < 1e-4
        name = f"{type(module).__name__} fwd+bwd"
        out(
            f"  {name:<20} float32: worst error / max |ref| over y and {len(leaves)} grads vs eager {worst:.1e}  "
            f"{'ok' if worst < 1e-4 else 'FAIL'}"
        )
    return ok


# ---------------------------------------------------------------- 5. timing
def _time_pair(fns, device, blocks: int, rounds: int, warmup: int, before=None) -> tuple[float, float, float]:
    """(ms of fns[0], ms of fns[1], ratio fns[1] / fns[0]): the two callables alternating over `blocks` blocks of
    `rounds` rounds (ffn_ext._timing.blocked_pair says how and why). `before`, if given, runs untimed before every
    call. CUDA: events, CPU: perf_counter."""
    for fn in fns:
        for _ in range(warmup):
            if before is not None:
                before()
            fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)

    def time_one(k: int) -> float:
        if before is not None:
            before()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fns[k]()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        fns[k]()
        return (time.perf_counter() - t0) * 1e3

    return blocked_pair(time_one, blocks, rounds)


def ffn_timing(device, out=print) -> list:
    """The walk's two FFN layers, fwd and fwd+bwd, against the eager PyTorch MLP with the same weights (eager_form):
    alternating, in blocks (_time_pair). Returns the ratios (eager time / ffn_ext time)."""
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    # CPU: the walk's 16 tokens, so that a run (milliseconds) mostly fits in a time slice of a shared machine
    tokens, blocks, rounds, warmup = (8192, 6, 5, 5) if gpu else (WALK_TOKENS, 12, 10, 3)
    where = f"{_label(device)} ({device})" if gpu else f"CPU, {torch.get_num_threads()} thread(s)"
    out(
        f"\n== FFN layers on {where}, {_dname(dtype)}, {tokens} tokens (ms: min of {blocks * rounds}, alternating; "
        f"eager/ffn_ext: median of {blocks} blocks) =="
    )
    torch.manual_seed(2)
    layers: list[tuple[str, ffn_ext.FFN | ffn_ext.SwiGLUFFN]] = [
        ("FFN 768 -> 3072, GELU", ffn_ext.FFN(768, 3072, activation="gelu")),
        ("SwiGLUFFN 896 -> 4864", ffn_ext.SwiGLUFFN(896, 4864)),
    ]
    out(f"  {'layer':<24} {'pass':<8} {'ffn_ext':>9} {'eager':>9} {'eager/ffn_ext':>13}  (above 1x: ffn_ext faster)")
    ratios = []
    for label, module in layers:
        module = module.to(device=device, dtype=dtype)
        eager = eager_form(module)
        x = torch.randn(tokens, module.down_proj.out_features, device=device, dtype=dtype, requires_grad=True)
        gy = torch.randn_like(x)

        def train(fwd, x=x, gy=gy):
            return lambda: torch.autograd.backward(fwd(x), gy)

        leaves = (x, *module.parameters())

        def zero_grad(leaves=leaves):
            # as optimizer.zero_grad() between steps: each timed backward starts without gradients. Accumulating
            # into kept ones instead left glibc's heap in a state where one callable's 17 MB weight gradients were
            # fresh pages every call and the other's were not (SwiGLUFFN fwd+bwd: 0.72x in some processes, 12,768
            # page faults a call on one side, none on the other).
            for t in leaves:
                t.grad = None

        def infer(fwd, x=x):
            def run():
                with torch.no_grad():
                    fwd(x)

            return run

        for what, wrap, before in (("fwd", infer, None), ("fwd+bwd", train, zero_grad)):
            ours, theirs, ratio = _time_pair([wrap(module), wrap(eager)], device, blocks, rounds, warmup, before)
            ratios.append(ratio)
            out(f"  {label:<24} {what:<8} {ours:>9.3f} {theirs:>9.3f} {ratio:>12.2f}x")
    if not gpu:
        out(
            "  On the CPU the ops are PyTorch's own: the gain there is memory (the [tokens, d_ff] tensors kept, "
            "above), not time."
        )
    return ratios


def op_timing(device, out=print, blocks=None, rounds=None, warmup=None, size=None) -> None:
    """--verbose: the ops of Llama/Qwen (swiglu), Gemma (geglu_tanh) and GPT-OSS (the clamped, interleaved
    SwiGLU) and exact GELU, against their ATen expressions, alternating, in blocks (_time_pair)."""
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    tokens, d_ff = size or ((8192, 14336) if gpu else (256, 2048))
    blocks, rounds = blocks or (10 if gpu else 12), rounds or (5 if gpu else 10)
    warmup = (5 if gpu else 3) if warmup is None else warmup
    where = f"{_label(device)} ({device})" if gpu else f"CPU, {torch.get_num_threads()} thread(s)"
    out(
        f"\n== Ops on {where}, {_dname(dtype)}, [{tokens}, {d_ff}]: public API vs the ATen expression (ms: min of "
        f"{blocks * rounds}, alternating; ratio: median of {blocks} blocks) =="
    )
    gen = torch.Generator(device=device).manual_seed(0)
    gate, up, grad = (torch.randn(tokens, d_ff, device=device, dtype=dtype, generator=gen) for _ in range(3))
    gate_up = torch.randn(tokens, 2 * d_ff, device=device, dtype=dtype, generator=gen)
    args = {"unary": (gate,), "gated": (gate, up), "packed": (gate_up,)}

    def fwd_bwd(fn, inputs):
        leaves = [t.detach().requires_grad_() for t in inputs]
        return lambda: torch.autograd.grad(fn(*leaves), leaves, grad)

    rows: list[tuple[str, Callable, Callable]] = []  # (case, ours, ATen): callables of no argument
    # the gated ops of Llama/Qwen (swiglu) and Gemma (geglu_tanh), the packed form and exact GELU: ffn_ext's public
    # function (api_op) against the table's ATen form (act(gate) * up with F.silu, F.gelu: what eager users write)
    for name in ("swiglu", "geglu_tanh", "swiglu_packed", "gelu"):
        spec = TABLE_OPS[name]
        a, ours, ref = args[spec.kind], api_op(spec), aten_reference(spec)
        rows.append((f"{name} fwd", lambda f=ours, a=a: f(*a), lambda f=ref, a=a: f(*a)))
        rows.append((f"{name} fwd+bwd", fwd_bwd(ours, a), fwd_bwd(ref, a)))
    # GPT-OSS's experts: the clamped SwiGLU on the interleaved layout (limit 7, alpha 1.702, up + 1; inputs scaled
    # so that the clamps act) against transformers' GptOssExperts._apply_gate in ATen ops
    gpt_oss = {"limit": 7.0, "alpha": 1.702, "up_offset": 1.0}
    gu_c = gate_up * 4

    def hf_apply_gate(gu):
        g, u = gu[..., ::2], gu[..., 1::2]
        g = g.clamp(min=None, max=gpt_oss["limit"])
        u = u.clamp(min=-gpt_oss["limit"], max=gpt_oss["limit"])
        return (u + gpt_oss["up_offset"]) * (g * torch.sigmoid(g * gpt_oss["alpha"]))

    def clamped(gu):
        return ffn_ext.swiglu_clamped_packed(gu, layout="interleaved", **gpt_oss)

    rows.append(("GPT-OSS clamped interl. fwd", lambda: clamped(gu_c), lambda: hf_apply_gate(gu_c)))
    rows.append(("GPT-OSS clamped interl. fwd+bwd", fwd_bwd(clamped, (gu_c,)), fwd_bwd(hf_apply_gate, (gu_c,))))
    out(f"  {'case':<32} {'ffn_ext':>9} {'ATen':>9} {'vs ATen':>8}")
    for name, ours, theirs in rows:
        t_ours, t_aten, ratio = _time_pair([ours, theirs], device, blocks, rounds, warmup)
        out(f"  {name:<32} {t_ours:>9.3f} {t_aten:>9.3f} {ratio:>7.2f}x")


# ---------------------------------------------------------------- main
def headline(info: dict) -> str:
    """The first line (or two, within the screen's width): the version, torch, and where the ops run."""
    import textwrap

    text = f"ffn_ext {ffn_ext.__version__}, torch {info['torch_version']}: {_loader.where_it_runs(info)}"
    return textwrap.fill(text, width=120, subsequent_indent="  ", break_on_hyphens=False)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ffn_ext", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="where to check and time the ops (default: cuda if usable, else cpu)",
    )
    parser.add_argument("--quick", action="store_true", help="skip the timing")
    parser.add_argument(
        "--verbose", action="store_true", help="print every op x dtype check and time the ops one by one"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads for torch (default 1: the demo's tensors are small and OpenMP spinning "
        "on a shared 2-core machine costs more than it gains)",
    )
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    device = pick_device(args.device)

    info = ffn_ext.build_info()
    print(headline(info))
    if args.verbose:
        print(ffn_ext.build_summary())
    walk()

    what = "ffn_ext ops" + (" (no native library: PyTorch's ops)" if info["native"].startswith("none") else "")
    print(f"\n== Op checks ({what}) on {_label(device)} ({device}), fp64 / fp32 / bf16 against an fp64 reference ==")
    record: list[tuple] = []
    # odd row lengths exercise the CUDA kernels' vector tails; the GPU gets more rows
    shape = dict(rows=512, cols=4103) if device.type == "cuda" else {}
    ok = check_ops(device, out=print if args.verbose else (lambda line: None), record=record, **shape)
    family_summary(record)
    ok &= check_module(device)
    if not args.quick:
        ffn_timing(device)
        if args.verbose:
            op_timing(device)
    print(
        f"\n{'PASS' if ok else 'FAIL'}: ffn_ext ops vs ATen on {_label(device)} ({device}) "
        f"[{time.perf_counter() - t0:.1f} s]"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
