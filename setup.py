"""Builds ffn_ext._C: a CUDAExtension when a CUDA build of torch and nvcc are present, else a CppExtension.

    pip install --no-build-isolation .        (or -e . for development)

Environment: FFN_EXT_FORCE_CPU=1 builds CPU-only; TORCH_CUDA_ARCH_LIST picks the GPU architectures (default
"8.0;9.0+PTX"); MAX_JOBS limits parallel compile jobs. Sources and flags: csrc/build.json.
"""
import importlib.util
import os
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("ffn_ext_build", ROOT / "ffn_ext" / "_build.py")
build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build)

from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

with_cuda, why = build.decide_cuda()
sources, flags = build.sources_and_flags(with_cuda, python_module=True)
sources = [os.path.relpath(s, ROOT) for s in sources]
if with_cuda:
    archs = build.default_arch_list(build.config())
    print(f"ffn_ext: building the CUDA extension for TORCH_CUDA_ARCH_LIST={archs}: {why}", flush=True)
    ext = CUDAExtension("ffn_ext._C", sources, extra_compile_args=flags)
else:
    print(f"ffn_ext: building the CPU-only extension (no CUDA kernels): {why}", flush=True)
    ext = CppExtension("ffn_ext._C", sources, extra_compile_args={"cxx": flags["cxx"]})

setup(ext_modules=[ext], cmdclass={"build_ext": BuildExtension})
