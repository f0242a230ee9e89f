"""The other ways to build and load ffn_ext: the JIT build (ffn_ext.jit.load), the CMake build (CMakeLists.txt:
libffn_ext_ops.so with the schemas for C++ consumers, and the Python module _C), and, when ffn_ext._C is missing,
the ops ffn_ext defines itself. Every binary is on torch's stable ABI: no c10::/at::/torch:: symbol but torch::stable.

Builds run CPU-only (FFN_EXT_FORCE_CPU=1 / -DFFN_EXT_WITH_CUDA=OFF) in temporary directories, in subprocesses (one
registration of the ffn_ext namespace per process), with two parallel jobs. Subprocesses import the ffn_ext under
test (conftest.package_env), so these tests also check an installed package; the CMake test needs the checkout.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import HANG_GUARD_S, PACKAGE_PARENT, needs_source_tree

import ffn_ext
from ffn_ext import _build, _loader

ROOT = Path(__file__).resolve().parent.parent


def _env(**extra) -> dict:
    env = dict(os.environ)
    env.pop("FFN_EXT_NO_C", None)
    env.pop("FFN_EXT_FORCE_CPU", None)
    env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_PARENT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("MAX_JOBS", "2")
    env.update(extra)
    return env


def _run_python(*parts: str, env: dict, cwd: Path | None = None):
    """Runs the script made of `parts` (each dedented on its own) in a fresh interpreter."""
    code = "\n".join(textwrap.dedent(p) for p in parts)
    r = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=cwd or PACKAGE_PARENT,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert r.returncode == 0, (
        f"subprocess failed ({r.returncode}):\n--- stdout\n{r.stdout[-4000:]}\n--- stderr\n{r.stderr[-6000:]}"
    )
    return r


def _unstable_symbols(path) -> list[str]:
    """The C++ symbols of torch's unstable API that the binary `path` needs (nm -D --undefined-only, demangled):
    a stable-ABI binary needs none but torch::stable's (docs/internals/stable-abi.md)."""
    out = subprocess.run(
        ["nm", "-D", "-C", "--undefined-only", str(path)], capture_output=True, text=True, timeout=HANG_GUARD_S
    ).stdout
    return [
        line.strip().removeprefix("U ")
        for line in out.splitlines()
        if re.search(r"\b(c10|at|torch)::(?!stable::)", line)
    ]


# Every op of the table (ffn_ext/table.py) against ATen, and gradients, in whatever process runs it (the ops are
# torch.ops.ffn_ext.*). The table is loaded from its file, not through the ffn_ext package, whose import would load
# ffn_ext._C next to a library the process has loaded already (the CMake build's).
OPS_VS_ATEN = r"""
import importlib.util, sys, torch
_spec = importlib.util.spec_from_file_location("ffn_ext_table", @TABLE@)
_table = sys.modules["ffn_ext_table"] = importlib.util.module_from_spec(_spec)  # (dataclasses look it up)
_spec.loader.exec_module(_table)
ACTIVATIONS, SPECS = _table.ACTIVATIONS, _table.OPS
ops = torch.ops.ffn_ext
torch.manual_seed(0)
def check(got, want, what):
    torch.testing.assert_close(got, want, msg=lambda m: f"{what}: {m}")
for name in SPECS:
    assert hasattr(ops, name), name
for dt in (torch.float32, torch.float64):
    for act in ACTIVATIONS:
        x = torch.randn(5, 33, dtype=dt) * 3
        g = torch.randn(5, 33, dtype=dt)
        gate, up = torch.randn(5, 33, dtype=dt) * 3, torch.randn(5, 33, dtype=dt)
        gu = torch.randn(5, 66, dtype=dt) * 3
        gp = torch.randn(5, 33, dtype=dt)
        f, f_bwd, n = act.aten, act.aten_backward, act.gated
        check(getattr(ops, act.name)(x), f(x), act.name)
        check(getattr(ops, act.name + "_backward")(g, x), f_bwd(g, x), act.name + "_backward")
        check(getattr(ops, n)(gate, up), f(gate) * up, n)
        dgate, dup = getattr(ops, n + "_backward")(g, gate, up)
        check(dgate, f_bwd(g * up, gate), n + "_backward dgate")
        check(dup, g * f(gate), n + "_backward dup")
        a, b = gu.chunk(2, -1)
        check(getattr(ops, n + "_packed")(gu), f(a) * b, n + "_packed")
        check(getattr(ops, n + "_packed_backward")(gp, gu), torch.cat([f_bwd(gp * b, a), gp * f(a)], -1),
              n + "_packed_backward")
print("OPS_OK")
""".replace("@TABLE@", repr(str(PACKAGE_PARENT / "ffn_ext" / "table.py")))

GRADCHECK = r"""
import torch, ffn_ext
from ffn_ext.table import ACTIVATIONS
torch.manual_seed(1)
d = dict(dtype=torch.float64, requires_grad=True)
x = torch.randn(3, 7, **d)
gate, up = torch.randn(3, 7, **d), torch.randn(3, 7, **d)
gu = torch.randn(3, 14, **d)
for act in ACTIVATIONS:
    function, options = act.api
    for f, args in ((lambda t: getattr(ffn_ext, function)(t, **options), (x,)),
                    (lambda a, b: ffn_ext.gated(a, b, activation=act.name), (gate, up)),
                    (lambda t: ffn_ext.gated_packed(t, activation=act.name), (gu,))):
        assert torch.autograd.gradcheck(f, args), (act.name, args)
        assert torch.autograd.gradgradcheck(f, args), (act.name, args)
print("GRAD_OK")
"""


# ---------------------------------------------------------------- (a) JIT build
@pytest.mark.slow
def test_jit_build_cpu_only(tmp_path):
    code = f"""
    import sys, time, torch, ffn_ext
    assert ffn_ext.build_info()["native"].startswith("none"), ffn_ext.build_info()
    t = time.time()
    mod = ffn_ext.jit.load(build_directory={str(tmp_path)!r}, verbose=False)
    print(f"JIT build + load: {{time.time() - t:.1f}} s")
    info = ffn_ext.build_info()
    assert info["native"] == "jit", info
    assert info["cuda_kernels"] == "no" and not ffn_ext.has_cuda_kernels(), info
    assert info["torch_version_built_against"] == torch.__version__.split("+")[0], info
    assert "_C" not in sys.modules and "ffn_ext._C" not in sys.modules
    # a second load in the same process: the same sources, so the loaded module
    assert ffn_ext.jit.load(build_directory={str(tmp_path)!r}) is mod
    try:  # but not a build it cannot give
        ffn_ext.jit.load(with_cuda=True)
    except RuntimeError as e:
        assert "already registered" in str(e) and "without the CUDA kernels" in str(e), e
    else:
        raise AssertionError("jit.load(with_cuda=True) next to a CPU-only build did not raise")
    # the product carries no test code (tests/native.py builds that apart): _C is the schemas and build_info
    assert not [n for n in dir(mod) if n.startswith(("_host_", "_emulate_", "_fast_"))], dir(mod)
    assert info["torch_target_version"] == "2.10", info
    """
    r = _run_python(code, OPS_VS_ATEN, GRADCHECK, env=_env(FFN_EXT_NO_C="1", FFN_EXT_FORCE_CPU="1"))
    assert "OPS_OK" in r.stdout and "GRAD_OK" in r.stdout, r.stdout
    (built,) = tmp_path.glob("*.so")
    if shutil.which("nm"):
        assert not _unstable_symbols(built), f"{built} needs unstable torch symbols: {_unstable_symbols(built)[:5]}"
    # a first build says so: what (no CUDA kernels, why, how long), where cached, and when done, without verbose
    said = [line for line in r.stderr.splitlines() if line.startswith("ffn_ext.jit: ")]
    assert len(said) == 3 and "no CUDA kernels" in said[0] and "FFN_EXT_FORCE_CPU" in said[0], said
    assert "about" in said[0] and str(tmp_path) in said[1], said
    assert said[2].startswith("ffn_ext.jit: built and loaded in"), said
    print(r.stdout.splitlines()[0])


class _FakeC:
    """Stands in for a loaded ffn_ext._C (its file in a temporary directory, with or without a build record)."""

    def __init__(self, directory: Path):
        self.__file__ = str(directory / "_C.so")

    @staticmethod
    def build_info():
        return {"cuda_kernels": "no"}


@pytest.mark.parametrize("record", ["same sources", "other sources", "no record"])
def test_jit_load_next_to_a_loaded_C(tmp_path, monkeypatch, record):
    """jit.load() in a process where ffn_ext._C registered the ops: returns _C when its build record says it was
    built from these sources, else raises a RuntimeError that says why and what to do (before building)."""
    if record != "no record":
        h = _build.sources_hash() if record == "same sources" else "0123456789abcdef"
        (tmp_path / _build.RECORD).write_text(json.dumps({"sources_hash": h}))
    fake = _FakeC(tmp_path)
    monkeypatch.setattr(ffn_ext.ops, "_native", fake)
    monkeypatch.setattr(ffn_ext.ops, "_native_source", "ffn_ext._C")
    # _C's CUDA kernels are the CUDA library's, which the loader did not load here
    monkeypatch.setattr(_loader, "_cuda_status", {"loaded": False, "reason": "test"})
    if record == "same sources":
        assert ffn_ext.jit.load() is fake
        with pytest.raises(RuntimeError, match="built without the CUDA kernels; with_cuda=True"):
            ffn_ext.jit.load(with_cuda=True)
    else:
        why = "built from other sources" if record == "other sources" else "has no build record"
        with pytest.raises(
            RuntimeError,
            match=rf"already registered in this process by ffn_ext\._C.*{why}.*"
            r"FFN_EXT_NO_C=1",
        ):
            ffn_ext.jit.load()


def test_installed_C_has_a_build_record_of_these_sources():
    """setup.py leaves the build record next to _C; it names the torch it was built with (any supported one: on the
    stable ABI it serves every later torch, as the CUDA wheel checked under three torches does), whether it has the
    CUDA kernels and, unless csrc/ changed since the build, these sources (jit.load() then returns _C)."""
    native = ffn_ext.ops._native
    if ffn_ext.ops._native_source != "ffn_ext._C":
        pytest.skip(f"ffn_ext._C is not loaded here ({ffn_ext.build_info()['native']})")
    record = _build.read_record(Path(native.__file__).parent)
    if record is None:
        pytest.skip(f"{native.__file__} was built before build records (rebuild with pip install)")
    assert _build.too_old(record["torch_version"]) is None, record
    assert record["cuda_kernels"] or not ffn_ext.has_cuda_kernels(), record  # loaded only where built
    this_torch = (_build.torch_base_version(torch.__version__), torch.version.cuda)
    if (record["torch_version"], record.get("torch_cuda")) == this_torch:
        assert record["cuda_kernels"] == ffn_ext.has_cuda_kernels(), record  # under its own torch they load
    if record["sources_hash"] == _build.sources_hash():
        assert ffn_ext.jit.load() is native


# ---------------------------------------------------------------- (b) CMake build
def _cmake() -> str | None:
    exe = shutil.which("cmake")
    if exe is None:
        return None
    out = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"(\d+)\.(\d+)", out)
    return exe if m and (int(m.group(1)), int(m.group(2))) >= (3, 19) else None


@pytest.mark.slow
def test_cmake_build_cpu_only(tmp_path):
    """The CMake build (libffn_ext_ops.so and _C) from the checkout, both on the stable ABI (nm); the library loaded
    by torch.ops.load_library registers the schemas, and `import ffn_ext` after it adopts those ops and adds its
    Python CPU kernels and autograd; the library installed with its headers and config, and a C++ consumer found
    through find_package(ffn_ext) (tests/cpp_consumer: embeds Python, imports ffn_ext, calls the ops and their
    backward ops through <ffn_ext/ops.h>, checks a shape error's message) linked with --as-needed and a static
    libstdc++; and _C standing in for ffn_ext._C."""
    ROOT = needs_source_tree("the CMake build")
    cmake = _cmake()
    if cmake is None:
        pytest.skip("cmake >= 3.19 not found")
    build = tmp_path / "build"
    env = _env(CUDA_HOME=os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    # The venv's bin (ninja from pip) on PATH.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    gen = ["-G", "Ninja"] if shutil.which("ninja", path=env["PATH"]) else []
    # libstdc++ linked statically, as the H200 image's toolchain did by itself: there, streaming a number into an
    # error message crashed (here it loses the number); the messages must come out whole anyway. The stable
    # headers' error path (torch::stable::detail::throw_exception) streams the line number.
    static = "-static-libstdc++"
    cfg = subprocess.run(
        [
            cmake,
            "-S",
            str(ROOT),
            "-B",
            str(build),
            *gen,
            "-DFFN_EXT_WITH_CUDA=OFF",
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-DCMAKE_SHARED_LINKER_FLAGS={static}",
            f"-DCMAKE_MODULE_LINKER_FLAGS={static}",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert cfg.returncode == 0, f"cmake configure failed:\n{cfg.stdout[-4000:]}\n{cfg.stderr[-6000:]}"
    assert "ffn_ext: CUDA kernels OFF" in cfg.stdout, cfg.stdout[-3000:]
    # the source lists and the stable flags came from csrc/build.json
    cfg_json = json.loads((ROOT / "csrc" / "build.json").read_text())
    rules = (build / ("build.ninja" if gen else "Makefile")).read_text()
    if gen:
        for src in cfg_json["ops_sources"] + cfg_json["python_sources"]:
            assert src in rules, f"{src} (build.json) is not in the CMake build"
        for src in cfg_json["cuda_sources"]:
            assert src not in rules, f"{src} is built although FFN_EXT_WITH_CUDA=OFF"
        assert f"-DTORCH_TARGET_VERSION={_build.TORCH_TARGET_VERSION}" in rules
    bld = subprocess.run(
        [cmake, "--build", str(build), "-j", "2", "--target", "ffn_ext_ops", "_C"],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert bld.returncode == 0, f"cmake build failed:\n{bld.stdout[-6000:]}\n{bld.stderr[-4000:]}"
    (lib,) = [p for p in build.glob("libffn_ext_ops.*") if p.suffix in (".so", ".dylib")]
    (mod,) = build.glob("_C*.so")
    if shutil.which("nm"):
        # the static copy is really there (else this test would not test the above)
        syms = subprocess.run(["nm", "-C", "--defined-only", str(lib)], capture_output=True, text=True).stdout
        assert "std::ostream::_M_insert<long>" in syms, "libstdc++ was not linked statically"
        for so in (lib, mod):  # stable ABI: nothing of c10/at/torch but torch::stable
            assert not _unstable_symbols(so), f"{so.name} needs unstable torch symbols: {_unstable_symbols(so)[:5]}"

    # the plain library: torch.ops.load_library registers the schemas (no kernels for CPU: those are Python)
    code = f"""
    import sys, torch
    torch.ops.load_library({str(lib)!r})
    assert not any(m == "ffn_ext" or m.startswith("ffn_ext.") for m in sys.modules), "ffn_ext was imported"
    assert str(torch.ops.ffn_ext.swiglu.default._schema) == "ffn_ext::swiglu(Tensor gate, Tensor up) -> Tensor"
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("ffn_ext::swiglu", "CPU")
    """
    # then `import ffn_ext`: adopts the ops the library registered (importing _C next to them would abort) and
    # registers its Python kernels and autograd; the checks' messages and types are the Python API's
    adopt = """
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning either
        import ffn_ext
    info = ffn_ext.build_info()
    assert info["native"].startswith("ops registered before import"), info
    assert "ffn_ext._C" not in sys.modules
    g, u = torch.randn(4, 50, dtype=torch.float64), torch.randn(4, 50, dtype=torch.float64)
    try:
        torch.ops.ffn_ext.swiglu(g, u[:, :3])
    except ValueError as e:
        assert str(e).startswith("ffn_ext.swiglu: expected `up` to have the shape of `gate` [4, 50], got [4, 3]"), e
    else:
        raise AssertionError("shape mismatch accepted")
    try:
        torch.ops.ffn_ext.swiglu_packed(torch.randn(2, 3, 5))
    except ValueError as e:
        assert str(e).startswith("ffn_ext.swiglu_packed: expected the last dimension of `gate_up` to be even "
                                 "([..., 2*M]), got shape [2, 3, 5]"), e
    else:
        raise AssertionError("odd packed width accepted")
    x = torch.randn(3, 9, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(ffn_ext.silu(x), torch.nn.functional.silu(x))
    ffn_ext.swiglu(x, x).sum().backward()
    print("ADOPT_OK")
    """
    r = _run_python(code, adopt, OPS_VS_ATEN, env=_env(), cwd=tmp_path)
    assert "OPS_OK" in r.stdout and "ADOPT_OK" in r.stdout

    # installed: headers, library, ffn_extConfig.cmake; a consumer program through find_package(ffn_ext)
    prefix = tmp_path / "prefix"
    inst = subprocess.run(
        [cmake, "--install", str(build), "--prefix", str(prefix)],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert inst.returncode == 0, inst.stdout[-3000:] + inst.stderr[-3000:]
    for rel in (
        "include/ffn_ext/ops.h",
        "include/ffn_ext/ops_table.h",
        "lib/libffn_ext_ops.so",
        "lib/cmake/ffn_ext/ffn_extConfig.cmake",
        "lib/cmake/ffn_ext/ffn_extTargets.cmake",
    ):
        assert (prefix / rel).is_file(), f"{rel} not installed: {sorted(map(str, prefix.rglob('*')))}"
    consumer = tmp_path / "consumer"
    cfg = subprocess.run(
        [
            cmake,
            "-S",
            str(ROOT / "tests" / "cpp_consumer"),
            "-B",
            str(consumer),
            *gen,
            f"-DCMAKE_PREFIX_PATH={prefix}",
            f"-DPython3_EXECUTABLE={sys.executable}",  # the embedded Python, and the torch ffn_ext's config uses
            # --as-needed: the linker drops libraries nothing references (the default of some distributions);
            # <ffn_ext/ops.h> references libffn_ext_ops.so, whose loading registers the schemas
            f"-DCMAKE_EXE_LINKER_FLAGS={static} -Wl,--as-needed",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert cfg.returncode == 0, f"consumer configure failed:\n{cfg.stdout[-4000:]}\n{cfg.stderr[-6000:]}"
    bld = subprocess.run(
        [cmake, "--build", str(consumer), "-j", "2"], env=env, capture_output=True, text=True, timeout=HANG_GUARD_S
    )
    assert bld.returncode == 0, f"consumer build failed:\n{bld.stdout[-6000:]}\n{bld.stderr[-4000:]}"
    exe = consumer / "consumer"
    if shutil.which("readelf"):
        dyn = subprocess.run(["readelf", "-d", str(exe)], capture_output=True, text=True).stdout
        assert "libffn_ext_ops.so" in dyn, f"--as-needed dropped libffn_ext_ops.so:\n{dyn}"
    # the embedded interpreter finds ffn_ext and this environment's packages (torch) through PYTHONPATH
    site = sysconfig.get_paths()["purelib"]
    run_env = _env(PYTHONPATH=os.pathsep.join([str(PACKAGE_PARENT), site]))
    run = subprocess.run([str(exe)], env=run_env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert run.returncode == 0 and "CONSUMER_OK" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
    # the shape check's message reached C++ whole, number included (static libstdc++)
    assert "expected `up` to have the shape of `gate` [4, 50], got [4, 3]" in run.stdout, run.stdout[-3000:]

    # the Python module: stands in for ffn_ext._C (the package is told to skip its own _C and adopt this one)
    code = f"""
    import importlib.util, sys, torch
    import ffn_ext
    assert ffn_ext.build_info()["native"].startswith("none")
    ffn_ext.ops._undefine_here()  # the ops ffn_ext defined itself: dropped, as ffn_ext.jit.load does first
    spec = importlib.util.spec_from_file_location("ffn_ext._C", {str(mod)!r})
    C = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(C)
    ffn_ext.ops._adopt(C, "ffn_ext._C")
    info = ffn_ext.build_info()
    assert info["native"] == "ffn_ext._C" and info["torch_target_version"] == "2.10", info
    assert not [n for n in dir(C) if n.startswith(("_host_", "_emulate_", "_fast_"))], dir(C)  # no test code
    """
    r = _run_python(code, OPS_VS_ATEN, GRADCHECK, env=_env(FFN_EXT_NO_C="1"), cwd=tmp_path)
    assert "OPS_OK" in r.stdout and "GRAD_OK" in r.stdout


# ---------------------------------------------------------------- (b2) which CUDA toolkit a build takes
# torch.utils.cpp_extension takes the folder above the first nvcc's bin/ when CUDA_HOME is unset; for a wrapper
# script outside the toolkit (this project's machines: /usr/local/bin/nvcc execs /usr/local/cuda-13.0/bin/nvcc)
# that folder has no CUDA headers, and `pip install .` died deep in ninja on cuda_runtime.h. These tests run the
# detection (_build.find_cuda_home, used by setup.py and ffn_ext.jit) against scripts in a temporary folder, with
# CUDA_HOME and CUDA_PATH unset: nothing is compiled.


def _script(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return path


def _fake_toolkit(home: Path) -> Path:
    """A folder that passes for a CUDA toolkit: include/cuda_runtime.h, and a bin/nvcc that answers a dry run as
    nvcc does (`#$ TOP=<its bin>/..` on stderr)."""
    (home / "include").mkdir(parents=True)
    (home / "include" / "cuda_runtime.h").write_text("")
    _script(home / "bin" / "nvcc", 'echo "#\\$ TOP=${0%/*}/.." >&2')
    return home


def _real_toolkit() -> Path | None:
    for home in (os.environ.get("CUDA_HOME"), _REAL_DEFAULT):
        if home and not _build._missing(home):
            return Path(home)
    return None


_REAL_DEFAULT, _PATH = _build.DEFAULT_CUDA_HOME, os.environ.get("PATH", "")  # before no_cuda_env patches them


def _first_on_path(folder: Path) -> str:
    """PATH with folder first; the rest stays (nvcc runs the host compiler, gcc, even for a dry run)."""
    return os.pathsep.join([str(folder), _PATH])


@pytest.fixture
def no_cuda_env(tmp_path, monkeypatch):
    """CUDA_HOME and CUDA_PATH unset, PATH an empty folder (each test puts its nvcc first), no /usr/local/cuda."""
    for var in _build.CUDA_HOME_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(_build, "DEFAULT_CUDA_HOME", str(tmp_path / "no-cuda"))
    return monkeypatch


@pytest.mark.parametrize("toolkit", ["fake", "real"])
def test_a_wrapper_nvcc_finds_the_toolkit_it_runs(tmp_path, no_cuda_env, toolkit):
    """An nvcc on PATH that is a wrapper script execing the toolkit's nvcc: the toolkit is the one it runs, not the
    folder above the wrapper's bin/ (which here has no include/). The real toolkit's nvcc when there is one."""
    home = _fake_toolkit(tmp_path / "cuda-13.0") if toolkit == "fake" else _real_toolkit()
    if home is None:
        pytest.skip("no CUDA toolkit here ($CUDA_HOME or /usr/local/cuda with bin/nvcc and include/cuda_runtime.h)")
    wrapper = _script(tmp_path / "wrap" / "bin" / "nvcc", f'exec {home / "bin" / "nvcc"} "$@"')
    no_cuda_env.setenv("PATH", _first_on_path(wrapper.parent))
    found, how = _build.find_cuda_home()
    assert found is not None and Path(found).resolve() == home.resolve(), (found, how)
    assert "nvcc --dryrun" in how and str(wrapper) in how, how
    # a symlink to the toolkit's nvcc, and CUDA_HOME named: the same toolkit
    link = tmp_path / "link" / "bin" / "nvcc"
    link.parent.mkdir(parents=True)
    link.symlink_to(home / "bin" / "nvcc")
    no_cuda_env.setenv("PATH", _first_on_path(link.parent))
    assert Path(_build.find_cuda_home()[0]).resolve() == home.resolve()
    no_cuda_env.setenv("CUDA_HOME", str(home))
    assert _build.find_cuda_home() == (str(home), "named by CUDA_HOME")


def test_a_wrapper_to_a_missing_toolkit_stops_with_the_ways_out(tmp_path, no_cuda_env):
    """A wrapper whose toolkit is gone, with CUDA_HOME unset: one message before anything compiles, naming the nvcc
    found, what is missing, and the two ways out; FFN_EXT_FORCE_CPU=1 then builds without looking for a toolkit."""
    wrapper = _script(tmp_path / "wrap" / "bin" / "nvcc", f'exec {tmp_path / "gone" / "bin" / "nvcc"} "$@"')
    no_cuda_env.setenv("PATH", _first_on_path(wrapper.parent))
    with pytest.raises(_build.CudaToolkitError) as caught:
        _build.find_cuda_home()
    msg = str(caught.value)
    for part in (str(wrapper), "include/cuda_runtime.h", "CUDA_HOME=", f"{_build.FORCE_CPU_ENV}=1", "before compiling"):
        assert part in msg, f"{part!r} not in the message:\n{msg}"
    no_cuda_env.setenv(_build.FORCE_CPU_ENV, "1")
    assert _build.decide_cuda() == (False, f"{_build.FORCE_CPU_ENV} is set")


def test_a_cuda_home_without_headers_stops_and_no_toolkit_builds_cpu_only(tmp_path, no_cuda_env):
    """CUDA_HOME (or CUDA_PATH) naming a folder without the toolkit's files stops with the message; no toolkit at
    all (no CUDA_HOME, no nvcc, no /usr/local/cuda) is a CPU-only build, not an error; /usr/local/cuda when it is
    a toolkit is taken, as torch takes it."""
    (tmp_path / "local" / "bin").mkdir(parents=True)
    no_cuda_env.setenv("CUDA_PATH", str(tmp_path / "local"))
    with pytest.raises(_build.CudaToolkitError, match=r"(?s)CUDA_PATH=.*no bin/nvcc and no include/cuda_runtime\.h"):
        _build.find_cuda_home()
    no_cuda_env.delenv("CUDA_PATH")
    found, how = _build.find_cuda_home()
    assert found is None and "no nvcc is on PATH" in how, how
    no_cuda_env.setattr(_build, "DEFAULT_CUDA_HOME", str(_fake_toolkit(tmp_path / "cuda")))
    assert _build.find_cuda_home()[0] == str(tmp_path / "cuda")


def test_use_cuda_home_points_torch_at_the_toolkit(monkeypatch):
    """The toolkit found is what torch's cpp_extension compiles with, whether or not it was imported already."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("CUDA_HOME", "/unused")  # restored after the test
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", cpp_extension.CUDA_HOME)
    _build.use_cuda_home("/opt/cuda-x")
    assert os.environ["CUDA_HOME"] == "/opt/cuda-x" and cpp_extension.CUDA_HOME == "/opt/cuda-x"


def test_architectures_the_users_else_the_visible_gpus_else_the_default(monkeypatch):
    """TORCH_CUDA_ARCH_LIST wins; unset, a visible GPU's architecture alone (PTX for the newest, as torch's own
    extensions build), and with no GPU the project default, saying so and naming FFN_EXT_FORCE_CPU; the build's first
    lines name the toolkit, the architectures and an expected time that grows with them."""
    cfg = {"default_cuda_archs": "8.0;9.0+PTX"}
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.6")
    assert _build.choose_archs(cfg) == ("8.6", "TORCH_CUDA_ARCH_LIST")
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: [(9, 0), (8, 0)][i])
    archs, why = _build.choose_archs(cfg)
    assert archs == "8.0;9.0+PTX" and "visible GPU" in why and os.environ["TORCH_CUDA_ARCH_LIST"] == archs
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert _build.choose_archs(cfg)[0] == "9.0+PTX"
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    archs, why = _build.choose_archs(cfg)
    assert archs == "8.0;9.0+PTX" and "no GPU visible" in why and f"{_build.FORCE_CPU_ENV}=1" in why, why
    plan = _build.build_plan(True, "the CUDA toolkit in /opt/cuda-13.0 (named by CUDA_HOME)", archs, why, "_C")
    assert "/opt/cuda-13.0" in plan[0] and "sm_80, sm_90 (+PTX)" in plan[1] and "no GPU visible" in plan[1], plan
    assert "expected time: about" in plan[2], plan
    monkeypatch.setenv("MAX_JOBS", "2")
    seconds = [
        float(t) * (60 if unit == "min" else 1)
        for t, unit in (
            re.search(r"about ([\d.]+) (s|min)", _build.expected_build_time(a)).groups() for a in (None, "9.0", archs)
        )
    ]
    assert seconds == sorted(seconds) and len(set(seconds)) == 3, seconds
    assert _build.arch_names("800,900") == "sm_80, sm_90" and _build.arch_names("10.0;9.0a") == "sm_100, sm_90a"


@pytest.mark.parametrize("case", ["kernels, no GPU", "kernels, GPU", "kernels off", "no native library"])
def test_where_it_runs_says_what_the_ops_run(monkeypatch, case):
    """build_summary()'s and the main job's first line: the CUDA kernels (built? for which architectures?), whether a
    GPU is visible, and so what the ops run; a build for GPUs on a machine without one says the CPU's ops run."""
    gpu = case == "kernels, GPU"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "NVIDIA H200")
    monkeypatch.setattr(_build, "read_record", lambda d: {})  # the library's own list, not the build's record
    info = {"native": "ffn_ext._C", "cuda_kernels": "yes", "cuda_version": "13.0", "cuda_archs": "800,900"}
    if case == "kernels off":
        info = {
            "native": "ffn_ext._C",
            "cuda_kernels": "no",
            "cuda_kernels_off": "torch 2.13.0+cpu is a CPU-only build",
        }
        monkeypatch.setattr(_build, "read_record", lambda d: {"cuda_archs": "8.0;9.0+PTX"})
        monkeypatch.setattr(_loader, "cuda_library_path", lambda: Path(__file__))  # a file that exists
    if case == "no native library":
        info = {"native": "none: the ops are defined by ffn_ext (PyTorch's own ops)", "cuda_kernels": "no"}
    line = _loader.where_it_runs(info)
    want = {
        "kernels, no GPU": "CUDA kernels: built for sm_80, sm_90; no GPU visible: the ops run PyTorch's CPU ops",
        "kernels, GPU": "GPU: NVIDIA H200 (sm_90): CUDA tensors run ffn_ext's kernels",
        "kernels off": "CUDA kernels: built for sm_80, sm_90 (+PTX), not loaded (torch 2.13.0+cpu is a CPU-only build)",
        "no native library": "no native library",
    }[case]
    assert want in line, line
    assert ffn_ext.build_summary().splitlines()[0] == _loader.where_it_runs(ffn_ext.build_info())


def test_a_wheel_of_the_in_place_build_needs_that_build_of_these_sources(tmp_path):
    """FFN_EXT_PREBUILT=1 (.ci/wheel) packs the binaries an in-place build left, never a build of other sources:
    without a build, or with its record's sources hash not the sources', it refuses."""
    root = tmp_path / "root"
    shutil.copytree(_build.source_root() / "csrc", root / "csrc")
    (root / "ffn_ext").mkdir()
    with pytest.raises(RuntimeError, match="no in-place build"):
        _build.prebuilt_files(root)
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    (root / "ffn_ext" / f"_C{suffix}").write_bytes(b"")
    record = {"cuda_kernels": False, "sources_hash": "0" * 16}
    (root / "ffn_ext" / _build.RECORD).write_text(json.dumps(record))
    with pytest.raises(RuntimeError, match="other sources"):
        _build.prebuilt_files(root)
    record.update(sources_hash=_build.sources_hash(root), cuda_kernels=True)
    (root / "ffn_ext" / _build.RECORD).write_text(json.dumps(record))
    with pytest.raises(RuntimeError, match="missing"):
        _build.prebuilt_files(root)
    (root / _build.cuda_library_relpath(root)).parent.mkdir(parents=True)
    (root / _build.cuda_library_relpath(root)).write_bytes(b"")
    files, got = _build.prebuilt_files(root)
    assert files == [f"ffn_ext/_C{suffix}", f"ffn_ext/{_build.RECORD}", _build.cuda_library_relpath(root)], files
    assert got == record


def test_setup_py_stops_before_compiling_on_a_broken_toolkit(tmp_path):
    """`setup.py` as pip runs it first (dist_info, the metadata), with a wrapper nvcc to a missing toolkit first on
    PATH and CUDA_HOME unset: under a CUDA build of torch it exits with the message and no traceback, having
    compiled nothing; a CPU-only torch never looks for a toolkit."""
    root = needs_source_tree("setup.py")
    wrapper = _script(tmp_path / "wrap" / "bin" / "nvcc", f'exec {tmp_path / "gone" / "bin" / "nvcc"} "$@"')
    env = {k: v for k, v in os.environ.items() if k not in (*_build.CUDA_HOME_VARS, _build.FORCE_CPU_ENV)}
    env["PATH"] = os.pathsep.join([str(wrapper.parent), env.get("PATH", "")])
    r = subprocess.run(
        [sys.executable, "setup.py", "-q", "dist_info", "--output-dir", str(tmp_path / "out")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    if torch.version.cuda is None:
        assert r.returncode == 0, r.stderr[-3000:]
        return
    assert r.returncode != 0, r.stdout[-2000:]
    assert "cannot build the CUDA kernels" in r.stderr and str(wrapper) in r.stderr, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "ffn_ext: building" not in r.stdout, r.stderr[-3000:]


def test_jit_load_stops_before_compiling_on_a_broken_toolkit(tmp_path):
    """ffn_ext.jit.load() finds the toolkit as setup.py does: with a wrapper nvcc to a missing toolkit first on PATH
    and CUDA_HOME unset, a CUDA build (with_cuda=True; and the default, under a CUDA build of torch) raises the
    message, and nothing was compiled into the build directory."""
    wrapper = _script(tmp_path / "wrap" / "bin" / "nvcc", f'exec {tmp_path / "gone" / "bin" / "nvcc"} "$@"')
    env = _env(FFN_EXT_NO_C="1", PATH=os.pathsep.join([str(wrapper.parent), os.environ.get("PATH", "")]))
    for var in _build.CUDA_HOME_VARS:
        env.pop(var, None)
    code = f"""
    import torch, ffn_ext
    for with_cuda in [True] + ([None] if torch.version.cuda else []):
        try:
            ffn_ext.jit.load(with_cuda=with_cuda, build_directory={str(tmp_path / "build")!r})
        except ffn_ext._build.CudaToolkitError as e:
            assert {str(wrapper)!r} in str(e) and "FFN_EXT_FORCE_CPU=1" in str(e), e
        else:
            raise AssertionError(f"jit.load(with_cuda={{with_cuda}}) built with a broken toolkit")
    print("JIT_STOPPED")
    """
    r = _run_python(code, env=env)
    assert "JIT_STOPPED" in r.stdout, r.stdout
    assert not (tmp_path / "build").exists() or not any((tmp_path / "build").iterdir())


# ---------------------------------------------------------------- (c) no _C: ffn_ext defines the ops
def test_import_without_C_warns_once_and_defines_the_ops_itself():
    code = r"""
    import sys, warnings
    sys.modules["ffn_ext._C"] = None          # makes `from . import _C` raise ImportError
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import torch, torch.nn.functional as F
        import ffn_ext
        import ffn_ext                        # a second import does not warn again
        x = torch.randn(6, 40, dtype=torch.float64) * 3
        gate, up = torch.randn(6, 40, dtype=torch.float64), torch.randn(6, 40, dtype=torch.float64)
        gu = torch.randn(6, 80, dtype=torch.float64)
        results = [
            (ffn_ext.gelu(x), F.gelu(x)),
            (ffn_ext.silu(x), F.silu(x)),
            (ffn_ext.swiglu(gate, up), F.silu(gate) * up),
            (ffn_ext.swiglu_packed(gu), F.silu(gu[:, :40]) * gu[:, 40:]),
            (ffn_ext.gelu(x.float()), F.gelu(x.float())),
        ]
        xg = x.clone().requires_grad_()
        ffn_ext.swiglu(xg, up).sum().backward()
        info = ffn_ext.build_info()
        cuda = ffn_ext.has_cuda_kernels()
    ours = [w for w in caught if "ffn_ext" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    msg = str(ours[0].message)
    assert issubclass(ours[0].category, RuntimeWarning), ours[0].category
    assert "ffn_ext.jit.load()" in msg and "circular import" not in msg, msg
    if ffn_ext._build.in_checkout():  # a checkout's package: rebuild there; an install's: only what works for it
        assert "pip install --no-build-isolation -e ." in msg, msg
    assert "PyTorch's own ops" in msg, msg
    for got, want in results:
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    s = torch.sigmoid(x)
    torch.testing.assert_close(xg.grad, up * s * (1 + x * (1 - s)))
    assert info["native"].startswith("none") and "ffn_ext._C could not be imported" in info["reason"], info
    assert cuda is False
    print("FALLBACK_OK")
    """
    r = _run_python(code, env=_env())
    assert "FALLBACK_OK" in r.stdout, r.stdout


def test_no_C_env_skips_C_without_warning():
    """FFN_EXT_NO_C=1: no _C, no warning (it was asked for), the ops defined by ffn_ext itself, build_info says why."""
    code = r"""
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import torch, ffn_ext
        x = torch.randn(3, 9)
        torch.testing.assert_close(ffn_ext.silu(x), torch.nn.functional.silu(x), rtol=0, atol=0)
    assert not [w for w in caught if "ffn_ext" in str(w.message)], [str(w.message) for w in caught]
    import sys
    assert "ffn_ext._C" not in sys.modules
    info = ffn_ext.build_info()
    assert info["native"].startswith("none") and "FFN_EXT_NO_C" in info["reason"], info
    print("NO_C_OK")
    """
    r = _run_python(code, env=_env(FFN_EXT_NO_C="1"))
    assert "NO_C_OK" in r.stdout


def test_installed_library_uses_the_shared_libstdcxx():
    """The built _C links libstdc++ dynamically and holds no copy of its own. On the H200 image (torch 2.11, g++ 13)
    the editable build came out with libstdc++'s stream and locale code inside _C itself; that copy's locale
    facets were never set up, so the first integer streamed into an error message segfaulted (cuda-gdb: in
    std::ostream::_M_insert<long>, called from shapes.cpp). The messages now avoid streams for numbers
    (csrc/shapes.cpp), and this test names the cause if a toolchain does it again."""
    nm = shutil.which("nm")
    native = ffn_ext.ops._native
    if nm is None or native is None or not getattr(native, "__file__", None):
        pytest.skip("needs `nm` and the installed native module ffn_ext._C")
    out = subprocess.run(
        [nm, "-C", "--defined-only", native.__file__], capture_output=True, text=True, timeout=HANG_GUARD_S
    ).stdout
    own = sorted(
        {
            line.split(" ", 2)[-1]
            for line in out.splitlines()
            if re.search(r" [TtWw] std::(locale::|ostream& std::ostream::_M_insert|codecvt<)", line)
        }
    )
    assert not own, (
        f"{native.__file__} defines libstdc++'s own stream/locale code (a static libstdc++ in the link), "
        f"e.g. {own[:3]}; error messages that stream numbers will crash"
    )


def test_cuda_kernel_files_are_torch_free():
    """nvcc never parses the torch headers: the row kernels (csrc/cuda/kernels_part*.cu) and the FP8 quantizing
    kernels (csrc/cuda/quant_part*.cu) include only rows.h, ffn_math.h, quant_kernel.h, the op table and the CUDA
    runtime; cuda/ops.cpp (g++) registers the ops. With torch/library.h and row_ops.h in them, a row part took about
    three times the nvcc time (docs/building.md#build-time)."""
    root = needs_source_tree("the kernel sources")
    # the stable port's header-only set (torch/headeronly: c10::Half/BFloat16, the version): no ATen/c10 parse

    def includes(path: Path, seen: set) -> set:
        angled = set()
        for quoted, name in re.findall(r'^#include ([<"])([^>"]+)[>"]', path.read_text(), re.M):
            if quoted == "<":
                angled.add(name)
            elif (path.parent / name).resolve() not in seen:
                seen.add((path.parent / name).resolve())
                angled |= includes((path.parent / name).resolve(), seen)
        return angled

    cfg = json.loads((root / "csrc" / "build.json").read_text())
    cu = [s for s in cfg["cuda_sources"] if s.endswith(".cu")]
    parts = [s for s in cu if Path(s).name.startswith("kernels_part")]
    quant_parts = [s for s in cu if Path(s).name.startswith("quant_part")]
    assert len(parts) == 4 and len(quant_parts) == 4, cu
    for src in cu:
        torch_headers = {h for h in includes(root / src, set()) if h.split("/")[0] in ("torch", "ATen", "c10")}
        heavy = sorted(h for h in torch_headers if not h.startswith("torch/headeronly/"))
        assert not heavy, f"{src} includes torch headers: {heavy}"
