"""griffe extension for the API reference: ffn_ext's docstrings are plain text with code in backticks, where `*`
is multiplication (`silu(gate) * up`, `2*d_ff`), not Markdown emphasis. Escape the stars outside code spans so
mkdocstrings renders them as written."""

from __future__ import annotations

import re

import griffe

_CODE = re.compile(r"(`+)(.+?)\1", re.S)


def _escape(text: str) -> str:
    out, last = [], 0
    for m in _CODE.finditer(text):
        out.append(text[last : m.start()].replace("*", r"\*"))
        out.append(m.group(0))
        last = m.end()
    out.append(text[last:].replace("*", r"\*"))
    return "".join(out)


class PlainDocstrings(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _escape(obj.docstring.value)
