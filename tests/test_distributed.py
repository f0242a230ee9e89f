"""ffn_ext under torch.distributed, 2 ranks on the gloo backend (CPU), one process group for all the checks (a spawn
costs seconds): DTensor sharding of every op of the table (forward and backward ops, both packed layouts) against
the single-process result, the tensor-parallel plan of the gated and classic FFNs (tp_plan's module hooks, and the
lean autograd on DTensor weights: tp_gated_mlp / tp_plain_mlp, shard_gated_ffns / shard_plain_ffns), FSDP2's
fully_shard, and a patched Hugging Face model's training steps under each (benchmarks/train_distributed.py).

Each rank runs every check and collects the failures; the test fails with all of them (rank, check, error)."""

from __future__ import annotations

import copy
import os
import socket
import tempfile
import traceback

import optable
import pytest
import torch

# optable imports ffn_ext, here before torch.distributed.tensor (below), in the spawned ranks too (they import this
# file): _check_registered_on_first_call checks the registration that ffn_ext then does on a first call
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available in this torch build", allow_module_level=True)
try:
    from torch.distributed.fsdp import fully_shard  # noqa: F401
    from torch.distributed.tensor.experimental import register_sharding  # noqa: F401
except ImportError as e:  # torch < 2.6
    pytest.skip(f"needs DTensor's register_sharding and FSDP2's fully_shard ({e})", allow_module_level=True)

WORLD = 2
_SEP = "\n----\n"
TOL = dict(rtol=1e-10, atol=1e-10)  # float64 throughout: a wrong pairing or a missed reduction is O(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- the checks, run on every rank
def _op_cases():
    return [(n, p) for n in optable.OPS for p in (optable.PACKINGS if optable.is_packed(n) else (None,))]


def _check_registered_on_first_call(mesh):
    """Without register_strategies() called, the functional API's first call on DTensors registers the strategies
    (ffn_ext.ops._register_dtensor, through the hook ffn_ext.distributed sets): torch.distributed.tensor was imported
    after ffn_ext here."""
    from torch.distributed.tensor import Shard, distribute_tensor

    import ffn_ext

    if ffn_ext.distributed._registered:
        return ["the strategies were registered before the check (it tests the registration on a first call)"]
    torch.manual_seed(0)
    g, u = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    got = ffn_ext.swiglu(distribute_tensor(g, mesh, [Shard(0)]), distribute_tensor(u, mesh, [Shard(0)]))
    torch.testing.assert_close(got.full_tensor(), ffn_ext.swiglu(g, u), **TOL)
    return []


def _check_ops(mesh):
    """Every op of the table on DTensors placed Replicate, Shard(0), Shard(-1) (packed: redistributed first) and
    mixed (inputs on different dims, a Partial input): the op's result (all outputs) equals the single-process one;
    the forward ops' gradients (autograd through the DTensor op: the backward ops under DTensor) too."""
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    import ffn_ext.distributed  # noqa: F401  (the strategies)

    failures = []
    for name, packing in _op_cases():
        fn = optable.call(name, packing)
        n = optable.N_INPUTS[name]
        torch.manual_seed(0)  # the same inputs on every rank
        full = optable.make_inputs(name, (4, 6), torch.float64, packing=packing or "concat")
        want = optable.as_tuple(fn(*full))
        layouts = {
            "replicate": [Replicate()] * n,
            "shard0": [Shard(0)] * n,
            "shard_last": [Shard(-1)] * n,
            "mixed": [Shard(i % 2) for i in range(n)],
        }
        if n > 1:
            layouts["partial"] = [Partial()] + [Shard(0)] * (n - 1)
        backward = not optable.spec(name).backward
        if backward:
            leaves = [t.detach().requires_grad_() for t in full]
            want_grads = torch.autograd.grad(sum((w.square()).sum() for w in optable.as_tuple(fn(*leaves))), leaves)
        for label, placements in layouts.items():
            try:
                ins = []
                for t, p in zip(full, placements):
                    if isinstance(p, Partial):  # a Partial(sum) DTensor whose sum is t: t / world on each rank
                        d = distribute_tensor(t / WORLD, mesh, [Replicate()])
                        d = type(d).from_local(d.to_local(), mesh, [Partial()], run_check=False)
                    else:
                        d = distribute_tensor(t, mesh, [p])
                    ins.append(d.requires_grad_() if backward else d)
                got = optable.as_tuple(fn(*ins))
                for g, w in zip(got, want):
                    torch.testing.assert_close(g.full_tensor(), w, **TOL)
                    assert not any(isinstance(p, Partial) for p in g.placements), g.placements
                if backward:
                    sum(g.full_tensor().square().sum() for g in got).backward()
                    for x, w in zip(ins, want_grads):
                        torch.testing.assert_close(x.grad.full_tensor(), w, **TOL)
            except Exception:
                failures.append(f"{name}[{packing}] {label}: {traceback.format_exc(limit=-3)}")
    return failures


def _check_per_rank_packed(mesh):
    """per_rank_packed on a gate_up projection split per rank ([gate_r | up_r] on each rank) equals the
    single-process swiglu_packed of the whole projection, sharded on the last dim."""
    from torch.distributed.tensor import DTensor, Shard

    import ffn_ext
    from ffn_ext.distributed import per_rank_packed

    rank = dist.get_rank()
    torch.manual_seed(1)
    x, w_gate, w_up = (
        torch.randn(5, 8, dtype=torch.float64),
        torch.randn(6, 8, dtype=torch.float64),
        torch.randn(6, 8, dtype=torch.float64),
    )
    want = ffn_ext.swiglu(x @ w_gate.T, x @ w_up.T)  # [5, 6]
    local = x @ torch.cat([w_gate.chunk(WORLD)[rank], w_up.chunk(WORLD)[rank]]).T  # [5, 2 * 3]: [gate_r | up_r]
    gate_up = DTensor.from_local(local, mesh, [Shard(-1)], run_check=False)
    torch.testing.assert_close(per_rank_packed(ffn_ext.swiglu_packed, gate_up).full_tensor(), want, **TOL)
    # the plain op on that DTensor reads the global [gate_0 | up_0 | gate_1 | up_1] as [gate | up]: it is the user's
    # duty to say the shards are per-rank pairs (per_rank_packed); the plain op computes the global tensor's pairs
    g = gate_up.full_tensor()
    torch.testing.assert_close(ffn_ext.swiglu_packed(gate_up).full_tensor(), ffn_ext.swiglu_packed(g), **TOL)
    return []


def _ffn(kind, seed):
    import ffn_ext

    torch.manual_seed(seed)
    if kind == "swiglu":
        return ffn_ext.SwiGLUFFN(8, 12).double()
    if kind == "plain":  # the classic FFN (GELU), with biases: fc1's is sharded, fc2's replicated
        return ffn_ext.FFN(8, 12, bias=True).double()
    return ffn_ext.GeGLUFFN(8, 12, approximate="tanh").double()


def _check_tp_plan(mesh):
    """tp_plan on SwiGLUFFN and GeGLUFFN (local outputs, and DTensor outputs between the projections: the fused op
    on DTensors Shard(-1)): output and gradients equal the single-process module's."""
    from torch.distributed.tensor.parallel import parallelize_module

    from ffn_ext.distributed import tp_plan

    failures = []
    for kind in ("swiglu", "geglu", "plain"):
        for local in (True, False):
            try:
                ref, tp = _ffn(kind, 2), _ffn(kind, 2)
                parallelize_module(tp, mesh, tp_plan(tp, use_local_output=local))
                torch.manual_seed(3)
                x = torch.randn(2, 5, 8, dtype=torch.float64)
                y_ref, y = ref(x), tp(x)
                torch.testing.assert_close(y.full_tensor() if hasattr(y, "full_tensor") else y, y_ref, **TOL)
                y_ref.square().sum().backward()
                (y.full_tensor() if hasattr(y, "full_tensor") else y).square().sum().backward()
                for (k, p_ref), p in zip(ref.named_parameters(), tp.parameters()):
                    torch.testing.assert_close(p.grad.full_tensor(), p_ref.grad, **TOL, msg=k)
            except Exception:
                failures.append(f"tp_plan {kind} use_local_output={local}: {traceback.format_exc(limit=-3)}")
    return failures


def _graph_names(y) -> set:
    """The class names of the autograd nodes behind y."""
    names, todo = set(), [y.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is not None and type(fn).__name__ not in names:
            names.add(type(fn).__name__)
            todo += [f for f, _ in fn.next_functions]
    return names


def _same_and_grads(y, y_ref, xt, x, dts, full):
    """y (from xt and the DTensor weights dts) equals y_ref (from x and the full weights), and so do the gradients
    of the same loss: xt's and x's, each DTensor's gathered and its full tensor's."""
    torch.testing.assert_close(y, y_ref, **TOL)
    y_ref.square().sum().backward()
    y.square().sum().backward()
    torch.testing.assert_close(xt.grad, x.grad, **TOL)
    for t, d in zip(full, dts):
        torch.testing.assert_close(d.grad.full_tensor(), t.grad, **TOL)


def _check_tp_gated_mlp(mesh):
    """tp_gated_mlp (the lean autograd on each rank's d_ff shard, partial outputs summed) with and without biases:
    output, x's gradient and the weights' gradients (DTensors) equal the single-process gated_mlp's; the lean
    autograd.Function is in the graph."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import ffn_ext
    from ffn_ext.distributed import tp_gated_mlp

    failures = []
    for act in ("silu", "gelu_tanh"):
        for bias in (False, True):
            try:
                torch.manual_seed(6)
                shapes = [(12, 8), (12, 8), (8, 12)] + ([(12,), (12,), (8,)] if bias else [])
                full = [torch.randn(*sh, dtype=torch.float64, requires_grad=True) for sh in shapes]
                x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
                placements = [Shard(0), Shard(0), Shard(1), Shard(0), Shard(0), Replicate()]
                dts = [distribute_tensor(t.detach(), mesh, [p]).requires_grad_() for t, p in zip(full, placements)]
                y_ref = ffn_ext.gated_mlp(x, *full[:3], *(full[3:] if bias else [None] * 3), activation=act)
                xt = x.detach().clone().requires_grad_()
                y = tp_gated_mlp(xt, *dts[:3], *(dts[3:] if bias else [None] * 3), activation=act)
                _same_and_grads(y, y_ref, xt, x, dts, full)
                names = _graph_names(y)
                assert any("GatedMLP" in n for n in names), sorted(names)
            except Exception:
                failures.append(f"tp_gated_mlp {act} bias={bias}: {traceback.format_exc(limit=-3)}")
    return failures


def _sharded_equals_reference(ref, shard, mesh, opts, function):
    """A copy of module `ref` with the options `opts`, placed by `shard` (shard_gated_ffns / shard_plain_ffns):
    output, x's gradient and the weights' gradients equal ref's, and the lean `function` is in the graph."""
    model = copy.deepcopy(ref)
    model.recompute, model.token_chunk = opts.get("recompute", False), opts.get("token_chunk")
    assert shard(torch.nn.Sequential(model), mesh) == 1
    torch.manual_seed(8)
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    xt = x.detach().clone().requires_grad_()
    y_ref, y = ref(x), model(xt)
    torch.testing.assert_close(y, y_ref, **TOL)
    assert any(function in n for n in _graph_names(y)), sorted(_graph_names(y))
    y_ref.square().sum().backward()
    y.square().sum().backward()
    torch.testing.assert_close(xt.grad, x.grad, **TOL)
    for (k, p_ref), p in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), p_ref.grad, **TOL, msg=k)


def _check_shard_gated_ffns(mesh):
    """shard_gated_ffns: SwiGLUFFN and GeGLUFFN (with bias, and with recompute / token_chunk) with DTensor weights
    and no hooks run tp_gated_mlp (the lean autograd in the graph): output, x's gradient and the weights' gradients
    equal the single-process module's."""
    from ffn_ext.distributed import shard_gated_ffns

    failures = []
    for kind, opts in (("swiglu", {}), ("geglu", {"recompute": True}), ("swiglu", {"token_chunk": 4})):
        try:
            ref = _ffn(kind, 7)
            ref.down_proj.bias = torch.nn.Parameter(torch.randn(8, dtype=torch.float64))
            _sharded_equals_reference(ref, shard_gated_ffns, mesh, opts, "GatedMLP")
        except Exception:
            failures.append(f"shard_gated_ffns {kind} {opts}: {traceback.format_exc(limit=-3)}")
    return failures


def _check_tp_plain_mlp(mesh):
    """tp_plain_mlp (the lean autograd on each rank's d_ff shard, partial outputs summed), nn.Linear and Conv1D
    layouts, with and without biases, recompute and token_chunk: output, x's gradient and the weights' gradients
    (DTensors) equal the single-process plain_mlp's; the lean autograd.Function is in the graph."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import ffn_ext
    from ffn_ext.distributed import tp_plain_mlp

    failures = []
    for transposed, bias, opts in (
        (False, False, {}),
        (False, True, {"recompute": True}),
        (True, True, {}),
        (True, False, {"token_chunk": 4}),
    ):
        try:
            torch.manual_seed(6)
            shapes = [(8, 12), (12, 8)] if transposed else [(12, 8), (8, 12)]
            shapes += [(12,), (8,)] if bias else []
            full = [torch.randn(*sh, dtype=torch.float64, requires_grad=True) for sh in shapes]
            x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
            placements = ([Shard(1), Shard(0)] if transposed else [Shard(0), Shard(1)]) + [Shard(0), Replicate()]
            dts = [distribute_tensor(t.detach(), mesh, [p]).requires_grad_() for t, p in zip(full, placements)]

            def args(ts):
                return (*ts[:2], *(ts[2:] if bias else [None, None]))

            y_ref = ffn_ext.plain_mlp(x, *args(full), activation="gelu_tanh", transposed=transposed)
            xt = x.detach().clone().requires_grad_()
            y = tp_plain_mlp(xt, *args(dts), activation="gelu_tanh", transposed=transposed, **opts)
            _same_and_grads(y, y_ref, xt, x, dts, full)
            assert any("PlainMLP" in n for n in _graph_names(y)), sorted(_graph_names(y))
        except Exception:
            failures.append(
                f"tp_plain_mlp transposed={transposed} bias={bias} {opts}: {traceback.format_exc(limit=-3)}"
            )
    return failures


def _check_shard_plain_ffns(mesh):
    """shard_plain_ffns: ffn_ext.FFN (biases; recompute / token_chunk) with DTensor weights and no hooks runs
    tp_plain_mlp: output and every gradient equal the single-process module's."""
    from ffn_ext.distributed import shard_plain_ffns

    failures = []
    for opts in ({}, {"recompute": True}, {"token_chunk": 4}):
        try:
            _sharded_equals_reference(_ffn("plain", 7), shard_plain_ffns, mesh, opts, "PlainMLP")
        except Exception:
            failures.append(f"shard_plain_ffns {opts}: {traceback.format_exc(limit=-3)}")
    return failures


def _check_fsdp2(mesh):
    """fully_shard(SwiGLUFFN) and fully_shard(FFN): one SGD step on each rank's own batch equals the single-process
    step on the mean of both ranks' losses."""
    return [f for kind in ("swiglu", "plain") for f in _fsdp2_step(mesh, kind)]


def _fsdp2_step(mesh, kind):
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    ref, model = _ffn(kind, 4), _ffn(kind, 4)
    fully_shard(model, mesh=mesh)
    torch.manual_seed(5)
    xs = [torch.randn(3, 8, dtype=torch.float64) for _ in range(WORLD)]
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    (sum(ref(x).square().sum() for x in xs) / WORLD).backward()
    opt_ref.step()
    model(xs[rank]).square().sum().backward()
    opt.step()
    for (k, p_ref), p in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(p.full_tensor(), p_ref, **TOL, msg=f"{kind} {k}")
    return []


def _check_training_steps(mesh):
    """Whole-model training on the 2 ranks (benchmarks/train_distributed.py --quick, in this process group): three
    AdamW steps of a tiny Llama patched by ffn_ext.patch_hf_model under FSDP2 (fully_shard per decoder layer, the
    batch split), parallelize_module with tp_plan, and shard_gated_ffns; every step's loss within 1e-4 relative of
    the same steps on one process, ffn_ext's ops run. On gloo only (the script's models and mesh are the CPU's);
    needs transformers and the benchmarks next to the tests (else not run: the other checks still are)."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "train_distributed.py"
    if BACKEND != "gloo" or not script.is_file() or importlib.util.find_spec("transformers") is None:
        return []
    spec = importlib.util.spec_from_file_location("_train_distributed", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench.check(mesh, steps=3)


def _check_quant(mesh):
    """The quantizing ops on DTensors (ffn_ext.distributed.quant_strategies): every rank's local q and scale are its
    slice of the single-process result, bit for bit, for inputs sharded on each dim (the last dim and a dynamic
    per-tensor scale are redistributed first). Compared shard by shard: gloo has no float8 collectives."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    import ffn_ext

    failures = []
    torch.manual_seed(1)
    x = torch.randn(4, 6, 64, dtype=torch.float64) * torch.linspace(0.1, 4, 6, dtype=torch.float64)[:, None]
    u = torch.randn(4, 6, 64, dtype=torch.float64)
    recipes = [
        ffn_ext.QuantRecipe(scaling="row"),
        ffn_ext.QuantRecipe(scaling="group", group_size=32),
        ffn_ext.QuantRecipe(scaling="tensor"),
        ffn_ext.QuantRecipe(scaling="tensor", static_scale=0.5),
    ]
    calls = {
        "quantize": (lambda r, a, b: ffn_ext.quantize(a, r), (x,)),
        "swiglu_quant": (lambda r, a, b: ffn_ext.swiglu_quant(a, b, r), (x, u)),
        "gated_packed_quant": (lambda r, a, b: ffn_ext.gated_packed_quant(a, r, "gelu"), (x,)),
    }
    for name, (fn, full) in calls.items():
        for r in recipes:
            want_q, want_s = fn(r, *full, None) if len(full) == 1 else fn(r, *full)
            for d in range(3):
                label = f"{name} {r.scaling} static={r.static_scale} Shard({d})"
                try:
                    dts = [distribute_tensor(t, mesh, [Shard(d)]) for t in full]
                    q, s = fn(r, *dts, None) if len(dts) == 1 else fn(r, *dts)
                    assert isinstance(q, DTensor) and isinstance(s, DTensor), label
                    for got, want in ((q, want_q), (s, want_s)):
                        p = got.placements[0]
                        if isinstance(p, Shard):
                            want = want.tensor_split(mesh.size(), p.dim)[mesh.get_local_rank()]
                        else:
                            assert isinstance(p, Replicate), (label, p)
                        local = got.to_local()
                        bits = (lambda t: t.view(torch.uint8)) if local.element_size() == 1 else (lambda t: t)
                        assert torch.equal(bits(local.contiguous()), bits(want.contiguous())), (label, p)
                except Exception:
                    failures.append(f"_check_quant {label}: {traceback.format_exc(limit=-2)}")
    return failures


BACKEND = os.environ.get("FFN_EXT_DIST_BACKEND", "gloo")  # nccl: benchmarks/device_check.sh on 2+ GPUs


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)  # 2 ranks on the CI's 2 cores
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = "cpu"
    if BACKEND == "nccl":  # every check's tensors on this rank's GPU
        torch.cuda.set_device(rank)
        torch.set_default_device(f"cuda:{rank}")
        device = "cuda"
    dist.init_process_group(BACKEND, rank=rank, world_size=WORLD)
    failures = []

    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device, (WORLD,))
        for check in (
            _check_registered_on_first_call,
            _check_ops,
            _check_per_rank_packed,
            _check_tp_plan,
            _check_tp_gated_mlp,
            _check_shard_gated_ffns,
            _check_tp_plain_mlp,
            _check_shard_plain_ffns,
            _check_fsdp2,
            _check_training_steps,
            _check_quant,
        ):
            try:
                failures += check(mesh)
            except Exception:
                failures.append(f"{check.__name__}: {traceback.format_exc(limit=-3)}")
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
            f.write(_SEP.join(failures))
        dist.destroy_process_group()


def test_dtensor_tp_and_fsdp2_on_two_gloo_ranks():
    import torch.multiprocessing as mp

    if BACKEND == "nccl" and torch.cuda.device_count() < WORLD:
        pytest.skip(f"FFN_EXT_DIST_BACKEND=nccl needs {WORLD} GPUs, found {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory() as out:
        # spawn, though the ranks then import torch and ffn_ext again (seconds on 2 cores): a forked rank
        # cannot run backward once this process has started autograd's device threads (a backward on meta or CUDA
        # tensors in an earlier test of the same pytest-xdist worker: "Unable to handle autograd's threading in
        # combination with fork-based multiprocessing", seen with the files in xdist's order)
        mp.start_processes(_worker, args=(_free_port(), out), nprocs=WORLD, join=True, start_method="spawn")
        failures = []
        for r in range(WORLD):
            with open(os.path.join(out, f"rank{r}.txt")) as f:
                failures += [f"rank {r}: {x}" for x in f.read().split(_SEP) if x]
    assert not failures, _SEP.join(failures)


def test_tp_plan_names_every_gated_ffn_and_refuses_a_fused_gate_up():
    """tp_plan: colwise gate_proj/up_proj and rowwise down_proj for every gated FFN, by its qualified name; a
    module with a fused gate_up projection is refused with the reason (colwise sharding of [gate | up] would give
    rank 0 gate rows only)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    import ffn_ext
    from ffn_ext.distributed import tp_plan

    model = torch.nn.Sequential(
        ffn_ext.SwiGLUFFN(8, 12), torch.nn.Linear(8, 8), ffn_ext.GeGLUFFN(8, 12), ffn_ext.FFN(8, 12)
    )
    plan = tp_plan(model)
    assert {k: type(v) for k, v in plan.items()} == {
        **{
            f"{i}.{n}": ColwiseParallel if n != "down_proj" else RowwiseParallel
            for i in (0, 2)
            for n in ("gate_proj", "up_proj", "down_proj")
        },
        "3.up_proj": ColwiseParallel,
        "3.down_proj": RowwiseParallel,
    }
    with pytest.raises(ValueError, match="fused gate_up"):
        tp_plan(ffn_ext.SwiGLUFFN(8, 12, fused_gate_up=True))
