"""The frames pages read from a run store, kept per version of the store's files (:mod:`kvlab.dashboard.store_reads`):
the store's own answers, not read again while the store is unchanged, read again after any commit."""

from __future__ import annotations

import pandas as pd
import pytest
from test_ui_tables import add_run

from kvlab.dashboard.store_reads import read_frame, read_shares
from kvlab.runs.tables import run_shares
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
