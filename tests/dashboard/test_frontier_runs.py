"""The Frontier and Runs pages, driven through Streamlit's AppTest on a store of known runs: downloads hold what
the filters show, byte axes and tables read in binary units, coinciding points stay visible, the article's rows
never stand alone, and both pages offer their comparison as an HTML report."""

from __future__ import annotations

import base64
import io
from collections.abc import Callable

import numpy as np
import pandas as pd
import pytest
from drawn_charts import drawn_charts
from streamlit.runtime.media_file_manager import MediaFileManager
from streamlit.testing.v1 import AppTest
from test_pages import open_page
from test_ui_tables import add_run

from kvlab.store import open_store

pytestmark = pytest.mark.model


@pytest.fixture
def seeded(db):
    """Six needle runs at 4,096 tokens (the full cache, H2O and StreamingLLM at two budgets, the two policies at
    one budget holding the same bytes) and one H2O run at 1,024 tokens; no random eviction."""
    store = open_store(db)
    add_run(store, "full", None, {0.0: [True], 0.5: [True], 1.0: [True]}, context=4096, kv_bytes=8 << 20)
    for keep, ok in ((0.1, [True, False]), (0.3, [True, True])):
        add_run(store, "h2o", keep, {0.0: ok, 1.0: ok}, context=4096, kv_bytes=int((8 << 20) * keep))
        add_run(store, "streaming", keep, {0.0: [False], 1.0: ok}, context=4096, kv_bytes=int((8 << 20) * keep))
    add_run(store, "h2o", 0.1, {0.5: [True]}, context=1024, kv_bytes=200 << 10)
    store.close()
    return db


@pytest.fixture
def downloads(monkeypatch) -> dict[str, Callable[[], bytes]]:
    """What each download button of the last page run would serve, by file name: the deferred data callables
    Streamlit registers (a click in a browser calls them)."""
    recorded: dict[str, Callable[[], bytes]] = {}
    original = MediaFileManager.add_deferred

    def recording(self, data_callable, mimetype, coordinates, file_name=None, **kwargs):
        recorded[str(file_name)] = data_callable
        return original(self, data_callable, mimetype, coordinates, file_name, **kwargs)

    monkeypatch.setattr(MediaFileManager, "add_deferred", recording)
    return recorded


def rerun(app: AppTest) -> AppTest:
    app.run()
    assert not app.exception, app.exception
    return app


def widget(elements, label: str):
    return next(element for element in elements if element.label == label)


def figures(app: AppTest) -> list[dict]:
    return [chart.figure for chart in drawn_charts(app)]


def values(array: object) -> list:
    """A figure's array as a list: plotly writes numeric arrays as base64 typed arrays."""
    if isinstance(array, dict) and "bdata" in array:
        return np.frombuffer(base64.b64decode(array["bdata"]), dtype=array["dtype"]).tolist()
    assert isinstance(array, list)
    return array


# --- Runs ---------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_runs_downloads_hold_the_filtered_runs_whatever_is_compared(seeded, downloads):
    app = open_page("views/runs.py")
    widget(app.multiselect, "Policy").set_value(["h2o"])
    widget(app.multiselect, "Runs to compare").set_value([4])
    downloads.clear()
    rerun(app)
    shown = app.dataframe[0].value
    runs = pd.read_csv(io.BytesIO(downloads["kvlab-runs.csv"]()))
    assert len(runs) == len(shown) == 3 and sorted(runs["run_id"]) == sorted(shown["run"])
    assert len(pd.read_parquet(io.BytesIO(downloads["kvlab-runs.parquet"]()))) == len(shown)
    trials = pd.read_csv(io.BytesIO(downloads["kvlab-trials.csv"]()))
    assert len(trials) == shown["trials"].sum() and set(trials["run_id"]) == set(shown["run"])
    caption = next(caption.value for caption in app.caption if "whatever is picked" in caption.value)
    assert f"({len(shown)}," in caption and f"{shown['trials'].sum()} trials" in caption


def test_runs_comparison_charts_and_report(seeded, downloads):
    app = open_page("views/runs.py")
    assert widget(app.multiselect, "Runs to compare").value == [5, 6]
    quality, memory = figures(app)
    accuracy = open_store(seeded, read_only=True).list_runs().set_index("run_id")["accuracy"]
    assert values(quality["data"][0]["y"]) == pytest.approx([100 * accuracy[5], 100 * accuracy[6]])
    assert quality["data"][0]["error_y"]["visible"]  # a Wilson interval: 1 of 1 is not a certainty
    assert {"0 MiB", "1 MiB", "4 MiB"} <= set(memory["layout"]["yaxis"]["ticktext"])  # peaks of 400 KiB, 4.8 MiB
    document = downloads["kvlab-runs-5-6.html"]().decode()
    assert "run 5" in document and "run 6" in document and "<script src=" not in document


# --- Frontier -----------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_frontier_in_binary_units_with_every_policy_visible(seeded):
    app = open_page("views/frontier.py")
    widget(app.selectbox, "Memory axis").set_value("kv_bytes")
    rerun(app)
    figure = figures(app)[0]
    assert figure["layout"]["xaxis"]["type"] == "log"
    assert {"512 KiB", "1 MiB", "8 MiB"} <= set(figure["layout"]["xaxis"]["ticktext"])
    lines = [trace for trace in figure["data"] if trace["meta"] != "Pareto front"]
    drawn = {(trace["line"]["color"], trace["marker"]["symbol"], trace["line"]["dash"]) for trace in lines}
    assert len(drawn) == len(lines) == 3
    assert all(trace["marker"]["opacity"] < 1 for trace in lines)
    h2o, streaming = (next(t for t in lines if t["meta"] == name) for name in ("h2o · prefill", "streaming · prefill"))
    assert values(h2o["x"])[0] != values(streaming["x"])[0]  # same budget (819.2 KiB), drawn side by side
    hover = h2o["customdata"][0][1]
    assert hover.startswith("At 819 KiB") and "h2o · prefill" in hover and "streaming · prefill" in hover
    table = app.dataframe[0].value
    assert set(table["KV bytes held at the end (measured)"]) == {"819 KiB", "2.40 MiB", "8.00 MiB"}


@pytest.mark.slow
def test_the_article_rows_appear_only_beside_kvlab_rows_and_the_report_is_offered(seeded, downloads):
    app = open_page("views/frontier.py")
    claim = next(frame.value for frame in app.dataframe if "90% pruned" in frame.value.columns)
    rows = list(claim.index)
    for policy in ("h2o", "streaming"):
        assert rows[rows.index(f"{policy} (article)") + 1] == f"{policy} prefill (kvlab)"
    assert "random (article)" not in rows
    cells = claim.to_numpy().astype(str)
    assert "—" in cells and not ({"None", "nan"} & set(cells.ravel()))  # nothing measured reads as a dash
    assert any("for random" in caption.value for caption in app.caption)
    widget(app.selectbox, "Context length of kvlab's rows").set_value(1024)
    rerun(app)
    claim = next(frame.value for frame in app.dataframe if "90% pruned" in frame.value.columns)
    assert list(claim.index) == ["h2o (article)", "h2o prefill (kvlab)"]  # the one policy measured at 1,024
    assert any("for streaming, random" in caption.value for caption in app.caption)
    document = downloads["kvlab-frontier.html"]().decode()
    assert "Selection A: kvlab-tiny-llama" in document and "<script src=" not in document
