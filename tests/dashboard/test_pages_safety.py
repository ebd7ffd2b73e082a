"""The dashboard under careless and hostile use, through Streamlit's AppTest: nothing typed is rendered as markup,
the model box tells nothing about the server's files, a damaged or full store is one sentence and a live run's result
is never lost, and a bug is one sentence with a reference instead of a traceback."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from streamlit import config
from streamlit.testing.v1 import AppTest
from test_pages import click, open_page, shown, widget
from test_store_safety import damaged_database, write_v4_database
from test_ui_tables import add_run
from tiny_models import save_tiny_checkpoint

from kvlab.dashboard import access, session
from kvlab.errors import KvlabError
from kvlab.models.loading import default_model
from kvlab.runs import tables
from kvlab.store import open_store
from kvlab.store.connection import close
from kvlab.store.errors import disk_full


@pytest.fixture
def db(tmp_path, monkeypatch):
    path = tmp_path / "runs.duckdb"
    monkeypatch.setenv("KVLAB_DB", str(path))
    return path


def refusal(app: AppTest, name: str) -> str:
    """The sidebar's sentence with the name taken out."""
    return shown(app.sidebar.error[0].value).replace(repr(name), "NAME")


@pytest.mark.model
@pytest.mark.slow
def test_the_model_box_says_the_same_whether_a_path_exists_or_not(db, tmp_path):
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(
        json.dumps(
            {
                "model_type": "bert",
                "architectures": ["BertForMaskedLM"],
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "hidden_size": 8,
            }
        )
    )
    app = open_page("views/live.py")
    sentences = set()
    for name in ("/etc/shadow", "/root", "/no/such/model", str(bert), "no-such-owner/no-such-model", "x" * 400):
        app.sidebar.text_input[0].set_value(name)
        app.run()
        assert not app.exception
        shown_name = name if len(name) <= 80 else name[:80] + "…"
        sentences.add(refusal(app, shown_name))
    assert sentences == {
        "NAME is not a model this server can load: give a hub id, a GGUF file, or the directory of a "
        "decoder-only causal language model with its config.json, tokenizer and weights."
    }


@pytest.mark.model
def test_an_empty_model_box_is_a_sentence_not_the_default_model(db):
    app = open_page("views/live.py")
    app.sidebar.text_input[0].set_value("")
    app.run()
    sentence = shown(app.sidebar.error[0].value)
    assert sentence.startswith("The model box is empty, so no model is loaded") and "kvlab-tiny-llama" in sentence
    assert widget(app.button, "Run").disabled


@pytest.mark.model
def test_a_model_with_truncated_weights_is_a_sentence_and_every_page_still_works(db, tmp_path):
    directory = Path(save_tiny_checkpoint(tmp_path / "model"))
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    app = open_page("views/live.py")
    app.sidebar.text_input[0].set_value(str(directory))
    app.run()
    assert not app.exception and "Could not load the weights of" in shown(app.sidebar.error[0].value)
    for page in ("views/costs.py", "views/runs.py", "views/frontier.py", "views/needle_grid.py"):
        app.switch_page(page)
        app.run()
        assert not app.exception


@pytest.mark.model
@pytest.mark.slow
def test_pasted_markup_is_shown_as_text(db):
    app = open_page("views/live.py")
    widget(app.radio, "Task").set_value("Your text")
    app.run()
    image = "![pixel](http://127.0.0.1:9/pixel.png)"
    widget(app.text_area, "…or paste a text").set_value("The access code of Ada is 4471. " * 4)
    widget(app.text_input, "Question").set_value(f"What is **the** code? {image}")
    widget(app.text_input, "Expected answer").set_value(f"4471 {image}")
    widget(app.number_input, "Tokens to generate (at most)").set_value(2)
    app.run()
    click(app, "Run")
    rendered = [
        element.value
        for kind in ("markdown", "caption", "error", "warning", "success", "info")
        for element in app.get(kind)
    ]
    assert any(image in shown(text) for text in rendered)  # it is there, as text
    assert not any("![" in text or "**the**" in text for text in rendered)  # and never as markup
    assert "(pixel.png)" not in " ".join(rendered)


@pytest.mark.model
@pytest.mark.slow
def test_a_text_far_longer_than_the_model_is_refused_before_it_is_tokenised(db):
    app = open_page("views/live.py")
    widget(app.radio, "Task").set_value("Your text")
    app.run()
    widget(app.text_area, "…or paste a text").set_value("word " * 150_000)
    app.run()
    click(app, "Run")
    assert "characters, far more than the 4,608 tokens a prompt may have here" in shown(app.error[0].value)
    assert not db.exists()  # nothing ran, nothing was stored


@pytest.mark.model
@pytest.mark.slow
def test_a_live_run_that_cannot_be_stored_keeps_its_result_for_download(db, monkeypatch):
    def full_disk(*args, **kwargs):
        raise disk_full(db)

    app = open_page("views/live.py")
    widget(app.number_input, "Context length (tokens)").set_value(128)
    widget(app.number_input, "Tokens to generate (at most)").set_value(2)
    app.run()
    monkeypatch.setattr(session, "open_store", full_disk)  # every page opens its stores through the session
    click(app, "Run")
    problem = next(shown(error.value) for error in app.error if "disk" in error.value)
    assert "could not be written because its disk is full" in problem and "kept on this page" in problem
    assert [button.label for button in app.get("download_button")] == ["Download this run (CSV)"]
    assert widget(app.metric, "Prompt tokens").value == "128"
    assert "not stored" in shown(app.main.caption[-1].value)
    app.run()  # a rerun (any widget change) keeps the result
    assert [button.label for button in app.get("download_button")] == ["Download this run (CSV)"]


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("page", ["views/runs.py", "views/frontier.py"])
def test_a_damaged_store_is_a_sentence_on_the_pages_that_read_it(tmp_path, monkeypatch, page):
    monkeypatch.setenv("KVLAB_DB", str(damaged_database(tmp_path)))
    app = AppTest.from_file("../../app.py", default_timeout=120)
    app.run()
    app.switch_page(page)
    app.run()
    assert not app.exception
    assert any("is damaged: part of it cannot be read" in shown(error.value) for error in app.error)


@pytest.mark.model
@pytest.mark.slow
def test_reading_pages_leave_an_older_store_as_it_was(tmp_path, monkeypatch):
    path = tmp_path / "runs.duckdb"
    write_v4_database(path)
    before = path.read_bytes()
    monkeypatch.setenv("KVLAB_DB", str(path))
    app = AppTest.from_file("../../app.py", default_timeout=120)
    app.run()
    for page in ("views/runs.py", "views/frontier.py", "views/needle_grid.py", "views/costs.py"):
        app.switch_page(page)
        app.run()
        assert not app.exception
        if page == "views/runs.py":
            assert "1 of 1 runs" in shown(app.main.caption[0].value)
    close(path.resolve())
    assert path.read_bytes() == before


@pytest.mark.model
def test_a_bug_in_a_page_is_one_sentence_with_a_reference_and_no_traceback(db, monkeypatch, caplog):
    def broken(runs):
        raise ZeroDivisionError("a bug in a table shaper")

    monkeypatch.setattr(tables, "runs_table", broken)
    add_run(open_store(db), "h2o", 0.5, {0.5: [True]})
    app = AppTest.from_file("../../app.py", default_timeout=120)
    app.run()
    app.switch_page("views/runs.py")
    app.run()
    assert not app.exception
    message = shown(app.error[0].value)
    assert re.fullmatch(
        r"Something went wrong on the server \(ZeroDivisionError, reference [0-9a-f]{8}\); the "
        r"details are in the server log\.",
        message,
    )
    reference = message.split("reference ")[1][:8]
    assert any(reference in record.getMessage() and record.exc_info for record in caplog.records)
    assert "a bug in a table shaper" not in message


@pytest.mark.model
def test_development_mode_shows_the_traceback(db, monkeypatch):
    def broken(runs):
        raise ZeroDivisionError("a bug in a table shaper")

    monkeypatch.setattr(tables, "runs_table", broken)
    add_run(open_store(db), "h2o", 0.5, {0.5: [True]})
    configured = config.get_option("client.showErrorDetails")
    config.set_option("client.showErrorDetails", "full")
    try:
        app = AppTest.from_file("../../app.py", default_timeout=120)
        app.run()
        app.switch_page("views/runs.py")
        app.run()
    finally:
        config.set_option("client.showErrorDetails", configured)
    assert app.exception and "a bug in a table shaper" in app.exception[0].value


# --- the Host header -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "header,allowed",
    [
        (None, True),
        ("localhost:8501", True),
        ("127.0.0.1:8501", True),
        ("[::1]:8501", True),
        ("LOCALHOST", True),
        ("kvlab.example.org", True),
        ("kvlab.example.org:443", True),
        ("evil.example:8501", False),
        ("localhost.evil.example", False),
        ("127.0.0.1.nip.io:8501", False),
        ("", False),
    ],
)
def test_only_the_servers_own_names_are_answered(header, allowed):
    names = access.allowed_hosts({"KVLAB_ALLOWED_HOSTS": "kvlab.example.org, "})
    assert access.host_allowed(header, names) is allowed


@pytest.mark.model
def test_a_page_reached_by_another_name_runs_nothing(db, monkeypatch):
    monkeypatch.setattr(session, "host_allowed", lambda header, names: False)
    app = AppTest.from_file("../../app.py", default_timeout=120)
    app.run()
    assert not app.exception and not app.sidebar.text_input and not app.title
    assert "does not answer to the name this page used" in shown(app.error[0].value)


@pytest.mark.model
def test_the_default_model_is_allowed_with_an_allow_list_that_names_it(db, monkeypatch):
    monkeypatch.setenv("KVLAB_ALLOWED_MODELS", default_model())
    app = open_page("views/live.py")
    assert not app.sidebar.error
    with pytest.raises(KvlabError):
        access.check_model_allowed("/etc/shadow", access.allowed_models())


@pytest.mark.model
@pytest.mark.parametrize(
    ("field", "value"),
    [("Memory (GiB)", 1e308), ("Bandwidth (GB/s)", 1e300), ("Dense BF16 TFLOP/s", 1e250), ("Memory (GiB)", 1e16)],
)
def test_huge_numbers_in_the_cost_calculator_are_one_sentence(db, field, value):
    app = open_page("views/costs.py")
    widget(app.number_input, field).set_value(value)
    app.run()
    assert not app.exception
    assert any("GPU" in shown(error.value) for error in app.error)
