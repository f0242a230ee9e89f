"""ffn_ext.quantize_fp8 (ffn_ext.fp8): the FP8 MLP through F.scaled_mm RowWise equals, bit for bit, the same
path written out with quant.py's reference quantization and ffn_ext's unfused ops; and the bf16 MLP within FP8's
error (the measured relative error is printed with -s)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ffn_ext
from ffn_ext import fp8
from ffn_ext.fp8 import BLOCK, FP8FFN, ROW, FP8GatedFFN, quantize_fp8
from ffn_ext.quant import reference_quantize

pytestmark = pytest.mark.skipif(
    not hasattr(F, "scaled_mm"), reason="torch.nn.functional.scaled_mm (RowWise) is not in this torch"
)

RW = None if not hasattr(F, "scaled_mm") else F.ScalingType.RowWise


def ref_linear(qa, sa, w, b, dt):
    qw, sw = reference_quantize(w.detach(), ROW)
    if qa.is_cpu and not fp8._CPU_SCALED_MM:
        # torch 2.10 has no CPU scaled_mm: the product it computes, from the dequantized values in float32
        y = ((qa.float() * sa) @ (qw.float() * sw.reshape(-1, 1)).t()).to(dt)
    else:
        y = F.scaled_mm(qa, qw.t(), sa, RW, sw.reshape(1, -1).contiguous(), RW, output_dtype=dt)
    return y if b is None else y + b.detach().to(dt)


def gate_up_weights(ffn):
    """[gate | up] weight rows (and bias) of a gated FFN, as one GEMM's."""
    if "gate_up_proj" not in ffn._modules:
        g, u = ffn.gate_proj, ffn.up_proj
        return torch.cat([g.weight, u.weight]), None if g.bias is None else torch.cat([g.bias, u.bias])
    gu = ffn.gate_up_proj
    if ffn.act.layout == "concat":
        return gu.weight, gu.bias
    return torch.cat([gu.weight[0::2], gu.weight[1::2]]), None if gu.bias is None else torch.cat(
        [gu.bias[0::2], gu.bias[1::2]]
    )


def ref_gated(ffn, x):
    """The FP8 path by hand: quant.py's reference quantization, F.scaled_mm, ffn_ext's unfused packed op."""
    dt, x2 = x.dtype, x.reshape(-1, x.shape[-1])
    qx, sx = reference_quantize(x2, ROW)
    gu = ref_linear(qx, sx, *gate_up_weights(ffn), dt)
    act = ffn.act
    if isinstance(act, ffn_ext.SwiGLU) and act.clamped:
        h = ffn_ext.swiglu_clamped_packed(gu, limit=act.limit, alpha=act.alpha, up_offset=act.up_offset)
    else:
        h = ffn_ext.gated_packed(gu, act.activation)
    qh, sh = reference_quantize(h, ROW)
    return ref_linear(qh, sh, ffn.down_proj.weight, ffn.down_proj.bias, dt).reshape(x.shape)


def make(kind, dt):
    torch.manual_seed(3)
    if kind == "swiglu":
        return ffn_ext.SwiGLUFFN(256, 384, dtype=dt)
    if kind == "geglu_tanh_bias":
        return ffn_ext.GeGLUFFN(256, 384, approximate="tanh", bias=True, dtype=dt)
    if kind == "fused_gate_up":
        return ffn_ext.GatedFFN(256, 384, "gelu", fused_gate_up=True, dtype=dt)
    m = ffn_ext.GatedFFN(256, 384, "silu", fused_gate_up=True, dtype=dt)  # GPT-OSS: clamped, interleaved
    m.act = ffn_ext.SwiGLU(limit=7.0, alpha=1.702, up_offset=1.0, layout="interleaved")
    return m


@pytest.mark.parametrize("kind", ["swiglu", "geglu_tanh_bias", "fused_gate_up", "clamped_interleaved"])
def test_fp8_gated_mlp(kind):
    dt = torch.bfloat16
    ffn = make(kind, dt)
    x = torch.randn(2, 7, 256, dtype=dt)
    m8 = quantize_fp8(ffn)
    assert isinstance(m8, FP8GatedFFN)
    with torch.no_grad():
        y8 = m8(x)
        ref = ref_gated(ffn, x)
        exact = ffn.float()(x.float())
    assert torch.equal(y8, ref)
    assert torch.equal(
        m8.gate_up.weight_q.view(torch.uint8),
        reference_quantize(gate_up_weights(ffn)[0].detach(), ROW)[0].view(torch.uint8),
    )
    err = ((y8.float() - exact).norm() / exact.norm()).item()
    bf16 = ffn.to(dt)(x)
    err_bf16 = ((bf16.float() - exact).norm() / exact.norm()).item()
    print(f"{kind}: FP8 MLP relative error {err:.4f} (bf16 MLP {err_bf16:.4f}) vs the fp32 MLP")
    assert err < 0.1  # measured 0.057-0.067 (bf16: 0.004): e4m3 on x, h and both weights, per-row scales


class _Mul(nn.Module):
    def forward(self, gate, up):
        return gate * up


def test_fp8_classic_ffn_and_containers():
    torch.manual_seed(4)
    model = nn.Sequential(
        ffn_ext.FFN(128, 256, "gelu", dtype=torch.bfloat16), ffn_ext.SwiGLUFFN(128, 256, dtype=torch.bfloat16)
    )
    odd = ffn_ext.SwiGLUFFN(128, 256, dtype=torch.bfloat16)
    odd.act = _Mul()  # not one of ffn_ext's activations: not converted, named in a warning
    model.append(nn.Sequential(odd))
    x = torch.randn(9, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        exact = model.float()(x.float())
        model = model.to(torch.bfloat16)
        with pytest.warns(UserWarning, match=r"2\.0 \(SwiGLUFFN\) is not converted"):
            quantize_fp8(model)
        assert isinstance(model[0], FP8FFN) and isinstance(model[1], FP8GatedFFN)
        assert isinstance(model[2][0], ffn_ext.SwiGLUFFN)
        err = ((model(x).float() - exact).norm() / exact.norm()).item()
    print(f"Sequential(FFN, SwiGLUFFN, SwiGLUFFN not converted): relative error {err:.4f}")
    assert err < 0.25  # three MLPs in a row, two in FP8: measured 0.146 (one FP8 MLP: 0.057-0.067)


def test_fp8_row_on_cpu_is_named_once(fresh_warning):
    """recipe="row" runs F.scaled_mm on the CPU too, which has no FP8 units: one warning per process says that it
    is slower than the bf16 MLP, not a speed-up."""
    m8 = quantize_fp8(ffn_ext.SwiGLUFFN(128, 256, dtype=torch.bfloat16))
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        with pytest.warns(RuntimeWarning, match=r"recipe=\"row\" on cpu: .* 7-10x slower than the bf16 MLP") as got:
            y = m8(x)
        assert got[0].filename == __file__, got[0].filename  # the caller's line, not one inside torch or ffn_ext
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once
            assert torch.equal(m8(x), y)


def test_fp8_recipe_error():
    with pytest.raises(ValueError, match="`recipe` must be \"row\" .* or \"block\""):
        quantize_fp8(ffn_ext.SwiGLUFFN(128, 256), recipe="blocks")


# ---------------------------------------------------------------- recipe="block"
def ref_weight_blocks(w):
    """q, scale [N/128, K/128] of w by the formula, one 128x128 block at a time (loops: independent of fp8.py)."""
    n, k = w.shape
    q, s = torch.empty(n, k, dtype=torch.float8_e4m3fn), torch.empty(n // 128, k // 128)
    for i in range(n // 128):
        for j in range(k // 128):
            blk = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            qb, sb = reference_quantize(blk.reshape(1, -1), ROW)
            q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128], s[i, j] = qb.reshape(128, 128), sb.item()
    return q, s


def emulated(qa, sa, qw, sw, dt):
    a = qa.float() * sa.repeat_interleave(128, 1)
    w = qw.float() * sw.repeat_interleave(128, 0).repeat_interleave(128, 1)
    return (a @ w.t()).to(dt)


def ref_block_gated(ffn, x):
    dt, x2 = x.dtype, x.reshape(-1, x.shape[-1])
    w, b = gate_up_weights(ffn)
    qx, sx = reference_quantize(x2, BLOCK)
    gu = emulated(qx, sx, *ref_weight_blocks(w.detach()), dt)
    gu = gu if b is None else gu + b.detach().to(dt)
    h = ffn_ext.gated_packed(gu, ffn.act.activation)
    qh, sh = reference_quantize(h, BLOCK)
    d = ffn.down_proj
    y = emulated(qh, sh, *ref_weight_blocks(d.weight.detach()), dt)
    return (y if d.bias is None else y + d.bias.detach().to(dt)).reshape(x.shape)


@pytest.fixture
def fresh_warning(monkeypatch):
    monkeypatch.setattr(fp8, "_EMULATED_WARNED", set())


@pytest.mark.parametrize("kind", ["swiglu", "geglu_tanh_bias"])
def test_fp8_block_mlp_emulated_on_cpu(kind, fresh_warning):
    """Off sm_90 the block recipe's GEMMs are the named float32 emulation: one warning, the same result as the path
    written out (block-by-block weight quantization, reference_quantize in 1x128 column-layout groups)."""
    dt = torch.bfloat16
    ffn = make(kind, dt)
    x = torch.randn(2, 7, 256, dtype=dt)
    m8 = quantize_fp8(ffn, recipe="block")
    assert isinstance(m8, FP8GatedFFN) and m8.gate_up.weight_scale.shape == (6, 2)
    with torch.no_grad():
        with pytest.warns(RuntimeWarning, match=r"recipe=\"block\" on cpu: .* emulated"):
            y8 = m8(x)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per device
            assert torch.equal(m8(x), y8)
        ref = ref_block_gated(ffn, x)
        exact = ffn.float()(x.float())
    assert torch.equal(y8, ref)
    q, s = ref_weight_blocks(gate_up_weights(ffn)[0].detach())
    assert torch.equal(m8.gate_up.weight_q.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(m8.gate_up.weight_scale, s)
    err = ((y8.float() - exact).norm() / exact.norm()).item()
    print(f"{kind}: block FP8 MLP relative error {err:.4f} vs the fp32 MLP")
    assert err < 0.1  # measured 0.060-0.065 (row: 0.057-0.067): 128 activations, 128x128 weights per scale


def test_fp8_block_needs_multiples_of_128():
    with pytest.raises(
        ValueError, match=r"recipe=\"block\" needs .* multiples of 128.*down projection has weight \[out=256, in=320\]"
    ):
        quantize_fp8(ffn_ext.SwiGLUFFN(256, 320), recipe="block")
    with pytest.raises(ValueError, match=r"up projection \(fc1\) has weight \[out=256, in=200\]"):
        quantize_fp8(ffn_ext.FFN(200, 256, "gelu"), recipe="block")


def test_fp8_block_sm90_path_arguments(monkeypatch, fresh_warning):
    """The sm_90 path without a GPU: F.scaled_mm mocked, the capability check forced; what it is given is what
    cuBLAS's block-scaled GEMM takes (1x128 column-major x scales, 128x128 weight scales transposed with mat_b)."""
    dt = torch.bfloat16
    ffn = ffn_ext.FFN(256, 384, "gelu", dtype=dt)
    x = torch.randn(5, 256, dtype=dt)
    m8 = quantize_fp8(ffn, recipe="block")
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="emulated"):
        want = m8(x)
    calls = []

    def fake_scaled_mm(a, b, sa, ra, sb, rb, output_dtype=None):
        """torch's CUDA check of this recipe pair (_scaled_block1x128_block128x128), then the emulation."""
        m, k = a.shape
        n, kb, kb4 = b.shape[1], k // 128, -(-k // 512) * 4
        assert a.dtype == b.dtype == torch.float8_e4m3fn and a.stride() == (k, 1) and b.stride() == (1, k)
        assert ra == F.ScalingType.BlockWise1x128 and rb == F.ScalingType.BlockWise128x128
        assert sa.dtype == sb.dtype == torch.float32 and m % 4 == 0
        assert sa.shape == (m, kb) and sa.stride() == (1, m)  # MN-major ("column")
        assert sb.shape == (kb4, n // 128) and sb.stride() == (1, kb4)  # K blocks padded to a multiple of 4
        assert not sb[kb:].any()
        calls.append((m, k, n))
        return emulated(a, sa, b.t(), sb[:kb].t(), output_dtype)

    monkeypatch.setattr(fp8, "_blockwise_native", lambda device: True)
    monkeypatch.setattr(F, "scaled_mm", fake_scaled_mm)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        got = m8(x)
    assert calls == [(8, 256, 384), (8, 384, 256)]  # 5 tokens padded to 8 (zero rows), cut back
    assert torch.equal(got, want)


def test_blockwise_native_only_on_sm90(monkeypatch):
    assert not fp8._blockwise_native(torch.device("cpu"))
    for cap, native in (((9, 0), True), ((8, 0), False), ((10, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, cap=cap: cap)
        assert fp8._blockwise_native(torch.device("cuda", 0)) is native
