"""Every ffn_ext op (forward and backward, every activation and gated op of the op table ffn_ext/table.py, gated
ops with parameters at their example values, packed ops in both layouts) on CUDA, every dtype, a few shapes and
layouts: a plain script for compute-sanitizer (no pytest, runs in seconds):

    compute-sanitizer --tool memcheck  --error-exitcode 1 python tests/cuda_sanitize_cases.py
    compute-sanitizer --tool racecheck --error-exitcode 1 python tests/cuda_sanitize_cases.py

Layouts: contiguous, chunk(2, -1) views (row stride 2M), storage offset one element (misaligned vectors), odd
widths (scalar head/tail), a transposed input (made contiguous by the op), expanded rows (stride 0) and empty
tensors. Results are also checked against the CPU path (float64 math, loose tolerances: the point here is memory
safety, the accuracy tests are tests/test_fuzz.py and the op tests). Exits 0 and prints one summary line.
"""

import sys

import torch

import ffn_ext
from ffn_ext.table import ACTIVATIONS, GATED, LAYOUTS

OPS = torch.ops.ffn_ext
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 8e-2}


def layouts(rows, cols, dtype, gen):
    """(name, x [rows, cols]) for every layout; values random, never all zeros."""

    def r(*s):
        return (torch.randn(*s, generator=gen, dtype=torch.float32) * 2).to(dtype).cuda()

    yield "contiguous", r(rows, cols)
    yield "chunk", r(rows, 2 * cols).chunk(2, -1)[1]
    yield "offset1", r(rows * cols + 1)[1:].view(rows, cols)
    yield "padded", r(rows, cols + 1)[:, 1:]
    yield "transposed", r(cols, rows).t()
    yield "expanded", r(1, cols).expand(rows, cols)


def check(name, got, ref, dtype):
    got = got.cpu().double()
    ref = ref.double()
    if got.shape != ref.shape:
        raise AssertionError(f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}")
    err = (got - ref).abs().max().item() if got.numel() else 0.0
    if not err <= TOL[dtype] * (1 + ref.abs().max().item() if ref.numel() else 1):
        raise AssertionError(f"{name}: max error {err}")


def main():
    if not torch.cuda.is_available():
        print("cuda_sanitize_cases: no CUDA device, nothing to run")
        return 0
    if not ffn_ext.has_cuda_kernels():
        print("cuda_sanitize_cases: WARNING: ffn_ext has no CUDA kernels in this build (ATen composites run)")
    gen = torch.Generator().manual_seed(0)
    calls = 0
    shapes = [(4, 64), (3, 37), (5, 33), (1, 1), (2, 1000), (0, 16), (4, 0)]
    for dtype in DTYPES:
        for rows, cols in shapes:
            for lname, x in layouts(rows, cols, dtype, gen):
                tag = f"{dtype} {rows}x{cols} {lname}"
                xc = x.cpu()
                grad = torch.randn(rows, cols, generator=gen).to(dtype).cuda()
                gc = grad.cpu()
                up = torch.randn(rows, cols, generator=gen).to(dtype).cuda()
                uc = up.cpu()
                for act in ACTIVATIONS:  # the op table: each activation's two ops
                    unary, unary_bw = getattr(OPS, act.name), getattr(OPS, act.name + "_backward")
                    check(f"{act.name} {tag}", unary(x), unary(xc.double()), dtype)
                    check(f"{act.name}_backward {tag}", unary_bw(grad, x), unary_bw(gc.double(), xc.double()), dtype)
                    calls += 2
                for g in GATED:  # and each gated op's four, at the example parameters, packed in both layouts
                    p = g.example
                    gated, gated_bw = getattr(OPS, g.name), getattr(OPS, g.name + "_backward")
                    check(f"{g.name} {tag}", gated(x, up, **p), gated(xc.double(), uc.double(), **p), dtype)
                    dg, du = gated_bw(grad, x, up, **p)
                    rg, ru = gated_bw(gc.double(), xc.double(), uc.double(), **p)
                    check(f"{g.name}_backward.dgate {tag}", dg, rg, dtype)
                    check(f"{g.name}_backward.dup {tag}", du, ru, dtype)
                    calls += 2
                    if cols % 2 == 0:  # packed ops: x is [rows, 2M]
                        m = cols // 2
                        gm = grad[:, :m]  # a strided grad
                        packed = getattr(OPS, g.name + "_packed")
                        packed_bw = getattr(OPS, g.name + "_packed_backward")
                        for layout in LAYOUTS:
                            lt = f"{tag} {layout}"
                            check(
                                f"{g.name}_packed {lt}",
                                packed(x, **p, layout=layout),
                                packed(xc.double(), **p, layout=layout),
                                dtype,
                            )
                            check(
                                f"{g.name}_packed_backward {lt}",
                                packed_bw(gm, x, **p, layout=layout),
                                packed_bw(gm.cpu().double(), xc.double(), **p, layout=layout),
                                dtype,
                            )
                            calls += 2
        # autograd through the public API (the backward ops run from autograd's engine thread)
        for act in ACTIVATIONS:
            for layout in LAYOUTS:
                gu = torch.randn(6, 2 * 45, generator=gen).to(dtype).cuda().requires_grad_(True)
                ffn_ext.gated_packed(gu, activation=act.name, layout=layout).sum().backward()
                calls += 2
            x = torch.randn(6, 45, generator=gen).to(dtype).cuda().requires_grad_(True)
            function, options = act.api
            getattr(ffn_ext, function)(x, **options).sum().backward()
            calls += 2
        gu = torch.randn(6, 2 * 45, generator=gen).to(dtype).cuda().mul(4).requires_grad_(True)
        ffn_ext.swiglu_clamped_packed(gu, limit=7.0, alpha=1.702, up_offset=1.0, layout="interleaved").sum().backward()
        calls += 2
    torch.cuda.synchronize()
    print(
        f"cuda_sanitize_cases: OK, {calls} op calls on {torch.cuda.get_device_name()} "
        f"(cuda kernels: {ffn_ext.has_cuda_kernels()})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
