"""Input validation: every bad input raises a clear error that names the op and the argument, through the public
API (ffn_ext.gelu, ...) and through the dispatcher ops (torch.ops.ffn_ext.*), on real (CPU), meta and fake tensors,
and by the Python checks alone (what explains a CUDA kernel's guard; and FFN_EXT_NO_C=1 in a subprocess). BAD_INPUTS
lists examples of every kind of error; TABLE_CASES generates the dtype, shape, device and argument-kind errors for
every op of the table (tests/optable.py).

Error classes (see README, "Input validation"): TypeError for what kind of tensor / dtype, ValueError for shapes
and for option values (a packed op's `layout`, a gated op's parameters: swiglu_clamped's `limit` > 0, finite
`alpha` and `up_offset`), RuntimeError for devices. Gated ops with parameters are called with the table's example
values (optable.op_kwargs), packed ops in both layouts. No op takes an out= argument: outputs are always fresh
tensors, so aliased outputs cannot happen; aliased or overlapping *inputs* are allowed (inputs are only read) and
are tested for correctness.
"""

import math
import os
import re
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from conftest import HANG_GUARD_S
from optable import (
    ACTIVATIONS,
    FORWARD_OPS,
    GATED,
    GATED_IDS,
    PACKINGS,
    PARAM_OPS,
    activation_arg,
    api_call,
    aten_result,
    call,
    input_shapes,
    is_packed,
    make_inputs,
    op,
    op_kwargs,
    spec,
)
from optable import (
    OPS as OP_NAMES,
)

import ffn_ext

OPS = torch.ops.ffn_ext
CUDA = torch.cuda.is_available() and ffn_ext.has_cuda_kernels()


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
    # mixed floating-point dtypes: the dispatcher ops refuse them; the public API promotes (test_mixed_dtypes_promote)
    (
        "swiglu-dtype-mismatch",
        None,
        lambda: OPS.swiglu(X, X.double()),
        TypeError,
        r"ffn_ext\.swiglu: expected `up` to have the dtype of `gate` \(torch\.float32\), got torch\.float64",
    ),
    (
        "swiglu-dtype-mismatch-half",
        None,
        lambda: OPS.swiglu(X.half(), X.bfloat16()),
        TypeError,
        r"ffn_ext\.swiglu: expected `up` to have the dtype of `gate` \(torch\.float16\), got torch\.bfloat16",
    ),
    (
        "gelu-int64",
        lambda: ffn_ext.gelu(X.long()),
        lambda: OPS.gelu(X.long()),
        TypeError,
        r"ffn_ext\.gelu: expected `x` to have dtype float64, float32, float16 or bfloat16, got torch\.int64",
    ),
    (
        "silu-int8",
        lambda: ffn_ext.silu(X.to(torch.int8)),
        lambda: OPS.silu(X.to(torch.int8)),
        TypeError,
        r"ffn_ext\.silu: expected `x` to have dtype float64, float32, float16 or bfloat16, got torch\.int8",
    ),
    (
        "silu-bool",
        lambda: ffn_ext.silu(X > 0),
        lambda: OPS.silu(X > 0),
        TypeError,
        r"ffn_ext\.silu: expected `x` to have dtype .*, got torch\.bool",
    ),
    (
        "gelu-complex64",
        lambda: ffn_ext.gelu(X.to(torch.complex64)),
        lambda: OPS.gelu(X.to(torch.complex64)),
        TypeError,
        r"ffn_ext\.gelu: expected `x` to have dtype .*, got torch\.complex64",
    ),
    (
        "swiglu-gate-int",
        lambda: ffn_ext.swiglu(X.int(), X.int()),
        lambda: OPS.swiglu(X.int(), X.int()),
        TypeError,
        r"ffn_ext\.swiglu: expected `gate` to have dtype .*, got torch\.int32",
    ),
    (
        "swiglu-up-int",
        lambda: ffn_ext.swiglu(X, X.int()),
        lambda: OPS.swiglu(X, X.int()),
        TypeError,
        r"ffn_ext\.swiglu: expected `up` to have dtype .*, got torch\.int32",
    ),
    (
        "packed-complex128",
        lambda: ffn_ext.swiglu_packed(X8.to(torch.complex128)),
        lambda: OPS.swiglu_packed(X8.to(torch.complex128)),
        TypeError,
        r"ffn_ext\.swiglu_packed: expected `gate_up` to have dtype .*, got torch\.complex128",
    ),
    # shapes
    (
        "swiglu-shape-mismatch",
        lambda: ffn_ext.swiglu(X, rnd(3, 5)),
        lambda: OPS.swiglu(X, rnd(3, 5)),
        ValueError,
        r"ffn_ext\.swiglu: expected `up` to have the shape of `gate` \[3, 4\], got \[3, 5\]",
    ),
    (
        "swiglu-no-broadcast",
        lambda: ffn_ext.swiglu(X, rnd(4)),
        lambda: OPS.swiglu(X, rnd(4)),
        ValueError,
        r"ffn_ext\.swiglu: expected `up` to have the shape of `gate` \[3, 4\], got \[4\]",
    ),
    (
        "packed-odd-last-dim",
        lambda: ffn_ext.swiglu_packed(rnd(3, 5)),
        lambda: OPS.swiglu_packed(rnd(3, 5)),
        ValueError,
        r"ffn_ext\.swiglu_packed: expected the last dimension of `gate_up` to be even \(\[\.\.\., 2\*M\]\), "
        r"got shape \[3, 5\]",
    ),
    (
        "packed-0-dim",
        lambda: ffn_ext.swiglu_packed(torch.tensor(1.0)),
        lambda: OPS.swiglu_packed(torch.tensor(1.0)),
        ValueError,
        r"ffn_ext\.swiglu_packed: expected `gate_up` to have at least 1 dimension \(\[\.\.\., 2\*M\]\), "
        r"got a 0-dim tensor",
    ),
    # devices (no GPU needed: a CPU tensor with a meta tensor)
    (
        "swiglu-cpu-meta",
        lambda: ffn_ext.swiglu(X, M),
        lambda: OPS.swiglu(X, M),
        RuntimeError,
        r"ffn_ext\.swiglu: expected `up` to be on the device of `gate` \(cpu\), got meta",
    ),
    (
        "swiglu-meta-cpu",
        lambda: ffn_ext.swiglu(M, X),
        lambda: OPS.swiglu(M, X),
        RuntimeError,
        r"ffn_ext\.swiglu: expected `up` to be on the device of `gate` \(meta\), got cpu",
    ),
    # not a tensor
    (
        "gelu-None",
        lambda: ffn_ext.gelu(None),
        None,
        TypeError,
        r"ffn_ext\.gelu: expected `x` to be a torch\.Tensor, got NoneType",
    ),
    (
        "swiglu-up-list",
        lambda: ffn_ext.swiglu(X, [1.0]),
        None,
        TypeError,
        r"ffn_ext\.swiglu: expected `up` to be a torch\.Tensor, got list",
    ),
    (
        "packed-ndarray",
        lambda: ffn_ext.swiglu_packed(X8.numpy()),
        None,
        TypeError,
        r"ffn_ext\.swiglu_packed: expected `gate_up` to be a torch\.Tensor, got ndarray",
    ),
    # layouts / tensor kinds: the public API checks before dispatch (the dispatcher's own error is in DISPATCHER_ONLY)
    (
        "gelu-sparse-coo",
        lambda: ffn_ext.gelu(X.to_sparse()),
        None,
        TypeError,
        r"ffn_ext\.gelu: expected `x` to be a dense strided tensor, got layout torch\.sparse_coo",
    ),
    (
        "silu-sparse-csr",
        lambda: ffn_ext.silu(_csr(X)),
        None,
        TypeError,
        r"ffn_ext\.silu: expected `x` to be a dense strided tensor, got layout torch\.sparse_csr",
    ),
    (
        "swiglu-up-sparse",
        lambda: ffn_ext.swiglu(X, X.to_sparse()),
        None,
        TypeError,
        r"ffn_ext\.swiglu: expected `up` to be a dense strided tensor, got layout torch\.sparse_coo",
    ),
    (
        "packed-sparse",
        lambda: ffn_ext.swiglu_packed(X8.to_sparse()),
        None,
        TypeError,
        r"ffn_ext\.swiglu_packed: expected `gate_up` to be a dense strided tensor, got layout torch\.sparse_coo",
    ),
    (
        "gelu-nested",
        lambda: ffn_ext.gelu(_nested()),
        None,
        TypeError,
        r"ffn_ext\.gelu: `x` is a nested tensor; expected a dense strided tensor",
    ),
    (
        "swiglu-gate-nested",
        lambda: ffn_ext.swiglu(_nested(), _nested()),
        None,
        TypeError,
        r"ffn_ext\.swiglu: `gate` is a nested tensor; expected a dense strided tensor",
    ),
    (
        "gelu-quantized",
        lambda: ffn_ext.gelu(_quantized(X)),
        None,
        TypeError,
        r"ffn_ext\.gelu: `x` is a quantized tensor; expected a floating-point tensor",
    ),
    (
        "packed-quantized",
        lambda: ffn_ext.swiglu_packed(_quantized(X8)),
        None,
        TypeError,
        r"ffn_ext\.swiglu_packed: `gate_up` is a quantized tensor; expected a floating-point tensor",
    ),
]

# torch.ops.ffn_ext.* with tensors whose dispatch key has no ffn_ext kernel: the dispatcher's own error.
_NO_KERNEL = r"Could not run 'ffn_ext::{op}' with arguments from the '{key}' backend"
DISPATCHER_ONLY = [
    (
        "ops-gelu-sparse-coo",
        lambda: OPS.gelu(X.to_sparse()),
        NotImplementedError,
        _NO_KERNEL.format(op="gelu", key="SparseCPU"),
    ),
    (
        "ops-silu-sparse-csr",
        lambda: OPS.silu(_csr(X)),
        NotImplementedError,
        _NO_KERNEL.format(op="silu", key="SparseCsrCPU"),
    ),
    (
        "ops-swiglu-up-sparse",
        lambda: OPS.swiglu(X, X.to_sparse()),
        NotImplementedError,
        _NO_KERNEL.format(op="swiglu", key="SparseCPU"),
    ),
    # a strided nested tensor may fail inside the autograd kernel ("NestedTensorImpl doesn't support sizes")
    # before reaching the NestedTensorCPU key
    (
        "ops-gelu-nested",
        lambda: OPS.gelu(_nested()),
        RuntimeError,
        _NO_KERNEL.format(op="gelu", key="NestedTensorCPU") + r"|NestedTensorImpl doesn't support sizes",
    ),
    (
        "ops-gelu-quantized",
        lambda: OPS.gelu(_quantized(X)),
        NotImplementedError,
        _NO_KERNEL.format(op="gelu", key="QuantizedCPU"),
    ),
    # an undefined tensor (None): the dispatcher fails before any kernel ("tensor does not have a device")
    ("ops-gelu-None", lambda: OPS.gelu(None), (TypeError, RuntimeError), r"gelu|device"),
    ("ops-gelu-float", lambda: OPS.gelu(1.0), (TypeError, RuntimeError), r"gelu"),
]

# Backward ops: wrong grad (shape, dtype, device) and wrong saved inputs; torch.ops only (no public API for these).
BACKWARD_BAD = [
    (
        "gelu_backward-grad-shape",
        lambda: OPS.gelu_backward(rnd(3, 5), X),
        ValueError,
        r"ffn_ext\.gelu_backward: expected `grad` to have the shape of `x` \[3, 4\], got \[3, 5\]",
    ),
    (
        "silu_backward-grad-dtype",
        lambda: OPS.silu_backward(X.half(), X),
        TypeError,
        r"ffn_ext\.silu_backward: expected `grad` to have the dtype of `x` \(torch\.float32\), got torch\.float16",
    ),
    (
        "silu_backward-grad-device",
        lambda: OPS.silu_backward(M, X),
        RuntimeError,
        r"ffn_ext\.silu_backward: expected `grad` to be on the device of `x` \(cpu\), got meta",
    ),
    (
        "gelu_backward-grad-int",
        lambda: OPS.gelu_backward(X.long(), X),
        TypeError,
        r"ffn_ext\.gelu_backward: expected `grad` to have dtype .*, got torch\.int64",
    ),
    (
        "gelu_backward-x-bool",
        lambda: OPS.gelu_backward(X, X > 0),
        TypeError,
        r"ffn_ext\.gelu_backward: expected `x` to have dtype .*, got torch\.bool",
    ),
    (
        "swiglu_backward-grad-shape",
        lambda: OPS.swiglu_backward(rnd(4, 3), X, X),
        ValueError,
        r"ffn_ext\.swiglu_backward: expected `grad` to have the shape of `gate` \[3, 4\], got \[4, 3\]",
    ),
    (
        "swiglu_backward-grad-dtype",
        lambda: OPS.swiglu_backward(X.double(), X, X),
        TypeError,
        r"ffn_ext\.swiglu_backward: expected `grad` to have the dtype of `gate` \(torch\.float32\), got torch\.float64",
    ),
    (
        "swiglu_backward-up-shape",
        lambda: OPS.swiglu_backward(X, X, rnd(3, 1)),
        ValueError,
        r"ffn_ext\.swiglu_backward: expected `up` to have the shape of `gate` \[3, 4\], got \[3, 1\]",
    ),
    (
        "swiglu_backward-grad-device",
        lambda: OPS.swiglu_backward(M, X, X),
        RuntimeError,
        r"ffn_ext\.swiglu_backward: expected `grad` to be on the device of `gate` \(cpu\), got meta",
    ),
    (
        "packed_backward-grad-full-width",
        lambda: OPS.swiglu_packed_backward(X8, X8),
        ValueError,
        r"ffn_ext\.swiglu_packed_backward: expected `grad` to have the forward output's shape \[3, 4\] "
        r"\(gate_up's with the last dimension halved\), got \[3, 8\]",
    ),
    (
        "packed_backward-grad-0-dim",
        lambda: OPS.swiglu_packed_backward(torch.tensor(1.0), X8),
        ValueError,
        r"ffn_ext\.swiglu_packed_backward: expected `grad` to have the forward output's shape \[3, 4\]",
    ),
    (
        "packed_backward-grad-dtype",
        lambda: OPS.swiglu_packed_backward(X.bfloat16(), X8),
        TypeError,
        r"ffn_ext\.swiglu_packed_backward: expected `grad` to have the dtype of `gate_up` \(torch\.float32\), "
        r"got torch\.bfloat16",
    ),
    (
        "packed_backward-grad-device",
        lambda: OPS.swiglu_packed_backward(M, X8),
        RuntimeError,
        r"ffn_ext\.swiglu_packed_backward: expected `grad` to be on the device of `gate_up` \(cpu\), got meta",
    ),
    (
        "packed_backward-odd-gate_up",
        lambda: OPS.swiglu_packed_backward(rnd(3, 2), rnd(3, 5)),
        ValueError,
        r"ffn_ext\.swiglu_packed_backward: expected the last dimension of `gate_up` to be even",
    ),
    (
        "packed_backward-0-dim-gate_up",
        lambda: OPS.swiglu_packed_backward(torch.tensor(1.0), torch.tensor(1.0)),
        ValueError,
        r"ffn_ext\.swiglu_packed_backward: expected `gate_up` to have at least 1 dimension",
    ),
]


# ---------------------------------------------------------------- the same errors for every op of the table
def _checks(name: str, args, kwargs: dict):
    """Raises the error the Python checks find for a call of op `name` (what the API raises for a CUDA kernel's
    guard, or where the dispatcher fails on a tensor kind); fails when they find none."""
    ffn_ext._kernels.OP[name].validate(tuple(args), kwargs, kinds=True)
    raise AssertionError(f"{name}: no check failed")


def _table_cases():
    """(id, op name, args, exception, message regex, paths): for every op, bad inputs built from its argument
    names (spec.args) with the messages the Python checks give (ffn_ext/_kernels.py). paths: where the error is
    expected, "ops" (torch.ops.ffn_ext; not for non-tensors, which the dispatcher rejects itself), "checks" (the
    Python checks alone: what explains a CUDA kernel's guard) and "api" (the public API, forward ops)."""
    cases = []
    for name in OP_NAMES:
        sp, nm = spec(name), re.escape(f"ffn_ext.{name}")
        args = list(make_inputs(name, (3, 4), torch.float32))
        r = activation_arg(name)
        ref = sp.args[r]  # x, gate or gate_up: what the other arguments are checked against

        def bad(k, value, exc, msg, what, api=True):
            a = list(args)
            a[k] = value
            paths = (
                {"checks"}
                | ({"ops"} if isinstance(value, torch.Tensor) else set())
                | (set() if sp.backward or not api else {"api"})
            )
            cases.append((f"{name}-{sp.args[k]}-{what}", name, tuple(a), exc, msg, paths))

        for k, arg in enumerate(sp.args):  # dtypes that are not floating point, for every argument
            bad(
                k,
                args[k].long(),
                TypeError,
                rf"{nm}: expected `{arg}` to have dtype float64, float32, float16 or "
                rf"bfloat16, got torch\.int64",
                "int64",
            )
        bad(
            r,
            args[r].to(torch.complex64),
            TypeError,
            rf"{nm}: expected `{ref}` to have dtype .*, got torch\.complex64",
            "complex64",
        )
        bad(r, None, TypeError, rf"{nm}: expected `{ref}` to be a torch\.Tensor, got NoneType", "None")
        if sp.kind == "packed":
            bad(
                r,
                torch.randn(3, 5),
                ValueError,
                rf"{nm}: expected the last dimension of `gate_up` to be even "
                rf"\(\[\.\.\., 2\*M\]\), got shape \[3, 5\]",
                "odd",
            )
            bad(
                r,
                torch.tensor(1.0),
                ValueError,
                rf"{nm}: expected `gate_up` to have at least 1 dimension "
                rf"\(\[\.\.\., 2\*M\]\), got a 0-dim tensor",
                "0-dim",
            )
            if sp.backward:
                g = args[0]
                bad(
                    0,
                    torch.randn(3, 8),
                    ValueError,
                    rf"{nm}: expected `grad` to have the forward output's shape "
                    rf"\[3, 4\] \(gate_up's with the last dimension halved\), "
                    rf"got \[3, 8\]",
                    "full-width",
                )
                bad(
                    0,
                    g.double(),
                    TypeError,
                    rf"{nm}: expected `grad` to have the dtype of `gate_up` "
                    rf"\(torch\.float32\), got torch\.float64",
                    "float64",
                )
                bad(
                    0,
                    g.to("meta"),
                    RuntimeError,
                    rf"{nm}: expected `grad` to be on the device of `gate_up` "
                    rf"\(cpu\), got meta",
                    "meta",
                )
            continue
        for k, arg in enumerate(sp.args):  # each other argument against the reference one
            if k == r:
                continue
            t = args[k]
            # the public API promotes mixed floating-point dtypes (test_mixed_dtypes_promote): not its error
            bad(
                k,
                t.double(),
                TypeError,
                rf"{nm}: expected `{arg}` to have the dtype of `{ref}` "
                rf"\(torch\.float32\), got torch\.float64",
                "float64",
                api=False,
            )
            bad(
                k,
                t.half(),
                TypeError,
                rf"{nm}: expected `{arg}` to have the dtype of `{ref}` "
                rf"\(torch\.float32\), got torch\.float16",
                "float16",
                api=False,
            )
            bad(
                k,
                torch.randn(3, 5),
                ValueError,
                rf"{nm}: expected `{arg}` to have the shape of `{ref}` "
                rf"\[3, 4\], got \[3, 5\]",
                "shape",
            )
            bad(
                k,
                torch.randn(4),
                ValueError,
                rf"{nm}: expected `{arg}` to have the shape of `{ref}` \[3, 4\], "
                rf"got \[4\]",
                "no-broadcast",
            )  # no broadcasting
            bad(
                k,
                t.to("meta"),
                RuntimeError,
                rf"{nm}: expected `{arg}` to be on the device of `{ref}` \(cpu\), "
                rf"got meta",
                "meta",
            )
            bad(k, None, TypeError, rf"{nm}: expected `{arg}` to be a torch\.Tensor, got NoneType", "None")
    return cases


TABLE_CASES = _table_cases()
_PUBLIC_KINDS = [  # (id, bad argument, exception, message): what only the public API sees (the dispatcher cannot)
    ("None", lambda t: None, TypeError, "expected `{arg}` to be a torch\\.Tensor, got NoneType"),
    ("list", lambda t: [1.0], TypeError, "expected `{arg}` to be a torch\\.Tensor, got list"),
    (
        "sparse",
        lambda t: t.to_sparse(),
        TypeError,
        "expected `{arg}` to be a dense strided tensor, got layout torch\\.sparse_coo",
    ),
    ("nested", lambda t: _nested(), TypeError, "`{arg}` is a nested tensor; expected a dense strided tensor"),
    (
        "quantized",
        lambda t: _quantized(t),
        TypeError,
        "`{arg}` is a quantized tensor; expected a floating-point tensor",
    ),
]
PUBLIC_KIND_CASES = [
    (f"{name}-{arg}-{kid}", name, k, make_bad, exc, rf"{re.escape('ffn_ext.' + name)}: " + msg.format(arg=arg))
    for name in FORWARD_OPS
    for k, arg in enumerate(spec(name).args)
    for kid, make_bad, exc, msg in _PUBLIC_KINDS
]


def _ids(cases):
    return [c[0] for c in cases]


@pytest.mark.parametrize(
    "case", [c for c in BAD_INPUTS if c[1] is not None], ids=_ids([c for c in BAD_INPUTS if c[1] is not None])
)
def test_public_api_rejects(case):
    _, api, _, exc, msg = case
    with pytest.raises(exc, match=msg):
        api()


@pytest.mark.parametrize(
    "case", [c for c in BAD_INPUTS if c[2] is not None], ids=_ids([c for c in BAD_INPUTS if c[2] is not None])
)
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


@pytest.mark.parametrize("case", TABLE_CASES, ids=_ids(TABLE_CASES))
def test_every_op_rejects(case):
    """torch.ops.ffn_ext.<op>, the public API (forward ops) and the Python checks alone give the same error for the
    same bad input; under FakeTensorMode (the fake kernels) too, but for the device mismatches and non-tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    _, name, args, exc, msg, paths = case
    for packing in PACKINGS if is_packed(name) else (None,):
        kw = op_kwargs(name, packing)
        calls = {
            "ops": lambda: op(name)(*args, **kw),
            "checks": lambda: _checks(name, args, kw),
            "api": lambda: api_call(name, packing)(*args),
        }
        for path in sorted(paths):
            with pytest.raises(exc, match=msg):
                calls[path]()
        if "ops" in paths and all(a.device.type == "cpu" for a in args):
            with FakeTensorMode(allow_non_fake_inputs=True):
                with pytest.raises(exc, match=msg):
                    op(name)(*args, **kw)


@pytest.mark.parametrize("case", PUBLIC_KIND_CASES, ids=_ids(PUBLIC_KIND_CASES))
def test_public_api_rejects_tensor_kinds_for_every_op(case):
    """Non-tensors, sparse, nested and quantized tensors in any argument of any forward op: the clear error from
    the public API (the dispatcher fails elsewhere for these: DISPATCHER_ONLY), and from the Python checks alone."""
    _, name, k, make_bad, exc, msg = case
    args = list(make_inputs(name, (3, 4), torch.float32))
    args[k] = make_bad(args[k])
    for fn in (lambda: api_call(name)(*args), lambda: _checks(name, tuple(args), op_kwargs(name))):
        with pytest.raises(exc, match=msg):
            fn()


@pytest.mark.parametrize(
    "call, key",
    [
        (lambda: ffn_ext.gelu(X, approximate="bogus"), "approximate"),
        (lambda: ffn_ext.gelu(X, approximate=None), "approximate"),
        (lambda: ffn_ext.gelu(X, approximate="Tanh"), "approximate"),
        (lambda: ffn_ext.geglu(X, X, approximate="bogus"), "approximate"),
        (lambda: ffn_ext.geglu_packed(X8, approximate="bogus"), "approximate"),
        (lambda: ffn_ext.geglu_packed(X8, approximate=1), "approximate"),
        (lambda: ffn_ext.gated(X, X, activation="bogus"), "activation"),
        (lambda: ffn_ext.gated(X, X, activation=None), "activation"),
        (lambda: ffn_ext.gated_packed(X8, activation="swiglu"), "activation"),  # the op's name, not the activation's
    ],
    ids=[
        "gelu-bogus",
        "gelu-None",
        "gelu-Tanh",
        "geglu-bogus",
        "geglu_packed-bogus",
        "geglu_packed-int",
        "gated-bogus",
        "gated-None",
        "gated_packed-swiglu",
    ],
)
def test_bad_options_raise_value_error_naming_the_option(call, key):
    with pytest.raises(ValueError, match=rf"`{key}` must be one of .*, got "):
        call()


def test_every_option_value_is_accepted():
    """The values the errors above list are the table's: ffn_ext.gelu(approximate=) for each GELU entry,
    gated(activation=) for every activation, layout= for every packed op."""
    for act in ACTIVATIONS:
        function, options = act.api
        torch.testing.assert_close(getattr(ffn_ext, function)(X, **options), call(act.name)(X), rtol=0, atol=0)
        torch.testing.assert_close(ffn_ext.gated(X, X, activation=act.name), call(act.gated)(X, X), rtol=0, atol=0)
        for layout in PACKINGS:
            torch.testing.assert_close(
                ffn_ext.gated_packed(X8, activation=act.name, layout=layout),
                call(act.gated + "_packed", layout)(X8),
                rtol=0,
                atol=0,
            )
    for approximate in ("none", "tanh"):
        ffn_ext.geglu(X, X, approximate=approximate), ffn_ext.geglu_packed(X8, approximate=approximate)
    for layout in PACKINGS:
        ffn_ext.swiglu_packed(X8, layout=layout), ffn_ext.swiglu_clamped_packed(X8, limit=1.0, layout=layout)
    # limit: any value > 0, inf included (no clamp: swiglu); alpha and up_offset: any finite value, ints too
    for limit in (1e-30, 1, 7.0, math.inf):
        ffn_ext.swiglu_clamped(X, X, limit=limit, alpha=-2, up_offset=-0.5)
    torch.testing.assert_close(ffn_ext.swiglu_clamped(X, X, limit=math.inf), ffn_ext.swiglu(X, X), rtol=1e-6, atol=0)


# ---------------------------------------------------------------- option values: layout, a gated op's parameters
_LAYOUT_MSG = r'{op}: `layout` must be "concat" or "interleaved", got "{bad}"'
BAD_LAYOUTS = ["bogus", "Concat", "interleave", ""]
PACKED_ALL = [n for n in OP_NAMES if is_packed(n)]


def _param_cases():
    """(id, op, kwargs, message regex) for bad values of every parameter of every op with parameters."""
    cases = []
    bad = {
        "limit": [0.0, -1.0, -math.inf, math.nan],
        "alpha": [math.inf, -math.inf, math.nan],
        "up_offset": [math.inf, math.nan],
    }
    for name in PARAM_OPS:
        for p in spec(name).params:
            assert p.name in bad, f"{name}: no bad values listed for parameter {p.name}"
            what = "> 0" if p.name == "limit" else "finite"
            for v in bad[p.name]:
                kw = dict(op_kwargs(name), **{p.name: v})
                cases.append((f"{name}-{p.name}={v}", name, kw, rf"ffn_ext\.{name}: `{p.name}` must be {what}, got "))
    return cases


PARAM_CASES = _param_cases()


def _op_paths(name, args, kw):
    """Every way to call op `name`: the dispatcher on real and meta tensors and under FakeTensorMode, and for
    forward ops with parameters or a layout the public API."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def fake():
        with FakeTensorMode(allow_non_fake_inputs=True):
            op(name)(*args, **kw)

    paths = dict(
        ops=lambda: op(name)(*args, **kw), meta=lambda: op(name)(*[a.to("meta") for a in args], **kw), fake=fake
    )
    if not spec(name).backward:
        public = getattr(ffn_ext, name, None) if spec(name).params else None
        if public is not None:
            paths["api"] = lambda: public(*args, **kw)
        elif "layout" in kw:
            paths["api"] = lambda: api_call(name, kw["layout"])(*args)
    return paths


@pytest.mark.parametrize("bad", BAD_LAYOUTS)
@pytest.mark.parametrize("name", PACKED_ALL)
def test_bad_layout_raises_value_error_naming_layout(name, bad):
    args = make_inputs(name, (3, 4), torch.float32)
    kw = op_kwargs(name, bad)
    for _path, fn in _op_paths(name, args, kw).items():
        with pytest.raises(ValueError, match=_LAYOUT_MSG.format(op=re.escape("ffn_ext." + name), bad=bad)):
            fn()


@pytest.mark.parametrize("case", PARAM_CASES, ids=[c[0] for c in PARAM_CASES])
def test_bad_parameter_raises_value_error_naming_it(case):
    _, name, kw, msg = case
    for packing in PACKINGS if is_packed(name) else (None,):
        k = dict(kw, layout=packing) if packing else kw
        for _path, fn in _op_paths(name, make_inputs(name, (3, 4), torch.float32), k).items():
            with pytest.raises(ValueError, match=msg):
                fn()


@pytest.mark.parametrize("name", PARAM_OPS)
def test_required_parameter_missing_raises_type_error(name):
    args = make_inputs(name, (3, 4), torch.float32)
    kw = {k: v for k, v in op_kwargs(name).items() if k != "limit"}
    required = [p.name for p in spec(name).params if p.default is None]
    assert required == ["limit"], required
    with pytest.raises(TypeError, match=r"missing required keyword argument\(s\) \['limit'\]"):
        _checks(name, args, kw)
    if not spec(name).backward:
        with pytest.raises(TypeError, match="limit"):
            getattr(ffn_ext, name)(*args, **kw)
    with pytest.raises((TypeError, RuntimeError), match="limit"):
        op(name)(*args, **kw)


def test_modules_reject_bad_options():
    for bad in BAD_LAYOUTS:
        for make in (
            lambda: ffn_ext.Gated("gelu", layout=bad),
            lambda: ffn_ext.SwiGLU(layout=bad),
            lambda: ffn_ext.GeGLU(layout=bad),
            lambda: ffn_ext.SwiGLU(limit=7.0, layout=bad),
        ):
            with pytest.raises(ValueError, match=r"`layout` must be one of \['concat', 'interleaved'\], got "):
                make()
    for kw, key in [
        (dict(limit=0.0), "limit"),
        (dict(limit=-7.0), "limit"),
        (dict(limit=math.nan), "limit"),
        (dict(limit=7.0, alpha=math.inf), "alpha"),
        (dict(alpha=math.nan), "alpha"),
        (dict(limit=7.0, up_offset=math.inf), "up_offset"),
    ]:
        with pytest.raises(ValueError, match=rf"ffn_ext\.SwiGLU: `{key}` must be"):
            ffn_ext.SwiGLU(**kw)


def _to_meta(v):
    return v.to("meta") if isinstance(v, torch.Tensor) and v.layout == torch.strided and not v.is_nested else v


# Fake/meta tensors run only the fake kernels (ffn_ext/_kernels.py): the checks of the CPU and CUDA kernels, so the
# same errors.
_META_CASES = [c for c in BAD_INPUTS if c[2] is not None and "cpu-meta" not in c[0] and "meta-cpu" not in c[0]]


@pytest.mark.parametrize("case", _META_CASES, ids=_ids(_META_CASES))
def test_fake_tensor_mode_rejects_the_same(case):
    from torch._subclasses.fake_tensor import FakeTensorMode

    _, api, ops_call, exc, msg = case
    # The real tensors the lambdas close over become fake when they reach an op under the mode; ffn_ext then runs
    # its fake kernel. (The public API promotes mixed dtypes: those cases go through the dispatcher op.)
    with FakeTensorMode(allow_non_fake_inputs=True):
        with pytest.raises(exc, match=msg):
            (api or ops_call)()


# ---------------------------------------------------------------- what is accepted
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 6), (2, 3, 8), (4,), (0, 6), (3, 0)], ids=str)
def test_meta_tensors_match_real_outputs(dtype, shape):
    """Meta inputs give outputs with the real outputs' sizes, strides and dtype (fake kernels, torch.compile), for
    every op (the packed ops in both layouts); `shape` is the packed ops' gate_up, the others' output is its
    half."""
    out_shape = shape[:-1] + (shape[-1] // 2,)
    for name in OP_NAMES:
        for packing in PACKINGS if is_packed(name) else (None,):
            args = [rnd(*s, dtype=dtype) for s in input_shapes(name, out_shape)]
            real = call(name, packing)(*args)
            meta = call(name, packing)(*[a.to("meta") for a in args])
            for rr, mm in zip(
                real if isinstance(real, tuple) else (real,), meta if isinstance(meta, tuple) else (meta,)
            ):
                assert mm.device.type == "meta", name
                assert (mm.shape, mm.stride(), mm.dtype) == (rr.shape, rr.stride(), rr.dtype), (name, packing)


@pytest.mark.parametrize("name", FORWARD_OPS)
def test_meta_through_public_api_and_autograd(name):
    for packing in PACKINGS if is_packed(name) else (None,):
        args = [
            torch.empty(s, device="meta", dtype=torch.bfloat16, requires_grad=True) for s in input_shapes(name, (4, 5))
        ]
        out = api_call(name, packing)(*args)
        assert out.shape == (4, 5) and out.device.type == "meta" and out.dtype == torch.bfloat16
        grads = torch.autograd.grad(out, args, torch.empty(4, 5, device="meta", dtype=torch.bfloat16))
        for g, a in zip(grads, args):
            assert g.shape == a.shape and g.dtype == a.dtype and g.device.type == "meta"


@pytest.mark.parametrize("name", [n for n in OP_NAMES if spec(n).kind != "packed"])
def test_zero_dim_is_fine_for_elementwise_ops(name):
    args = [torch.tensor(v, dtype=torch.float64) for v in (0.75, -1.5, 2.25)[: len(spec(name).args)]]
    out = call(name)(*args)
    want = aten_result(name, *args)
    for o, w in zip(out if isinstance(out, tuple) else (out,), want if isinstance(want, tuple) else (want,)):
        assert o.dim() == 0
        torch.testing.assert_close(o, w, rtol=1e-12, atol=0)
    if not spec(name).backward:
        torch.testing.assert_close(api_call(name)(*args), want, rtol=1e-12, atol=0)


@pytest.mark.parametrize("gated", GATED, ids=GATED_IDS)
def test_aliased_and_overlapping_inputs(gated):
    """Inputs may alias each other (they are only read); outputs are fresh and never alias an input."""
    base = rnd(6, 9, dtype=torch.float64) * 3
    a, b = base[:, :-1], base[:, 1:]  # overlapping views, shifted by one element
    grad = rnd(6, 8, dtype=torch.float64)
    act, g = gated.act, gated.name
    bwd = act.name + "_backward"
    calls = (
        [
            (g, (a, b), None),
            (g, (a, a), None),
            (g + "_backward", (grad, a, a), None),  # the same tensor as gate and up
            (g + "_backward", (a, b, a), None),  # grad overlaps gate and is up
            (bwd, (a, a), None),  # grad aliases x
            (act.name, (rnd(1, 8, dtype=torch.float64).expand(5, 8),), None),  # stride-0 rows
        ]
        + [
            c
            for packing in PACKINGS
            for c in (
                (g + "_packed", (base[:, :8],), packing),
                (g + "_packed_backward", (base[:, :4], base[:, 1:9]), packing),  # grad overlaps gate_up
            )
        ]
    )
    for name, args, packing in calls:
        out = call(name, packing)(*args)
        want = aten_result(name, *args, packing=packing or "concat")
        for o, w in zip(out if isinstance(out, tuple) else (out,), want if isinstance(want, tuple) else (want,)):
            torch.testing.assert_close(o, w, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name}: {m}")
            # outputs are fresh, contiguous (the native ops') and do not share memory with inputs
            assert o.is_contiguous(), name
            assert o.untyped_storage().data_ptr() != base.untyped_storage().data_ptr(), name


def test_no_op_takes_out_argument():
    """Nothing to alias: no ffn_ext op schema has an out= (mutable) argument."""
    for name in OP_NAMES:
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
@pytest.mark.parametrize("name", OP_NAMES)
def test_cuda_cpu_device_mismatch_every_op(name):
    """Each argument but the reference one (x, gate, gate_up) on the CPU, the others on the GPU."""
    args = list(make_inputs(name, (3, 4), torch.float32, "cuda"))
    r = activation_arg(name)
    for k, arg in enumerate(spec(name).args):
        if k != r:
            bad = list(args)
            bad[k] = bad[k].cpu()
            for packing in PACKINGS if is_packed(name) else (None,):
                with pytest.raises(
                    RuntimeError,
                    match=rf"{re.escape('ffn_ext.' + name)}: expected `{arg}` to be on "
                    rf"the device of `{spec(name).args[r]}` \(cuda:0\), got cpu",
                ):
                    op(name)(*bad, **op_kwargs(name, packing))


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_cuda_cpu_device_mismatch_names_the_argument():
    xc = rnd(3, 4, device="cuda")
    with pytest.raises(
        RuntimeError,
        match=r"ffn_ext\.swiglu: expected `up` to be on the device of `gate` "
        r"\(cuda:0\), got cpu",
    ):
        ffn_ext.swiglu(xc, X)
    with pytest.raises(
        RuntimeError,
        match=r"ffn_ext\.gelu_backward: expected `grad` to be on the device of `x` "
        r"\(cuda:0\), got cpu",
    ):
        OPS.gelu_backward(X, xc)
    with pytest.raises(RuntimeError, match=r"ffn_ext\.swiglu_packed_backward: expected `grad` to be on the device"):
        OPS.swiglu_packed_backward(X, X8.cuda())
    with pytest.raises(TypeError, match=r"ffn_ext\.gelu: expected `x` to have dtype .*, got torch\.int64"):
        ffn_ext.gelu(xc.long())
    with pytest.raises(ValueError, match=r"ffn_ext\.swiglu_packed: expected the last dimension"):
        ffn_ext.swiglu_packed(rnd(3, 5, device="cuda"))
    with pytest.raises(TypeError, match=r"ffn_ext\.gelu: expected `x` to be a dense strided tensor"):
        ffn_ext.gelu(xc.to_sparse())


# ---------------------------------------------------------------- no native library (ffn_ext defines the ops)
_FALLBACK_SCRIPT = textwrap.dedent(r"""
    import re, torch, ffn_ext
    assert ffn_ext.build_info()["native"].startswith("none: the ops are defined by ffn_ext"), ffn_ext.build_info()
    X = torch.randn(3, 4); X8 = torch.randn(3, 8); M = torch.empty(3, 4, device="meta")
    cases = [
        (lambda: torch.ops.ffn_ext.swiglu(X, X.double()), TypeError, r"ffn_ext\.swiglu: expected `up` to have the dtype of `gate` \(torch\.float32\), got torch\.float64"),
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
        (lambda: ffn_ext.gelu(X, approximate="bogus"), ValueError, r"`approximate` must be one of"),
        (lambda: ffn_ext.geglu(X, X, approximate="bogus"), ValueError, r"`approximate` must be one of"),
        (lambda: ffn_ext.geglu_packed(X8, approximate="bogus"), ValueError, r"`approximate` must be one of"),
        (lambda: ffn_ext.gated(X, X, activation="bogus"), ValueError, r"`activation` must be one of"),
        (lambda: ffn_ext.swiglu_packed(X8, layout="bogus"), ValueError, r'ffn_ext\.swiglu_packed: `layout` must be "concat" or "interleaved", got "bogus"'),
        (lambda: ffn_ext.swiglu_clamped(X, X, limit=0.0), ValueError, r"ffn_ext\.swiglu_clamped: `limit` must be > 0"),
        (lambda: ffn_ext.swiglu_clamped(X, X, limit=7.0, alpha=float("nan")), ValueError, r"ffn_ext\.swiglu_clamped: `alpha` must be finite"),
        (lambda: ffn_ext.swiglu_clamped_packed(X8, limit=7.0, up_offset=float("inf")), ValueError, r"ffn_ext\.swiglu_clamped_packed: `up_offset` must be finite"),
        (lambda: ffn_ext.swiglu_clamped_packed(X8, limit=7.0, layout="Interleaved"), ValueError, r"ffn_ext\.swiglu_clamped_packed: `layout` must be"),
    ]
    # every op of the table through the public API: the op's name in the message
    from ffn_ext.table import ACTIVATIONS
    for act in ACTIVATIONS:
        fn, opts = act.api
        cases += [
            (lambda fn=fn, opts=opts: getattr(ffn_ext, fn)(X.long(), **opts), TypeError,
             rf"ffn_ext\.{act.name}: expected `x` to have dtype .*, got torch\.int64"),
            (lambda a=act: getattr(torch.ops.ffn_ext, a.gated)(X, X.double()), TypeError,
             rf"ffn_ext\.{act.gated}: expected `up` to have the dtype of `gate` \(torch\.float32\), "
             r"got torch\.float64"),
            (lambda a=act: ffn_ext.gated(X, M, activation=a.name), RuntimeError,
             rf"ffn_ext\.{act.gated}: expected `up` to be on the device of `gate` \(cpu\), got meta"),
            (lambda a=act: ffn_ext.gated_packed(torch.randn(3, 5), activation=a.name), ValueError,
             rf"ffn_ext\.{act.gated}_packed: expected the last dimension of `gate_up` to be even"),
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
    # mixed floating-point dtypes: promoted as ATen's silu(g) * u (without the native library too)
    g, u = torch.randn(3, 4), torch.randn(3, 4, dtype=torch.bfloat16)
    torch.testing.assert_close(ffn_ext.swiglu(g, u), torch.nn.functional.silu(g) * u)
    for act in ACTIVATIONS:  # and the ops compute: ATen's composites
        g, u = torch.randn(3, 4), torch.randn(3, 4)
        torch.testing.assert_close(ffn_ext.gated(g, u, activation=act.name), act.aten(g) * u)
        gu = torch.randn(3, 8)
        torch.testing.assert_close(ffn_ext.gated_packed(gu, activation=act.name, layout="interleaved"),
                                   act.aten(gu[:, ::2]) * gu[:, 1::2])
    g, u = 4 * torch.randn(3, 4), 4 * torch.randn(3, 4)
    gc = g.clamp(max=2.0)
    torch.testing.assert_close(ffn_ext.swiglu_clamped(g, u, limit=2.0, alpha=1.702, up_offset=1.0),
                               (u.clamp(-2.0, 2.0) + 1.0) * gc * torch.sigmoid(gc * 1.702))
    print("fallback-ok", len(cases))
""")


@pytest.mark.slow
def test_aten_fallback_validates_the_same():
    env = dict(os.environ, FFN_EXT_NO_C="1")
    r = subprocess.run(
        [sys.executable, "-c", _FALLBACK_SCRIPT], env=env, capture_output=True, text=True, timeout=HANG_GUARD_S
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"fallback-ok {20 + 4 * len(ACTIVATIONS)}" in r.stdout, r.stdout


def test_jagged_nested_tensors_run_the_pointwise_ops():
    """The unary and gated ops carry torch.Tag.pointwise, so jagged nested tensors (NJT) run them on their values,
    as they run ATen's silu and mul; the results are ATen's on the same NJT. (Strided nested tensors are still
    refused: BAD_INPUTS.) Before torch 2.12 the stable ABI cannot tag the schemas: NJT is refused, by name."""
    njt = _nested(torch.jagged)
    up = njt * 0.5 + 1
    if ffn_ext.build_info()["pointwise_tags"] != "yes":
        with pytest.raises(TypeError, match=r"ffn_ext\.silu: `x` is a nested tensor"):
            ffn_ext.silu(njt)
        return
    for act in ACTIVATIONS:
        fn, kw = act.api
        got = getattr(ffn_ext, fn)(njt, **kw)
        torch.testing.assert_close(got.values(), act.aten(njt).values())
        torch.testing.assert_close(ffn_ext.gated(njt, up, activation=act.name).values(), (act.aten(njt) * up).values())
    torch.testing.assert_close(OPS.silu(njt).values(), torch.nn.functional.silu(njt).values())
