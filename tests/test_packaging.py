"""Packaging off the happy path: what the sdist holds, what the wheel requires, plain `pip install .`
stopping at once with the command to run, a _C built for another torch named at import, the sources an install
ships for ffn_ext.jit, the public C++ header covering the table, and an installed CUDA build's kernels loading
under its CUDA major only. CI's packaging stage (.ci/packaging) installs the sdist and the CUDA wheel into clean venvs
and runs these tests from outside the tree (the wheel's under three torches).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch
from conftest import HANG_GUARD_S, needs_source_tree

import ffn_ext
from ffn_ext import _build, _loader, table
from ffn_ext.table import OPS


def _setup_py(root: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "setup.py", *args],
        cwd=root,
        env=env or dict(os.environ),
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )


def test_sdist_holds_every_tracked_file(tmp_path):
    """The sdist (no torch needed to make it) has every file git tracks except CI's own, and no binaries: a build
    from it, `python -m build` included, finds csrc/build.json, the headers, CMakeLists.txt and the tests."""
    root = needs_source_tree("the sdist check")
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("needs git and the checkout's .git")
    tracked = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout.split()
    # untracked new files (a session's work in progress) are not expected in it, only what git knows and exists
    want = {f for f in tracked if not f.startswith(".ci/") and f != ".gitignore" and (root / f).is_file()}
    code = (
        "import sys; sys.modules['torch'] = None  # an sdist must not need torch\n"
        "from setuptools import build_meta as b; print(b.build_sdist(sys.argv[1]))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], cwd=root, capture_output=True, text=True, timeout=HANG_GUARD_S
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    name = r.stdout.strip().splitlines()[-1]
    with tarfile.open(tmp_path / name) as tar:
        members = {m.name.split("/", 1)[1] for m in tar.getmembers() if m.isfile() and "/" in m.name}
    missing = sorted(want - members)
    assert not missing, f"tracked files missing from the sdist (MANIFEST.in): {missing}"
    assert not [m for m in members if m.endswith((".so", ".o", ".pyc"))], sorted(members)
    assert "LICENSE" in members and "csrc/include/ffn_ext/ops.h" in members


def test_wheel_requires_any_supported_torch(tmp_path):
    """A wheel, like the sdist, accepts every torch from the minimum on: its binaries are built on torch's stable ABI
    at that target, so they load under any later torch (the CUDA library under one of its CUDA major)."""
    root = needs_source_tree("setup.py")
    need = ".".join(map(str, _build.MIN_TORCH))
    r = _setup_py(root, "-q", "dist_info", "--output-dir", str(tmp_path))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (meta,) = tmp_path.glob("*.dist-info/METADATA")
    requires = re.findall(r"^Requires-Dist: (torch\S*)\s*$", meta.read_text(), re.M)
    assert requires == [f"torch>={need}"], requires
    assert re.search(r"^License-Expression: Apache-2.0$", meta.read_text(), re.M)
    pkg_info = root / "ffn_ext.egg-info" / "PKG-INFO"
    r = _setup_py(root, "-q", "egg_info")
    assert r.returncode == 0 and f"Requires-Dist: torch>={need}" in pkg_info.read_text(), r.stderr[-2000:]


def test_isolated_build_stops_at_once_with_the_command(tmp_path):
    """A build environment without torch (pip's isolated one installs it from pyproject.toml; a hand-made one may
    not): setup.py stops in seconds, printing the command to run, and makes no build directory."""
    root = needs_source_tree("setup.py")
    import setuptools

    shim = tmp_path / "site"
    shim.mkdir()
    site = Path(setuptools.__file__).resolve().parent.parent
    for name in ("setuptools", "_distutils_hack", "pkg_resources"):
        if (site / name).exists():
            (shim / name).symlink_to(site / name)
    env = dict(os.environ, PYTHONPATH=str(shim), SETUPTOOLS_USE_DISTUTILS="local")
    r = subprocess.run(
        [sys.executable, "-S", "setup.py", "dist_info", "--output-dir", str(tmp_path / "out")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert r.returncode != 0, r.stdout[-2000:]
    msg = r.stderr
    assert "torch is not importable" in msg and "pip install --no-build-isolation ." in msg, msg[-3000:]
    assert "Traceback" not in msg, msg[-3000:]


def test_an_old_setuptools_gets_a_clear_message(tmp_path):
    """Under --no-build-isolation pip does not check pyproject.toml's setuptools>=77; setup.py names the setuptools
    it finds and the command (setuptools 65, a Python 3.11 venv's, failed on pyproject's SPDX license with a schema
    dump). Here a stand-in setuptools reporting 65.5.0."""
    root = needs_source_tree("setup.py")
    fake = tmp_path / "setuptools"
    (fake / "command").mkdir(parents=True)
    (fake / "__init__.py").write_text(
        '__version__ = "65.5.0"\ndef setup(**kw):\n    raise SystemExit("reached setup()")\n'
    )
    (fake / "command" / "__init__.py").write_text("")
    (fake / "command" / "build_py.py").write_text("class build_py:\n    pass\n")
    r = _setup_py(root, "--version", env=dict(os.environ, PYTHONPATH=str(tmp_path)))
    assert r.returncode != 0 and "reached setup()" not in r.stderr, r.stderr[-2000:]
    assert "setuptools>=77" in r.stderr and "65.5.0" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_a_torch_below_the_minimum_is_refused_clearly():
    """Below the oldest supported torch, `import ffn_ext` (and setup.py, with the same message) stops with the
    versions and the command, before the native library is touched."""
    need = ".".join(map(str, _build.MIN_TORCH))
    assert _build.too_old(torch.__version__) is None
    assert _build.too_old(f"{need}.0+cu128") is None
    msg = _build.too_old("2.9.1+cu128")
    assert msg is not None and f"torch>={need}" in msg and "2.9.1+cu128" in msg
    code = "import torch; torch.__version__ = '2.9.1'\nimport ffn_ext"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert r.returncode != 0 and f"ImportError: ffn_ext needs torch>={need}, this is torch 2.9.1" in r.stderr, r.stderr


def test_cuda_library_loads_only_under_its_cuda_major(tmp_path, monkeypatch):
    """The CUDA library is loaded only under a torch of the CUDA major it was built for; otherwise the CUDA kernels
    are off and the reason names both (a CPU-only torch, another major, no library): _C itself loads under any
    torch from the minimum on, and is refused only when it is not built."""
    lib = tmp_path / "lib" / "libffn_ext_cuda.so"
    monkeypatch.setattr(_loader, "cuda_library_path", lambda: lib)
    monkeypatch.setattr(_loader._build, "PACKAGE", tmp_path)

    def status(record: dict | None, cuda: str | None) -> dict:
        monkeypatch.setattr(_loader, "_cuda_status", {"loaded": False, "reason": "not tried"})
        monkeypatch.setattr(torch.version, "cuda", cuda)
        if record is not None:
            (tmp_path / _build.RECORD).write_text(json.dumps(record))
        return _loader.load_cuda_library()

    s = status(None, "13.0")
    assert not s["loaded"] and "has no CUDA kernels" in s["reason"] and str(lib) in s["reason"], s
    lib.parent.mkdir()
    lib.write_bytes(b"")
    s = status({"torch_version": "2.14.1", "torch_cuda": "12.8"}, "13.0")
    assert not s["loaded"] and s["reason"] == "built for CUDA 12.x, torch is built for CUDA 13.0", s
    s = status({"torch_version": "2.14.1", "torch_cuda": "13.0"}, None)
    assert not s["loaded"] and "CPU-only build" in s["reason"], s
    s = status({"torch_version": "2.14.1", "torch_cuda": "13.0"}, "13.2")  # same major: tried (an empty file here)
    assert not s["loaded"] and str(lib) in s["reason"], s
    monkeypatch.setattr(_loader.importlib.machinery, "EXTENSION_SUFFIXES", [".cpython-311-x86_64-linux-gnu.so"])
    (tmp_path / "_C.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    (tmp_path / _build.RECORD).write_text(json.dumps({"torch_version": "2.10.0", "torch_cuda": "12.8"}))
    _loader.check_installed_C()  # built with another torch: loads (stable ABI)
    for p in tmp_path.glob("_C*"):
        p.unlink()
    with pytest.raises(ImportError, match="ffn_ext._C is not built"):
        _loader.check_installed_C()


def test_an_installed_cuda_build_loads_its_kernels_only_under_its_cuda_major():
    """An installed ffn_ext with the CUDA kernels (the CUDA wheel, .ci/wheel): under a torch of the build's CUDA major
    they load, with the CUDA runtime of torch's own wheels (no CUDA toolkit needed); under any other torch they are
    off and build_info() says why. (In a checkout, .ci/cross-torch checks the same of the in-place build.)"""
    if _build.in_checkout():
        pytest.skip("an installed package's CUDA library (tests run from outside the checkout)")
    record = _build.read_record(_build.PACKAGE)
    if not record or not record["cuda_kernels"]:
        pytest.skip("this ffn_ext was built without the CUDA kernels")
    info = ffn_ext.build_info()
    assert info["native"] == "ffn_ext._C" and _loader.cuda_library_path().is_file(), info
    built, running = record["torch_cuda"], torch.version.cuda
    if running and built.split(".")[0] == running.split(".")[0]:
        assert info["cuda_kernels"] == "yes", info
        if not os.environ.get("LD_LIBRARY_PATH"):  # (a toolkit's library path would come first)
            cudart = set(re.findall(r"\S*libcudart\.so\S*", Path("/proc/self/maps").read_text()))
            assert cudart and all("site-packages" in p for p in cudart), cudart
    else:
        assert info["cuda_kernels"] == "no" and info["cuda_kernels_off"], info


def test_sources_reachable_for_jit():
    """The sources ffn_ext.jit compiles are there: the checkout's csrc/, or the copy an installed package ships."""
    root = _build.source_root()
    sources = _build.python_target()[0] + _build.cuda_target()[0]
    missing = [s for s in sources if not Path(s).is_file()]
    assert not missing, missing
    for rel in _build.shipped_files(root):
        assert (root / rel).is_file(), rel
    headers = {Path(rel).name for rel in _build.shipped_files(root)}
    assert {"ffn_ext.h", "ops_table.h", "rows_launcher.cuh", "ops.h", "build.json"} <= headers, headers
    # no test code: the host math and emulated launches are the tests' own extension (tests/native.py)
    assert not [rel for rel in _build.shipped_files(root) if "test" in rel.lower()], _build.shipped_files(root)
    if not _build.in_checkout():
        assert root == _build.SHIPPED, root


def test_public_header_declares_every_forward_op():
    """<ffn_ext/ops.h> declares a typed function for every forward op of the table, from the table itself: it
    expands the op lists of <ffn_ext/ops_table.h> (installed next to it), whose lines are ffn_ext/table.py's
    activations and gated ops (its functions are defined inline, from the same lists)."""
    inc = _build.source_root() / "csrc" / "include" / "ffn_ext"
    header, table = (inc / "ops.h").read_text(), (inc / "ops_table.h").read_text()
    assert '#include "ops_table.h"' in header
    assert "FFN_EXT_ACTIVATIONS(FFN_EXT_DECLARE_ACT)" in header and "FFN_EXT_GATED(FFN_EXT_DECLARE_GATED)" in header

    def lines(macro):
        body = re.search(rf"#define {macro}\(X\)(.*?)(?:\n\n|\Z)", table, re.S).group(1)
        return re.findall(r"^\s*X\((\w+),", body, re.M)

    acts, gated = lines("FFN_EXT_ACTIVATIONS"), lines("FFN_EXT_GATED")
    declared = set(acts) | set(gated) | {g + "_packed" for g in gated}
    forward = {name for name, spec in OPS.items() if not spec.backward}
    assert declared == forward, (sorted(forward - declared), sorted(declared - forward))


def test_op_table_is_generated_from_the_python_table():
    """The C++ op table the library is built from is ffn_ext/table.py's rendering, not a second list: git tracks no
    copy of it, and the registered schemas carry each gated op's parameters with the table's defaults."""
    root = _build.source_root()
    text = (root / _build.OPS_TABLE).read_text()
    assert text == _build.render_ops_table(table), f"{_build.OPS_TABLE} is stale: rebuild (it is written by builds)"
    for a in table.ACTIVATIONS:
        assert f"  X({a.name}, {a.functor})" in text, a.name
    for g in table.GATED:
        assert f"  X({g.name}, {g.functor}, " in text, g.name
        if not hasattr(torch.ops.ffn_ext, g.name):
            continue  # the native library is not loaded (the ATen path): its schemas are not registered
        for op in (g.name, g.name + "_backward", g.name + "_packed", g.name + "_packed_backward"):
            schema = getattr(torch.ops.ffn_ext, op).default._schema
            kwargs = {a.name: a.default_value for a in schema.arguments if a.kwarg_only and a.name != "layout"}
            assert kwargs == {p.name: p.default for p in g.params}, (op, str(schema))
    if _build.in_checkout() and shutil.which("git") and (root / ".git").exists():
        tracked = subprocess.run(["git", "ls-files", _build.OPS_TABLE], cwd=root, capture_output=True, text=True)
        assert tracked.stdout.strip() == "", "the generated op table is tracked by git"


def test_fallback_warning_recommends_only_what_works():
    """The advice of the fallback warning: jit.load() when sources are there, the rebuild command in a checkout."""
    text = _loader.remedy()
    assert "ffn_ext.jit.load()" in text, text
    assert ("pip install --no-build-isolation -e ." in text) == _build.in_checkout(), text
    assert "circular" not in text


def test_package_holds_no_sass_reader():
    """The SASS reader is test machinery (tests/sass_reader.py, used by tests/test_sass.py and
    benchmarks/sass_budget.py): neither the checkout's package nor an installed wheel has a copy."""
    import importlib.util

    assert importlib.util.find_spec("ffn_ext.sass") is None


def test_shipped_binaries_use_only_torchs_stable_abi():
    """Every binary the package ships (_C and, with CUDA, lib/libffn_ext_cuda.so) needs no libtorch C++ symbol
    (c10::, at::, torch:: but torch::stable) from torch, only its C shims: what lets one build load under every torch
    from 2.10 on. And each shim it needs, torch has (the symbols resolve in this torch's libraries; the CUDA
    library's, under a CUDA torch)."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm not found")
    libs = [*_build.PACKAGE.glob("_C*.so"), *_build.PACKAGE.glob("lib/*.so")]
    if not libs:
        pytest.skip("no built binary in the package")
    torch_lib = Path(torch.__file__).parent / "lib"
    have = set()
    for name in ("libtorch_cpu.so", "libtorch_cuda.so"):
        if (torch_lib / name).is_file():
            out = subprocess.run([nm, "-D", "--defined-only", str(torch_lib / name)], capture_output=True, text=True)
            have |= {line.split()[-1] for line in out.stdout.splitlines() if line.strip()}
    for lib in libs:
        out = subprocess.run([nm, "-D", "--undefined-only", "-C", str(lib)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        cpp = [
            ln for ln in out.stdout.splitlines() if re.search(r"\b(c10|at|torch)::", ln) and "torch::stable" not in ln
        ]
        assert not cpp, (lib.name, cpp[:10])
        raw = subprocess.run([nm, "-D", "--undefined-only", str(lib)], capture_output=True, text=True).stdout
        shims = {ln.split()[-1] for ln in raw.splitlines() if ln.split()[-1].startswith(("aoti_torch_", "torch_"))}
        assert shims, lib.name
        if lib.parent.name == "lib" and not (torch_lib / "libtorch_cuda.so").is_file():
            continue  # the CUDA library under a CPU-only torch: never loaded there (a CUDA wheel's, .ci/wheel)
        assert shims <= have, (lib.name, sorted(shims - have))
