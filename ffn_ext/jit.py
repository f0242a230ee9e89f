"""Build and load the native library from the C++/CUDA sources with torch.utils.cpp_extension.load.

Two binaries, as setup.py builds them (stable ABI, docs/internals/stable-abi.md): the module _C (pybind11, the
schemas), then, with CUDA, the CUDA library (a plain shared library, is_python_module=False, loaded with
torch.ops.load_library); the CPU kernels, fake kernels and autograd are the package's Python, registered when the
module is adopted. Works from a checkout (csrc/) and from an installed package (the copy under ffn_ext/_src that
setup.py ships), with the sources and flags setup.py and CMake use (csrc/build.json). One process can hold only one registration of the
ffn_ext namespace: when ops are loaded already, load() returns them if they were built from these same sources
(ffn_ext._C, or an earlier load()), and otherwise says why it cannot load a second build.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

from . import _build, _loader, ops


def _say(line: str) -> None:
    print(f"ffn_ext.jit: {line}", file=sys.stderr, flush=True)


def _loaded_matches(with_cuda: bool | None) -> tuple[bool, str]:
    """(the loaded native library serves this request?, why not)."""
    native, source = ops._native, ops._native_source
    built = getattr(native, "_ffn_ext_sources_hash", None)
    if source == "ffn_ext._C":
        record = _build.read_record(Path(native.__file__).parent) or {}
        built = record.get("sources_hash")
        if built is None:
            return (
                False,
                f"ffn_ext._C ({native.__file__}) has no build record ({_build.RECORD}) to compare sources with",
            )
    if built is None:
        return False, f"the ops were registered by {source}, whose sources are unknown"
    here = _build.sources_hash()
    if built != here:
        return False, f"{source} was built from other sources (hash {built}; {_build.source_root()}/csrc: {here})"
    has_cuda = ops.has_cuda_kernels()  # _C's CUDA kernels are the CUDA library the loader loaded (or not)
    if with_cuda is not None and bool(with_cuda) != has_cuda:
        return False, f"{source} was built {'with' if has_cuda else 'without'} the CUDA kernels; with_cuda={with_cuda}"
    return True, ""


def load(
    verbose: bool = False, with_cuda: bool | None = None, build_directory: str | None = None, name: str = "ffn_ext_jit"
) -> ModuleType:
    """Compiles (cached by torch in build_directory or its default extension dir) and loads the library, then
    makes it ffn_ext's backend. with_cuda=None decides as setup.py does. Returns the loaded module.

    A first build prints what it builds, with which CUDA toolkit, for which GPU architectures (as setup.py:
    TORCH_CUDA_ARCH_LIST, else the visible GPU's, else the project default), roughly how long it takes and where it
    is cached, and one line when it is done; verbose=True shows the compiler's output too. It needs ninja
    (`pip install ninja`), as torch.utils.cpp_extension.load does.

    The CUDA toolkit is found as setup.py finds it (_build.find_cuda_home: CUDA_HOME, else the toolkit that the nvcc
    on PATH runs, else /usr/local/cuda), and CUDA_HOME is set to it for this process; one that cannot compile raises
    _build.CudaToolkitError (a RuntimeError) before anything is compiled."""
    if ops._native_source == "python":  # the ops ffn_ext defined itself, without a native library: replaced
        ops._undefine_here()
    if ops._native is not None:
        ok, why = _loaded_matches(with_cuda)
        if ok:
            return ops._native
        raise RuntimeError(
            f"ffn_ext.jit.load: the ffn_ext ops are already registered in this process by {ops._native_source}, "
            f"and they cannot serve this request: {why}. One process holds one registration of the ffn_ext "
            f"namespace: set {ops.NO_C_ENV}=1 before importing ffn_ext (then load() builds and uses the JIT "
            "library), or run the JIT build in a separate process."
        )
    if with_cuda is None:
        with_cuda, why = _build.decide_cuda()
    elif with_cuda:
        home, how = _build.cuda_toolkit()
        why = f"with_cuda=True; the CUDA toolkit in {home} ({how})"
    else:
        why = "with_cuda=False"
    from torch.utils import cpp_extension  # after the toolkit is chosen: its import logs the CUDA_HOME it takes

    root = _build.source_root()
    archs, archs_why = _build.choose_archs(_build.config(root)) if with_cuda else (None, "")
    _build.write_ops_table(root)  # a checkout's C++ op table, from table.py (an install ships it)
    py_sources, py_flags, _ = _build.python_target(root)
    cuda_sources, cuda_flags, _ = _build.cuda_target(root) if with_cuda else ([], {}, [])
    directory = Path(build_directory or cpp_extension._get_build_directory(name, verbose))
    cuda_name = f"{name}_cuda"
    cuda_directory = directory / "cuda"  # its own build.ninja: one per cpp_extension.load
    outputs = [directory / f"{name}.so"] + ([cuda_directory / f"{cuda_name}.so"] if with_cuda else [])
    newest = max(os.path.getmtime(s) for s in _build.shipped_files_abs(root) if "csrc" in s)
    fresh = any(not p.exists() or p.stat().st_mtime < newest for p in outputs)
    if fresh or verbose:
        what = f"_C ({len(py_sources) + len(cuda_sources)} files from {root / 'csrc'})"
        for line in _build.build_plan(with_cuda, why, archs, archs_why, what):
            _say(line.removeprefix("ffn_ext: "))
        _say(f"cached in {directory}" + ("" if verbose else " (verbose=True shows the compiler)"))
    start = time.time()
    # The stable-ABI flags of build.json (-DTORCH_TARGET_VERSION, hidden visibility). cpp_extension.load also links
    # -ltorch_python -lc10 -ltorch (in NEEDED, no symbol used: nm -D shows only the shim's C functions).
    module = cpp_extension.load(
        name=name,
        sources=py_sources,
        extra_cflags=py_flags["cxx"],
        with_cuda=False,
        build_directory=str(directory),
        verbose=verbose,
    )
    cuda_info: dict = {}
    if with_cuda:
        cuda_directory.mkdir(parents=True, exist_ok=True)
        library = cpp_extension.load(
            name=cuda_name,
            sources=cuda_sources,
            extra_cflags=cuda_flags["cxx"],
            extra_cuda_cflags=cuda_flags["nvcc"],
            with_cuda=True,
            is_python_module=False,
            build_directory=str(cuda_directory),
            verbose=verbose,
        )
        # load() has loaded it with torch.ops.load_library (the CUDA kernels register before ffn_ext's Python
        # kernels, which serve CUDA tensors only without them)
        library = str(library or cuda_directory / f"{cuda_name}.so")
        if os.path.realpath(library) not in torch.ops.loaded_libraries:
            torch.ops.load_library(library)
        built = _loader._built_cuda_info(Path(library))
        cuda_info = {"cuda_kernels": "yes", **{k: v for k, v in built.items() if k.startswith("cuda_")}}
    if fresh and not verbose:
        _say(f"built and loaded in {time.time() - start:.0f} s: {getattr(module, '__file__', outputs[0])}")
    _describe(module, cuda_info)
    module._ffn_ext_sources_hash = _build.sources_hash(root)
    ops._adopt(module, "jit")
    return module


def _describe(module: ModuleType, cuda_info: dict) -> None:
    """The JIT _C's build_info() with the CUDA library's part (_C itself has no CUDA kernels)."""
    own = module.build_info

    def build_info() -> dict:
        info = dict(own())
        info.update(cuda_info)
        return info

    build_info.__doc__ = own.__doc__
    module.build_info = build_info  # type: ignore[attr-defined]  # the compiled module's, wrapped
