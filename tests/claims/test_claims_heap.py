"""The claims on the cache as a managed heap (12, 13, 16, 18, 21, 27, 35), each verdict rule tested both ways on
stores filled with known trials; the cache options read from stored parameters without torch; the heavy-hitter
ablation's choice of tokens; and the commands, the GPU script and the stored names agreeing with each other."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from tiny_models import prompt, tiny_model

from kvlab.cache.layer import FREE, AttentionShape, HeapLayer
from kvlab.cache.spec import CacheOptions, CacheSpec
from kvlab.claims import BY_ID, Evidence
from kvlab.claims.commands import (
    ALLOCATIONS,
    BIT_WIDTHS,
    GENERATIONAL,
    HYBRID,
    PRECISION_BASES,
    PRESET_KEEPS,
    QUANTISED,
    bits_variant,
    quality_budget,
    with_options,
)
from kvlab.claims.evaluate import record
from kvlab.claims.evidence import SIDE_CHANNEL_FORMAT
from kvlab.claims.needle import measured_table, needle_cells, plain
from kvlab.claims.options import cache_options, variant
from kvlab.claims.pillars import ABLATION
from kvlab.claims.verdicts import FAILS, HOLDS, UNMEASURABLE, verdict_of
from kvlab.engine.generation import Generation
from kvlab.engine.spec import RunSpec
from kvlab.errors import KvlabError
from kvlab.models.loading import wrap_model
from kvlab.policies import LayerView, configure, make_policy
from kvlab.policies.drop_pillars import DropPillars
from kvlab.runs.sweep import parse_policies
from kvlab.stats import wilson_interval
from kvlab.store import RunConfig, Store, Trial
from kvlab.store.rows import canonical_json

REPO = Path(__file__).resolve().parents[2]
MODEL = "m"
SNAPKV = {"window": 32, "kernel": 7, "pooling": "max"}
H2O = {"recent_ratio": 0.5}


def evaluated(claim_id: str, store: Store | None, results: Path):
    return record(BY_ID[claim_id], Evidence(store, store.path if store is not None else results / "none", results))


def run(store: Store, policy: str, params: dict, **config) -> int:
    config.setdefault("task", "needle")
    config.setdefault("mode", "prefill")
    return store.begin_run(RunConfig(model=MODEL, policy=policy, policy_params=params, device="cuda (H100)", **config))


def needle(
    store: Store,
    policy: str,
    params: dict,
    keep: float | None,
    correct: int,
    *,
    kv_bytes: int = 1000,
    of: int = 100,
    **config,
) -> None:
    run_id = run(store, policy, params, keep=keep, context_length=4096, **config)
    trials = [
        Trial(trial_key=str(i), task_id="t", context_tokens=4096, correct=i < correct, kv_bytes=kv_bytes)
        for i in range(of)
    ]
    store.add_trials(run_id, trials)


def text_pass(store: Store, policy: str, params: dict, ppl: float, budget: int | None, mode: str = "prefill") -> None:
    run_id = run(
        store,
        policy,
        params,
        task="quality:doc",
        mode=mode,
        budget_tokens=budget,
        stop_rule="none",
        max_new_tokens=1024,
        context_length=4096,
    )
    store.add_trial(
        run_id,
        Trial(
            trial_key="doc",
            task_id="doc",
            context_tokens=4096,
            correct=None,
            item_hash="doc",
            scored_tokens=1024,
            nll=math.log(ppl),
            kl=0.1,
        ),
    )


# --- stored parameters, commands and the script ---------------------------------------------------------------------


def test_a_stored_run_s_cache_options_are_read_with_their_defaults():
    stored = canonical_json(configure("h2o", hot=0.25, key_bits=4, value_bits=4).params())
    assert cache_options(stored) == {**CacheOptions.defaults(), "hot": 0.25, "key_bits": 4, "value_bits": 4}
    assert variant("h2o", canonical_json(make_policy("h2o").params())) == "h2o"
    assert variant("h2o", None) == "h2o" and cache_options(float("nan"))["hot"] == 1.0  # a missing value


def test_every_variant_a_command_names_is_the_name_its_stored_runs_get():
    names = [*ALLOCATIONS, *(bits_variant(k, v) for k, v in BIT_WIDTHS), *GENERATIONAL]
    names += [with_options(base, options) for base in PRECISION_BASES for options in (HYBRID, QUANTISED)]
    for name in names:
        (policy,) = parse_policies(name)
        shown = variant(policy.name, canonical_json(policy.params()))
        assert shown == (name if policy.name != "generational" else "generational"), name
    assert bits_variant(4, 16) == "snapkv[hot=0,key_bits=4]" and quality_budget(0.2) == 615


def test_the_gpu_script_runs_what_the_claims_commands_name():
    script = (REPO / "bench" / "heap_claims.sh").read_text()
    for claim_id in ("12", "13", "16", "21", "27", "35"):
        command = record(BY_ID[claim_id], Evidence(None, REPO / "none.duckdb", REPO / "no-results")).command
        for listed in re.findall(r"--policies '?([^' ]+)'?", command):
            for name in re.findall(r"[a-z_0-9]+(?:\[[^\]]*\])?", listed):
                assert name in script, (claim_id, name)
        for keeps in re.findall(r"--keep ([0-9.,]+)", command):
            assert f"--keep {keeps}" in script or all(keep in script for keep in keeps.split(",")), (claim_id, keeps)
    assert ",".join(f"{keep:g}" for keep in PRESET_KEEPS) == "0.085,0.17,0.255"


def test_names_read_without_torch_are_those_of_the_modules_that_write_them():
    from kvlab.experiments.sidechannel import RESULT_FORMAT

    assert SIDE_CHANNEL_FORMAT == RESULT_FORMAT and ABLATION == DropPillars.name


@pytest.mark.slow
def test_needle_cells_keep_variants_apart_and_the_methods_claims_read_only_the_methods(store, tmp_path):
    needle(store, "full", {}, None, 100)
    needle(store, "h2o", H2O, 0.2, 100)  # 80% pruned: every needle
    hybrid = {**H2O, "hot": 0.25, "key_bits": 4, "value_bits": 4}
    needle(store, "h2o", hybrid, 0.2, 0, kv_bytes=90)
    cells = needle_cells(store.trials_frame())
    assert sorted(cells["variant"]) == ["h2o", with_options("h2o", HYBRID)]
    assert plain(cells)["accuracy"].tolist() == [100.0] and cells["kv_bytes"].tolist() != [1000.0, 1000.0]
    assert evaluated("8", store, tmp_path).verdict == HOLDS  # the hybrid's misses are not H2O's
    assert list(measured_table(store.trials_frame()).index) == ["h2o prefill (kvlab)"]


# --- the heavy-hitter ablation ------------------------------------------------------------------------------------


def pillar_view(scores: list[float], positions: list[int], window: int | None = None) -> LayerView:
    layer = HeapLayer(
        positions=torch.tensor([[positions]]),
        scores=torch.tensor([[scores]]),
        shape=AttentionShape(sliding_window=window),
        live=sum(p >= 0 for p in positions),
        used=len(positions),
    )
    return LayerView(0, 1, layer, 1 << 30, 1 << 30, max(positions) + 1, torch.Generator(), len(positions))


def test_the_ablation_removes_the_heaviest_hitters_past_the_sinks():
    view = pillar_view([9.0, 5.0, 1.0, 4.0, 4.0, 8.0, 0.5], [0, 1, 2, 3, 4, FREE, 6])
    removed = DropPillars(count=2, sinks=1).removed(view)[0, 0].tolist()
    assert removed == [False, True, False, False, True, False, False]  # 9.0 is a sink, 8.0 a free slot; a tie to 4
    assert DropPillars(count=1, sinks=0).removed(view)[0, 0].tolist()[0]  # without sinks the first token goes
    windowed = pillar_view([1.0, 7.0, 2.0, 3.0], [0, 1, 2, 3], window=3)  # position 1 is outside the window
    assert DropPillars(count=1, sinks=0).removed(windowed)[0, 0].tolist() == [False, False, False, True]
    assert DropPillars(count=3).removes() == 3


def snapshot(layer: HeapLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's positions and accumulated attention as they are now."""
    assert layer.positions is not None and layer.scores is not None
    return layer.positions.clone(), layer.scores.clone()


@pytest.mark.parametrize("layout", ["compact", "bitmask"])
def test_the_compression_removes_exactly_the_heaviest_hitters(layout):
    """Read a prompt, snapshot every layer's accumulated attention just before prefill mode's compression, and find
    after it exactly the held tokens but the ``count`` heaviest past the sinks, in every layer and KV head."""
    loaded = wrap_model(tiny_model("llama"))
    policy = DropPillars(count=3, sinks=2)
    generation = Generation(
        loaded, RunSpec(policy, mode="prefill", max_new_tokens=0, cache=CacheSpec(layout=layout)), prompt(2, 30)
    )
    before: list[tuple[torch.Tensor, torch.Tensor]] = []
    for event in generation.events():
        if event.kind == "prefill":
            before = [snapshot(layer) for layer in generation.cache.layers]
        else:
            assert event.kind == "compress"
            after = event.survivors()
    for (positions, scores), held in zip(before, after):
        candidates = (positions >= 2).float()
        ranking = (scores + 1e-6 * positions) * candidates - (1 - candidates)  # ties to the later token
        removed = positions.gather(-1, ranking.topk(3, dim=-1).indices).sort(dim=-1).values
        kept = [[sorted(set(range(30)) - set(heads.tolist())) for heads in sequence] for sequence in removed]
        assert held.tolist() == kept


def test_the_ablation_is_a_prefill_mode_ablation_with_checked_parameters():
    with pytest.raises(KvlabError, match="prefill mode"):
        DropPillars().check_mode("streaming")
    with pytest.raises(KvlabError, match="count"):
        DropPillars(count=0)
    assert not DropPillars.evicts and DropPillars.needs_scores


# --- claim 12: the preset's budgets ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_preset_saves_memory_where_it_keeps_the_uniform_accuracy(store, tmp_path):
    preset = {**SNAPKV, "layer_allocation": "preset"}
    needle(store, "snapkv", SNAPKV, 0.1, 50, kv_bytes=1000)
    needle(store, "snapkv", preset, 0.1, 52, kv_bytes=1000)  # the same bytes: no saving to compare
    needle(store, "snapkv", preset, 0.085, 47, kv_bytes=860)
    needle(store, "snapkv", SNAPKV, 0.2, 70, kv_bytes=2000)
    needle(store, "snapkv", preset, 0.17, 50, kv_bytes=1720)
    row = evaluated("12", store, tmp_path)
    assert row.verdict == "holds only under a condition: at 10% kept"
    assert "preset with 86% of its KV bytes (keeping 8.5%) 47%" in row.figure and "saves nothing" in row.figure


def test_the_preset_without_runs_gives_the_formula(tmp_path):
    row = evaluated("12", None, tmp_path)
    assert verdict_of(row.verdict) == UNMEASURABLE and "no runs of" in row.reason and "100%" in row.figure


# --- claims 16, 27 and 35: precision -----------------------------------------------------------------------------


def bits(key: int, value: int) -> dict:
    return {
        **SNAPKV,
        "hot": 0.0,
        **({"key_bits": key} if key != 16 else {}),
        **({"value_bits": value} if value != 16 else {}),
    }


@pytest.mark.slow
def test_keys_need_four_bits_and_values_survive_two(store, tmp_path):
    needle(store, "full", {}, None, 100)
    for (key, value), correct in {(8, 16): 100, (4, 16): 98, (2, 16): 40, (16, 2): 97}.items():
        needle(store, "snapkv", bits(key, value), 1.0, correct)
    row = evaluated("27", store, tmp_path)
    assert row.verdict == HOLDS and "K2/V16: needle 40%" in row.figure
    text_pass(store, "full", {}, 10.0, None)
    text_pass(store, "snapkv", bits(16, 2), 13.0, quality_budget(1.0))  # x1.3: values lose at 2 bits
    text_pass(store, "snapkv", bits(2, 16), 10.5, 999)  # another budget: not the claim's pass
    row = evaluated("27", store, tmp_path)
    assert row.verdict == "holds only under a condition: keys at 4 bits suffice; keys at 2 bits fall short"
    assert "K16/V2: needle 97%" in row.figure and "perplexity x1.300" in row.figure


@pytest.mark.slow
def test_keys_that_survive_two_bits_refute_the_need_for_four(store, tmp_path):
    needle(store, "full", {}, None, 100)
    needle(store, "snapkv", bits(2, 16), 1.0, 99)
    assert evaluated("27", store, tmp_path).verdict == FAILS  # only the 2-bit reading, and it does not fall short


@pytest.mark.slow
def test_the_hybrid_saves_its_92_percent_only_when_the_bytes_say_so(store, tmp_path):
    needle(store, "full", {}, None, 100, kv_bytes=1000)
    needle(store, "h2o", {**H2O, "hot": 0.25, "key_bits": 4, "value_bits": 4}, 0.2, 99, kv_bytes=80)
    needle(store, "h2o", H2O, 0.2, 99)
    row = evaluated("16", store, tmp_path)
    assert row.verdict == HOLDS and "92.0% of the KV bytes saved" in row.figure and "in 16 bits: 99%" in row.figure
    needle(store, "snapkv", {**SNAPKV, "hot": 0.25, "key_bits": 4, "value_bits": 4}, 0.2, 90, kv_bytes=110)
    text_pass(store, "full", {}, 10.0, None)
    text_pass(store, "h2o", {**H2O, "hot": 0.25, "key_bits": 4, "value_bits": 4}, 10.2, quality_budget(0.2))
    row = evaluated("16", store, tmp_path)
    assert row.verdict == "holds only under a condition: in memory with h2o; in needle accuracy with h2o"
    assert "perplexity x1.020" in row.figure and "formula:" in row.figure


@pytest.mark.slow
def test_four_bits_and_90_percent_eviction_against_40x(store, tmp_path):
    needle(store, "full", {}, None, 100, kv_bytes=4000)
    needle(store, "snapkv", {**SNAPKV, "hot": 0.0, "key_bits": 4, "value_bits": 4}, 0.1, 99, kv_bytes=100)
    row = evaluated("35", store, tmp_path)
    assert row.verdict == HOLDS and "40.0x less KV" in row.figure
    needle(store, "h2o", {**H2O, "hot": 0.0, "key_bits": 4, "value_bits": 4}, 0.1, 90, kv_bytes=160)
    assert evaluated("35", store, tmp_path).verdict == (
        "holds only under a condition: in memory with snapkv; in accuracy with snapkv"
    )


def test_precision_claims_without_runs_keep_the_formula(tmp_path):
    for claim_id, shown in (("16", "saved with 5% of all tokens"), ("35", "x with per-tensor scales")):
        row = evaluated(claim_id, None, tmp_path)
        assert verdict_of(row.verdict) == UNMEASURABLE and "no runs of" in row.reason and shown in row.figure


# --- claim 21: the generational cache ----------------------------------------------------------------------------


def ranked(store: Store, policy: str, params: dict, slots: int, seconds: float, correct: int = 50) -> None:
    run_id = run(store, policy, params, mode="streaming", keep=0.2, context_length=4096, layout="compact")
    trials = [
        Trial(
            trial_key=str(i),
            task_id="t",
            context_tokens=4096,
            correct=i < correct,
            ranked_slots=slots,
            ranking_s=seconds,
        )
        for i in range(100)
    ]
    store.add_trials(run_id, trials)


@pytest.mark.slow
def test_the_generational_cache_cuts_what_h2o_ranks(store, tmp_path):
    tiers = {"young": 0.1, "middle": 0.1, "major_every": 64}
    ranked(store, "h2o", H2O, 10_000, 0.010)
    ranked(store, "generational", tiers, 1_500, 0.0095, correct=48)
    row = evaluated("21", store, tmp_path)
    assert row.verdict == (
        "holds only under a condition: generational (young 10%, middle 10%, old re-ranked every 64 tokens) on "
        "needles at 20% kept (compact layout), in slots ranked"
    )
    assert "85% fewer slots, 5% less time" in row.figure and "needle 48%" in row.figure


@pytest.mark.slow
def test_a_generational_cache_ranking_most_of_the_cache_does_not_cut_80_percent(store, tmp_path):
    ranked(store, "h2o", H2O, 10_000, 0.010)
    ranked(store, "generational", {"young": 0.1, "middle": 0.3, "major_every": 64}, 6_000, 0.009)
    needle(store, "h2o", H2O, 0.3, 50, mode="streaming")  # no ranking counted (an older store): left out
    assert evaluated("21", store, tmp_path).verdict == FAILS
    assert "no runs of" in evaluated("21", None, tmp_path).reason


# --- claim 13: the heavy-hitter ablation --------------------------------------------------------------------------


def entropy_file(results: Path, full: list[float], ablated: list[float]) -> None:
    directory = results / "pillars"
    directory.mkdir(parents=True, exist_ok=True)
    configurations = [
        {"policy": "full", "params": {}, "entropy": full},
        {"policy": ABLATION, "params": {"count": 32, "sinks": 4}, "entropy": ablated},
    ]
    data = {
        "model": MODEL,
        "device": "NVIDIA H100",
        "command": "python bench/pillar_entropy.py --model m",
        "trials": 20,
        "configurations": configurations,
    }
    (directory / f"{MODEL}.json").write_text(json.dumps(data))


@pytest.mark.slow
def test_pillars_removed_raise_entropy_and_lose_needles(store, tmp_path):
    needle(store, "full", {}, None, 95, query_aware=False)
    needle(store, ABLATION, {"count": 32, "sinks": 4}, None, 60, query_aware=False)
    half = evaluated("13", store, tmp_path)  # accuracy without entropy is half the claim
    assert verdict_of(half.verdict) == UNMEASURABLE and "removing 32: 60%" in half.figure
    entropy_file(tmp_path, [2.0, 1.0], [2.4, 1.1])
    row = evaluated("13", store, tmp_path)
    assert row.verdict == HOLDS and "higher in 2 of 2 layers" in row.figure and row.device == "cuda (H100), NVIDIA H100"
    entropy_file(tmp_path, [2.0, 1.0], [1.9, 1.0])
    assert (
        evaluated("13", store, tmp_path).verdict == "holds only under a condition: removing 32 per KV head, in accuracy"
    )


@pytest.mark.slow
def test_pillars_that_cost_no_needles_refute_the_claim(store, tmp_path):
    needle(store, "full", {}, None, 95, query_aware=False)
    needle(store, ABLATION, {"count": 32, "sinks": 4}, None, 90, query_aware=False)
    entropy_file(tmp_path, [2.0, 1.0], [1.5, 0.9])
    assert evaluated("13", store, tmp_path).verdict == FAILS


# --- claim 18: the noise floor against a timing side channel -------------------------------------------------------


def side_channel_file(results: Path, timing: dict[str, int], retrieved: dict[str, int]) -> None:
    """A result as ``kvlab sidechannel --out`` writes it: levels with the timing channel's test score (of 20)."""
    from kvlab.experiments.sidechannel import ChannelScore, LevelSummary, SideChannelResult, TrialRecord

    def score(channel: str, correct: int | None) -> ChannelScore:
        if correct is None:  # a constant observable, or too few trials of one class
            return ChannelScore(channel, 0.0, None, None, 0, 0, None, None, None, verdict="")
        low, high = wilson_interval(correct, 20)
        return ChannelScore(channel, 1.0, 0.5, True, 20, correct, correct / 20, low, high, verdict="")

    def level(noise: str, kind: str, scale: float) -> LevelSummary:
        low, high = wilson_interval(retrieved[noise], 40)
        return LevelSummary(
            noise=noise,
            kind=kind,
            scale=scale,
            trials=40,
            cached=20,
            retrieved=retrieved[noise],
            retrieval=retrieved[noise] / 40,
            retrieval_low=low,
            retrieval_high=high,
            decode_seconds=0.01,
            channels=[score("decode_time", timing[noise]), score("kv_bytes", None), score("answer", None)],
        )

    trial = TrialRecord(
        trial=0,
        noise="no noise",
        depth=0.9,
        haystack="h",
        canary="QZ-1",
        positions=[3],
        held_share=1.0,
        cached=True,
        answer="QZ-1",
        correct=True,
        observables={},
        token_seconds=[0.01],
        decode_graphs=0,
    )
    result = SideChannelResult(
        model=MODEL,
        device="cuda (H100)",
        dtype="bfloat16",
        policy="h2o",
        params={"recent_ratio": 0.5},
        mode="prefill",
        keep=0.3,
        budget_tokens=308,
        context_tokens=1024,
        new_tokens=16,
        trials=40,
        seed=0,
        depths=(0.4, 1.0),
        canary_sentence="The access code of Ingrid is <code>.",
        question="What is the access code of Ingrid?",
        levels=[level("no noise", "none", 0.0), level("gaussian 0.5", "gaussian", 0.5)],
        records=[trial],
    )
    directory = results / "side_channel"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{MODEL}.json").write_text(json.dumps(result.to_json()))


def test_noise_that_hides_a_timing_channel_cheaply_holds(tmp_path):
    side_channel_file(tmp_path, {"no noise": 18, "gaussian 0.5": 11}, {"no noise": 30, "gaussian 0.5": 29})
    row = evaluated("18", None, tmp_path)
    low, high = wilson_interval(18, 20)
    assert row.verdict == HOLDS and f"timing 90% ({math.floor(100 * low)}–{math.ceil(100 * high)})" in row.figure
    assert row.device == "cuda (H100)"
    assert "--noise gaussian --noise-scale 0.5" in row.command and "--keep 0.3" in row.command


def test_no_timing_channel_leaves_nothing_for_noise_to_prevent(tmp_path):
    side_channel_file(tmp_path, {"no noise": 10, "gaussian 0.5": 10}, {"no noise": 30, "gaussian 0.5": 30})
    row = evaluated("18", None, tmp_path)
    assert row.verdict == FAILS and "nothing for noise to hide" in row.figure
    side_channel_file(tmp_path, {"no noise": 18, "gaussian 0.5": 10}, {"no noise": 30, "gaussian 0.5": 20})
    assert evaluated("18", None, tmp_path).verdict == FAILS  # hidden, at 25 points of retrieval


def test_a_broken_side_channel_file_is_the_reason(tmp_path):
    assert "no runs of the side-channel experiment" in evaluated("18", None, tmp_path).reason
    (tmp_path / "side_channel").mkdir()
    (tmp_path / "side_channel" / "x.json").write_text(json.dumps({"format": "other"}))
    assert "x.json is not a side-channel result" in evaluated("18", None, tmp_path).reason
