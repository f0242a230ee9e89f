"""Thread safety of the Python layer: many threads making their first ffn_ext calls at once, in a fresh process (so
the first-use paths -- torch.ops attribute lookup, OpOverload caching, autograd registration, the dispatcher's
kernel lookup -- really run concurrently), give correct results, raise nothing, and warn at most once. Every op of
the table (ffn_ext.table.ACTIVATIONS and GATED: the unary, gated and packed ops and their backward ops, the packed
ones in both layouts, the gated ops with parameters with their example values) is called.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import HANG_GUARD_S

_SCRIPT = textwrap.dedent(r"""
    import sys, threading, warnings
    warnings.simplefilter("always")  # every warning is shown, so a repeated one would be counted twice
    N_THREADS, DEVICE, IMPORT_IN_THREADS = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
    import torch
    if not IMPORT_IN_THREADS:
        import ffn_ext

    barrier = threading.Barrier(N_THREADS)
    errors, done = [], []
    caught = []
    _show = warnings.showwarning
    warnings.showwarning = lambda msg, cat, *a, **k: caught.append(f"{cat.__name__}: {msg}")

    def close(a, b, what):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m: f"{what}: {m}")

    def work(i):
        try:
            barrier.wait()  # all threads start their first calls together
            import ffn_ext  # no-op after the first import; concurrent with the others when IMPORT_IN_THREADS
            ops = torch.ops.ffn_ext
            if DEVICE == "cuda":
                assert ffn_ext.has_cuda_kernels()
            from ffn_ext.table import ACTIVATIONS  # every activation of the op table
            gen = torch.Generator().manual_seed(i)
            x = (torch.randn(7, 10, generator=gen, dtype=torch.float64) + 0.1).to(DEVICE)
            g = torch.randn(7, 10, generator=gen, dtype=torch.float64).to(DEVICE)
            gate, up = x.chunk(2, -1)
            gh = g[:, :5]
            native = not ffn_ext.build_info()["native"].startswith("none")  # the backward ops exist
            for act in ACTIVATIONS:
                fn, opts = act.api
                unary = lambda t, fn=fn, opts=opts: getattr(ffn_ext, fn)(t, **opts)
                gated = lambda a, b, act=act: ffn_ext.gated(a, b, activation=act.name)
                packed = lambda t, act=act: ffn_ext.gated_packed(t, activation=act.name)
                # forward ops through the public API and torch.ops
                close(unary(x), act.aten(x), act.name)
                close(gated(gate, up), act.aten(gate) * up, act.gated)
                close(packed(x), act.aten(gate) * up, act.gated + "_packed")
                close(ffn_ext.gated_packed(x, activation=act.name, layout="interleaved"),
                      act.aten(x[:, ::2]) * x[:, 1::2], act.gated + "_packed interleaved")
                dg, du = act.aten_backward(gh * up, gate), gh * act.aten(gate)
                if native:
                    bwd = getattr(ops, act.name + "_backward")
                    close(bwd(g, x), act.aten_backward(g, x), act.name + "_backward")
                    dgate, dup = getattr(ops, act.gated + "_backward")(gh.contiguous(), gate, up)
                    close(dgate, dg, act.gated + "_backward dgate")
                    close(dup, du, act.gated + "_backward dup")
                    close(getattr(ops, act.gated + "_packed_backward")(gh, x), torch.cat([dg, du], -1),
                          act.gated + "_packed_backward")
                # autograd backward (and double backward) right away
                for f, ref, what in ((unary, act.aten, act.name),
                                     (packed, lambda t, act=act: act.aten(t[..., :5]) * t[..., 5:], act.gated)):
                    a = x.clone().requires_grad_(True)
                    b = x.clone().requires_grad_(True)
                    (ga,) = torch.autograd.grad(f(a).sum(), a, create_graph=True)
                    (gb,) = torch.autograd.grad(ref(b).sum(), b, create_graph=True)
                    close(ga, gb, f"grad {what}")
                    (gga,) = torch.autograd.grad((ga * g).sum(), a)
                    (ggb,) = torch.autograd.grad((gb * g).sum(), b)
                    close(gga, ggb, f"double grad {what}")
                a, b = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
                gated(a, b).backward(gh)
                close(a.grad, dg, f"{act.gated} autograd dgate")
                close(b.grad, du, f"{act.gated} autograd dup")
            from ffn_ext.table import GATED, join_packed, split_packed  # the gated ops with parameters
            for gt in GATED:
                if not gt.params:
                    continue
                p = {q.name: q.example for q in gt.params}
                close(getattr(ffn_ext, gt.name)(gate, up, **p), gt.forward(gate, up, **p), gt.name)
                for lay in ("concat", "interleaved"):
                    gg, uu = split_packed(x, lay)
                    close(getattr(ffn_ext, gt.name + "_packed")(x, layout=lay, **p), gt.forward(gg, uu, **p),
                          f"{gt.name}_packed {lay}")
                    if native:
                        close(getattr(ops, gt.name + "_packed_backward")(gh, x, layout=lay, **p),
                              join_packed(*gt.backward(gh, gg, uu, **p), lay), f"{gt.name}_packed_backward {lay}")
                    a = x.clone().requires_grad_(True)
                    b = x.clone().requires_grad_(True)
                    getattr(ffn_ext, gt.name + "_packed")(a, layout=lay, **p).backward(gh)
                    gt.forward(*split_packed(b, lay), **p).backward(gh)
                    close(a.grad, b.grad, f"{gt.name}_packed {lay} autograd")
            done.append(i)
        except BaseException as e:  # noqa: BLE001 (reported by the parent)
            errors.append(f"thread {i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(N_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()  # no limit: the test's subprocess timeout guards against a hang
    warnings.showwarning = _show
    for e in errors:
        print("ERROR", e)
    for w in caught:
        print("WARNING", w)
    print(f"threads-done {len(done)}/{N_THREADS} errors={len(errors)} warnings={len(caught)} "
          f"distinct_warnings={len(set(caught))}")
""")


def _run(n_threads, device, import_in_threads, env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    r = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(n_threads), device, "1" if import_in_threads else "0"],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        env=env,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ERROR" not in r.stdout, r.stdout
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith(f"threads-done {n_threads}/{n_threads} errors=0"), r.stdout + r.stderr
    return r.stdout


def _warnings(out):
    return [line for line in out.splitlines() if line.startswith("WARNING")]


@pytest.mark.slow
@pytest.mark.parametrize("import_in_threads", [False, True], ids=["import-first", "import-in-threads"])
def test_concurrent_first_calls_cpu(import_in_threads):
    out = _run(16, "cpu", import_in_threads)
    w = _warnings(out)
    assert len(w) == len(set(w)), f"a warning was issued more than once:\n{out}"


@pytest.mark.slow
def test_concurrent_first_calls_aten_fallback():
    """No native library (ffn_ext defines the ops, PyTorch's own ops their kernels): same results, and its one
    warning (if any) only once."""
    out = _run(16, "cpu", True, {"FFN_EXT_NO_C": "1"})
    w = _warnings(out)
    assert len(w) == len(set(w)), out


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_concurrent_first_calls_cuda():
    out = _run(16, "cuda", False)
    w = _warnings(out)
    assert len(w) == len(set(w)), out
