"""Quality beyond needles: a held-out text read under a policy, scored by perplexity and by KL divergence from the
full cache; the first-token ablation; quality runs in the store, on the frontier and on the command line."""

from __future__ import annotations

import dataclasses
import json
import math

import pandas as pd
import pytest
import torch
from tiny_models import prompt, tiny_model

from kvlab.budget import Budget
from kvlab.cli import main
from kvlab.dashboard import grid_figures
from kvlab.dashboard.store_figures import frontier_figure
from kvlab.engine.generation import Generation, generate
from kvlab.engine.spec import RunSpec
from kvlab.errors import KvlabError
from kvlab.models.loading import load_model, wrap_model
from kvlab.policies import evicting, is_full_cache, make_policy
from kvlab.policies.base import check_budget
from kvlab.provenance import Provenance
from kvlab.runs import tables
from kvlab.runs.quality import DEFAULT_TEXT, measure, run_quality
from kvlab.runs.records import run_config
from kvlab.store import RunConfig, RunFilter, Store, Trial, export_trials, run_key
from kvlab.tasks.texts import DEFAULT_TOKENS, read_text, scored_tokens, text_pass

PREFIX, SCORED = 8, 40


def streaming(policy: str, budget: int | None = None, **params: object) -> RunSpec:
    return RunSpec(
        make_policy(policy, **params), None if budget is None else Budget(tokens=budget), mode="streaming", chunk=8
    )


@pytest.fixture(scope="module")
def passage(shipped):
    return text_pass(shipped.tokenizer, read_text(DEFAULT_TEXT), "python-docs-1", PREFIX, SCORED)


@pytest.fixture(scope="module")
def tiny(checkpoint):
    return load_model(checkpoint)


@pytest.mark.model
@pytest.mark.slow
def test_the_full_cache_scores_no_kl_and_the_model_s_own_loss(shipped, passage):
    quality = measure(shipped, streaming("full"), passage)
    assert quality.kl == 0.0 and quality.nll == quality.full_nll
    ids = torch.tensor([passage.ids])
    labels = ids.clone()
    labels[:, : passage.prefix] = -100  # transformers' loss over exactly the scored tokens
    with torch.no_grad():
        loss = float(shipped.model(ids, labels=labels).loss)
    assert quality.perplexity == pytest.approx(math.exp(loss), rel=1e-4)
    assert quality.scored_tokens == SCORED and quality.result.tokens[0] == list(passage.ids[PREFIX:])


@pytest.mark.model
@pytest.mark.slow
def test_streaming_llm_at_a_small_budget_predicts_the_text_worse(shipped, passage):
    quality = measure(shipped, streaming("streaming", 12, sinks=4), passage)
    assert quality.kl > 0.01
    assert quality.perplexity > quality.full_perplexity
    assert quality.result.kept_per_layer == [12] * shipped.arch.num_layers
    figures = quality.to_json()
    assert figures["perplexity_ratio"] == pytest.approx(quality.perplexity / quality.full_perplexity)
    assert figures["kv_bytes"] == quality.result.kv_bytes > 0


def test_forcing_the_greedy_tokens_gives_the_greedy_run():
    """Teacher forcing is the decode path with given tokens: forcing what greedy decoding chose gives its logits."""
    loaded = wrap_model(tiny_model("llama"))
    ids = prompt(length=30, seed=4)
    spec = RunSpec(
        make_policy("h2o"), Budget(tokens=10), mode="streaming", chunk=6, max_new_tokens=7, stop_token_ids=()
    )
    greedy = [e.logits for e in Generation(loaded, spec, ids).events() if e.kind == "decode"]
    chosen = torch.tensor([generate(loaded, ids, spec).tokens[0]])
    forced = [e.logits for e in Generation(loaded, spec, ids, forced_ids=chosen).events() if e.kind == "decode"]
    assert all(torch.equal(a, b) for a, b in zip(greedy, forced)) and len(forced) == 7
    with pytest.raises(KvlabError, match="max_new_tokens"):
        Generation(loaded, spec, ids, forced_ids=chosen[:, :3])


@pytest.mark.parametrize("mode", ["streaming", "prefill"])
def test_the_first_token_ablation_keeps_every_token_but_the_first(mode):
    loaded = wrap_model(tiny_model("llama"))
    spec = RunSpec(make_policy("drop_first"), mode=mode, chunk=5, max_new_tokens=6, stop_token_ids=())
    checked = 0
    for event in Generation(loaded, spec, prompt(length=23)).events():
        if mode == "prefill" and event.kind == "prefill":
            continue  # prefill mode removes it at its one compression
        expected = torch.arange(1, event.seen_tokens, dtype=torch.int32)
        for held in event.survivors():
            assert held.shape == (1, loaded.arch.num_kv_heads, event.seen_tokens - 1)
            assert (held == expected).all()
        checked += 1
    assert checked >= 7
    static = dataclasses.replace(spec, static=True)  # the host's counts of a static step agree
    assert generate(loaded, prompt(length=23), static).tokens == generate(loaded, prompt(length=23), spec).tokens


@pytest.mark.model
def test_the_first_token_ablation_is_its_own_run_and_no_method(shipped):
    assert "drop_first" not in evicting() and not is_full_cache("drop_first")
    with pytest.raises(KvlabError, match="takes no budget"):
        check_budget(make_policy("drop_first"), Budget(tokens=10), 100)
    keys = {
        name: run_key(
            run_config(
                shipped, streaming(name), task="t", task_hash="h", stop_rule="none", query_aware=None, context_length=9
            )
        )
        for name in ("full", "drop_first")
    }
    assert keys["full"] != keys["drop_first"]
    assert tables.run_label("drop_first", "streaming") == "drop_first · streaming · full cache"
    runs = pd.DataFrame({"policy": ["full", "drop_first", "h2o", "h2o"], "keep": [None, None, 0.1, 0.3]})
    assert grid_figures.at_budget(runs, 0.1)["policy"].tolist() == [
        "full",
        "drop_first",
        "h2o",
    ]  # shown on the needle grid


@pytest.mark.slow
def test_a_quality_run_is_stored_and_found_again(tiny, store):
    text = read_text(DEFAULT_TEXT)
    passage = text_pass(tiny.tokenizer, text, "python-docs-1", 4, 24)
    first, run_id = run_quality(tiny, streaming("streaming", 8, sinks=2), passage, store)
    again, same_id = run_quality(tiny, streaming("streaming", 8, sinks=2), passage, store)
    _, other_id = run_quality(tiny, streaming("streaming", 10, sinks=2), passage, store)
    longer = text_pass(tiny.tokenizer, text, "python-docs-1", 4, 25)
    _, longer_id = run_quality(tiny, streaming("streaming", 8, sinks=2), longer, store)
    assert same_id == run_id and len({run_id, other_id, longer_id}) == 3
    runs = store.list_runs().set_index("run_id")
    assert runs.loc[run_id, "trials"] == 1 and runs.loc[run_id, "task"] == "quality:python-docs-1"
    assert runs.loc[run_id, "perplexity"] == pytest.approx(first.perplexity) and again.nll == first.nll
    assert runs.loc[run_id, "kl"] == pytest.approx(first.kl) and math.isnan(runs.loc[run_id, "accuracy"])
    assert runs.loc[run_id, "context_length"] == 28 and runs.loc[run_id, "stop_rule"] == "none"
    trial = store.trials_frame(RunFilter(run_ids=(run_id,))).iloc[0]
    assert pd.isna(trial["correct"]) and pd.isna(trial["peak_gpu_bytes"])
    assert trial["scored_tokens"] == 24 and trial["peak_kv_bytes"] == first.result.peak_kv_bytes


PROVENANCE = Provenance("0.1.0", "abc", {"python": "3"})


def add_text_run(store: Store, policy: str, budget: int | None, passes: list[tuple[int, float, float]], kv: int) -> int:
    """A stored quality run with one trial per (scored tokens, nll, kl)."""
    run_id = store.begin_run(
        RunConfig(
            model="m", policy=policy, mode="streaming", task="quality:t", budget_tokens=budget, context_length=99
        ),
        provenance=PROVENANCE,
    )
    store.add_trials(
        run_id,
        [
            Trial(f"p{i}", "t", 99, None, kv_bytes=kv, peak_kv_bytes=kv, scored_tokens=n, nll=nll, kl=kl)
            for i, (n, nll, kl) in enumerate(passes)
        ],
    )
    return run_id


def test_perplexity_and_kl_are_frontier_axes_where_lower_is_better(store, tmp_path):
    add_text_run(store, "full", None, [(100, 3.0, 0.0)], kv=8000)
    add_text_run(store, "streaming", 64, [(100, 3.6, 0.5), (300, 3.4, 0.3)], kv=100)  # pooled over 400 tokens
    add_text_run(store, "streaming", 128, [(100, 3.2, 0.2)], kv=200)
    add_text_run(store, "h2o", 256, [(100, 3.3, 0.25)], kv=300)  # more memory and worse: not on the front
    frontier = store.accuracy_frontier()
    pooled = frontier.set_index(["policy", "budget_tokens"]).loc[("streaming", 64)]
    assert pooled["perplexity"] == pytest.approx(math.exp((100 * 3.6 + 300 * 3.4) / 400))
    assert pooled["kl"] == pytest.approx((100 * 0.5 + 300 * 0.3) / 400) and math.isnan(pooled["accuracy"])
    for metric in ("perplexity", "kl"):
        points = tables.frontier_points(frontier, "kv_bytes", metric)
        front = set(points[points["front"]]["label"])
        assert front == {"streaming · streaming · 64 tokens", "streaming · streaming · 128 tokens", "full cache"}
        figure = frontier_figure(points, "KV bytes", bytes_axis=True, metric=tables.METRICS[metric])
        assert "lower is better" in figure.layout.yaxis.title.text and figure.layout.yaxis.range is None
    assert tables.frontier_points(frontier, "kv_bytes", "accuracy").empty  # a text has no answer to count
    shown = tables.runs_table(store.list_runs())
    assert shown["perplexity"].notna().all() and shown["accuracy %"].isna().all()
    assert "perplexity of the text" in tables.compare_runs(store.list_runs(), store.trials_frame()).index
    assert export_trials(store, tmp_path / "trials.csv") == 5 and export_trials(store, tmp_path / "t.parquet") == 5


def test_a_long_text_is_read_only_as_far_as_the_pass_goes(tiny):
    text = read_text(DEFAULT_TEXT)
    assert text_pass(tiny.tokenizer, text * 60, "t", 4, 60) == text_pass(tiny.tokenizer, text, "t", 4, 60)
    with pytest.raises(KvlabError, match="fewer than the 64 of this pass"):
        text_pass(tiny.tokenizer, "the cache", "t", 4, 60)


def test_the_number_of_scored_tokens():
    assert scored_tokens(None, 256) == DEFAULT_TOKENS
    assert scored_tokens(Budget(tokens=256), 256) == DEFAULT_TOKENS
    assert scored_tokens(Budget(tokens=2048), 256) == 2048 - 256 + 1000
    assert scored_tokens(Budget(tokens=512), 64, 1448) == 1448
    with pytest.raises(KvlabError, match="at least 1,000 tokens past the budget"):
        scored_tokens(Budget(tokens=512), 64, 1447)
    with pytest.raises(KvlabError, match="in tokens"):
        scored_tokens(Budget(keep=0.1), 64)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


@pytest.mark.slow
def test_the_quality_command_prints_and_stores_a_pass(checkpoint, tmp_path, capsys):
    db = tmp_path / "runs.duckdb"
    argv = ["quality", "--model", checkpoint, "--prefix", "8", "--tokens", "1000", "--db", str(db)]
    status, out, _ = run(capsys, *argv, "--policy", "streaming", "--param", "sinks=2", "--budget", "8", "--json")
    assert status == 0
    figures = json.loads(out)
    assert figures["text"] == "python-docs-1" and figures["scored_tokens"] == 1000 and figures["kl"] > 0
    assert figures["kept_per_layer"] == [8] * 3 and figures["mode"] == "streaming" and figures["run_id"] == 1
    assert figures["full_perplexity"] < figures["perplexity"]
    status, out, err = run(capsys, *argv, "--policy", "drop_first")
    assert status == 0 and "perplexity" in out and "stored as run 2" in err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--policy", "streaming", "--budget", "256", "--tokens", "999"], "at least 1,000 tokens past the budget"),
        (["--policy", "streaming", "--keep", "0.1"], "in tokens (--budget)"),
        (["--policy", "streaming", "--budget", "4"], "minimum of 5"),
        (["--policy", "drop_first", "--budget", "64"], "takes no budget"),
        (["--text", "/nonexistent/text.txt"], "Cannot read the text file"),
    ],
)
def test_bad_settings_are_refused_before_the_model_loads(tmp_path, capsys, argv, message):
    status, out, err = run(capsys, "quality", "--model", str(tmp_path / "no-model"), "--db", str(tmp_path / "d"), *argv)
    assert status == 2 and out == "" and message in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "d").exists()


def test_texts_too_short_or_too_long_for_the_model_are_one_sentence(checkpoint, tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("the cache keeps the tokens that matter", encoding="utf-8")
    for argv, message in (
        (["--text", str(short), "--tokens", "1000"], "fewer than the 1,008 of this pass"),
        (["--tokens", "1100"], "1,108 positions, more than the 1,024"),
    ):
        status, out, err = run(
            capsys, "quality", "--model", checkpoint, "--prefix", "8", "--db", str(tmp_path / "d"), *argv
        )
        last = err.rstrip("\n").split("\n")[-1]  # after the loader's progress bar
        assert status == 2 and out == "" and last.startswith("error: ") and message in last


def test_a_pass_leaves_the_tokenizer_as_it_found_it(checkpoint):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    text_pass(tokenizer, "the tokens that matter " * 40, "t", 4, 20)
    assert tokenizer.backend_tokenizer.truncation is None  # no setting left behind for later calls
