#!/usr/bin/env python
"""Instructions per element on each CUDA kernel's vector path, read from the SASS (no GPU needed), and what that
count predicts for bandwidth on an H200.

    python benchmarks/sass_budget.py                 # the loaded ffn_ext native library, sm_90
    python benchmarks/sass_budget.py --lib build/libffn_ext_ops.so --arch 80

A command line over ffn_ext.sass (the same as `python -m ffn_ext.sass`), which holds the SASS reader, the
vector-path tracer, the calibration against Nsight Compute and the kernel list derived from ffn_ext.table; its
docstring says how the count is made and what it predicts. tests/test_sass.py checks every kernel with it.
The FP8 quantizing kernels (csrc/cuda/quant_kernels.cuh) follow in a second table: their steady state per element
(ffn_ext.sass.quant_budget: one loop iteration, group / row / tensor and the tensor kernel's amax launch).
"""

from __future__ import annotations

import sys
from pathlib import Path

_REPO = str(Path(__file__).resolve().parent.parent)
if _REPO not in sys.path:  # run as `python benchmarks/sass_budget.py` from a checkout that is not installed
    sys.path.append(_REPO)

from ffn_ext.sass import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(prog="benchmarks/sass_budget.py"))
