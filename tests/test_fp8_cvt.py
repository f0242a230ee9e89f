"""The sm_89+ build's FP8 conversion against the software one, on the host: the CUDA kernels built for sm_90
convert with cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32 (two elements per instruction, the op's clamp to +-fp8_max left
to the instruction's saturation), the host and sm_80 with ffn_math.h's bit-level to_fp8 (checked against torch's
casts in tests/test_quant_math.py). The host cannot run the instruction; cuda_fp8.h's __nv_cvt_float_to_fp8 and
__nv_cvt_float2_to_fp8x2 are __host__ __device__ and their host path emulates it (the device path is that one
instruction). tests/fp8_cvt_check.cpp compares the two bit for bit, element by element and as the device's
pairwise chunk code; this test builds it with the host compiler and runs it (seconds)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import HANG_GUARD_S

ROOT = Path(__file__).resolve().parent.parent
CUDA_HOME = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


@pytest.mark.skipif(not (CUDA_HOME / "include" / "cuda_fp8.h").is_file(), reason="needs a CUDA toolkit's cuda_fp8.h")
@pytest.mark.skipif(_compiler() is None, reason="needs a host C++ compiler")
def test_hardware_fp8_conversion_matches_software(tmp_path):
    from torch.utils.cpp_extension import include_paths

    exe = tmp_path / "fp8_cvt_check"
    cmd = [_compiler(), "-std=c++17", "-O2", "-I", str(ROOT / "csrc")]
    cmd += [f"-I{p}" for p in include_paths()] + [f"-I{CUDA_HOME / 'include'}"]
    cmd += [str(ROOT / "tests" / "fp8_cvt_check.cpp"), "-o", str(exe)]
    build = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert run.returncode == 0 and run.stdout.startswith("ok "), run.stdout[-4000:] + run.stderr[-2000:]
    assert int(run.stdout.split()[1]) > 4_000_000  # the values checked per format, summed: all of them ran
