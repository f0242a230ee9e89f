"""The test-only extension ffn_ext_testing: the functions the tests run on the host in place of the CUDA kernels,
compiled from ffn_ext's own headers. They are not part of ffn_ext (its _C and its wheel carry none of them):

  _host_math(op, inputs, params=[])       every op's element math (csrc/ffn_math.h's functors), element by element
  _host_fp8(x, format), _host_quant_scale(amax, fp8_max, pow2)   ffn_math.h's FP8 conversion and group scale
  _emulate_cuda(op, inputs, sms=132, params=[], layout="concat")  a row op's whole CUDA launch emulated on the host
  _emulate_quant(op, inputs, params, layout, format, ...)         a quantizing op's CUDA launches emulated
  _emulate_cache(op, inputs, params, group_size)                   an FP8 cache op's CUDA launch emulated

testing() returns the module, building it first when it is missing or older than its sources (tests/csrc/*, the
headers under ffn_ext's csrc/); a build that fails raises with the compiler's output, so that a test needing it
fails rather than skips. It is a CPU extension (host code only) built with torch.utils.cpp_extension against the
torch in use, into <tests' parent>/build/ffn_ext_testing/<python and torch version>/ (gitignored), one build per
environment. `.ci/env` builds it once before the tests run (python tests/native.py --if-stale); a test run that
finds it stale rebuilds it (one process builds, the others wait for it).

The headers are those of the ffn_ext under test (ffn_ext._build.source_root(): the checkout's csrc/, or the copy
an installed package carries), so the host code matches the kernels of the _C being tested. The emulations compile
the CUDA library's glue (row_ops.h, quant_ops.h, shapes.cpp, quant_recipe.cpp) as that library does: on torch's
stable API at ffn_ext's TORCH_TARGET_VERSION (ffn_ext/_build.py), in translation units of their own
(tests/csrc/testing.h); the module itself is on the full API (pybind11's tensor casters).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import re
import sys
import time
from pathlib import Path
from types import ModuleType

NAME = "ffn_ext_testing"
HERE = Path(__file__).resolve().parent
SOURCES = HERE / "csrc"  # module.cpp, emulate_rows.cpp, emulate_quant.cpp and what they include
# module.cpp: the pybind11 module and host math on the full torch API; emulate_*.cpp: the CUDA ops' glue on the
# stable API (tests/csrc/testing.h). emulate_rows.cpp is the largest job (its every-op instantiations).
TRANSLATION_UNITS = ("module.cpp", "emulate_rows.cpp", "emulate_quant.cpp")
CXX_FLAGS = ["-O3", "-g0", "-fvisibility=hidden"]  # hidden: its copies of the library's functions stay its own

_module: ModuleType | None = None


def build_directory() -> Path:
    """Where the extension is built: per Python and torch version (each environment its own build)."""
    tag = f"{sys.implementation.cache_tag}-torch{importlib.metadata.version('torch')}"
    return HERE.parent / "build" / NAME / re.sub(r"[^A-Za-z0-9.+_-]", "_", tag)


def _library(directory: Path) -> Path | None:
    found = sorted(directory.glob(f"{NAME}*.so"))
    return found[0] if found else None


def is_stale() -> bool:
    """True when the built extension is missing or older than a file it is compiled from (a cheap check, without
    torch: the build itself, ninja, knows exactly)."""
    lib = _library(build_directory())
    if lib is None:
        return True
    built = lib.stat().st_mtime
    roots = [SOURCES, _headers()]
    return any(p.is_file() and p.stat().st_mtime > built for root in roots for p in root.rglob("*"))


def _headers() -> Path:
    """csrc/ of the ffn_ext under test: a checkout's, or the copy an installed package carries."""
    return _build_module().source_root() / "csrc"


def _target_flag() -> str:
    """The stable translation units' target version: ffn_ext's own (_build.TORCH_TARGET_VERSION, build.json's
    -DTORCH_TARGET_VERSION), under a name of its own that tests/csrc/stable_target.h turns into TORCH_TARGET_VERSION
    there only (module.cpp is on the full API, which refuses it)."""
    return f"-DFFN_EXT_TESTING_TARGET_VERSION={_build_module().TORCH_TARGET_VERSION}"


def _build_module() -> ModuleType:
    """ffn_ext/_build.py of the ffn_ext under test, loaded by its path: importing the package would import torch."""
    import importlib.util

    spec = importlib.util.find_spec("ffn_ext")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"{NAME}: ffn_ext is not importable: its headers are needed to build {NAME}")
    path = Path(list(spec.submodule_search_locations)[0]) / "_build.py"
    bspec = importlib.util.spec_from_file_location("_ffn_ext_build_for_tests", path)
    assert bspec is not None and bspec.loader is not None
    mod = importlib.util.module_from_spec(bspec)
    bspec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def _exclusive(directory: Path):
    """One process at a time builds (pytest-xdist workers start together). An flock, which the system drops if
    its holder dies; then torch's own lock file, which a killed build would leave behind, is removed."""
    import fcntl

    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".build-lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            (directory / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build(verbose: bool = False) -> ModuleType:
    """Builds (when needed: ninja decides, headers included) and loads the extension."""
    from torch.utils import cpp_extension

    directory = build_directory()
    headers = _headers()
    with _exclusive(directory):
        try:
            return cpp_extension.load(
                name=NAME,
                sources=[str(SOURCES / tu) for tu in TRANSLATION_UNITS],
                extra_cflags=[*CXX_FLAGS, _target_flag()],
                extra_include_paths=[str(SOURCES), str(headers)],
                build_directory=str(directory),
                with_cuda=False,
                verbose=verbose,
            )
        except Exception as e:
            raise RuntimeError(
                f"{NAME}, the tests' host-code extension (tests/native.py), did not build in {directory} from "
                f"{SOURCES} and {headers}: {e}"
            ) from e


def testing() -> ModuleType:
    """The extension, built first if needed (module docstring)."""
    global _module
    if _module is None:
        _module = build()
    return _module


def main(argv: list[str]) -> int:
    """python tests/native.py [--if-stale] [--verbose]: builds the extension (with --if-stale: only when missing
    or older than its sources) and says how long it took."""
    if "--if-stale" in argv and not is_stale():
        return 0
    print(f"{NAME}: building the tests' host-code extension into {build_directory()}", file=sys.stderr, flush=True)
    start = time.time()
    mod = build(verbose="--verbose" in argv)
    assert callable(mod._host_math) and callable(mod._emulate_cuda), mod
    print(f"{NAME}: built in {time.time() - start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
