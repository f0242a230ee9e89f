"""Every ffn_ext op (forward and backward, every activation of the op table ffn_ext/table.py) on CUDA, every dtype,
a few shapes and layouts: a plain script for compute-sanitizer (no pytest, runs in seconds):

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
from ffn_ext.table import ACTIVATIONS

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
                for act in ACTIVATIONS:  # the op table: each activation's six ops
                    unary, unary_bw = getattr(OPS, act.name), getattr(OPS, act.name + "_backward")
                    gated, gated_bw = getattr(OPS, act.gated), getattr(OPS, act.gated + "_backward")
                    check(f"{act.name} {tag}", unary(x), unary(xc.double()), dtype)
                    check(f"{act.name}_backward {tag}", unary_bw(grad, x), unary_bw(gc.double(), xc.double()), dtype)
                    check(f"{act.gated} {tag}", gated(x, up), gated(xc.double(), uc.double()), dtype)
                    dg, du = gated_bw(grad, x, up)
                    rg, ru = gated_bw(gc.double(), xc.double(), uc.double())
                    check(f"{act.gated}_backward.dgate {tag}", dg, rg, dtype)
                    check(f"{act.gated}_backward.dup {tag}", du, ru, dtype)
                    calls += 4
                    if cols % 2 == 0:  # packed ops: x is [rows, 2M]
                        m = cols // 2
                        gm = grad[:, :m]  # a strided grad
                        packed = getattr(OPS, act.gated + "_packed")
                        packed_bw = getattr(OPS, act.gated + "_packed_backward")
                        check(f"{act.gated}_packed {tag}", packed(x), packed(xc.double()), dtype)
                        check(f"{act.gated}_packed_backward {tag}", packed_bw(gm, x),
                              packed_bw(gm.cpu().double(), xc.double()), dtype)
                        calls += 2
        # autograd through the public API (the backward ops run from autograd's engine thread)
        for act in ACTIVATIONS:
            gu = torch.randn(6, 2 * 45, generator=gen).to(dtype).cuda().requires_grad_(True)
            ffn_ext.gated_packed(gu, activation=act.name).sum().backward()
            x = torch.randn(6, 45, generator=gen).to(dtype).cuda().requires_grad_(True)
            function, options = act.api
            getattr(ffn_ext, function)(x, **options).sum().backward()
            calls += 4
    torch.cuda.synchronize()
    print(f"cuda_sanitize_cases: OK, {calls} op calls on {torch.cuda.get_device_name()} "
          f"(cuda kernels: {ffn_ext.has_cuda_kernels()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
