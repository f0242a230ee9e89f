"""torch.compile(fullgraph=True) and torch.export of a small MLP that uses every forward op of the table
(tests/optable.py) between Linears, and so (through autograd) every backward op: the gated ops with parameters
(swiglu_clamped) with the table's example values, and the packed ops in both layouts (each gated op's packed form
in one of them, alternating, so that layout="interleaved" and the parameters are in the graphs as keyword
arguments).

fullgraph=True turns any graph break into an error, so passing means the ops trace as single graph nodes (their
fake kernels run under dynamo/AOTAutograd). Compile tests are few: each costs seconds on 2 cores."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from conftest import HANG_GUARD_S
from optable import (
    ACTIVATIONS,
    BACKWARD_OPS,
    DEVICES,
    FORWARD_OPS,
    GATED,
    PACKINGS,
    api_call,
    is_packed,
    op_kwargs,
    spec,
)

# the backward ops an op's autograd reaches; the recompute ops serve the classic FFN's backward (plain_mlp, compiled
# in tests/test_plain_mlp.py), not an op's autograd
AUTOGRAD_BACKWARD_OPS = tuple(n for n in BACKWARD_OPS if not spec(n).recompute)

# each gated op's packed form runs in one layout: swiglu concat, geglu interleaved, ...
PACKING_OF = {g.name: PACKINGS[i % len(PACKINGS)] for i, g in enumerate(GATED)}


class TinyMLP(nn.Module):
    """x -> Linear -> d, then for every activation of the table: Linear -> act (the public unary API); for every
    gated op: Linear -> [gate|up] -> its packed op (in PACKING_OF's layout) -> Linear -> [gate|up] -> the gated op
    on chunk views; then Linear -> d: every forward op, and (through autograd) every backward op. Projections are
    scaled by 4 so that a clamp (limit 2.5 in the example parameters) is active on some elements."""

    def __init__(self, d=16, h=24):
        super().__init__()
        self.inp = nn.Linear(d, h)
        self.unary = [api_call(a.name) for a in ACTIVATIONS]
        self.gated = [(api_call(g.name + "_packed", PACKING_OF[g.name]), api_call(g.name)) for g in GATED]
        self.unary_layers = nn.ModuleList(nn.Linear(h, h) for _ in ACTIVATIONS)
        self.gated_layers = nn.ModuleList(nn.ModuleList([nn.Linear(h, 2 * h), nn.Linear(h, 2 * h)]) for _ in GATED)
        self.out = nn.Linear(h, d)

    def forward(self, x):
        y = self.inp(x)
        # tanh after each op bounds the chain: relu2 and relu2_glu square their input, and unbounded, a dozen
        # layers overflowed to NaN in eager and compiled alike
        for unary, lin in zip(self.unary, self.unary_layers):
            y = torch.tanh(unary(lin(y)))
        for (packed, gated), (l1, l2) in zip(self.gated, self.gated_layers):
            y = torch.tanh(packed(4 * l1(y)))
            gate, up = (4 * l2(y)).chunk(2, dim=-1)
            y = torch.tanh(gated(gate, up))
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
    return {
        str(n.target.overloadpacket) if hasattr(n.target, "overloadpacket") else str(n.target)
        for n in gm.graph.nodes
        if n.op == "call_function"
    }


def _ffn_kwargs_in(gm) -> dict:
    """ffn_ext op name -> the keyword arguments of its nodes in the graph (a list, one per node)."""
    out = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and getattr(n.target, "namespace", None) == "ffn_ext":
            out.setdefault(n.target._opname, []).append(dict(n.kwargs))
    return out


def _check_kwargs(kwargs_by_op: dict, names):
    """Each op's nodes carry the model's keyword arguments: the example parameters and the packed op's layout (a
    default may be left out of a node)."""
    for name in names:
        s = spec(name)
        want = op_kwargs(name, PACKING_OF[s.gated.name] if is_packed(name) else None)
        defaults = dict({"layout": "concat"}, **{p.name: p.default for p in s.params})
        assert kwargs_by_op.get(name), (name, sorted(kwargs_by_op))
        for kw in kwargs_by_op[name]:
            assert {k: kw.get(k, defaults[k]) for k in want} == want, (name, kw, want)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_matches_eager(device):
    torch._dynamo.reset()
    model = TinyMLP().to(device)
    compiled = torch.compile(model, fullgraph=True)  # the default backend (inductor); one shape: one compile
    _compare(model, compiled, [torch.randn(2, 5, 16, device=device)])


def test_import_loads_neither_dynamo_nor_dtensor():
    """`import ffn_ext` leaves dynamo and torch.distributed.tensor unloaded on every torch (the older releases' depth
    function is marked, not decorated): they cost a second, and DTensor loaded at import registers the sharding
    strategies there instead of on a first DTensor call."""
    import ffn_ext

    code = "import sys, ffn_ext; print([m for m in ('torch._dynamo', 'torch.distributed.tensor') if m in sys.modules])"
    where = Path(ffn_ext.__file__).resolve().parents[1]  # this ffn_ext, a checkout's or an install's
    r = subprocess.run([sys.executable, "-c", code], cwd=where, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout


def test_compile_fullgraph_where_dynamo_cannot_trace_the_functorch_depth(monkeypatch):
    """Before torch 2.13 dynamo cannot trace the functorch layer depth that the functional API reads (fullgraph
    failed there): ffn_ext reads it through a function marked as assume_constant_result marks it, on those releases. That path, taken here on this
    torch: a fullgraph compile of every forward op, and of grad and vmap(grad) over the lean MLP, equals eager."""
    from torch.func import functional_call, grad, vmap

    import ffn_ext

    # ffn_ext marks the function as assume_constant_result does (it does not call it: that imports dynamo)
    assert vars(torch.compiler.assume_constant_result(lambda: 0)) == {"_dynamo_marked_constant": True}
    monkeypatch.setattr(ffn_ext._compat, "_DYNAMO_FOLDS_DEPTH", False)
    monkeypatch.setattr(ffn_ext._compat._depth_while_traced, "_dynamo_marked_constant", True, raising=False)
    torch._dynamo.reset()
    model = TinyMLP().double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    _compare(model, torch.compile(model, fullgraph=True, backend="aot_eager"), [x])
    ffn = ffn_ext.SwiGLUFFN(16, 24).double()
    params = {k: v.detach() for k, v in ffn.named_parameters()}
    per_sample = vmap(grad(lambda p, xi: functional_call(ffn, p, (xi,)).square().sum()), in_dims=(None, 0))
    ref = vmap(grad(lambda p, xi: _swiglu_ffn_ref(p, xi).square().sum()), in_dims=(None, 0))
    x = torch.randn(4, 3, 16, dtype=torch.float64)
    got = torch.compile(per_sample, backend="aot_eager", fullgraph=True)(params, x)
    torch.testing.assert_close(got, ref(params, x), rtol=1e-10, atol=1e-10)


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

    kwargs = []

    def grab_kwargs(gm, example_inputs):
        kwargs.append(_ffn_kwargs_in(gm))
        return grab(gm, example_inputs)

    backend = aot_autograd(fw_compiler=grab_kwargs, bw_compiler=grab_kwargs)
    model = TinyMLP().to(device)
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=backend)
    _compare(model, compiled, [torch.randn(n, 16, device=device) for n in (3, 7, 12)])
    fw, bw = seen[0], seen[1]
    for name in FORWARD_OPS:
        assert f"ffn_ext.{name}" in fw, f"forward graph lacks ffn_ext.{name}: {sorted(fw)}"
    for name in AUTOGRAD_BACKWARD_OPS:
        assert f"ffn_ext.{name}" in bw, f"backward graph lacks ffn_ext.{name}: {sorted(bw)}"
    assert len(seen) == 2, f"dynamic=True recompiled for new batch sizes ({len(seen)} graphs)"
    _check_kwargs(kwargs[0], FORWARD_OPS)
    _check_kwargs(kwargs[1], AUTOGRAD_BACKWARD_OPS)


@pytest.mark.parametrize("device", DEVICES)
def test_export_graph_has_ffn_ext_ops(device):
    model = TinyMLP().to(device).eval()
    x = torch.randn(6, 16, device=device)
    batch = torch.export.Dim("batch", min=2, max=1024)
    ep = torch.export.export(model, (x,), dynamic_shapes=({0: batch},))
    targets = {n.target for n in ep.graph.nodes if n.op == "call_function"}
    for name in FORWARD_OPS:
        assert getattr(torch.ops.ffn_ext, name).default in targets, f"exported graph lacks torch.ops.ffn_ext.{name}"
    _check_kwargs(_ffn_kwargs_in(ep.graph_module), FORWARD_OPS)
    for n in (6, 11):
        x = torch.randn(n, 16, device=device)
        torch.testing.assert_close(ep.module()(x), model(x), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- no recompiles; transforms under compile
def test_no_recompile_after_the_first_call():
    """A compiled function compiles once: the second call, on fresh inputs, runs under
    set_stance("fail_on_recompile") (what serving stacks set after warm-up). The route once filled an overload
    cache while traced, so dynamo guarded on the cache's contents and every compiled function compiled twice; each
    Op now holds its overload from registration on. Every forward op of the table through the functional API
    (TinyMLP) and a SwiGLUFFN, forward and backward (aot_eager: the guards are dynamo's, whatever the backend)."""
    import ffn_ext

    torch._dynamo.reset()
    torch.manual_seed(0)
    for model, x in (
        (TinyMLP(), lambda: torch.randn(2, 5, 16)),
        (ffn_ext.SwiGLUFFN(16, 24), lambda: torch.randn(3, 16)),
    ):
        compiled = torch.compile(model, backend="aot_eager")
        _compare(model, compiled, [x()])
        with torch.compiler.set_stance("fail_on_recompile"):
            _compare(model, compiled, [x()])


def _swiglu_ffn_ref(params, x):  # SwiGLUFFN's math in ATen ops (Llama's MLP)
    g = torch.nn.functional.linear(x, params["gate_proj.weight"])
    u = torch.nn.functional.linear(x, params["up_proj.weight"])
    return torch.nn.functional.linear(torch.nn.functional.silu(g) * u, params["down_proj.weight"])


def _tiny_loss(model):
    return lambda params, x: torch.func.functional_call(model, params, (x,)).square().sum()


def test_transforms_under_compile_match_aten():
    """torch.compile(grad(...)), compile(vmap(grad(functional_call(SwiGLUFFN))), fullgraph=True) and jvp under
    compile give the eager transforms' results, which test_transforms checks against ATen's, here on every forward
    op of the table (TinyMLP) and against SwiGLUFFN's ATen expression. While dynamo traces a transform, the route
    computes each op by its ATen form (dynamo traces no Function with a custom jvp)."""
    from torch.func import functional_call, grad, jvp, vmap

    import ffn_ext

    torch._dynamo.reset()
    torch.manual_seed(0)
    tol = dict(rtol=1e-10, atol=1e-10)
    model = TinyMLP().double()
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    loss = _tiny_loss(model)
    want = grad(loss, argnums=(0, 1))(params, x)
    got = torch.compile(grad(loss, argnums=(0, 1)), backend="aot_eager", fullgraph=True)(params, x)
    torch.testing.assert_close(got, want, **tol)
    t = torch.randn_like(x)
    f = lambda x, t: jvp(lambda z: model(z), (x,), (t,))  # noqa: E731
    torch.testing.assert_close(torch.compile(f, backend="aot_eager", fullgraph=True)(x, t), f(x, t), **tol)

    ffn = ffn_ext.SwiGLUFFN(16, 24).double()
    params = {k: v.detach() for k, v in ffn.named_parameters()}
    per_sample = vmap(grad(lambda p, xi: functional_call(ffn, p, (xi,)).square().sum()), in_dims=(None, 0))
    ref = vmap(grad(lambda p, xi: _swiglu_ffn_ref(p, xi).square().sum()), in_dims=(None, 0))
    x = torch.randn(4, 3, 16, dtype=torch.float64)
    torch.testing.assert_close(
        torch.compile(per_sample, backend="aot_eager", fullgraph=True)(params, x), ref(params, x), **tol
    )


def test_aoti_package_runs_the_ops(tmp_path):
    """AOTInductor: the exported TinyMLP (every forward op) compiled into a .pt2 package, loaded and run, equals
    eager. The ops run through AOTInductor's proxy executor, so the loading process needs them registered (import
    ffn_ext, as here). Costs the C++ compile of one small model."""
    aoti_compile = getattr(torch._inductor, "aoti_compile_and_package", None)
    if aoti_compile is None:
        pytest.skip("torch._inductor.aoti_compile_and_package is not in this torch")
    torch.manual_seed(0)
    model = TinyMLP().eval()
    x = torch.randn(6, 16)
    ep = torch.export.export(model, (x,))
    path = aoti_compile(ep, package_path=str(tmp_path / "tiny.pt2"))
    loaded = torch._inductor.aoti_load_package(path)
    x = torch.randn(6, 16)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=1e-5, atol=1e-6)
