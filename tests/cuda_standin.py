"""The CUDA stand-in: a `cuda`-marked test run on a machine without a GPU, with the CUDA launch emulated on the CPU.

Without a GPU, conftest.py runs the first `cuda`-marked parametrization of every test function under `standin()`
(the others skip, as before), unless NO_STANDIN below names the function with the reason it cannot run so. Inside:

- CPU tensors play the GPU's: a torch function mode turns every "cuda" device argument (device=, .to, .cuda(),
  factory functions) into "cpu", and makes tensors report the device a CUDA tensor reports (`device` cuda:0,
  `is_cuda` True), so ffn_ext's Python and the test's take their CUDA branches;
- every torch.ops.ffn_ext op reaching a kernel runs _emulate_cuda of the tests' host-code extension (tests/native.py)
  instead: the CUDA ops' own problem setup, guards, output allocation and launch shape (csrc/row_ops.h, rows.h) with
  each block's and thread's code run on the host (tests/test_launcher_emulation.py checks that launch against the host
  math, bit for bit). It runs the glue libffn_ext_cuda.so registers, so its guards raise what the CUDA kernels raise
  (a RuntimeError), which the functional API explains with its Python checks, as on a GPU;
- torch.cuda's stream, synchronization and memory calls the tests make are no-ops or neutral answers, and
  torch.autocast("cuda", dtype) is the host's autocast with that dtype.

So the test's Python runs, names and all, and its assertions check the launcher's indexing, peeling and layouts
against the same references as on a GPU. What it cannot check is the device itself: the compiled kernels'
instructions and approximations (tests/test_sass.py reads the SASS), streams and graphs, several devices, memory
past the host's. A test that needs those is in NO_STANDIN, with the reason.
"""

from __future__ import annotations

import contextlib
import os

import native
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

import ffn_ext
from ffn_ext.table import CACHE_SCHEMAS, GATED_BY_NAME
from ffn_ext.table import OPS as SPECS

STANDIN_ENV = "FFN_EXT_CUDA_STANDIN"  # 0: without a GPU, every cuda test skips (no stand-in run)
SMS = 132  # the lent H200's multiprocessors: the launch shape the emulation takes

# test function ("file::function") -> why its Python cannot run without a GPU. Each name must be a cuda-marked test
# function (tests/test_cuda_standin.py checks both ways).
NO_STANDIN = {
    **{
        f"test_quant.py::{f}": "the quantizing kernels are not row ops: _emulate_cuda runs the op table's launcher "
        "only; their per-lane code runs emulated by tests/test_quant_math.py (_emulate_quant)"
        for f in ("test_recipes_bit_identical", "test_fuzzed_shapes", "test_formula_properties", "test_opcheck")
    },
    "test_ops.py::test_cuda_large_swiglu_packed_bf16": "tensors past 2**31 elements: 8.6 GB and ~4e9 emulated threads on the host (marked large as well)",
    "test_ops.py::test_cuda_large_swiglu_chunk_bf16": "tensors past 2**31 elements: 8.6 GB and ~2e9 emulated threads on the host (marked large as well)",
    "test_ops.py::test_cuda_large_gelu_fp16": "tensors past 2**31 elements: 4.3 GB and ~2e9 emulated threads on the host (marked large as well)",
    "test_cuda_safety.py::test_kernels_run_on_the_current_stream": "checks the order of kernels on streams (torch.cuda._sleep, a side stream): host ops have no streams",
    "test_cuda_safety.py::test_cuda_graph_capture_and_replay": "a CUDA graph replays the captured kernels: nothing on the host records and replays them",
    "test_cuda_safety.py::test_cuda_graph_capture_with_autograd": "a CUDA graph replays the captured kernels: nothing on the host records and replays them",
    "test_cuda_safety.py::test_compile_reduce_overhead_matches_eager": "mode='reduce-overhead' is inductor's CUDA graphs: inductor compiles for the real device, not the stand-in",
    "test_cuda_safety.py::test_second_device_uses_its_own_guard": "two GPUs and the device guard between them: one host device",
    "test_cuda_safety.py::test_cpu_only_build_serves_cuda_tensors_with_one_warning": "a CPU-only build serving real CUDA tensors (JIT build in a subprocess, outside the stand-in)",
    "test_validation.py::test_cuda_cpu_device_mismatch_every_op": "an argument on another device than the others: the stand-in puts every tensor on the one host device",
    "test_validation.py::test_cuda_cpu_device_mismatch_names_the_argument": "an argument on another device than the others: the stand-in puts every tensor on the one host device",
    **{
        name: "torch.compile (and export) refuse to trace under a torch dispatch mode, which the emulated kernels "
        "are (its cpu parametrization, where there is one, runs the same Python)"
        for name in (
            "test_modules.py::test_compile_fullgraph_matches_eager_cuda",
            "test_compile_export.py::test_compile_fullgraph_matches_eager",
            "test_compile_export.py::test_compile_dynamic_shapes_and_ops_in_graph",
            "test_compile_export.py::test_export_graph_has_ffn_ext_ops",
        )
    },
    **{
        name: "opcheck's fake-tensor and AOT-dispatch checks make meta tensors from the device the inputs report, "
        "which in the stand-in is not their storage's (its cpu parametrization runs the same Python)"
        for name in (
            "test_opcheck.py::test_opcheck",
            "test_opcheck.py::test_opcheck_partial_requires_grad_and_bf16",
            "test_cache_ops.py::test_opcheck",
        )
    },
    "test_threads.py::test_concurrent_first_calls_cuda": "first calls from 16 threads in a subprocess, on real CUDA tensors: outside the stand-in",
}

_CUDA = torch.device("cuda", 0)
_CPU = torch.device("cpu")
_T = torch.Tensor
_SELF = {_T.pin_memory}  # host memory already
# what a CUDA tensor's properties say (method-wrappers: a new object per attribute access, equal and hashed alike)
_GETTERS = {_T.device.__get__: _CUDA, _T.is_cuda.__get__: True, _T.is_cpu.__get__: False}


def available() -> bool:
    """True when cuda tests can run in the stand-in here: no GPU, the ffn_ext ops registered (by a native library),
    not turned off. The emulation (tests/native.py) is built when the first stand-in test runs, if it must be."""
    return not torch.cuda.is_available() and ffn_ext.ops._native is not None and os.environ.get(STANDIN_ENV, "1") != "0"


def _is_cuda(d) -> bool:
    if isinstance(d, torch.device):
        return d.type == "cuda"
    return isinstance(d, str) and (d == "cuda" or d.startswith("cuda:"))


def _host(v):
    return v if not _is_cuda(v) else "cpu" if isinstance(v, str) else _CPU


class _CudaOnHost(TorchFunctionMode):
    """CPU tensors in the GPU's place (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _GETTERS:
            return _GETTERS[func]
        if func in _SELF:
            return args[0]
        if func is torch.device:  # a device as a value: it stays cuda (what tensors say they are on)
            return func(*args, **kwargs)
        if func is _T.cuda:  # a copy, as from the host to a device
            return args[0].clone()
        moved = any(_is_cuda(a) for a in args) or any(_is_cuda(v) for v in kwargs.values())
        args, kwargs = tree_map(_host, args), tree_map(_host, kwargs)
        if func is _T.to and moved:
            kwargs["copy"] = True
        return func(*args, **kwargs)


class _EmulatedKernels(TorchDispatchMode):
    """torch.ops.ffn_ext.* kernels as _emulate_cuda (tests/native.py) runs them; `calls` counts them, per op."""

    def __init__(self):
        super().__init__()
        self.calls: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.name()
        # only real host tensors: fake, meta and wrapper tensors (opcheck's modes) take the op's own kernels
        if not name.startswith("ffn_ext::") or any(
            isinstance(a, torch.Tensor) and (type(a) is not torch.Tensor or a.device.type != "cpu") for a in args
        ):
            return func(*args, **kwargs)
        op = name.split("::", 1)[1]
        if op in CACHE_SCHEMAS:  # the FP8 activation cache's ops (their kernels: _emulate_cache)
            gated = GATED_BY_NAME[op[: op.rindex("_cache")]]
            params = [float(kwargs.get(p.name, p.default)) for p in gated.params]
            outs = native.testing()._emulate_cache(op, list(args), params, int(kwargs.get("group_size", 128)))
            self.calls[op] = self.calls.get(op, 0) + 1
            return tuple(outs)
        spec = SPECS[op]
        params = [float(kwargs.get(p.name, p.default)) for p in spec.params]
        outs = native.testing()._emulate_cuda(op, list(args), SMS, params, kwargs.get("layout", "concat"))
        self.calls[op] = self.calls.get(op, 0) + 1
        return tuple(outs) if spec.n_outputs > 1 else outs[0]


class _Stream:
    """torch.cuda.Stream / current_stream() for host work: it is ordered already."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def synchronize(self):
        pass

    def record_event(self, event=None):
        return event

    def wait_event(self, event):
        pass


def _returning(value):
    """A new function returning `value` (each stub its own object: dynamo's trace rules key on the function)."""
    return lambda *args, **kwargs: value() if callable(value) else value


_CUDA_STUBS = {
    **{
        name: _returning(None)
        for name in (
            "synchronize",
            "empty_cache",
            "_sleep",
            "set_device",
            "manual_seed",
            "manual_seed_all",
            "reset_peak_memory_stats",
        )
    },
    "Stream": _Stream,
    "current_stream": _returning(_Stream),
    "default_stream": _returning(_Stream),
    "stream": _returning(contextlib.nullcontext),
    "device": _returning(contextlib.nullcontext),
    "device_count": _returning(1),
    "current_device": _returning(0),
    "mem_get_info": _returning((64 << 30, 64 << 30)),
    "max_memory_allocated": _returning(0),
    "memory_allocated": _returning(0),
}


@contextlib.contextmanager
def standin(monkeypatch):
    """Runs the body with CPU tensors standing in for CUDA tensors and ffn_ext's kernels emulated (module
    docstring). Yields the kernel-call counter (op -> calls)."""
    for name, stub in _CUDA_STUBS.items():
        monkeypatch.setattr(torch.cuda, name, stub, raising=False)

    class _Autocast(torch.autocast):  # torch.autocast("cuda", ...) as the host's autocast, same dtype
        def __init__(self, device_type, *args, **kwargs):
            super().__init__("cpu" if _is_cuda(device_type) else device_type, *args, **kwargs)

    monkeypatch.setattr(torch, "autocast", _Autocast)
    # stream bookkeeping: nothing to do for host tensors (patched: its argument parser refuses the stand-in stream)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    kernels = _EmulatedKernels()
    with kernels, _CudaOnHost():
        yield kernels.calls
