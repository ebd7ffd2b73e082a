"""A griffe extension for the API reference: kvlab's docstrings are plain prose with Sphinx cross-reference roles
(``:func:`~kvlab.cache.heap.position_order```), which Markdown would print as they are. Each role is rendered as the
code name it points at: the last component where Sphinx would show it (``~``), else the full dotted name."""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:mod|class|func|meth|data|attr|exc|obj|const|py:\w+):`(~?)([^`]+)`")


def _as_code(match: re.Match[str]) -> str:
    shortened, target = match.group(1), match.group(2)
    return f"`{target.rsplit('.', 1)[-1] if shortened else target}`"


class SphinxRoles(griffe.Extension):
    """Rewrites every Sphinx role in a docstring as a code span before the docstring is parsed."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_as_code, obj.docstring.value)
