"""Smoke test of the benchmark suite: `--smoke` runs of benchmarks/bench_ops.py, bench_ffn.py and host_overhead.py
in a subprocess write the markdown table, the JSON with sane numbers, and (when matplotlib is installed) the
plots; benchmarks/device_check.sh is well formed and runs its GPU-free stage."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, out: Path, args=("--no-progress",)) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--smoke", "--device", "cpu",
                           *args, "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
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
    res = data["results"]
    # every op x direction x {ffn_ext, eager} at both smoke sizes
    seen = {(r["op"], r["direction"], r["impl"], r["size"]) for r in res}
    assert len(seen) == 4 * 3 * 2 * 2, sorted(seen)
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
    # ffn_ext's swiglu saves only its inputs; eager also saves silu(gate) (N fp32 elements)
    for r in res:
        if r["op"] == "swiglu" and r["direction"] == "fwd+bwd":
            expect = 0 if r["impl"] == "ffn_ext" else r["numel"] * 4
            assert r["saved_extra_bytes"] == expect, r
    assert len(data["targets"]) >= 10 and all("met" in t for t in data["targets"])
    if _has_matplotlib():
        pngs = sorted(p.name for p in tmp_path.glob("*.png"))
        assert "ops_bandwidth_swiglu.png" in pngs and "ops_speedup_fp32.png" in pngs, pngs
        assert all((tmp_path / p).stat().st_size > 1000 for p in pngs)


@pytest.mark.slow
def test_bench_ffn_smoke(tmp_path):
    _run("bench_ffn.py", tmp_path)
    data = json.loads((tmp_path / "ffn.json").read_text())
    assert "| model |" in (tmp_path / "ffn.md").read_text()
    assert not data["errors"], data["errors"]
    assert data["meta"]["ffn_ext_module"]
    res = {r["impl"]: r for r in data["results"]}
    assert set(res) == {"ffn_ext", "eager"}
    for r in res.values():
        assert _positive(r["median_ms"]) and _positive(r["fwd_median_ms"]) and _positive(r["activation_bytes"])
    # eager saves gate, silu(gate), up and h: 4 [tokens, d_ff] tensors
    assert res["eager"]["activation_tf_units"] == pytest.approx(4.0)
    assert res["ffn_ext"]["activation_vs_eager"] == pytest.approx(
        res["ffn_ext"]["activation_bytes"] / res["eager"]["activation_bytes"])
    if _has_matplotlib():
        assert (tmp_path / "ffn.png").stat().st_size > 1000


@pytest.mark.slow
def test_host_overhead_smoke(tmp_path):
    _run("host_overhead.py", tmp_path, args=())
    data = json.loads((tmp_path / "host.json").read_text())
    assert "| op | layer |" in (tmp_path / "host.md").read_text()
    layers = {(r["op"], r["layer"]) for r in data["results"]}
    for op in ("gelu", "silu", "swiglu", "swiglu_packed"):
        assert (op, "ATen eager") in layers and (op, f"ffn_ext.{op}") in layers, sorted(layers)
    assert ("MLP 1x8->16", "ffn_ext.SwiGLUFFN") in layers, sorted(layers)
    if data["meta"]["ffn_ext_build_info"]["native"] != "none (ATen fallback)":
        assert ("gelu", "torch.ops ffn_ext") in layers and ("gelu", "torch.ops aten") in layers
    for r in data["results"]:
        assert _positive(r["issue_us"]) and r["issue_min_us"] <= r["issue_us"] <= r["total_us"] * 1.01, r


@pytest.mark.slow
def test_device_check_script_is_well_formed(tmp_path):
    """benchmarks/device_check.sh gets one call on a lent GPU, so what can be checked here is: bash parses it,
    every default stage has a `stage` line, the stage limits leave room under the device tool's 600 s per call,
    and the scripts it runs exist. Then a run of its one GPU-free stage (sass) writes the summary and archive,
    and skips the rest without counting them as failures."""
    import importlib.util
    import re

    import ffn_ext

    script = ROOT / "benchmarks" / "device_check.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    stages = dict(re.findall(r"^\s*(?:FFN_EXT_RUN_LARGE=1 )?stage (\w+) (\d+) ", text, re.M))
    defaults = re.search(r"STAGES=\$\{STAGES:-([^}]*)\}", text).group(1).split()
    assert sorted(defaults) == sorted(stages), (defaults, stages)
    assert sum(int(v) for v in stages.values()) <= 590, stages
    for path in re.findall(r"\b((?:benchmarks|tests)/\w+\.py)\b", text):
        assert (ROOT / path).is_file(), path

    env = dict(os.environ, OUT=str(tmp_path), STAGES="sass", PYTHON=sys.executable,
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(["bash", str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    summary = (tmp_path / "summary.txt").read_text()
    assert (tmp_path / "device_check.tgz").is_file()
    for name in set(stages) - {"sass"}:
        assert re.search(rf"^{name}\s+skipped \(STAGES\)", summary, re.M), (name, summary)
    sass_ok = re.search(r"^sass\s+rc=0 ", summary, re.M) is not None
    spec = importlib.util.spec_from_file_location("sass_budget", ROOT / "benchmarks" / "sass_budget.py")
    sass_budget = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sass_budget)
    if ffn_ext.has_cuda_kernels() and sass_budget.cuobjdump():
        assert sass_ok and proc.returncode == 0 and "failed stages: 0" in summary, summary
    else:
        assert not sass_ok and proc.returncode == 1 and "failed stages: 1" in summary, summary
