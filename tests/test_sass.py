"""Machine code of the CUDA kernels, read without a GPU (tests/sass_reader.py): what a regression in the code
would break, not how many instructions a kernel takes (benchmarks/sass_budget.py reports that, since the counts
move with each nvcc release).

`cuobjdump` (shipped in the triton package that the CUDA build of torch installs, triton/backends/nvidia/bin; else
$CUDA_HOME/bin or PATH) dumps the SASS of the built extension (the loaded ffn_ext native library, or the file named
by FFN_EXT_SASS_LIB, e.g. a CMake-built libffn_ext_ops.so). For every architecture:
  * the binary holds exactly the rows_kernel instantiations that ffn_ext.table predicts (sass_reader.KERNELS:
    UnaryFwd/UnaryBwd/UnaryBwdRecompute per activation, GatedFwd/GatedBwd/GatedBwdRecompute per gated op over its
    gate functor (Glu<Act>, or its own: SwigluClamped), and each packed op's Interleaved<GatedFwd<G>, 0, -1> /
    Interleaved<GatedBwd<G>, 1, 0>; x 4 dtypes, VEC = 16 bytes / sizeof(T)) and no other kernel, so an op added to one table and not the other fails;
    and each FP8 quantizing kernel once per (kind, op, dtype, layout);
  * the vector body uses 128-bit global loads (LDG...128) and stores (STG...128), at least one per operand (the
    quantizing kernels: 16-byte loads and the 8-byte fp8 store);
  * no local memory traffic (LDL/STL) and no stack (register spills would show up as both), and the register caps
    of the launch bounds hold;
  * the vector path (sass_reader.vector_path) moves kUnroll 16-byte packs per operand (an interleaved pair
    operand: two per VEC elements) and issues all its loads before any floating-point math (csrc/rows.h);
  * sm_90's quantizing kernels convert to fp8 with the hardware instruction;
  * the FP8 activation cache's kernels: once per (kind, gated op, dtype), no spills, their vector accesses;
and the binary holds exactly the SASS and PTX the architecture list asked for (TORCH_CUDA_ARCH_LIST, else
default_cuda_archs of csrc/build.json), which must also be what the build reports (build_info()['cuda_archs']).
Skips when the extension has no CUDA kernels or no cuobjdump is found.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import pytest
import sass_reader as S

import ffn_ext
from ffn_ext import _build
from ffn_ext.table import ACTIVATIONS, GATED, GATED_BY_NAME, OPS

ROOT = Path(__file__).resolve().parent.parent
LIB_ENV = "FFN_EXT_SASS_LIB"

EXPECTED_KERNELS = S.expected_kernels()  # {(functor, dtype)}: (3 x activations + 5 x gated ops) x 4 dtypes per arch


# ---------------------------------------------------------------- locating the binary
def _library() -> tuple[str | None, str]:
    """(path of the binary to inspect, why not) ."""
    if os.environ.get(LIB_ENV):
        return os.environ[LIB_ENV], ""
    return S.native_library()


def requested_archs() -> tuple[str, set[int], set[int]]:
    """(the list, SASS archs, PTX archs) from TORCH_CUDA_ARCH_LIST or the project default."""
    text = os.environ.get("TORCH_CUDA_ARCH_LIST") or _build.config()["default_cuda_archs"]
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


@functools.cache
def dump(kind: str) -> str:
    lib, why = _library()
    if lib is None:
        pytest.skip(why)
    if S.cuobjdump() is None:
        pytest.skip("cuobjdump not found (install triton, or set CUDA_HOME to a toolkit that has it)")
    return S.dump(lib, kind)


@pytest.fixture(scope="module")
def sass():
    """The row-op kernels' SASS (the op table's kernels; the FP8 quantizing kernels are checked apart, below)."""
    funcs = S.parse_sass(dump("sass"))
    assert funcs, "cuobjdump found no SASS functions in the extension"
    return {k: v for k, v in funcs.items() if not _is_quant(k[1])}


QUANT_KINDS = ("quant_kernel", "quant_row_kernel", "quant_tensor_kernel")  # scaling "group", "row", "tensor"


def _quant_kind(name: str) -> str | None:
    """ffn_ext::quant::(anonymous)::quant_kernel / quant_row_kernel / quant_tensor_kernel<...>, mangled."""
    m = re.search(r"5quant.*?\d+(quant_(?:row_|tensor_)?kernel)I", name)
    return m.group(1) if m else None


def _is_quant(name: str) -> bool:
    """A quantizing kernel, or one of the FP8 activation cache's (checked apart from the row kernels too)."""
    return _quant_kind(name) is not None or _cache_kernel(name) is not None


CACHE_KINDS = ("cache_kernel", "cached_backward_kernel")  # <gated>_cache, <gated>_cached_backward
_CACHE = re.compile(r"5quant.*?\d+(cache_kernel|cached_backward_kernel)I(N3c108BFloat16E|N3c104HalfE|f)(?=N)")


def _cache_kernel(name: str) -> tuple[str, str] | None:
    """(kind, dtype) of ffn_ext::quant::(anonymous)::cache_kernel / cached_backward_kernel<T, Gate>, mangled."""
    m = _CACHE.search(name)
    return (m.group(1), S.DTYPES[m.group(2)][0]) if m else None


def test_quant_kernels_use_no_stack_or_local_memory():
    """The FP8 quantizing kernels (csrc/cuda/quant_part*.cu): present for every arch, and no spills (stack or local
    memory) in their resource usage (the row kernel keeps kRowChunks x 8 floats of h per thread in registers)."""
    res = {k: v for k, v in S.parse_resources(dump("res")).items() if _is_quant(k[1])}
    assert res, "no quant_kernel in the extension's resource usage"
    bad = {f"sm_{a} {n}": r for (a, n), r in res.items() if r.get("STACK") or r.get("LOCAL")}
    assert not bad, f"quantizing kernels with stack or local memory: {bad}"


def test_quant_kernel_inventory():
    """Per arch, each quantizing kernel (group, row, tensor) once per (op, input dtype, pair layout): 3 dtypes x
    (quantize + each gated op with two operands or one interleaved pair); the recipe is runtime data, so no
    more (quant_kernels.cuh's header says the count; the parts hold each kernel once)."""
    res = S.parse_resources(dump("res"))
    per = 3 * (1 + 2 * len(GATED))
    archs = {a for a, _ in res}
    assert archs
    for arch in sorted(archs):
        kinds = [_quant_kind(n) for a, n in res if a == arch and _is_quant(n)]
        counts = {k: kinds.count(k) for k in QUANT_KINDS}
        assert counts == dict.fromkeys(QUANT_KINDS, per), f"sm_{arch}: {counts}, expected {per} of each"


def test_cache_kernels_inventory_and_no_spills():
    """The FP8 activation cache's kernels (csrc/cache_kernel.h, in quant_part*.cu): per arch, each kind once per
    (gated op, input dtype: float32, float16, bfloat16), and no stack or local memory."""
    res = {k: v for k, v in S.parse_resources(dump("res")).items() if _cache_kernel(k[1]) is not None}
    archs = {a for a, _ in res}
    assert archs, "no cache_kernel in the extension's resource usage"
    for arch in sorted(archs):
        kinds = [_cache_kernel(n)[0] for a, n in res if a == arch]
        counts = {k: kinds.count(k) for k in CACHE_KINDS}
        assert counts == dict.fromkeys(CACHE_KINDS, 3 * len(GATED)), f"sm_{arch}: {counts}"
    bad = {f"sm_{a} {n}": r for (a, n), r in res.items() if r.get("STACK") or r.get("LOCAL")}
    assert not bad, f"cache kernels with stack or local memory: {bad}"


def test_cache_kernels_vector_accesses_and_conversion():
    """_cache loads a chunk of gate and of up with 16-byte loads, stores h's chunk with 16-byte stores and each
    fp8 chunk with an 8-byte store, converting with F2FP.SATFINITE.E4M3 on sm_90 (none on sm_80: the software
    path); _cached_backward loads its fp8 chunks with 8-byte loads and grad's with 16-byte ones, and stores dgate,
    dup and h with 16-byte stores (benchmarks/sass_budget.py does not trace these)."""
    funcs = {k: v for k, v in S.parse_sass(dump("sass")).items() if _cache_kernel(k[1]) is not None}
    assert funcs, "no cache kernel in the extension's SASS"
    load64 = re.compile(r"\bLDG(?:\.[A-Z0-9_]+)*\.64\b")
    store64 = re.compile(r"\bSTG(?:\.[A-Z0-9_]+)*\.64\b")
    for (arch, name), ins in funcs.items():
        kind, dtype = _cache_kernel(name)
        ops = [op for _, op in ins]
        chunk = S.QUANT_LANE * S.DTYPE_SIZE[dtype] // 16  # 16-byte accesses per chunk of 8 elements
        count = lambda r: sum(r.search(op) is not None for op in ops)  # noqa: E731
        where = f"sm_{arch} {kind} {dtype}"
        convs = {m.group(1) for op in ops if (m := S.F2FP_FP8.search(op))}
        if kind == "cache_kernel":
            assert count(S.LOAD_128) >= 2 * chunk, f"{where}: 16-byte loads"
            assert count(S.STORE_128) >= chunk and count(store64) >= 2, f"{where}: h's or the fp8 chunks' stores"
            assert convs == ({"E4M3"} if arch >= 89 else set()), f"{where}: fp8 conversions {convs}"
        else:
            assert count(load64) >= 2 and count(S.LOAD_128) >= chunk, f"{where}: the cache's or grad's loads"
            assert count(S.STORE_128) >= 3 * chunk, f"{where}: dgate, dup and h's stores"
            assert not convs, f"{where}: converts to fp8"


def _quant_funcs(arch: int) -> dict:
    funcs = S.parse_sass(dump("sass"))
    return {k: v for k, v in funcs.items() if k[0] == arch and S.quant_kernel_of(k[1]) is not None}


def test_quant_kernels_convert_with_the_hardware():
    """sm_90's quantizing kernels convert to fp8 with F2FP.SATFINITE.E4M3 / E5M2 (cvt.rn.satfinite.e4m3x2.f32 and
    e5m2x2: the recipe's format is runtime data, so each kernel has both); sm_80's have no such instruction and
    run ffn_math.h's software to_fp8 (tests/test_fp8_cvt.py checks the two agree bit for bit)."""
    archs = {a for a, _ in S.parse_sass(dump("sass"))}
    if 90 not in archs:
        pytest.skip("no sm_90 SASS in this build")
    per = 3 * 3 * (1 + 2 * len(GATED))  # kinds x dtypes x (quantize + gated ops x 2 layouts)
    for arch in sorted(archs):
        funcs = _quant_funcs(arch)
        assert len(funcs) == per, f"sm_{arch}: {len(funcs)} quantizing kernels decoded, want {per}"
        for (_, name), ins in funcs.items():
            found = {m.group(1) for _, t in ins if (m := S.F2FP_FP8.search(t))}
            want = {"E4M3", "E5M2"} if arch >= 89 else set()
            assert found == want, f"sm_{arch} {S.quant_kernel_of(name)}: fp8 conversions {found}, want {want}"


def test_quant_kernels_use_vector_accesses():
    """Every quantizing kernel of every arch loads its inputs with 16-byte loads, at least one lane's worth (a
    chunk of 8 elements per operand), and stores its fp8 chunks with 8-byte stores: the vector accesses their
    bandwidth rests on (benchmarks/sass_budget.py traces the steady state and reports its count)."""
    archs = {a for a, _ in S.parse_sass(dump("sass"))}
    per = 3 * 3 * (1 + 2 * len(GATED))  # kinds x dtypes x (quantize + gated ops x 2 layouts)
    for arch in sorted(archs):
        funcs = _quant_funcs(arch)
        assert len(funcs) == per, f"sm_{arch}: {len(funcs)} quantizing kernels decoded, want {per}"
        for (_, name), ins in funcs.items():
            k = S.quant_kernel_of(name)
            ni = 1 if k.op == "quantize" else 2  # an interleaved pair: the same bytes as two operands
            want = ni * S.QUANT_LANE * S.DTYPE_SIZE[k.dtype] // 16
            ops = [op for _, op in ins]
            loads = sum(S.LOAD_128.search(op) is not None for op in ops)
            stores = sum(re.search(r"\bSTG(?:\.[A-Z0-9_]+)*\.64\b", op) is not None for op in ops)
            assert loads >= want, f"sm_{arch} {k}: {loads} 16-byte loads (LDG.*.128), want >= {want} (one chunk)"
            assert stores >= 1, f"sm_{arch} {k}: no 8-byte store (STG.*.64) of an fp8 chunk"


def test_quant_tracer_on_a_sample():
    """quant_budget's walk: the 8-byte store is the vector store, the group kernel's lane makes two chunks' loads
    and stores, its unrolled shuffle steps are counted, the writer lanes' block is added (its float32 route), a
    predicated EXIT may end the path before one thread's scalar store, and the count runs from the main loop's head
    to its back edge."""
    name = (
        "_ZN7ffn_ext5quant45_GLOBAL__N__0_8_quant_cu_0_12quant_kernelIN3c108BFloat16E"
        "NS0_6GatedHINS_4math3GluINS6_4SiluEEEEELb0EEEvNS0_12QuantProblemET0_"
    )
    assert S.quant_kernel_of(name) == S.QuantKernel("group", "swiglu", "GatedH<Glu<Silu>>", "bfloat16", False)
    sample = [
        (0x00, "S2R R0, SR_TID.X"),  # before the loop: not counted
        (0x10, "@P4 LDG.E.128 R8, desc[UR4][R6.64]"),  # loop head: the first chunk
        (0x20, "@P4 LDG.E.128 R12, desc[UR4][R4.64]"),
        (0x30, "@!P4 LDG.E.U16 R2, desc[UR4][R4.64]"),  # the if-converted fallback: issued, counted
        (0x40, "LDG.E.128 R16, desc[UR4][R6.64+0x40]"),  # the second chunk
        (0x50, "LDG.E.128 R20, desc[UR4][R4.64+0x40]"),
        (0x60, "@!P2 BRA 0x80"),  # a shuffle step, taken
        (0x70, "SHFL.BFLY PT, R17, R14, 0x1, 0x1f"),
        (0x80, "F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C R14, R15, R14, RZ"),
        (0x90, "@!P0 BRA 0xb0"),
        (0xA0, "STG.E.U8 desc[UR4][R18.64], R14"),  # a chunk stored byte by byte: skipped
        (0xB0, "STG.E.64 desc[UR4][R18.64], R14"),
        (0xC0, "STG.E.64 desc[UR4][R18.64+0x40], R16"),
        (0xD0, "@P3 BRA 0x120"),  # not a writer lane
        (0xE0, "@!P1 BRA 0x110"),  # the writer block: float32 or e8m0 scales
        (0xF0, "STG.E.U8 desc[UR4][R10.64], R21"),
        (0x100, "BRA 0x120"),
        (0x110, "STG.E desc[UR4][R12.64], R21"),
        (0x120, "BSYNC B0"),
        (0x130, "@P1 BRA 0x10"),  # the grid-stride loop
        (0x140, "EXIT"),
    ]
    funcs = {(90, name): sample}
    (r,) = S.quant_budget(funcs, 90)
    # 0x10-0x90 (9), 0xb0 0xc0 0xd0 0x120 0x130, and the writer's 0xe0 0x110
    assert r["instr_per_iter"] == 9 + 5 + 2 and r["instr_per_elem"] == 16 / 16 and r["f2fp"] == ["E4M3"]
    amax = [(0x00, "@P4 LDG.E.128 R8, desc[UR4][R6.64]"), (0x10, "@P1 BRA 0x00"), (0x20, "@P0 EXIT")]
    amax += [(0x30, "STG.E desc[UR4][R2.64], R13"), (0x40, "EXIT")]
    assert S.vector_path(amax, 1, 0, None, S.QUANT_VECTOR, S.QUANT_SCALAR, exits=True) == (3, 1, 0)


def _archs_in(funcs) -> set[int]:
    return {a for a, _ in funcs}


# ---------------------------------------------------------------- tests
def test_kernel_list_follows_the_table():
    """sass_reader.KERNELS is the op table read as kernels: per activation its C++ functor (CamelCase of the
    name, as csrc/ops_table.h spells it) in UnaryFwd / UnaryBwd / UnaryBwdRecompute; per gated op its gate functor
    (Glu<Act> for act(gate) * up, else the CamelCase of the op's name) in GatedFwd / GatedBwd, which the concat packed
    ops run too, and GatedBwdRecompute, and in Interleaved<GatedFwd<G>, 0, -1> / Interleaved<GatedBwd<G>, 1, 0> for
    the interleaved layout."""
    assert S.act_struct("gelu") == "Gelu" and S.act_struct("gelu_tanh") == "GeluTanh" and S.act_struct("silu") == "Silu"
    assert S.gate_struct(GATED_BY_NAME["swiglu"]) == "Glu<Silu>"
    assert S.gate_struct(GATED_BY_NAME["geglu_tanh"]) == "Glu<GeluTanh>"
    assert S.gate_struct(GATED_BY_NAME["swiglu_clamped"]) == "SwigluClamped"
    want = {
        f"{shape}<{S.act_struct(a.name)}>"
        for a in ACTIVATIONS
        for shape in ("UnaryFwd", "UnaryBwd", "UnaryBwdRecompute")
    }
    for g in GATED:
        gate = S.gate_struct(g)
        want |= {
            f"GatedFwd<{gate}>",
            f"GatedBwd<{gate}>",
            f"GatedBwdRecompute<{gate}>",
            f"Interleaved<GatedFwd<{gate}>, 0, -1>",
            f"Interleaved<GatedBwd<{gate}>, 1, 0>",
        }
    assert set(S.KERNELS) == want
    ops_run = [op for k in S.KERNELS.values() for op in (k.op, *k.also)]
    packed = [name for name, spec in OPS.items() if spec.kind == "packed"]
    assert sorted(ops_run) == sorted([*OPS, *packed]), (
        "every unary and gated op runs one kernel, every packed op two (concat: its gated op's; interleaved: its own)"
    )
    assert S.KERNELS["GatedBwd<Glu<GeluTanh>>"] == S.KernelSpec(
        "geglu_tanh_backward", 3, 2, ("geglu_tanh_packed_backward",)
    )
    assert S.KERNELS["UnaryFwd<Silu>"] == S.KernelSpec("silu", 1, 1)
    assert S.KERNELS["GatedFwd<SwigluClamped>"] == S.KernelSpec("swiglu_clamped", 2, 1, ("swiglu_clamped_packed",))
    # an interleaved kernel moves its gated op's elements (the pair operand: two per element)
    assert S.KERNELS["Interleaved<GatedFwd<Glu<Silu>>, 0, -1>"] == S.KernelSpec("swiglu_packed", 2, 1)
    assert S.KERNELS["Interleaved<GatedBwd<SwigluClamped>, 1, 0>"] == S.KernelSpec(
        "swiglu_clamped_packed_backward", 3, 2
    )
    assert list(S.KERNELS)[:2] == ["UnaryFwd<Gelu>", "UnaryBwd<Gelu>"]  # the table's order
    assert S.KERNELS["GatedBwdRecompute<Glu<Silu>>"] == S.KernelSpec("swiglu_backward_recompute", 3, 3)
    assert len(EXPECTED_KERNELS) == (3 * len(ACTIVATIONS) + 5 * len(GATED)) * 4


def test_kernel_inventory(sass):
    """Exactly the rows_kernel instantiations the table predicts (KERNELS x 4 dtypes, VEC = 16 bytes / sizeof(T))
    per arch, and no other kernel."""
    lines = []
    for arch in sorted(_archs_in(sass)):
        names = [n for a, n in sass if a == arch]
        parsed = {n: S.kernel_of(n) for n in names}
        unknown = [n for n, p in parsed.items() if p is None]
        assert not unknown, (
            f"sm_{arch}: kernels other than ffn_ext::cuda::rows_kernel<T, math::Shape<Arg>, VEC> or "
            f"<T, math::Interleaved<math::Shape<Arg>, int, int>, VEC>: {unknown}"
        )
        found = {(k.functor, k.dtype) for k in parsed.values()}
        assert len(found) == len(names), f"sm_{arch}: duplicate instantiations: {sorted(names)}"
        assert found == EXPECTED_KERNELS, (
            f"sm_{arch}: the binary and ffn_ext.table disagree: in the binary only "
            f"{sorted(found - EXPECTED_KERNELS)}, predicted only {sorted(EXPECTED_KERNELS - found)} (is the C++ "
            "functor of each activation the CamelCase of its table name, and each gated op's gate Glu<Act> or the "
            "CamelCase of its name? csrc/ops_table.h, ffn_ext/table.py, sass_reader.gate_struct)"
        )
        for k in parsed.values():
            size = k.vec * S.DTYPE_SIZE[k.dtype]
            assert size == 16, f"sm_{arch}: {k} uses {size}-byte packs"
        lines += [f"sm_{arch} {k}" for k in sorted(parsed.values(), key=str)]
    print(f"\n{len(lines)} kernels:\n" + "\n".join(lines))


def test_arch_list_matches_request_and_build_info(sass):
    text, want_sass, want_ptx = requested_archs()
    elf = dump("elf")
    ptx = dump("ptx")
    cubin_archs = {int(a) for a in re.findall(r"\.sm_(\d+)[af]?\.cubin", elf)}
    ptx_archs = {int(a) for a in re.findall(r"\.sm_(\d+)[af]?\.ptx", ptx)}
    assert cubin_archs == _archs_in(sass), (elf, sorted(_archs_in(sass)))
    source = "TORCH_CUDA_ARCH_LIST" if os.environ.get("TORCH_CUDA_ARCH_LIST") else "default_cuda_archs"
    hint = f"(expected from {source}={text!r}; rebuild, or set TORCH_CUDA_ARCH_LIST to the list the extension was built with)"
    assert cubin_archs == want_sass, f"SASS for {sorted(cubin_archs)}, expected {sorted(want_sass)} {hint}"
    assert ptx_archs == want_ptx, f"PTX for {sorted(ptx_archs)}, expected {sorted(want_ptx)} {hint}"
    if not os.environ.get(LIB_ENV):
        reported = {int(a) // 10 for a in re.findall(r"\d+", ffn_ext.build_info().get("cuda_archs", ""))}
        assert reported == cubin_archs, f"build_info() says cuda_archs={ffn_ext.build_info().get('cuda_archs')!r}"


def test_default_arch_list_is_ampere_and_hopper():
    """The project default must keep sm_80 and sm_90 code and PTX for the newest (forward compatibility)."""
    default = _build.config()["default_cuda_archs"]  # the checkout's build.json, or the copy an install ships
    items = set(re.split(r"[;\s]+", default.strip()))
    assert {"8.0", "9.0+PTX"} <= items, default


@pytest.mark.parametrize("functor", list(S.KERNELS))
def test_vector_loads_and_stores_no_local_memory(sass, functor):
    checked = 0
    for (arch, name), insts in sorted(sass.items()):
        k = S.kernel_of(name)
        if k is None or k.functor != functor:
            continue
        spec = S.KERNELS[k.functor]
        where = f"sm_{arch} {k}"
        ops = [op for _, op in insts]
        loads = [i for i in ops if S.LOAD_128.search(i)]
        stores = [i for i in ops if S.STORE_128.search(i)]
        local = [i for i in ops if S.LOCAL_MEM.search(i)]
        assert len(loads) >= spec.ni, (
            f"{where}: {len(loads)} 128-bit global loads (LDG.*.128), want >= {spec.ni} (one per input)"
        )
        assert len(stores) >= spec.no, f"{where}: {len(stores)} 128-bit global stores (STG.*.128), want >= {spec.no}"
        assert not local, f"{where}: local memory traffic (spills?): {local[:5]}"
        checked += 1
    assert checked == 4 * len(_archs_in(sass)), f"{functor}: {checked} kernels checked, want 4 dtypes x archs"


def test_no_stack_or_local_memory_in_resource_usage(sass):
    res = S.parse_resources(dump("res"))
    ours = {k: v for k, v in res.items() if S.kernel_of(k[1]) is not None}
    assert len(ours) == len(sass), f"resource usage for {len(ours)} kernels, SASS for {len(sass)}"
    bad = {f"sm_{a} {S.kernel_of(n)}": r for (a, n), r in ours.items() if r.get("STACK") or r.get("LOCAL")}
    assert not bad, f"kernels with stack or local memory: {bad}"
    regs = sorted((r["REG"], a, str(S.kernel_of(n))) for (a, n), r in ours.items())
    print(f"\nregisters: min {regs[0]}, max {regs[-1]}")
    # __launch_bounds__(256): up to 255 registers fit; more than 128 would halve the resident warps. float64 is not
    # capped (rows_launcher.cuh min_blocks: its erf/exp spilled at 128), nor ReGLU's 16-bit backward (it spilled 8
    # bytes at 128 on sm_80; 136-155 registers uncapped), nor GeGLU's and GeGLU-tanh's gated backward that also
    # writes h (it spilled 8 bytes at 128), so those only have to fit.
    uncapped = ("float64", "GatedBwd<Glu<Relu>>", "GatedBwdRecompute<Glu<Gelu>>", "GatedBwdRecompute<Glu<GeluTanh>>")
    over = [r for r in regs if r[0] > (255 if any(u in r[2] for u in uncapped) else 128)]
    assert not over, f"register use above the cap: {over}"


def test_vector_path_loads_all_before_math(sass):
    """The path nearly every thread of a large tensor takes (sass_reader.vector_path), traced in every kernel of
    every arch: kUnroll 128-bit loads per input and stores per output (an interleaved pair operand counts as its
    two inputs or outputs: two 16-byte accesses per VEC elements), all loads issued before the first
    floating-point instruction, so that every byte a thread reads is in flight at once (csrc/rows.h never()), and,
    but for float64 (which has no kFull body), neither a range check on its 128-bit accesses nor an element-wise
    access: the path is rows.h's kFull body, so one narrowed access there cannot pass by the tracer taking the
    general body instead.
    How many instructions the path takes is benchmarks/sass_budget.py's report, not a check."""
    for arch in sorted(_archs_in(sass)):
        rows = S.budget(sass, arch)
        assert len(rows) == len(EXPECTED_KERNELS), f"sm_{arch}: traced {len(rows)} kernels"
        for r in rows:
            where = f"sm_{arch} {r['op']} ({r['kernel']}) {r['dtype']}"
            assert (r["loads"], r["stores"]) == (r["want_loads"], r["want_stores"]), (
                f"{where}: the traced vector path has {r['loads']} 128-bit loads and {r['stores']} stores, want "
                f"{r['want_loads']} and {r['want_stores']} (the SASS layout changed, or the tracer lost its way)"
            )
            assert r["math_before_last_load"] == 0, (
                f"{where}: {r['math_before_last_load']} floating-point instructions issue before the vector path's "
                "last 128-bit load: ptxas sank loads below math, so fewer bytes are in flight (csrc/rows.h never())"
            )
            if r["dtype"] != "float64":
                assert r["scalar_accesses"] == 0 and r["guarded_vector_accesses"] == 0, (
                    f"{where}: {r['scalar_accesses']} element-wise and {r['guarded_vector_accesses']} predicated "
                    "global accesses on the vector path: it is not rows.h's kFull body (does that body still make "
                    "kUnroll unpredicated 128-bit accesses per operand?)"
                )


def test_vector_path_tracer_on_a_sample():
    """The tracer follows the vector path: it jumps past code with scalar loads/stores, falls through into the
    128-bit access a branch guards, and stops at the row loop's back edge."""
    sample = [
        (0x00, "S2R R0, SR_TID.X"),
        (0x10, "@P0 BRA 0x40"),  # skip the head (scalar code)
        (0x20, "LDG.E.U16 R2, desc[UR4][R4.64]"),
        (0x30, "STG.E.U16 desc[UR4][R4.64], R2"),
        (0x40, "@P1 BRA 0x70"),  # would skip the 128-bit load: fall through
        (0x50, "LDG.E.128 R8, desc[UR4][R6.64]"),
        (0x60, "FFMA R8, R8, R9, R10"),
        (0x70, "@!P2 BRA 0xa0"),  # scalar store path skipped
        (0x80, "STG.E.U16 desc[UR4][R6.64], R8"),
        (0x90, "BRA 0xb0"),
        (0xA0, "STG.E.128.STRONG.GPU desc[UR4][R6.64], R8"),
        (0xB0, "NOP"),
        (0xC0, "BRA 0x00"),  # the row loop: one row only
        (0xD0, "EXIT"),
    ]
    assert S.vector_path(sample, 1, 1) == (8, 1, 1)  # 0x00 0x10 0x40 0x50 0x60 0x70 0xa0 0xc0


def test_vector_path_tracer_takes_the_fast_body():
    """A fast body (no range checks, no element-wise fallback) placed after the general one, as nvcc lays out
    rows.h's two instantiations: the tracer jumps into it, because the general body holds scalar accesses, and
    counts the fast body only; it does not jump past math (the isinf branch) or past a 128-bit access."""
    sample = [
        (0x00, "ISETP.GE.AND P0, PT, R0, R1, PT"),
        (0x10, "@!P2 BRA P0, 0x80"),  # to the fast body
        (0x20, "@P1 LDG.E.U16 R2, desc[UR4][R4.64]"),  # general body: element-wise fallback, predicated
        (0x30, "@!P1 LDG.E.128 R8, desc[UR4][R6.64]"),
        (0x40, "FFMA R8, R8, R9, R10"),
        (0x50, "@P1 STG.E.U16 desc[UR4][R6.64], R8"),
        (0x60, "@!P1 STG.E.128 desc[UR4][R6.64], R8"),
        (0x70, "BRA 0xe0"),
        (0x80, "LDG.E.128 R8, desc[UR4][R6.64]"),  # fast body
        (0x90, "@P3 BRA 0xb0"),  # x = inf: skips math only, fall through
        (0xA0, "FFMA R8, R8, R9, R10"),
        (0xB0, "FMUL R8, R8, R9"),
        (0xC0, "STG.E.128 desc[UR4][R6.64], R8"),
        (0xD0, "NOP"),
        (0xE0, "EXIT"),
    ]
    path = []
    assert S.vector_path(sample, 1, 1, path) == (8, 1, 1)
    assert [sample[i][0] for i in path] == [0x00, 0x10, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xE0]
    with pytest.raises(RuntimeError, match="no path"):
        S.vector_path(sample, 2, 1)


def test_parsers_on_a_sample():
    """The SASS and resource parsers and the name decoder (so a format change in cuobjdump, or in how the kernels
    are named, fails here instead of passing vacuously)."""
    sample = """
Fatbin elf code:
================
arch = sm_90
code version = [1,8]

	code for sm_90
		Function : _ZN7ffn_ext4cuda11rows_kernelIfNS_4math8UnaryFwdINS2_4SiluEEELi4EEEvNS_4rows10RowProblemIXsrT0_2NIEXsrS8_2NOEEES8_
	.headerflags	@"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDG.E.128 R4, desc[UR4][R2.64] ;     /* 0x000 */
        /*0010*/                   STL.64 [R1], R4 ;                    /* 0x000 */
        /*0020*/              @!P0 STG.E.128.STRONG.GPU desc[UR4][R6.64], R8 ;   /* 0x000 */
"""
    funcs = S.parse_sass(sample)
    ((key, insts),) = funcs.items()
    assert key[0] == 90 and S.kernel_of(key[1]) == S.Kernel("UnaryFwd", "Silu", "float32", 4)
    assert [a for a, _ in insts] == [0x0, 0x10, 0x20]
    assert insts[2][1] == "@!P0 STG.E.128.STRONG.GPU desc[UR4][R6.64], R8"
    ops = [op for _, op in insts]
    assert S.LOAD_128.search(ops[0]) and S.STORE_128.search(ops[2]) and S.LOCAL_MEM.search(ops[1])
    assert not S.LOAD_128.search("LDG.E.64 R4, [R2.64]") and not S.LOCAL_MEM.search("LDG.E R4, [R2.64]")
    # the names in the binary: math::<Shape><math::<Arg>>, the namespace substitution depends on the dtype
    assert S.kernel_of(
        "_ZN7ffn_ext4cuda11rows_kernelIdNS_4math8UnaryBwdINS2_4GeluEEELi2EEEvNS_4rows10RowProblemIX"
        "srT0_2NIEXsrS8_2NOEEES8_"
    ) == S.Kernel("UnaryBwd", "Gelu", "float64", 2)
    # gated kernels: a gate functor, Glu<Act> or one of its own, and the interleaved form with its int arguments
    k = S.kernel_of(
        "_ZN7ffn_ext4cuda11rows_kernelIN3c104HalfENS_4math8GatedFwdINS4_3GluINS4_4SiluEEEEELi8EEEvNS_4rows"
        "10RowProblemIXsrT0_2NIEXsrSC_2NOEEESC_"
    )
    assert k == S.Kernel("GatedFwd", "Glu<Silu>", "float16", 8) and k.functor == "GatedFwd<Glu<Silu>>"
    assert (k.functor, k.dtype) in EXPECTED_KERNELS and not k.interleaved
    k = S.kernel_of(
        "_ZN7ffn_ext4cuda11rows_kernelIfNS_4math8GatedBwdINS2_13SwigluClampedEEELi4EEEvNS_4rows10RowProblem"
        "IXsrT0_2NIEXsrS8_2NOEEES8_"
    )
    assert k == S.Kernel("GatedBwd", "SwigluClamped", "float32", 4)
    k = S.kernel_of(
        "_ZN7ffn_ext4cuda11rows_kernelIN3c108BFloat16ENS_4math11InterleavedINS4_8GatedFwdINS4_3GluINS4_8"
        "GeluTanhEEEEELi0ELin1EEELi8EEEvNS_4rows10RowProblemIXsrT0_2NIEXsrSE_2NOEEESE_"
    )
    assert k == S.Kernel("GatedFwd", "Glu<GeluTanh>", "bfloat16", 8, 0, -1) and k.interleaved
    assert k.functor == "Interleaved<GatedFwd<Glu<GeluTanh>>, 0, -1>" and (k.functor, k.dtype) in EXPECTED_KERNELS
    k = S.kernel_of(
        "_ZN7ffn_ext4cuda11rows_kernelIdNS_4math11InterleavedINS2_8GatedBwdINS2_13SwigluClampedEEELi1ELi0E"
        "EELi2EEEvNS_4rows10RowProblemIXsrT0_2NIEXsrSA_2NOEEESA_"
    )
    assert k == S.Kernel("GatedBwd", "SwigluClamped", "float64", 2, 1, 0)
    assert str(k) == "rows_kernel<float64, Interleaved<GatedBwd<SwigluClamped>, 1, 0>, VEC=2>"
    # a plain functor (the names before the op table) still decodes, and the inventory test would reject it
    old = S.kernel_of(
        "_ZN7ffn_ext4cuda11rows_kernelIN3c108BFloat16ENS_4math9SwigluBwdELi8EEEvNS0_10RowProblemIXsrT0_"
        "2NIEXsrS7_2NOEEES7_"
    )
    assert old == S.Kernel("SwigluBwd", None, "bfloat16", 8) and (old.functor, old.dtype) not in EXPECTED_KERNELS
    # so does an activation where a gate belongs (the names before Glu): decoded as it is, not predicted
    k = S.kernel_of(
        "_ZN7ffn_ext4cuda11rows_kernelIN3c108BFloat16ENS_4math8GatedBwdINS4_8GeluTanhEEELi8EEEvNS_4rows"
        "10RowProblemIXsrT0_2NIEXsrSA_2NOEEESA_"
    )
    assert k.functor == "GatedBwd<GeluTanh>" and (k.functor, k.dtype) not in EXPECTED_KERNELS
    assert S.kernel_of("_ZN7ffn_ext4cuda11other_kernelIfEEvv") is None
    assert S.kernel_of("_ZN7ffn_ext4cuda11rows_kernelIfNS_4math8UnaryFwdINS2_4Si") is None  # truncated
    assert (
        S.kernel_of(
            "_ZN7ffn_ext4cuda11rows_kernelIfNS_4math11InterleavedINS2_8GatedFwdINS2_3GluINS2_4SiluEEEEELi0EEELi4EEEvv"
        )
        is None
    )  # Interleaved without its two ints
    assert (
        S.kernel_of("_ZN7ffn_ext4cuda11rows_kernelIfNS_4math8GatedFwdINS2_3GluINS2_4SiluEEEEELi4EEEvv").act
        == "Glu<Silu>"
    )
    res = S.parse_resources(
        """
Resource usage:
 Common:
  GLOBAL:0
 Function _ZN7ffn_ext4cuda11rows_kernelIfNS_4math8UnaryFwdINS2_4SiluEEELi4EEEvNS_4rows10RowProblemIXsrT0_2NIEXsrS8_2NOEEES8_:
  REG:40 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:568 TEXTURE:0 SURFACE:0 SAMPLER:0
""".replace("Resource usage:", "Resource usage:\n arch = sm_90")
    )
    assert res == {
        (90, key[1]): {"REG": 40, "STACK": 0, "SHARED": 0, "LOCAL": 0, "TEXTURE": 0, "SURFACE": 0, "SAMPLER": 0}
    }
