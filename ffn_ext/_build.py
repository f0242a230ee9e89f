"""How ffn_ext is built: the shared source/flag list (csrc/build.json) and the CUDA-or-not decision.

Used by setup.py (loaded by file path, before the package is installed) and by ffn_ext.jit. The decision never
looks at torch.cuda.is_available(): build machines often have a CUDA toolkit and no GPU.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORCE_CPU_ENV = "FFN_EXT_FORCE_CPU"


def config(root: Path = ROOT) -> dict:
    with open(root / "csrc" / "build.json") as f:
        return json.load(f)


def decide_cuda() -> tuple[bool, str]:
    """(build CUDA kernels?, why). Needs a CUDA build of torch and a CUDA toolkit (nvcc)."""
    import torch
    from torch.utils import cpp_extension

    if os.environ.get(FORCE_CPU_ENV, "0") not in ("", "0"):
        return False, f"{FORCE_CPU_ENV} is set"
    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} is a CPU-only build"
    if cpp_extension.CUDA_HOME is None:
        return False, "no CUDA toolkit found (set CUDA_HOME to the directory holding bin/nvcc)"
    nvcc = Path(cpp_extension.CUDA_HOME) / "bin" / "nvcc"
    if not nvcc.exists():
        return False, f"CUDA_HOME={cpp_extension.CUDA_HOME} has no bin/nvcc"
    return True, f"torch {torch.__version__} (CUDA {torch.version.cuda}) and nvcc in {cpp_extension.CUDA_HOME}"


def default_arch_list(cfg: dict) -> str:
    """Sets TORCH_CUDA_ARCH_LIST to the project default when the user has not chosen (torch would otherwise build
    for the local GPU, or for every architecture when there is none). Returns the list in force."""
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", cfg["default_cuda_archs"])
    return os.environ["TORCH_CUDA_ARCH_LIST"]


def sources_and_flags(with_cuda: bool, python_module: bool, root: Path = ROOT) -> tuple[list[str], dict]:
    """Absolute source paths and {'cxx': [...], 'nvcc': [...]} for one build."""
    cfg = config(root)
    srcs = list(cfg["library_sources"])
    if python_module:
        srcs += cfg["python_sources"]
    cxx = list(cfg["cxx_flags"])
    nvcc = list(cfg["nvcc_flags"])
    if with_cuda:
        srcs += cfg["cuda_sources"]
        define = "-D" + cfg["cuda_define"]
        cxx.append(define)
        nvcc.append(define)
    return [str(root / s) for s in srcs], {"cxx": cxx, "nvcc": nvcc}
