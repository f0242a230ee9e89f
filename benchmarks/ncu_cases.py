"""The kernels `benchmarks/device_check.sh` profiles with Nsight Compute: each op of the op table once (ffn_ext/
table.py: per activation gelu, gelu_tanh, silu its unary forward and backward next to ATen's, its gated forward
and backward, its packed forward), bf16, 2**26 elements per tensor (several times the L2), so `ncu` can say
whether a kernel is bound by memory or by instruction issue. Not a benchmark: run it under ncu, e.g.

    ncu --clock-control none --section SpeedOfLight \\
        --metrics smsp__issue_active.avg.pct_of_peak_sustained_active python benchmarks/ncu_cases.py

The packed backward runs the gated backward's kernel (another layout), so it is left out; except for GPT-OSS's
form, the clamped SwiGLU on the interleaved layout (common.bench_ops' swiglu_clamped_packed_interleaved), whose
forward and backward run last: the clamped SwiGLU's kernels, on inputs scaled so that the clamps act.
"""

import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (also puts the repository root on sys.path)
import torch  # noqa: E402

n = 1 << 26
gen = torch.Generator(device="cuda").manual_seed(0)
x, g, u = (torch.randn(n, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(3))
gu = torch.randn(1 << 13, 1 << 14, device="cuda", generator=gen, dtype=torch.bfloat16)  # packed, 2**26 per half
ops, aten = torch.ops.ffn_ext, torch.ops.aten
cases = []
for op, (kind, act) in common.table_ops().items():
    if kind == "unary":
        cases += [
            (f"ffn_ext {op}", partial(common.ffn_ext_fn(op), x)),
            (f"aten {op}", partial(act.aten, x)),
            (f"ffn_ext {op}_backward", partial(getattr(ops, f"{op}_backward"), g, x)),
            (f"aten {op}_backward", partial(act.aten_backward, g, x)),
        ]
    elif kind == "gated":
        cases += [
            (f"ffn_ext {op}", partial(common.ffn_ext_fn(op), g, u)),
            (f"ffn_ext {op}_backward", partial(getattr(ops, f"{op}_backward"), x, g, u)),
        ]
    else:
        cases.append((f"ffn_ext {op}", partial(common.ffn_ext_fn(op), gu)))
# GPT-OSS's experts: the clamped SwiGLU (limit 7, alpha 1.702, up + 1) on the interleaved [g0, u0, g1, u1, ...] layout
gpt_oss = common.bench_ops()["swiglu_clamped_packed_interleaved"]
gu_c = gu * gpt_oss.scale
kw = dict(gpt_oss.params, layout=gpt_oss.layout)
cases += [
    ("ffn_ext swiglu_clamped_packed interleaved", lambda: ops.swiglu_clamped_packed(gu_c, **kw)),
    (
        "ffn_ext swiglu_clamped_packed_backward interleaved",
        lambda: ops.swiglu_clamped_packed_backward(g.view(1 << 13, 1 << 13), gu_c, **kw),
    ),
]
for name, fn in cases:
    torch.cuda.nvtx.range_push(name)
    fn()
    torch.cuda.nvtx.range_pop()
torch.cuda.synchronize()
print("ran:", ", ".join(name for name, _ in cases))
