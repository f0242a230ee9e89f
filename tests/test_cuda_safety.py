"""CUDA execution safety of the ffn_ext kernels: non-default streams, CUDA graph capture and replay,
torch.compile(mode="reduce-overhead") (CUDA graphs under inductor), several devices, and a build without CUDA
kernels serving CUDA tensors. Everything here needs a GPU (marked `cuda`; without one, what can runs in the CUDA
stand-in, tests/cuda_standin.py).

Memory checking is a separate plain script for compute-sanitizer: tests/cuda_sanitize_cases.py.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from conftest import HANG_GUARD_S
from optable import OPS as OP_NAMES
from optable import PACKINGS, as_tuple, call, is_packed, spec

import ffn_ext

OPS = torch.ops.ffn_ext
pytestmark = pytest.mark.cuda

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def _inputs(dtype, rows=33, m=200, seed=0, device="cuda"):
    gen = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(rows, 2 * m, generator=gen) * 2).to(dtype).to(device)
    grad = torch.randn(rows, m, generator=gen).to(dtype).to(device)
    return gate_up, grad


def _all_ops(gate_up, grad):
    """Every op of the table once (x: gate, or up for every other op; gate and up: chunk views of gate_up; a gated
    op with parameters with its example values), the packed ones in every layout; returns a flat list of
    outputs."""
    gate, up = gate_up.chunk(2, -1)
    outs = []
    for k, name in enumerate(OP_NAMES):
        args = {"x": gate if k % 2 == 0 else up, "gate": gate, "up": up, "gate_up": gate_up, "grad": grad}
        for packing in PACKINGS if is_packed(name) else (None,):
            outs += as_tuple(call(name, packing)(*[args[a] for a in spec(name).args]))
    return outs


def _assert_all_equal(a, b, what):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"{what}: output {i} differs (max {(x.double() - y.double()).abs().max()})"


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_default_stream_matches_default_stream(dtype):
    gate_up, grad = _inputs(dtype)
    expected = _all_ops(gate_up, grad)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got = _all_ops(gate_up, grad)
    for t in (gate_up, grad):
        t.record_stream(s)
    torch.cuda.current_stream().wait_stream(s)
    _assert_all_equal(got, expected, f"side stream {dtype}")


def test_kernels_run_on_the_current_stream():
    """On a side stream: a long sleep, then an in-place update of the input, then the ops. If a kernel were
    launched on another stream (e.g. the legacy default stream) it would read the input before the update."""
    gate_up, grad = _inputs(torch.float32, rows=256, m=512)
    new_gate_up, _ = _inputs(torch.float32, rows=256, m=512, seed=1)
    expected = _all_ops(new_gate_up, grad)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)  # ~tens of ms of GPU time on s
        gate_up.copy_(new_gate_up)
        got = _all_ops(gate_up, grad)
    torch.cuda.current_stream().wait_stream(s)
    _assert_all_equal(got, expected, "ops ordered after the stream's earlier work")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_capture_and_replay(dtype):
    static_gu, static_grad = _inputs(dtype)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up outside the capture
        _all_ops(static_gu, static_grad)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = _all_ops(static_gu, static_grad)
    for seed in (1, 2, 3):
        new_gu, new_grad = _inputs(dtype, seed=seed)
        static_gu.copy_(new_gu)
        static_grad.copy_(new_grad)
        g.replay()
        torch.cuda.synchronize()
        _assert_all_equal([o.clone() for o in static_out], _all_ops(new_gu, new_grad), f"graph replay {seed}")


def test_cuda_graph_capture_with_autograd():
    lin = torch.nn.Linear(64, 2 * 96, device="cuda")
    static_x = torch.randn(16, 64, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            lin.zero_grad(set_to_none=True)
            ffn_ext.swiglu_packed(lin(static_x)).sum().backward()
    torch.cuda.current_stream().wait_stream(s)
    lin.zero_grad(set_to_none=True)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_y = ffn_ext.swiglu_packed(lin(static_x))
        static_y.sum().backward()
    for seed in (1, 2):
        x = torch.randn(16, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        static_x.copy_(x)
        g.replay()
        torch.cuda.synchronize()
        w = lin.weight.detach().clone().requires_grad_(True)
        b = lin.bias.detach().clone().requires_grad_(True)
        h = F.linear(x, w, b)
        y = F.silu(h[:, :96]) * h[:, 96:]
        y.sum().backward()
        torch.testing.assert_close(static_y, y, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lin.weight.grad, w.grad, rtol=1e-4, atol=1e-4)


class _MLP(torch.nn.Module):
    def __init__(self, d=128, m=192):
        super().__init__()
        self.up = torch.nn.Linear(d, 2 * m)
        self.down = torch.nn.Linear(m, d)

    def forward(self, x):
        return ffn_ext.gelu(self.down(ffn_ext.swiglu_packed(self.up(x))))


@pytest.mark.slow
def test_compile_reduce_overhead_matches_eager():
    torch._dynamo.reset()
    model = _MLP().cuda()
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for i in range(5):  # warm-up, recording, then graph replays with new inputs
            x = torch.randn(24, 128, device="cuda")
            got = compiled(x).clone()  # cudagraph outputs are overwritten by the next replay
            torch.testing.assert_close(got, model(x), rtol=1e-5, atol=1e-5, msg=lambda m: f"call {i}: {m}")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_second_device_uses_its_own_guard():
    """Tensors on cuda:1 while cuda:0 is current: the kernels run on the tensors' device."""
    assert torch.cuda.current_device() == 0
    gu1, grad1 = _inputs(torch.float32, device="cuda:1")
    out = _all_ops(gu1, grad1)
    torch.cuda.synchronize(1)
    assert all(o.device == torch.device("cuda:1") for o in out)
    ref = _all_ops(gu1.cpu().double(), grad1.cpu().double())
    for o, r in zip(out, ref):
        torch.testing.assert_close(o.cpu().double(), r, rtol=1e-5, atol=1e-5)
    with torch.cuda.device(1):  # and the other way round
        gu0, grad0 = _inputs(torch.float32, device="cuda:0")
        out0 = _all_ops(gu0, grad0)
    assert all(o.device == torch.device("cuda:0") for o in out0)
    _assert_all_equal(
        [o.cpu() for o in out0], [o.cpu() for o in _all_ops(gu0.cpu().cuda(1), grad0.cuda(1))], "cuda:0 vs cuda:1"
    )


_CPU_ONLY_BUILD = textwrap.dedent(r"""
    import sys, warnings
    warnings.simplefilter("always")
    import torch, torch.nn.functional as F
    import ffn_ext
    ffn_ext.jit.load(with_cuda=False, build_directory=sys.argv[1], name="ffn_ext_cpuonly")
    assert not ffn_ext.has_cuda_kernels(), ffn_ext.build_info()
    x = torch.randn(9, 22, device="cuda", dtype=torch.float64)
    g = torch.randn(9, 11, device="cuda", dtype=torch.float64)
    from ffn_ext.table import ACTIVATIONS
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        outs = [ffn_ext.gelu(x), ffn_ext.silu(x), ffn_ext.swiglu_packed(x), ffn_ext.swiglu(*x.chunk(2, -1)),
                torch.ops.ffn_ext.swiglu_packed_backward(g, x), torch.ops.ffn_ext.gelu_backward(x, x)]
        outs += [ffn_ext.gelu(x) for _ in range(3)]
        packed = [ffn_ext.gated_packed(x, activation=a.name) for a in ACTIVATIONS]
    assert all(o.is_cuda for o in outs + packed)
    torch.testing.assert_close(outs[0], F.gelu(x))
    torch.testing.assert_close(outs[2], F.silu(x[:, :11]) * x[:, 11:])
    for a, h in zip(ACTIVATIONS, packed):
        torch.testing.assert_close(h, a.aten(x[:, :11]) * x[:, 11:])
    msgs = [str(m.message) for m in w if "without CUDA kernels" in str(m.message)]
    print("python warnings:", len(msgs))
""")


@pytest.mark.slow
def test_cpu_only_build_serves_cuda_tensors_with_one_warning(tmp_path):
    """A build without CUDA kernels (JIT, with_cuda=False) still runs CUDA tensors through the ATen composites
    and warns once (ffn_ext/_kernels.py)."""
    env = dict(os.environ, FFN_EXT_NO_C="1")
    r = subprocess.run(
        [sys.executable, "-c", _CPU_ONLY_BUILD, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-5000:]
    # one Python warning; stderr counted too, in case a C++ warning were printed there instead
    python_warnings = int(r.stdout.split("python warnings:")[1].split()[0])
    printed = r.stderr.count("without CUDA kernels")
    assert python_warnings + printed == 1, r.stdout[-3000:] + r.stderr[-3000:]
