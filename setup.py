"""Builds ffn_ext on torch's stable ABI (TORCH_TARGET_VERSION 2.10, docs/internals/stable-abi.md): ffn_ext._C
(pybind11, per Python: the schemas, no kernels) and, when a CUDA build of torch and nvcc are present, the plain
shared library ffn_ext/lib/libffn_ext_cuda.so (the CUDA kernels; loaded on demand by ffn_ext/_loader.py).

    pip install .                             (isolated: pip fetches a torch >= 2.10 to build with)
    pip install torch ninja
    pip install --no-build-isolation .        (offline, with your torch; -e . for development)

Both binaries load under any torch >= 2.10 (the CUDA library only under a torch of its CUDA major): which torch the
build saw decides only the CUDA major of the CUDA kernels.

Environment: FFN_EXT_FORCE_CPU=1 builds CPU-only; CUDA_HOME names the CUDA toolkit (unset: the toolkit that the nvcc
on PATH runs, else /usr/local/cuda; one without its headers stops the build before it compiles: _build.find_cuda_home);
TORCH_CUDA_ARCH_LIST picks the GPU architectures (unset: the visible GPU's, else "8.0;9.0+PTX": _build.choose_archs);
MAX_JOBS limits parallel compile jobs; FFN_EXT_PREBUILT=1 makes a wheel of an in-place build's binaries (.ci/wheel). Sources and flags: csrc/build.json. Making an sdist
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
ffn_ext is compiled against torch's headers (stable ABI: the result serves every torch from 2.10 on). pip's
isolated build installs torch itself (pyproject.toml); this build environment has none. Install torch first (and
ninja for a parallel build), then build without isolation:

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
install_requires = [f"torch>={'.'.join(map(str, build.MIN_TORCH))}"]  # stable ABI: any torch from the 2.10 target on

if needs_torch:
    if importlib.util.find_spec("torch") is None:
        sys.exit(ISOLATION_MESSAGE.format(what="torch is not importable in this build environment."))
    import torch

    too_old = build.too_old(torch.__version__)
    if too_old:
        sys.exit(too_old)
    # FFN_EXT_PREBUILT=1 (.ci/wheel): the wheel takes the binaries an in-place build left (same sources, checked)
    # instead of compiling them a second time; no toolkit is needed then.
    prebuilt = os.environ.get(build.PREBUILT_ENV, "0") not in ("", "0")
    # Before torch.utils.cpp_extension is imported: that import takes its CUDA_HOME (and logs it), which
    # decide_cuda sets to the toolkit it found; a toolkit that cannot compile stops the build here, not in ninja.
    try:
        if prebuilt:
            try:
                prebuilt_files, prebuilt_record = build.prebuilt_files(ROOT)
            except RuntimeError as e:
                sys.exit(str(e))
            with_cuda, why = bool(prebuilt_record.get("cuda_kernels")), "the in-place build's binaries"
        else:
            with_cuda, why = build.decide_cuda()
    except build.CudaToolkitError as e:
        sys.exit(str(e))
    from torch.utils.cpp_extension import BuildExtension

    if build.write_ops_table(ROOT):  # the C++ op table, from ffn_ext/table.py (not in git)
        print(f"ffn_ext: wrote {build.OPS_TABLE} from ffn_ext/table.py", flush=True)
    # Stable ABI (docs/internals/stable-abi.md): both binaries serve every torch >= the 2.10 target, so the
    # wheel requires torch>=2.10, not the build's torch; only the CUDA library is tied to one CUDA major.
    from torch.utils import cpp_extension

    torch_inc = cpp_extension.include_paths()[:1]  # torch/include: the stable headers need no other
    torch_lib = cpp_extension.library_paths()
    try:  # pip's pybind11 first; torch/include ships a copy otherwise
        import pybind11

        pybind_inc = [pybind11.get_include()]
    except ImportError:
        pybind_inc = []
    # -g0: Python's CFLAGS carry -g, which made _C 26 MB of debug info (the CMake build, without it, is 4 MB).
    srcs, flags, libs = build.python_target(ROOT)
    ext_modules = [
        setuptools.Extension(
            "ffn_ext._C",
            [os.path.relpath(x, ROOT) for x in srcs],
            include_dirs=[*pybind_inc, *torch_inc],
            library_dirs=torch_lib,
            libraries=libs,
            language="c++",
            extra_compile_args={"cxx": flags["cxx"] + ["-g0"]},
        )
    ]
    cuda_lib = build.cuda_library_relpath(ROOT)
    cuda_ext = cuda_lib.removesuffix(".so").replace("/", ".")
    if prebuilt:
        archs = prebuilt_record.get("cuda_archs")
        banner = f"ffn_ext: no compiling ({build.PREBUILT_ENV}=1): the wheel takes {', '.join(prebuilt_files)}"
    else:
        archs, archs_why = build.choose_archs(build.config(ROOT)) if with_cuda else (None, "")
        banner = "\n".join(build.build_plan(with_cuda, why, archs, archs_why, "_C"))
    if with_cuda:
        srcs, flags, libs = build.cuda_target(ROOT)
        cuda_home = cpp_extension.CUDA_HOME or ""  # (none needed with FFN_EXT_PREBUILT: nothing is compiled)
        cuda_lib_dirs = [d for d in (os.path.join(cuda_home, x) for x in ("lib64", "lib")) if os.path.isdir(d)]
        ext_modules.append(
            setuptools.Extension(
                cuda_ext,
                [os.path.relpath(x, ROOT) for x in srcs],
                include_dirs=[*torch_inc, os.path.join(cuda_home, "include")],
                library_dirs=[*torch_lib, *cuda_lib_dirs],
                libraries=libs,
                language="c++",
                extra_compile_args={"cxx": flags["cxx"] + ["-g0"], "nvcc": flags["nvcc"]},
            )
        )

    class BuildExt(BuildExtension):
        """Says once what it builds (seen with `pip install -v`: pip shows a build's output only then or on
        failure), names the CUDA library as a plain shared library (no Python ABI suffix: it is
        loaded with torch.ops.load_library), and leaves the build record (_build.RECORD) next to _C."""

        def get_ext_filename(self, fullname):
            if fullname == cuda_ext:
                return cuda_lib
            if fullname == cuda_ext.rpartition(".")[2]:
                return Path(cuda_lib).name
            return super().get_ext_filename(fullname)

        def get_ext_fullpath(self, ext_name):
            if ext_name == cuda_ext:  # next to _C's package dir, in place or in build_lib alike
                return str(Path(super().get_ext_fullpath("ffn_ext._C")).parent / Path(cuda_lib).relative_to("ffn_ext"))
            return super().get_ext_fullpath(ext_name)

        def run(self):
            print(banner, flush=True)
            if prebuilt:
                for rel in prebuilt_files:
                    target = Path(self.build_lib) / rel
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(ROOT / rel, target)
                return
            if with_cuda and self.inplace:  # the in-place copy does not create the folder
                (ROOT / cuda_lib).parent.mkdir(parents=True, exist_ok=True)
            if not with_cuda:  # a CUDA library an earlier build left would ship (from build/lib) and load
                (Path(self.build_lib) / cuda_lib).unlink(missing_ok=True)
                if self.inplace:  # an editable build's, in the checkout
                    (ROOT / cuda_lib).unlink(missing_ok=True)
            super().run()
            for path in self._records():
                path.write_text(json.dumps(build.build_record(with_cuda, ROOT, archs), indent=1) + "\n")

        def _records(self):
            return [Path(self.get_ext_fullpath("ffn_ext._C")).with_name(build.RECORD)]

        def get_outputs(self):
            if prebuilt:
                return [str(Path(self.build_lib) / rel) for rel in prebuilt_files]
            return super().get_outputs() + [str(p) for p in self._records()]

    cmdclass["build_ext"] = BuildExt

setup(ext_modules=ext_modules, cmdclass=cmdclass, install_requires=install_requires)
