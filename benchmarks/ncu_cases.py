"""The kernels `benchmarks/device_check.sh` profiles with Nsight Compute: each op once, ffn_ext and its ATen peer,
bf16, 2**26 elements per tensor (several times the L2), so `ncu` can say whether a kernel is bound by memory or
by instruction issue. Not a benchmark: run it under ncu, e.g.

    ncu --clock-control none --section SpeedOfLight \\
        --metrics smsp__issue_active.avg.pct_of_peak_sustained_active python benchmarks/ncu_cases.py
"""
import torch
import torch.nn.functional as F

import ffn_ext

n = 1 << 26
gen = torch.Generator(device="cuda").manual_seed(0)
x, g, u = (torch.randn(n, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(3))
gu = torch.randn(1 << 13, 1 << 14, device="cuda", generator=gen, dtype=torch.bfloat16)  # packed, 2**26 per half
cases = [
    ("ffn_ext gelu", lambda: ffn_ext.gelu(x)), ("aten gelu", lambda: F.gelu(x)),
    ("ffn_ext gelu_backward", lambda: torch.ops.ffn_ext.gelu_backward(g, x)),
    ("aten gelu_backward", lambda: torch.ops.aten.gelu_backward(g, x)),
    ("ffn_ext silu", lambda: ffn_ext.silu(x)), ("aten silu", lambda: F.silu(x)),
    ("ffn_ext silu_backward", lambda: torch.ops.ffn_ext.silu_backward(g, x)),
    ("aten silu_backward", lambda: torch.ops.aten.silu_backward(g, x)),
    ("ffn_ext swiglu", lambda: ffn_ext.swiglu(g, u)),
    ("ffn_ext swiglu_backward", lambda: torch.ops.ffn_ext.swiglu_backward(x, g, u)),
    ("ffn_ext swiglu_packed", lambda: ffn_ext.swiglu_packed(gu)),
]
for name, fn in cases:
    torch.cuda.nvtx.range_push(name)
    fn()
    torch.cuda.nvtx.range_pop()
torch.cuda.synchronize()
print("ran:", ", ".join(name for name, _ in cases))
