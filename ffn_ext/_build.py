"""How ffn_ext is built: the shared source/flag list (csrc/build.json), where the sources are, the CUDA-or-not
decision, and the record a build leaves next to the library it made.

Used by setup.py (loaded by file path, before the package is installed) and by ffn_ext.jit. The decision never
looks at torch.cuda.is_available(): build machines often have a CUDA toolkit and no GPU.

Sources: in a checkout they are the repository's csrc/; an installed package (wheel or sdist build) carries a copy
under ffn_ext/_src/ (csrc/** and CMakeLists.txt, laid there by setup.py's build_py), so ffn_ext.jit works from an
install as from a checkout. Both layouts hold csrc/build.json with paths relative to that root.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
CHECKOUT = PACKAGE.parent  # the repository root when this is a checkout (or an sdist's unpacked tree)
SHIPPED = PACKAGE / "_src"  # the copy inside an installed package
FORCE_CPU_ENV = "FFN_EXT_FORCE_CPU"
RECORD = "_C_build.json"  # written next to _C by setup.py: torch version, CUDA, sources hash
MIN_TORCH = (2, 10)  # the oldest torch ffn_ext supports: setup.py and `import ffn_ext` refuse older ones
MIN_SETUPTOOLS = 77  # pyproject.toml's SPDX `license` string; older setuptools reject the file


def too_old(torch_version: str) -> str | None:
    """The error for a torch older than MIN_TORCH ('2.9.1+cu128'), else None."""
    match = re.match(r"(\d+)\.(\d+)", torch_version)
    if match is None or tuple(map(int, match.groups())) >= MIN_TORCH:
        return None
    need = ".".join(map(str, MIN_TORCH))
    return f"ffn_ext needs torch>={need}, this is torch {torch_version}: pip install -U 'torch>={need}'"


def source_root() -> Path:
    """The directory holding csrc/build.json: the checkout's root, else the package's shipped copy."""
    for root in (CHECKOUT, SHIPPED):
        if (root / "csrc" / "build.json").is_file():
            return root
    raise FileNotFoundError(
        f"ffn_ext: no C++/CUDA sources found: neither {CHECKOUT / 'csrc' / 'build.json'} (a source checkout) nor "
        f"{SHIPPED / 'csrc' / 'build.json'} (an installed package) exists. Reinstall ffn_ext from its sdist or a "
        "checkout (pip install --no-build-isolation ...) to get them."
    )


def config(root: Path | None = None) -> dict:
    with open((root or source_root()) / "csrc" / "build.json") as f:
        return json.load(f)


def shipped_files(root: Path) -> list[str]:
    """Files (relative to root) that make up the sources: what an installed package carries and what the sources
    hash covers. Every C++/CUDA file under csrc/ (headers included), build.json, and CMakeLists.txt / cmake/."""
    out = []
    for p in sorted((root / "csrc").rglob("*")):
        if p.is_file() and (p.suffix in (".h", ".cuh", ".hpp", ".cpp", ".cu") or p.name == "build.json"):
            out.append(p.relative_to(root).as_posix())
    cmake = (
        sorted(q.relative_to(root).as_posix() for q in (root / "cmake").glob("*")) if (root / "cmake").is_dir() else []
    )
    return out + [rel for rel in ["CMakeLists.txt", *cmake] if (root / rel).is_file()]


def sources_hash(root: Path | None = None) -> str:
    """sha256 over the C++/CUDA sources, headers and build.json (not the CMake files): equal hashes, same code."""
    root = root or source_root()
    h = hashlib.sha256()
    for rel in shipped_files(root):
        if rel.startswith("csrc/"):
            h.update(rel.encode() + b"\0" + (root / rel).read_bytes() + b"\0")
    return h.hexdigest()[:16]


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


def sources_and_flags(with_cuda: bool, python_module: bool, root: Path | None = None) -> tuple[list[str], dict]:
    """Absolute source paths and {'cxx': [...], 'nvcc': [...]} for one build."""
    root = root or source_root()
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


def torch_base_version(version: str) -> str:
    """'2.14.1+cu130' -> '2.14.1'."""
    return version.split("+")[0]


def build_record(with_cuda: bool, root: Path | None = None) -> dict:
    """What a build of _C records next to it (RECORD): read at import without loading the library, so that a _C
    built for another torch is named with both versions instead of failing to load with a linker message."""
    import torch

    return {
        "torch_version": torch_base_version(torch.__version__),
        "torch_cuda": torch.version.cuda,
        "cuda_kernels": bool(with_cuda),
        "sources_hash": sources_hash(root),
    }


def read_record(directory: Path) -> dict | None:
    try:
        return json.loads((Path(directory) / RECORD).read_text())
    except (OSError, ValueError):
        return None


def in_checkout() -> bool:
    """True when the package is imported from a source checkout (setup.py next to it)."""
    return (CHECKOUT / "setup.py").is_file() and (CHECKOUT / "csrc" / "build.json").is_file()


def rebuild_command() -> str:
    """The command that rebuilds _C against the torch in this environment, for messages."""
    if in_checkout():
        return f"cd {CHECKOUT} && pip install --no-build-isolation -e ."
    return (
        "pip install --no-build-isolation --no-binary ffn_ext --force-reinstall --no-deps ffn_ext "
        "(or, from its sdist or checkout: pip install --no-build-isolation <path>)"
    )


def shipped_files_abs(root: Path | None = None) -> list[str]:
    root = root or source_root()
    return [str(root / rel) for rel in shipped_files(root)]
