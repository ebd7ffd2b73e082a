"""The Advisor page, and the Cost calculator's measured decode times: what a reader sees for the shipped runs, for
the dashboard's own store, and for a configuration a GPU benchmark measured."""

from __future__ import annotations

import pytest
from test_pages import open_page, shown, widget

from kvlab.costs.measured import MEASURED, load_measured_decode

pytestmark = pytest.mark.model


def test_the_advisor_ranks_the_shipped_runs_and_says_what_is_missing(db) -> None:
    app = open_page("views/advisor.py")
    ranked = app.dataframe[0].value
    assert list(ranked.columns[:2]) == ["rank", "configuration"] and ranked["rank"].iloc[0] == "1"
    assert all(cell.endswith(")") and "% (" in cell for cell in ranked["relative accuracy (95% CI)"])
    assert set(ranked["decode source"]) == {"computed"}  # no GPU benchmark of Llama-3-8B on an H100 at 32,768
    warning = shown(app.warning[0].value)
    assert "no needle runs at 32,768 tokens" in warning and "kvlab sweep --model <a model reaching 32,768" in warning
    assert "kvlab-tiny-llama reaches only 4,608 positions" in warning
    assert "Llama-3-8B has no runs of its own" in shown(app.caption[1].value)


def test_the_advisor_shows_a_measured_decode_where_the_gpu_benchmark_ran(db) -> None:
    app = open_page("views/advisor.py")
    widget(app.selectbox, "GPU").set_value("H200 141GB")
    widget(app.slider, "Accuracy floor (share of the full cache's)").set_value(0.5)
    app.run()
    assert not app.exception, app.exception
    ranked = app.dataframe[0].value
    full = ranked[ranked["configuration"] == "full cache"].iloc[0]
    assert full["decode source"] == "measured on NVIDIA H200 (full cache, 32,768 tokens, batch 1)"


def test_the_advisor_reads_the_dashboards_store_when_asked(db) -> None:
    app = open_page("views/advisor.py")
    widget(app.radio, "Evidence").set_value("this dashboard's store")
    app.run()
    assert not app.exception, app.exception
    assert "holds no runs yet" in shown(app.info[0].value) and not app.dataframe


def test_the_cost_calculator_shows_a_measured_decode_with_its_device(db) -> None:
    app = open_page("views/costs.py")
    selects = [box for box in app.selectbox if box.label == "Preset"]
    selects[1].set_value("H200 141GB")  # the second "Preset" is the GPU's
    widget(app.number_input, "Prompt tokens (N)").set_value(32768)
    widget(app.number_input, "Batch (sequences decoded together)").set_value(1)
    widget(app.slider, "Kept fraction of the context").set_value(0.1)
    app.run()
    assert not app.exception, app.exception
    decode = widget(app.metric, f"Decode, {MEASURED}")
    committed = load_measured_decode()
    assert committed is not None
    streaming = committed.decode_ms(32768, "streaming streaming", "flex")  # StreamingLLM at 32,768 tokens
    assert streaming is not None and decode.value == f"{streaming:.2f} ms"
    caption = " ".join(shown(caption.value) for caption in app.caption)
    assert "full cache: measured on NVIDIA H200 (full cache, 32,768 tokens, batch 1)" in caption
    assert "evicted: measured on NVIDIA H200 (StreamingLLM, 32,768 tokens, batch 1)" in caption
    widget(app.number_input, "Batch (sequences decoded together)").set_value(2)
    app.run()
    assert widget(app.metric, "Decode, computed") is not None


def test_the_advisor_judges_a_perplexity_floor_on_the_shipped_runs(db) -> None:
    app = open_page("views/advisor.py")
    widget(app.radio, "Floor judged on").set_value("perplexity")
    widget(app.number_input, "Context (prompt tokens)").set_value(1280)
    app.run()
    assert not app.exception, app.exception
    ranked = app.dataframe[0].value
    assert "full cache" in set(ranked["configuration"]) and ranked["rank"].iloc[0] == "1"
    assert "relative is its perplexity over the configuration's" in shown(app.caption[1].value)
    assert not app.warning  # the shipped perplexity runs are at 1,280 tokens
