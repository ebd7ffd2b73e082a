"""The policy advisor: which stored configurations meet an accuracy floor, cheapest first, with their intervals and
paired tests; measured decode times only where a GPU benchmark measured that configuration; and a sentence with the
sweep that would add what the store lacks."""

from __future__ import annotations

import html
import json
import math
from datetime import datetime
from pathlib import Path

import pandas as pd
import pytest

from kvlab.cli import main
from kvlab.costs.gpus import GPU_PRESETS
from kvlab.costs.measured import MeasuredDecode, MeasuredRow
from kvlab.costs.presets import preset_name
from kvlab.dashboard.advice_figures import advice_figure
from kvlab.dashboard.report import advice_report, report_html
from kvlab.errors import KvlabError
from kvlab.provenance import Provenance
from kvlab.runs.advisor import AdviceRequest, advise, evidence_runs, evidence_sentence, shown_advice
from kvlab.store import RunConfig, Store, Trial, open_store

FULL_BYTES = 8 << 20
ITEMS = 20


def add_run(store: Store, policy: str, mode: str, keep: float | None, right: int, context: int = 4096) -> None:
    """A needle run whose first ``right`` of :data:`ITEMS` items are answered right, holding ``keep`` of the full
    cache's bytes, with the seconds a sweep stores."""
    run_id = store.begin_run(
        RunConfig(
            model="m",
            policy=policy,
            mode=mode,
            task="needle",
            keep=keep,
            context_length=context,
            layout="threshold",
            device="cuda:0",
            dtype="bfloat16",
        ),
        provenance=Provenance("0.1.0", "abc1234", {"python": "3"}),
    )
    store.add_trials(
        run_id,
        [
            Trial(
                trial_key=str(item),
                task_id="t",
                context_tokens=context,
                correct=item < right,
                item_hash=f"item-{item}",
                kv_bytes=int(FULL_BYTES * (keep or 1.0)),
                prefill_s=0.01,
                decode_s=0.05,
            )
            for item in range(ITEMS)
        ],
    )
    store.finish_run(run_id)


@pytest.fixture
def stored(tmp_path: Path) -> Path:
    """Full cache (all right), StreamingLLM keeping 30 % (19 of 20), SnapKV keeping 50 % (all right) and H2O
    keeping 10 % (half right), all at 4,096 tokens."""
    path = tmp_path / "advice.duckdb"
    with open_store(path) as store:
        add_run(store, "full", "prefill", None, ITEMS)
        add_run(store, "streaming", "streaming", 0.3, ITEMS - 1)
        add_run(store, "snapkv", "prefill", 0.5, ITEMS)
        add_run(store, "h2o", "prefill", 0.1, ITEMS // 2)
    return path


@pytest.fixture
def trials(stored: Path) -> pd.DataFrame:
    with open_store(stored, read_only=True) as store:
        return store.trials_frame()


#: A GPU benchmark of the Llama-3-8B shape on an H200 at 4,096 tokens: the full cache and StreamingLLM keeping 30 %.
MEASURED = MeasuredDecode(
    "NVIDIA H200",
    "bench/results/test.json",
    0.3,
    (
        MeasuredRow(4096, "full", "flex", 9.0, 4.0, 0.5),
        MeasuredRow(4096, "streaming streaming", "flex", 8.0, 3.5, None),
    ),
)


def request(**changed: object) -> AdviceRequest:
    fields: dict = {"model": "Llama-3-8B", "gpu": "H200 141GB", "context": 4096, "floor": 0.9} | changed
    return AdviceRequest(**fields)


def test_the_cheapest_configuration_that_meets_the_floor_comes_first(trials):
    advice = advise(request(), trials)
    assert list(advice.ranked["policy"]) == ["streaming", "snapkv", "full"]
    assert list(advice.ranked["rank"]) == [1, 2, 3]
    assert list(advice.below["policy"]) == ["h2o"]  # 50 % of the full cache's accuracy, under the floor
    assert advice.missing == ()
    first = advice.ranked.iloc[0]
    assert first["relative accuracy"] == pytest.approx(0.95)
    assert first["relative 95% CI low"] < 0.95 < first["relative 95% CI high"] <= 1.0
    assert first["vs full cache (McNemar p)"] == "1" and first["paired reading"].startswith("no difference shown")
    assert first["KV bytes measured (evidence)"] == pytest.approx(0.3 * FULL_BYTES)
    costs = list(advice.ranked["cost per query, computed ($)"])
    assert costs == sorted(costs) and costs[0] < costs[-1]
    below = advice.below.iloc[0]
    assert below["relative accuracy"] == pytest.approx(0.5) and "full cache right more often" in below["paired reading"]
    assert advise(request(floor=0.96), trials).ranked["policy"].tolist() == ["snapkv", "full"]


def test_the_shown_table_carries_the_interval_and_the_paired_test(trials):
    shown = shown_advice(advise(request(), trials).ranked)
    assert shown.loc[0, "relative accuracy (95% CI)"].startswith("95% (")
    assert shown.loc[0, "vs full cache"].startswith("McNemar p 1:")
    assert shown.loc[2, "vs full cache"] == "the reference" and shown.loc[2, "configuration"] == "full cache"


def test_a_decode_time_is_measured_only_where_a_gpu_run_matches(trials):
    advice = advise(request(), trials, MEASURED)
    source = dict(zip(advice.ranked["policy"], advice.ranked["decode source"]))
    decode = dict(zip(advice.ranked["policy"], advice.ranked["decode ms per token"]))
    assert source["full"] == "measured on NVIDIA H200 (full cache, 4,096 tokens, batch 1)"
    assert (
        source["streaming"].startswith("measured on NVIDIA H200 (StreamingLLM")
        and "prefill computed" in source["streaming"]
    )
    assert decode["full"] == pytest.approx(9.0) and decode["streaming"] == pytest.approx(8.0)
    assert source["snapkv"] == "computed"  # the benchmark did not run it
    for other in (request(gpu="H100 SXM 80GB"), request(batch=2), request(model="Mistral-7B")):
        assert set(advise(other, trials, MEASURED).ranked["decode source"]) == {"computed"}


def test_missing_evidence_names_the_sweep_and_its_time(trials):
    advice = advise(request(context=32768), trials)
    assert advice.evidence is not None and advice.evidence.context == 4096
    (sentence,) = advice.missing
    assert "no needle runs at 32,768 tokens" in sentence
    assert "`kvlab sweep --model m --task needle --policies full,h2o,snapkv,streaming --keep 0.1,0.3,0.5 " in sentence
    assert "--contexts 32768 --trials 20`" in sentence
    assert "1,000 trials (0 stored)" in sentence and "on cuda:0" in sentence and "(an estimate)" in sentence
    shipped = trials.assign(model="kvlab-tiny-llama")  # the shipped model: 4,608 positions, short of 32,768
    (short,) = advise(request(context=32768), shipped).missing
    assert "--model <a model reaching 32,768 tokens>" in short and "reaches only 4,608 positions" in short
    assert "(an estimate)" in short and "larger and slower than this estimate" in short
    assert "--model kvlab-tiny-llama" in advise(request(context=4500), shipped).missing[0]
    empty = advise(request(), trials.iloc[0:0])
    assert empty.evidence is None and empty.ranked.empty and "--model <model>" in empty.missing[0]


def test_no_configuration_meeting_the_floor_is_said(trials):
    advice = advise(request(floor=1.0, gpu="RTX 4090 24GB"), trials)  # 8B at bf16 fits; the floor keeps full, snapkv
    assert advice.ranked["policy"].tolist() == ["snapkv", "full"]
    tight = advise(request(model="Llama-3-70B", gpu="RTX 4090 24GB"), trials)  # 70B does not fit one 4090
    assert tight.ranked.empty and "No stored configuration" in tight.missing[-1]


def test_bad_requests_are_one_sentence(trials):
    with pytest.raises(KvlabError, match="floor"):
        request(floor=1.5)
    with pytest.raises(KvlabError, match="Unknown GPU preset"):
        request(gpu="H999")
    with pytest.raises(KvlabError, match="no needle runs of 'other'; it holds runs of m"):
        advise(request(evidence_model="other"), trials)
    assert preset_name(GPU_PRESETS, "H100", "GPU") == "H100 SXM 80GB"
    assert preset_name(GPU_PRESETS, "h200", "GPU") == "H200 141GB"
    with pytest.raises(KvlabError, match="Unknown GPU preset 'B300'"):
        preset_name(GPU_PRESETS, "B300", "GPU")


@pytest.mark.parametrize("fmt", ["table", "csv", "markdown", "json"])
def test_the_command_in_each_format(stored, capsys, fmt):
    status = main(
        ["advise", "--db", str(stored), "--gpu", "H200", "--context", "32768", "--floor", "0.9", "--format", fmt]
    )
    out = capsys.readouterr().out
    assert status == 0
    if fmt == "json":
        data = json.loads(out)
        assert [row["policy"] for row in data["ranked"]] == ["streaming", "snapkv", "full"]
        assert data["request"]["gpu"] == "H200 141GB" and "kvlab sweep" in data["missing"][0]
        return
    if fmt == "csv":
        lines = out.splitlines()
        assert lines[0].startswith("rank,configuration,") and lines[1].startswith("1,streaming · streaming · keep 30%")
        return
    assert "kvlab sweep --model m" in out and "Llama-3-8B on 1 × H200 141GB" in out
    assert ("| rank | configuration |" in out) == (fmt == "markdown")
    assert "95% (" in out and "computed" in out


def test_the_command_refuses_an_unknown_preset(stored, capsys):
    assert main(["advise", "--db", str(stored), "--model", "Llama-9"]) == 2
    assert "Unknown model preset 'Llama-9'" in capsys.readouterr().err


def test_the_chart_draws_every_configuration_against_the_floor(trials):
    figure = advice_figure(advise(request(), trials))
    below, meets = figure.data
    assert list(meets.y) == pytest.approx([95.0, 100.0, 100.0]) and list(below.y) == pytest.approx([50.0])
    assert list(meets.x) == sorted(meets.x) and below.marker.color != meets.marker.color
    assert meets.error_y.arrayminus[0] > 0 and figure.layout.shapes[0].y0 == pytest.approx(90.0)
    assert "computed" in figure.layout.xaxis.title.text
    assert "measured on m at 4,096 tokens" in figure.layout.title.text


def test_the_report_holds_the_ranking_the_evidence_and_what_is_missing(trials):
    advice = advise(request(context=32768), trials)
    report = advice_report(advice, evidence_runs(advice, trials))
    document = report_html(report, datetime(2026, 1, 2, 3, 4))
    assert report.title.startswith("Cheapest configurations keeping 90%") and "has no runs of its own" in report.summary
    assert [table.title for table in report.tables] == [
        "Configurations that meet the floor, cheapest first",
        "Below the floor, closest first",
        "Missing evidence",
    ]
    assert len(evidence_runs(advice, trials)) == 4 and "kvlab sweep --model m" in html.unescape(document)
    assert "streaming · streaming · keep 30%" in html.unescape(document)


def add_quality_run(store: Store, policy: str, keep: float | None, nll: list[float]) -> None:
    """A perplexity run (``kvlab quality``) scoring one text per value of ``nll`` (mean negative log-likelihood over
    512 tokens), holding ``keep`` of the full cache's bytes."""
    run_id = store.begin_run(
        RunConfig(
            model="m",
            policy=policy,
            mode="streaming",
            task="quality:texts",
            keep=keep,
            context_length=768,
            layout="compact",
            device="cuda:0",
            dtype="bfloat16",
        ),
        provenance=Provenance("0.1.0", "abc1234", {"python": "3"}),
    )
    store.add_trials(
        run_id,
        [
            Trial(
                trial_key=str(text),
                task_id=f"text-{text}",
                context_tokens=768,
                correct=None,
                item_hash=f"text-{text}",
                scored_tokens=512,
                nll=value,
                kv_bytes=int(FULL_BYTES * (keep or 1.0)),
            )
            for text, value in enumerate(nll)
        ],
    )
    store.finish_run(run_id)


def test_a_perplexity_floor_compares_the_full_caches_perplexity_with_each_configurations(tmp_path):
    """Relative is the full cache's perplexity over the configuration's: 0.05 nats more per token keeps 95 %, 0.5
    nats keep 61 %; the interval pairs the texts, and one text gives none."""
    path = tmp_path / "quality.duckdb"
    with open_store(path) as store:
        add_quality_run(store, "full", None, [2.0, 2.2, 1.8])
        add_quality_run(store, "streaming", 0.25, [2.04, 2.26, 1.85])
        add_quality_run(store, "h2o", 0.1, [2.5, 2.7, 2.3])
        add_run(store, "full", "prefill", None, ITEMS)  # a needle run: not perplexity evidence
        trials_frame = store.trials_frame()
    advice = advise(request(benchmark="perplexity", context=768, floor=0.9), trials_frame)
    assert advice.evidence is not None and advice.evidence.task == "quality"
    assert advice.evidence.full_score == pytest.approx(math.exp(2.0)) and advice.evidence.full_trials == 3
    ranked = advice.ranked.set_index("policy")
    assert ranked.loc["streaming", "relative accuracy"] == pytest.approx(math.exp(-0.05))
    low, high = ranked.loc["streaming", ["relative 95% CI low", "relative 95% CI high"]]
    assert low <= math.exp(-0.05) <= high < 1.0
    assert ranked.loc["streaming", "accuracy"] == pytest.approx(math.exp(2.05))  # its own perplexity
    assert "3 texts paired" in ranked.loc["streaming", "paired reading"]
    below = advice.below.set_index("policy")
    assert below.loc["h2o", "relative accuracy"] == pytest.approx(math.exp(-0.5))
    assert "perplexity" in evidence_sentence(advice)
    with open_store(path) as store:
        add_quality_run(store, "tova", 0.5, [2.1])
        one_text = advise(request(benchmark="perplexity", context=768, floor=0.5), store.trials_frame())
    tova = one_text.ranked.set_index("policy").loc["tova"]
    assert math.isnan(tova["relative 95% CI low"]) and "too few for an interval" in tova["paired reading"]


def test_the_command_judges_a_perplexity_floor_on_the_shipped_runs(capsys):
    assert main(["advise", "--model", "Llama-3-8B", "--gpu", "H100", "--context", "1280", "--on", "perplexity"]) == 0
    out = capsys.readouterr().out
    assert "perplexity" in out and "streaming" in out and "the reference" in out
