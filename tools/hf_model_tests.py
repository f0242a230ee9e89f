"""transformers' own model test files with every model patched by ffn_ext.hf.patch_hf_model: the tests that fail
patched and pass unpatched. A developer's check (issue 32), not run by CI and not part of the package.

The tests: a transformers tests/ tree for the release installed (PyPI's sdist has tests/*.py and src/ but not
tests/models, tests/generation, tests/exporters, tests/utils nor utils/test_module: take those from a checkout of
the repository, the closer to the release the better), laid out as in the repository (ROOT/tests, ROOT/utils, ROOT/src).

    .venv/bin/python tools/hf_model_tests.py ROOT [--families gpt2,t5,...] [--modes off,default,recompute,chunk]
        [--out DIR] [-- pytest args]           # PYTHONPATH=.venv-tf-next for the second transformers (.ci/tf-next)

runs all the families' tests/models/F/test_modeling_F.py in one pytest run per mode (-n 2, no more: 2 cores), and
prints passed / failed / skipped per family and mode, the modules patched, and every test that fails patched but
passes in --modes' first (unpatched) run. Modes: off (unpatched); default (patch_hf_model(model)); recompute
(recompute=True); chunk (token_chunk=4); recompute+chunk (both). In DIR: per run TAG.log (below) and TAG.out
(pytest's report: the tracebacks). A run stopped by --timeout counts the tests it finished. Tests that need the
network or weights skip or fail alike in both runs; only the difference counts.

As a pytest plugin (`-p hf_model_tests`, tools/ on PYTHONPATH), with FFN_EXT_PATCH set to a mode: every
transformers PreTrainedModel gets patch_hf_model at the end of its __init__ (post_init, which every model class
calls: ModelClass(config) and from_pretrained alike); the RuntimeWarning naming what was left unpatched is recorded,
not raised into the test. FFN_EXT_PATCH_LOG=FILE gets one line per test (from the process that ran it): node
id, outcome, modules patched in it, the warning's text (the classes named), the failure's last line.

Test files older than the release may import names its transformers.testing_utils no longer has: supply them in a
plugin of your own (`-- -p my_compat`), as for ffn_ext's 2026-12 run (test files of a 5.16.dev checkout against
5.24.0 / 5.25.0: `_TEXT_MODEL_TESTER_DEFAULTS`; tests/distributed_testing_utils.py stubbed).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import warnings
from pathlib import Path

MODES = {
    "off": None,
    "default": {},
    "recompute": {"recompute": True},
    "chunk": {"token_chunk": 4},
    "recompute+chunk": {"recompute": True, "token_chunk": 4},
}
FAMILIES = "gpt2,bert,vit,clip,whisper,gpt_neox,t5,qwen3_moe,mixtral,gpt_oss"

# ---- the pytest plugin -------------------------------------------------------------------------------------------
_seen = {"patched": 0, "named": set()}


def _install(options: dict) -> None:
    import transformers

    from ffn_ext.hf import patch_model

    original = transformers.PreTrainedModel.post_init

    def post_init(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _seen["patched"] += patch_model(self, **options)
        _seen["named"].update(str(w.message) for w in caught if issubclass(w.category, RuntimeWarning))
        return out

    transformers.PreTrainedModel.post_init = post_init


if os.environ.get("FFN_EXT_PATCH") and MODES[os.environ["FFN_EXT_PATCH"]] is not None:
    _install(MODES[os.environ["FFN_EXT_PATCH"]])


def pytest_runtest_logreport(report):
    """Streams one line per test to FFN_EXT_PATCH_LOG (it survives a run stopped by its timeout): node id, outcome,
    modules patched during the test, the classes the patch named."""
    log = os.environ.get("FFN_EXT_PATCH_LOG")
    if not log or hasattr(report, "node"):  # xdist's controller gets its workers' reports again: they log them
        return
    if _seen.get("outcome") != "failed" and (report.failed or report.when == "call" or "outcome" not in _seen):
        _seen["outcome"] = "failed" if report.failed else "skipped" if report.skipped else "passed"  # failed sticks
    if report.failed:
        _seen["why"] = report.longreprtext.strip().splitlines()[-1][:300] if report.longreprtext.strip() else "?"
    if report.when != "teardown":
        return
    named = sorted({m.split("ffn_ext.hf.patch_model: ", 1)[-1][:300] for m in _seen["named"]})
    with open(log, "a") as f:
        f.write(f"{report.nodeid}\t{_seen.pop('outcome', 'failed')}\t{_seen['patched']}\t{' | '.join(named)}")
        f.write(f"\t{_seen.pop('why', '')}\n")
    _seen["patched"], _seen["named"] = 0, set()


# ---- the runner --------------------------------------------------------------------------------------------------
def _results(log: Path) -> dict[str, list[str]]:
    """node id -> [outcome, modules patched, named] from a run's log."""
    lines = log.read_text().splitlines() if log.exists() else []
    return {line.split("\t")[0]: line.split("\t")[1:] for line in lines}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", type=Path)
    ap.add_argument("--families", default=FAMILIES)
    ap.add_argument("--modes", default="off,default,recompute,chunk")
    ap.add_argument("--out", type=Path, default=Path("/tmp/hf_model_tests"))
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per pytest run")
    a, pytest_args = ap.parse_known_args()  # what follows -- goes to pytest
    pytest_args = [x for x in pytest_args if x != "--"]
    import transformers

    a.out.mkdir(parents=True, exist_ok=True)
    modes = a.modes.split(",")
    paths = [str(Path(__file__).resolve().parent), str(a.root / "utils"), os.environ.get("PYTHONPATH", "")]
    fams = a.families.split(",")
    files = [f"tests/models/{fam}/test_modeling_{fam}.py" for fam in fams]
    runs: dict[str, dict[str, list[str]]] = {}
    for mode in modes:  # one pytest run per mode over all the families
        tag = f"{transformers.__version__}-{mode}"
        log = a.out / f"{tag}.log"
        log.unlink(missing_ok=True)
        env = dict(os.environ, FFN_EXT_PATCH=mode, FFN_EXT_PATCH_LOG=str(log), HF_HUB_OFFLINE="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        cmd = [sys.executable, "-m", "pytest", "-p", "hf_model_tests", "-p", "no:cacheprovider", "-q", "-n", "2"]
        with open(a.out / f"{tag}.out", "w") as out:  # pytest's own report, the failures' tracebacks
            try:
                subprocess.run(
                    [*cmd, *files, *pytest_args],
                    cwd=a.root,
                    env=env,
                    timeout=a.timeout,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            except subprocess.TimeoutExpired:
                print(f"{tag}: stopped after {a.timeout} s (the tests it finished count)", flush=True)
        runs[mode] = res = _results(log)
        for fam in fams:
            mine = [v for k, v in res.items() if k.startswith(f"tests/models/{fam}/")]
            counts = {k: sum(v[0] == k for v in mine) for k in ("passed", "failed", "skipped")}
            patched = sum(int(v[1]) for v in mine)
            print(
                f"{tag} {fam}: {counts}, modules patched {patched} in {sum(v[1] != '0' for v in mine)} tests",
                flush=True,
            )
    bad = 0
    base = runs.get(modes[0], {})
    for mode in modes[1:]:
        for name, v in sorted(runs.get(mode, {}).items()):
            if v[0] == "failed" and base.get(name, [""])[0] == "passed":
                bad += 1
                print(f"  PATCHED-ONLY FAILURE [{mode}] {name}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
