"""torch.compile(fullgraph=True) and torch.export of a small MLP that uses every forward op of the table
(tests/optable.py) between Linears, and so (through autograd) every backward op.

fullgraph=True turns any graph break into an error, so passing means the ops trace as single graph nodes (their
fake kernels run under dynamo/AOTAutograd). Compile tests are few: each costs seconds on 2 cores."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from optable import ACTIVATIONS, BACKWARD_OPS, DEVICES, FORWARD_OPS, api_call


class TinyMLP(nn.Module):
    """x -> Linear -> d, then for every activation of the table: Linear -> act (the public unary API) -> Linear ->
    [gate|up] -> gated_packed -> Linear -> [gate|up] -> gated(chunk views), then Linear -> d: every forward op, and
    (through autograd) every backward op."""

    def __init__(self, d=16, h=24):
        super().__init__()
        self.inp = nn.Linear(d, h)
        self.acts = [(api_call(a.name), api_call(a.gated + "_packed"), api_call(a.gated)) for a in ACTIVATIONS]
        self.layers = nn.ModuleList(
            nn.ModuleList([nn.Linear(h, h), nn.Linear(h, 2 * h), nn.Linear(h, 2 * h)]) for _ in ACTIVATIONS)
        self.out = nn.Linear(h, d)

    def forward(self, x):
        y = self.inp(x)
        for (unary, packed, gated), (l0, l1, l2) in zip(self.acts, self.layers):
            y = unary(l0(y))
            y = packed(l1(y))
            gate, up = l2(y).chunk(2, dim=-1)
            y = gated(gate, up)
        return self.out(y)


def _eager_and_grads(model, x):
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out = model(x)
    out.square().sum().backward()
    return out.detach(), x.grad, [p.grad.clone() for p in model.parameters()]


def _compare(model, compiled, xs):
    for x in xs:
        want = _eager_and_grads(model, x)
        got = _eager_and_grads(compiled, x)
        torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-5)
        for g, w in zip(got[2], want[2]):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def _ffn_ops_in(gm) -> set:
    return {str(n.target.overloadpacket) if hasattr(n.target, "overloadpacket") else str(n.target)
            for n in gm.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_matches_eager(device):
    torch._dynamo.reset()
    model = TinyMLP().to(device)
    compiled = torch.compile(model, fullgraph=True)  # the default backend (inductor); one shape: one compile
    _compare(model, compiled, [torch.randn(2, 5, 16, device=device)])


@pytest.mark.parametrize("device", DEVICES)
def test_compile_dynamic_shapes_and_ops_in_graph(device):
    # dynamic=True: one graph for several batch sizes, run through AOTAutograd (forward and backward graphs made
    # and executed, like inductor but without its C++ codegen, which costs a minute on 2 cores). The graphs hold
    # the ffn_ext forward AND backward ops as nodes, not decompositions.
    torch._dynamo.reset()
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    seen = []

    def grab(gm, example_inputs):
        seen.append(_ffn_ops_in(gm))
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=grab, bw_compiler=grab)
    model = TinyMLP().to(device)
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=backend)
    _compare(model, compiled, [torch.randn(n, 16, device=device) for n in (3, 7, 12)])
    fw, bw = seen[0], seen[1]
    for name in FORWARD_OPS:
        assert f"ffn_ext.{name}" in fw, f"forward graph lacks ffn_ext.{name}: {sorted(fw)}"
    for name in BACKWARD_OPS:
        assert f"ffn_ext.{name}" in bw, f"backward graph lacks ffn_ext.{name}: {sorted(bw)}"
    assert len(seen) == 2, f"dynamic=True recompiled for new batch sizes ({len(seen)} graphs)"


@pytest.mark.parametrize("device", DEVICES)
def test_export_graph_has_ffn_ext_ops(device):
    model = TinyMLP().to(device).eval()
    x = torch.randn(6, 16, device=device)
    batch = torch.export.Dim("batch", min=2, max=1024)
    ep = torch.export.export(model, (x,), dynamic_shapes=({0: batch},))
    targets = {n.target for n in ep.graph.nodes if n.op == "call_function"}
    for name in FORWARD_OPS:
        assert getattr(torch.ops.ffn_ext, name).default in targets, f"exported graph lacks torch.ops.ffn_ext.{name}"
    for n in (6, 11):
        x = torch.randn(n, 16, device=device)
        torch.testing.assert_close(ep.module()(x), model(x), rtol=1e-5, atol=1e-6)
