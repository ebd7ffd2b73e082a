"""Text a user typed, or that names something a user chose, shown as plain text inside Streamlit's Markdown.

Streamlit renders the body of ``st.error``, ``st.caption``, ``st.markdown``, table cells and most labels as Markdown,
so a question or answer holding ``![x](https://host/p.png)`` would make every browser that shows it fetch that
address, and ``**`` or ``#`` would restyle the page. Every ASCII punctuation character is backslash-escaped, which
CommonMark renders as the character itself, so the text reads exactly as typed and nothing in it is markup. Bare
addresses (``https://…``, ``www.…``, ``name@host``) are turned into links by GitHub-flavoured Markdown after escapes
are read, so an invisible word joiner (U+2060) is put where that recognition starts (after ``:`` before ``//``,
after ``www`` before ``.``, after ``@``): the text looks the same and is not a link.
"""

from __future__ import annotations

import re

import pandas as pd

_PUNCTUATION = re.compile(r"([!-/:-@\[-`{-~])")
_AUTOLINK_STARTS = re.compile(r"(?<=:)(?=//)|(?<=www)(?=\.)|(?<=@)", re.IGNORECASE)
WORD_JOINER = "\u2060"


def plain(text: object) -> str:
    """``text`` escaped so that Markdown shows it literally, and no address in it becomes a link."""
    return _PUNCTUATION.sub(r"\\\1", _AUTOLINK_STARTS.sub(WORD_JOINER, str(text)))


def plain_frame(frame: pd.DataFrame) -> pd.DataFrame:
    """A table for ``st.table`` (which renders cells as Markdown) with every text cell, label and header escaped."""
    escaped = frame.map(lambda value: plain(value) if isinstance(value, str) else value)
    escaped.index = [plain(label) if isinstance(label, str) else label for label in escaped.index]
    escaped.columns = [plain(label) if isinstance(label, str) else label for label in escaped.columns]
    return escaped
