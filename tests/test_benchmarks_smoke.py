"""Smoke test of the benchmark suite: `--smoke` runs of benchmarks/bench_ops.py, bench_ffn.py and host_overhead.py
in a subprocess write the markdown table, the JSON with sane numbers, and (when matplotlib is installed) the
plots, for every op of the op table (ffn_ext/table.py: the new gelu_tanh and geglu ops next to gelu, silu and
swiglu; bench_ops.py also the interleaved layout, the clamped SwiGLU and two MoE shapes); benchmarks/device_check.sh
is well formed, runs its GPU-free stage, and its GPU stages reach every op."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import HANG_GUARD_S, package_env

from ffn_ext.table import ACTIVATIONS, OPS

ROOT = Path(__file__).resolve().parents[1]
# the forward ops the benchmarks time: per activation its unary op, its gated op and the packed gated op
TABLE_OPS = [a.name for a in ACTIVATIONS] + [a.gated for a in ACTIVATIONS] + [a.gated + "_packed" for a in ACTIVATIONS]
NEW_OPS = {"gelu_tanh", "geglu", "geglu_tanh", "geglu_packed", "geglu_tanh_packed"}
# bench_ops.py also times the interleaved layout and the clamped SwiGLU (GPT-OSS's parameters), after the table's ops,
# and two MoE shapes: (op, size, shape, model) at the smoke run's 2 tokens
BENCH_OPS = TABLE_OPS + [
    "swiglu_packed_interleaved",
    "swiglu_clamped",
    "swiglu_clamped_packed",
    "swiglu_clamped_packed_interleaved",
]
MOE = {
    ("swiglu_clamped_packed_interleaved", "MoE 2x4x2880", (8, 2880), "GPT-OSS-20B"),
    ("swiglu_packed", "MoE 2x8x768", (16, 768), "Qwen3-30B-A3B"),
}


def _eager_saved_per_element(act, n=64) -> float:
    """Bytes per element that the entry's eager form act.eager(gate) * up (fp32) saves for backward beyond its
    inputs: what the benchmarks' "eager" row of the gated op keeps."""
    gate, up = (torch.randn(n, requires_grad=True) for _ in range(2))
    inputs = {t.untyped_storage().data_ptr() for t in (gate, up)}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in inputs:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        act.eager(gate) * up
    return sum(saved.values()) / n


def _run(script: str, out: Path, args=("--no-progress",)) -> subprocess.CompletedProcess:
    if not (ROOT / "benchmarks" / script).is_file():
        pytest.skip(f"benchmarks/{script} is not next to the tests (copied without benchmarks/)")
    env = package_env()  # the ffn_ext under test, not the checkout's when an install is tested from it
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--smoke", "--device", "cpu", *args, "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _quick(name: str, *args: str) -> subprocess.CompletedProcess:
    """benchmarks/<name> run with args, as the installed package; skips when the benchmarks were not copied."""
    script = ROOT / "benchmarks" / name
    if not script.is_file():
        pytest.skip(f"benchmarks/{name} is not next to the tests (copied without benchmarks/)")
    proc = subprocess.run(
        [sys.executable, str(script), *args],
        cwd=ROOT,
        env=package_env(),
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _positive(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v) and v > 0


@pytest.mark.slow
def test_bench_ops_smoke(tmp_path):
    proc = _run("bench_ops.py", tmp_path)
    assert "Targets (reported, not asserted)" in proc.stdout
    data = json.loads((tmp_path / "ops.json").read_text())
    md = (tmp_path / "ops.md").read_text()
    assert "| op | dir | dtype |" in md and "Targets" in md
    meta = data["meta"]
    for key in ("date", "device_name", "torch_version", "git_commit", "ffn_ext_build_info", "mode"):
        assert key in meta, key
    assert meta["mode"] == "smoke" and meta["device_type"] == "cpu"
    assert not data["errors"], data["errors"]
    res = [r for r in data["results"] if "moe" not in r]
    # every op of the table (and the clamped/interleaved ones) x direction x {ffn_ext, eager} at both smoke sizes
    seen = {(r["op"], r["direction"], r["impl"], r["size"]) for r in res}
    assert {r["op"] for r in res} == set(BENCH_OPS) and set(TABLE_OPS) >= NEW_OPS, sorted({r["op"] for r in res})
    assert len(seen) == len(BENCH_OPS) * 3 * 2 * 2, sorted(seen)
    assert [r["op"] for r in res][:: 3 * 2][: len(BENCH_OPS)] == BENCH_OPS  # the table's order, then the new ones
    moe = [r for r in data["results"] if "moe" in r]
    assert {(r["op"], r["size"], tuple(r["shape"]), r["moe"]) for r in moe} == MOE, moe
    assert len(moe) == len(MOE) * 3 * 2
    assert any(n.startswith("clamped ops") for n in data["notes"]), data["notes"]
    # the clamped SwiGLU's peers: vLLM and TransformerEngine are CUDA only; the notes say why each was skipped
    assert any("vLLM" in n and "skipped" in n for n in data["notes"]), data["notes"]
    assert any("TransformerEngine" in n and "skipped" in n for n in data["notes"]), data["notes"]
    res = data["results"]
    for r in res:
        assert _positive(r["median_ms"]) and _positive(r["gbps"]) and _positive(r["frac_copy"]), r
        assert r["p10_ms"] <= r["median_ms"] <= r["p90_ms"]
        assert r["bytes_moved"] == data["bytes_per_element"][r["op"]][r["direction"]] * r["numel"] * 4
        if r["impl"] == "ffn_ext":
            assert _positive(r["speedup_vs"]["eager"])
        if r["direction"] == "fwd+bwd":
            assert r["saved_bytes"] > 0 and r["saved_extra_bytes"] >= 0
            assert r["peak_extra_bytes"] is None  # CPU: not measured
    for c in data["copy"]:
        assert _positive(c["gbps"])
    # ffn_ext's gated ops save only their inputs, but on the CPU those whose autograd there is ATen's (the table's
    # aten_autograd), which save what eager does; eager (the entry's eager form) also saves act(gate), and more for
    # a composite form (relu2's square(relu(gate)) keeps relu(gate) too) and the clamped SwiGLU (GPT-OSS's
    # expression keeps its intermediates)
    eager_saved = {a.gated: _eager_saved_per_element(a) for a in ACTIVATIONS}
    for r in res:
        if r["op"] in eager_saved and r["direction"] == "fwd+bwd":
            lean = r["impl"] == "ffn_ext" and not OPS[r["op"]].aten_autograd  # (the smoke run is on the CPU)
            expect = 0 if lean else r["numel"] * eager_saved[r["op"]]
            assert r["saved_extra_bytes"] == expect, r
        if r["op"].startswith("swiglu_clamped") and r["direction"] == "fwd+bwd":
            assert (r["saved_extra_bytes"] == 0) if r["impl"] == "ffn_ext" else (r["saved_extra_bytes"] > 0), r
    assert len(data["targets"]) >= 10 and all("met" in t for t in data["targets"])
    assert any(
        t["target"].startswith("swiglu_clamped_packed_interleaved fwd+bwd: ffn_ext >= 3.0x ATen eager")
        for t in data["targets"]
    )
    if _has_matplotlib():
        pngs = sorted(p.name for p in tmp_path.glob("*.png"))
        assert {f"ops_bandwidth_{op}.png" for op in BENCH_OPS} | {"ops_speedup_fp32.png"} == set(pngs), pngs
        assert all((tmp_path / p).stat().st_size > 1000 for p in pngs)


@pytest.mark.slow
def test_bench_ffn_smoke(tmp_path):
    _run("bench_ffn.py", tmp_path, args=("--no-progress", "--variants", "--token-chunk", "8"))
    data = json.loads((tmp_path / "ffn.json").read_text())
    assert "| model |" in (tmp_path / "ffn.md").read_text()
    assert not data["errors"], data["errors"]
    assert data["meta"]["ffn_ext_module"]
    res = {(r["model"], r["impl"]): r for r in data["results"]}
    impls = ("ffn_ext", "eager", "fused", "recompute", "chunk")
    assert set(res) == {(m, i) for m in ("tiny", "tiny-geglu") for i in impls}, sorted(res)
    for model in ("tiny", "tiny-geglu"):  # CPU peak (a dispatch mode): token_chunk=8 of 32 tokens is the lowest
        peaks = {i: res[(model, i)]["peak_extra_bytes"] for i in impls}
        assert all(_positive(p) for p in peaks.values()), peaks
        assert peaks["chunk"] < min(p for i, p in peaks.items() if i != "chunk"), peaks
        assert res[(model, "recompute")]["activation_bytes"] == 0 == res[(model, "chunk")]["activation_bytes"]
    assert {r["mlp"] for r in data["results"]} == {"SwiGLU", "GeGLU (tanh)"}
    import ffn_ext

    want = {
        "tiny": "ffn_ext.SwiGLUFFN",
        "tiny-geglu": "ffn_ext.GeGLUFFN(approximate='tanh')" if hasattr(ffn_ext, "GeGLUFFN") else "local module",
    }
    for model in ("tiny", "tiny-geglu"):
        assert res[(model, "ffn_ext")]["module"].startswith(want[model]), res[(model, "ffn_ext")]["module"]
        for r in (res[(model, "ffn_ext")], res[(model, "eager")]):
            assert _positive(r["median_ms"]) and _positive(r["fwd_median_ms"]) and _positive(r["activation_bytes"])
        # eager saves gate, act(gate), up and h: 4 [tokens, d_ff] tensors; ffn_ext gate and up
        assert res[(model, "eager")]["activation_tf_units"] == pytest.approx(4.0)
        assert res[(model, "ffn_ext")]["activation_tf_units"] == pytest.approx(2.0)
        assert res[(model, "ffn_ext")]["activation_vs_eager"] == pytest.approx(
            res[(model, "ffn_ext")]["activation_bytes"] / res[(model, "eager")]["activation_bytes"]
        )
    if _has_matplotlib():
        assert (tmp_path / "ffn.png").stat().st_size > 1000


def test_bench_ffn_classic_smoke(tmp_path):
    """--classic: ffn_ext.FFN against the eager fc2(act(fc1(x))): 1 [tokens, d_ff] tensor saved of eager's 2,
    recompute and token_chunk none."""
    _run("bench_ffn.py", tmp_path, args=("--no-progress", "--classic", "--variants", "--token-chunk", "8"))
    data = json.loads((tmp_path / "classic_ffn.json").read_text())
    assert not data["errors"], data["errors"]
    res = {r["impl"]: r for r in data["results"]}
    assert set(res) == {"ffn_ext", "eager", "recompute", "chunk"}, sorted(res)
    assert res["eager"]["activation_tf_units"] == pytest.approx(2.0)
    assert res["ffn_ext"]["activation_tf_units"] == pytest.approx(1.0)
    assert res["recompute"]["activation_bytes"] == 0 == res["chunk"]["activation_bytes"]
    assert {r["mlp"] for r in data["results"]} == {"FFN (GELU erf)"}


@pytest.mark.slow
def test_host_overhead_smoke(tmp_path):
    _run("host_overhead.py", tmp_path, args=())
    data = json.loads((tmp_path / "host.json").read_text())
    assert "| op | layer |" in (tmp_path / "host.md").read_text()
    layers = {(r["op"], r["layer"]) for r in data["results"]}
    assert {op for op, _ in layers} == set(TABLE_OPS) | {"MLP 1x8->16", "call"}, sorted(layers)
    assert set(data["call_ratios"]) == {
        "public call / ATen's two ops",
        "torch.ops / a plain custom op",
        "fwd+bwd / ATen's",
    }
    for op in ("gelu", "silu", "swiglu", "swiglu_packed", "geglu", "geglu_packed"):
        assert (op, "ATen eager") in layers and (op, f"ffn_ext.{op}") in layers, sorted(layers)
    assert ("gelu_tanh", "ffn_ext.gelu(approximate='tanh')") in layers, sorted(layers)
    assert ("geglu_tanh", "ffn_ext.gated(activation='gelu_tanh')") in layers, sorted(layers)
    assert ("MLP 1x8->16", "ffn_ext.SwiGLUFFN") in layers, sorted(layers)
    assert ("gelu", "torch.ops ffn_ext") in layers and ("gelu", "torch.ops aten") in layers
    for r in data["results"]:
        assert _positive(r["issue_us"]) and r["issue_min_us"] <= r["issue_us"] <= r["total_us"] * 1.01, r


@pytest.mark.slow
def test_device_check_script_is_well_formed(tmp_path):
    """benchmarks/device_check.sh gets a few calls on a lent GPU, so what can be checked here is: bash parses it,
    every default stage has a `stage` line, the calls its header prescribes cover every stage and their stage
    limits leave room under the device tool's 600 s per call,
    the scripts it runs exist and take their ops from the op table. Then a run of its one GPU-free stage (sass),
    without its time limit (STAGE_LIMITS=off: a slow machine is no failure), writes the summary and archive, and
    skips the rest without counting them as failures."""
    import re

    import sass_reader

    import ffn_ext

    script = ROOT / "benchmarks" / "device_check.sh"
    if not script.is_file() or not (ROOT / "tests" / "cuda_sanitize_cases.py").is_file():
        pytest.skip("benchmarks/device_check.sh is not next to the tests (copied without benchmarks/)")
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    stages = dict(re.findall(r"^\s*(?:\w+=\S+ )?stage (\w+) (\d+) ", text, re.M))
    defaults = re.search(r"STAGES=\$\{STAGES:-([^}]*)\}", text).group(1).split()
    assert sorted(defaults) == sorted(stages), (defaults, stages)
    # the calls its header prescribes (STAGES=... groups): together every stage, each under the 600 s per call
    groups = [g.split() for g in re.findall(r'^#.*STAGES="([^"]+)" bash benchmarks/device_check\.sh', text, re.M)]
    assert groups and sorted(sum(groups, [])) == sorted(stages), (groups, stages)
    for g in groups:
        assert sum(int(stages[n]) for n in g) <= 590, (g, stages)
    for path in re.findall(r"\b((?:benchmarks|tests)/\w+\.py)\b", text):
        assert (ROOT / path).is_file(), path
    # the GPU stages take their ops from the op table: bench_ops with no --ops subset, the sanitizer and ncu cases
    # from ffn_ext.table (directly or through benchmarks/common.py's table_ops)
    assert "--ops" not in re.search(r"^stage bench_ops .*$", text, re.M).group(0)
    for path in ("tests/cuda_sanitize_cases.py", "benchmarks/ncu_cases.py"):
        assert re.search(r"ffn_ext\.table|table_ops\(\)", (ROOT / path).read_text()), path

    # STAGE_LIMITS=off: the stage's time limit is for the device call; here only its outcome counts, however
    # loaded the machine.
    env = dict(
        os.environ,
        OUT=str(tmp_path),
        STAGES="sass",
        STAGE_LIMITS="off",
        PYTHON=sys.executable,
        PYTHONPATH=package_env()["PYTHONPATH"],
    )
    proc = subprocess.run(
        ["bash", str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S
    )
    summary = (tmp_path / "summary.txt").read_text()
    assert (tmp_path / "device_check.tgz").is_file()
    for name in set(stages) - {"sass"}:
        assert re.search(rf"^{name}\s+skipped \(STAGES\)", summary, re.M), (name, summary)
    sass_ok = re.search(r"^sass\s+rc=0 ", summary, re.M) is not None
    if ffn_ext.has_cuda_kernels() and sass_reader.cuobjdump():
        assert sass_ok and proc.returncode == 0 and "failed stages: 0" in summary, summary
    else:
        assert not sass_ok and proc.returncode == 1 and "failed stages: 1" in summary, summary


def test_bench_cpu_quick(tmp_path):
    """benchmarks/bench_cpu.py --quick (tiny shapes, 1 thread, min of 3): every implementation, fwd and fwd+bwd,
    a positive time and ratio each, the worst ratio named in the markdown."""
    _quick("bench_cpu.py", "--quick", "--reps", "2", "--out", str(tmp_path))
    data = json.loads((tmp_path / "cpu.json").read_text())
    impls = {r["impl"] for r in data["rows"]}
    assert {"SwiGLUFFN", "GeGLUFFN (tanh)", "GatedFFN (gelu)", "FFN (gelu)", "swiglu_mlp"} <= impls, impls
    assert {r["pass"] for r in data["rows"]} == {"fwd", "fwd+bwd"}
    assert all(_positive(r[k]) for r in data["rows"] for k in ("ffn_ext_ms", "eager_ms", "ratio"))
    assert "eager vs eager (A/A)" in impls  # the control, left out of the worst ratio
    assert data["worst"]["ratio"] == min(r["ratio"] for r in data["rows"] if r["impl"] != "eager vs eager (A/A)")
    assert "**Worst ratio:" in (tmp_path / "cpu.md").read_text()


def test_moe_saved_bytes_quick():
    """benchmarks/moe_saved_bytes.py --quick (one Qwen3-MoE experts layer, 1 block): a row with every experts
    implementation's saved bytes, ffn_ext's below grouped_mm's and eager's, and positive times."""
    pytest.importorskip("transformers.integrations.moe")
    proc = _quick("moe_saved_bytes.py", "--quick", "--rounds", "1")
    rows = [line for line in proc.stdout.splitlines() if line.startswith("qwen3_moe")]
    assert len(rows) == 1, proc.stdout
    sizes, times = rows[0].split("|")[1].split(), rows[0].split("|")[2].split()
    eager, grouped, _batched, ours = (float(v) for v in sizes)
    assert 0 < ours < grouped < eager, rows[0]
    assert all(float(t.rstrip("x")) > 0 for t in times), rows[0]


def test_train_saved_dtype_quick(tmp_path):
    """benchmarks/train_saved_dtype.py at tiny widths, 2 seeds x 4 steps, the default patch and the FP8 cache: the
    CSV has every step of every run, the first step's loss is the same in both (the forward is unchanged), the
    floor lies between 0 and a uniform guess, and the table states the goal."""
    pytest.importorskip("transformers")
    args = ("--variants", "default,fp8", "--seeds", "0,1", "--steps", "4", "--batch", "2", "--seq", "8")
    tiny = ("--hidden", "32", "--intermediate", "128", "--warmup", "1", "--final-steps", "2", "--held-out", "4")
    _quick("train_saved_dtype.py", *args, *tiny, "--out", str(tmp_path))
    with open(tmp_path / "train_saved_dtype.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * 2 * 4
    first = {(r["variant"], r["seed"]): r["loss"] for r in rows if r["step"] == "1"}
    assert first["default", "0"] == first["fp8", "0"] and first["default", "1"] == first["fp8", "1"], first
    data = json.loads((tmp_path / "train_saved_dtype.json").read_text())
    assert 0 < data["floor"] < math.log(64), data["floor"]
    assert "Goal (issue 45)" in (tmp_path / "train_saved_dtype.md").read_text()


def test_bench_model_smoke(tmp_path):
    """benchmarks/bench_model.py --smoke on a dense and an MoE model (tiny widths, 2 layers, 32 tokens, 2 training
    steps): a row per variant with a positive tokens/s and saved bytes; the memory options keep less for backward
    than unpatched, by exactly the eager MLP's four [tokens, d_ff] tensors per layer (gate, act(gate), up and h) for
    recompute and token_chunk; ffn_ext's experts keep less than grouped_mm's; every variant's loss after the two steps
    is unpatched's up to fp32 rounding (same weights, same batches); torch.compile is listed as not run, with why;
    the table, the JSON (also at --json) and the plot are written."""
    pytest.importorskip("transformers.integrations.moe")
    models = ("--models", "llama-3-8b,gpt-oss-20b")
    _run("bench_model.py", tmp_path, args=("--no-progress", *models, "--json", str(tmp_path / "copy.json")))
    data = json.loads((tmp_path / "model.json").read_text())
    assert json.loads((tmp_path / "copy.json").read_text())["results"] == data["results"]
    assert not data["errors"], data["errors"]
    rows = {(r["model"], r["variant"]): r for r in data["results"]}
    dense = {("llama-3-8b", v) for v in ("unpatched", "ffn_ext", "recompute", "token_chunk")}
    assert set(rows) == dense | {("gpt-oss-20b", v) for v in ("unpatched", "ffn_ext", "experts=ffn_ext")}, rows
    for r in rows.values():
        assert _positive(r["tokens_per_s"]) and _positive(r["saved_bytes"]) and _positive(r["peak_rss_bytes"]), r
        # the forward + backward peak (the profiler's CPU allocations) holds at least what backward was given
        assert _positive(r["step_peak_bytes"]) and r["step_peak_bytes"] >= r["saved_bytes"], r
        assert len(r["losses"]) == 2 and abs(r["loss_rel"]) < 1e-5, r
    cfg = data["models"]["llama-3-8b"]["config"]
    eager_mlp = cfg["num_hidden_layers"] * 4 * 32 * cfg["intermediate_size"] * 4  # fp32 [32 tokens, d_ff] x 4
    base = rows[("llama-3-8b", "unpatched")]["saved_bytes"]
    for v in ("recompute", "token_chunk"):
        assert base - rows[("llama-3-8b", v)]["saved_bytes"] == eager_mlp, (v, rows[("llama-3-8b", v)])
    assert rows[("llama-3-8b", "ffn_ext")]["saved_bytes"] <= base
    moe = {v: rows[("gpt-oss-20b", v)]["saved_bytes"] for v in ("unpatched", "ffn_ext", "experts=ffn_ext")}
    assert moe["experts=ffn_ext"] < moe["ffn_ext"] < moe["unpatched"], moe
    skipped = {(s["model"], s["variant"]): s["reason"] for s in data["skipped"]}
    assert skipped[("llama-3-8b", "compile")].startswith("--smoke"), skipped
    md = (tmp_path / "model.md").read_text()
    assert "| model | MLP | tokens | layers | variant |" in md and "Not run:" in md
    if _has_matplotlib():
        assert (tmp_path / "model.png").stat().st_size > 1000


def test_bench_model_stack_smoke(tmp_path):
    """bench_model.py --layers 1,3 (a stack at two depths, SGD): a row per depth and variant, and the per-layer
    figures: recompute's saved bytes grow by exactly the eager MLP's four [tokens, d_ff] tensors a layer less than
    unpatched's; the stack plot is written."""
    pytest.importorskip("transformers")
    args = ("--no-progress", "--models", "llama-3-8b", "--variants", "recompute", "--layers", "1,3")
    _run("bench_model.py", tmp_path, args=(*args, "--optimizer", "sgd"))
    data = json.loads((tmp_path / "model.json").read_text())
    assert not data["errors"], data["errors"]
    assert {(r["variant"], r["layers"]) for r in data["results"]} == {
        (v, n) for v in ("unpatched", "recompute") for n in (1, 3)
    }
    per = {o["variant"]: o for o in data["per_layer"]}
    cfg = data["models"]["llama-3-8b"]["config"]
    eager_mlp = 4 * 32 * cfg["intermediate_size"] * 4  # fp32 [32 tokens, d_ff] x 4, per layer
    saved = per["unpatched"]["saved_per_layer"] - per["recompute"]["saved_per_layer"]
    assert abs(saved - eager_mlp) < 1e-6 * eager_mlp, (saved, eager_mlp)
    assert per["unpatched"]["step_peak_per_layer"] > 0 and per["recompute"]["step_peak_per_layer_vs"] is not None
    assert "Per layer" in (tmp_path / "model.md").read_text()
    if _has_matplotlib():
        assert (tmp_path / "model_stack.png").stat().st_size > 1000


def test_bench_model_rebuild_smoke(tmp_path):
    """bench_model.py --rebuild (each variant's model built from the seed, no kept copy) trains the same weights as
    the deep copies: every row's losses and saved bytes equal those of the run without it."""
    pytest.importorskip("transformers")
    args = ("--no-progress", "--no-plots", "--models", "llama-3-8b", "--variants", "recompute", "--optimizer", "sgd")
    rows = {}
    for name, extra in (("copy", ()), ("rebuild", ("--rebuild",))):
        _run("bench_model.py", tmp_path / name, args=(*args, *extra))
        data = json.loads((tmp_path / name / "model.json").read_text())
        assert not data["errors"], data["errors"]
        rows[name] = {r["variant"]: (r["losses"], r["saved_bytes"]) for r in data["results"]}
    assert set(rows["copy"]) == {"unpatched", "recompute"}
    assert rows["rebuild"] == rows["copy"]


def test_bench_model_plan(capsys, monkeypatch):
    """bench_model.py --plan builds no model and needs no GPU: the GPU quick plan (what the device check's model
    stage runs) is bf16, 2 layers, 4096 tokens, every model with the memory options, torch.compile of Llama only;
    the CPU quick plan lists torch.compile and Liger as not run, each with its reason."""
    if not (ROOT / "benchmarks" / "bench_model.py").is_file():
        pytest.skip("benchmarks/bench_model.py is not next to the tests (copied without benchmarks/)")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_model

    assert bench_model.main(["--plan", "--quick", "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "bf16, 2 layer(s), batch 1 x tokens [4096]" in out and "'qwen3-30b-a3b': 128" in out, out
    runs = {(p[1], p[6]) for p in (line.split() for line in out.splitlines() if line.startswith("  run "))}
    for m in bench_model.MODELS:
        assert (m, "unpatched") in runs and (m, "ffn_ext") in runs, (m, runs)
    assert ("llama-3-8b", "compile+ffn_ext") in runs and ("gemma-3-4b", "compile") not in runs, runs
    assert ("gpt-oss-20b", "experts=ffn_ext") in runs and ("gemma-3-4b", "token_chunk") in runs, runs
    assert bench_model.main(["--plan", "--quick", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "fp32, 1 layer(s)" in out and "  run " in out
    skips = [line for line in out.splitlines() if line.startswith("  skip ")]
    assert any("compile" in s and "torch.compile on a CPU" in s for s in skips), skips
    assert any("liger" in s and "not run on a CPU" in s for s in skips), skips
