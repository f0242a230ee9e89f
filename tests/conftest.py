"""Shared test configuration and helpers for ffn_ext.

Markers (declared in pyproject.toml):
  cuda   needs a CUDA GPU. Skips when torch.cuda.is_available() is False; FAILS when a GPU is present but the loaded
         ffn_ext has no CUDA kernels (a wrong build must not pass silently as "skipped").
  large  tensors past 2**31 elements (tens of GiB): skip unless FFN_EXT_RUN_LARGE=1.
  slow   builds or subprocesses.

Helpers other test files can import (``from conftest import reference, tolerance, ...``):
  OPS, FORWARD_OPS, BACKWARD_OPS, FLOAT_DTYPES     op names (torch.ops.ffn_ext.<name>) and dtypes
  op(name)                                         the torch.ops.ffn_ext OpOverloadPacket
  reference(name, *inputs, inf_limits=False)       fp64 result of op `name` computed with ATen from the same inputs
  tolerance(dtype)                                 dict(rtol=, atol=) for comparing a dtype's result to fp64
  assert_matches_reference(name, inputs, out)      shape/dtype/device/contiguity + values vs reference()
  make_layout(shape, dtype, device, layout)        random tensor of logical `shape` laid out as `layout` (LAYOUTS)
  make_inputs(name, shape, dtype, device, layout)  the inputs of op `name` (shape = the op's output shape)
  input_shapes(name, shape)                        the input shapes of op `name` for output shape `shape`
  poison_cuda_cache(device)                        fill the caching allocator's free memory with NaN
  as_tuple(x)                                      x if tuple/list else (x,)
"""
from __future__ import annotations

import math
import os
import zlib

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import ffn_ext

# ---------------------------------------------------------------- markers: cuda / large
LARGE_ENV = "FFN_EXT_RUN_LARGE"


def cuda_ready() -> bool:
    """True when CUDA tests can run (a GPU is visible)."""
    return torch.cuda.is_available()


def pytest_runtest_setup(item):
    if item.get_closest_marker("large") is not None and os.environ.get(LARGE_ENV, "0") != "1":
        pytest.skip(f"large test (tensors past 2**31 elements): set {LARGE_ENV}=1 to run it")
    if item.get_closest_marker("cuda") is not None:
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU: torch.cuda.is_available() is False")
        if not ffn_ext.has_cuda_kernels():
            pytest.fail(
                "a CUDA GPU is present but the loaded ffn_ext has no CUDA kernels (wrong build: rebuild with a CUDA "
                "toolkit and a CUDA torch).\n" + ffn_ext.build_summary(),
                pytrace=False,
            )


@pytest.fixture(autouse=True)
def _seed(request):
    """Every test starts from a seed derived from its id: fresh random inputs, reproducible per test."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    yield


# A device parameter list: `@pytest.mark.parametrize("device", DEVICES)`.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]

# ---------------------------------------------------------------- ops
FORWARD_OPS = ("gelu", "silu", "swiglu", "swiglu_packed")
BACKWARD_OPS = ("gelu_backward", "silu_backward", "swiglu_backward", "swiglu_packed_backward")
OPS = FORWARD_OPS + BACKWARD_OPS
UNARY_OPS = ("gelu", "silu")
FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
CPU_DTYPES = (torch.float64, torch.float32, torch.bfloat16)

# Number of inputs and outputs per op.
N_INPUTS = {"gelu": 1, "silu": 1, "swiglu": 2, "swiglu_packed": 1, "gelu_backward": 2, "silu_backward": 2,
            "swiglu_backward": 3, "swiglu_packed_backward": 2}
N_OUTPUTS = {name: 2 if name == "swiglu_backward" else 1 for name in OPS}
# Argument names (as in the schemas / error messages).
ARG_NAMES = {"gelu": ("x",), "silu": ("x",), "swiglu": ("gate", "up"), "swiglu_packed": ("gate_up",),
             "gelu_backward": ("grad", "x"), "silu_backward": ("grad", "x"), "swiglu_backward": ("grad", "gate", "up"),
             "swiglu_packed_backward": ("grad", "gate_up")}


def op(name: str):
    """torch.ops.ffn_ext.<name>."""
    return getattr(torch.ops.ffn_ext, name)


def as_tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def is_packed(name: str) -> bool:
    return name.startswith("swiglu_packed")


def input_shapes(name: str, shape) -> tuple:
    """Input shapes of op `name` whose (first) output has shape `shape`. Packed ops: gate_up is [..., 2M] for an
    output [..., M]; their `grad` has the forward output's shape [..., M]."""
    shape = tuple(shape)
    if is_packed(name):
        packed = shape[:-1] + (2 * shape[-1],)
        return (packed,) if name == "swiglu_packed" else (shape, packed)
    return (shape,) * N_INPUTS[name]


# ---------------------------------------------------------------- fp64 reference
def _silu_lim(x):  # silu with mathematical limits at +-inf
    return torch.where(x == -math.inf, torch.full_like(x, -0.0), torch.where(x == math.inf, x, F.silu(x)))


def _gelu_lim(x):
    return torch.where(x == -math.inf, torch.full_like(x, -0.0), torch.where(x == math.inf, x, F.gelu(x)))


def _deriv_lim(x, d):  # derivative d(x) with 0 at -inf and 1 at +inf
    return torch.where(x == -math.inf, torch.zeros_like(x), torch.where(x == math.inf, torch.ones_like(x), d))


def _silu_grad(x):
    s = torch.sigmoid(x)
    return s * (1 + x * (1 - s))


def _gelu_grad(x):
    return 0.5 * (1 + torch.erf(x * math.sqrt(0.5))) + x * torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def reference(name: str, *inputs: torch.Tensor, inf_limits: bool = False):
    """The result of torch.ops.ffn_ext.<name>(*inputs) computed in float64 with ATen from the same input values
    (upcast exactly), on the inputs' device. Returns a tensor, or a tuple for swiglu_backward, like the op.

    inf_limits=False: ATen's semantics (NaN for silu(-inf), gelu(-inf); what the CPU kernels return).
    inf_limits=True: the mathematical limits the CUDA kernels implement (silu(-inf) = gelu(-inf) = -0,
    silu(+inf) = gelu(+inf) = +inf, derivatives 0 at -inf and 1 at +inf; NaN propagates)."""
    d = [t.detach().double() for t in inputs]
    if inf_limits:
        silu, gelu = _silu_lim, _gelu_lim
        silu_grad = lambda x: _deriv_lim(x, _silu_grad(x))  # noqa: E731
        gelu_grad = lambda x: _deriv_lim(x, _gelu_grad(x))  # noqa: E731
    else:
        silu, gelu = F.silu, F.gelu
        silu_grad = lambda x: torch.ops.aten.silu_backward(torch.ones_like(x), x)  # noqa: E731
        gelu_grad = lambda x: torch.ops.aten.gelu_backward(torch.ones_like(x), x)  # noqa: E731

    def swiglu_bwd(grad, gate, up):
        if inf_limits:
            return grad * up * silu_grad(gate), grad * silu(gate)
        return torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)

    if name == "gelu":
        return gelu(d[0])
    if name == "silu":
        return silu(d[0])
    if name == "gelu_backward":
        grad, x = d
        return grad * gelu_grad(x) if inf_limits else torch.ops.aten.gelu_backward(grad, x)
    if name == "silu_backward":
        grad, x = d
        return grad * silu_grad(x) if inf_limits else torch.ops.aten.silu_backward(grad, x)
    if name == "swiglu":
        return silu(d[0]) * d[1]
    if name == "swiglu_backward":
        return swiglu_bwd(*d)
    if name == "swiglu_packed":
        gate, up = d[0].chunk(2, dim=-1)
        return silu(gate) * up
    if name == "swiglu_packed_backward":
        grad, gate_up = d
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.cat(swiglu_bwd(grad, gate, up), dim=-1)
    raise ValueError(f"unknown op {name!r}")


# ---------------------------------------------------------------- tolerances
_TOL = {
    # A fused kernel rounds once (error <= 0.5 ulp of the storage type, plus the float math's few ulp); the CPU
    # composites round an intermediate too (silu(gate) before * up), hence bf16/fp16 rtol of about 2-3 ulp.
    torch.float64: dict(rtol=1e-12, atol=1e-12),
    torch.float32: dict(rtol=1e-5, atol=1e-6),
    torch.float16: dict(rtol=1e-3, atol=1e-5),
    torch.bfloat16: dict(rtol=1e-2, atol=1e-5),
}


def tolerance(dtype: torch.dtype) -> dict:
    """dict(rtol=, atol=) for comparing a result computed in `dtype` with the float64 reference(). The atol covers
    results near the zero crossings of silu'(x) (x ~ -1.28) and gelu'(x) (x ~ -0.75), where the float math
    cancels."""
    return dict(_TOL[dtype])


def assert_close_to(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, msg: str = "", scale=1.0):
    """actual (any float dtype) vs an fp64 expected, with tolerance(dtype) times `scale`; NaN must match NaN."""
    tol = tolerance(dtype)
    torch.testing.assert_close(actual.double(), expected.double(), rtol=tol["rtol"] * scale,
                               atol=tol["atol"] * scale, equal_nan=True, check_device=True,
                               msg=(lambda m: f"{msg}\n{m}") if msg else None)


def assert_matches_reference(name: str, inputs, out, msg: str = "", inf_limits: bool = False, scale=1.0):
    """Checks op `name`'s result `out` (tensor or tuple) for `inputs`: shape, dtype, device, contiguity, and values
    against reference() within tolerance(dtype) * scale."""
    outs, refs = as_tuple(out), as_tuple(reference(name, *inputs, inf_limits=inf_limits))
    assert len(outs) == N_OUTPUTS[name], f"{name}: expected {N_OUTPUTS[name]} outputs, got {len(outs)}"
    dtype = inputs[0].dtype
    for k, (o, r) in enumerate(zip(outs, refs)):
        where = f"{name} output {k} {msg}"
        assert isinstance(o, torch.Tensor), where
        assert o.shape == r.shape, f"{where}: shape {tuple(o.shape)} != expected {tuple(r.shape)}"
        assert o.dtype == dtype, f"{where}: dtype {o.dtype} != input dtype {dtype}"
        assert o.device == inputs[0].device, f"{where}: device {o.device} != {inputs[0].device}"
        assert o.is_contiguous(), f"{where}: output is not contiguous (strides {o.stride()})"
        assert_close_to(o, r, dtype, where, scale=scale)


# ---------------------------------------------------------------- input layouts
# Every layout gives a tensor of the requested logical shape; they differ in strides / storage offset:
LAYOUTS = (
    "contiguous",
    "transposed",  # last two dims swapped in memory (not row-like: a kernel must copy or gather)
    "step",  # x[..., ::2] slicing with a step along the last dim (stride(-1) == 2)
    "row_step",  # x[..., ::2, :]: rows with a gap between them (row stride 2*cols)
    "padded",  # rows of an odd-width buffer: x[..., :cols] of [..., cols + 3] (rows at odd alignments)
    "offset",  # buf[1:].view(shape): contiguous but misaligned by one element
    "expanded",  # one row expanded over the rows (stride 0 along dim -2)
    "chunk_hi",  # the upper half of [..., 2*cols].chunk(2, -1) (row stride 2*cols, storage offset cols)
    "scalar",  # one value expanded to the whole shape (every stride 0), e.g. the grad of .sum()
)


def _randn(shape, dtype, device, scale):
    return (torch.randn(shape, dtype=torch.float32, device=device) * scale).to(dtype)


def make_layout(shape, dtype=torch.float32, device="cpu", layout="contiguous", scale=3.0) -> torch.Tensor:
    """A random tensor (N(0, scale^2) values, never all zeros) of logical `shape`, laid out as `layout` (one of
    LAYOUTS). Layouts that need 2 dims fall back to the nearest meaningful one for 0-d/1-d shapes ("transposed",
    "row_step", "expanded" -> "contiguous" / "step" on 1-d)."""
    shape = tuple(shape)
    nd = len(shape)
    if layout == "contiguous" or nd == 0 and layout not in ("offset", "scalar"):
        return _randn(shape, dtype, device, scale)
    if layout == "scalar":
        return _randn((), dtype, device, scale).expand(shape)
    if layout == "offset":
        n = math.prod(shape)
        return _randn((n + 1,), dtype, device, scale)[1:].view(shape)
    cols = shape[-1]
    if layout == "step":
        return _randn(shape[:-1] + (2 * cols,), dtype, device, scale)[..., ::2]
    if layout == "padded":
        return _randn(shape[:-1] + (cols + 3,), dtype, device, scale)[..., :cols]
    if layout == "chunk_hi":
        return _randn(shape[:-1] + (2 * cols,), dtype, device, scale).chunk(2, dim=-1)[1] if cols else \
            _randn(shape, dtype, device, scale)
    if nd < 2:
        return make_layout(shape, dtype, device, "step", scale)
    if layout == "transposed":
        return _randn(shape[:-2] + (shape[-1], shape[-2]), dtype, device, scale).transpose(-1, -2)
    if layout == "row_step":
        return _randn(shape[:-2] + (2 * shape[-2], cols), dtype, device, scale)[..., ::2, :]
    if layout == "expanded":
        return _randn(shape[:-2] + (1, cols), dtype, device, scale).expand(shape)
    raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS} or 'chunk' (make_inputs)")


def make_chunk_pair(shape, dtype=torch.float32, device="cpu", offset=0, scale=3.0):
    """gate, up = t.chunk(2, -1) of one random [..., 2*cols] tensor t (views with row stride 2*cols; up starts
    `cols` elements after gate, so for odd cols they sit at different alignments). offset > 0 shifts t's storage
    by that many elements (t = buf[offset:].view(...))."""
    shape = tuple(shape)
    if len(shape) == 0 or shape[-1] == 0:  # nothing to chunk: two plain tensors
        return _randn(shape, dtype, device, scale), _randn(shape, dtype, device, scale)
    full = shape[:-1] + (2 * shape[-1],)
    n = math.prod(full)
    t = _randn((n + offset,), dtype, device, scale)[offset:].view(full)
    return t.chunk(2, dim=-1)


def make_inputs(name: str, shape, dtype=torch.float32, device="cpu", layout="contiguous", grad_layout=None,
                scale=3.0):
    """Random inputs for op `name` whose output has shape `shape`. Every input gets `layout`, except `grad`
    (backward ops), which gets grad_layout (default: `layout`). layout="chunk": swiglu/swiglu_backward take gate, up
    = t.chunk(2, -1); the packed ops take gate_up as the upper half of a [..., 4M] chunk; unary ops take a
    "chunk_hi" view."""
    shape = tuple(shape)
    grad_layout = layout if grad_layout is None else grad_layout
    if layout == "chunk":
        if name in ("swiglu", "swiglu_backward"):
            pair = make_chunk_pair(shape, dtype, device, scale=scale)
            if name == "swiglu":
                return pair
            g_layout = "chunk_hi" if grad_layout == "chunk" else grad_layout
            return (make_layout(shape, dtype, device, g_layout, scale=scale),) + pair
        layout = "chunk_hi"
        grad_layout = "chunk_hi" if grad_layout == "chunk" else grad_layout
    shapes = input_shapes(name, shape)
    names = ARG_NAMES[name]
    return tuple(make_layout(s, dtype, device, grad_layout if n == "grad" else layout, scale=scale)
                 for s, n in zip(shapes, names))


# ---------------------------------------------------------------- recording the ops a call dispatches
class RecordOps(TorchDispatchMode):
    """A dispatch mode that records the name of every op it sees (str of the OpOverload, e.g.
    'ffn_ext.gelu.default') and runs it unchanged."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------- CUDA caching allocator poison
def poison_cuda_cache(device="cuda", nbytes: int = 256 << 20, small_blocks: int = 16) -> None:
    """Fills the CUDA caching allocator's free memory with NaN bytes (0xFF: NaN in fp16, bf16, fp32 and fp64):
    releases the unused cache, allocates one large block (`nbytes`) and `small_blocks` blocks of the small pool
    (<= 1 MiB), fills them with 0xFF and frees them. The next allocations (inputs, then the op's outputs) are
    carved from this memory, so an element a kernel forgets to write reads as NaN and fails the comparison."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    big = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(0xFF)
    small = [torch.empty(1 << 20, dtype=torch.uint8, device=device).fill_(0xFF) for _ in range(small_blocks)]
    torch.cuda.synchronize(device)
    del big, small
