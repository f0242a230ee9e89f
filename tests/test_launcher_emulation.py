"""The CUDA launch of every op of the table (tests/optable.py), emulated on the CPU: runs in CI, where there is no
GPU.

_emulate_cuda(op, inputs, sms, params, layout) of the tests' host-code extension (tests/native.py)
builds the RowProblem the CUDA kernel gets
(csrc/row_ops.h, the code the CUDA ops use), takes the launch shape csrc/rows.h computes for a GPU with `sms`
multiprocessors, and runs rows.h's per-thread code for every block and thread of that grid on the host. Outputs are first filled with
all-ones bytes (a NaN arithmetic never makes), so an element no thread writes shows. What it cannot check is the
device-only code: 16-byte loads/stores as instructions, the paired 16-bit conversions, the MUFU approximations
(tests/test_sass.py and the CUDA tests cover those).

Each result must equal, bit for bit, the host math (_host_math: the same functors element by element), over
layouts that exercise the launcher: lengths around the vector width, head/tail peeling (views starting one
element past a 16-byte boundary), chunk views with a row stride, packed rows, >65535 rows (the grid-y loop),
layouts that need a copy, and narrow (decode) and wide launches. The packed ops run in both gate_up layouts
(optable.PACKINGS): "interleaved" reads [g0, u0, g1, u1, ...] as 16-byte vectors of whole pairs split in registers,
only where the pair's vectors are aligned (element stores/loads otherwise), so gate_up is tried at element offsets
0..7, with odd M (rows alternating alignment) and with row strides; gated ops with parameters run with the table's
example values (optable.host_params).
"""

from __future__ import annotations

import math

import native
import pytest
import torch
from optable import (
    GATED,
    GATED_IDS,
    HOST_OPS,
    N_INPUTS,
    PACKED_OPS,
    PACKINGS,
    activation_arg,
    assert_matches_reference,
    host_params,
    is_packed,
    repack,
    spec,
    unpack,
)

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _rand(shape, dtype, gen, offset=0):
    """Random values in a fresh buffer, returned as a view starting `offset` elements in (offset 1: not 16-byte
    aligned, so the launcher peels a head)."""
    n = math.prod(shape)
    buf = (torch.randn(n + offset, generator=gen, dtype=torch.float64) * 3).to(dtype)
    return buf[offset:].view(shape)


def _same_bits(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape, want.shape)
    assert got.is_contiguous(), what
    g, w = got.contiguous().view(BITS[got.dtype]), want.contiguous().view(BITS[want.dtype])
    bad = g != w
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {bad.numel()} elements differ from the host math, first at "
        f"{torch.nonzero(bad)[:3].tolist()}: got {got[bad][:3].tolist()}, want {want[bad][:3].tolist()}"
        f" (all-ones bytes = never written)"
    )


def _host(op, *ins):
    return native.testing()._host_math(op, [t.contiguous() for t in ins], host_params(op))


def expected(op, ins, packing="concat"):
    """The host math of op's functor: a packed op is its gated op on gate, up = the halves of gate_up in
    `packing`, with the backward's (dgate, dup) joined in that layout."""
    if is_packed(op):
        gated, gated_ins = unpack(op, ins, packing)
        return list(repack(op, _host(gated, *gated_ins), packing))
    return _host(op, *ins)


def check(op, ins, sms, what, packing="concat"):
    got = native.testing()._emulate_cuda(op, list(ins), sms, host_params(op), packing)
    want = expected(op, ins, packing)
    assert len(got) == len(want), what
    for k, (g, w) in enumerate(zip(got, want)):
        _same_bits(g, w, f"{op}[{k}] {ins[0].dtype} {what} sms={sms} packing={packing}")


SAME_SHAPE = {op: N_INPUTS[op] for op in HOST_OPS}  # the ops whose inputs all have the output's shape
GATED_OPS = list(GATED_IDS)  # every gated op of the table, with or without parameters


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("op", list(SAME_SHAPE))
def test_contiguous_and_misaligned_lengths(op, dtype):
    """One long row (contiguous inputs): every length around the vector width (2/4/8 elements) and the block's
    span, each input starting at offset 0 or 1 (a misaligned input is read element by element; a misaligned
    output gets a head)."""
    gen = torch.Generator().manual_seed(1)
    for n in [1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 255, 1000, 1024 * 8 + 5, 40_000]:
        for offsets in [(0,) * 3, (1,) * 3, (0, 1, 1), (1, 0, 1)]:
            ins = [_rand([n], dtype, gen, offsets[i]) for i in range(SAME_SHAPE[op])]
            for sms in (132, 2):
                check(op, ins, sms, f"n={n} offsets={offsets[: len(ins)]}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("op", [g + suffix for g in GATED_OPS for suffix in ("", "_backward")])
def test_chunk_views_with_a_row_stride(op, dtype):
    """gate, up = x.chunk(2, -1): rows of M elements with row stride 2M, read in place; M odd or even, rows
    starting on and off 16-byte boundaries (the head differs row by row when M is odd)."""
    gen = torch.Generator().manual_seed(2)
    for rows, m in [(1, 5), (3, 8), (16, 4864), (7, 4865), (33, 96), (5, 1)]:
        gate, up = _rand([rows, 2 * m], dtype, gen).chunk(2, -1)
        grad = _rand([rows, m], dtype, gen, 1)
        ins = [grad, gate, up] if spec(op).backward else [gate, up]
        for sms in (132, 2):
            check(op, ins, sms, f"chunk rows={rows} M={m}")
        if not spec(op).backward:  # up as the view with the offset, gate contiguous
            check(op, [_rand([rows, m], dtype, gen), up], 132, f"contiguous gate, chunk up rows={rows} M={m}")


@pytest.mark.parametrize("packing", PACKINGS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("op", PACKED_OPS)
def test_packed_forward_and_backward(op, dtype, packing):
    """<gated>_packed reads both halves (concat) or the pairs (interleaved) of each [..., 2M] row in place; its
    backward writes dgate and dup into one packed output in the same layout (row stride 2M for both outputs)."""
    gen = torch.Generator().manual_seed(3)
    for shape in [(1, 2), (3, 18), (2, 5, 34), (16, 9728), (9, 9730), (4, 2 * 4863)]:
        gate_up = _rand(list(shape), dtype, gen)
        grad = _rand(list(shape[:-1]) + [shape[-1] // 2], dtype, gen, 1)
        for sms in (132, 2):
            check(op, [gate_up], sms, f"shape={shape}", packing)
            check(op + "_backward", [grad, gate_up], sms, f"shape={shape}", packing)
        # a packed input that is itself a view with a row stride (every other row of a bigger tensor)
        big = _rand([2 * shape[0], shape[-1]], dtype, gen) if len(shape) == 2 else None
        if big is not None:
            check(op, [big[::2]], 132, f"strided rows shape={shape}", packing)
            check(op + "_backward", [grad, big[::2]], 132, f"strided rows shape={shape}", packing)


@pytest.mark.parametrize("packing", PACKINGS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("gated", GATED, ids=GATED_IDS)
def test_packed_misaligned_offsets_and_odd_m(gated, dtype, packing):
    """gate_up starting 0..7 elements past a 16-byte boundary (one long row, or rows of odd M whose alignment
    alternates, or rows with a padded stride), grad and the output at their own offsets: every pair of aligned
    and misaligned operands, vectorized where aligned and element by element elsewhere, must give the host math
    bit for bit."""
    gen = torch.Generator().manual_seed(7)
    op = gated.name + "_packed"
    for rows, m in [(1, 37), (3, 5), (4, 8), (5, 17), (2, 129)]:
        for offset in range(8):
            buf = _rand([rows * 2 * m + offset], dtype, gen)
            gate_up = buf[offset:].view(rows, 2 * m)
            grad = _rand([rows, m], dtype, gen, (offset * 3) % 8)
            what = f"rows={rows} M={m} offset={offset}"
            check(op, [gate_up], 2, what, packing)
            check(op + "_backward", [grad, gate_up], 2, what, packing)
        # and the emulated launch against the fp64 reference with the kernels' limits (which half is gate, which
        # up, in which layout the backward writes: not only the host math's agreement)
        for name, ins in ((op, [gate_up]), (op + "_backward", [grad, gate_up])):
            got = native.testing()._emulate_cuda(name, ins, 132, host_params(name), packing)
            assert_matches_reference(name, ins, got[0], f"emulated {packing}", inf_limits=True, packing=packing)
        padded = _rand([rows, 2 * m + 3], dtype, gen, 1)[:, : 2 * m]  # row stride 2M + 3, not a multiple of 16 B
        check(op, [padded], 132, f"padded rows={rows} M={m}", packing)
        check(op + "_backward", [_rand([rows, m], dtype, gen), padded], 132, f"padded rows={rows} M={m}", packing)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("gated", GATED, ids=GATED_IDS)
def test_more_rows_than_grid_y(gated, dtype):
    """More than 65535 rows: grid.y stops at 65535 and each block loops over rows y, y + 65535, ..."""
    gen = torch.Generator().manual_seed(4)
    gate, up = _rand([70_001, 6], dtype, gen).chunk(2, -1)
    check(gated.name, [gate, up], 132, "70001 chunk rows")
    packed = _rand([70_001, 4], dtype, gen)
    for packing in PACKINGS:
        check(gated.name + "_packed", [packed], 132, "70001 packed rows", packing)
        check(gated.name + "_packed", [packed[:, :4]], 132, "70001 packed rows", packing)
    # rows with a stride: no merging into one long row
    strided = _rand([70_001, 8], dtype, gen)[:, :4]
    check(gated.name + "_packed", [strided], 132, "70001 strided packed rows", "interleaved")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("op", list(SAME_SHAPE))
def test_layouts_that_need_a_copy_and_broadcast_rows(op, dtype):
    """Transposed and every-other-column inputs cannot be rows with a contiguous last dim: made contiguous first.
    Expanded rows (stride 0 along the rows) can: read in place. The activation's argument gets the layout, the
    other inputs are contiguous."""
    gen = torch.Generator().manual_seed(5)
    k = activation_arg(op)
    x = _rand([40, 24], dtype, gen)
    row = _rand([1, 37], dtype, gen)
    for what, a, shape, sms in (
        ("transposed", x.t(), [24, 40], 132),
        ("every other column", x[:, ::2], [40, 12], 2),
        ("expanded rows", row.expand(9, 37), [9, 37], 132),
    ):
        ins = [_rand(shape, dtype, gen) for _ in range(N_INPUTS[op])]
        ins[k] = a
        check(op, ins, sms, what)


def test_empty_and_zero_dim():
    gen = torch.Generator().manual_seed(6)
    for dtype in DTYPES:
        for op, n in SAME_SHAPE.items():
            check(op, [torch.empty(0, 5, dtype=dtype)] * n, 132, "empty")
            check(op, [_rand([], dtype, gen) for _ in range(n)], 132, "0-dim")
        for op in PACKED_OPS:
            for packing in PACKINGS:
                check(op, [torch.empty(3, 0, dtype=dtype)], 132, "M = 0", packing)
                check(op + "_backward", [torch.empty(3, 0, dtype=dtype)] * 2, 132, "M = 0", packing)
                check(op, [torch.empty(0, 6, dtype=dtype)], 132, "no rows", packing)


def test_emulate_cuda_rejects_bad_calls():
    with pytest.raises(ValueError, match="unknown op"):
        native.testing()._emulate_cuda("tanh", [torch.ones(2)])
    for op in list(SAME_SHAPE) + list(PACKED_OPS) + [p + "_backward" for p in PACKED_OPS]:
        n = N_INPUTS[op]
        with pytest.raises(ValueError, match=f"takes {n} inputs"):
            native.testing()._emulate_cuda(op, [torch.ones(2)] * (n + 1), 132, host_params(op))
        with pytest.raises(ValueError, match=f"{op} takes (no params|params)"):
            native.testing()._emulate_cuda(op, [torch.ones(2, 4)] * n, 132, host_params(op) + [1.0])
    with pytest.raises(ValueError, match="CPU tensors"):
        native.testing()._emulate_cuda("gelu", [torch.ones(2, device="meta")])
    with pytest.raises(ValueError, match="sms"):
        native.testing()._emulate_cuda("gelu", [torch.ones(2)], 0)


def test_emulate_cuda_raises_what_the_cuda_kernels_raise():
    # the ops' C++ guards are the CUDA glue's (row_ops.h, shapes.cpp): a RuntimeError naming the op and the argument
    # (the one type the stable ABI carries); the functional API explains it with the Python checks (the tests of
    # ffn_ext's errors run through it, in the stand-in too)
    for op in list(PACKED_OPS) + [p + "_backward" for p in PACKED_OPS]:  # the layout
        ins = [torch.ones(2, 2)] * (N_INPUTS[op] - 1) + [torch.ones(2, 4)]
        with pytest.raises(RuntimeError) as info:
            native.testing()._emulate_cuda(op, ins, 132, host_params(op), "bogus")
        assert type(info.value) is RuntimeError
        assert str(info.value) == f'ffn_ext.{op}: `layout` must be "concat" or "interleaved"', str(info.value)
    with pytest.raises(RuntimeError, match=r"^ffn_ext\.gelu: `x` must be a dense strided float64"):
        native.testing()._emulate_cuda("gelu", [torch.ones(2, dtype=torch.int64)])
    with pytest.raises(RuntimeError, match=r"^ffn_ext\.swiglu: `up` must have the dtype, device and shape of `gate`"):
        native.testing()._emulate_cuda("swiglu", [torch.ones(2, 3), torch.ones(2, 4)])
    with pytest.raises(RuntimeError, match=r"^ffn_ext\.swiglu_packed: `gate_up` must be \[\.\.\., 2\*M\]"):
        native.testing()._emulate_cuda("swiglu_packed", [torch.ones(2, 3)])
