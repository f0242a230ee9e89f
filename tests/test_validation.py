"""Input validation: every bad input raises a clear error that names the op and the argument, through the public
API (ffn_ext.gelu, ...) and through the dispatcher ops (torch.ops.ffn_ext.*), on real (CPU), meta and fake tensors,
and in the pure-ATen fallback (FFN_EXT_NO_C=1, in a subprocess).

Error classes (see README, "Input validation"): TypeError for what kind of tensor / dtype, ValueError for shapes,
RuntimeError for devices. No op takes an out= argument: outputs are always fresh tensors, so aliased outputs
cannot happen; aliased or overlapping *inputs* are allowed (inputs are only read) and are tested for correctness.
"""
import os
import re
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F

import ffn_ext

OPS = torch.ops.ffn_ext
CUDA = torch.cuda.is_available() and ffn_ext.build_info().get("native") != "none (ATen fallback)"


def rnd(*shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, dtype=dtype, device=device) + 0.25


def _quantized(x):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensor creation is deprecated in recent torch
        return torch.quantize_per_tensor(x, 0.1, 0, torch.qint8)


def _nested(layout=torch.strided):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # prototype warning for the strided layout
        return torch.nested.nested_tensor([rnd(2, 4), rnd(3, 4)], layout=layout)


def _csr(x):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "sparse CSR support is in beta"
        return x.to_sparse_csr()


X = rnd(3, 4)
X8 = rnd(3, 8)
M = torch.empty(3, 4, device="meta")

# ---------------------------------------------------------------- the table
# (id, public-API call, the same call through torch.ops (None: no dispatcher equivalent), exception, message regex).
# When the torch.ops call cannot reach our checks (sparse/nested/quantized dispatch to keys where ffn_ext has no
# kernel), its expectation is given separately in DISPATCHER_ONLY below.
BAD_INPUTS = [
    # dtypes
    ("swiglu-dtype-mismatch", lambda: ffn_ext.swiglu(X, X.double()), lambda: OPS.swiglu(X, X.double()), TypeError,
     r"ffn_ext\.swiglu: expected `up` to have the dtype of `gate` \(torch\.float32\), got torch\.float64"),
    ("swiglu-dtype-mismatch-half", lambda: ffn_ext.swiglu(X.half(), X.bfloat16()),
     lambda: OPS.swiglu(X.half(), X.bfloat16()), TypeError,
     r"ffn_ext\.swiglu: expected `up` to have the dtype of `gate` \(torch\.float16\), got torch\.bfloat16"),
    ("gelu-int64", lambda: ffn_ext.gelu(X.long()), lambda: OPS.gelu(X.long()), TypeError,
     r"ffn_ext\.gelu: expected `x` to have dtype float64, float32, float16 or bfloat16, got torch\.int64"),
    ("silu-int8", lambda: ffn_ext.silu(X.to(torch.int8)), lambda: OPS.silu(X.to(torch.int8)), TypeError,
     r"ffn_ext\.silu: expected `x` to have dtype float64, float32, float16 or bfloat16, got torch\.int8"),
    ("silu-bool", lambda: ffn_ext.silu(X > 0), lambda: OPS.silu(X > 0), TypeError,
     r"ffn_ext\.silu: expected `x` to have dtype .*, got torch\.bool"),
    ("gelu-complex64", lambda: ffn_ext.gelu(X.to(torch.complex64)), lambda: OPS.gelu(X.to(torch.complex64)),
     TypeError, r"ffn_ext\.gelu: expected `x` to have dtype .*, got torch\.complex64"),
    ("swiglu-gate-int", lambda: ffn_ext.swiglu(X.int(), X.int()), lambda: OPS.swiglu(X.int(), X.int()), TypeError,
     r"ffn_ext\.swiglu: expected `gate` to have dtype .*, got torch\.int32"),
    ("swiglu-up-int", lambda: ffn_ext.swiglu(X, X.int()), lambda: OPS.swiglu(X, X.int()), TypeError,
     r"ffn_ext\.swiglu: expected `up` to have dtype .*, got torch\.int32"),
    ("packed-complex128", lambda: ffn_ext.swiglu_packed(X8.to(torch.complex128)),
     lambda: OPS.swiglu_packed(X8.to(torch.complex128)), TypeError,
     r"ffn_ext\.swiglu_packed: expected `gate_up` to have dtype .*, got torch\.complex128"),
    # shapes
    ("swiglu-shape-mismatch", lambda: ffn_ext.swiglu(X, rnd(3, 5)), lambda: OPS.swiglu(X, rnd(3, 5)), ValueError,
     r"ffn_ext\.swiglu: expected `up` to have the shape of `gate` \[3, 4\], got \[3, 5\]"),
    ("swiglu-no-broadcast", lambda: ffn_ext.swiglu(X, rnd(4)), lambda: OPS.swiglu(X, rnd(4)), ValueError,
     r"ffn_ext\.swiglu: expected `up` to have the shape of `gate` \[3, 4\], got \[4\]"),
    ("packed-odd-last-dim", lambda: ffn_ext.swiglu_packed(rnd(3, 5)), lambda: OPS.swiglu_packed(rnd(3, 5)),
     ValueError, r"ffn_ext\.swiglu_packed: expected the last dimension of `gate_up` to be even \(\[\.\.\., 2\*M\]\), "
     r"got shape \[3, 5\]"),
    ("packed-0-dim", lambda: ffn_ext.swiglu_packed(torch.tensor(1.0)), lambda: OPS.swiglu_packed(torch.tensor(1.0)),
     ValueError, r"ffn_ext\.swiglu_packed: expected `gate_up` to have at least 1 dimension \(\[\.\.\., 2\*M\]\), "
     r"got a 0-dim tensor"),
    # devices (no GPU needed: a CPU tensor with a meta tensor)
    ("swiglu-cpu-meta", lambda: ffn_ext.swiglu(X, M), lambda: OPS.swiglu(X, M), RuntimeError,
     r"ffn_ext\.swiglu: expected `up` to be on the device of `gate` \(cpu\), got meta"),
    ("swiglu-meta-cpu", lambda: ffn_ext.swiglu(M, X), lambda: OPS.swiglu(M, X), RuntimeError,
     r"ffn_ext\.swiglu: expected `up` to be on the device of `gate` \(meta\), got cpu"),
    # not a tensor
    ("gelu-None", lambda: ffn_ext.gelu(None), None, TypeError,
     r"ffn_ext\.gelu: expected `x` to be a torch\.Tensor, got NoneType"),
    ("swiglu-up-list", lambda: ffn_ext.swiglu(X, [1.0]), None, TypeError,
     r"ffn_ext\.swiglu: expected `up` to be a torch\.Tensor, got list"),
    ("packed-ndarray", lambda: ffn_ext.swiglu_packed(X8.numpy()), None, TypeError,
     r"ffn_ext\.swiglu_packed: expected `gate_up` to be a torch\.Tensor, got ndarray"),
    # layouts / tensor kinds: the public API checks before dispatch (the dispatcher's own error is in DISPATCHER_ONLY)
    ("gelu-sparse-coo", lambda: ffn_ext.gelu(X.to_sparse()), None, TypeError,
     r"ffn_ext\.gelu: expected `x` to be a dense strided tensor, got layout torch\.sparse_coo"),
    ("silu-sparse-csr", lambda: ffn_ext.silu(_csr(X)), None, TypeError,
     r"ffn_ext\.silu: expected `x` to be a dense strided tensor, got layout torch\.sparse_csr"),
    ("swiglu-up-sparse", lambda: ffn_ext.swiglu(X, X.to_sparse()), None, TypeError,
     r"ffn_ext\.swiglu: expected `up` to be a dense strided tensor, got layout torch\.sparse_coo"),
    ("packed-sparse", lambda: ffn_ext.swiglu_packed(X8.to_sparse()), None, TypeError,
     r"ffn_ext\.swiglu_packed: expected `gate_up` to be a dense strided tensor, got layout torch\.sparse_coo"),
    ("gelu-nested", lambda: ffn_ext.gelu(_nested()), None, TypeError,
     r"ffn_ext\.gelu: `x` is a nested tensor; expected a dense strided tensor"),
    ("silu-nested-jagged", lambda: ffn_ext.silu(_nested(torch.jagged)), None, TypeError,
     r"ffn_ext\.silu: `x` is a nested tensor; expected a dense strided tensor"),
    ("swiglu-gate-nested", lambda: ffn_ext.swiglu(_nested(), _nested()), None, TypeError,
     r"ffn_ext\.swiglu: `gate` is a nested tensor; expected a dense strided tensor"),
    ("gelu-quantized", lambda: ffn_ext.gelu(_quantized(X)), None, TypeError,
     r"ffn_ext\.gelu: `x` is a quantized tensor; expected a floating-point tensor"),
    ("packed-quantized", lambda: ffn_ext.swiglu_packed(_quantized(X8)), None, TypeError,
     r"ffn_ext\.swiglu_packed: `gate_up` is a quantized tensor; expected a floating-point tensor"),
]

# torch.ops.ffn_ext.* with tensors whose dispatch key has no ffn_ext kernel: the dispatcher's own error.
_NO_KERNEL = r"Could not run 'ffn_ext::{op}' with arguments from the '{key}' backend"
DISPATCHER_ONLY = [
    ("ops-gelu-sparse-coo", lambda: OPS.gelu(X.to_sparse()), NotImplementedError,
     _NO_KERNEL.format(op="gelu", key="SparseCPU")),
    ("ops-silu-sparse-csr", lambda: OPS.silu(_csr(X)), NotImplementedError,
     _NO_KERNEL.format(op="silu", key="SparseCsrCPU")),
    ("ops-swiglu-up-sparse", lambda: OPS.swiglu(X, X.to_sparse()), NotImplementedError,
     _NO_KERNEL.format(op="swiglu", key="SparseCPU")),
    # with the C++ Autograd-key kernels (csrc/autograd.cpp) a strided nested tensor fails inside the autograd
    # kernel ("NestedTensorImpl doesn't support sizes") before reaching the NestedTensorCPU key
    ("ops-gelu-nested", lambda: OPS.gelu(_nested()), RuntimeError,
     _NO_KERNEL.format(op="gelu", key="NestedTensorCPU") + r"|NestedTensorImpl doesn't support sizes"),
    ("ops-silu-nested-jagged", lambda: OPS.silu(_nested(torch.jagged)), NotImplementedError, r"ffn_ext\.silu"),
    ("ops-gelu-quantized", lambda: OPS.gelu(_quantized(X)), NotImplementedError,
     _NO_KERNEL.format(op="gelu", key="QuantizedCPU")),
    # an undefined tensor (None): the dispatcher fails before any kernel ("tensor does not have a device")
    ("ops-gelu-None", lambda: OPS.gelu(None), (TypeError, RuntimeError), r"gelu|device"),
    ("ops-gelu-float", lambda: OPS.gelu(1.0), (TypeError, RuntimeError), r"gelu"),
]

# Backward ops: wrong grad (shape, dtype, device) and wrong saved inputs; torch.ops only (no public API for these).
BACKWARD_BAD = [
    ("gelu_backward-grad-shape", lambda: OPS.gelu_backward(rnd(3, 5), X), ValueError,
     r"ffn_ext\.gelu_backward: expected `grad` to have the shape of `x` \[3, 4\], got \[3, 5\]"),
    ("silu_backward-grad-dtype", lambda: OPS.silu_backward(X.half(), X), TypeError,
     r"ffn_ext\.silu_backward: expected `grad` to have the dtype of `x` \(torch\.float32\), got torch\.float16"),
    ("silu_backward-grad-device", lambda: OPS.silu_backward(M, X), RuntimeError,
     r"ffn_ext\.silu_backward: expected `grad` to be on the device of `x` \(cpu\), got meta"),
    ("gelu_backward-grad-int", lambda: OPS.gelu_backward(X.long(), X), TypeError,
     r"ffn_ext\.gelu_backward: expected `grad` to have dtype .*, got torch\.int64"),
    ("gelu_backward-x-bool", lambda: OPS.gelu_backward(X, X > 0), TypeError,
     r"ffn_ext\.gelu_backward: expected `x` to have dtype .*, got torch\.bool"),
    ("swiglu_backward-grad-shape", lambda: OPS.swiglu_backward(rnd(4, 3), X, X), ValueError,
     r"ffn_ext\.swiglu_backward: expected `grad` to have the shape of `gate` \[3, 4\], got \[4, 3\]"),
    ("swiglu_backward-grad-dtype", lambda: OPS.swiglu_backward(X.double(), X, X), TypeError,
     r"ffn_ext\.swiglu_backward: expected `grad` to have the dtype of `gate` \(torch\.float32\), got torch\.float64"),
    ("swiglu_backward-up-shape", lambda: OPS.swiglu_backward(X, X, rnd(3, 1)), ValueError,
     r"ffn_ext\.swiglu_backward: expected `up` to have the shape of `gate` \[3, 4\], got \[3, 1\]"),
    ("swiglu_backward-grad-device", lambda: OPS.swiglu_backward(M, X, X), RuntimeError,
     r"ffn_ext\.swiglu_backward: expected `grad` to be on the device of `gate` \(cpu\), got meta"),
    ("packed_backward-grad-full-width", lambda: OPS.swiglu_packed_backward(X8, X8), ValueError,
     r"ffn_ext\.swiglu_packed_backward: expected `grad` to have the forward output's shape \[3, 4\] "
     r"\(gate_up's with the last dimension halved\), got \[3, 8\]"),
    ("packed_backward-grad-0-dim", lambda: OPS.swiglu_packed_backward(torch.tensor(1.0), X8), ValueError,
     r"ffn_ext\.swiglu_packed_backward: expected `grad` to have the forward output's shape \[3, 4\]"),
    ("packed_backward-grad-dtype", lambda: OPS.swiglu_packed_backward(X.bfloat16(), X8), TypeError,
     r"ffn_ext\.swiglu_packed_backward: expected `grad` to have the dtype of `gate_up` \(torch\.float32\), "
     r"got torch\.bfloat16"),
    ("packed_backward-grad-device", lambda: OPS.swiglu_packed_backward(M, X8), RuntimeError,
     r"ffn_ext\.swiglu_packed_backward: expected `grad` to be on the device of `gate_up` \(cpu\), got meta"),
    ("packed_backward-odd-gate_up", lambda: OPS.swiglu_packed_backward(rnd(3, 2), rnd(3, 5)), ValueError,
     r"ffn_ext\.swiglu_packed_backward: expected the last dimension of `gate_up` to be even"),
    ("packed_backward-0-dim-gate_up", lambda: OPS.swiglu_packed_backward(torch.tensor(1.0), torch.tensor(1.0)),
     ValueError, r"ffn_ext\.swiglu_packed_backward: expected `gate_up` to have at least 1 dimension"),
]


def _ids(cases):
    return [c[0] for c in cases]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=_ids(BAD_INPUTS))
def test_public_api_rejects(case):
    _, api, _, exc, msg = case
    with pytest.raises(exc, match=msg):
        api()


@pytest.mark.parametrize("case", [c for c in BAD_INPUTS if c[2] is not None],
                         ids=_ids([c for c in BAD_INPUTS if c[2] is not None]))
def test_dispatcher_rejects(case):
    _, _, ops_call, exc, msg = case
    with pytest.raises(exc, match=msg):
        ops_call()


@pytest.mark.parametrize("case", DISPATCHER_ONLY, ids=_ids(DISPATCHER_ONLY))
def test_dispatcher_rejects_unsupported_kinds(case):
    _, call, exc, msg = case
    with pytest.raises(exc, match=msg):
        call()


@pytest.mark.parametrize("case", BACKWARD_BAD, ids=_ids(BACKWARD_BAD))
def test_backward_ops_reject(case):
    _, call, exc, msg = case
    with pytest.raises(exc, match=msg):
        call()


def _to_meta(v):
    return v.to("meta") if isinstance(v, torch.Tensor) and v.layout == torch.strided and not v.is_nested else v


# Fake/meta tensors run only the Meta kernels (csrc/shapes.cpp): the same checks, so the same errors.
_META_CASES = [c for c in BAD_INPUTS if c[2] is not None and "cpu-meta" not in c[0] and "meta-cpu" not in c[0]]


@pytest.mark.parametrize("case", _META_CASES, ids=_ids(_META_CASES))
def test_fake_tensor_mode_rejects_the_same(case):
    from torch._subclasses.fake_tensor import FakeTensorMode

    _, api, _, exc, msg = case
    # The real tensors the lambdas close over become fake when they reach an op under the mode; ffn_ext then runs
    # its Meta kernel.
    with FakeTensorMode(allow_non_fake_inputs=True):
        with pytest.raises(exc, match=msg):
            api()


# ---------------------------------------------------------------- what is accepted
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]


def _all_ops(x2m, x, grad_m):
    """Calls every op once; x2m: [..., 2M], x and grad_m: [..., M]."""
    g, u = x2m.chunk(2, -1)
    return {
        "gelu": OPS.gelu(x), "gelu_backward": OPS.gelu_backward(grad_m, x),
        "silu": OPS.silu(x), "silu_backward": OPS.silu_backward(grad_m, x),
        "swiglu": OPS.swiglu(g, u), "swiglu_backward": OPS.swiglu_backward(grad_m, g, u),
        "swiglu_packed": OPS.swiglu_packed(x2m), "swiglu_packed_backward": OPS.swiglu_packed_backward(grad_m, x2m),
    }


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 6), (2, 3, 8), (4,), (0, 6), (3, 0)], ids=str)
def test_meta_tensors_match_real_outputs(dtype, shape):
    """Meta inputs give outputs with the real outputs' sizes, strides and dtype (fake kernels, torch.compile)."""
    x2m = rnd(*shape, dtype=dtype)
    m = shape[-1] // 2
    x, grad_m = rnd(*shape[:-1], m, dtype=dtype), rnd(*shape[:-1], m, dtype=dtype)
    real = _all_ops(x2m, x, grad_m)
    meta = _all_ops(x2m.to("meta"), x.to("meta"), grad_m.to("meta"))
    for name, r in real.items():
        for rr, mm in zip(r if isinstance(r, tuple) else (r,), meta[name] if isinstance(r, tuple) else (meta[name],)):
            assert mm.device.type == "meta", name
            assert (mm.shape, mm.stride(), mm.dtype) == (rr.shape, rr.stride(), rr.dtype), name


def test_meta_through_public_api_and_autograd():
    gu = torch.empty(4, 10, device="meta", requires_grad=True)
    out = ffn_ext.swiglu_packed(gu)
    assert out.shape == (4, 5) and out.device.type == "meta"
    (g,) = torch.autograd.grad(out, gu, torch.empty(4, 5, device="meta"))
    assert g.shape == (4, 10) and g.device.type == "meta"
    x = torch.empty(3, 7, device="meta", dtype=torch.bfloat16, requires_grad=True)
    for f in (ffn_ext.gelu, ffn_ext.silu):
        (gx,) = torch.autograd.grad(f(x).sum(), x)
        assert gx.shape == x.shape and gx.dtype == x.dtype and gx.device.type == "meta"


def test_zero_dim_is_fine_for_elementwise_ops():
    x = torch.tensor(0.75, dtype=torch.float64)
    u = torch.tensor(-1.5, dtype=torch.float64)
    torch.testing.assert_close(ffn_ext.gelu(x), F.gelu(x), rtol=1e-12, atol=0)
    torch.testing.assert_close(ffn_ext.silu(x), F.silu(x), rtol=1e-12, atol=0)
    torch.testing.assert_close(ffn_ext.swiglu(x, u), F.silu(x) * u, rtol=1e-12, atol=0)
    assert ffn_ext.gelu(x).dim() == 0


def test_aliased_and_overlapping_inputs():
    """Inputs may alias each other (they are only read); outputs are fresh and never alias an input."""
    base = rnd(6, 9, dtype=torch.float64)
    a, b = base[:, :-1], base[:, 1:]  # overlapping views, shifted by one element
    torch.testing.assert_close(ffn_ext.swiglu(a, b), F.silu(a) * b, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ffn_ext.swiglu(a, a), F.silu(a) * a, rtol=1e-12, atol=1e-12)
    grad = rnd(6, 8, dtype=torch.float64)
    dg, du = OPS.swiglu_backward(grad, a, a)  # the same tensor as gate and up
    ref = torch.ops.aten.silu_backward(grad * a, a), grad * F.silu(a)
    torch.testing.assert_close(dg, ref[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(du, ref[1], rtol=1e-12, atol=1e-12)
    dx = OPS.gelu_backward(a, a)  # grad aliases x
    torch.testing.assert_close(dx, torch.ops.aten.gelu_backward(a, a), rtol=1e-12, atol=1e-12)
    exp = rnd(1, 8, dtype=torch.float64).expand(5, 8)  # stride-0 rows
    torch.testing.assert_close(ffn_ext.gelu(exp), F.gelu(exp), rtol=1e-12, atol=1e-12)
    # outputs are fresh, contiguous and do not share memory with inputs
    for out in (ffn_ext.swiglu(a, b), ffn_ext.gelu(a), ffn_ext.swiglu_packed(base[:, :8]), dg, du, dx):
        assert out.is_contiguous()
        assert out.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()


def test_no_op_takes_out_argument():
    """Nothing to alias: no ffn_ext op schema has an out= (mutable) argument."""
    for name in ("gelu", "gelu_backward", "silu", "silu_backward", "swiglu", "swiglu_backward", "swiglu_packed",
                 "swiglu_packed_backward"):
        schema = getattr(OPS, name).default._schema
        assert not schema.is_mutable, (name, str(schema))
        assert all(a.alias_info is None for a in schema.arguments), (name, str(schema))


def test_autograd_rejects_wrong_grad_shape():
    x = rnd(3, 4).requires_grad_(True)
    y = ffn_ext.gelu(x)
    with pytest.raises(RuntimeError, match="shape"):
        y.backward(rnd(3, 5))


# ---------------------------------------------------------------- CUDA (GPU machine only)
@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_cuda_cpu_device_mismatch_names_the_argument():
    xc = rnd(3, 4, device="cuda")
    with pytest.raises(RuntimeError, match=r"ffn_ext\.swiglu: expected `up` to be on the device of `gate` "
                                           r"\(cuda:0\), got cpu"):
        ffn_ext.swiglu(xc, X)
    with pytest.raises(RuntimeError, match=r"ffn_ext\.gelu_backward: expected `grad` to be on the device of `x` "
                                           r"\(cuda:0\), got cpu"):
        OPS.gelu_backward(X, xc)
    with pytest.raises(RuntimeError, match=r"ffn_ext\.swiglu_packed_backward: expected `grad` to be on the device"):
        OPS.swiglu_packed_backward(X, X8.cuda())
    with pytest.raises(TypeError, match=r"ffn_ext\.gelu: expected `x` to have dtype .*, got torch\.int64"):
        ffn_ext.gelu(xc.long())
    with pytest.raises(ValueError, match=r"ffn_ext\.swiglu_packed: expected the last dimension"):
        ffn_ext.swiglu_packed(rnd(3, 5, device="cuda"))
    with pytest.raises(TypeError, match=r"ffn_ext\.gelu: expected `x` to be a dense strided tensor"):
        ffn_ext.gelu(xc.to_sparse())


# ---------------------------------------------------------------- the ATen fallback (no native library)
_FALLBACK_SCRIPT = textwrap.dedent(r"""
    import re, torch, ffn_ext
    assert ffn_ext.build_info()["native"].startswith("none"), ffn_ext.build_info()
    X = torch.randn(3, 4); X8 = torch.randn(3, 8); M = torch.empty(3, 4, device="meta")
    cases = [
        (lambda: ffn_ext.swiglu(X, X.double()), TypeError, r"ffn_ext\.swiglu: expected `up` to have the dtype of `gate` \(torch\.float32\), got torch\.float64"),
        (lambda: ffn_ext.swiglu(X, torch.randn(3, 5)), ValueError, r"ffn_ext\.swiglu: expected `up` to have the shape of `gate` \[3, 4\], got \[3, 5\]"),
        (lambda: ffn_ext.swiglu(X, M), RuntimeError, r"ffn_ext\.swiglu: expected `up` to be on the device of `gate` \(cpu\), got meta"),
        (lambda: ffn_ext.gelu(X.long()), TypeError, r"ffn_ext\.gelu: expected `x` to have dtype float64, float32, float16 or bfloat16, got torch\.int64"),
        (lambda: ffn_ext.silu(X > 0), TypeError, r"ffn_ext\.silu: expected `x` to have dtype .*, got torch\.bool"),
        (lambda: ffn_ext.swiglu(X, X.int()), TypeError, r"ffn_ext\.swiglu: expected `up` to have dtype .*, got torch\.int32"),
        (lambda: ffn_ext.swiglu_packed(torch.randn(3, 5)), ValueError, r"ffn_ext\.swiglu_packed: expected the last dimension of `gate_up` to be even"),
        (lambda: ffn_ext.swiglu_packed(torch.tensor(1.0)), ValueError, r"ffn_ext\.swiglu_packed: expected `gate_up` to have at least 1 dimension"),
        (lambda: ffn_ext.swiglu_packed(X8.to(torch.complex64)), TypeError, r"ffn_ext\.swiglu_packed: expected `gate_up` to have dtype"),
        (lambda: ffn_ext.gelu(X.to_sparse()), TypeError, r"ffn_ext\.gelu: expected `x` to be a dense strided tensor, got layout torch\.sparse_coo"),
        (lambda: ffn_ext.gelu(None), TypeError, r"ffn_ext\.gelu: expected `x` to be a torch\.Tensor, got NoneType"),
    ]
    for call, exc, msg in cases:
        try:
            call()
        except exc as e:
            assert re.search(msg, str(e)), (msg, str(e))
        else:
            raise AssertionError(f"no {exc.__name__} for {msg}")
    y = ffn_ext.swiglu_packed(torch.empty(2, 6, device="meta"))
    assert y.shape == (2, 3) and y.device.type == "meta"
    print("fallback-ok", len(cases))
""")


@pytest.mark.slow
def test_aten_fallback_validates_the_same():
    env = dict(os.environ, FFN_EXT_NO_C="1")
    r = subprocess.run([sys.executable, "-c", _FALLBACK_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "fallback-ok 11" in r.stdout
