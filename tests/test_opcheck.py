"""torch.library.opcheck on every ffn_ext op of the table (tests/optable.py): schema (no aliasing or mutation),
fake kernels (Python, ffn_ext/_kernels.py) match the real kernels' sizes and strides, autograd registration, and
AOT dispatch with dynamic shapes. Ops are called with their keyword arguments (optable.op_kwargs: a gated op's example parameters, and for
the packed ops layout="interleaved" as well as the default)."""

from __future__ import annotations

import pytest
import torch
from optable import DEVICES, GATED, NO_AUTOGRAD_OPS, OPS, PACKINGS, is_packed, make_inputs, op, op_kwargs

# Each opcheck costs seconds (AOT dispatch with dynamic shapes): one case each way. Without grad: 3-D chunk views
# with odd M (gate and up at different offsets, strided rows); with grad: contiguous 2-D leaves.
CASES = {False: ("chunk", (2, 3, 5)), True: ("contiguous", (3, 7))}


# (op, packing): every op with its default layout, and the packed ops with layout="interleaved" passed as well
OP_CASES = [(n, None) for n in OPS] + [(n, p) for n in OPS if is_packed(n) for p in PACKINGS[1:]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("requires_grad", [False, True], ids=["no_grad", "requires_grad"])
@pytest.mark.parametrize("name, packing", OP_CASES, ids=[n + (f"-{p}" if p else "") for n, p in OP_CASES])
def test_opcheck(name, packing, requires_grad, device):
    layout, shape = CASES[requires_grad]
    inputs = make_inputs(name, shape, torch.float32, device, layout, packing=packing or "concat")
    if requires_grad:
        inputs = tuple(t.requires_grad_() for t in inputs)
    if requires_grad and name in NO_AUTOGRAD_OPS:  # the table says it has no autograd: it must say so, not run
        with pytest.raises(Exception, match="has no autograd formula"):
            torch.library.opcheck(op(name).default, inputs, op_kwargs(name, packing))
        return
    torch.library.opcheck(op(name).default, inputs, op_kwargs(name, packing))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", [n for g in GATED for n in (g.name, g.name + "_packed_backward")])
def test_opcheck_partial_requires_grad_and_bf16(name, device):
    packing = PACKINGS[-1] if is_packed(name) else None  # interleaved (the default layout is tested above)
    inputs = list(make_inputs(name, (3, 9), torch.bfloat16, device, "chunk", packing=packing or "concat"))
    inputs[-1] = inputs[-1].detach().clone().requires_grad_()  # only the last input requires grad
    torch.library.opcheck(op(name).default, tuple(inputs), op_kwargs(name, packing))


# torch before 2.13 (2.10.0 checked) compares a fake kernel's shape and dtype with the real kernel's, not its strides
_OPCHECK_STRIDES = torch.torch_version.TorchVersion(torch.__version__) >= "2.13"


@pytest.mark.parametrize("wrong", ["shape", "dtype", "strides"])
def test_opcheck_can_fail(wrong):
    # opcheck is able to fail here: a fake kernel that differs from the real one in `wrong` is caught.
    if wrong == "strides" and not _OPCHECK_STRIDES:
        pytest.skip(f"torch {torch.__version__}'s opcheck does not compare strides (from 2.13 on it does)")
    fakes = {
        "shape": lambda x: x.new_empty((x.shape[0], x.shape[1] + 1)),
        "dtype": lambda x: x.new_empty(x.shape, dtype=torch.float64),
        "strides": lambda x: torch.empty_strided(x.shape, (1, x.shape[0]), dtype=x.dtype, device=x.device),
    }
    lib = torch.library.Library(f"ffn_ext_opcheck_probe_{wrong}", "FRAGMENT")
    lib.define("bad(Tensor x) -> Tensor")
    lib.impl("bad", lambda x: x.clone().contiguous(), "CPU")
    lib._register_fake("bad", fakes[wrong])
    with pytest.raises(Exception, match="test_faketensor"):
        torch.library.opcheck(
            getattr(torch.ops, f"ffn_ext_opcheck_probe_{wrong}").bad.default,
            (torch.randn(3, 4),),
            test_utils=("test_faketensor",),
        )
