"""The Claims page's logic: the claims a store holds (or, before its first refresh, evaluated on the spot), shaped
into the table the page shows, filtered and marked by verdict. Pure functions of frames, except
:func:`claims_of`, which reads a store."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from kvlab.claims import VERDICTS, Verdict, evaluate_file, verdict_of
from kvlab.claims.report import records_frame, source_text
from kvlab.claims.verdicts import CONDITIONAL, FAILS, HOLDS, UNMEASURABLE
from kvlab.store import open_store
from kvlab.ui.text import plain

#: A mark before each verdict, so that it reads without colour too.
MARKS: dict[Verdict, str] = {HOLDS: "✔", FAILS: "✘", CONDITIONAL: "◐", UNMEASURABLE: "–"}
#: Streamlit's colour per verdict, for the badge that shows it.
COLOURS: dict[Verdict, str] = {HOLDS: "green", FAILS: "red", CONDITIONAL: "orange", UNMEASURABLE: "gray"}
VIEW_COLUMNS = ["number", "article", "claim", "figure", "reason", "verdict", "source", "command"]


def claims_of(path: Path) -> tuple[pd.DataFrame, bool]:
    """The claims of the store at ``path`` and whether they are the stored ones: the claims table when a refresh
    has filled it, else every claim evaluated now against the store's runs without writing (``False``)."""
    if path.is_file() and path.stat().st_size > 0:
        stored = open_store(path, read_only=True).claims_frame()
        if not stored.empty:
            return stored, True
    return records_frame(evaluate_file(path)), False


def verdict_counts(claims: pd.DataFrame) -> dict[Verdict, int]:
    """How many claims have each verdict, in the order of :data:`~kvlab.claims.VERDICTS`."""
    found = claims["verdict"].map(verdict_of).value_counts()
    return {verdict: int(found.get(verdict, 0)) for verdict in VERDICTS}


def claims_view(claims: pd.DataFrame, verdicts: Iterable[str] = (), articles: Iterable[str] = ()) -> pd.DataFrame:
    """The rows the page shows, for the chosen verdicts and articles (all when none is chosen): kvlab's figure
    and the reason it has none or only part of one (a row with neither is not shown), the verdict, where the figure
    came from and the command that reproduces it."""
    verdicts, articles = set(verdicts), set(articles)
    rows = claims[(claims["figure"].fillna("") != "") | (claims["reason"].fillna("") != "")]
    kinds = rows["verdict"].map(verdict_of)
    rows = rows[kinds.isin(verdicts or VERDICTS) & (rows["article"].isin(articles) if articles else True)]
    return pd.DataFrame(
        {
            "number": rows["claim_id"],
            "article": rows["article"],
            "claim": rows["claim"],
            "figure": [_text(figure) for figure in rows["figure"]],
            "reason": [_text(reason) for reason in rows["reason"]],
            "verdict": rows["verdict"],
            "source": [_source(_text(m), _text(d)) for m, d in zip(rows["model"], rows["device"])],
            "command": rows["command"],
        },
        columns=VIEW_COLUMNS,
        dtype=object,  # a missing figure or reason stays None, not a NaN that reads as text
    ).reset_index(drop=True)


def _source(model: str | None, device: str | None) -> str | None:
    """Where a figure came from, or None when nothing is said."""
    return source_text(model, device) if model or device else None


def _text(value: object) -> str | None:
    """A stored text cell, or None for NULL."""
    return None if value is None or (isinstance(value, float) and pd.isna(value)) else str(value)


def verdict_badge(verdict: str) -> str:
    """A verdict as a coloured, marked Markdown badge, its condition shown as the plain text it is."""
    kind = verdict_of(verdict)
    return f":{COLOURS[kind]}-background[{MARKS[kind]} {plain(verdict)}]"
