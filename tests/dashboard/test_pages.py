"""Every dashboard page, driven headless through Streamlit's AppTest with the shipped model on the CPU."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch
from drawn_charts import drawn_charts
from streamlit import config
from streamlit.testing.v1 import AppTest
from test_ui_tables import add_run

from kvlab.dashboard import navigation, session
from kvlab.dashboard.sweep_jobs import SWEEP_JOBS
from kvlab.engine.generation import Generation
from kvlab.models.loading import default_model
from kvlab.runs.device_queue import DEVICE_QUEUE
from kvlab.store import open_store

pytestmark = pytest.mark.model

REPO = Path(__file__).resolve().parents[2]
#: Every page but Claims, whose evaluation has its own tests (test_pages_claims.py).
PAGES = {entry.script: entry.title for entry in navigation.PAGES if entry.script != "views/claims.py"}


@pytest.fixture
def seeded(db):
    store = open_store(db)
    add_run(store, "full", None, {0.0: [True], 0.5: [True], 1.0: [True]}, context=4096, kv_bytes=8000)
    for keep, ok in ((0.1, [True, False]), (0.3, [True, True])):
        add_run(store, "h2o", keep, {0.0: ok, 1.0: ok}, context=4096, kv_bytes=int(8000 * keep))
        add_run(store, "streaming", keep, {0.0: [False], 1.0: ok}, context=4096, kv_bytes=int(8000 * keep))
    add_run(store, "h2o", 0.1, {0.5: [True]}, context=1024, kv_bytes=200)
    return db


def open_page(page: str) -> AppTest:
    app = AppTest.from_file("../../app.py", default_timeout=120)
    app.run()
    app.switch_page(page)
    app.run()
    assert not app.exception, app.exception
    assert app.title[0].value == PAGES[page]
    return app


def shown(value: str) -> str:
    """Markdown as a reader sees it: the page escapes user text with backslashes and invisible word joiners."""
    return re.sub(r"\\([!-/:-@\[-`{-~])", r"\1", value).replace("\u2060", "")


def widget(elements, label: str):
    """The widget of a kind (``app.number_input``, ``app.button``…) with this label."""
    return next(element for element in elements if element.label == label)


def charts(app: AppTest) -> dict[str, dict]:
    """Plotly figures on the page by title."""
    return {chart.title: chart.figure for chart in drawn_charts(app)}


def click(app: AppTest, label: str) -> AppTest:
    widget(app.button, label).click()
    app.run()
    assert not app.exception, app.exception
    return app


@pytest.mark.slow
def test_every_page_renders_on_an_empty_database(db):
    app = AppTest.from_file("../../app.py", default_timeout=120)
    app.run()
    assert not app.exception
    assert "Running on **cpu**" in app.sidebar.caption[0].value
    assert app.sidebar.text_input[0].value == default_model()
    for page, title in PAGES.items():
        app.switch_page(page)
        app.run()
        assert not app.exception, (page, app.exception)
        assert app.title[0].value == title
        assert "Running on **cpu**" in app.sidebar.caption[0].value  # drawn by app.py, whichever page ran first
    for page, empty in (("views/frontier.py", "no runs with trials yet"), ("views/runs.py", "No runs are stored")):
        app.switch_page(page)
        app.run()  # cold, the page shows the shipped runs, labelled so, with a switch to the empty own store
        assert app.toggle[0].label == "Shipped runs" and app.toggle[0].value, page
        assert any("**shipped runs**" in caption.value for caption in app.caption), page
        assert drawn_charts(app) or app.dataframe, page
        app.toggle[0].set_value(False)
        assert empty in app.run().info[0].value
    app.switch_page("views/needle_grid.py")
    assert "No stored needle trials" in app.run().info[0].value
    shipped = [header.value for header in app.subheader if header.value.startswith("Shipped runs: ")]
    assert shipped == ["Shipped runs: kvlab-tiny-llama at 4,096 tokens"]  # the loaded model's shipped sweep meanwhile
    assert any(chart.key for chart in drawn_charts(app))


@pytest.mark.slow
def test_a_short_live_run_completes_and_is_stored(db):
    app = open_page("views/live.py")
    assert charts(app)["KV cache bytes"]["layout"]["annotations"][0]["text"] == "Press Run to start."
    widget(app.number_input, "Context length (tokens)").set_value(256)
    widget(app.number_input, "Chunk (tokens per forward pass)").set_value(64)
    widget(app.number_input, "Tokens to generate (at most)").set_value(6)
    click(app, "Run")
    assert "stored as run 1" in app.main.caption[-1].value
    labels = {metric.label: metric.value for metric in app.metric}
    assert labels["Prompt tokens"] == "256" and re.fullmatch(r"[\d.,]+ (KiB|MiB)", labels["KV in use (measured)"])
    titles = set(charts(app))
    assert {
        "KV cache bytes",
        "Cache map: tokens held",
        "Entropy over the run",
        "Attention weight per key<br>mean over layers",
    } <= titles
    runs = open_store(db).list_runs()
    assert len(runs) == 1 and runs.loc[0, "trials"] == 1 and runs.loc[0, "context_length"] == 256
    [written] = [element.value for element in app.main.text]  # the answer in plain text, its ends trimmed
    assert written == (open_store(db).trials_frame()["output"][0].strip() or "(nothing generated)")

    widget(app.selectbox, "3D view").set_value(2)
    app.run()
    assert not app.exception
    assert "Attention weight per key<br>layer 2" in charts(app)
    assert "stored as run 1" in app.main.caption[-1].value
    assert open_store(db).list_runs().loc[0, "trials"] == 1  # redrawn, not run again


@pytest.mark.slow
def test_pasted_and_uploaded_text(db):
    app = open_page("views/live.py")
    widget(app.radio, "Task").set_value("Your text")
    app.run()
    app.file_uploader[0].set_value(("weights.txt", b"\x00\x01binary", "text/plain"))
    app.run()
    assert "is binary, not text" in shown(app.error[0].value)
    assert widget(app.button, "Run").disabled
    app.file_uploader[0].set_value(None)
    widget(app.text_area, "…or paste a text").set_value("The locker code of Ada is 4471. " * 8)
    widget(app.text_input, "Question").set_value("What is the locker code of Ada?")
    widget(app.text_input, "Expected answer").set_value("4471")
    widget(app.number_input, "Tokens to generate (at most)").set_value(4)
    app.run()
    click(app, "Run")
    assert "stored as run 1" in app.main.caption[-1].value
    runs = open_store(db).list_runs()
    assert list(runs["task"]) == ["text"]


@pytest.mark.slow
def test_out_of_memory_is_a_sentence_and_the_next_run_works(db, monkeypatch):
    app = open_page("views/live.py")
    widget(app.number_input, "Context length (tokens)").set_value(128)
    widget(app.number_input, "Tokens to generate (at most)").set_value(2)
    app.run()
    real_forward = Generation.forward

    def exhausted(self, ids):
        raise torch.OutOfMemoryError("CUDA out of memory.")

    monkeypatch.setattr(Generation, "forward", exhausted)
    click(app, "Run")
    assert "The GPU ran out of memory" in shown(app.error[0].value)
    monkeypatch.setattr(Generation, "forward", real_forward)
    click(app, "Run")
    assert "stored as run 1" in app.main.caption[-1].value
    assert not any("memory" in error.value for error in app.error)


@pytest.mark.slow
def test_an_unknown_model_is_a_sentence_and_the_app_keeps_working(db):
    app = open_page("views/live.py")
    app.sidebar.text_input[0].set_value("/no/such/model")
    app.run()
    assert not app.exception
    assert shown(app.sidebar.error[0].value) == (
        "'/no/such/model' is not a model this server can load: give a hub id, a GGUF file, or the directory of a "
        "decoder-only causal language model with its config.json, tokenizer and weights."
    )
    assert widget(app.button, "Run").disabled
    app.switch_page("views/costs.py")
    app.run()
    assert not app.exception and app.metric
    app.sidebar.text_input[0].set_value(default_model())
    app.run()
    assert not app.sidebar.error


def sweep_job(db, sweep_id: int = 1):
    """The background job of a sweep the page started, once it has ended."""
    job = SWEEP_JOBS.jobs(db.resolve())[sweep_id]
    assert job.join(120)
    return job


def grid_page(db, policies: list[str], depths: int = 2, trials: int = 1, batch: int = 8) -> AppTest:
    app = open_page("views/needle_grid.py")
    widget(app.multiselect, "Policies").set_value(policies)
    widget(app.multiselect, "Context lengths (tokens)").set_value([256])
    widget(app.slider, "Needle depths (how many)").set_value(depths)
    widget(app.number_input, "Trials per cell").set_value(trials)
    widget(app.number_input, "Batch size").set_value(batch)
    app.run()
    return app


@pytest.mark.slow
def test_the_needle_grid_runs_a_sweep_on_the_server_and_shows_its_cells(db):
    app = grid_page(db, ["full", "h2o"])
    click(app, "Run grid")
    assert app.info[0].value.startswith("Sweep 1 runs on the server: it goes on if this tab is closed")
    sweep_job(db)
    app.run()
    assert shown(app.success[0].value) == "Ran 4 trials; 0 were already stored."
    assert shown(app.main.markdown[0].value).startswith("Sweep 1: full, h2o · keep 0.1 · prefill · 256 tokens")
    assert "started by test@example.com" in shown(app.main.markdown[0].value)
    heatmaps = drawn_charts(app)
    assert len(heatmaps) == 1
    panels = [trace["type"] for trace in heatmaps[0].figure["data"]]
    assert panels == ["heatmap", "heatmap"]
    assert set(open_store(db).list_runs()["started_by"]) == {"test@example.com"}

    click(app, "Run grid")  # the same grid again: the same sweep, nothing left to run
    sweep_job(db)
    app.run()
    assert shown(app.success[0].value) == "Ran 0 trials; 4 were already stored."
    assert len(open_store(db).sweeps()) == 1


@pytest.mark.slow
def test_a_waiting_sweep_shows_its_place_and_is_stopped_and_resumed_from_the_page(db):
    app = grid_page(db, ["full", "h2o"])
    with DEVICE_QUEUE.turn("live run of h2o on 2,048 tokens"):
        click(app, "Run grid")
        job = SWEEP_JOBS.jobs(db.resolve())[1]
        deadline = time.monotonic() + 10
        while job.waiting is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        app.run()
        assert any(
            shown(info.value).startswith(
                "Waiting for the device: 1 run is ahead of yours. Now running: live run of h2o on 2,048 tokens"
            )
            for info in app.info
        )
        click(app, "Stop")
        sweep_job(db)
    app.run()
    assert shown(app.warning[0].value).startswith("Stopped before it started")
    assert open_store(db).list_runs().empty
    click(app, "Resume")
    assert sweep_job(db) is not job
    app.run()
    assert shown(app.success[0].value) == "Ran 4 trials; 0 were already stored."


@pytest.mark.slow
def test_out_of_memory_in_a_needle_grid_is_a_sentence(db, monkeypatch):
    app = grid_page(db, ["h2o"])

    def exhausted(self, ids):
        raise torch.OutOfMemoryError("CUDA out of memory.")

    monkeypatch.setattr(Generation, "forward", exhausted)
    click(app, "Run grid")
    sweep_job(db)
    app.run()
    assert "ran out of memory" in shown(app.error[0].value) and "resume it to go on" in shown(app.error[0].value)
    assert set(open_store(db).list_runs()["status"]) == {"interrupted"}
    assert widget(app.button, "Resume")


@pytest.mark.slow
def test_the_frontier_from_stored_runs(seeded):
    app = open_page("views/frontier.py")
    figures = [chart.figure for chart in drawn_charts(app)]
    assert len(figures) == 1 and len(app.dataframe) == 2  # selection A alone (and the claim) until B is asked for
    widget(app.toggle, "Selection B").set_value(True)
    app.run()
    figures = [chart.figure for chart in drawn_charts(app)]
    assert len(figures) == 2
    assert [box.value for box in app.selectbox if box.label == "Context length (tokens)"] == [4096, 1024]
    names = {trace["meta"] for trace in figures[0]["data"]}
    assert {"full cache", "h2o · prefill", "streaming · prefill", "Pareto front"} <= names
    assert figures[0]["layout"]["xaxis"]["title"]["text"] == "kept fraction of the context"
    widget(app.selectbox, "Memory axis").set_value("kv_bytes")
    app.run()
    figures = [chart.figure for chart in drawn_charts(app)]
    assert figures[0]["layout"]["xaxis"]["type"] == "log"
    assert "measured" in figures[0]["layout"]["xaxis"]["title"]["text"]
    assert len(app.dataframe) == 3  # the two selections' points and the claim table


@pytest.mark.slow
def test_the_cost_calculator(seeded):
    app = open_page("views/costs.py")
    fits = widget(app.metric, "Sequences that fit")
    assert fits.value == "228"
    gpu = [box for box in app.selectbox if box.label == "Preset"][1]  # the first preset is the model's
    gpu.set_value("A100 40GB SXM")
    app.run()
    assert widget(app.metric, "Sequences that fit").value != "228"
    widget(app.radio, "From").set_value("pasted config.json")
    app.run()
    widget(app.text_area, "config.json").set_value("{not json")
    app.run()
    assert "not valid JSON" in shown(app.error[0].value)
    widget(app.radio, "From").set_value("loaded model")
    app.run()
    assert any("kvlab-tiny-llama" in shown(caption.value) for caption in app.caption)
    widget(app.radio, "Kept fraction").set_value("from a stored run")
    app.run()
    assert widget(app.selectbox, "Stored run").options


@pytest.mark.slow
def test_the_runs_page_filters_compares_and_offers_downloads(seeded):
    app = open_page("views/runs.py")
    assert "6 of 6 runs" in app.main.caption[0].value
    widget(app.multiselect, "Policy").set_value(["h2o"])
    app.run()
    assert "3 of 6 runs" in app.main.caption[0].value
    assert widget(app.multiselect, "Runs to compare").value == [4, 6]
    assert {button.label for button in app.get("download_button")} == {
        "Runs (CSV)",
        "Runs (Parquet)",
        "Trials (CSV)",
        "Trials (Parquet)",
        "Report (HTML)",
    }


# --- access -----------------------------------------------------------------------------------------------------------

AUTH = {
    "redirect_uri": "http://localhost:8501/oauth2callback",
    "cookie_secret": "a-cookie-secret-of-32-characters",
    "client_id": "kvlab",
    "client_secret": "not-a-secret",
    "server_metadata_url": "http://127.0.0.1:9/.well-known/openid-configuration",
}
WIDGET_KINDS = (
    "button",
    "checkbox",
    "toggle",
    "radio",
    "selectbox",
    "multiselect",
    "select_slider",
    "slider",
    "text_input",
    "text_area",
    "number_input",
    "file_uploader",
)


@pytest.mark.slow
def test_with_a_login_configured_a_visitor_sees_only_the_login_and_runs_record_the_user(db):
    app = AppTest.from_file("../../app.py", default_timeout=120)
    app.secrets["auth"] = AUTH
    app.user = {"is_logged_in": False}
    app.run()
    assert not app.exception
    assert [title.value for title in app.title] == ["kvlab"]
    assert [button.label for button in app.button] == ["Log in"]
    assert not app.sidebar.text_input and not drawn_charts(app) and not app.metric

    app.secrets["auth"] = {key: AUTH[key] for key in ("redirect_uri", "cookie_secret", "client_id")}
    app.run()
    assert not app.button and "name no OIDC provider" in app.error[0].value  # incomplete: nobody gets in

    app.secrets["auth"] = AUTH
    app.user = {"is_logged_in": True, "email": "ann@example.com", "name": "Ann"}
    app.run()
    assert app.title[0].value == "Overview"
    assert "Logged in as **ann@example.com**" in [shown(caption.value) for caption in app.sidebar.caption]
    assert widget(app.sidebar.button, "Log out")
    app.switch_page("views/live.py")
    app.run()
    widget(app.number_input, "Context length (tokens)").set_value(128)
    widget(app.number_input, "Tokens to generate (at most)").set_value(2)
    click(app, "Run")
    assert open_store(db).list_runs()["started_by"].tolist() == ["ann@example.com"]


def test_without_a_login_the_sidebar_says_who_can_reach_the_server(db):
    app = AppTest.from_file("../../app.py", default_timeout=120)
    app.run()
    assert "No login configured: serving this machine only (localhost)." in [
        shown(c.value) for c in app.sidebar.caption
    ]
    assert not app.sidebar.warning
    # the sidebar reads the address the server was started with, as `--server.address` or the environment sets it
    configured = config.get_option("server.address")
    config.set_option("server.address", "0.0.0.0")
    try:
        app.run()
    finally:
        config.set_option("server.address", configured)
    assert "the server listens on 0.0.0.0: anyone who can reach its port" in shown(app.sidebar.warning[0].value)


@pytest.mark.slow
def test_a_model_outside_the_allow_list_is_refused_with_a_message(db, monkeypatch):
    monkeypatch.setenv("KVLAB_ALLOWED_MODELS", f"{default_model()},Qwen/Qwen2.5-0.5B")
    app = open_page("views/live.py")
    assert not app.sidebar.error
    app.sidebar.text_input[0].set_value("meta-llama/Llama-3.2-1B")
    app.run()
    assert shown(app.sidebar.error[0].value) == (
        f"'meta-llama/Llama-3.2-1B' is not a model this server may load; it allows {default_model()}, "
        "Qwen/Qwen2.5-0.5B."
    )
    assert widget(app.button, "Run").disabled

    monkeypatch.setenv("KVLAB_ALLOWED_MODELS", "Qwen/Qwen2.5-0.5B")  # the default model is not allowed either
    app = AppTest.from_file("../../app.py", default_timeout=120)
    app.session_state["kvlab_model_name"] = default_model()
    app.run()
    assert shown(app.sidebar.error[0].value).endswith(
        "is not a model this server may load; it allows Qwen/Qwen2.5-0.5B."
    )


@pytest.mark.slow
def test_nothing_in_the_browser_can_switch_trust_remote_code_on(db, tmp_path, monkeypatch):
    remote = tmp_path / "ships-its-own-code"
    remote.mkdir()
    (remote / "config.json").write_text(
        json.dumps(
            {
                "model_type": "mysterious",
                "auto_map": {"AutoConfig": "configuration.MyConfig", "AutoModelForCausalLM": "modeling.MyModel"},
            }
        )
    )
    calls: list[dict] = []
    real_load = session.load_model

    def recording_load(name, **kwargs):
        calls.append(kwargs)
        return real_load(name, **kwargs)

    monkeypatch.setattr(session, "load_model", recording_load)
    app = AppTest.from_file("../../app.py", default_timeout=120)
    app.query_params = {"trust_remote_code": "true", "kvlab_model_name": str(remote)}
    app.run()
    assert app.sidebar.text_input[0].value == default_model()  # query parameters do not reach widgets
    app.sidebar.text_input[0].set_value(str(remote))
    app.run()
    assert "is not a model this server can load" in shown(app.sidebar.error[0].value)
    assert calls and all(call["trust_remote_code"] is False for call in calls)
    for page in PAGES:
        app.switch_page(page)
        app.run()
        for kind in WIDGET_KINDS:
            for element in app.get(kind):
                named = f"{getattr(element, 'label', '')} {getattr(element, 'key', '') or ''}".lower()
                assert "remote" not in named and "trust" not in named, (page, named)
    sources = [REPO / "app.py", *(REPO / "views").glob("*.py"), *(REPO / "kvlab" / "dashboard").glob("*.py")]
    settings = [
        value
        for source in sources
        for value in re.findall(r"trust_remote_code\s*=\s*(\w+)", source.read_text(encoding="utf-8"))
    ]
    assert settings == ["False"]


def test_pages_open_stores_only_through_the_session():
    """One way to a store: every page and dashboard module opens it with ``session.open_page_store`` (read-only
    unless it writes), which alone calls the store's opener."""
    sources = [REPO / "app.py", *(REPO / "views").glob("*.py"), *(REPO / "kvlab" / "dashboard").glob("*.py")]
    openers = [
        f"{source.name}: {call}"
        for source in sources
        for call in re.findall(r"\b(?:open_store|Store)\(", source.read_text(encoding="utf-8"))
    ]
    assert openers == ["session.py: open_store("]
