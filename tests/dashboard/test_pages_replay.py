"""The overview and replays in the dashboard (AppTest, the shipped model on the CPU): content with no model loaded,
a stored run replayed with a scrubber, two runs side by side on one scrubber, and a live page whose settings and
result stay together across page switches."""

from __future__ import annotations

import pytest
from drawn_charts import drawn_charts
from streamlit.testing.v1 import AppTest
from test_pages import click, open_page, shown, widget

from kvlab.runs.replay import EXAMPLES_DB
from kvlab.store import open_store

GUIDE = "How to read this"


def figure_data(app: AppTest) -> list[dict]:
    return [chart.figure for chart in drawn_charts(app)]


def memory_points(app: AppTest) -> list[int]:
    """How many events each KV-bytes chart on the page draws."""
    counts = []
    for figure in figure_data(app):
        lines = [trace for trace in figure["data"] if trace.get("name", "").startswith("in use")]
        counts += [len(lines[0]["x"])] if lines else []
    return counts


@pytest.mark.model
@pytest.mark.slow
def test_the_overview_shows_the_shipped_results_without_a_model(db):
    app = AppTest.from_file("../../app.py", default_timeout=120)
    app.run()
    assert not app.exception and app.title[0].value == "Overview"
    app.sidebar.text_input[0].set_value("/no/such/model")
    app.run()
    assert not app.exception and app.sidebar.error  # no model, and the overview still has all its content
    assert "H100" in shown(app.caption[0].value)
    run_id, _ = app.selectbox(key="overview-replay").value
    with open_store(EXAMPLES_DB, read_only=True) as store:
        replays = store.replays()
    replayed = replays.loc[replays["run_id"] == run_id, "model"].iloc[0]
    assert replayed != "kvlab-tiny-llama"  # a published model's run first: it has attention sinks
    model = widget(app.radio, "Model")
    assert model.value == (replayed if replayed in model.options else model.options[0])  # the replay's, if measured
    figures = figure_data(app)
    frontier = figures[0]
    assert {trace["meta"] for trace in frontier["data"]} >= {"h2o · prefill", "streaming · prefill"}
    claim = app.dataframe[0].value
    assert any(row.endswith("(article)") for row in claim.index) and any("kvlab" in row for row in claim.index)
    assert len([p for p in app.get("popover") if p.proto.popover.label == GUIDE]) >= 4
    last = memory_points(app)
    slider = widget(app.select_slider, "Tokens read and generated")
    slider.set_value(slider.options[2] if isinstance(slider.options[2], int) else int(slider.options[2]))
    app.run()
    assert not app.exception and memory_points(app)[0] < last[0]  # scrubbed back: fewer events drawn


def scrubbed(app: AppTest) -> int:
    return int(widget(app.select_slider, "Tokens read and generated").value)


@pytest.mark.model
@pytest.mark.slow
def test_play_steps_a_replay_pass_by_pass_pauses_and_stops_at_the_end(db):
    app = AppTest.from_file("../../app.py", default_timeout=120)
    app.run()
    steps = sorted({int(option) for option in widget(app.select_slider, "Tokens read and generated").options})
    assert scrubbed(app) == steps[-1] and len(steps) > 4
    click(app, "Play")  # at the last step: from the first, drawn before the first move
    assert scrubbed(app) == steps[0]
    drawn = [memory_points(app)[0]]
    for step in steps[1:3]:  # each tick of the replay's timer (a rerun here) is one step further
        app.run()
        assert not app.exception and scrubbed(app) == step
        drawn.append(memory_points(app)[0])
    assert drawn == sorted(drawn) and drawn[0] < drawn[-1]  # the charts follow the scrubber
    click(app, "Pause")
    app.run()
    assert scrubbed(app) == steps[2] and widget(app.button, "Play")
    widget(app.select_slider, "Tokens read and generated").set_value(steps[-2])
    app.run()
    click(app, "Play")
    assert scrubbed(app) == steps[-2]
    app.run()
    app.run()
    assert scrubbed(app) == steps[-1] and widget(app.button, "Play")  # stopped at the end


@pytest.mark.model
@pytest.mark.slow
def test_a_stored_run_replays_and_two_replay_side_by_side_on_one_scrubber(db):
    app = open_page("views/live.py")
    widget(app.number_input, "Context length (tokens)").set_value(256)
    widget(app.number_input, "Chunk (tokens per forward pass)").set_value(64)
    widget(app.number_input, "Tokens to generate (at most)").set_value(4)
    widget(app.slider, "Kept fraction").set_value(0.3)  # above SnapKV's smallest budget (its window and pool)
    click(app, "Run")
    widget(app.selectbox, "Policy").set_value("snapkv")
    widget(app.number_input, "Chunk (tokens per forward pass)").set_value(128)
    app.run()
    click(app, "Run")
    assert not app.error and len(open_store(db).replays()) == 2

    widget(app.radio, "Show").set_value("Replay stored runs")
    app.run()
    assert not app.exception
    widget(app.radio, "From").set_value(widget(app.radio, "From").options[0])  # this server's runs
    app.run()
    runs = widget(app.multiselect, "Runs (one, or two side by side)")
    assert len(runs.options) == 2 and len(runs.value) == 1
    assert len(memory_points(app)) == 1
    runs.set_value(runs.options)
    app.run()
    assert not app.exception
    final = memory_points(app)
    assert len(final) == 2 and final[0] != final[1]  # chunks of 64 and of 128 tokens: other events
    slider = widget(app.select_slider, "Tokens read and generated")
    slider.set_value(128)
    app.run()
    at_128 = memory_points(app)
    assert sorted(at_128) == [1, 2]  # one pass of 128 tokens, two of 64: both runs at the same point of reading
    assert any("Reading the prompt: 128 of 256 tokens" in c.value for c in app.caption)
    click(app, "Play")  # from the end: both runs from the first step, in step
    first = memory_points(app)
    app.run()
    assert len(memory_points(app)) == 2 and memory_points(app) != first


@pytest.mark.model
@pytest.mark.slow
def test_settings_survive_a_page_switch_and_a_changed_setting_clears_the_result(db):
    app = open_page("views/live.py")
    widget(app.number_input, "Context length (tokens)").set_value(256)
    widget(app.slider, "Kept fraction").set_value(0.3)
    widget(app.number_input, "Tokens to generate (at most)").set_value(3)
    click(app, "Run")
    assert "stored as run 1" in app.main.caption[-1].value
    app.switch_page("views/costs.py")
    app.run()
    app.switch_page("views/live.py")
    app.run()
    assert not app.exception
    assert widget(app.number_input, "Context length (tokens)").value == 256
    assert widget(app.slider, "Kept fraction").value == 0.3
    assert "stored as run 1" in app.main.caption[-1].value  # the result is still drawn, under its own settings
    widget(app.slider, "Kept fraction").set_value(0.5)
    app.run()
    assert "settings changed since the last run" in app.info[0].value
    assert not any("stored as run" in caption.value for caption in app.main.caption)


def test_the_shipped_examples_hold_gpu_replays_and_both_published_models():
    with open_store(EXAMPLES_DB, read_only=True) as store:
        replays = store.replays()
    shipped = replays[replays["model"] == "kvlab-tiny-llama"]
    assert {"h2o", "snapkv"} <= set(shipped["policy"]) and shipped["device"].str.contains("H100").all()
    published = replays[replays["model"] != "kvlab-tiny-llama"]
    assert set(published["model"]) == {"SmolLM2-135M-Instruct.Q4_1.gguf", "gemma-3-270m-q4_k_m.gguf"}
    assert {"full", "streaming", "h2o"} <= set(published["policy"]) and published["device"].str.len().gt(0).all()


@pytest.mark.model
@pytest.mark.slow
def test_the_overview_opens_the_shipped_replays_on_the_live_page(db):
    app = AppTest.from_file("../../app.py", default_timeout=120)
    app.run()
    click(app, "Replay it with every chart, or two runs side by side")
    assert app.title[0].value == "Live run" and widget(app.radio, "Show").value == "Replay stored runs"
    assert widget(app.radio, "From").value == "kvlab's shipped examples"
    assert len(memory_points(app)) == 1 and not app.exception
