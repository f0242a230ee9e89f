"""torch.library.opcheck on every ffn_ext op of the table (tests/optable.py): schema (no aliasing or mutation),
fake/Meta kernels match the real kernel's sizes and strides, autograd registration, and AOT dispatch with dynamic
shapes."""
from __future__ import annotations

import pytest
import torch

from optable import ACTIVATIONS, DEVICES, OPS, make_inputs, op

# Each opcheck costs seconds (AOT dispatch with dynamic shapes): one case each way. Without grad: 3-D chunk views
# with odd M (gate and up at different offsets, strided rows); with grad: contiguous 2-D leaves.
CASES = {False: ("chunk", (2, 3, 5)), True: ("contiguous", (3, 7))}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("requires_grad", [False, True], ids=["no_grad", "requires_grad"])
@pytest.mark.parametrize("name", OPS)
def test_opcheck(name, requires_grad, device):
    layout, shape = CASES[requires_grad]
    inputs = make_inputs(name, shape, torch.float32, device, layout)
    if requires_grad:
        inputs = tuple(t.requires_grad_() for t in inputs)
    torch.library.opcheck(op(name).default, inputs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", [n for a in ACTIVATIONS for n in (a.gated, a.gated + "_packed_backward")])
def test_opcheck_partial_requires_grad_and_bf16(name, device):
    inputs = list(make_inputs(name, (3, 9), torch.bfloat16, device, "chunk"))
    inputs[-1] = inputs[-1].detach().clone().requires_grad_()  # only the last input requires grad
    torch.library.opcheck(op(name).default, tuple(inputs))


def test_opcheck_can_fail():
    # opcheck is able to fail here: a fake kernel with the wrong strides is caught.
    lib = torch.library.Library("ffn_ext_opcheck_probe", "FRAGMENT")
    lib.define("bad(Tensor x) -> Tensor")
    lib.impl("bad", lambda x: x.clone().contiguous(), "CPU")
    lib._register_fake("bad", lambda x: torch.empty_strided(x.shape, (1, x.shape[0]), dtype=x.dtype,
                                                             device=x.device))
    with pytest.raises(Exception, match="test_faketensor"):
        torch.library.opcheck(torch.ops.ffn_ext_opcheck_probe.bad.default, (torch.randn(3, 4),),
                              test_utils=("test_faketensor",))
