"""The needle grid page: its depth control, its estimate before Run grid, a heatmap that fills in while a sweep runs,
columns at the depths asked for, and panel titles that fit (AppTest with the shipped model on the CPU)."""

from __future__ import annotations

import threading

import pandas as pd
import pytest
from drawn_charts import drawn_charts
from streamlit.testing.v1 import AppTest
from test_pages import open_page, shown, sweep_job, widget

from kvlab.dashboard.grid import NeedleGridRequest, depth_label, evenly_spaced_depths
from kvlab.dashboard.grid_figures import depth_accuracy, needle_grid, needle_heatmaps, panel_title
from kvlab.dashboard.sweep_jobs import SWEEP_JOBS
from kvlab.runs.device_queue import DEVICE_QUEUE
from kvlab.runs.sweep import SweepRunner

DEPTHS = "Needle depths (how many)"


def grid_page(policies: list[str], depths: int = 2, trials: int = 1, batch: int = 8) -> AppTest:
    app = open_page("views/needle_grid.py")
    widget(app.multiselect, "Policies").set_value(policies)
    widget(app.multiselect, "Context lengths (tokens)").set_value([256])
    widget(app.slider, DEPTHS).set_value(depths)
    widget(app.number_input, "Trials per cell").set_value(trials)
    widget(app.number_input, "Batch size").set_value(batch)
    app.run()
    assert not app.exception, app.exception
    return app


def captions(app: AppTest) -> list[str]:
    return [shown(caption.value) for caption in app.caption]


def heatmap(app: AppTest) -> dict:
    [chart] = [chart.figure for chart in drawn_charts(app)]
    return chart


def test_the_depth_control_says_it_is_a_count_and_shows_the_depths_it_chooses():
    assert evenly_spaced_depths(5) == (0.0, 0.25, 0.5, 0.75, 1.0)
    assert NeedleGridRequest("m", ("h2o",), 0.1, "prefill", (256,), 3, 1).grid().depths == evenly_spaced_depths(3)
    assert [depth_label(d) for d in evenly_spaced_depths(7)][:3] == ["0%", "16.7%", "33.3%"]
    with pytest.raises(Exception, match="at least two depths"):
        evenly_spaced_depths(1)


@pytest.mark.model
@pytest.mark.slow
def test_the_page_shows_the_chosen_depths_and_an_estimate_before_run(db):
    app = grid_page(["full", "h2o"], depths=5)
    slider = widget(app.slider, DEPTHS)
    assert "evenly spaced from the start of the text (0%) to its end (100%)" in slider.help
    assert "Depths: 0%, 25%, 50%, 75%, 100%" in captions(app)
    [estimate] = [caption for caption in captions(app) if "trials (" in caption]
    assert estimate.startswith("10 trials (0 stored); ") and estimate.endswith("(an estimate).")
    assert "on cpu for the 10 to run, from one timed read of 8 x 256 tokens" in estimate
    slider.set_value(3)
    app.run()
    assert "Depths: 0%, 50%, 100%" in captions(app)
    assert any(caption.startswith("6 trials (0 stored); ") for caption in captions(app))


@pytest.mark.model
@pytest.mark.slow
def test_the_estimate_counts_stored_trials_and_is_based_on_them(db):
    app = grid_page(["full", "h2o"])
    widget(app.button, "Run grid").click()
    app.run()
    sweep_job(db)
    app.run()
    assert "4 trials (4 stored): nothing left to run." in captions(app)
    widget(app.number_input, "Trials per cell").set_value(2)
    app.run()
    [estimate] = [caption for caption in captions(app) if "trials (" in caption]
    assert estimate.startswith("8 trials (4 stored); ")
    assert "from the median speed of 4 stored needle trials of this model on cpu (an estimate)." in estimate


@pytest.mark.model
def test_while_the_device_is_busy_the_estimate_counts_and_waits(db):
    app = open_page("views/needle_grid.py")
    with DEVICE_QUEUE.turn("live run of h2o on 2,048 tokens"):
        widget(app.number_input, "Batch size").set_value(3)  # a shape not timed yet
        app.run()
    [estimate] = [caption for caption in captions(app) if "trials (" in caption]
    assert estimate.endswith("to run. The time is estimated once the device is free.")


@pytest.mark.model
@pytest.mark.slow
def test_the_heatmap_fills_in_while_the_sweep_runs(db, monkeypatch):
    """The sweep is held before it stores anything, and again after its first batch: the page says it measures,
    then draws the stored trial while the sweep still runs."""
    before_first, after_first = threading.Event(), threading.Event()
    first_may_store, may_go_on = threading.Event(), threading.Event()
    stored = SweepRunner._store

    def held(self, *args, **kwargs):
        before_first.set()
        first_may_store.wait(60)
        stored(self, *args, **kwargs)
        after_first.set()
        may_go_on.wait(60)

    monkeypatch.setattr(SweepRunner, "_store", held)
    app = grid_page(["full", "h2o"], trials=1, batch=1)
    with DEVICE_QUEUE.turn("live run of h2o on 2,048 tokens"):
        widget(app.button, "Run grid").click()
        app.run()
        assert any("waits for the device; the heatmap fills in" in shown(info.value) for info in app.info)
    assert before_first.wait(60)
    app.run()
    assert any(
        shown(info.value) == "Sweep 1 is measuring these settings; the heatmap fills in as its trials are stored."
        for info in app.info
    )
    assert [chart.key for chart in drawn_charts(app)] == ["needle-shipped"]  # no heatmap yet: shipped runs
    first_may_store.set()
    assert after_first.wait(60)
    app.run()
    job = SWEEP_JOBS.jobs(db.resolve())[1]
    assert job.active
    assert any(shown(info.value).startswith("Sweep 1 is measuring: 1 of 4 trials so far") for info in app.info)
    cells = [cell for trace in heatmap(app)["data"] for row in trace["text"] for cell in row if cell]
    assert cells and all(cell.endswith("n=1") for cell in cells)
    may_go_on.set()
    sweep_job(db)
    app.run()
    assert not any("is measuring" in shown(info.value) for info in app.info)
    assert len(heatmap(app)["data"]) == 2
    assert any(popover.proto.popover.label == "How to read this" for popover in app.get("popover"))


def test_columns_are_the_depths_asked_for_not_where_the_needle_landed():
    runs = pd.DataFrame(
        {"run_id": [1], "policy": ["h2o"], "mode": ["prefill"], "keep": [0.1], "budget_tokens": [None]}
    ).assign(policy_params=["{}"])
    trials = pd.DataFrame(
        {
            "run_id": [1, 1, 1, 1],
            "context_length": [256, 256, 256, 256],
            "context_tokens": [256, 256, 256, 256],
            # a needle asked at 100% that landed at 84%, one at 25% that landed at 31%, and a trial of another grid
            "trial_key": ["depth=1.0000/trial=0", "depth=0.2500/trial=0", "depth=0.2500/trial=1", "live"],
            "depth": [0.836, 0.31, 0.29, 0.7],
            "correct": [True, False, True, True],
        }
    )
    by_depth = depth_accuracy(trials)
    assert sorted(by_depth["depth"]) == [0.25, 0.7, 1.0]
    cells = needle_grid(by_depth, runs, depths=evenly_spaced_depths(5)).set_index("depth")
    assert list(cells.index) == [0.25, 0.75, 1.0]
    assert cells.loc[0.25, "trials"] == 2 and cells.loc[0.25, "accuracy"] == 50
    assert cells.loc[1.0, "trials"] == 1  # by where it landed, it would be in the 75% column (or 80% in tenths)
    assert list(needle_heatmaps(cells.reset_index()).data[0].x) == ["25%", "75%", "100%"]
    rounded = needle_grid(by_depth, runs)  # without the depths asked for: tenths, as before
    assert sorted(rounded["depth"]) == [0.2, 0.7, 1.0]


def test_panel_titles_fit_their_panels_at_1280_pixels():
    label = "snapkv (window=32, kernel=7, pooling=max) · streaming · keep 12.5%"
    title = panel_title(label, 18)
    assert all(len(line) <= 18 for line in title.split("<br>"))
    assert title.split("<br>")[-2:] == ["streaming", "keep 12.5%"] and "…" not in title
    variants = [f"h2o (hot=0.25, key_bits={bits}, value_bits=4) · prefill · keep 10%" for bits in (4, 8)]
    assert panel_title(variants[0], 18) != panel_title(variants[1], 18)
    assert panel_title("h2o · prefill · keep 10%", 36) == "h2o · prefill · keep 10%"
    labels = [f"{name} (window=32, kernel=7) · streaming · keep 10%" for name in "abcdef"]
    cells = pd.DataFrame({"label": labels, "context_length": 256, "depth": 0.5, "accuracy": 100.0, "trials": 1})
    figure = needle_heatmaps(cells)
    titles = [annotation.text for annotation in figure.layout.annotations]
    assert all(len(line) <= 18 for title in titles for line in title.split("<br>"))
    lines = max(title.count("<br>") + 1 for title in titles)
    assert figure.layout.margin.t >= 16 * lines  # the wrapped titles have room above the panels
