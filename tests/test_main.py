"""python -m ffn_ext: the full demo in a subprocess (exit status, key lines), and its checker can fail."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import HANG_GUARD_S, package_env

import ffn_ext
from ffn_ext import __main__ as demo
from ffn_ext import _loader
from ffn_ext.table import ACTIVATIONS
from ffn_ext.table import OPS as TABLE_OPS

ROOT = Path(__file__).resolve().parents[1]
GPU = torch.cuda.is_available() and ffn_ext.has_cuda_kernels()


@pytest.fixture(scope="module")
def full_run():
    env = package_env(PYTHONWARNINGS="ignore")  # the ffn_ext under test, wherever the tests run from
    proc = subprocess.run(
        [sys.executable, "-m", "ffn_ext"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S
    )
    return proc


def test_main_exits_zero_with_pass(full_run):
    assert full_run.returncode == 0, full_run.stdout[-4000:] + full_run.stderr[-4000:]
    last = full_run.stdout.strip().splitlines()[-1]
    assert last.startswith("PASS: ffn_ext ops vs ATen on " + ("GPU" if GPU else "CPU")), last
    assert "FAIL" not in full_run.stdout


def test_main_fits_one_screen(full_run):
    lines = full_run.stdout.strip().splitlines()
    assert len(lines) <= 45, f"{len(lines)} lines:\n" + full_run.stdout
    assert max(map(len, lines)) <= 132, max(lines, key=len)


def test_main_key_lines(full_run):
    out = full_run.stdout
    # the first line: where the ops run, as build_summary() says it (built for which GPUs, is one visible)
    where = _loader.where_it_runs(ffn_ext.build_info())
    assert out.startswith(demo.headline(ffn_ext.build_info()) + "\n"), out[:500]
    assert " ".join(demo.headline(ffn_ext.build_info()).split()) == " ".join(
        f"ffn_ext {ffn_ext.__version__}, torch {torch.__version__}: {where}".split()
    )
    assert "CUDA kernels: " in where and ("GPU: " in where or "no GPU visible: the ops run PyTorch's CPU ops" in where)
    # the walk: shapes through the forward hooks, parameters, the saved [tokens, d_ff] tensors as measured
    assert "x (1, 16, 768) -> " in out and "(1, 16, 3072)" in out and re.search(r"down_proj \(1, 16, 768\)", out)
    assert re.search(
        r"x \(1, 16, 896\) -> gate_proj \(1, 16, 4864\), up_proj \(1, 16, 4864\) -> act \(1, 16, "
        r"4864\) -> down_proj \(1, 16, 896\)",
        out,
    )
    assert "params 4,718,592 = 2 x 768 x 3072" in out and "params 13,074,432 = 3 x 896 x 4864" in out
    classic = re.search(r"\[16, 3072\] tensors: eager PyTorch (\d+), FFN (\d+)", out)
    gated = re.search(r"\[16, 4864\] tensors: eager PyTorch (\d+), SwiGLUFFN (\d+)", out)
    assert classic and gated, out
    assert int(classic.group(1)) == 2 and int(gated.group(1)) == 4  # eager keeps z, act(z) / gate, act, up, h
    assert int(classic.group(2)) == 1 and int(gated.group(2)) == 2  # the lean autograd: z / gate, up
    assert "134,217,728 params" in out and "= 11008) 135,266,304 params (+0.78%)" in out
    assert "swiglu_hidden_dim(896) = 2560" in out and "ffn_dim_multiplier=2.0) = 4864" in out
    # one line per activation of the table, its checks counted from the table
    for act in ACTIVATIONS:
        ops = [n for n, s in TABLE_OPS.items() if s.act.name == act.name]
        n = 3 * (
            len(ops)
            + sum(1 for n in ops if TABLE_OPS[n].kind == "gated" and not TABLE_OPS[n].backward)
            + sum(1 for n in ops if TABLE_OPS[n].kind == "packed")
        )
        m = re.search(
            rf"^  {re.escape(act.name)}\s+(\d+) checks \({len(ops)} ops\), worst ([\d.]+) of the tolerance.*"
            r"ok$",
            out,
            re.M,
        )
        assert m and int(m.group(1)) == n and float(m.group(2)) <= 1.0, (act.name, n, out)
    for module in ("FFN", "SwiGLUFFN"):
        assert re.search(rf"^  {module} fwd\+bwd\s+float32: .* ok$", out, re.M), module
    # the FFN layers' timing, labelled with the device; no op table by default
    assert re.search(r"== FFN layers on " + ("GPU" if GPU else "CPU"), out)
    for layer in (r"FFN 768 -> 3072, GELU", r"SwiGLUFFN 896 -> 4864"):
        for what in ("fwd", r"fwd\+bwd"):
            assert re.search(rf"{layer}\s+{what}\s+[\d.]+\s+[\d.]+\s+[\d.]+x", out), (layer, what)
    # which way the ratio reads, and what the CPU gains
    assert "eager/ffn_ext" in out and "(above 1x: ffn_ext faster)" in out
    assert ("the gain there is memory" in out) == (not GPU), out
    assert "max abs" not in out and "== Ops on" not in out


def test_verbose_table_has_every_op_and_dtype(capsys):
    """--verbose: the full op x dtype table (in-process, the checks only: --quick), every line ok."""
    assert demo.main(["--quick", "--verbose", "--device", "cpu", "--threads", "0"]) == 0
    out = capsys.readouterr().out
    assert "max abs" in out and "torch_version" in out  # the table's header, build_summary()
    for op in [
        *demo.OPS,
        *(f"{s.name} \\(chunk views\\)" for s in TABLE_OPS.values() if s.kind == "gated" and not s.backward),
        *(f"{s.name} \\(interleaved\\)" for s in TABLE_OPS.values() if s.kind == "packed"),
    ]:
        for dtype in ("float64", "float32", "bfloat16"):
            assert re.search(rf"^\s+{op}\s+{dtype}\s+\S+\s+\S+\s+\S+\s+\S+\s+ok$", out, re.M), (op, dtype)


def test_op_timing_runs(capsys):
    """--verbose's op timing (the public API against the ATen expression): every case, a ratio each."""
    demo.op_timing(torch.device("cpu"), blocks=1, rounds=1, warmup=0, size=(8, 64))
    out = capsys.readouterr().out
    for case in (
        "swiglu fwd",
        r"swiglu fwd\+bwd",
        "geglu_tanh fwd",
        "swiglu_packed fwd",
        "gelu fwd",
        r"GPT-OSS clamped interl\. fwd",
        r"GPT-OSS clamped interl\. fwd\+bwd",
    ):
        assert re.search(case + r"\s+[\d.]+\s+[\d.]+\s+[\d.]+x", out), case


def test_family_summary_counts_and_fails():
    """The per-activation line: counts, the worst fraction, and a failure named."""
    lines = []
    record = [
        ("gelu", torch.float32, 0.5, False, True),
        ("geglu (chunk views)", torch.bfloat16, 0.9, False, True),
        ("gelu_backward", torch.float64, 2.0, True, True),
        ("silu", torch.float32, 3.0, False, False),
    ]
    demo.family_summary(record, out=lines.append)
    gelu = next(line for line in lines if line.strip().startswith("gelu "))
    assert "3 checks (3 ops)" in gelu and "worst 0.90 of the tolerance: geglu (chunk views) bf16" in gelu
    assert "; +1 by ATen's error" in gelu and gelu.endswith("ok")
    silu = next(line for line in lines if line.strip().startswith("silu"))
    assert "FAIL: silu float32" in silu


def test_cases_cover_the_table_with_aten_references():
    """op_cases: one case per op of the table (plus chunk views of the gated ops and the interleaved layout of the
    packed ones), each with the reference built from the table's ATen forms; the references agree with autograd
    through the forward's ATen form in float64."""
    cases = demo.op_cases()
    assert set(TABLE_OPS) <= set(cases)
    assert set(cases) - set(TABLE_OPS) == {
        f"{s.name} (chunk views)" for s in TABLE_OPS.values() if s.kind == "gated" and not s.backward
    } | {f"{s.name} (interleaved)" for s in TABLE_OPS.values() if s.kind == "packed"}
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
    assert demo.check_ops(
        torch.device("cpu"), dtypes=(torch.float32,), rows=4, cols=33, cases={"gelu_like_aten": (unary, off, like_aten)}
    )
    assert "within it plus twice ATen eager's own error" in capsys.readouterr().out
    assert not demo.check_ops(
        torch.device("cpu"), dtypes=(torch.float32,), rows=4, cols=33, cases={"gelu_worse_than_aten": (unary, off, f)}
    )


def test_checker_catches_a_wrong_op(capsys):
    """A case whose 'ffn_ext' side is off by 1% (fp32) or inf (bf16) makes check_ops report FAIL."""
    unary = demo.op_cases()["gelu"][0]
    cases = {
        "gelu_off_by_1%": (unary, lambda x: torch.nn.functional.gelu(x) * 1.01, torch.nn.functional.gelu),
        "gelu_inf": (unary, lambda x: torch.nn.functional.gelu(x) / (x != x[0, 0]), torch.nn.functional.gelu),
    }
    assert not demo.check_ops(
        torch.device("cpu"), dtypes=(torch.float32,), rows=4, cols=33, cases=dict(list(cases.items())[:1])
    )
    assert not demo.check_ops(
        torch.device("cpu"), dtypes=(torch.bfloat16,), rows=4, cols=33, cases=dict(list(cases.items())[1:])
    )
    assert demo.check_ops(
        torch.device("cpu"), dtypes=(torch.float32,), rows=4, cols=33, cases={"gelu": demo.op_cases()["gelu"]}
    )
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
