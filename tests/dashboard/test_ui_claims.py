"""The Claims page's shapers: claims read from a store or evaluated on the spot, filtered, never a row without a
figure or a reason, and verdicts marked."""

from __future__ import annotations

import pandas as pd

from kvlab.claims import CATALOGUE, VERDICTS, refresh
from kvlab.claims.report import COLUMNS
from kvlab.claims.verdicts import CONDITIONAL, FAILS, HOLDS, UNMEASURABLE
from kvlab.dashboard.claims import MARKS, claims_of, claims_view, verdict_badge, verdict_counts
from kvlab.store import open_store


def test_claims_are_evaluated_on_the_spot_until_a_refresh_stores_them(tmp_path):
    path = tmp_path / "runs.duckdb"
    evaluated, stored = claims_of(None, path)
    assert not stored and len(evaluated) == len(CATALOGUE) and not path.exists()  # reading never creates a store
    store = open_store(path)
    refresh(store)
    kept, stored = claims_of(open_store(path, read_only=True), path)
    assert stored and kept["claim_id"].tolist() == evaluated["claim_id"].tolist()
    store.close()


def test_the_view_filters_and_never_shows_a_row_without_a_figure_or_a_reason(tmp_path):
    claims, _ = claims_of(None, tmp_path / "none.duckdb")
    broken = pd.DataFrame([dict.fromkeys(COLUMNS) | {"claim_id": "99", "article": "x", "verdict": HOLDS}])
    view = claims_view(pd.concat([claims, broken], ignore_index=True))
    assert len(view) == len(CATALOGUE)  # the row with neither is left out
    assert (view["figure"].notna() | view["reason"].notna()).all()
    assert not view.isin(["nan", "None"]).any().any()
    failing = claims_view(claims, verdicts=[FAILS])
    assert len(failing) == verdict_counts(claims)[FAILS] > 0 and set(failing["verdict"]) == {FAILS}
    article = claims["article"].iloc[-1]
    assert set(claims_view(claims, articles=[article])["article"]) == {article}
    assert sum(verdict_counts(claims).values()) == len(claims)


def test_verdicts_are_marked_and_coloured():
    assert verdict_badge(HOLDS) == f":green-background[{MARKS[HOLDS]} holds]"
    assert verdict_badge(f"{CONDITIONAL}: in [prefill] mode").startswith(":orange-background[◐ holds only")
    assert "\\[prefill\\]" in verdict_badge(f"{CONDITIONAL}: in [prefill] mode")  # a condition is plain text
    assert set(MARKS) == set(VERDICTS) and MARKS[UNMEASURABLE] != MARKS[FAILS]
