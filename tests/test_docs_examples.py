"""Every ```python block of README.md and docs/**/*.md runs here, on CPU: an example that stops working fails CI.

One test per page: its blocks run in order in one namespace (a page builds on its earlier blocks, as a reader
does), each compiled under its own file name and line, so a traceback points at the page and line. A block that
cannot run on CPU is preceded by an HTML comment `<!-- no-test: the reason -->`: it is compiled (a syntax error
still fails) but not run, and the reason must be given. The examples use tiny shapes; together they take a few
seconds. Also here: every name of ffn_ext.__all__ has an entry in the API reference (docs/reference/*.md).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
from conftest import SOURCE_TREE, needs_source_tree

import ffn_ext

_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.S | re.M)
_NO_TEST = re.compile(r"<!--\s*no-test:\s*(?P<reason>[^>]*?)\s*-->\s*$")


def _pages() -> list[Path]:
    if SOURCE_TREE is None:
        return []
    return [SOURCE_TREE / "README.md", *sorted((SOURCE_TREE / "docs").rglob("*.md"))]


def python_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """(line of the block's first code line, code, the no-test reason or None) for each ```python block."""
    blocks = []
    for m in _FENCE.finditer(text):
        if m.group("info").strip().split(" ")[0] not in ("python", "py"):
            continue
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = _NO_TEST.search(before)
        line = text.count("\n", 0, m.start("body")) + 1
        body = m.group("body")
        if m.group("indent"):
            body = "\n".join(s[len(m.group("indent")) :] for s in body.split("\n"))
        blocks.append((line, body, skip.group("reason") if skip else None))
    return blocks


_WITH_EXAMPLES = [p for p in _pages() if python_blocks(p.read_text())]


@pytest.mark.parametrize("page", _WITH_EXAMPLES, ids=[str(p.relative_to(SOURCE_TREE)) for p in _WITH_EXAMPLES])
def test_page_examples_run(page: Path):
    blocks = python_blocks(page.read_text())
    namespace: dict = {"__name__": "__docs_example__"}
    torch.manual_seed(0)
    for line, code, skip in blocks:
        compiled = compile("\n" * (line - 1) + code, str(page), "exec")  # tracebacks give the page's lines
        if skip is not None:
            assert skip, f"{page}:{line}: a no-test block must say why"
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the examples' own warnings (HF, distributed) are not what is tested
            exec(compiled, namespace)


def test_no_test_blocks_are_few_and_say_why():
    """The blocks that do not run are listed with their reasons (so the count is a fact one can read), and a
    reason is always there."""
    root = needs_source_tree("the docs")
    skipped = [
        (p.name, line, reason)
        for p in _pages()
        for line, _, reason in python_blocks(p.read_text())
        if reason is not None
    ]
    ran = sum(reason is None for p in _pages() for _, _, reason in python_blocks(p.read_text()))
    assert all(reason for _, _, reason in skipped), skipped
    assert ran >= 15, f"only {ran} examples run"
    readme = python_blocks((root / "README.md").read_text())
    assert readme and all(reason is None for _, _, reason in readme), "the README's tour must run"
    assert len(skipped) <= 5, f"too many examples do not run on CPU: {skipped}"


def test_collector_finds_blocks_and_reasons():
    """The collector itself: a marked block is skipped with its reason, an unmarked one runs, other languages are
    not collected, and an indented fence (in a list) is dedented."""
    text = (
        "x\n```python\na = 1\n```\n<!-- no-test: needs a GPU -->\n```python\nb = 2\n```\n```bash\nls\n```\n"
        "- item\n\n  ```python\n  c = 3\n  ```\n"
    )
    assert python_blocks(text) == [(3, "a = 1\n", None), (7, "b = 2\n", "needs a GPU"), (15, "c = 3\n", None)]


def test_every_public_name_is_in_the_api_reference():
    """A reader goes from a name of ffn_ext.__all__ to its reference page: each name is rendered by a `:::` entry
    of docs/reference/ (the object itself, or the module that holds it, with it among its members)."""
    root = needs_source_tree("the docs")
    ref = "\n".join(p.read_text() for p in sorted((root / "docs" / "reference").glob("*.md")))
    entries = set(re.findall(r"^::: ([\w.]+)", ref, re.M))
    members = set(re.findall(r"members: \[([^\]]*)\]", ref))
    listed = {m.strip() for group in members for m in group.split(",")}
    missing = []
    for name in ffn_ext.__all__:
        obj = getattr(ffn_ext, name)
        if isinstance(obj, type(ffn_ext)):  # a submodule: its page renders it
            ok = obj.__name__ in entries
        else:
            where = f"{obj.__module__}.{getattr(obj, '__name__', name)}"
            ok = where in entries or (obj.__module__ in entries and getattr(obj, "__name__", name) in listed)
        if not ok:
            missing.append(name)
    assert not missing, f"public names without an API reference entry in docs/reference/: {missing}"


def test_readme_links_point_at_files_that_exist():
    """README.md is not a page of the site, so mkdocs does not check its links: every relative link must name a
    file or folder of the checkout (and a docs page's anchor must be one of its headings)."""
    root = needs_source_tree("the README")
    text = (root / "README.md").read_text()
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue
        path, _, anchor = target.partition("#")
        if not (root / path).exists():
            missing.append(target)
        elif anchor and path.endswith(".md"):
            headings = re.findall(r"^#+ (.+)$", (root / path).read_text(), re.M)
            slugs = {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}
            if anchor not in slugs:
                missing.append(target)
    assert not missing, f"README.md links to what does not exist: {missing}"
