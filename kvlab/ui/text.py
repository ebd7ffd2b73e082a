"""Text a user typed, or that names something a user chose, shown as plain text inside Streamlit's Markdown.

Streamlit renders the body of ``st.error``, ``st.caption``, ``st.markdown``, table cells and most labels as Markdown,
so a question or answer holding ``![x](https://host/p.png)`` would make every browser that shows it fetch that
address, and ``**`` or ``#`` would restyle the page. Every ASCII punctuation character is backslash-escaped, which
CommonMark renders as the character itself, so the text reads exactly as typed and nothing in it is markup.
"""

from __future__ import annotations

import re

import pandas as pd

_PUNCTUATION = re.compile(r"([!-/:-@\[-`{-~])")


def plain(text: object) -> str:
    """``text`` escaped so that Markdown shows it literally."""
    return _PUNCTUATION.sub(r"\\\1", str(text))


def plain_frame(frame: pd.DataFrame) -> pd.DataFrame:
    """A table for ``st.table`` (which renders cells as Markdown) with every text cell, label and header escaped."""
    escaped = frame.map(lambda value: plain(value) if isinstance(value, str) else value)
    escaped.index = [plain(label) if isinstance(label, str) else label for label in escaped.index]
    escaped.columns = [plain(label) if isinstance(label, str) else label for label in escaped.columns]
    return escaped
