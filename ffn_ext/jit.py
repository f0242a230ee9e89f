"""Build and load the native library from the C++/CUDA sources with torch.utils.cpp_extension.load.

Works from a checkout (csrc/) and from an installed package (the copy under ffn_ext/_src that setup.py ships), with
the sources and flags setup.py and CMake use (csrc/build.json). One process can hold only one registration of the
ffn_ext namespace: when ops are loaded already, load() returns them if they were built from these same sources
(ffn_ext._C, or an earlier load()), and otherwise says why it cannot load a second build.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from types import ModuleType

from . import _build, ops


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
    has_cuda = native.build_info().get("cuda_kernels") == "yes"
    if with_cuda is not None and bool(with_cuda) != has_cuda:
        return False, f"{source} was built {'with' if has_cuda else 'without'} the CUDA kernels; with_cuda={with_cuda}"
    return True, ""


def load(
    verbose: bool = False, with_cuda: bool | None = None, build_directory: str | None = None, name: str = "ffn_ext_jit"
) -> ModuleType:
    """Compiles (cached by torch in build_directory or its default extension dir) and loads the library, then
    makes it ffn_ext's backend. with_cuda=None decides as setup.py does. Returns the loaded module.

    A first build prints one line when it starts (what, for which GPU architectures, roughly how long, where it is
    cached) and one when it is done; verbose=True shows the compiler's output too."""
    from torch.utils import cpp_extension

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
        if verbose:
            _say(f"CUDA kernels {'on' if with_cuda else 'off'}: {why}")
    archs = _build.default_arch_list(_build.config()) if with_cuda else None
    _build.write_ops_table(_build.source_root())  # a checkout's C++ op table, from table.py (an install ships it)
    sources, flags = _build.sources_and_flags(with_cuda, python_module=True)
    directory = Path(build_directory or cpp_extension._get_build_directory(name, verbose))
    library = directory / f"{name}.so"
    newest = max(os.path.getmtime(s) for s in [*sources, *_build.shipped_files_abs()] if "csrc" in s)
    fresh = not library.exists() or library.stat().st_mtime < newest
    if fresh and not verbose:
        what = (
            f"the CUDA kernels for TORCH_CUDA_ARCH_LIST={archs} (a few minutes; about 3.5 on 2 cores)"
            if with_cuda
            else "the CPU kernels (no CUDA; 1-2 minutes on 2 cores)"
        )
        _say(
            f"compiling {len(sources)} files from {_build.source_root() / 'csrc'}: {what}; cached in {directory} "
            "(verbose=True shows the compiler)"
        )
    start = time.time()
    module = cpp_extension.load(
        name=name,
        sources=sources,
        extra_cflags=flags["cxx"],
        extra_cuda_cflags=flags["nvcc"],
        with_cuda=with_cuda,
        build_directory=str(directory),
        verbose=verbose,
    )
    if fresh and not verbose:
        _say(f"built and loaded in {time.time() - start:.0f} s: {getattr(module, '__file__', library)}")
    module._ffn_ext_sources_hash = _build.sources_hash()
    ops._adopt(module, "jit")
    return module
