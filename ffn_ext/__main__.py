"""python -m ffn_ext: the FFN -> SwiGLU walk, live, and a self-check of the installed ops.

1. build information;  2. the Qwen2.5-0.5B MLP shape walk (x (1, 16, 896), d_ff 4864) through ffn_ext.SwiGLUFFN
with forward hooks, and its training memory;  3. the parameter table for D = 4096 (standard FFN vs SwiGLU);
4. every op of the op table (ffn_ext/table.py: per activation, gelu, gelu_tanh, silu, its unary, gated and packed
ops, forward and backward; fp64 / fp32 / bf16) against an fp64 reference from the table's ATen forms (act.aten,
act.aten_backward) on the best device, with a PASS/FAIL line (exit status 1 on FAIL);  5. a short timing of ffn_ext
vs ATen eager on that device (swiglu and geglu_tanh forward and backward, swiglu_packed, gelu, SwiGLUFFN).

Options: --device cpu|cuda (default: cuda when available and the CUDA kernels are built, else cpu);
--quick (skip the timing); --threads N (torch CPU threads, default 1).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import ffn_ext
from ffn_ext.table import OPS as TABLE_OPS, join_packed, split_packed
from ffn_ext.sizing import ffn_params, swiglu_ffn_params, swiglu_hidden_dim

OPS = tuple(TABLE_OPS)  # every op of the table (ffn_ext/table.py): per activation its six, forward and backward

# allclose tolerances against an fp64 ATen reference (outputs rounded once ~ 2^-9 relative for bf16)
TOLERANCES = {torch.float64: (1e-12, 1e-10), torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 2 ** -6)}
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


# ---------------------------------------------------------------- 2. shape walk
def shape_walk() -> None:
    d_model, d_ff = 896, 4864
    print(f"\n== Qwen2.5-0.5B MLP shape walk: d_model {d_model}, d_ff {d_ff} ({d_ff / d_model:.2f}x) ==")
    torch.manual_seed(0)
    mlp = ffn_ext.SwiGLUFFN(d_model, d_ff)
    x = torch.randn(1, 16, d_model)

    def hook(name):
        def fn(module, inputs, output):
            shapes = " x ".join(str(tuple(t.shape)) for t in inputs)
            print(f"  {name:<10} {type(module).__name__:<7} {shapes:>28} -> {tuple(output.shape)}")
        return fn

    handles = [getattr(mlp, n).register_forward_hook(hook(n)) for n in ("gate_proj", "up_proj", "act", "down_proj")]
    print(f"  input x    {tuple(x.shape)}")
    with torch.no_grad():
        y = mlp(x)
    for h in handles:
        h.remove()
    print(f"  output y   {tuple(y.shape)}   params {sum(p.numel() for p in mlp.parameters()):,}"
          f" = 3 x {d_model} x {d_ff}")
    print(f"  8/3 rule: swiglu_hidden_dim({d_model}) = {swiglu_hidden_dim(d_model)}; Qwen's {d_ff} is not the 8/3 "
          f"rule (= swiglu_hidden_dim({d_model}, 256, ffn_dim_multiplier=2.0) = "
          f"{swiglu_hidden_dim(d_model, 256, 2.0)})")

    # training memory: [tokens, d_ff] tensors autograd keeps, ffn_ext vs the eager composite
    xg = x.clone().requires_grad_()
    ours = saved_activation_tensors(lambda: mlp(xg), 16, d_ff)
    eager = saved_activation_tensors(lambda: mlp.down_proj(F.silu(mlp.gate_proj(xg)) * mlp.up_proj(xg)), 16, d_ff)
    print(f"  saved for backward, [16, {d_ff}] tensors: ffn_ext {ours[0]} ({ours[1]:,} bytes), "
          f"eager PyTorch {eager[0]} ({eager[1]:,} bytes)")


def saved_activation_tensors(fn, tokens: int, width: int) -> tuple[int, int]:
    """(count, bytes) of the distinct storages autograd saves while running fn() for [tokens, width] activations
    (any leading shape with tokens rows in all; parameters excluded)."""
    seen = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter) and t.dim() >= 2 and t.shape[-1] == width \
                and t.numel() == tokens * width:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return len(seen), sum(seen.values())


# ---------------------------------------------------------------- 3. parameter table
def parameter_table(d: int = 4096) -> None:
    print(f"\n== FFN parameters at d_model D = {d} (no biases) ==")
    base = ffn_params(d, 4 * d)
    rows = [
        ("standard FFN, d_ff = 4D", "2", 4 * d, base),
        ("SwiGLU, d_ff = 4D (no shrink)", "3", 4 * d, swiglu_ffn_params(d, 4 * d)),
        ("SwiGLU, d_ff = floor(8D/3)", "3", (8 * d) // 3, swiglu_ffn_params(d, (8 * d) // 3)),
        ("SwiGLU, 8/3 rule to 256 (LLaMA)", "3", swiglu_hidden_dim(d), swiglu_ffn_params(d)),
    ]
    print(f"  {'layout':<34} {'matrices':>8} {'d_ff':>7} {'params':>13} {'vs FFN':>8}")
    for name, mats, ff, n in rows:
        print(f"  {name:<34} {mats:>8} {ff:>7} {n:>13,} {100.0 * (n / base - 1):>+7.2f}%")
    print(f"  8/3 = 2/3 x 4: three matrices at 2/3 the width keep the budget; "
          f"256 * ceil({8 * d / 3:.1f} / 256) = {swiglu_hidden_dim(d)}")


# ---------------------------------------------------------------- 4. op checks
def aten_reference(spec, layout="concat"):
    """The op of table entry `spec` (an OpSpec) written with ATen ops (its activation's act.aten and
    act.aten_backward, or its gated op's own ATen form, at the example parameters): the reference of the checks
    (run in float64) and the ATen column (in the op's dtype). Packed ops in `layout`."""
    if spec.kind == "unary":
        return spec.act.aten_backward if spec.backward else spec.act.aten
    g, p = spec.gated, spec.example

    def gated(gate, up):
        return g.forward(gate, up, **p)

    def gated_backward(grad, gate, up):
        return g.backward(grad, gate, up, **p)

    if spec.kind == "gated":
        return gated_backward if spec.backward else gated
    if spec.backward:
        return lambda grad, gu: join_packed(*gated_backward(grad, *split_packed(gu, layout)), layout)
    return lambda gu: gated(*split_packed(gu, layout))


def _vjp(fn, grad, *inputs):
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in inputs]
        out = torch.autograd.grad(fn(*leaves), leaves, grad)
    return out if len(out) > 1 else out[0]


def api_op(spec, layout="concat"):
    """The op of table entry `spec` through the public functional API (what is checked when torch.ops.ffn_ext is
    not loaded: the API's ATen fallback and its autograd): the forward op's API call (ffn_ext.gelu(x,
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
    """torch.ops.ffn_ext.<name> (with the table's example parameters, and `layout` for a packed op), or the public
    API's form of it when the native library is not loaded."""
    spec = TABLE_OPS[name]
    if ffn_ext.ops._native is None:
        return api_op(spec, layout)
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

    makers = {("unary", False): unary, ("unary", True): unary_bw, ("gated", False): binary,
              ("gated", True): binary_bw, ("packed", False): packed, ("packed", True): packed_bw}
    cases = {}
    for name, spec in TABLE_OPS.items():
        op, ref = _op(name), aten_reference(spec)
        cases[name] = (makers[(spec.kind, spec.backward)], op, ref)
        if spec.kind == "gated" and not spec.backward:
            cases[f"{name} (chunk views)"] = (views, op, ref)
        if spec.kind == "packed":
            cases[f"{name} (interleaved)"] = (makers[(spec.kind, spec.backward)], _op(name, "interleaved"),
                                              aten_reference(spec, "interleaved"))
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
    return all(o.shape == r.shape and torch.allclose(o.double(), r, rtol=rtol, atol=atol, equal_nan=True)
               for o, r in zip(out, ref))


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


def check_ops(device, dtypes=(torch.float64, torch.float32, torch.bfloat16), rows=64, cols=1030, cases=None,
              seed=0, out=print) -> bool:
    """Every op against an fp64 ATen reference (and ATen in the same dtype, for scale); True when all pass."""
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
            ok = all(g.dtype == dtype and g.device == inputs[0].device for g in got)
            if ok and not _within(got, ref, dtype):
                ok = _as_good_as(got, base, ref, dtype)
                by_aten += [f"{name} {_dname(dtype)}"] if ok else []
            all_ok &= ok
            (a_abs, a_rel), (b_abs, b_rel) = _errors(got, ref), _errors(base, ref)
            out(f"  {name:<28} {_dname(dtype):<9} {a_abs:>10.2e} {a_rel:>10.2e} {b_abs:>10.2e} {b_rel:>10.2e}  "
                f"{'ok' if ok else 'FAIL'}")
    if by_aten:
        out(f"  ok above the tolerance but within it plus twice ATen eager's own error in the same dtype, element by "
            f"element: {', '.join(by_aten)}")
    return all_ok


def check_module(device, out=print) -> bool:
    """SwiGLUFFN (lean autograd) vs the eager composite, fp32: output and all gradients."""
    torch.manual_seed(1)
    mlp = ffn_ext.SwiGLUFFN(96, 256, bias=True).to(device)
    x = torch.randn(3, 50, 96, device=device, requires_grad=True)
    y = mlp(x)
    gy = torch.randn_like(y)
    got = (y, *torch.autograd.grad(y, (x, *mlp.parameters()), gy))
    y0 = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    ref = (y0, *torch.autograd.grad(y0, (x, *mlp.parameters()), gy))
    worst = max(((g - r).abs().max() / r.abs().max().clamp_min(1e-30)).item() for g, r in zip(got, ref))
    ok = worst < 1e-4
    out(f"  {'SwiGLUFFN fwd+bwd':<28} {'float32':<9} max error / max |ref| over y and 7 grads: {worst:.2e}  "
        f"{'ok' if ok else 'FAIL'}")
    return ok


# ---------------------------------------------------------------- 5. timing
def _median_ms(fn, device, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def timing(device) -> None:
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    tokens, d_ff, d_model = (8192, 14336, 4096) if gpu else (256, 2048, 256)
    iters, warmup = (50, 5) if gpu else (7, 2)
    where = f"{_label(device)} ({device})" if gpu else f"CPU ({torch.get_num_threads()} thread(s))"
    print(f"\n== Timing on {where}, {_dname(dtype)}, median of {iters} (ms; tokens {tokens}, d_ff {d_ff}) ==")
    if not gpu:
        print("  (CPU: ffn_ext's CPU kernels are the ATen composites, so expect parity here)")
    gen = torch.Generator(device=device).manual_seed(0)
    gate, up, grad = (torch.randn(tokens, d_ff, device=device, dtype=dtype, generator=gen) for _ in range(3))
    gate_up = torch.randn(tokens, 2 * d_ff, device=device, dtype=dtype, generator=gen)
    args = {"unary": (gate,), "gated": (gate, up), "packed": (gate_up,)}
    rows = []
    # the gated ops of Llama/Qwen (swiglu) and Gemma (geglu_tanh), then the packed form and exact GELU; the ATen
    # column is the table's ATen composite (ATen's forward and backward kernels, as eager autograd runs them)
    for name in ("swiglu", "geglu_tanh", "swiglu_backward", "geglu_tanh_backward", "swiglu_packed", "gelu"):
        spec = TABLE_OPS[name]
        a = ((grad,) if spec.backward else ()) + args[spec.kind]
        op, ref = _op(name), aten_reference(spec)
        rows.append((f"{spec.forward_name} {'bwd' if spec.backward else 'fwd'}",
                     lambda op=op, a=a: op(*a), lambda ref=ref, a=a: ref(*a)))
    # GPT-OSS's experts: the clamped SwiGLU on the interleaved layout (limit 7, alpha 1.702, up + 1; inputs scaled
    # so that the clamps act) against transformers' GptOssExperts._apply_gate in ATen ops; fwd+bwd: the forward, then
    # the gradient of gate_up (autograd's backward for ATen)
    gpt_oss = {"limit": 7.0, "alpha": 1.702, "up_offset": 1.0}
    gu_c = gate_up * 4
    gu_cg = gu_c.detach().requires_grad_()

    def hf_apply_gate(gu):
        g, u = gu[..., ::2], gu[..., 1::2]
        g = g.clamp(min=None, max=gpt_oss["limit"])
        u = u.clamp(min=-gpt_oss["limit"], max=gpt_oss["limit"])
        return (u + gpt_oss["up_offset"]) * (g * torch.sigmoid(g * gpt_oss["alpha"]))

    def clamped(gu):
        return ffn_ext.swiglu_clamped_packed(gu, layout="interleaved", **gpt_oss)

    rows.append(("GPT-OSS clamped interl. fwd", lambda: clamped(gu_c), lambda: hf_apply_gate(gu_c)))
    rows.append(("GPT-OSS clamped interl. fwd+bwd", lambda: torch.autograd.grad(clamped(gu_cg), gu_cg, grad),
                 lambda: torch.autograd.grad(hf_apply_gate(gu_cg), gu_cg, grad)))
    layer_tokens = tokens // 2 if gpu else 128
    mlp = ffn_ext.SwiGLUFFN(d_model, d_ff if gpu else 1024).to(device=device, dtype=dtype)
    x = torch.randn(layer_tokens, d_model, device=device, dtype=dtype, generator=gen, requires_grad=True)
    gy = torch.randn(layer_tokens, d_model, device=device, dtype=dtype, generator=gen)

    def layer(fwd):
        return lambda: torch.autograd.backward(fwd(), gy)

    rows.append((f"SwiGLUFFN fwd+bwd ({layer_tokens} tok)", layer(lambda: mlp(x)),
                 layer(lambda: mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)))))
    print(f"  {'case':<32} {'ffn_ext':>9} {'ATen':>9} {'speedup':>8}")
    for name, ours, theirs in rows:
        a, b = _median_ms(ours, device, iters, warmup), _median_ms(theirs, device, iters, warmup)
        print(f"  {name:<32} {a:>9.3f} {b:>9.3f} {b / a:>7.2f}x")


# ---------------------------------------------------------------- main
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ffn_ext", description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="where to check and time the ops (default: cuda if usable, else cpu)")
    parser.add_argument("--quick", action="store_true", help="skip the timing")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads for torch (default 1: the demo's tensors are small and OpenMP spinning "
                             "on a shared 2-core machine costs more than it gains)")
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    device = pick_device(args.device)

    print("== ffn_ext build ==")
    print(ffn_ext.build_summary())
    shape_walk()
    parameter_table()

    what = "ffn_ext ops" if ffn_ext.ops._native is not None else "ffn_ext API (NO native library: ATen fallback)"
    print(f"\n== Op checks ({what}) on {_label(device)} ({device}) against an fp64 ATen reference "
          f"(ATen columns: ATen eager in the same dtype, for scale) ==")
    # odd row lengths exercise the CUDA kernels' vector tails; the GPU gets more rows
    ok = check_ops(device, rows=512, cols=4103) if device.type == "cuda" else check_ops(device)
    ok &= check_module(device)
    if not args.quick:
        timing(device)
    print(f"\n{'PASS' if ok else 'FAIL'}: ffn_ext ops vs ATen on {_label(device)} ({device}) "
          f"[{time.perf_counter() - t0:.1f} s]")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
