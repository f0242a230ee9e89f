"""Every ffn_ext op (forward and backward; the op list is the table's, tests/optable.py) against its float64
reference, over shapes, layouts and dtypes; the packed ops in both gate_up layouts (concat, interleaved), the gated
ops with parameters (swiglu_clamped) with the table's example values and inputs at their clamp bounds.

CPU: the ATen composite kernels. CUDA (marked `cuda`): the extension's own kernels, with the caching allocator
poisoned with NaN before each case so unwritten output elements show, plus the launcher's edge cases (head/tail
peeling, multi-block rows, > 65535 rows, chunk views at odd alignments), ATen CUDA agreement, the infinity
semantics, and (marked `large`) tensors past 2**31 elements.
"""

from __future__ import annotations

import functools
import math

import native
import optable
import pytest
import torch
import torch.nn.functional as F
from optable import (
    ACTIVATIONS,
    BACKWARD_OPS,
    CPU_DTYPES,
    FLOAT_DTYPES,
    GATED,
    GATED_IDS,
    HOST_OPS,
    N_INPUTS,
    OPS,
    PACKINGS,
    RecordOps,
    activation_arg,
    api_call,
    as_tuple,
    assert_close_to,
    assert_matches_reference,
    aten_result,
    call,
    error_scale,
    host_params,
    is_packed,
    make_chunk_pair,
    make_inputs,
    make_layout,
    op,
    ops_of,
    params_of,
    poison_cuda_cache,
    reference,
    spec,
    terms,
    tolerance,
    unpack,
)

import ffn_ext
from ffn_ext.table import join_packed, split_packed

ACT_IDS = [a.name for a in ACTIVATIONS]

# Output shapes (for the packed ops: the output [..., M]; gate_up is [..., 2M], so odd last dims give odd M).
SHAPES = [
    (0,),
    (0, 5),
    (4, 0),
    (0, 0),
    (2, 0, 3),  # empty
    (),
    (1,),
    (1, 1),  # 0-dim and one element
    (3, 7),
    (5, 1001),
    (1, 13),  # odd
    (4, 7),
    (4, 8),
    (4, 9),
    (4, 15),
    (4, 16),
    (4, 17),
    (3, 31),
    (3, 33),
    (2, 64),
    (2, 65),  # around vector widths
    (2, 3, 5),
    (3, 2, 17),
    (2, 1, 9),
    (1, 4, 16),  # 3-D
]
LAYOUTS_TESTED = ("contiguous", "transposed", "step", "row_step", "padded", "offset", "expanded", "chunk", "scalar")


def _shapes_for(name):
    return [s for s in SHAPES if not (is_packed(name) and len(s) == 0)]


def _packings(name):
    """The gate_up layouts op `name` is run in: both for the packed ops, none to choose for the others."""
    return PACKINGS if is_packed(name) else ("concat",)


def _run_case(name, shape, dtype, device, layout, grad_layout=None, poison=False, packing="concat"):
    if poison:
        poison_cuda_cache(device, nbytes=32 << 20, small_blocks=4)
    inputs = make_inputs(name, shape, dtype, device, layout, grad_layout=grad_layout, packing=packing)
    before = [t.clone() for t in inputs]
    out = call(name, packing if is_packed(name) else None)(*inputs)
    assert_matches_reference(
        name,
        inputs,
        out,
        packing=packing,
        msg=f"shape={shape} dtype={dtype} layout={layout} grad={grad_layout} packing={packing}",
    )
    for k, (a, b) in enumerate(zip(inputs, before)):
        assert torch.equal(a, b), f"{name} modified its input {k} (shape={shape} layout={layout})"
    for o in as_tuple(out):  # outputs are fresh tensors, never views of the inputs
        for t in inputs:
            if o.numel() and t.numel():
                assert o.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


# ---------------------------------------------------------------- CPU
@pytest.mark.parametrize("layout", LAYOUTS_TESTED)
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("name", OPS)
def test_cpu_matches_fp64_reference(name, dtype, layout):
    for packing in _packings(name):
        for shape in _shapes_for(name):
            _run_case(name, shape, dtype, "cpu", layout, packing=packing)


@pytest.mark.parametrize("grad_layout", ["contiguous", "transposed", "scalar", "offset"])
@pytest.mark.parametrize("name", BACKWARD_OPS)
def test_cpu_backward_grad_layout_differs(name, grad_layout):
    for packing in _packings(name):
        for shape in [(3, 7), (4, 16), (2, 3, 9)]:
            for layout in ("chunk", "contiguous", "offset"):
                _run_case(name, shape, torch.float32, "cpu", layout, grad_layout=grad_layout, packing=packing)


@pytest.mark.parametrize("packing", PACKINGS)
@pytest.mark.parametrize("name", [n for n in OPS if is_packed(n)])
def test_cpu_packed_odd_m_matches_chunked_gated(name, packing):
    # The packed ops equal the gated op / its backward on the two halves of gate_up in its layout (same CPU math,
    # so exactly); the backward writes (dgate, dup) in that layout.
    for m in (1, 3, 7, 33, 1001):
        gate_up = make_layout((5, 2 * m), torch.float32)
        grad = make_layout((5, m), torch.float32)
        ins = (grad, gate_up) if spec(name).backward else (gate_up,)
        gated, gated_ins = unpack(name, ins, packing)
        want = as_tuple(call(gated)(*gated_ins))
        out = call(name, packing)(*ins)
        if spec(name).backward:
            assert out.shape == (5, 2 * m)
            dgate, dup = split_packed(out, packing)
            torch.testing.assert_close(dgate, want[0], rtol=0, atol=0)
            torch.testing.assert_close(dup, want[1], rtol=0, atol=0)
            want = (join_packed(*want, packing),)
        torch.testing.assert_close(out, want[0], rtol=0, atol=0)


@pytest.mark.parametrize("name", [n for n in OPS if is_packed(n)])
def test_cpu_packings_differ(name):
    # The layout argument is used: the interleaved result is the concat op's on the permuted gate_up, and not the
    # concat result itself.
    gate_up = make_layout((3, 2 * 9), torch.float64)
    grad = make_layout((3, 9), torch.float64)
    perm = join_packed(*split_packed(gate_up, "interleaved"), "concat")  # the same gate, up in concat layout
    ins = (grad,) if spec(name).backward else ()
    inter = call(name, "interleaved")(*ins, gate_up)
    concat = call(name, "concat")(*ins, perm)
    if spec(name).backward:
        concat = join_packed(*split_packed(concat, "concat"), "interleaved")
    # (strided halves take ATen's scalar loop, contiguous ones its vectorized one: the last bit may differ)
    torch.testing.assert_close(inter, concat, rtol=1e-14, atol=1e-300)
    assert not torch.allclose(inter, call(name)(*ins, gate_up))


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("name", OPS)
def test_cpu_extreme_finite_values(name, dtype):
    # Large magnitudes (sigmoid/exp overflow regions, erf saturation) and tiny ones, all finite.
    vals = torch.tensor(
        [
            -1e4,
            -300.0,
            -100.0,
            -88.5,
            -30.0,
            -10.0,
            -1.2785,
            -0.7517,
            -1e-3,
            -1e-30,
            1e-30,
            1e-3,
            0.5,
            10.0,
            30.0,
            88.5,
            100.0,
            300.0,
            1e4,
        ],
        dtype=torch.float64,
    )
    n = vals.numel()
    for packing in _packings(name):
        inputs = make_inputs(name, (2, n), dtype)
        # x (unary), gate (gated), or the gate of gate_up in its layout (packed): what the nonlinearity applies to.
        target = inputs[activation_arg(name)]
        if is_packed(name):
            target = split_packed(target, packing)[0]
        target[..., :n].copy_(vals.expand(2, n).to(dtype))
        out = call(name, packing if is_packed(name) else None)(*inputs)
        assert_matches_reference(name, inputs, out, packing=packing, msg=packing)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("name", HOST_OPS)
def test_cpu_nonfinite_follow_aten(name, dtype):
    # The CPU kernels are ATen's: for inf/nan inputs they give what ATen (the table's act.aten / aten_backward)
    # gives in that dtype. The activation's argument gets the specials; grad / up get others of their own.
    x = torch.tensor([-math.inf, math.inf, math.nan, -2.0, 3.0], dtype=dtype)
    other = torch.tensor([1.0, -2.0, 0.5, math.inf, math.nan], dtype=dtype)
    ins = [other] * N_INPUTS[name]
    ins[activation_arg(name)] = x
    got, want = as_tuple(call(name)(*ins)), as_tuple(aten_result(name, *ins))
    masks = [m for _, _, _, m in terms(name, [t.double() for t in ins])]
    for g, w, m in zip(got, want, masks):
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)
        if m is None or m[2]:
            assert torch.isnan(g[2]), "NaN input must give NaN"
        else:  # a select (a clamp's gradient) gives 0 there, as ATen's where
            assert g[2].item() == 0, "a NaN input where the op selects 0 must give 0"


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("name", [n for n in OPS if spec(n).aten_autograd])
def test_cpu_autograd_is_the_backward_op(name, dtype):
    # Where the table says an op's CPU autograd is ATen's (aten_autograd), ATen's autograd of its CPU kernel gives
    # what its backward op computes, bit for bit: random, extreme and non-finite inputs (relu's would not: ATen's
    # derivative is 0 at NaN, the table's NaN).
    ins = make_inputs(name, (2, 8), dtype)
    target = ins[activation_arg(name)]
    target = split_packed(target, "concat")[0] if is_packed(name) else target
    specials = torch.tensor([-math.inf, math.inf, math.nan, -1e4, 1e4, 0.0, -0.0, -88.5], dtype=dtype)
    target[0].copy_(specials)
    leaves = [t.clone().requires_grad_() for t in ins]
    out = api_call(name)(*leaves)
    assert not type(out.grad_fn).__name__.startswith("ffn_ext"), out.grad_fn
    grad = make_layout(out.shape, dtype)
    got = torch.autograd.grad(out, leaves, grad)
    want = as_tuple(call(name + "_backward")(grad, *ins))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)


def test_reference_helpers_can_fail():
    # Guard the guards: the tolerance rejects the tanh GELU approximation (~5e-4 off) in fp32 and a one-ulp-off
    # fp64 result; the reference of swiglu_backward is not the forward's.
    x = make_layout((64,), torch.float32)
    with pytest.raises(AssertionError):
        assert_close_to(F.gelu(x, approximate="tanh"), reference("gelu", x), torch.float32)
    xd = make_layout((64,), torch.float64)
    with pytest.raises(AssertionError):
        assert_close_to(F.gelu(xd) * (1 + 1e-11), reference("gelu", xd), torch.float64)
    g, u = make_layout((8,), torch.float64), make_layout((8,), torch.float64)
    dg, du = reference("swiglu_backward", torch.ones(8, dtype=torch.float64), g, u)
    torch.testing.assert_close(du, F.silu(g))
    assert not torch.allclose(dg, du)
    # each activation's reference is its own (the tanh GELU is not the exact one), with and without the limits
    for inf_limits in (False, True):
        refs = [reference(a.name, xd, inf_limits=inf_limits) for a in ACTIVATIONS]
        for i in range(len(refs)):
            for j in range(i):
                assert not torch.allclose(refs[i], refs[j], rtol=1e-6, atol=0), (ACTIVATIONS[i].name, inf_limits)
    # assert_matches_reference (with its error scale and, on the CPU, ATen's own results accepted) rejects every
    # op's result given for the same op of another activation or gated op (in float32 and float64: in bfloat16
    # the tanh GELU is within the tolerance of the exact one), and a packed op's result in the other layout
    for dtype in (torch.float64, torch.float32):
        for name in OPS:
            s = spec(name)
            inputs = make_inputs(name, (4, 33), dtype, layout="chunk")
            others = [
                n for n in ops_of(kind=s.kind, backward=s.backward) if n != name and spec(n).recompute == s.recompute
            ]
            assert len(others) == (len(ACTIVATIONS) if s.kind == "unary" else len(GATED)) - 1, (name, others)
            for wrong in others:
                with pytest.raises(AssertionError):
                    assert_matches_reference(name, inputs, call(wrong)(*inputs), f"{wrong} as {name}")
            if is_packed(name):
                with pytest.raises(AssertionError):
                    assert_matches_reference(name, inputs, call(name, "interleaved")(*inputs), "interleaved as concat")
    # a gated op with parameters: the reference follows the parameters (each one matters)
    for g in GATED:
        for p in g.params:
            name, inputs = g.name, make_inputs(g.name, (4, 33), torch.float64)
            other = dict(params_of(name), **{p.name: p.example * 0.5 + 0.25})
            with pytest.raises(AssertionError):
                assert_matches_reference(name, inputs, call(name, params=other)(*inputs), f"{p.name} changed")


@pytest.mark.parametrize("name", [n for n in OPS if not spec(n).backward])
def test_public_api_reaches_the_op(name):
    # api_call(name) (ffn_ext.gelu(x, approximate=...), ffn_ext.gated(..., activation=...),
    # ffn_ext.swiglu_clamped(..., limit=...), ...) dispatches exactly torch.ops.ffn_ext.<name>, with its result, in
    # every layout of a packed op.
    for packing in PACKINGS if is_packed(name) else (None,):
        inputs = make_inputs(name, (3, 6), torch.float32, packing=packing or "concat")
        with RecordOps() as rec:
            out = api_call(name, packing)(*inputs)
        assert rec.ops == [f"ffn_ext.{name}.default"], rec.ops
        torch.testing.assert_close(out, call(name, packing)(*inputs), rtol=0, atol=0)


def test_named_api_functions_are_the_gated_ones():
    # The named functions reach the same ops as ffn_ext.gated / gated_packed with the activation's name.
    gate, up = make_chunk_pair((4, 7), torch.float32)
    gate_up = make_layout((4, 14), torch.float32)
    for approximate, act in (("none", "gelu"), ("tanh", "gelu_tanh")):
        torch.testing.assert_close(
            ffn_ext.geglu(gate, up, approximate=approximate), ffn_ext.gated(gate, up, activation=act), rtol=0, atol=0
        )
        torch.testing.assert_close(
            ffn_ext.geglu_packed(gate_up, approximate=approximate),
            ffn_ext.gated_packed(gate_up, activation=act),
            rtol=0,
            atol=0,
        )
        torch.testing.assert_close(ffn_ext.gelu(gate, approximate=approximate), call(act)(gate), rtol=0, atol=0)
    torch.testing.assert_close(ffn_ext.swiglu(gate, up), ffn_ext.gated(gate, up), rtol=0, atol=0)
    torch.testing.assert_close(ffn_ext.swiglu_packed(gate_up), ffn_ext.gated_packed(gate_up), rtol=0, atol=0)
    torch.testing.assert_close(ffn_ext.geglu(gate, up), call("geglu")(gate, up), rtol=0, atol=0)
    for layout in PACKINGS:  # layout= reaches the op, by every name
        want = call("swiglu_packed", layout)(gate_up)
        torch.testing.assert_close(ffn_ext.swiglu_packed(gate_up, layout=layout), want, rtol=0, atol=0)
        torch.testing.assert_close(ffn_ext.gated_packed(gate_up, layout=layout), want, rtol=0, atol=0)
        for approximate, act in (("none", "gelu"), ("tanh", "gelu_tanh")):
            torch.testing.assert_close(
                ffn_ext.geglu_packed(gate_up, approximate, layout=layout),
                ffn_ext.gated_packed(gate_up, act, layout=layout),
                rtol=0,
                atol=0,
            )
        p = dict(limit=2.0, alpha=1.702, up_offset=1.0)
        torch.testing.assert_close(
            ffn_ext.swiglu_clamped_packed(gate_up, layout=layout, **p),
            call("swiglu_clamped_packed", layout, p)(gate_up),
            rtol=0,
            atol=0,
        )
    torch.testing.assert_close(
        ffn_ext.swiglu_clamped(gate, up, limit=2.0, alpha=0.5, up_offset=-1.0),
        call("swiglu_clamped", params=dict(limit=2.0, alpha=0.5, up_offset=-1.0))(gate, up),
        rtol=0,
        atol=0,
    )
    # the parameters' defaults are the schema's (alpha=1, up_offset=0)
    torch.testing.assert_close(
        ffn_ext.swiglu_clamped(gate, up, limit=2.0),
        call("swiglu_clamped", params=dict(limit=2.0))(gate, up),
        rtol=0,
        atol=0,
    )


# ---------------------------------------------------------------- CUDA: the same matrix, poisoned cache
@pytest.mark.cuda
@pytest.mark.parametrize("layout", LAYOUTS_TESTED)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("name", OPS)
def test_cuda_matches_fp64_reference(name, dtype, layout):
    for packing in _packings(name):
        for shape in _shapes_for(name):
            _run_case(name, shape, dtype, "cuda", layout, poison=True, packing=packing)


@pytest.mark.cuda
@pytest.mark.parametrize("grad_layout", ["contiguous", "transposed", "scalar", "offset", "padded"])
@pytest.mark.parametrize("name", BACKWARD_OPS)
def test_cuda_backward_grad_layout_differs(name, grad_layout):
    for dtype in (torch.float32, torch.bfloat16):
        for shape in [(3, 7), (4, 16), (2, 3, 9), (3, 1001)]:
            for layout in ("chunk", "contiguous", "offset", "padded"):
                for packing in _packings(name):
                    _run_case(name, shape, dtype, "cuda", layout, grad_layout=grad_layout, poison=True, packing=packing)


# Columns that exercise head/tail peeling and rows spanning several blocks (256 threads x 4 x 16 B per block).
LAUNCHER_COLS = (1, 2, 3, 5, 8, 127, 1023, 1024, 1025, 2049, 4095, 4096, 4097, 4864, 8193, 11008, 14336 + 3)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("name", OPS)
def test_cuda_launcher_cols(name, dtype):
    for cols in LAUNCHER_COLS:
        for layout in ("contiguous", "padded", "chunk", "offset"):
            for packing in _packings(name):
                _run_case(name, (3, cols), dtype, "cuda", layout, poison=True, packing=packing)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", OPS)
def test_cuda_many_rows(name, dtype):
    # rows past the 65535 grid.y limit: row-wise layouts (not merged into one long row) and contiguous.
    for rows in (1, 2, 63, 65535, 65536, 70000):
        for cols in (16, 3):
            for layout in ("chunk", "padded", "contiguous"):
                for packing in _packings(name):
                    _run_case(name, (rows, cols), dtype, "cuda", layout, poison=True, packing=packing)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("gated", GATED, ids=GATED_IDS)
def test_cuda_chunk_views_odd_m_alignments(gated, dtype):
    # gate, up = t.chunk(2, -1) with t shifted by 0..7 elements: gate and up at different 16-byte alignments,
    # both different from the (fresh, aligned) output's. The packed ops' gate_up likewise, in both layouts (an
    # interleaved pair is read as 16-byte vectors only when aligned; odd M: every other row is not).
    g = gated.name
    for m in (1, 3, 5, 7, 9, 15, 17, 33, 1001, 4097):
        for offset in range(8):
            poison_cuda_cache(nbytes=32 << 20, small_blocks=4)
            gate, up = make_chunk_pair((6, m), dtype, "cuda", offset=offset)
            grad = make_layout((6, m), dtype, "cuda", "offset" if offset % 2 else "contiguous")
            msg = f"m={m} offset={offset}"
            assert_matches_reference(g, (gate, up), call(g)(gate, up), msg)
            assert_matches_reference(g + "_backward", (grad, gate, up), call(g + "_backward")(grad, gate, up), msg)
            buf = make_layout((6 * 2 * m + offset,), dtype, "cuda")
            gate_up = buf[offset:].view(6, 2 * m)
            for packing in PACKINGS:
                msg = f"m={m} offset={offset} packing={packing}"
                assert_matches_reference(
                    g + "_packed", (gate_up,), call(g + "_packed", packing)(gate_up), msg, packing=packing
                )
                assert_matches_reference(
                    g + "_packed_backward",
                    (grad, gate_up),
                    call(g + "_packed_backward", packing)(grad, gate_up),
                    msg,
                    packing=packing,
                )


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("name", HOST_OPS)
def test_cuda_inputs_misaligned_relative_to_output(name, dtype):
    # Each input a contiguous view at its own element offset (1..7) from a 16-byte boundary.
    n_in = N_INPUTS[name]
    for shape in [(4, 37), (1, 4096), (3, 4864), (2, 2, 257)]:
        n = math.prod(shape)
        for shift in range(1, 8):
            poison_cuda_cache(nbytes=32 << 20, small_blocks=4)
            inputs = tuple(
                make_layout((n + 8,), dtype, "cuda")[(shift * (k + 1)) % 8 :][:n].view(shape) for k in range(n_in)
            )
            assert_matches_reference(name, inputs, call(name)(*inputs), f"shape={shape} shift={shift}")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("name", OPS)
def test_cuda_matches_aten_cuda(name, dtype):
    # Finite inputs: the fused kernels agree with ATen's CUDA ops (which may round an intermediate: 2x tolerance).
    for shape in [(7, 4864), (33, 17), (2, 3, 1001)]:
        for packing in _packings(name):
            kw = dict(packing=packing)
            inputs = make_inputs(
                name, shape, dtype, "cuda", "contiguous" if spec(name).kind == "unary" else "chunk", **kw
            )
            got = as_tuple(call(name, packing if is_packed(name) else None)(*inputs))
            want = as_tuple(aten_result(name, *inputs, **kw))  # the table's ATen composites on CUDA, same dtype
            refs, spreads = as_tuple(reference(name, *inputs, **kw)), error_scale(name, *inputs, **kw)
            assert len(got) == len(want) == len(refs)
            rtol = tolerance(dtype)["rtol"]
            for g, w, r, sp in zip(got, want, refs, spreads):
                assert torch.isfinite(g).all()
                # twice the tolerance, plus ATen's own error (e.g. the 1 - tanh^2 of its tanh GELU backward cancels)
                aten_err = (w.double() - r).abs() / rtol
                assert_close_to(
                    g, w.double(), dtype, f"{name} {shape} {packing} vs ATen CUDA", scale=2.0, spread=sp + aten_err
                )


SPECIAL = [
    -math.inf,
    math.inf,
    math.nan,
    -1e4,
    -100.0,
    -88.7,
    -20.0,
    -1.0,
    -0.0,
    0.0,
    1e-20,
    1.0,
    20.0,
    88.7,
    100.0,
    1e4,
]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("act", ACTIVATIONS, ids=ACT_IDS)
def test_cuda_infinity_semantics(act, dtype):
    # the limits at -inf and +inf are the table entry's (act.limits: act(-inf), act(+inf), act'(-inf), act'(+inf))
    x = torch.tensor(SPECIAL, dtype=torch.float64).to(dtype).cuda()
    ones = torch.ones_like(x)
    ninf, pinf, nan = 0, 1, 2
    f_ninf, f_pinf, d_ninf, d_pinf = act.limits
    name, bwd, g = act.name, act.name + "_backward", act.gated
    y = op(name)(x)
    assert y[ninf].item() == f_ninf and math.copysign(1.0, y[ninf].item()) == math.copysign(1.0, f_ninf), (
        f"{name}(-inf) must be {f_ninf}"
    )
    assert y[pinf].item() == f_pinf, f"{name}(+inf) must be {f_pinf}"
    assert math.isnan(y[nan].item()), f"{name}(nan) must be nan"
    assert_close_to(y, reference(name, x, inf_limits=True), dtype, name, spread=error_scale(name, x)[0])
    d = op(bwd)(ones, x)
    assert d[ninf].item() == d_ninf and d[pinf].item() == d_pinf, (
        f"{bwd}: derivative must be {d_ninf} at -inf, {d_pinf} at +inf"
    )
    assert math.isnan(d[nan].item())
    assert_close_to(d, reference(bwd, ones, x, inf_limits=True), dtype, bwd, spread=error_scale(bwd, ones, x)[0])
    up = make_layout(x.shape, dtype, "cuda")
    h = op(g)(x, up)
    assert h[ninf].item() == f_ninf * up[ninf].item() and h[pinf].item() == f_pinf * up[pinf].sign().item()
    assert_close_to(h, reference(g, x, up, inf_limits=True), dtype, g, spread=error_scale(g, x, up)[0])
    grad = make_layout(x.shape, dtype, "cuda")
    dgate, dup = op(g + "_backward")(grad, x, up)
    assert (
        dgate[ninf].item() == d_ninf * (grad[ninf] * up[ninf]).item() and dup[ninf].item() == f_ninf * grad[ninf].item()
    )
    assert_matches_reference(g + "_backward", (grad, x, up), (dgate, dup), inf_limits=True)
    gate_up = torch.cat([x, up]).view(1, -1)
    assert_matches_reference(g + "_packed", (gate_up,), op(g + "_packed")(gate_up), inf_limits=True)
    g1 = grad.view(1, -1)
    assert_matches_reference(
        g + "_packed_backward", (g1, gate_up), op(g + "_packed_backward")(g1, gate_up), inf_limits=True
    )


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("gated", GATED, ids=GATED_IDS)
def test_cuda_gated_infinity_semantics(gated, dtype):
    # Every gated op, its backward and its packed forms in both layouts, with the specials in gate, in up, in both
    # and in grad, against the limits the CUDA kernels implement (the table's act.ref, a clamp's selects). The
    # finite values pair so that no result leaves float16's range and no activation value or derivative that
    # underflows in float (gelu(-20)) meets an infinity (0 * inf: NaN, where the fp64 reference has inf).
    def rnd(n, lo, hi):
        return (torch.rand(n, dtype=torch.float64) * (hi - lo) + lo).to(dtype).cuda()

    x = torch.tensor(SPECIAL, dtype=torch.float64).to(dtype).cuda()
    small = (
        torch.tensor([-math.inf, math.inf, math.nan, -5.0, -1.0, -0.0, 0.0, 1e-20, 1.0, 5.0], dtype=torch.float64)
        .to(dtype)
        .cuda()
    )
    sg, su = (t.reshape(-1) for t in torch.meshgrid(small, small, indexing="ij"))
    n, k = x.numel(), sg.numel()
    gate = torch.cat([x, rnd(n, -4, 4), sg, rnd(n, 0.5, 4)])  # grad = +-inf below: act and act' > 0.5 there
    up = torch.cat([rnd(n, -4, 4), x, su, rnd(n, -4, 4)])
    grad = torch.cat([rnd(2 * n + k, -3, 3), x])
    g = gated.name
    assert_matches_reference(g, (gate, up), call(g)(gate, up), inf_limits=True)
    assert_matches_reference(g + "_backward", (grad, gate, up), call(g + "_backward")(grad, gate, up), inf_limits=True)
    for packing in PACKINGS:
        gate_up = join_packed(gate, up, packing).view(1, -1)
        g1 = grad.view(1, -1)
        assert_matches_reference(
            g + "_packed", (gate_up,), call(g + "_packed", packing)(gate_up), inf_limits=True, packing=packing
        )
        assert_matches_reference(
            g + "_packed_backward",
            (g1, gate_up),
            call(g + "_packed_backward", packing)(g1, gate_up),
            inf_limits=True,
            packing=packing,
        )


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_cuda_agrees_with_host_math(dtype):
    # _host_math (tests/native.py) runs the kernels' element math on the host: same functors, same single rounding.
    x = torch.cat([torch.tensor(SPECIAL, dtype=torch.float64).to(dtype), make_layout((4096,), dtype)])
    for name in HOST_OPS:  # every op but the packed ones (tests/test_launcher_emulation.py: same functors)
        ins = [make_layout(x.shape, dtype) for _ in range(N_INPUTS[name])]
        ins[activation_arg(name)] = x
        host = native.testing()._host_math(name, ins, host_params(name))
        dev = as_tuple(call(name)(*[t.cuda() for t in ins]))
        for h, d, sp in zip(host, dev, error_scale(name, *ins)):
            # The device's erff/expf may differ from the host libm by an ulp of float (more where the formula
            # cancels: error_scale): allow the tolerance of one storage ulp.
            assert_close_to(d.cpu(), h.double(), dtype, f"{name} {dtype}", spread=sp)
            same_sign = torch.signbit(d.cpu()) == torch.signbit(h)
            assert same_sign[(h == 0)].all(), f"{name}: signed zeros differ from the host math"


@pytest.mark.cuda
def test_cuda_side_stream_and_device_guard():
    # Kernels launch on the current stream: work queued on a side stream after a producer on that stream.
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x = make_layout((257, 1001), torch.float32, "cuda") * 1.0
        y = torch.ops.ffn_ext.gelu(x)
        gu = make_layout((300, 2 * 4097), torch.bfloat16, "cuda")
        h = torch.ops.ffn_ext.swiglu_packed(gu)
    s.synchronize()
    assert_close_to(y, reference("gelu", x), torch.float32)
    assert_close_to(h, reference("swiglu_packed", gu), torch.bfloat16)
    if torch.cuda.device_count() > 1:  # a tensor on another device than the current one
        x1 = make_layout((33, 4864), torch.float32, "cuda:1")
        with torch.cuda.device(0):
            y1 = torch.ops.ffn_ext.silu(x1)
        assert y1.device == x1.device
        assert_close_to(y1, reference("silu", x1), torch.float32)


# ---------------------------------------------------------------- CUDA: past 2**31 elements
def _need_gib(gib):
    free, _ = torch.cuda.mem_get_info()
    if free < gib * (1 << 30):
        pytest.skip(f"needs {gib} GiB of free GPU memory, {free / (1 << 30):.1f} GiB free")


def _check_rows(out, ref_fn, rows=4, samples=32, name=""):
    """out (2-D) vs ref_fn(row_slice) -> float32 recomputation: the first and last `rows` rows in full (within
    one bf16 ulp: the float math of torch and of the kernel may round differently), plus `samples` random rows."""
    last = out[-rows:].float()
    torch.testing.assert_close(
        last,
        ref_fn(slice(out.shape[0] - rows, out.shape[0])),
        rtol=8e-3,
        atol=1e-6,
        msg=lambda m: f"{name} last rows: {m}",
    )
    first = out[:rows].float()
    torch.testing.assert_close(
        first, ref_fn(slice(0, rows)), rtol=8e-3, atol=1e-6, msg=lambda m: f"{name} first rows: {m}"
    )
    for rr in torch.randint(0, out.shape[0], (samples,)).tolist():
        torch.testing.assert_close(
            out[rr : rr + 1].float(),
            ref_fn(slice(rr, rr + 1)),
            rtol=8e-3,
            atol=1e-6,
            msg=lambda m: f"{name} row {rr}: {m}",
        )
    assert not torch.isnan(out).any().item(), f"{name}: NaN in the output (an unwritten element?)"


@pytest.mark.cuda
@pytest.mark.large
def test_cuda_large_swiglu_packed_bf16():
    # [149910, 2*14336] -> [149910, 14336]: the output has 2.149e9 > 2**31 elements (vLLM's int32 overflow case).
    _need_gib(40)
    rows, m = 149_910, 14_336
    assert rows * m > 2**31
    poison_cuda_cache(nbytes=1 << 30)
    gate_up = torch.randn(rows, 2 * m, dtype=torch.bfloat16, device="cuda")
    out = torch.ops.ffn_ext.swiglu_packed(gate_up)
    assert out.shape == (rows, m) and out.is_contiguous()

    def ref(sl):
        g, u = gate_up[sl].float().chunk(2, -1)
        return F.silu(g) * u

    _check_rows(out, ref, name="swiglu_packed")
    grad = torch.randn(rows, m, dtype=torch.bfloat16, device="cuda")
    del out
    dgu = torch.ops.ffn_ext.swiglu_packed_backward(grad, gate_up)
    assert dgu.shape == gate_up.shape

    def ref_bwd(sl):
        g, u = gate_up[sl].float().chunk(2, -1)
        gr = grad[sl].float()
        s = torch.sigmoid(g)
        return torch.cat([gr * u * s * (1 + g * (1 - s)), gr * g * s], -1)

    _check_rows(dgu, ref_bwd, name="swiglu_packed_backward")


@pytest.mark.cuda
@pytest.mark.large
def test_cuda_large_swiglu_chunk_bf16():
    # gate, up: chunk views of one [rows, 2M] tensor, each with > 2**31 elements (row stride 2M).
    _need_gib(30)
    rows, m = 131_073, 16_384
    assert rows * m > 2**31
    t = torch.randn(rows, 2 * m, dtype=torch.bfloat16, device="cuda")
    gate, up = t.chunk(2, -1)
    poison_cuda_cache(nbytes=1 << 30)
    out = torch.ops.ffn_ext.swiglu(gate, up)

    def ref(sl):
        return F.silu(gate[sl].float()) * up[sl].float()

    _check_rows(out, ref, name="swiglu")


@pytest.mark.cuda
@pytest.mark.large
def test_cuda_large_gelu_fp16():
    # One contiguous tensor of 2**31 + 1001 elements: a single long "row" for the launcher.
    _need_gib(24)
    n = 2**31 + 1001
    x = torch.randn(n, dtype=torch.float16, device="cuda")
    poison_cuda_cache(nbytes=1 << 30)
    y = torch.ops.ffn_ext.gelu(x)
    assert y.shape == (n,)
    y2, x2 = y[-8008:], x[-8008:]  # the tail, past 2**31
    torch.testing.assert_close(y2.float(), F.gelu(x2.float()), rtol=2e-3, atol=1e-5)
    idx = torch.randint(0, n, (1 << 20,), device="cuda")
    torch.testing.assert_close(y[idx].float(), F.gelu(x[idx].float()), rtol=2e-3, atol=1e-5)
    assert not torch.isnan(y).any().item()
    g = torch.randn(n, dtype=torch.float16, device="cuda")
    del y
    dx = torch.ops.ffn_ext.gelu_backward(g, x)
    ref = torch.ops.aten.gelu_backward(g[idx].float(), x[idx].float())
    torch.testing.assert_close(dx[idx].float(), ref, rtol=2e-3, atol=1e-5)
    torch.testing.assert_close(
        dx[-5000:].float(), torch.ops.aten.gelu_backward(g[-5000:].float(), x[-5000:].float()), rtol=2e-3, atol=1e-5
    )
    assert not torch.isnan(dx).any().item()


# ---------------------------------------------------------------- mixed dtypes and autocast
_MIXED = [
    (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float64),
    (torch.bfloat16, torch.float16),
]
_GATED_FORWARD = [n for n in optable.FORWARD_OPS if optable.spec(n).kind == "gated"]
_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize("dtypes", _MIXED, ids=[f"{a}-{b}".replace("torch.", "") for a, b in _MIXED])
@pytest.mark.parametrize("name", _GATED_FORWARD)
def test_mixed_dtypes_promote(name, dtypes, device):
    """Every gated op of the table through the public API, gate and up of different floating-point dtypes: the
    result has their common dtype, as ATen's act(gate) * up, and is the op on the promoted inputs (computed once,
    rounded once), within that dtype's tolerance of the float64 reference. The dispatcher op itself still
    refuses mixed dtypes (test_validation)."""
    gate, up = optable.make_inputs(name, (5, 7), torch.float64, device)
    gate, up = gate.to(dtypes[0]), up.to(dtypes[1])
    common = torch.promote_types(*dtypes)
    out = api_call(name)(gate, up)
    assert out.dtype == common == torch.result_type(gate, up), (out.dtype, common)
    assert_matches_reference(name, (gate.to(common), up.to(common)), out, aten=False)


@pytest.mark.parametrize("device", _DEVICES)
def test_autocast_matches_aten(device):
    """Under autocast (bfloat16 on the CPU, float16 on CUDA) the projections' outputs are 16-bit and the ops run
    in that dtype, as ATen's silu(g) * u does there; a projection's 16-bit output next to a float32 tensor
    promotes to float32, as ATen does. Both match ATen's expression under the same autocast."""
    dtype = torch.bfloat16 if device == "cpu" else torch.float16
    torch.manual_seed(0)
    x = torch.randn(4, 16, device=device)
    w_g, w_u = torch.randn(24, 16, device=device) / 4, torch.randn(24, 16, device=device) / 4
    u32 = torch.randn(4, 24, device=device)
    for act in ACTIVATIONS:
        gated = functools.partial(ffn_ext.gated, activation=act.name)
        with torch.autocast(device, dtype=dtype):
            got = gated(F.linear(x, w_g), F.linear(x, w_u))
            want = act.aten(F.linear(x, w_g)) * F.linear(x, w_u)
            got_mixed = gated(F.linear(x, w_g), u32)
            want_mixed = act.aten(F.linear(x, w_g).float()) * u32  # computed once in float32
        assert got.dtype == want.dtype == dtype and got_mixed.dtype == torch.float32
        assert_close_to(got, want.double(), dtype, f"{act.name} autocast", scale=4)
        torch.testing.assert_close(got_mixed, want_mixed, rtol=1e-5, atol=1e-6)


def test_mixed_dtypes_promote_under_compile():
    torch._dynamo.reset()
    g, u = torch.randn(3, 8), torch.randn(3, 8, dtype=torch.bfloat16)
    out = torch.compile(ffn_ext.swiglu, backend="aot_eager", fullgraph=True)(g, u)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, F.silu(g) * u.float())


@pytest.mark.parametrize("name", optable.OPS)
def test_pointwise_tags(name):
    """torch.Tag.pointwise on every elementwise op of the table (unary and gated, forward and backward), as ATen's
    gelu/silu/mul carry; not on the packed ops, which pair elements along the last dim. The stable ABI can tag a
    schema from torch 2.12 on (csrc/registration.cpp looks the call up at run time): before, no op is tagged."""
    tagged = torch.torch_version.TorchVersion(torch.__version__) >= "2.12"
    assert ffn_ext.build_info()["pointwise_tags"] == ("yes" if tagged else "no"), ffn_ext.build_info()
    tags = getattr(torch.ops.ffn_ext, name).default.tags
    assert (torch.Tag.pointwise in tags) == (tagged and not optable.is_packed(name)), (name, tags)


# ---------------------------------------------------------------- memory format
_FORMATS = [(torch.channels_last, (2, 3, 4, 5)), (torch.channels_last_3d, (2, 3, 2, 4, 5))]
_SAME_SHAPE = [n for n in optable.OPS if not optable.is_packed(n)]


def _in_format(t, fmt):
    return t.contiguous(memory_format=fmt)


@pytest.mark.parametrize("fmt,shape", _FORMATS, ids=["channels_last", "channels_last_3d"])
@pytest.mark.parametrize("name", _SAME_SHAPE)
def test_outputs_keep_channels_last(name, fmt, shape):
    """Every unary and gated op (forward and backward): inputs all channels_last (channels_last_3d) give outputs in
    that format, as ATen's pointwise ops, with the values of contiguous inputs; on the CPU kernels, on the CUDA
    launch emulated on the host (one long row over the storage, rows.h) and under FakeTensorMode (the fake kernels
    give the real strides). One input in another format: contiguous outputs, the same values."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    kw = optable.op_kwargs(name)
    ins = optable.make_inputs(name, shape, torch.float32)
    cl = [_in_format(t, fmt) for t in ins]
    assert all(not t.is_contiguous() for t in cl)
    emulate = native.testing()._emulate_cuda
    paths = {
        "cpu": lambda *a: optable.op(name)(*a, **kw),
        "emulated_cuda": lambda *a: emulate(name, list(a), 132, host_params(name), "concat"),
    }
    # ATen's vectorized and scalar loops differ in the last bits, relative to the terms a formula cancels and the
    # factors multiplying it (S and M: gelu_tanh's derivative at x = -5.1 times grad * up = -12 is 1.3e-5 one way,
    # -0 the other)
    scales = [s + m for _, s, m in optable.limit_terms(name, [t.double() for t in ins], kw or None)]

    def close(got, want, path):
        for g, w, s in zip(got, want, scales):
            assert ((g.double() - w.double()).abs() <= 1e-5 * (1 + w.double().abs() + s)).all(), path

    for path, fn in paths.items():
        want = as_tuple(fn(*ins))  # the path's own result on contiguous inputs (the paths differ in the last bits)
        got = as_tuple(fn(*cl))
        assert all(g.is_contiguous(memory_format=fmt) for g in got), (path, [g.stride() for g in got])
        close(got, want, path)
        if len(cl) > 1:  # formats that disagree: contiguous outputs
            got = as_tuple(fn(cl[0], *ins[1:]))
            assert all(g.is_contiguous() for g in got), (path, [g.stride() for g in got])
            close(got, want, path)
    with FakeTensorMode() as mode:
        fake = as_tuple(optable.op(name)(*[mode.from_tensor(t) for t in cl], **kw))
    assert [f.stride() for f in fake] == [g.stride() for g in as_tuple(optable.op(name)(*cl, **kw))]
