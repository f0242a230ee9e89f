"""Machine code of the CUDA kernels, read without a GPU.

`cuobjdump` (shipped in the triton package that the CUDA build of torch installs, triton/backends/nvidia/bin; else
$CUDA_HOME/bin or PATH) dumps the SASS of the built extension (the loaded ffn_ext native library, or the file named
by FFN_EXT_SASS_LIB, e.g. a CMake-built libffn_ext_ops.so). For every rows_kernel instantiation (6 functors x 4
dtypes) and every architecture:
  * the vector body uses 128-bit global loads (LDG...128) and stores (STG...128), at least one per operand;
  * no local memory traffic (LDL/STL) and no stack (register spills would show up as both);
  * the vector path (benchmarks/sass_budget.py) moves kUnroll 16-byte packs per operand, issues all its loads
    before any floating-point math, and on sm_90 the 16-bit and float32 kernels need few enough instructions per
    byte to run at 92% of an H200's copy bandwidth;
and the binary holds exactly the SASS and PTX the architecture list asked for (TORCH_CUDA_ARCH_LIST, else
default_cuda_archs of csrc/build.json), which must also be what the build reports (build_info()['cuda_archs']).
Skips when the extension has no CUDA kernels or no cuobjdump is found.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

import ffn_ext

ROOT = Path(__file__).resolve().parent.parent
LIB_ENV = "FFN_EXT_SASS_LIB"

_spec = importlib.util.spec_from_file_location("sass_budget", ROOT / "benchmarks" / "sass_budget.py")
budget = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(budget)

FUNCTORS = {f: (ni, no) for f, (_, ni, no) in budget.FUNCTORS.items()}  # functor -> (NI, NO), as in ffn_math.h
DTYPES = budget.DTYPES
EXPECTED_KERNELS = {(f, dt) for f in FUNCTORS for dt, _ in DTYPES.values()}  # 24 per architecture

LOAD_128 = re.compile(r"\bLDG(?:\.[A-Z0-9_]+)*\.128\b")
STORE_128 = re.compile(r"\bSTG(?:\.[A-Z0-9_]+)*\.128\b")
LOCAL_MEM = re.compile(r"\b(?:LDL|STL)\b")


# ---------------------------------------------------------------- locating the binary
def _library() -> tuple[str | None, str]:
    """(path of the binary to inspect, why not) ."""
    if os.environ.get(LIB_ENV):
        return os.environ[LIB_ENV], ""
    native = ffn_ext.ops._native
    if native is None:
        return None, f"no native ffn_ext library is loaded ({ffn_ext.build_info().get('reason')})"
    if not ffn_ext.has_cuda_kernels():
        return None, "the loaded ffn_ext was built without CUDA kernels"
    return native.__file__, ""


def requested_archs() -> tuple[str, set[int], set[int]]:
    """(the list, SASS archs, PTX archs) from TORCH_CUDA_ARCH_LIST or the project default."""
    text = os.environ.get("TORCH_CUDA_ARCH_LIST") or json.loads((ROOT / "csrc" / "build.json").read_text())[
        "default_cuda_archs"]
    sass, ptx = set(), set()
    for item in re.split(r"[;\s]+", text.strip()):
        if not item:
            continue
        m = re.fullmatch(r"(\d+)\.(\d+)[af]?(\+PTX)?", item)
        assert m, f"cannot read {item!r} in the architecture list {text!r}"
        cc = int(m.group(1)) * 10 + int(m.group(2))
        sass.add(cc)
        if m.group(3):
            ptx.add(cc)
    return text, sass, ptx


def parse_sass(text: str) -> dict[tuple[int, str], list[str]]:
    """{(sm, mangled function name): [instruction lines]} from `cuobjdump --dump-sass`."""
    funcs: dict[tuple[int, str], list[str]] = {}
    arch, current = None, None
    for line in text.splitlines():
        m = re.match(r"\s*arch = sm_(\d+)", line)
        if m:
            arch, current = int(m.group(1)), None
            continue
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            assert arch is not None, "SASS function before any 'arch = sm_XX' header"
            current = funcs.setdefault((arch, m.group(1)), [])
            continue
        if current is not None and re.match(r"\s*/\*[0-9a-f]{4,}\*/", line):
            current.append(line.split(";")[0])
    return funcs


def parse_resources(text: str) -> dict[tuple[int, str], dict[str, int]]:
    """{(sm, function): {'REG': .., 'STACK': .., 'LOCAL': .., ...}} from `cuobjdump --dump-resource-usage`."""
    out, arch, fn = {}, None, None
    for line in text.splitlines():
        m = re.match(r"\s*arch = sm_(\d+)", line)
        if m:
            arch = int(m.group(1))
            continue
        m = re.match(r"\s*Function (\S+):\s*$", line)
        if m:
            fn = m.group(1)
            continue
        if fn is not None and "REG:" in line:
            out[(arch, fn)] = {k: int(v) for k, v in re.findall(r"([A-Z]+):(\d+)", line)}
            fn = None
    return out


@functools.lru_cache(maxsize=None)
def dump(kind: str) -> str:
    lib, why = _library()
    tool = budget.cuobjdump()
    if lib is None:
        pytest.skip(why)
    if tool is None:
        pytest.skip("cuobjdump not found (install triton, or set CUDA_HOME to a toolkit that has it)")
    flag = {"sass": "--dump-sass", "res": "--dump-resource-usage", "elf": "--list-elf", "ptx": "--list-ptx"}[kind]
    r = subprocess.run([tool, flag, lib], capture_output=True, text=True, timeout=300)
    if kind == "ptx" and r.returncode != 0 and "No PTX" in r.stderr + r.stdout:
        return ""
    assert r.returncode == 0, f"{tool} {flag} {lib} failed ({r.returncode}):\n{r.stderr[-2000:]}"
    return r.stdout


@pytest.fixture(scope="module")
def sass():
    funcs = parse_sass(dump("sass"))
    assert funcs, "cuobjdump found no SASS functions in the extension"
    return funcs


def _archs_in(funcs) -> set[int]:
    return {a for a, _ in funcs}


# ---------------------------------------------------------------- tests
def test_kernel_inventory(sass):
    """Exactly the 24 rows_kernel instantiations (6 functors x 4 dtypes, VEC = 16 bytes / sizeof(T)) per arch."""
    lines = []
    for arch in sorted(_archs_in(sass)):
        names = [n for a, n in sass if a == arch]
        parsed = {n: budget.kernel_of(n) for n in names}
        unknown = [n for n, p in parsed.items() if p is None]
        assert not unknown, f"sm_{arch}: kernels other than ffn_ext::cuda::rows_kernel: {unknown}"
        found = {(f, dt) for f, dt, _ in parsed.values()}
        assert len(found) == len(names), f"sm_{arch}: duplicate instantiations: {sorted(names)}"
        assert found == EXPECTED_KERNELS, (f"sm_{arch}: missing {sorted(EXPECTED_KERNELS - found)}, "
                                           f"unexpected {sorted(found - EXPECTED_KERNELS)}")
        for f, dt, vec in parsed.values():
            size = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}[dt]
            assert vec * size == 16, f"sm_{arch}: rows_kernel<{dt}, {f}> uses VEC={vec}: {vec * size}-byte packs"
        lines += [f"sm_{arch} rows_kernel<{dt}, {f}, VEC={vec}>" for f, dt, vec in sorted(parsed.values())]
    print(f"\n{len(lines)} kernels:\n" + "\n".join(lines))


def test_arch_list_matches_request_and_build_info(sass):
    text, want_sass, want_ptx = requested_archs()
    elf = dump("elf")
    ptx = dump("ptx")
    cubin_archs = {int(a) for a in re.findall(r"\.sm_(\d+)[af]?\.cubin", elf)}
    ptx_archs = {int(a) for a in re.findall(r"\.sm_(\d+)[af]?\.ptx", ptx)}
    assert cubin_archs == _archs_in(sass), (elf, sorted(_archs_in(sass)))
    hint = (f"(expected from {'TORCH_CUDA_ARCH_LIST' if os.environ.get('TORCH_CUDA_ARCH_LIST') else 'default_cuda_archs'}"
            f"={text!r}; rebuild, or set TORCH_CUDA_ARCH_LIST to the list the extension was built with)")
    assert cubin_archs == want_sass, f"SASS for {sorted(cubin_archs)}, expected {sorted(want_sass)} {hint}"
    assert ptx_archs == want_ptx, f"PTX for {sorted(ptx_archs)}, expected {sorted(want_ptx)} {hint}"
    if not os.environ.get(LIB_ENV):
        reported = {int(a) // 10 for a in re.findall(r"\d+", ffn_ext.build_info().get("cuda_archs", ""))}
        assert reported == cubin_archs, f"build_info() says cuda_archs={ffn_ext.build_info().get('cuda_archs')!r}"


def test_default_arch_list_is_ampere_and_hopper():
    """The project default must keep sm_80 and sm_90 code and PTX for the newest (forward compatibility)."""
    default = json.loads((ROOT / "csrc" / "build.json").read_text())["default_cuda_archs"]
    items = set(re.split(r"[;\s]+", default.strip()))
    assert {"8.0", "9.0+PTX"} <= items, default


@pytest.mark.parametrize("functor", sorted(FUNCTORS))
def test_vector_loads_and_stores_no_local_memory(sass, functor):
    ni, no = FUNCTORS[functor]
    checked = 0
    for (arch, name), insts in sorted(sass.items()):
        parsed = budget.kernel_of(name)
        if parsed is None or parsed[0] != functor:
            continue
        where = f"sm_{arch} rows_kernel<{parsed[1]}, {functor}>"
        loads = [i for i in insts if LOAD_128.search(i)]
        stores = [i for i in insts if STORE_128.search(i)]
        local = [i.strip() for i in insts if LOCAL_MEM.search(i)]
        assert len(loads) >= ni, f"{where}: {len(loads)} 128-bit global loads (LDG.*.128), want >= {ni} (one per input)"
        assert len(stores) >= no, f"{where}: {len(stores)} 128-bit global stores (STG.*.128), want >= {no}"
        assert not local, f"{where}: local memory traffic (spills?): {local[:5]}"
        checked += 1
    assert checked == 4 * len(_archs_in(sass)), f"{functor}: {checked} kernels checked, want 4 dtypes x archs"


def test_no_stack_or_local_memory_in_resource_usage(sass):
    res = parse_resources(dump("res"))
    ours = {k: v for k, v in res.items() if budget.kernel_of(k[1]) is not None}
    assert len(ours) == len(sass), f"resource usage for {len(ours)} kernels, SASS for {len(sass)}"
    bad = {f"sm_{a} {budget.kernel_of(n)}": r for (a, n), r in ours.items() if r.get("STACK") or r.get("LOCAL")}
    assert not bad, f"kernels with stack or local memory: {bad}"
    regs = sorted((r["REG"], a, budget.kernel_of(n)) for (a, n), r in ours.items())
    print(f"\nregisters: min {regs[0]}, max {regs[-1]}")
    # __launch_bounds__(256): up to 255 registers fit; more than 128 would halve the resident warps.
    assert regs[-1][0] <= 128, f"register use above 128: {regs[-5:]}"


def test_vector_path_fits_the_issue_budget(sass):
    """The path nearly every thread of a large tensor takes (benchmarks/sass_budget.py): kUnroll 128-bit loads
    per input and stores per output, all issued before the first floating-point instruction, and, on sm_90, few
    enough instructions per byte moved that an H200 can issue them at 92% of copy bandwidth (the target of the
    CUDA kernels issue). The bound is calibrated against Nsight Compute on the 2026-11-30 H200 run, where
    exact-erf GELU needed 8.7 instructions per byte and ran at 74%.
    float64 is exempt: its arithmetic issues at half rate, so instruction count alone does not bound it."""
    text = dump("sass")
    limit = budget.H200_INSTR_PER_BYTE / 0.92
    checked = 0
    for arch in sorted(_archs_in(sass)):
        rows = budget.budget(text, arch)
        assert len(rows) == len(EXPECTED_KERNELS), f"sm_{arch}: traced {len(rows)} kernels"
        for r in rows:
            where = f"sm_{arch} {r['op']} {r['dtype']}"
            assert (r["loads"], r["stores"]) == (r["want_loads"], r["want_stores"]), (
                f"{where}: the traced vector path has {r['loads']} 128-bit loads and {r['stores']} stores, want "
                f"{r['want_loads']} and {r['want_stores']} (the SASS layout changed, or the tracer lost its way)")
            assert r["math_before_last_load"] == 0, (
                f"{where}: {r['math_before_last_load']} floating-point instructions issue before the vector path's "
                "last 128-bit load: ptxas sank loads below math, so fewer bytes are in flight (csrc/rows.h never())")
            if arch == 90 and r["dtype"] != "float64":
                assert r["instr_per_byte"] <= limit, (
                    f"{where}: {r['instr_per_elem']:.1f} instructions per element, {r['instr_per_byte']:.2f} per "
                    f"byte moved: above {limit:.2f}, an H200 could not issue them at 92% of copy bandwidth")
                checked += 1
    if 90 in _archs_in(sass):
        assert checked == 18  # 6 ops x 3 dtypes
        print("\n" + budget.table(budget.budget(text, 90), 90))


def test_vector_path_tracer_on_a_sample():
    """The tracer follows the vector path: it jumps past code with scalar loads/stores, falls through into the
    128-bit access a branch guards, and stops at the row loop's back edge."""
    sample = [
        (0x00, "S2R R0, SR_TID.X"),
        (0x10, "@P0 BRA 0x40"),                     # skip the head (scalar code)
        (0x20, "LDG.E.U16 R2, desc[UR4][R4.64]"),
        (0x30, "STG.E.U16 desc[UR4][R4.64], R2"),
        (0x40, "@P1 BRA 0x70"),                     # would skip the 128-bit load: fall through
        (0x50, "LDG.E.128 R8, desc[UR4][R6.64]"),
        (0x60, "FFMA R8, R8, R9, R10"),
        (0x70, "@!P2 BRA 0xa0"),                    # scalar store path skipped
        (0x80, "STG.E.U16 desc[UR4][R6.64], R8"),
        (0x90, "BRA 0xb0"),
        (0xa0, "STG.E.128.STRONG.GPU desc[UR4][R6.64], R8"),
        (0xb0, "NOP"),
        (0xc0, "BRA 0x00"),                         # the row loop: one row only
        (0xd0, "EXIT"),
    ]
    assert budget.vector_path(sample, 1, 1) == (8, 1, 1)  # 0x00 0x10 0x40 0x50 0x60 0x70 0xa0 0xc0


def test_vector_path_tracer_takes_the_fast_body():
    """A fast body (no range checks, no element-wise fallback) placed after the general one, as nvcc lays out
    rows.h's two instantiations: the tracer jumps into it, because the general body holds scalar accesses, and
    counts the fast body only; it does not jump past math (the isinf branch) or past a 128-bit access."""
    sample = [
        (0x00, "ISETP.GE.AND P0, PT, R0, R1, PT"),
        (0x10, "@!P2 BRA P0, 0x80"),                # to the fast body
        (0x20, "@P1 LDG.E.U16 R2, desc[UR4][R4.64]"),   # general body: element-wise fallback, predicated
        (0x30, "@!P1 LDG.E.128 R8, desc[UR4][R6.64]"),
        (0x40, "FFMA R8, R8, R9, R10"),
        (0x50, "@P1 STG.E.U16 desc[UR4][R6.64], R8"),
        (0x60, "@!P1 STG.E.128 desc[UR4][R6.64], R8"),
        (0x70, "BRA 0xe0"),
        (0x80, "LDG.E.128 R8, desc[UR4][R6.64]"),   # fast body
        (0x90, "@P3 BRA 0xb0"),                     # x = inf: skips math only, fall through
        (0xa0, "FFMA R8, R8, R9, R10"),
        (0xb0, "FMUL R8, R8, R9"),
        (0xc0, "STG.E.128 desc[UR4][R6.64], R8"),
        (0xd0, "NOP"),
        (0xe0, "EXIT"),
    ]
    path = []
    assert budget.vector_path(sample, 1, 1, path) == (8, 1, 1)
    assert [sample[i][0] for i in path] == [0x00, 0x10, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xe0]
    with pytest.raises(RuntimeError, match="no path"):
        budget.vector_path(sample, 2, 1)


def test_parsers_on_a_sample():
    """The SASS parser itself (so a format change in cuobjdump fails here instead of passing vacuously)."""
    sample = """
Fatbin elf code:
================
arch = sm_90
code version = [1,8]

	code for sm_90
		Function : _ZN7ffn_ext4cuda11rows_kernelIfNS_4math7SiluFwdELi4EEEvNS0_10RowProblemIXsrT0_2NIEXsrS5_2NOEEES5_
	.headerflags	@"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDG.E.128 R4, desc[UR4][R2.64] ;     /* 0x000 */
        /*0010*/                   STL.64 [R1], R4 ;                    /* 0x000 */
        /*0020*/                   STG.E.128.STRONG.GPU desc[UR4][R6.64], R8 ;   /* 0x000 */
"""
    funcs = parse_sass(sample)
    ((key, insts),) = funcs.items()
    assert key[0] == 90 and budget.kernel_of(key[1]) == ("SiluFwd", "float32", 4)
    assert len(insts) == 3
    assert LOAD_128.search(insts[0]) and STORE_128.search(insts[2]) and LOCAL_MEM.search(insts[1])
    assert not LOAD_128.search("LDG.E.64 R4, [R2.64]") and not LOCAL_MEM.search("LDG.E R4, [R2.64]")
    assert budget.kernel_of(
        "_ZN7ffn_ext4cuda11rows_kernelIN3c108BFloat16ENS_4math9SwigluBwdELi8EEEvNS0_10RowProblemIXsrT0_2NIEXsrS7_2NOEEES7_"
    ) == ("SwigluBwd", "bfloat16", 8)
