"""Decode times measured on a GPU, as the cost views read them from the committed benchmark results, and the
``kvlab costs`` command that prints them beside the estimate."""

from __future__ import annotations

import json

import pytest

from kvlab.cli import main
from kvlab.costs.measured import MEASURED_DECODE, load_measured_decode, measured_summary, measured_table
from kvlab.errors import KvlabError
from kvlab.paths import bench_results


def row(config: str, attention: str, ms: float, roofline: float = 4.0) -> dict:
    return {"config": config, "attention": attention, "decode_ms": ms, "roofline_ms": roofline}


def results(tmp_path, decode: dict) -> object:
    path = tmp_path / MEASURED_DECODE
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"device": "Test GPU", "decode": decode}))
    return tmp_path


def test_the_figures_keep_their_device_and_compare_each_policy_with_the_full_cache_at_its_context(tmp_path):
    decode = {
        "8192": [row("full", "flex", 8.0), row("streaming streaming", "flex", 6.0), row("unlisted", "flex", 1.0)],
        "32768": [row("full", "flex", 10.0), row("full", "sdpa", 12.0), row("h2o streaming", "sdpa", 15.0, 5.0)],
    }
    measured = load_measured_decode(results(tmp_path, decode))
    assert measured is not None and measured.device == "Test GPU"
    table = measured_table(measured)
    assert len(table) == 5  # a configuration the views do not name is left out
    h2o = table[table["Configuration"] == "H2O"].iloc[0]
    assert (h2o["Context"], h2o["Backend"], h2o["x roofline"], h2o["vs full cache"]) == (32768, "sdpa", 3.0, 1.25)
    assert measured.nearest_context(25000) == 32768 and measured.nearest_context(100) == 8192
    summary = measured_summary(measured, 9000)
    assert "Test GPU" in summary and "8,192 tokens" in summary and "6.00 ms" in summary


def test_no_results_is_none_and_a_damaged_file_is_one_sentence(tmp_path):
    assert load_measured_decode(tmp_path) is None
    path = results(tmp_path, {}) / MEASURED_DECODE
    with pytest.raises(KvlabError, match="holds no decode figures"):
        load_measured_decode(tmp_path)
    path.write_text("{not json")
    with pytest.raises(KvlabError, match="not a decode benchmark result"):
        load_measured_decode(tmp_path)


def test_the_committed_measurement_names_its_gpu_and_every_context():
    folder = bench_results()
    assert folder is not None  # the tests run from a checkout
    measured = load_measured_decode(folder)
    assert measured is not None and "H200" in measured.device
    assert measured.contexts() == [8192, 32768, 131072]


def test_kvlab_costs_prints_the_estimate_then_the_measured_figures(capsys):
    assert main(["costs", "--model", "Llama-3-8B", "--gpu", "H200 141GB", "--keep", "0.1"]) == 0
    out = capsys.readouterr().out
    assert out.index("Estimated for Llama-3-8B on H200 141GB") < out.index("Measured on NVIDIA H200")
    assert "Decode step" in out and "StreamingLLM" in out
    assert main(["costs", "--format", "json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["measured"]["device"] == "NVIDIA H200" and printed["estimate"]


@pytest.mark.parametrize(
    ("arguments", "sentence"),
    [
        (["--model", "GPT-9"], "Unknown model preset"),
        (["--gpu", "nope"], "Unknown GPU preset"),
        (["--keep", "0"], "must be more than 0 and at most 1"),
        (["--batch", "0"], "batch must be at least 1"),
    ],
)
def test_bad_costs_arguments_are_one_sentence(arguments, sentence, capsys):
    assert main(["costs", *arguments]) == 2
    assert sentence in capsys.readouterr().err
