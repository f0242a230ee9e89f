"""The package's layers depend one way (table -> ops -> mlp -> modules -> distributed / hf -> __main__): every ffn_ext
module imports alone in a fresh interpreter, and no import cycle exists among ffn_ext's modules, counting imports
inside functions (read from the sources with ast, so a cycle is found even where it happens not to break an import
order). Generic over whatever modules and subpackages ffn_ext has."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import package_env

import ffn_ext

PACKAGE = Path(ffn_ext.__file__).resolve().parent


def _modules() -> dict:
    """Dotted module name -> source path, for every .py under the package (a package is its __init__)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if "__pycache__" in parts or any(p.startswith(".") for p in parts):
            continue
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _resolve(name: str, path: Path, node) -> list:
    """The ffn_ext modules an import statement of module `name` (at `path`) names."""
    if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
    else:
        if node.level:
            base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
            base = base[: len(base) - node.level + 1]
            mod = ".".join(base + ([node.module] if node.module else []))
        else:
            mod = node.module or ""
        # `from pkg import sub` imports the submodule when there is one, else a name from pkg's __init__
        targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else mod for a in node.names]
    found = []
    for t in targets:
        while t and t not in MODULES:  # `import ffn_ext.x.y` runs ffn_ext.x.y; an attribute resolves to its module
            t = t.rpartition(".")[0]
        if t and t != name:
            found.append(t)
    return found


def _graph() -> dict:
    graph = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        deps = set()
        for node in ast.walk(tree):  # every import, module-level or inside a function
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                deps.update(_resolve(name, path, node))
        graph[name] = deps
    return graph


def _cycles(graph: dict) -> list:
    """Every strongly connected component with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def _parents(name: str) -> set:
    """A module's packages (ffn_ext, ffn_ext.hf, ...): importing it runs their __init__ first, which is not a
    dependency of the module's own code."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def test_no_import_cycle_among_the_packages_modules():
    graph = {n: {d for d in deps if d not in _parents(n)} for n, deps in _graph().items()}
    assert "ffn_ext.ops" in graph and "ffn_ext.table" in graph  # the walk found the package
    assert _cycles(graph) == []


def test_the_cycle_check_finds_a_cycle():
    """The check itself can fail: the layers as they were (ops -> distributed -> mlp -> ops) are a cycle."""
    graph = {
        "ops": {"distributed"},
        "distributed": {"mlp", "modules"},
        "mlp": {"ops", "distributed"},
        "modules": {"ops"},
        "table": set(),
    }
    assert _cycles(graph) == [["distributed", "mlp", "modules", "ops"]]


def test_function_level_imports_are_read():
    src = "def f():\n    from . import distributed\n"
    tree = ast.parse(src)
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom))
    assert _resolve("ffn_ext.ops", PACKAGE / "ops.py", node) == ["ffn_ext.distributed"]


@pytest.mark.slow
def test_each_module_imports_alone_in_a_fresh_interpreter():
    names = [n for n in MODULES if n.rpartition(".")[2] != "__main__"]  # importing __main__ runs the main job
    failures = []
    for n in names:
        r = subprocess.run(
            [sys.executable, "-c", f"import importlib; importlib.import_module({n!r})"],
            capture_output=True,
            text=True,
            env=package_env(),
            cwd=str(PACKAGE.parent.parent),
        )
        if r.returncode != 0:
            failures.append(f"{n}: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")
    assert failures == []


def test_a_checkout_without_C_names_the_install_it_shadows(tmp_path, monkeypatch):
    """Python run in a checkout imports the checkout's ffn_ext, whose _C may not be built, even after `pip install .`
    put a built one in site-packages: the fallback's reason says so and names the installed one."""
    from ffn_ext import _loader

    installed = tmp_path / "site-packages" / "ffn_ext"
    installed.mkdir(parents=True)
    (installed / "__init__.py").write_text("")

    class Dist:
        @staticmethod
        def locate_file(rel):
            return tmp_path / "site-packages" / rel

    monkeypatch.setattr(_loader.importlib.metadata, "distribution", lambda name: Dist)
    monkeypatch.setattr(_loader, "_built_C", lambda: [])
    with pytest.raises(ImportError) as e:
        _loader.check_installed_C()
    assert "ffn_ext._C is not built" in str(e.value) and str(installed) in str(e.value), str(e.value)
    monkeypatch.setattr(_loader._build, "PACKAGE", installed)  # the installed one itself: nothing else to name
    with pytest.raises(ImportError) as e:
        _loader.check_installed_C()
    assert "source tree" not in str(e.value), str(e.value)
