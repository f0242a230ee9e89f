"""The FP8 inference MLP (ffn_ext.quantize_fp8) against the bf16 MLP: time per forward and the output's relative
error (in norm) against the fp32 MLP, for recipe="row" and "block" (on the CPU and off sm_90 "block" is the float32
emulation that fp8.py names: its time is not a speed). SwiGLUFFN at Qwen2-0.5B's width (896 -> 4864) by default.

    python benchmarks/bench_fp8_mlp.py                          # CPU: 64 tokens
    python benchmarks/bench_fp8_mlp.py --device cuda --check    # also: sm_90's BlockWise GEMMs vs the emulation

--check (CUDA): the block recipe through F.scaled_mm BlockWise1x128 x BlockWise128x128 must agree with the same
module's emulated GEMMs (the same FP8 values and scales; only the order of the float32 sums and the rounding of the
GEMM's output differ) and be within FP8's error of the fp32 MLP; exits 1 otherwise.
"""

from __future__ import annotations

import argparse
import copy
import sys
import warnings

import torch
from common import markdown_table, resolve_device, time_fn

import ffn_ext
from ffn_ext import fp8


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--inter", type=int, default=4864)
    p.add_argument("--check", action="store_true", help="CUDA: native BlockWise against the emulation")
    args = p.parse_args(argv)
    dev = resolve_device(args.device)
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    mlp = ffn_ext.SwiGLUFFN(args.hidden, args.inter).to(dev)
    x = torch.randn(args.tokens, args.hidden, device=dev, dtype=torch.bfloat16)
    exact = mlp(x.float())
    bf16 = mlp.to(torch.bfloat16)
    t_bf16 = time_fn(bf16, [(x,)], dev)["median_ms"]
    rows = [["bf16", f"{t_bf16:.4g}", "1.00x", f"{rel(bf16(x), exact):.4f}", "F.linear"]]
    ok = True
    for recipe in ("row", "block"):
        m8 = ffn_ext.quantize_fp8(copy.deepcopy(bf16), recipe)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            y = m8(x)
            t = time_fn(m8, [(x,)], dev)["median_ms"]
        native = recipe == "row" or fp8._blockwise_native(dev)
        gemm = "scaled_mm RowWise" if recipe == "row" else ("scaled_mm BlockWise" if native else "emulated (float32)")
        rows.append([recipe, f"{t:.4g}", f"{t_bf16 / t:.2f}x", f"{rel(y, exact):.4f}", gemm])
        if args.check and recipe == "block" and native:
            saved = fp8._blockwise_native
            fp8._blockwise_native = lambda device: False
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    emu, emu5 = m8(x), m8(x[:5])
            finally:
                fp8._blockwise_native = saved
            for what, got, want in ((f"{args.tokens} tokens", y, emu), ("5 tokens (padded to 8)", m8(x[:5]), emu5)):
                d = rel(got, want)
                good = d < 1e-2 and rel(y, exact) < 0.1
                ok &= good
                print(
                    f"check, {what}: block native vs emulated relative difference {d:.2e} ({'ok' if good else 'FAILED'})"
                )
    print(f"SwiGLUFFN {args.hidden} -> {args.inter}, {args.tokens} tokens, bf16 input, {dev} (median ms)")
    print(markdown_table(["MLP", "ms", "vs bf16", "rel. error vs fp32", "GEMMs"], rows))
    if args.check and not fp8._blockwise_native(dev):
        print("check: this device has no BlockWise F.scaled_mm (not sm_90): nothing to compare")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
