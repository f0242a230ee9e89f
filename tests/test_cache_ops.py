"""The FP8 activation cache's ops (table.CACHE_SCHEMAS, csrc/cache_kernel.h): <gated>_cache(gate, up) -> (h, q, scale)
and <gated>_cached_backward(grad, q, scale) -> (dgate, dup, h), for every gated op of the table.

The CUDA kernels' per-lane code runs emulated on the host (tests/native.py's _emulate_cache, outputs poisoned first)
and must equal, bit for bit, what it fuses: the unfused CUDA kernels' h and gradients (their launches emulated too)
and ffn_ext.quant's formula of [gate | up]; the backward's gate and up are the cache read back (quant.dequantize).
The ops' CPU kernels (the ATen formula) are checked against the same composition, and their checks, fake kernels
and schemas with opcheck."""

from __future__ import annotations

import native
import pytest
import torch
from optable import DEVICES, GATED
from test_quant import rand_h

import ffn_ext
from ffn_ext import _kernels, quant
from ffn_ext.quant import QuantRecipe, reference_quantize

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _params(g) -> list:
    return [float(v) for v in g.example.values()]


def _inputs(gen, dtype, rows, m, packed):
    """gate and up [rows, m] over many magnitudes per group, with zero groups, NaN and +-inf; views of one
    [rows, 2m] tensor (row stride 2m) when packed, else two tensors, gate 2 bytes off 16-byte alignment."""
    if packed:
        big = rand_h((rows, 2 * m), dtype, "cpu", gen)
        return big[:, :m], big[:, m:]
    return rand_h((rows, m + 1), dtype, "cpu", gen)[:, 1:], rand_h((rows, m), dtype, "cpu", gen)


def _bits(t):
    return t.contiguous().view(torch.uint8)


def _same(actual, expected, what):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    if actual.dtype.is_floating_point and actual.dtype.itemsize > 1:  # NaN where NaN: a NaN's payload is not defined
        nan = torch.isnan(expected)
        assert torch.equal(torch.isnan(actual), nan), f"{what}: NaN positions differ"
        assert torch.equal(_bits(actual.masked_fill(nan, 0)), _bits(expected.masked_fill(nan, 0))), f"{what} differs"
    else:
        assert torch.equal(_bits(actual), _bits(expected)), f"{what} differs"


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_emulation_bit_identical(dtype):
    # every gated op, every group size, one and several rows, aligned and unaligned (element-load) operands
    gen = torch.Generator().manual_seed(7 + dtype.itemsize)
    emu = native.testing()
    for trial, g in enumerate(GATED):
        for group in (128, 64, 32):
            rows, m = (1, 5, 33)[(trial + group) % 3], group * (1, 3, 2)[trial % 3]
            params = _params(g)
            gate, up = _inputs(gen, dtype, rows, m, packed=(trial + group) % 2 == 0)
            h, q, scale = emu._emulate_cache(g.name + "_cache", [gate, up], params, group)
            what = f"{g.name} {dtype} G={group} rows={rows} M={m}"
            _same(h, emu._emulate_cuda(g.name, [gate, up], params=params)[0], f"{what}: h")
            eq, es = reference_quantize(torch.cat((gate, up), -1), QuantRecipe(group_size=group))
            _same(q, eq, f"{what}: q")
            _same(scale, es, f"{what}: scale")
            # the backward from that cache: the unfused kernels on the values it reads back
            grad = rand_h((rows, m), dtype, "cpu", gen, specials=False)
            dg, du, hb = emu._emulate_cache(g.name + "_cached_backward", [grad, q, scale], params)
            g_back, u_back = quant.dequantize(q, scale, dtype).chunk(2, -1)
            edg, edu = emu._emulate_cuda(g.name + "_backward", [grad, g_back, u_back], params=params)
            _same(dg, edg, f"{what}: dgate")
            _same(du, edu, f"{what}: dup")
            _same(hb, emu._emulate_cuda(g.name, [g_back, u_back], params=params)[0], f"{what}: backward's h")


def test_a_cache_off_an_8_byte_boundary_is_read():
    # the kernel reads q 8 bytes at a time: a view of it one byte on is copied by the glue first, same values
    emu = native.testing()
    gate, up, grad = (torch.randn(3, 64) for _ in range(3))
    _, q, scale = emu._emulate_cache("swiglu_cache", [gate, up], [], 32)
    shifted = torch.empty(q.numel() + 1, dtype=torch.uint8)[1:].view(torch.float8_e4m3fn).view(q.shape)
    shifted.copy_(q)
    assert shifted.data_ptr() % 8
    want = emu._emulate_cache("swiglu_cached_backward", [grad, q, scale], [])
    got = emu._emulate_cache("swiglu_cached_backward", [grad, shifted, scale], [])
    for g, w, what in zip(got, want, ("dgate", "dup", "h")):
        _same(g, w, what)


def test_fp8_read_back_is_exact():
    # every float8_e4m3fn byte (subnormals, -0, NaN) as up's value, read back by the kernel as torch casts it: with
    # gate 1.0 and grad 1, reglu's dgate = grad * up * (gate > 0) is up itself
    up = torch.arange(256, dtype=torch.uint8).reshape(2, 128)
    gate = torch.full((2, 128), 0x38, dtype=torch.uint8)  # 1.0
    q = torch.cat((gate, up), -1).view(torch.float8_e4m3fn)
    dg, du, _ = native.testing()._emulate_cache("reglu_cached_backward", [torch.ones(2, 128), q, torch.ones(2, 2)], [])
    _same(dg, up.view(torch.float8_e4m3fn).float(), "every fp8 byte")
    assert torch.equal(du, torch.ones(2, 128))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("g", GATED, ids=[g.name for g in GATED])
def test_cpu_kernel_is_the_composition(g, device):
    gen = torch.Generator().manual_seed(3)
    gate, up = (torch.randn(4, 3, 256, generator=gen).to(device) * 3 for _ in range(2))
    p = g.example
    h, q, scale = _kernels.OP[g.name + "_cache"](gate, up, group_size=64, **p)
    assert q.shape == (4, 3, 512) and scale.shape == (4, 3, 8) and q.dtype == torch.float8_e4m3fn
    eq, es = reference_quantize(torch.cat((gate, up), -1), QuantRecipe(group_size=64))
    assert torch.equal(_bits(q), _bits(eq)) and torch.equal(scale, es)
    torch.testing.assert_close(h, _kernels.OP[g.name](gate, up, **p))
    grad = torch.randn(4, 3, 256, generator=gen).to(device)
    dg, du, hb = _kernels.OP[g.name + "_cached_backward"](grad, q, scale, **p)
    gb, ub = quant.dequantize(q, scale, torch.float32).chunk(2, -1)
    edg, edu = _kernels.OP[g.name + "_backward"](grad, gb, ub, **p)
    torch.testing.assert_close((dg, du, hb), (edg, edu, _kernels.OP[g.name](gb, ub, **p)))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    gen = torch.Generator().manual_seed(5)
    for g in GATED:
        gate, up, grad = (torch.randn(3, 5, 128, generator=gen).to(device) for _ in range(3))
        torch.library.opcheck(getattr(torch.ops.ffn_ext, g.name + "_cache").default, (gate, up), g.example)
        _, q, scale = _kernels.OP[g.name + "_cache"](gate, up, **g.example)
        op = getattr(torch.ops.ffn_ext, g.name + "_cached_backward").default
        # (not test_schema: its mode compares the inputs after the call with ops float8 has no CPU kernel of)
        checks = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
        torch.library.opcheck(op, (grad, q, scale), g.example, test_utils=checks)


def test_every_gated_op_has_cache_ops():
    for g in GATED:
        for suffix in ("_cache", "_cached_backward"):
            assert hasattr(torch.ops.ffn_ext, g.name + suffix), g.name + suffix


def test_errors_name_the_argument():
    gate, up = torch.randn(4, 96), torch.randn(4, 96)
    cache, back = _kernels.OP["swiglu_cache"], _kernels.OP["swiglu_cached_backward"]
    with pytest.raises(ValueError, match="`group_size`=64 must divide"):
        cache(gate, up, group_size=64)
    with pytest.raises(ValueError, match="`group_size` must be one of"):
        cache(gate, up, group_size=48)
    with pytest.raises(ValueError, match="swiglu_cache: .*`up`"):
        cache(gate, torch.randn(4, 64))
    _, q, scale = cache(gate, up, group_size=32)
    grad = torch.randn(4, 96)
    with pytest.raises(ValueError, match="`q` to be a float8_e4m3fn"):
        back(grad, q.float(), scale)
    with pytest.raises(ValueError, match="`scale` to be a float32"):
        back(grad, q, scale[:, :5])
    with pytest.raises(TypeError, match="`grad`"):
        back(grad.int(), q, scale)
    with pytest.raises(ValueError, match="limit"):
        _kernels.OP["swiglu_clamped_cache"](gate, up, group_size=32, limit=-1.0)


def test_kernel_guards():
    # the C++ guards of the CUDA glue (what a CUDA call raises before the Python checks explain it)
    emu = native.testing()
    gate = torch.randn(2, 96)
    with pytest.raises(RuntimeError, match="group_size"):
        emu._emulate_cache("swiglu_cache", [gate, gate], [], 64)
    with pytest.raises(RuntimeError, match="float32, float16 and bfloat16"):
        emu._emulate_cache("swiglu_cache", [gate.double(), gate.double()], [], 32)
    _, q, scale = emu._emulate_cache("swiglu_cache", [gate, gate], [], 32)
    with pytest.raises(RuntimeError, match="`scale`"):
        emu._emulate_cache("swiglu_cached_backward", [gate, q, scale[:, :3]], [])
    with pytest.raises(RuntimeError, match="`q`"):
        emu._emulate_cache("swiglu_cached_backward", [gate, q[:, :100], scale], [])


def test_gating_methods():
    g = ffn_ext.Gating("swiglu_clamped", limit=7.0, alpha=1.702, up_offset=1.0)
    gate, up = torch.randn(6, 128) * 8, torch.randn(6, 128) * 8
    h, q, scale = g.cache(gate, up)
    assert torch.equal(h, g(gate, up)) and scale.shape == (6, 2)
    grad = torch.randn(6, 128)
    dg, du, hb = g.cached_backward(grad, q, scale)
    gb, ub = quant.dequantize(q, scale, torch.float32).chunk(2, -1)
    torch.testing.assert_close((dg, du), g.backward(grad, gb, ub))
    torch.testing.assert_close(hb, g(gb, ub))
