"""The cache options every scoring policy takes, on the dashboard: drawn apart on the live page and run there, refused
in one sentence where they cannot run, applied to a needle grid's policies with and without them, and told apart on
the frontier and the runs page (AppTest with the shipped model on the CPU)."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from drawn_charts import drawn_charts
from streamlit.testing.v1 import AppTest
from test_grid_page import grid_page
from test_pages import charts, click, open_page, shown, sweep_job, widget
from test_ui_tables import MODEL, PROVENANCE

from kvlab.cache.spec import CacheOptions
from kvlab.dashboard.inputs import CACHE_OPTIONS_TITLE, cache_option_fields, policy_fields
from kvlab.models import profiles
from kvlab.policies import configure
from kvlab.store import RunConfig, Store, Trial, open_store

OPTIONS = CACHE_OPTIONS_TITLE
TIERED = {"hot": 0.25, "key_bits": 4, "value_bits": 4}
VARIANT = "h2o[hot=0.25,key_bits=4,value_bits=4]"


def errors(app: AppTest) -> list[str]:
    return [shown(error.value) for error in app.error]


def test_a_policy_s_own_parameters_and_its_cache_options_are_drawn_apart():
    own = {field.name for field in policy_fields("h2o")}
    options = [field.name for field in cache_option_fields("h2o")]
    assert options == list(CacheOptions.names()) and not own & set(options) and "recent_ratio" in own
    assert cache_option_fields("full") == [] and cache_option_fields("drop_first") == []
    assert cache_option_fields() == cache_option_fields("tova")
    bits = {field.name: field.choices for field in cache_option_fields() if field.name.endswith("_bits")}
    assert bits == {"key_bits": (16, 8, 4, 2), "value_bits": (16, 8, 4, 2)}


def live_page() -> AppTest:
    app = open_page("views/live.py")
    widget(app.number_input, "Context length (tokens)").set_value(128)
    widget(app.number_input, "Tokens to generate (at most)").set_value(2)
    app.run()
    return app


@pytest.mark.model
@pytest.mark.slow
def test_the_live_page_draws_the_cache_options_apart_and_runs_the_policy_they_make(db):
    app = live_page()
    [options] = app.expander
    assert options.label == OPTIONS
    inside = {element.key for kind in ("selectbox", "number_input", "checkbox") for element in options.get(kind)}
    assert inside == {f"live_h2o_{name}" for name in CacheOptions.names()}
    assert app.number_input(key="live_h2o_recent_ratio") and "live_h2o_recent_ratio" not in inside
    assert app.selectbox(key="live_h2o_key_bits").options == ["16", "8", "4", "2"]
    widget(app.radio, "Mode").set_value("prefill")
    app.number_input(key="live_h2o_hot").set_value(0.25)
    app.selectbox(key="live_h2o_key_bits").set_value(4)
    app.selectbox(key="live_h2o_value_bits").set_value(4)
    app.run()
    assert not errors(app) and not widget(app.button, "Run").disabled
    click(app, "Run")
    assert "stored as run 1" in app.main.caption[-1].value
    [params] = open_store(db).list_runs()["policy_params"]
    assert json.loads(params) == configure("h2o", **TIERED).params()
    assert {key: json.loads(params)[key] for key in TIERED} == TIERED

    widget(app.radio, "Mode").set_value("streaming")  # precision tiers are set at prefill mode's compression
    app.run()
    assert errors(app) == [
        "Policy 'h2o' uses precision tiers (hot below 1), set once at prefill mode's compression; run it in prefill "
        "mode."
    ]
    assert widget(app.button, "Run").disabled


@pytest.mark.model
@pytest.mark.slow
def test_key_bits_without_a_cold_tier_is_one_sentence_and_no_run(db):
    app = live_page()
    app.selectbox(key="live_h2o_key_bits").set_value(4)
    app.run()
    assert not app.exception
    [sentence] = errors(app)
    assert (
        sentence.startswith("Policy 'h2o' holds every kept token at 16 bits while hot is 1")
        and sentence.count(". ") == 0
    )
    assert widget(app.button, "Run").disabled


@pytest.mark.model
@pytest.mark.slow
def test_a_layer_allocation_shows_its_budgets_and_entropy_without_a_profile_names_the_command(
    db, tmp_path, monkeypatch
):
    app = live_page()
    app.selectbox(key="live_h2o_layer_allocation").set_value("preset")
    app.run()
    figure = charts(app)["Layer budgets<br>13 tokens per layer"]  # ceil(0.1 x 128) per layer
    lines = {trace["name"]: trace for trace in figure["data"] if trace["type"] == "scatter"}
    assert lines["preset"]["line"]["width"] > 2 and lines["preset"]["opacity"] == 1
    assert all(lines[name]["opacity"] < 1 for name in ("uniform", "entropy", "cake"))
    budgets = lines["preset"]["y"]
    assert sum(budgets) == 13 * len(budgets) and budgets[0] > budgets[-1]

    monkeypatch.setattr(profiles, "SHIPPED_PROFILES_DIR", tmp_path / "none-shipped")
    monkeypatch.setenv("KVLAB_PROFILES", str(tmp_path / "none-measured"))
    app.run()
    assert not any(title.startswith("Layer budgets") for title in charts(app))
    assert any(caption.value.startswith("Tokens per layer under preset at 13 per layer: ") for caption in app.caption)
    app.selectbox(key="live_h2o_layer_allocation").set_value("entropy")
    app.run()
    [sentence] = errors(app)
    assert sentence.startswith("The entropy allocation needs the attention profile of kvlab-tiny-llama")
    assert sentence.endswith("measure it with `kvlab profile --model kvlab-tiny-llama`.")
    assert widget(app.button, "Run").disabled


def set_options(app: AppTest, also_without: bool = True, **options: object) -> AppTest:
    for name, value in options.items():
        widget_of = app.number_input if isinstance(value, float) else app.selectbox
        widget_of(key=f"grid_{name}").set_value(value)
    app.checkbox(key="grid_also_without").set_value(also_without)
    app.run()
    assert not app.exception, app.exception
    return app


@pytest.mark.model
@pytest.mark.slow
def test_a_needle_grid_runs_each_policy_with_and_without_the_options(db):
    app = set_options(grid_page(["h2o"]), **TIERED)
    [options] = app.expander
    assert options.label == OPTIONS and options.checkbox(key="grid_also_without").value
    assert any(shown(caption.value).startswith("4 trials (0 stored); ") for caption in app.caption)
    click(app, "Run grid")
    sweep_job(db)
    app.run()
    assert shown(app.main.markdown[0].value).startswith(f"Sweep 1: h2o, {VARIANT} · keep 0.1 · prefill")
    [spec] = [record.spec for record in open_store(db).sweeps()]
    assert spec["policies"] == ["h2o", VARIANT]
    panels = [trace["name"] for trace in drawn_charts(app)[0].figure["data"]]
    assert panels == ["h2o (hot=0.25, key_bits=4, value_bits=4) · prefill · keep 10%", "h2o · prefill · keep 10%"]

    set_options(app, also_without=False)  # the variant alone: its stored runs, not the plain h2o's
    panels = [trace["name"] for trace in drawn_charts(app)[0].figure["data"]]
    assert panels == ["h2o (hot=0.25, key_bits=4, value_bits=4) · prefill · keep 10%"]
    assert any(shown(caption.value) == "2 trials (2 stored): nothing left to run." for caption in app.caption)

    widget(app.radio, "Mode").set_value("streaming")
    app.run()
    assert errors(app) == [
        "Policy 'h2o' uses precision tiers (hot below 1), set once at prefill mode's compression; run it in prefill "
        "mode."
    ]
    assert widget(app.button, "Run grid").disabled and not drawn_charts(app)


def add_run(store: Store, params: dict[str, object], correct: bool, kv_bytes: int) -> None:
    policy = configure("h2o", **params)
    config = RunConfig(MODEL, "h2o", "prefill", "needle", policy.params(), keep=0.1, context_length=512)
    run_id = store.begin_run(config, provenance=PROVENANCE)
    trial = Trial("0.5/0", "t", 512, correct, correct, 0.5, kept_tokens=52, kv_bytes=kv_bytes, peak_kv_bytes=kv_bytes)
    store.add_trials(run_id, [trial])
    store.finish_run(run_id)


@pytest.fixture
def tiered_runs(db):
    store = open_store(db)
    add_run(store, {}, True, 4000)
    add_run(store, TIERED, False, 1500)
    return db


def xs(trace: dict) -> list[float]:
    """A plotly trace's x values, written out as a list or packed as binary."""
    x = trace["x"]
    return list(x) if isinstance(x, list) else np.frombuffer(base64.b64decode(x["bdata"]), dtype=x["dtype"]).tolist()


@pytest.mark.model
@pytest.mark.slow
def test_the_frontier_and_the_runs_page_tell_a_policy_with_options_from_the_plain_one(tiered_runs):
    app = open_page("views/frontier.py")
    widget(app.selectbox, "Memory axis").set_value("kv_bytes")
    app.run()
    frontier = drawn_charts(app)[0].figure
    points = {trace["meta"]: xs(trace) for trace in frontier["data"] if trace["meta"] != "Pareto front"}
    assert set(points) == {"h2o · prefill", "h2o (hot=0.25, key_bits=4, value_bits=4) · prefill"}
    assert points["h2o (hot=0.25, key_bits=4, value_bits=4) · prefill"] < points["h2o · prefill"]

    app.switch_page("views/runs.py")
    app.run()
    assert not app.exception
    parameters = app.table[0].value.loc["parameters"].map(shown)
    assert "hot=0.25" in parameters["run 2"] and "hot" not in parameters["run 1"]
