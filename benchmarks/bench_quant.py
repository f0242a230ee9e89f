"""The quantizing ops (ffn_ext.quant) against ffn_ext's unfused op followed by a torch quantize (the same formula:
ffn_ext.quant.reference_quantize), and against torch.compile of that composite; bytes moved (inputs + q + scales)
as a fraction of copy bandwidth (a clone of the inputs). Shapes: the decode shape (1 x 14336), 4096 x 14336 and
2**28 elements (8192 x 32768); bf16 by default. CPU times are CPU times.

    python benchmarks/bench_quant.py --device cuda            # every recipe, swiglu and quantize
    python benchmarks/bench_quant.py --quick                  # group-128, row and tensor recipes, two shapes
"""

from __future__ import annotations

import argparse
import sys

import torch
from common import DTYPES, markdown_table, resolve_device, time_fn

import ffn_ext
from ffn_ext.quant import QuantRecipe, reference_quantize

SHAPES = {"decode": (1, 14336), "4096x14336": (4096, 14336), "2^28": (8192, 32768)}
RECIPES = {
    "tensor": QuantRecipe(scaling="tensor"),
    "tensor-static": QuantRecipe(scaling="tensor", static_scale=0.01),
    "row": QuantRecipe(scaling="row"),
    "group128": QuantRecipe(scaling="group", group_size=128),
    "group128-col": QuantRecipe(scaling="group", group_size=128, scale_layout="column"),
    "mxfp8": QuantRecipe(scaling="group", group_size=32, pow2_scales=True, scale_dtype=torch.float8_e8m0fnu),
}

# one recipe per kernel and launch count: group (1 launch), row (1), tensor dynamic (2) and static (1)
QUICK = ("group128", "row", "tensor", "tensor-static")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument(
        "--quick", action="store_true", help="group128, row, tensor (dynamic, static) only; decode and 4096x14336"
    )
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--shapes", default=None, help=f"comma-separated subset of {','.join(SHAPES)}")
    args = p.parse_args(argv)
    dev, dt = resolve_device(args.device), DTYPES[args.dtype]
    recipes = {k: RECIPES[k] for k in (QUICK if args.quick else RECIPES)}
    names = args.shapes.split(",") if args.shapes else (("decode", "4096x14336") if args.quick else SHAPES)
    shapes = {k: SHAPES[k] for k in names}
    if dev.type == "cpu":
        shapes.pop("2^28", None)  # minutes per case on a CPU
    rows = []
    torch.set_grad_enabled(False)
    for sname, (m, k) in shapes.items():
        gate, up = torch.randn(m, k, device=dev, dtype=dt), torch.randn(m, k, device=dev, dtype=dt)
        copy_ms = time_fn(lambda a, b: (a.clone(), b.clone()), [(gate, up)], dev)["median_ms"]
        for rname, r in recipes.items():
            fused = time_fn(lambda a, b, r=r: ffn_ext.swiglu_quant(a, b, r), [(gate, up)], dev)["median_ms"]
            unfused = time_fn(lambda a, b, r=r: reference_quantize(ffn_ext.swiglu(a, b), r), [(gate, up)], dev)[
                "median_ms"
            ]
            comp = None
            if not args.no_compile:
                cf = torch.compile(lambda a, b, r=r: reference_quantize(torch.nn.functional.silu(a) * b, r))
                comp = time_fn(cf, [(gate, up)], dev)["median_ms"]
            q, s = ffn_ext.swiglu_quant(gate, up, r)
            moved = 2 * gate.nbytes + q.nbytes + s.nbytes
            rows.append(
                [
                    sname,
                    rname,
                    f"{fused:.4g}",
                    f"{unfused:.4g}",
                    "-" if comp is None else f"{comp:.4g}",
                    f"{unfused / fused:.2f}x",
                    "-" if comp is None else f"{comp / fused:.2f}x",
                    f"{(moved / fused) / (4 * gate.nbytes / copy_ms):.2f}",
                ]
            )
    print(f"swiglu_quant, {args.dtype}, {dev} ({'CPU wall-clock' if dev.type == 'cpu' else 'CUDA events'}; ms)")
    print(
        markdown_table(
            ["shape", "recipe", "fused", "swiglu + quantize", "compile", "vs unfused", "vs compile", "of copy bw"], rows
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
