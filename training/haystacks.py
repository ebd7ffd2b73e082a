"""The held-out haystacks: English prose from the Python documentation in the standard library's ``pydoc_data``.

``pydoc_data/topics.py`` holds the text of the language reference topics that ``help()`` shows. The corpus builder
excludes that package, so the model never trains on it. This module keeps the prose paragraphs (no tables, headings
or indented code), joins each paragraph's wrapped lines into one line (one space between sentences), and writes the
topics, in their order, into a few files of about equal size.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from kvlab.tasks.needle import HAYSTACK_DIR

FILES = 4
_RULE = re.compile(r"^[=*\-~^+|]{3,}")


def _prose(paragraph: str) -> str | None:
    lines = paragraph.splitlines()
    if not lines or any(_RULE.match(line.strip()) or line.lstrip().startswith(("|", "+", ">>>")) for line in lines):
        return None
    if lines[0].startswith((" ", "\t")) or not re.search(r"[.!?]$", lines[-1].strip()):
        return None
    return re.sub(r" {2,}", " ", " ".join(line.strip() for line in lines))


def prose_paragraphs(topics: dict[str, str]) -> list[str]:
    """The prose paragraphs of every topic, in the topics' order."""
    out: list[str] = []
    for text in topics.values():
        out.extend(p for p in (_prose(block) for block in re.split(r"\n\s*\n", text)) if p)
    return out


def write_haystacks(directory: Path = HAYSTACK_DIR, files: int = FILES) -> list[Path]:
    """Write ``python-docs-<i>.txt`` files of about equal size from this interpreter's ``pydoc_data``."""
    from pydoc_data.topics import topics

    paragraphs = prose_paragraphs(topics)
    target = sum(len(p) for p in paragraphs) / files
    groups: list[list[str]] = [[]]
    for paragraph in paragraphs:
        if sum(len(p) for p in groups[-1]) >= target and len(groups) < files:
            groups.append([])
        groups[-1].append(paragraph)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for i, group in enumerate(groups, start=1):
        path = directory / f"python-docs-{i}.txt"
        path.write_text("\n\n".join(group) + "\n", encoding="utf-8")
        written.append(path)
    print(f"wrote {len(written)} haystack files from pydoc_data of Python {sys.version.split()[0]}")
    return written
