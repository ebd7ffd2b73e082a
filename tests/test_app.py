"""The dashboard's generate page, driven headless through Streamlit's AppTest."""

from __future__ import annotations

import pytest
from streamlit.testing.v1 import AppTest

from tiny_models import save_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def test_generate_page_runs_one_generation(checkpoint, monkeypatch):
    monkeypatch.setenv("KVLAB_DEFAULT_MODEL", checkpoint)
    app = AppTest.from_file("../pages/generate.py", default_timeout=60)
    app.run()
    assert not app.exception
    assert "cpu" in app.sidebar.caption[0].value
    app.text_area[0].set_value("the cache keeps the tokens that matter " * 4)
    app.selectbox[0].set_value("h2o")
    app.button[0].click()
    app.run()
    assert not app.exception
    labels = [metric.label for metric in app.metric]
    assert "KV held (measured)" in labels
    context = int(next(m.value for m in app.metric if m.label == "Context tokens"))
    assert context > 10


def test_a_model_that_does_not_exist_is_a_sentence_on_the_page(monkeypatch, tmp_path):
    monkeypatch.setenv("KVLAB_DEFAULT_MODEL", str(tmp_path / "missing"))
    app = AppTest.from_file("../pages/generate.py", default_timeout=60)
    app.run()
    assert not app.exception
    assert "No model directory" in app.sidebar.error[0].value
    assert app.button[0].disabled
