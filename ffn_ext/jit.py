"""Build and load the native library from the csrc/ sources with torch.utils.cpp_extension.load.

For source checkouts without an install. The sources and flags are the ones setup.py and CMake use
(csrc/build.json). One process can hold only one registration of the ffn_ext namespace: if the installed
ffn_ext._C is loaded, set FFN_EXT_NO_C=1 before importing ffn_ext, or run the JIT build in another process.
"""
from __future__ import annotations

from . import _build, ops


def load(verbose: bool = False, with_cuda: bool | None = None, build_directory: str | None = None,
         name: str = "ffn_ext_jit"):
    """Compiles (cached by torch in build_directory or its default extension dir) and loads the library, then
    makes it ffn_ext's backend. with_cuda=None decides as setup.py does. Returns the loaded module."""
    from torch.utils import cpp_extension

    if ops._native is not None:
        raise RuntimeError(
            f"ffn_ext.jit.load: the ffn_ext ops are already registered in this process by {ops._native_source}; a "
            f"second build of the same namespace cannot load here. Set {ops.NO_C_ENV}=1 before importing ffn_ext, "
            "or run the JIT build in a separate process."
        )
    if with_cuda is None:
        with_cuda, why = _build.decide_cuda()
        if verbose:
            print(f"ffn_ext.jit: CUDA kernels {'on' if with_cuda else 'off'}: {why}")
    if with_cuda:
        _build.default_arch_list(_build.config())
    sources, flags = _build.sources_and_flags(with_cuda, python_module=True)
    module = cpp_extension.load(
        name=name,
        sources=sources,
        extra_cflags=flags["cxx"],
        extra_cuda_cflags=flags["nvcc"],
        with_cuda=with_cuda,
        build_directory=build_directory,
        verbose=verbose,
    )
    ops._adopt(module, "jit")
    return module
