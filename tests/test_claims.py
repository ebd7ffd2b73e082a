"""The published needle claim is shown only beside kvlab's own measurement of the same cells."""

from __future__ import annotations

import pandas as pd
import pytest

from kvlab.claims import PUBLISHED_NEEDLE_CLAIM, measured_table, published_table, side_by_side


def trials() -> pd.DataFrame:
    rows = []
    for keep, correct in ((0.9, [1, 1, 1, 0]), (0.1, [0, 0, 0, 1])):
        rows += [
            {"context_length": 4096, "keep": keep, "policy": "h2o", "mode": "streaming", "correct": bool(c)}
            for c in correct
        ]
    rows += [{"context_length": 4096, "keep": None, "policy": "full", "mode": "prefill", "correct": True}] * 2
    rows += [{"context_length": 2048, "keep": 0.9, "policy": "h2o", "mode": "streaming", "correct": False}] * 3
    return pd.DataFrame(rows)


def test_the_article_table_is_as_published():
    table = published_table()
    assert list(table.columns) == ["10% pruned", "30% pruned", "50% pruned", "70% pruned", "90% pruned"]
    assert table.loc["streaming (article)", "90% pruned"] == 14.0 and table.loc["random (article)", "90% pruned"] == 5.0
    assert set(PUBLISHED_NEEDLE_CLAIM["h2o"]) == {100.0}


def test_measurement_is_accuracy_by_pruning_at_the_claims_context():
    measured = measured_table(trials())
    assert measured.loc["h2o streaming (kvlab)", "10% pruned"] == pytest.approx(75.0)
    assert measured.loc["h2o streaming (kvlab)", "90% pruned"] == pytest.approx(25.0)
    assert measured.loc["h2o streaming (kvlab)", "trials per cell"] == 4


def test_side_by_side_keeps_both_and_the_full_cache_ceiling():
    table = side_by_side(trials())
    assert list(table.index[:2]) == ["h2o (article)", "h2o streaming (kvlab)"]
    assert table.loc["h2o (article)", "90% pruned"] == 100.0
    assert table.loc["h2o streaming (kvlab)", "90% pruned"] == pytest.approx(25.0)
    assert pd.isna(table.loc["h2o streaming (kvlab)", "50% pruned"])
    assert (table.loc["full cache (kvlab)", ["10% pruned", "90% pruned"]] == 100.0).all()
