"""What `import ffn_ext` does about its native library before and after trying ffn_ext._C (called from
ops._load_installed): ops registered before the import, the CUDA library, and the fallback warning's advice.

- ffn_ext's ops are one TORCH_LIBRARY(ffn_ext); a second registration of the namespace aborts the process (c10
  "Only a single TORCH_LIBRARY can be used ..."), not a Python error. So when torch.ops.ffn_ext is already there
  (libffn_ext_ops.so loaded with torch.ops.load_library, or linked into a C++ host), the package adopts those ops
  and does not import _C.
- _C and the CUDA library are built on torch's stable ABI at the 2.10 target: one build serves every torch from
  2.10 on. setup.py leaves _build.RECORD next to _C (the torch and CUDA it was built with): the CUDA library is
  loaded only under a torch of the same CUDA major, else the CUDA kernels are off and build_info() says why.
- The advice names only what works here: rebuilding in a checkout, ffn_ext.jit.load() when the sources are there.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
from pathlib import Path

import torch

from . import _build

PROBE_OP = "ffn_ext::swiglu"


class Registered:
    """Stands in for the native module when the ops were registered by a library loaded before ffn_ext."""

    source = "ops registered before import (e.g. libffn_ext_ops.so)"

    def __init__(self):
        # asked now, before ffn_ext registers its Python kernels (which serve CUDA tensors when nothing else does)
        self._cuda = torch._C._dispatch_has_kernel_for_dispatch_key(PROBE_OP, "CUDA")

    def build_info(self) -> dict:
        return {
            "torch_version_built_against": "unknown (not ffn_ext._C)",
            "cuda_kernels": "yes" if self._cuda else "no",
            "cuda_version": "",
            "cuda_archs": "",
        }


def registered_elsewhere() -> Registered | None:
    """A stand-in module when torch.ops.ffn_ext is already registered in this process, else None."""
    try:
        torch._C._dispatch_find_schema_or_throw(PROBE_OP, "")
    except RuntimeError:
        return None
    return Registered()


def _built_C() -> list[Path]:
    return [p for s in importlib.machinery.EXTENSION_SUFFIXES for p in _build.PACKAGE.glob("_C" + s)]


def installed_elsewhere() -> Path | None:
    """The package directory of an ffn_ext installed (not editable) in this environment when the one imported is
    another: a checkout that shadows it, e.g. after `pip install .` in the checkout, whose own _C is not built."""
    try:
        dist = importlib.metadata.distribution("ffn_ext")
    except importlib.metadata.PackageNotFoundError:
        return None
    init = Path(str(dist.locate_file("ffn_ext/__init__.py")))
    if not init.is_file() or init.parent.resolve() == _build.PACKAGE.resolve():
        return None
    return init.parent


def check_installed_C() -> None:
    """Raises ImportError (before loading anything) when _C is absent. A _C built with any torch from the 2.10
    target on loads under any other (stable ABI); `import ffn_ext` refuses a torch older than that itself."""
    if not _built_C():
        other = installed_elsewhere()
        shadowed = (
            f". This is the ffn_ext source tree, which Python imports first from its current directory; the ffn_ext "
            f"installed in this environment is {other}: run Python from another directory to use it"
            if other is not None
            else ""
        )
        raise ImportError(f"ffn_ext._C is not built: no _C extension module in {_build.PACKAGE}{shadowed}")


def remedy() -> str:
    """What the fallback warning recommends: only what will work from this install."""
    ways = []
    if _build.in_checkout():
        ways.append(f"build the extension with `{_build.rebuild_command()}`")
    try:
        _build.source_root()
        ways.append(
            "call ffn_ext.jit.load() to compile the package's sources for this torch (a C++ compiler, and "
            "nvcc for the CUDA kernels; minutes the first time, cached after)"
        )
    except FileNotFoundError:
        ways.append(f"reinstall ffn_ext for this torch: {_build.rebuild_command()}")
    return "To get the fused kernels, " + ", or ".join(ways) + "."


# ---- the CUDA kernels: lib/libffn_ext_cuda.so (stable ABI, docs/internals/stable-abi.md) ----
# A library of its own, so that _C loads under any torch >= 2.10, CUDA or not. It needs libtorch_cuda and the
# libcudart.so of the CUDA major it was built with, so it is loaded only when the running torch has that major;
# otherwise, or when the load fails, the CUDA kernels are off and cuda_status() says why.
_cuda_status: dict = {"loaded": False, "reason": "not tried"}


def cuda_library_path() -> Path:
    return _build.PACKAGE / "lib" / "libffn_ext_cuda.so"


def _built_cuda_info(path: Path) -> dict:
    """The library's own record ('cuda_version=13.0;cuda_archs=900;...'), read through ctypes."""
    import ctypes

    lib = ctypes.CDLL(str(path))
    lib.ffn_ext_cuda_build_info.restype = ctypes.c_char_p
    return dict(kv.split("=", 1) for kv in lib.ffn_ext_cuda_build_info().decode().split(";") if "=" in kv)


def load_cuda_library() -> dict:
    """Loads the CUDA kernels once, when this torch can run them; returns cuda_status()."""
    if _cuda_status["loaded"] or _cuda_status["reason"] != "not tried":
        return cuda_status()
    path = cuda_library_path()
    record = _build.read_record(_build.PACKAGE) or {}
    built = record.get("torch_cuda") or ""
    if not path.is_file():
        reason = f"this build has no CUDA kernels ({path} does not exist)"
    elif torch.version.cuda is None:
        reason = f"torch {torch.__version__} is a CPU-only build"
    elif built and built.split(".")[0] != torch.version.cuda.split(".")[0]:
        reason = f"built for CUDA {built.split('.')[0]}.x, torch is built for CUDA {torch.version.cuda}"
    else:
        try:
            torch.ops.load_library(str(path))
        except OSError as e:  # load_library hides dlerror(); ctypes shows it
            try:
                _built_cuda_info(path)
                reason = f"torch.ops.load_library({path}) failed: {e}"
            except OSError as why:
                reason = f"cannot load {path}: {why}"
        else:
            _cuda_status.update(loaded=True, reason="", **_built_cuda_info(path))
            return cuda_status()
    _cuda_status.clear()
    _cuda_status.update(loaded=False, reason=reason)
    return cuda_status()


def cuda_status() -> dict:
    """{'loaded': bool, 'reason': why not ('' when loaded), and the library's cuda_version / cuda_archs}."""
    return dict(_cuda_status)


def where_it_runs(info: dict) -> str:
    """One line from build_info(): whether the CUDA kernels are built, for which architectures, whether a GPU is
    visible, and so what the ops run ('CUDA kernels: built for sm_80, sm_90 (+PTX); no GPU visible: the ops run
    PyTorch's CPU ops'). A build made for GPUs says so on a machine without one, where it runs none of its kernels."""
    gpu = torch.cuda.is_available()
    if gpu:
        major, minor = torch.cuda.get_device_capability()
        visible = f"GPU: {torch.cuda.get_device_name()} (sm_{major}{minor})"
    else:
        visible = "no GPU visible"
    if info.get("native", "").startswith("none"):
        return f"no native library (CUDA kernels: not built); {visible}: the ops run PyTorch's own ops"
    record = _build.read_record(_build.PACKAGE) or {}
    # the build's own list (it says +PTX) when the loaded _C is the package's, else what the library records
    mine = info.get("native") == "ffn_ext._C"
    archs = (record.get("cuda_archs") if mine else None) or info.get("cuda_archs") or ""
    built = f"built for {_build.arch_names(archs)}" if archs else "built"
    if info.get("cuda_kernels") == "yes":
        kernels = f"CUDA kernels: {built}"
        if not gpu:
            runs = "the ops run PyTorch's CPU ops"
        elif archs and f"sm_{major}{minor}" not in _build.arch_names(archs) and "+PTX" not in archs:
            runs = f"not built for its sm_{major}{minor}: rebuild with TORCH_CUDA_ARCH_LIST={major}.{minor}"
        else:
            runs = "CUDA tensors run ffn_ext's kernels, CPU tensors PyTorch's CPU ops"
    else:
        off = info.get("cuda_kernels_off", "")
        if cuda_library_path().is_file():
            kernels = f"CUDA kernels: {built}, not loaded ({off})"
        else:
            kernels = "CUDA kernels: not built"
        runs = "the ops run PyTorch's own ops (ATen) on every device" if gpu else "the ops run PyTorch's CPU ops"
    return f"{kernels}; {visible}: {runs}"
