"""The articles' claims: the needle table beside kvlab's measurement, the catalogue, the verdict rules, the figures
computed with kvlab.costs, the figures measured from a store filled with known trials, and the claims table."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from kvlab.budget import PYRAMID_BETA, pyramid_shares
from kvlab.claims import (
    BY_ID,
    CATALOGUE,
    PUBLISHED_NEEDLE_CLAIM,
    VERDICTS,
    Evidence,
    evaluate_all,
    measured_table,
    published_table,
    refresh,
    side_by_side,
)
from kvlab.claims.commands import FIRST_TOKEN_ABLATION
from kvlab.claims.evaluate import check_ids, record
from kvlab.claims.needle import FULL_CACHE, article_rows_left_out, needle_cells
from kvlab.claims.verdicts import (
    CONDITIONAL,
    FAILS,
    HOLDS,
    UNMEASURABLE,
    Evaluation,
    about,
    about_count,
    combine,
    verdict_of,
)
from kvlab.costs import (
    GPU_PRESETS,
    MODEL_PRESETS,
    kv_bytes_for_sequence,
    kv_bytes_per_token,
    sequences_that_fit,
    weight_bytes,
)
from kvlab.errors import KvlabError
from kvlab.policies import POLICIES, is_full_cache
from kvlab.policies.snapkv import PyramidKV
from kvlab.stats import pooled_perplexity, wilson_interval
from kvlab.store import RunConfig, Store, Trial, open_store

REPO = Path(__file__).resolve().parents[2]


def trials() -> pd.DataFrame:
    rows = []
    for keep, correct in ((0.9, [1, 1, 1, 0]), (0.1, [0, 0, 0, 1])):
        rows += [
            {"context_length": 4096, "keep": keep, "policy": "h2o", "mode": "streaming", "correct": bool(c)}
            for c in correct
        ]
    rows += [{"context_length": 4096, "keep": None, "policy": "full", "mode": "prefill", "correct": True}] * 2
    rows += [{"context_length": 2048, "keep": 0.9, "policy": "h2o", "mode": "streaming", "correct": False}] * 3
    rows += [{"context_length": 4096, "keep": 0.9, "policy": "h2o", "mode": "streaming", "correct": None}] * 5
    return pd.DataFrame(rows)


# --- the needle table ---------------------------------------------------------------------------------------------


def test_the_article_table_is_as_published():
    table = published_table()
    assert list(table.columns) == ["10% pruned", "30% pruned", "50% pruned", "70% pruned", "90% pruned"]
    assert table.loc["streaming (article)", "90% pruned"] == 14.0 and table.loc["random (article)", "90% pruned"] == 5.0
    assert set(PUBLISHED_NEEDLE_CLAIM["h2o"]) == {100.0}


def test_measurement_is_accuracy_by_pruning_with_intervals_ignoring_trials_without_an_answer():
    measured = measured_table(trials())
    assert measured.loc["h2o streaming (kvlab)", "10% pruned"] == pytest.approx(75.0)
    assert measured.loc["h2o streaming (kvlab)", "90% pruned"] == pytest.approx(25.0)
    assert measured.loc["h2o streaming (kvlab)", "trials per cell"] == 4  # the five trials without `correct` left out
    low, high = wilson_interval(3, 4)
    assert measured.loc["h2o streaming (kvlab)", "10% pruned, 95% interval"] == (
        f"{math.floor(100 * low)}–{math.ceil(100 * high)}"
    )
    assert measured.loc["h2o streaming (kvlab)", "50% pruned, 95% interval"] == "—"


def test_side_by_side_keeps_both_and_the_full_cache_ceiling():
    table = side_by_side(trials())
    assert list(table.index[:2]) == ["h2o (article)", "h2o streaming (kvlab)"]
    assert table.loc["h2o (article)", "90% pruned"] == 100.0
    assert table.loc["h2o (article)", "90% pruned, 95% interval"] == "—"
    assert table.loc["h2o streaming (kvlab)", "90% pruned"] == pytest.approx(25.0)
    assert pd.isna(table.loc["h2o streaming (kvlab)", "50% pruned"])
    assert (table.loc["full cache (kvlab)", ["10% pruned", "90% pruned"]] == 100.0).all()
    assert table.loc["full cache (kvlab)", "10% pruned, 95% interval"] == "34–100"  # 2 of 2


def test_the_article_rows_never_stand_without_kvlab_rows_of_their_policy():
    table = side_by_side(trials())
    assert [row for row in table.index if row.endswith("(article)")] == ["h2o (article)"]
    assert article_rows_left_out(table) == ["streaming", "random"]
    at_other_ratios = pd.DataFrame(  # kvlab measured streaming, but at none of the article's pruning ratios
        [{"context_length": 4096, "keep": 0.75, "policy": "streaming", "mode": "prefill", "correct": True}] * 3
    )
    table = side_by_side(pd.concat([trials(), at_other_ratios]))
    assert "streaming (article)" not in table.index and "streaming prefill (kvlab)" not in table.index
    assert article_rows_left_out(side_by_side(trials(), context=1024)) == list(PUBLISHED_NEEDLE_CLAIM)


def test_the_full_cache_and_the_ablation_are_named_as_the_policy_registry_says():
    assert {name for name in POLICIES if is_full_cache(name)} == {FULL_CACHE}
    assert POLICIES[FIRST_TOKEN_ABLATION]().removes() == 1 and not is_full_cache(FIRST_TOKEN_ABLATION)


# --- statistics and verdict rules ---------------------------------------------------------------------------------


def test_wilson_intervals_stay_honest_at_the_ends():
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson_interval(10, 10) == pytest.approx((0.7225, 1.0), abs=1e-4)
    assert wilson_interval(47, 100) == pytest.approx((0.3751, 0.5671), abs=1e-4)
    with pytest.raises(ValueError):
        wilson_interval(3, 2)


def test_perplexity_pools_texts_by_their_tokens():
    assert pooled_perplexity([math.log(4.0)], [10]) == pytest.approx(4.0)
    assert pooled_perplexity([math.log(2.0), math.log(8.0)], [100, 100]) == pytest.approx(4.0)
    assert pooled_perplexity([math.log(2.0), math.log(8.0)], [300, 100]) == pytest.approx(2.0**1.5)


def test_verdict_rules():
    assert about(42.9, 40) and about(42.9, 43) and not about(42.9, 20)
    assert about_count(3, 4) and about_count(19, 20) and not about_count(14, 4) and not about_count(17, 20)
    assert combine([("in prefill mode", True), ("in streaming mode", True)]) == (HOLDS, None)
    assert combine([("in prefill mode", False), ("in streaming mode", False)]) == (FAILS, None)
    assert combine([("in prefill mode", True), ("in streaming mode", False)]) == (CONDITIONAL, "in prefill mode")
    assert verdict_of("holds only under a condition: in prefill mode") == CONDITIONAL
    with pytest.raises(ValueError):
        Evaluation(HOLDS)  # neither a figure nor a reason
    with pytest.raises(ValueError):
        Evaluation(CONDITIONAL, figure="1 GB")  # a condition must be said
    with pytest.raises(ValueError):
        Evaluation(UNMEASURABLE, figure="1 GB")  # and a reason given
    assert Evaluation(CONDITIONAL, figure="1 GB", condition="in prefill mode").verdict_text == (
        "holds only under a condition: in prefill mode"
    )


# --- the catalogue on an empty store --------------------------------------------------------------------------------


@pytest.fixture
def nothing(tmp_path) -> Evidence:
    """No store file and no benchmark results."""
    return Evidence(None, tmp_path / "none.duckdb", tmp_path / "no-results")


def test_the_catalogue_holds_the_36_listed_claims_and_more():
    ids = [claim.claim_id for claim in CATALOGUE]
    assert ids == [str(number) for number in range(1, len(ids) + 1)] and len(ids) >= 36
    assert len(BY_ID) == len(ids)
    assert {claim.article for claim in CATALOGUE} == {"002", "003", "004"}
    assert check_ids(["5", "5", "9"]) == ["5", "9"]
    with pytest.raises(KvlabError, match="no claim 99"):
        check_ids(["99"])


def test_every_claim_evaluates_on_an_empty_store(nothing):
    for row in evaluate_all(nothing):
        claim = BY_ID[row.claim_id]
        assert row.figure or row.reason, row
        assert verdict_of(row.verdict) in VERDICTS and row.command, row
        if claim.source == "measured":
            assert verdict_of(row.verdict) == UNMEASURABLE and row.reason, row
            assert row.reason.endswith(f"; run: {row.command}"), row
            assert "no runs of" in row.reason or "no attention profile" in row.reason, row
        if claim.source == "computed":
            assert row.figure and verdict_of(row.verdict) != UNMEASURABLE and row.device.startswith("formula"), row
        if claim.source == "not measurable":
            assert verdict_of(row.verdict) == UNMEASURABLE and row.reason, row


@pytest.mark.slow
def test_no_claim_loads_torch_to_be_evaluated(tmp_path):
    code = (
        "import sys; from pathlib import Path; from kvlab.claims import evaluate_file; "
        f"evaluate_file(Path({str(tmp_path / 'x.duckdb')!r})); "
        "print('torch' in sys.modules, 'transformers' in sys.modules)"
    )
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert shown == "False False"


# --- figures computed with kvlab.costs ------------------------------------------------------------------------------


def evaluated(claim_id: str, evidence: Evidence):
    return record(BY_ID[claim_id], evidence)


def test_the_presets_read_as_written_give_the_sizes_transformers_derives():
    for spec in MODEL_PRESETS.values():
        assert kv_bytes_per_token(spec.written_arch, "fp16") == kv_bytes_per_token(spec.arch, "fp16"), spec.name
        assert kv_bytes_for_sequence(spec.written_arch, 131072, "fp16") == kv_bytes_for_sequence(
            spec.arch, 131072, "fp16"
        ), spec.name


def test_computed_figures_are_kvlab_costs_figures(nothing):
    llama70 = MODEL_PRESETS["Llama-3-70B"].arch
    assert kv_bytes_per_token(llama70, "fp16") == 327_680
    five = evaluated("5", nothing)
    assert "327,680 bytes" in five.figure and five.verdict == FAILS  # twice the article's 160 KB
    one = evaluated("1", nothing)
    size = kv_bytes_for_sequence(llama70, 128 * 1024, "fp16")
    assert f"{size / 1e9:.1f} GB" in one.figure and one.verdict == FAILS  # 42.9 GB, not 20
    assert evaluated("2", nothing).verdict == HOLDS  # 344 GB is past 160 GB
    assert evaluated("3", nothing).figure.startswith("2 bytes") and evaluated("3", nothing).verdict == FAILS
    assert evaluated("4", nothing).verdict == FAILS  # 64 query and 8 KV heads; 80 is the number of layers
    assert evaluated("7", nothing).verdict == HOLDS  # 42.9 GB: about 40 and about 43


def test_concurrency_on_an_a100_holds_only_for_a_70b_with_4_bit_weights(nothing):
    gpu, spec = GPU_PRESETS["A100 80GB SXM"], MODEL_PRESETS["Llama-3-70B"]
    fit = [
        sequences_that_fit(
            gpu.memory_bytes, weight_bytes(spec.params, "int4"), kv_bytes_for_sequence(spec.arch, 32768, "fp16", k)
        )
        for k in (1.0, 0.2)
    ]
    row = evaluated("23", nothing)
    assert f"Llama-3-70B, int4 weights: {fit[0]} → {fit[1]}" in row.figure
    assert row.verdict == "holds only under a condition: for Llama-3-70B with 4-bit weights"


def test_pyramid_budgets_follow_the_policys_own_schedule(nothing):
    assert PyramidKV().beta == PYRAMID_BETA
    budgets = PyramidKV(window=8).layer_budgets(40, 4)
    assert budgets == [8 + round(share) for share in pyramid_shares(32, PYRAMID_BETA, 4)] or sum(budgets) == 160
    row = evaluated("33", nothing)
    assert "100%/72%/44%/16%" in row.figure  # beta 20: a linear fall, not the article's 100/70/50/30
    assert verdict_of(row.verdict) == CONDITIONAL and "beta" in row.verdict


# --- figures measured from a store -----------------------------------------------------------------------------------


def run(store: Store, policy: str, *, task: str = "needle", mode: str = "prefill", **config) -> int:
    return store.begin_run(RunConfig(model="/models/m", policy=policy, mode=mode, task=task, device="cuda", **config))


def needle(store: Store, policy: str, keep: float | None, correct: int, of: int = 100, mode: str = "prefill") -> None:
    run_id = run(store, policy, mode=mode, keep=keep, context_length=4096)
    store.add_trials(
        run_id, [Trial(trial_key=str(i), task_id="t", context_tokens=4096, correct=i < correct) for i in range(of)]
    )


def hashed_needle(store: Store, policy: str, keep: float | None, correct: list[bool], mode: str = "prefill") -> None:
    """A needle run whose trials name the items they answered, so that runs on the same items pair up."""
    run_id = run(store, policy, mode=mode, keep=keep, context_length=4096)
    store.add_trials(
        run_id,
        [
            Trial(trial_key=str(i), task_id="t", context_tokens=4096, correct=ok, item_hash=f"item-{i}")
            for i, ok in enumerate(correct)
        ],
    )


def text_pass(store: Store, policy: str, ppl: float, *, scored: int = 1024, seconds: float = 1.0, **config) -> None:
    config.setdefault("context_length", 1280)
    run_id = run(store, policy, task="quality:doc", mode="streaming", stop_rule="none", max_new_tokens=scored, **config)
    store.add_trial(
        run_id,
        Trial(
            trial_key="doc",
            task_id="doc",
            context_tokens=config["context_length"],
            correct=None,
            item_hash=f"doc-{config['context_length']}",
            scored_tokens=scored,
            nll=math.log(ppl),
            kl=0.1,
            decode_s=seconds,
        ),
    )


@pytest.fixture
def evidence(store, tmp_path) -> Evidence:
    """What the store holds: an evaluation reads the store once, so a test that adds trials asks again."""
    return Evidence(store, store.path, tmp_path / "results")


@pytest.mark.slow
def test_needle_claims_from_stored_trials(store, evidence):
    needle(store, FULL_CACHE, None, 20, of=20)
    needle(store, "h2o", 0.2, 20, of=20)  # 80% pruned: every needle, in prefill mode
    needle(store, "h2o", 0.3, 12, of=20, mode="streaming")  # 70% pruned, fewer in streaming mode: refutes 80%
    for keep, accuracy in zip((0.9, 0.7, 0.5, 0.3, 0.1), PUBLISHED_NEEDLE_CLAIM["streaming"]):
        needle(store, "streaming", keep, int(accuracy))  # exactly the article's row
    needle(store, "snapkv", 0.1, 19, of=20)  # 90% pruned, 5 points below the full cache
    needle(store, "snapkv", 0.3, 18, of=20)
    needle(store, "random", 0.3, 11, of=20, mode="streaming")  # within h2o's interval in streaming mode
    assert evaluated("8", evidence).verdict == "holds only under a condition: in prefill mode"
    nine = evaluated("9", evidence)
    assert nine.verdict == "holds only under a condition: for streaming in prefill mode"
    assert "5 of 5 published cells inside" in nine.figure and nine.model == "/models/m" and nine.device == "cuda"
    assert evaluated("24", evidence).verdict == UNMEASURABLE  # the full cache finds every needle: nothing beats it
    assert evaluated("28", evidence).verdict == HOLDS
    assert evaluated("36", evidence).verdict == "holds only under a condition: in prefill mode"  # 90 against 30
    assert "--db" in nine.command and str(store.path) in nine.command


@pytest.mark.slow
def test_a_pruned_cache_above_a_fallible_full_cache(store, evidence):
    needle(store, FULL_CACHE, None, 80)
    needle(store, "tova", 0.5, 100)  # Wilson: 96.3-100 lies above 80's 71.1-86.7
    assert evaluated("24", evidence).verdict == HOLDS
    cells = needle_cells(store.trials_frame())
    assert cells.loc[cells["policy"] == "tova", "high"].iloc[0] == pytest.approx(100.0)


@pytest.mark.slow
def test_claims_setting_two_cells_against_each_other_test_them_in_pairs(store, evidence):
    hashed_needle(store, FULL_CACHE, None, [True] * 24 + [False] * 6)
    hashed_needle(store, "tova", 0.5, [True] * 30)  # right on the 6 items the full cache misses
    hashed_needle(store, "h2o", 0.3, [True] * 20 + [False] * 10)
    hashed_needle(store, "streaming", 0.3, [True] * 14 + [False] * 16)
    twenty_four = evaluated("24", evidence).figure
    assert "paired on 30 items, only full right on 0, only tova right on 6, McNemar p = 0.031 (exact)" in twenty_four
    thirty_six = evaluated("36", evidence).figure
    assert "paired on 30 items, only h2o right on 6, only streaming right on 0, McNemar p = 0.031" in thirty_six
    nine = evaluated("9", evidence).figure
    assert "streaming prefill 47% (95% intervals 30–64;" in nine  # every printed accuracy with its interval
    hashed_needle(store, "random", 0.3, [True] * 9)  # 9 items: too few to pair, so no test is printed
    assert "McNemar" not in evaluated("36", Evidence(store, store.path, evidence.results)).figure.split("random")[-1]


def test_sink_ablation_from_stored_text_passes(store, evidence):
    text_pass(store, FULL_CACHE, 10.0)
    for budget, by_sinks in ((128, {0: 30.0, 4: 12.0, 32: 11.5}), (64, {0: 40.0, 4: 20.0, 32: 12.0})):
        for sinks, ppl in by_sinks.items():
            text_pass(store, "streaming", ppl, budget_tokens=budget, policy_params={"sinks": sinks})
    nineteen = evaluated("19", evidence)
    assert nineteen.verdict == "holds only under a condition: at 128 tokens"  # 12 within 10% of 11.5; 20 is not
    assert "full cache 10.00" in nineteen.figure
    assert evaluated("20", evidence).verdict == UNMEASURABLE and "drop_first" in evaluated("20", evidence).reason
    text_pass(store, FIRST_TOKEN_ABLATION, 55.0)  # +450%
    twenty = evaluated("20", Evidence(store, store.path, evidence.results))
    assert twenty.verdict == HOLDS and "+450%" in twenty.figure


def test_a_first_token_ablation_too_short_or_too_mild(store, evidence):
    text_pass(store, FULL_CACHE, 10.0, scored=500)
    text_pass(store, FIRST_TOKEN_ABLATION, 60.0, scored=500)
    short = evaluated("20", evidence)
    assert short.verdict == UNMEASURABLE and short.figure and "500 tokens" in short.reason
    text_pass(store, FULL_CACHE, 10.0, context_length=2048)
    text_pass(store, FIRST_TOKEN_ABLATION, 20.0, context_length=2048)  # +100% on another pass, 1,024 tokens
    text_pass(store, "streaming", 30.0, context_length=2048, budget_tokens=128)  # the pass with the most trials
    assert evaluated("20", Evidence(store, store.path, evidence.results)).verdict == FAILS


def test_short_context_overhead_from_decode_times(store, evidence):
    for length in (2048, 4096):
        text_pass(store, FULL_CACHE, 10.0, seconds=1.0, context_length=length)
        text_pass(store, "h2o", 11.0, seconds=1.3, context_length=length, budget_tokens=256)
        text_pass(store, "streaming", 11.0, seconds=0.8, context_length=length, budget_tokens=256)
    needle(store, "snapkv", 0.5, 10)  # a needle run stops at its answer: its steps are unknown, so it is not timed
    row = evaluated("34", evidence)
    assert row.verdict == "holds only under a condition: for h2o in streaming mode"
    assert "h2o streaming 1.30x" in row.figure and "streaming streaming 0.80x" in row.figure
    assert "snapkv" not in row.figure


def test_short_context_overhead_from_the_timing_benchmark(tmp_path):
    directory = tmp_path / "results" / "overhead"
    directory.mkdir(parents=True)
    rows = [{"context": c, "policy": "full", "keep": None, "total_ms": 10.0} for c in (1024, 4096)]
    rows += [
        {"context": c, "policy": policy, "keep": 0.5, "total_vs_full": ratio, "decode_vs_full": ratio}
        for c in (1024, 4096)
        for policy, ratio in (("h2o", 1.2), ("streaming", 0.9))
    ]
    run = {"model": "m", "device": "NVIDIA H100 80GB HBM3", "mode": "prefill", "rows": rows}
    (directory / "m.json").write_text(
        json.dumps({**run, "command": "python bench/short_context_overhead.py --model m"})
    )
    row = evaluated("34", Evidence(None, tmp_path / "none.duckdb", tmp_path / "results"))
    assert row.verdict == "holds only under a condition: for h2o"
    assert "h2o 1.20x" in row.figure and "1,024 to 4,096 tokens" in row.figure
    assert row.device == "NVIDIA H100 80GB HBM3" and row.command.endswith("--model m")
    (directory / "m.json").write_text(json.dumps(run))  # no command: not a result of the benchmark
    broken = evaluated("34", Evidence(None, tmp_path / "none.duckdb", tmp_path / "results"))
    assert (
        broken.verdict == UNMEASURABLE and "m.json is not a short-context timing (it has no command)" in broken.reason
    )


def profile(results: Path, name: str, shares: list[float], entropies: list[float]) -> None:
    directory = results / "attention"
    directory.mkdir(parents=True, exist_ok=True)
    layers = [{"layer": i, "first_token_share": s, "entropy": e} for i, (s, e) in enumerate(zip(shares, entropies))]
    data = {"model": name, "device": "NVIDIA H100", "command": f"python bench/attention_profile.py --model {name}"}
    (directory / f"{name}.json").write_text(json.dumps({**data, "layers": layers}))


def test_attention_claims_from_profiles(tmp_path):
    evidence = Evidence(None, tmp_path / "none.duckdb", tmp_path / "results")
    profile(tmp_path / "results", "sinky", [0.6, 0.7, 0.2], [3.0, 2.0, 1.0])
    assert evaluated("29", evidence).verdict == HOLDS
    eleven = evaluated("11", evidence)
    assert eleven.verdict == HOLDS and eleven.device == "NVIDIA H100" and "--model sinky" in eleven.command
    evidence = Evidence(None, tmp_path / "none.duckdb", tmp_path / "results")
    profile(tmp_path / "results", "flat", [0.1, 0.6, 0.1, 0.1], [2.0, 2.0, 2.0, 2.05])
    assert evaluated("29", evidence).verdict == "holds only under a condition: on sinky; in layers 1 of flat"
    assert evaluated("11", evidence).verdict == "holds only under a condition: on sinky"


def test_a_file_that_is_no_profile_is_the_reason(tmp_path):
    (tmp_path / "results" / "attention").mkdir(parents=True)
    (tmp_path / "results" / "attention" / "broken.json").write_text('{"model": "m"}')
    row = evaluated("29", Evidence(None, tmp_path / "none.duckdb", tmp_path / "results"))
    assert row.verdict == UNMEASURABLE and "broken.json is not an attention profile (it has no device" in row.reason


# --- the claims table ------------------------------------------------------------------------------------------------


def test_refresh_replaces_the_claims_table(store):
    first = refresh(store, results=store.path.parent / "results")
    frame = store.claims_frame()
    assert frame["claim_id"].tolist() == [row.claim_id for row in first]  # numeric order: 9 before 10
    assert frame.loc[frame["claim_id"] == "5", "figure"].iloc[0] == BY_ID["5"].evaluate(None).figure  # type: ignore[arg-type]
    needle(store, FULL_CACHE, None, 10, of=10)
    needle(store, "h2o", 0.2, 10, of=10)
    refresh(store, results=store.path.parent / "results")
    again = store.claims_frame()
    assert len(again) == len(CATALOGUE)
    assert again.loc[again["claim_id"] == "8", "verdict"].iloc[0] == HOLDS
    assert (again["refreshed_at"] >= frame["refreshed_at"].max()).all()


def test_a_read_only_store_keeps_its_claims(store):
    refresh(store)
    reader = open_store(store.path, read_only=True)
    assert len(reader.claims_frame()) == len(CATALOGUE)
    with pytest.raises(ValueError, match="read-only"):
        reader.replace_claims([])
