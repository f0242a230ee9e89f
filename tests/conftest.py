"""pytest configuration for ffn_ext's tests: hooks, fixtures and markers only. The helpers (op lists from the op
table, inputs, the float64 reference, tolerances, DEVICES, RecordOps, ...) are in tests/optable.py:
``from optable import ...``.

Markers (declared in pyproject.toml):
  cuda   needs a CUDA GPU. Skips when torch.cuda.is_available() is False; FAILS when a GPU is present but the loaded
         ffn_ext has no CUDA kernels (a wrong build must not pass silently as "skipped").
  large  tensors past 2**31 elements (tens of GiB): skip unless FFN_EXT_RUN_LARGE=1.
  slow   builds or subprocesses.
"""
from __future__ import annotations

import os
import zlib

import pytest
import torch

import ffn_ext
from optable import DEVICES, RecordOps  # noqa: F401  (tests/test_transforms.py imports RecordOps from here)

# ---------------------------------------------------------------- markers: cuda / large
LARGE_ENV = "FFN_EXT_RUN_LARGE"


def cuda_ready() -> bool:
    """True when CUDA tests can run (a GPU is visible)."""
    return torch.cuda.is_available()


def pytest_runtest_setup(item):
    if item.get_closest_marker("large") is not None and os.environ.get(LARGE_ENV, "0") != "1":
        pytest.skip(f"large test (tensors past 2**31 elements): set {LARGE_ENV}=1 to run it")
    if item.get_closest_marker("cuda") is not None:
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU: torch.cuda.is_available() is False")
        if not ffn_ext.has_cuda_kernels():
            pytest.fail(
                "a CUDA GPU is present but the loaded ffn_ext has no CUDA kernels (wrong build: rebuild with a CUDA "
                "toolkit and a CUDA torch).\n" + ffn_ext.build_summary(),
                pytrace=False,
            )


@pytest.fixture(autouse=True)
def _seed(request):
    """Every test starts from a seed derived from its id: fresh random inputs, reproducible per test."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    yield
