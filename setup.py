"""Builds ffn_ext._C: a CUDAExtension when a CUDA build of torch and nvcc are present, else a CppExtension.

    pip install torch ninja                   # first: ffn_ext compiles against the torch it will run with
    pip install --no-build-isolation .        (or -e . for development; python -m build --no-isolation for dists)

The binary loads only with the torch it was compiled against, so the build uses the environment's torch: plain
`pip install .` (build isolation) stops at once with a message saying this, instead of building against another
torch in pip's throwaway environment. The wheel requires exactly the torch version it was built against.

Environment: FFN_EXT_FORCE_CPU=1 builds CPU-only; TORCH_CUDA_ARCH_LIST picks the GPU architectures (default
"8.0;9.0+PTX"); MAX_JOBS limits parallel compile jobs. Sources and flags: csrc/build.json. Making an sdist
(`setup.py sdist`, `python -m build --sdist`) needs no torch.
"""

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import setuptools
from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("ffn_ext_build", ROOT / "ffn_ext" / "_build.py")
build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build)

# Commands that compile (or fix the wheel's metadata, which pins torch): they need torch. sdist and egg_info
# (pip's get_requires hooks) do not.
_BUILD_COMMANDS = {"build", "build_ext", "bdist_wheel", "bdist", "dist_info", "editable_wheel", "develop", "install"}
needs_torch = any(arg in _BUILD_COMMANDS for arg in sys.argv[1:])

ISOLATION_MESSAGE = """
ffn_ext: {what}
ffn_ext's compiled library loads only with the torch it is compiled against, so it is built against the torch of
the environment it will run in, which pip's build isolation hides (the throwaway build environment has no torch,
on purpose: with one, pip would build against a torch you do not run and the install could not load).
Install torch first (and ninja for a parallel build), then build without isolation:

    pip install torch ninja
    pip install --no-build-isolation .                 # from a checkout or an unpacked sdist
    pip install --no-build-isolation ffn_ext-*.tar.gz  # from an sdist
    python -m build --no-isolation                     # sdist + wheel (needs `pip install build`)
"""


class BuildPyWithSources(build_py):
    """Also copies the C++/CUDA sources (csrc/**, CMakeLists.txt) into the package as ffn_ext/_src, so that
    ffn_ext.jit can build from an installed package. The list is _build.shipped_files: no second list here."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install runs from the checkout, which has csrc/
        dest = Path(self.build_lib) / "ffn_ext" / "_src"
        for rel in build.shipped_files(ROOT):
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ROOT / rel, target)

    def get_outputs(self, include_bytecode=True):
        dest = Path(self.build_lib) / "ffn_ext" / "_src"
        return super().get_outputs(include_bytecode) + [str(dest / rel) for rel in build.shipped_files(ROOT)]


# Under --no-build-isolation pip does not check pyproject.toml's build requirements, and an older setuptools fails
# on the file itself with a schema message that names neither setuptools nor its version.
# (A setuptools without its metadata reports 0.dev0+unknown: not known to be old, so not refused.)
_setuptools_major = setuptools.__version__.split(".")[0]
if _setuptools_major.isdigit() and 0 < int(_setuptools_major) < build.MIN_SETUPTOOLS:
    sys.exit(
        f"ffn_ext: building needs setuptools>={build.MIN_SETUPTOOLS} (pyproject.toml's SPDX `license`), this "
        f"environment has setuptools {setuptools.__version__}: pip install -U 'setuptools>={build.MIN_SETUPTOOLS}'"
    )

cmdclass = {"build_py": BuildPyWithSources}
ext_modules = []
install_requires = [f"torch>={'.'.join(map(str, build.MIN_TORCH))}"]  # an sdist's; a wheel pins its own below

if needs_torch:
    if importlib.util.find_spec("torch") is None:
        sys.exit(
            ISOLATION_MESSAGE.format(
                what="torch is not importable in this build environment (with plain `pip "
                "install .` or `python -m build`: pip's isolated one)."
            )
        )
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    too_old = build.too_old(torch.__version__)
    if too_old:
        sys.exit(too_old)

    if "pip-build-env" in str(Path(torch.__file__).resolve()):
        sys.exit(
            ISOLATION_MESSAGE.format(
                what=f"torch comes from pip's isolated build environment "
                f"({Path(torch.__file__).parent}), not from yours."
            )
        )

    if build.write_ops_table(ROOT):  # the C++ op table, from ffn_ext/table.py (not in git)
        print(f"ffn_ext: wrote {build.OPS_TABLE} from ffn_ext/table.py", flush=True)
    torch_version = build.torch_base_version(torch.__version__)
    install_requires = [f"torch=={torch_version}"]  # the binary loads only with this torch
    with_cuda, why = build.decide_cuda()
    sources, flags = build.sources_and_flags(with_cuda, python_module=True, root=ROOT)
    sources = [os.path.relpath(s, ROOT) for s in sources]
    # -g0: Python's CFLAGS carry -g, which made _C 26 MB of debug info (the CMake build, without it, is 4 MB).
    cxx = flags["cxx"] + ["-g0"]
    if with_cuda:
        archs = build.default_arch_list(build.config(ROOT))
        banner = f"ffn_ext: building the CUDA extension for TORCH_CUDA_ARCH_LIST={archs}: {why}"
        ext = CUDAExtension("ffn_ext._C", sources, extra_compile_args={"cxx": cxx, "nvcc": flags["nvcc"]})
    else:
        banner = f"ffn_ext: building the CPU-only extension (no CUDA kernels): {why}"
        ext = CppExtension("ffn_ext._C", sources, extra_compile_args={"cxx": cxx})
    ext_modules = [ext]

    class BuildExt(BuildExtension):
        """Says once what it builds, and leaves the build record (_build.RECORD) next to _C."""

        def run(self):
            print(banner, flush=True)
            super().run()
            for path in self._records():
                path.write_text(json.dumps(build.build_record(with_cuda, ROOT), indent=1) + "\n")

        def _records(self):
            return [Path(self.get_ext_fullpath(e.name)).with_name(build.RECORD) for e in self.extensions]

        def get_outputs(self):
            return super().get_outputs() + [str(p) for p in self._records()]

    cmdclass["build_ext"] = BuildExt

setup(ext_modules=ext_modules, cmdclass=cmdclass, install_requires=install_requires)
