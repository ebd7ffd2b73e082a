"""Decode times measured on a GPU, as the cost views read them from the committed benchmark results, and the
``kvlab costs`` command that prints them beside the estimate."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvlab.cli import main
from kvlab.costs import GPU_PRESETS, MODEL_PRESETS, Scenario, estimate
from kvlab.costs.measured import (
    MEASURED_DECODE,
    MeasuredDecode,
    MeasuredRow,
    gpu_preset_of,
    load_measured_decode,
    measured_against_formula,
    measured_summary,
    measured_table,
    measured_times,
    with_measured_times,
)
from kvlab.dashboard.cost_view import timing_sentence, with_measured
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


#: A benchmark of the Llama-3-8B shape on an H200 at 8,192 tokens, keeping 10 %.
H200_RUN = MeasuredDecode(
    "NVIDIA H200",
    "bench/results/test.json",
    0.1,
    (MeasuredRow(8192, "full", "flex", 6.0, 4.0, 0.25), MeasuredRow(8192, "streaming streaming", "flex", 5.0, 3.0)),
)
MEASURED_SCENARIO = Scenario(prompt_tokens=8192, output_tokens=100, keep_fraction=0.1)


def test_measured_times_replace_the_formulas_only_for_what_was_measured():
    full = measured_times(H200_RUN, "Llama-3-8B", "H200 141GB", replace(MEASURED_SCENARIO, keep_fraction=1.0), "full")
    assert full is not None and full.decode_s == pytest.approx(0.006) and full.prefill_s == 0.25
    assert full.label == "measured on NVIDIA H200 (full cache, 8,192 tokens, batch 1)"
    assert measured_times(H200_RUN, "Llama-3-8B", "H200 141GB", MEASURED_SCENARIO, "streaming streaming") is not None
    unmeasured = [
        ("Mistral-7B", "H200 141GB", MEASURED_SCENARIO, "full"),  # another shape
        ("Llama-3-8B", "H100 SXM 80GB", MEASURED_SCENARIO, "full"),  # another GPU
        ("Llama-3-8B", "H200 141GB", replace(MEASURED_SCENARIO, batch=4), "full"),
        ("Llama-3-8B", "H200 141GB", replace(MEASURED_SCENARIO, prompt_tokens=8000), "full"),
        ("Llama-3-8B", "H200 141GB", replace(MEASURED_SCENARIO, kv_precision="int8"), "full"),
        ("Llama-3-8B", "H200 141GB", replace(MEASURED_SCENARIO, keep_fraction=0.25), "streaming streaming"),
        ("Llama-3-8B", "H200 141GB", MEASURED_SCENARIO, "h2o streaming"),  # not in the file
    ]
    for model, gpu, scenario, configuration in unmeasured:
        assert measured_times(H200_RUN, model, gpu, scenario, configuration) is None, (model, gpu, scenario)


def test_measured_times_set_the_throughput_and_price():
    model, gpu = MODEL_PRESETS["Llama-3-8B"], GPU_PRESETS["H200 141GB"]
    priced = estimate(model, gpu, MEASURED_SCENARIO)
    times = measured_times(H200_RUN, model.name, gpu.name, MEASURED_SCENARIO, "streaming streaming")
    assert times is not None and times.prefill_s is None
    timed = with_measured_times(priced, times, MEASURED_SCENARIO, gpu.price_per_hour)
    assert timed.decode_step_seconds == pytest.approx(0.005) and timed.tokens_per_second == pytest.approx(200.0)
    assert timed.prefill_seconds == priced.prefill_seconds  # not timed by the benchmark: the formula's
    seconds = priced.prefill_seconds + 100 * 0.005
    assert timed.cost_per_query == pytest.approx(seconds * gpu.price_per_hour / 3600)
    assert timed.kv_bytes_per_sequence == priced.kv_bytes_per_sequence  # sizes stay computed
    full, evicted = with_measured(priced, H200_RUN, model.name, gpu.name, MEASURED_SCENARIO, None, 1.0)
    assert full is priced and evicted is None
    assert "computed from the formulas" in timing_sentence(None, None, H200_RUN)
    assert "8,192 tokens, keep 10%" in timing_sentence(None, None, H200_RUN)
    both = timing_sentence(times, None, H200_RUN)
    assert "full cache: measured on NVIDIA H200 (StreamingLLM" in both and "evicted: computed" in both


def test_the_committed_measurement_beside_the_formulas():
    measured = load_measured_decode(bench_results())
    assert measured is not None
    table = measured_against_formula(measured)
    assert len(table) == len(measured.rows) and gpu_preset_of(measured.device) == "H200 141GB"
    full = table[(table["Configuration"] == "full cache") & (table["Context"] == 32768)].iloc[0]
    assert full["decode ms measured"] == measured.decode_ms(32768, "full", "flex")
    assert full["measured / formula"] == pytest.approx(full["decode ms measured"] / full["decode ms formula"], abs=0.01)
    assert full["decode ms formula"] > 0 and full["prefill s formula"] > 0
    assert measured_against_formula(replace(measured, device="Unknown accelerator")).empty
