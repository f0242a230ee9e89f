"""The recipe "Adding an activation" as a measured fact: a scratch activation added to a copy of the tree by the
recipe alone (its functor in csrc/ffn_math.h and its entry in ffn_ext/table.py, from which the build generates the C++
op table; the entry's `doc` is its documentation), built CPU-only, passes the table-driven tests that pick
it up, with no test file edited. The files and hunks the recipe touched are printed and checked (README "Adding an
activation" quotes them).

Run alone: python -m pytest -q -s tests/test_recipe.py (a CPU build of the copy: minutes on 2 cores).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import HANG_GUARD_S

from ffn_ext import _build

ROOT = Path(__file__).resolve().parents[1]
NAME = "scratch_leaky"  # a made-up activation: leaky ReLU with slope 1/16 (exact in every dtype)

# The recipe, as (file, anchor, text inserted before the anchor). Nothing else is edited.
FUNCTOR = """// scratch_leaky: the recipe check's activation (tests/test_recipe.py), leaky ReLU with slope 1/16
struct ScratchLeaky : ActBase<ScratchLeaky> {
  template <bool Fast, typename A> static FFN_HD A f(A x) { return x < A(0) ? A(0.0625) * x : x; }
  template <bool Fast, typename A> static FFN_HD A df(A x) { return x > A(0) ? A(1) : (x <= A(0) ? A(0.0625) : x); }
};

"""
ENTRY = """    Activation(
        name="scratch_leaky", gated="scratch_leaky_glu",
        aten=lambda x: F.leaky_relu(x, 0.0625),
        aten_backward=lambda g, x: g * torch.where(x > 0, 1.0, torch.where(x <= 0, 0.0625, x)),  # NaN in, NaN out
        formula=lambda x: (torch.where(x < 0, 0.0625 * x, x),
                           torch.where(x > 0, 1.0, torch.where(x <= 0, 0.0625, x))),
        cancel=lambda x: (torch.zeros_like(x), torch.zeros_like(x)),
        limits=(-_INF, _INF, 0.0625, 1.0),
        doc="leaky ReLU with slope 1/16 (the recipe check's scratch activation)"),
"""
RECIPE = [
    ("csrc/ffn_math.h", "// ---- gates:", FUNCTOR),
    ("ffn_ext/table.py", ")\nBY_NAME = ", ENTRY),
]
# The table-driven test files the scratch activation runs through (the CPU ones; -k NAME picks its cases).
TEST_FILES = [
    "test_host_math.py",
    "test_launcher_emulation.py",
    "test_ops.py",
    "test_autograd.py",
    "test_opcheck.py",
    "test_validation.py",
    "test_modules.py",
]


def _git(cwd, *args) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def _copy_tree(dst: Path) -> None:
    files = _git(ROOT, "ls-files", "--cached", "--others", "--exclude-standard").split("\n")
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)


def apply_recipe(tree: Path) -> tuple[list[str], int]:
    """Applies RECIPE to a git tree; returns (the files it changed, the number of diff hunks)."""
    for rel, anchor, text in RECIPE:
        p = tree / rel
        s = p.read_text()
        assert s.count(anchor) == 1, f"{rel}: the recipe's anchor {anchor!r} is not there exactly once"
        p.write_text(s.replace(anchor, text + anchor))
    files = _git(tree, "diff", "--name-only").split()
    hunks = len(re.findall(r"^@@", _git(tree, "diff", "-U0"), re.M))
    return files, hunks


@pytest.mark.slow
def test_scratch_activation_by_the_recipe_alone(tmp_path):
    if not _build.in_checkout() or shutil.which("git") is None:
        pytest.skip("needs the git checkout (the recipe edits a copy of its tree)")
    tree = tmp_path / "tree"
    _copy_tree(tree)
    _git(tree, "init", "-q")
    _git(tree, "add", "-A")
    _git(tree, "-c", "user.name=recipe", "-c", "user.email=recipe@localhost", "commit", "-qm", "base")
    files, hunks = apply_recipe(tree)
    print(f"\nrecipe: {len(files)} files, {hunks} hunks: {files}")
    assert sorted(files) == sorted({rel for rel, _, _ in RECIPE}), files
    assert hunks == len(RECIPE), hunks

    env = dict(os.environ, **{_build.FORCE_CPU_ENV: "1"})
    env.pop("PYTHONPATH", None)
    build = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    # the copy's ffn_ext (python -m puts the working directory first on sys.path), with the scratch entry
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import ffn_ext, torch; from ffn_ext.table import BY_NAME; "
            f"print(ffn_ext.__file__, '{NAME}' in BY_NAME, hasattr(torch.ops.ffn_ext, '{NAME}'))",
        ],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert probe.returncode == 0 and probe.stdout.split()[1:] == ["True", "True"], probe.stdout + probe.stderr
    assert Path(probe.stdout.split()[0]).is_relative_to(tree), probe.stdout
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-k",
            NAME,
            *[f"tests/{f}" for f in TEST_FILES],
        ],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    tail = run.stdout[-4000:] + run.stderr[-2000:]
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    print(f"recipe: the table-driven tests on {NAME}: {summary}")
    assert run.returncode == 0, tail
    passed = int(re.search(r"(\d+) passed", summary).group(1))
    assert passed >= 100 and "failed" not in summary, summary
