"""The frames and charts pages read from a run store, kept per version of the store's files
(:mod:`kvlab.dashboard.store_reads`): the store's own answers, not read again while the store is unchanged, read again
after any commit."""

from __future__ import annotations

import pandas as pd
import pytest
from test_ui_tables import add_run

from kvlab.dashboard import store_reads
from kvlab.dashboard.store_figures import axis_frontier_figure
from kvlab.dashboard.store_reads import read_frame, read_frontier, read_shares
from kvlab.runs.tables import frontier_points, run_shares
from kvlab.store import RunFilter, Store, store_version


@pytest.fixture
def counted(monkeypatch) -> dict[str, int]:
    """How often each query reached a store."""
    calls: dict[str, int] = {}
    for name in ("list_runs", "trials_frame"):
        original = getattr(Store, name)

        def counting(self, *args, _name=name, _original=original, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(Store, name, counting)
    return calls


def test_frames_are_the_stores_own_and_read_again_only_after_a_commit(store: Store, counted) -> None:
    add_run(store, "h2o", 0.1, {0.0: [True, False], 1.0: [True]})
    add_run(store, "streaming", 0.1, {0.0: [False], 1.0: [True]})
    only_h2o = RunFilter(policies=("h2o",))
    before = store_version(store.path)
    pd.testing.assert_frame_equal(read_frame(store, "trials_frame", only_h2o), store.trials_frame(only_h2o))
    pd.testing.assert_frame_equal(read_shares(store, only_h2o), run_shares(store.trials_frame(only_h2o)))
    counted.clear()
    assert len(read_frame(store, "list_runs")) == 2
    assert len(read_frame(store, "list_runs")) == 2  # unchanged: kept
    read_shares(store, only_h2o)
    assert counted == {"list_runs": 1}

    add_run(store, "h2o", 0.3, {0.5: [True]})
    assert store_version(store.path) != before
    assert len(read_frame(store, "list_runs")) == 3
    assert len(read_shares(store, only_h2o)) == 2
    assert counted == {"list_runs": 2, "trials_frame": 1}


def test_the_frontier_is_the_stores_own_and_worked_out_again_only_after_a_commit(store: Store, monkeypatch) -> None:
    add_run(store, "h2o", 0.1, {0.0: [True, False], 1.0: [True]})
    add_run(store, "streaming", 0.1, {0.0: [False], 1.0: [True]})
    everything = RunFilter()
    read_frame(store, "list_runs")  # a first read folds the commits' log into the database: the store's next version
    expected = frontier_points(
        store.accuracy_frontier(everything), "kv_bytes", "accuracy", store.trials_frame(everything)
    )
    worked_out: list[str] = []

    def counted_points(*args, **kwargs) -> pd.DataFrame:
        worked_out.append("points")
        return frontier_points(*args, **kwargs)

    monkeypatch.setattr(store_reads, "frontier_points", counted_points)
    points, figure = read_frontier(store, everything, "kv_bytes", "accuracy")
    pd.testing.assert_frame_equal(points, expected)
    assert figure.to_json() == axis_frontier_figure(expected, "kv_bytes", "accuracy").to_json()
    figure.update_layout(title="changed by one caller")
    again, kept = read_frontier(store, everything, "kv_bytes", "accuracy")
    assert worked_out == ["points"]  # unchanged store: kept
    assert kept.layout.title.text is None  # each caller has its own copy
    read_frontier(store, everything, "keep", "accuracy")
    assert worked_out == ["points", "points"]  # another axis: another chart

    add_run(store, "h2o", 0.3, {0.5: [True]})
    points, _ = read_frontier(store, everything, "kv_bytes", "accuracy")
    assert worked_out == ["points"] * 3
    assert len(points) == len(again) + 1
