"""mkdocs hook: links from the pages to the code.

A page links to a file of the repository relatively, as a code host shows it: `[ops.py](../ffn_ext/ops.py)` from
docs/ops.md. mkdocs would report such a link as a missing page (the file is not under docs/), so this hook takes
every link whose target lies outside docs/ and inside the repository, fails the build if the file or folder does
not exist, and points it at `extra.code_url` + path when that is set, else at the file in the checkout, relative to
the built page (site/ sits in the checkout: a locally built site opens the source next to it).
"""

from __future__ import annotations

import os
import re

from mkdocs.exceptions import PluginError

_LINK = re.compile(r"(\]\()([^)\s]+)(\))")
_SCHEME = "ffn-ext-code:"


def _repo_target(page_src: str, docs_dir: str, root: str, target: str) -> str | None:
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
        return None
    path, _, anchor = target.partition("#")
    full = os.path.normpath(os.path.join(os.path.dirname(page_src), path))
    if not full.startswith(root + os.sep):
        return None
    if full.startswith(docs_dir + os.sep) and not full.endswith(".py"):  # a page or an image of the site
        return None
    rel = os.path.relpath(full, root)
    if not os.path.exists(full):
        raise PluginError(f"{os.path.relpath(page_src, root)}: link to {target!r}: {rel} does not exist")
    return rel.replace(os.sep, "/") + ("#" + anchor if anchor else "")


def on_page_markdown(markdown, page, config, files):
    docs_dir = os.path.abspath(config["docs_dir"])
    root = os.path.dirname(os.path.abspath(config["config_file_path"]))

    def sub(m):
        rel = _repo_target(page.file.abs_src_path, docs_dir, root, m.group(2))
        return m.group(0) if rel is None else f"{m.group(1)}{_SCHEME}{rel}{m.group(3)}"

    # fenced code is left alone: a `](...)` there is code, not a link
    parts = re.split(r"(^```.*?^```)", markdown, flags=re.S | re.M)
    return "".join(p if p.startswith("```") else _LINK.sub(sub, p) for p in parts)


def on_page_content(html, page, config, files):
    root = os.path.dirname(os.path.abspath(config["config_file_path"]))
    base = (config["extra"].get("code_url") or "").rstrip("/")
    here = os.path.dirname(page.file.abs_dest_path)

    def sub(m):
        rel = m.group(1)
        if base:
            return f'href="{base}/{rel}"'
        path, _, anchor = rel.partition("#")
        url = os.path.relpath(os.path.join(root, path), here).replace(os.sep, "/")
        return f'href="{url}' + ("#" + anchor if anchor else "") + '"'

    def src(m):  # an image (a benchmark plot): the file in the checkout, or the code host's raw file
        rel = m.group(1)
        if base:
            return f'src="{base}/{rel}?raw=true"'
        return 'src="' + os.path.relpath(os.path.join(root, rel), here).replace(os.sep, "/") + '"'

    html = re.sub(r'src="' + re.escape(_SCHEME) + r'([^"]*)"', src, html)
    return re.sub(r'href="' + re.escape(_SCHEME) + r'([^"]*)"', sub, html)
