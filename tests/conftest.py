"""pytest configuration for ffn_ext's tests: hooks, fixtures and markers only. The helpers (op lists from the op
table, inputs, the float64 reference, tolerances, DEVICES, RecordOps, ...) are in tests/optable.py:
``from optable import ...``.

The tests run from the checkout or copied anywhere against an installed ffn_ext (CI's packaging stage does the
latter): SOURCE_TREE is the checkout (None outside one) and tests that read its files call needs_source_tree();
subprocesses get package_env(), which puts the package under test, not the current directory's, first on the path.

Markers (registered here, so that a copy of tests/ outside the tree knows them):
  cuda   needs a CUDA GPU. FAILS when a GPU is present but the loaded ffn_ext has no CUDA kernels (a wrong build must
         not pass silently as "skipped"). Without a GPU, the first cuda-marked parametrization of each test function
         runs in the CUDA stand-in (tests/cuda_standin.py: CPU tensors in the GPU's place, the CUDA launch emulated),
         so that no CUDA test's Python goes unrun; the others skip. A function that cannot run so is named in
         cuda_standin.NO_STANDIN with the reason, which its skip message gives.
  large  tensors past 2**31 elements (tens of GiB): skip unless FFN_EXT_RUN_LARGE=1.
  slow   builds or subprocesses.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import cuda_standin
import pytest
import torch
from optable import DEVICES, RecordOps  # noqa: F401  (tests/test_transforms.py imports RecordOps from here)

import ffn_ext

# ---------------------------------------------------------------- where things are
_HERE = Path(__file__).resolve().parent.parent
# The checkout these tests sit in, or None when they were copied out of it (or it lacks the sources).
SOURCE_TREE = _HERE if (_HERE / "csrc" / "build.json").is_file() and (_HERE / "setup.py").is_file() else None
# The directory holding the ffn_ext package under test (site-packages for an install, the checkout otherwise).
PACKAGE_PARENT = Path(ffn_ext.__file__).resolve().parent.parent


def needs_source_tree(what: str = "this test") -> Path:
    """The checkout's root; skips the calling test when the tests run outside a checkout."""
    if SOURCE_TREE is None:
        pytest.skip(f"{what} needs the source checkout (tests run outside it, against an installed ffn_ext)")
    return SOURCE_TREE


def package_env(**extra) -> dict:
    """os.environ for a subprocess that must import the ffn_ext under test (the one this process imported), not
    whichever ffn_ext its working directory or PYTHONPATH would find first."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_PARENT)] + [q for q in [env.get("PYTHONPATH")] if q])
    env.update(extra)
    return env


# The time limit of every subprocess a test starts: a guard against a hang, never a speed check, so that no test's
# outcome depends on how fast or loaded the machine is. An hour: many times the longest of them (a CPU-only build
# takes minutes on 2 cores).
HANG_GUARD_S = 3600

# ---------------------------------------------------------------- markers: cuda / large / slow
LARGE_ENV = "FFN_EXT_RUN_LARGE"
MARKERS = {
    "cuda": "needs a CUDA GPU and the CUDA kernels (skips elsewhere)",
    "large": "needs a GPU with tens of GiB (tensors past 2**31 elements); run by benchmarks/device_check.sh",
    "slow": "builds or subprocesses taking tens of seconds",
}


def pytest_configure(config):
    for name, what in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {what}")


def cuda_ready() -> bool:
    """True when CUDA tests can run (a GPU is visible)."""
    return torch.cuda.is_available()


def standin_key(item) -> str:
    """The NO_STANDIN key of a test item: "file::function" (the function's name, without its parameters)."""
    return f"{item.path.name}::{getattr(item, 'originalname', item.name)}"


def pytest_collection_modifyitems(config, items):
    """Without a GPU: marks the first cuda-marked item of each test function to run in the CUDA stand-in."""
    if torch.cuda.is_available() or not cuda_standin.available():
        return
    seen = set()
    for item in items:
        key = standin_key(item)
        if item.get_closest_marker("cuda") is None or key in seen or key in cuda_standin.NO_STANDIN:
            continue
        seen.add(key)
        item.stash[STANDIN] = True


STANDIN = pytest.StashKey[bool]()


def pytest_runtest_setup(item):
    if item.get_closest_marker("large") is not None and os.environ.get(LARGE_ENV, "0") != "1":
        pytest.skip(f"large test (tensors past 2**31 elements): set {LARGE_ENV}=1 to run it")
    if item.get_closest_marker("cuda") is not None:
        if not torch.cuda.is_available():
            if item.stash.get(STANDIN, False):
                return
            reason = cuda_standin.NO_STANDIN.get(standin_key(item))
            pytest.skip(
                "needs a CUDA GPU: torch.cuda.is_available() is False"
                + (
                    f"; no stand-in run: {reason}"
                    if reason
                    else "; this function's first cuda parametrization runs in the CUDA stand-in"
                    if cuda_standin.available()
                    else f"; no stand-in here (no native ffn_ext library, or {cuda_standin.STANDIN_ENV}=0)"
                )
            )
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


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A stand-in item's test body runs inside cuda_standin.standin() (fixtures outside it; the test makes its
    tensors itself)."""
    if not item.stash.get(STANDIN, False):
        return (yield)
    with pytest.MonkeyPatch.context() as mp, cuda_standin.standin(mp) as calls:
        result = yield
    assert calls, f"{item.nodeid} ran in the CUDA stand-in but no ffn_ext kernel was called"
    return result
