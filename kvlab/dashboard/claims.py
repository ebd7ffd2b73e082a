"""The Claims page's logic: the claims a store holds (or, before its first refresh, evaluated on the spot), shaped
into the table the page shows, filtered and marked by verdict. Pure functions of frames, except
:func:`claims_of` and :func:`needle_evidence`, which read a store the page opened."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from kvlab.claims import CLAIM_CONTEXT, VERDICTS, Evidence, Verdict, evaluate_all, side_by_side, verdict_of
from kvlab.claims.report import records_frame, source_text
from kvlab.claims.verdicts import CONDITIONAL, FAILS, HOLDS, UNMEASURABLE
from kvlab.dashboard.text import plain
from kvlab.runs.tables import choices, frontier_points
from kvlab.store import RunFilter, Store

#: A mark before each verdict, so that it reads without colour too.
MARKS: dict[Verdict, str] = {HOLDS: "✔", FAILS: "✘", CONDITIONAL: "◐", UNMEASURABLE: "–"}
#: Streamlit's colour per verdict, for the badge that shows it.
COLOURS: dict[Verdict, str] = {HOLDS: "green", FAILS: "red", CONDITIONAL: "orange", UNMEASURABLE: "gray"}
VIEW_COLUMNS = ["number", "article", "claim", "figure", "reason", "verdict", "source", "command"]


def claims_of(store: Store | None, path: Path) -> tuple[pd.DataFrame, bool]:
    """The claims of ``store`` (the one at ``path``, None when there is none yet) and whether they are the stored
    ones: the claims table when a refresh has filled it, else every claim evaluated now against the store's runs
    without writing (``False``)."""
    if store is not None:
        stored = store.claims_frame()
        if not stored.empty:
            return stored, True
    return records_frame(evaluate_all(Evidence(store, path))), False


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


@dataclass(frozen=True)
class NeedleEvidence:
    """A store's needle evidence at the claim's context length, per model: the accuracy frontier's points against
    the kept fraction (:func:`~kvlab.runs.tables.frontier_points`) and the published claim beside kvlab's cells
    (:func:`~kvlab.claims.side_by_side`); and the devices its needle runs were measured on."""

    devices: list[str]
    frontiers: dict[str, pd.DataFrame]
    claims: dict[str, pd.DataFrame]

    @property
    def models(self) -> list[str]:
        """The models with needle runs, sorted."""
        return list(self.frontiers)


def needle_evidence(store: Store) -> NeedleEvidence:
    """Read a store's needle evidence once, for every model (the Overview shows one at a time, and scrubbing its
    replay must not read the store again)."""
    runs = store.list_runs(RunFilter(tasks=("needle",)))
    frontiers, claims = {}, {}
    for model in choices(runs, "model"):
        filters = RunFilter(models=(model,), tasks=("needle",), context_lengths=(CLAIM_CONTEXT,))
        trials = store.trials_frame(filters)
        frontiers[model] = frontier_points(store.accuracy_frontier(filters), "keep", "accuracy", trials)
        claims[model] = side_by_side(trials, CLAIM_CONTEXT)
    return NeedleEvidence(sorted(runs["device"].dropna().unique()), frontiers, claims)
