"""python -m ffn_ext: the full demo in a subprocess (exit status, key lines), and its checker can fail."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ffn_ext
from ffn_ext import __main__ as demo
from ffn_ext.table import OPS as TABLE_OPS
from conftest import package_env

ROOT = Path(__file__).resolve().parents[1]
GPU = torch.cuda.is_available() and ffn_ext.has_cuda_kernels()


@pytest.fixture(scope="module")
def full_run():
    env = package_env(PYTHONWARNINGS="ignore")  # the ffn_ext under test, wherever the tests run from
    proc = subprocess.run([sys.executable, "-m", "ffn_ext"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    return proc


def test_main_exits_zero_with_pass(full_run):
    assert full_run.returncode == 0, full_run.stdout[-4000:] + full_run.stderr[-4000:]
    last = full_run.stdout.strip().splitlines()[-1]
    assert last.startswith("PASS: ffn_ext ops vs ATen on " + ("GPU" if GPU else "CPU")), last
    assert "FAIL" not in full_run.stdout


def test_main_key_lines(full_run):
    out = full_run.stdout
    assert "cuda_kernels" in out and "native" in out  # build_summary()
    # the shape walk, through the forward hooks
    assert re.search(r"gate_proj\s+Linear\s+\(1, 16, 896\) -> \(1, 16, 4864\)", out)
    assert re.search(r"up_proj\s+Linear\s+\(1, 16, 896\) -> \(1, 16, 4864\)", out)
    assert re.search(r"act\s+SwiGLU\s+\(1, 16, 4864\) x \(1, 16, 4864\) -> \(1, 16, 4864\)", out)
    assert re.search(r"down_proj\s+Linear\s+\(1, 16, 4864\) -> \(1, 16, 896\)", out)
    one = 16 * 4864 * 4
    assert f"ffn_ext 2 ({2 * one:,} bytes), eager PyTorch 4 ({4 * one:,} bytes)" in out
    # the parameter table
    assert re.search(r"standard FFN, d_ff = 4D\s+2\s+16384\s+134,217,728", out)
    assert re.search(r"SwiGLU, 8/3 rule to 256 \(LLaMA\)\s+3\s+11008\s+135,266,304", out)
    # every op of the table (two per activation, four per gated op), every dtype, each gated op on chunk views,
    # each packed op in the interleaved layout, and the module
    n_acts = len({s.act.name for s in TABLE_OPS.values() if s.kind == "unary"})
    n_gated = len({s.gated.name for s in TABLE_OPS.values() if s.gated is not None})
    assert set(demo.OPS) == set(TABLE_OPS) and len(demo.OPS) == 2 * n_acts + 4 * n_gated
    for op in [*demo.OPS, *(f"{s.name} \\(chunk views\\)" for s in TABLE_OPS.values() if s.kind == "gated"
                            and not s.backward),
               *(f"{s.name} \\(interleaved\\)" for s in TABLE_OPS.values() if s.kind == "packed")]:
        for dtype in ("float64", "float32", "bfloat16"):
            assert re.search(rf"^\s+{op}\s+{dtype}\s+\S+\s+\S+\s+\S+\s+\S+\s+ok$", out, re.M), (op, dtype)
    assert re.search(r"SwiGLUFFN fwd\+bwd\s+float32 .* ok$", out, re.M)
    # the timing, labelled with the device
    assert re.search(r"== Timing on " + ("GPU" if GPU else "CPU"), out)
    for case in ("swiglu fwd", "geglu_tanh fwd", "swiglu bwd", "geglu_tanh bwd", "swiglu_packed fwd", "gelu fwd",
                 r"GPT-OSS clamped interl\. fwd", r"GPT-OSS clamped interl\. fwd\+bwd"):
        assert re.search(case + r"\s+[\d.]+\s+[\d.]+\s+[\d.]+x", out), case


def test_cases_cover_the_table_with_aten_references():
    """op_cases: one case per op of the table (plus chunk views of the gated ops and the interleaved layout of the
    packed ones), each with the reference built from the table's ATen forms; the references agree with autograd
    through the forward's ATen form in float64."""
    cases = demo.op_cases()
    assert set(TABLE_OPS) <= set(cases)
    assert set(cases) - set(TABLE_OPS) == {f"{s.name} (chunk views)" for s in TABLE_OPS.values()
                                           if s.kind == "gated" and not s.backward} | \
        {f"{s.name} (interleaved)" for s in TABLE_OPS.values() if s.kind == "packed"}
    gen = torch.Generator().manual_seed(0)
    for name, spec in TABLE_OPS.items():
        if not spec.backward:
            continue
        for suffix in ("", " (interleaved)") if spec.kind == "packed" else ("",):
            make, _, ref = cases[name + suffix]
            fwd = cases[spec.forward_name + suffix][2]
            grad, *inputs = make(3, 8, torch.float64, torch.device("cpu"), gen)
            want = demo._vjp(fwd, grad, *inputs)
            got = ref(grad, *inputs)
            for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
                torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=name + suffix)


def test_checker_accepts_atens_own_error_only(capsys):
    """An error above the tolerance passes only where ATen eager in the same dtype errs as much, element by
    element (the note names the case); the same error without it fails."""
    unary = demo.op_cases()["gelu"][0]
    f = torch.nn.functional.gelu
    off = lambda x: f(x) + 1e-4 * (x > 2)  # noqa: E731
    like_aten = lambda x: off(x) if x.dtype == torch.float32 else f(x)  # noqa: E731  (exact in float64)
    assert demo.check_ops(torch.device("cpu"), dtypes=(torch.float32,), rows=4, cols=33,
                          cases={"gelu_like_aten": (unary, off, like_aten)})
    assert "within it plus twice ATen eager's own error" in capsys.readouterr().out
    assert not demo.check_ops(torch.device("cpu"), dtypes=(torch.float32,), rows=4, cols=33,
                              cases={"gelu_worse_than_aten": (unary, off, f)})


def test_checker_catches_a_wrong_op(capsys):
    """A case whose 'ffn_ext' side is off by 1% (fp32) or inf (bf16) makes check_ops report FAIL."""
    unary = demo.op_cases()["gelu"][0]
    cases = {
        "gelu_off_by_1%": (unary, lambda x: torch.nn.functional.gelu(x) * 1.01, torch.nn.functional.gelu),
        "gelu_inf": (unary, lambda x: torch.nn.functional.gelu(x) / (x != x[0, 0]), torch.nn.functional.gelu),
    }
    assert not demo.check_ops(torch.device("cpu"), dtypes=(torch.float32,), rows=4, cols=33,
                              cases=dict(list(cases.items())[:1]))
    assert not demo.check_ops(torch.device("cpu"), dtypes=(torch.bfloat16,), rows=4, cols=33,
                              cases=dict(list(cases.items())[1:]))
    assert demo.check_ops(torch.device("cpu"), dtypes=(torch.float32,), rows=4, cols=33,
                          cases={"gelu": demo.op_cases()["gelu"]})
    out = capsys.readouterr().out
    assert out.count("FAIL") == 2


def test_main_returns_one_on_fail(monkeypatch, capsys):
    real = demo.op_cases

    def broken():  # two cases, one of them off: the run is short, and main must say FAIL
        cases = real()
        make, op, ref = cases["silu"]
        return {"gelu_tanh": cases["gelu_tanh"], "silu": (make, lambda x: op(x) + 1e-3, ref)}

    monkeypatch.setattr(demo, "op_cases", broken)
    assert demo.main(["--quick", "--device", "cpu", "--threads", "0"]) == 1  # 0: leave torch threads
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1].startswith("FAIL")
    assert "Timing" not in out  # --quick
