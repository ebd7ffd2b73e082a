"""Each defect of the integrity review, reproduced and shown fixed: a run's identity covers every setting that can
change its result, every bad input is one sentence (never a traceback, never a silent wrong run), and inputs are
bounded by the model's positions before any work."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from tiny_models import prompt, save_tiny_checkpoint, tiny_model

from kvlab.budget import Budget
from kvlab.cli import main
from kvlab.engine.generation import generate
from kvlab.engine.spec import RunSpec
from kvlab.errors import KvlabError
from kvlab.models import loading as models
from kvlab.models.loading import wrap_model
from kvlab.policies import make_policy
from kvlab.runs.live import LiveRun, LiveSettings, TextTask, build_prompt
from kvlab.runs.live_store import store_live_run
from kvlab.runs.sweep import SweepGrid, SweepRunner
from kvlab.store import open_store
from kvlab.tasks.items import load_jsonl
from kvlab.tasks.needle import score


def run(capsys, *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def one_sentence(err: str) -> str:
    """The single line a refused command prints (after transformers' loading progress bars, if it got that far)."""
    lines = [line + "\n" for line in err.split("\n") if line.strip() and not re.search(r"\d+/\d+ \[[\d:<?]+", line)]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# --- a run's identity ----------------------------------------------------------------------------------------------


def needle_grid(**changes) -> SweepGrid:
    values = dict(policies=(make_policy("full"),), keeps=(), contexts=(256,), depths=(0.5,), trials=2, max_new_tokens=1)
    return SweepGrid(**{**values, **changes})


@pytest.mark.model
@pytest.mark.slow
def test_a_sweep_with_another_generation_length_is_another_run_not_the_stored_one(shipped, tmp_path):
    store = open_store(tmp_path / "runs.duckdb")
    short = SweepRunner(shipped, store, needle_grid(max_new_tokens=1)).run()
    assert short.ran == 2
    longer = SweepRunner(shipped, store, needle_grid(max_new_tokens=24)).run()
    assert longer.ran == 2 and longer.skipped == 0 and set(longer.run_ids).isdisjoint(short.run_ids)
    runs = store.list_runs().set_index("max_new_tokens")
    assert runs.loc[1, "accuracy"] == 0.0  # one token cannot hold the seven-digit answer
    assert runs.loc[24, "accuracy"] == 1.0  # what a fresh database gives
    assert SweepRunner(shipped, store, needle_grid(max_new_tokens=24)).run().skipped == 2  # and it resumes
    store.close()


def write_tasks(path: Path, answer: str) -> str:
    path.write_text(
        json.dumps(
            {
                "id": "a",
                "context": "The access code of Ada is 4471. The sky was grey.",
                "question": "What is the access code of Ada?",
                "answer": answer,
            }
        )
        + "\n"
    )
    return str(path)


@pytest.mark.model
def test_eval_of_a_changed_task_file_is_a_new_run(tmp_path, capsys):
    db = str(tmp_path / "runs.duckdb")
    tasks = tmp_path / "tasks.jsonl"
    status, out, _ = run(capsys, "eval", "--tasks", write_tasks(tasks, "4471"), "--db", db, "--json")
    first = json.loads(out)
    status, out, _ = run(capsys, "eval", "--tasks", write_tasks(tasks, "9999"), "--db", db, "--json")
    second = json.loads(out)
    assert status == 0 and first["run_id"] != second["run_id"]
    store = open_store(db, read_only=True)
    trials = store.trials_frame().set_index("run_id")
    assert trials.loc[first["run_id"], "expected"] == "4471" and trials.loc[second["run_id"], "expected"] == "9999"
    assert trials.loc[second["run_id"], "correct"] == second["items"][0]["correct"]
    store.close()


@pytest.mark.model
def test_the_same_text_with_two_expected_answers_is_stored_twice(shipped, tmp_path):
    store = open_store(tmp_path / "runs.duckdb")
    for answer in ("4471", "amber"):
        live = LiveRun(
            shipped,
            build_prompt(
                shipped, TextTask("The access code of Ada is 4471. " * 4, "What is the access code of Ada?", answer)
            ),
            LiveSettings("full", max_new_tokens=4, chunk=64),
        )
        list(live.events())
        assert store_live_run(store, live, live.outcome()) is not None
    assert sorted(store.trials_frame()["expected"]) == ["4471", "amber"]
    store.close()


#: The stored settings that do not depend on the task: equal wherever the same settings ran.
SETTINGS = (
    "model",
    "weights_hash",
    "tokenizer_hash",
    "policy",
    "policy_params",
    "mode",
    "keep",
    "budget_tokens",
    "chunk",
    "compression_interval",
    "layout",
    "compact_at",
    "query_aware",
    "max_new_tokens",
    "stop_rule",
    "seed",
    "device",
    "dtype",
)


@pytest.mark.model
@pytest.mark.slow
def test_eval_a_sweep_and_the_live_page_store_the_same_settings_the_same_way(shipped, tmp_path, capsys):
    db = str(tmp_path / "runs.duckdb")
    same = ["--policy", "h2o", "--keep", "0.5", "--mode", "streaming", "--chunk", "64", "--max-new-tokens", "6"]
    status, _, err = run(capsys, "eval", "--tasks", write_tasks(tmp_path / "tasks.jsonl", "4471"), "--db", db, *same)
    assert status == 0, err
    sweep = ["sweep", "--policies", "h2o", "--keep", "0.5", "--mode", "streaming", "--chunk", "64"]
    sweep += ["--max-new-tokens", "6", "--contexts", "256", "--depths", "0.5", "--trials", "1", "--db", db, "--quiet"]
    status, _, err = run(capsys, *sweep)
    assert status == 0, err
    live = LiveRun(
        shipped,
        build_prompt(
            shipped, TextTask("The access code of Ada is 4471. " * 4, "What is the access code of Ada?", "4471")
        ),
        LiveSettings("h2o", {}, Budget(keep=0.5), "streaming", chunk=64, max_new_tokens=6),
    )
    list(live.events())
    store = open_store(db)
    assert store_live_run(store, live, live.outcome()) is not None
    runs = store.list_runs().sort_values("run_id")
    store.close()
    assert len(runs) == 3 and runs["task"].nunique() == 3
    stored = [{name: row[name] for name in SETTINGS} for _, row in runs.iterrows()]
    assert stored[0] == stored[1] == stored[2], stored
    assert stored[0]["policy"] == "h2o" and stored[0]["keep"] == 0.5 and stored[0]["chunk"] == 64


def test_random_has_no_seed_of_its_own_and_the_run_seed_is_its_seed():
    with pytest.raises(KvlabError, match="Policy 'random' has no parameter 'seed'"):
        make_policy("random", seed=3)
    assert make_policy("random").params() == {}


# --- bounded inputs ------------------------------------------------------------------------------------------------


def test_prompts_longer_than_the_models_positions_are_refused_before_any_work(checkpoint, capsys, monkeypatch):
    status, _, err = run(capsys, "generate", "--model", checkpoint, "--prompt", "the cache " * 600)
    assert status == 2 and "positions, more than the 1,024 of" in one_sentence(err)
    status, _, err = run(capsys, "generate", "--model", checkpoint, "--prompt", "x" * (1024 * 128 + 1))
    assert status == 2 and "characters, far more than the 1,024 tokens" in one_sentence(err)
    monkeypatch.setenv("KVLAB_MAX_NEW_TOKENS", "4")
    status, _, err = run(capsys, "generate", "--model", checkpoint, "--prompt", "the cache", "--max-new-tokens", "8")
    assert status == 2 and "more than the 4 this server allows (KVLAB_MAX_NEW_TOKENS)" in one_sentence(err)


@pytest.mark.model
def test_a_sweep_past_the_models_positions_stores_nothing(tmp_path, capsys):
    db = tmp_path / "runs.duckdb"
    status, _, err = run(capsys, "sweep", "--policies", "full", "--contexts", "4600", "--db", str(db), "--quiet")
    assert status == 2 and "more than the 4,608 of" in one_sentence(err)
    assert not db.exists()


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--contexts", ""], "at least one context length"),
        (["--contexts", "256", "--depths", ""], "at least one needle depth"),
        (["--contexts", "256", "--depths", " , "], "at least one needle depth"),
        (["--contexts", "256", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
        (["--contexts", "256", "--seed", str(2**63)], "a seed must be at most 9223372036854775807"),
        (["--contexts", "256,-5"], "Context lengths are positive numbers of tokens"),
    ],
)
def test_empty_and_out_of_range_sweep_settings_are_refused(tmp_path, capsys, argv, message):
    db = tmp_path / "runs.duckdb"
    status, _, err = run(capsys, "sweep", "--policies", "full", "--db", str(db), "--quiet", *argv)
    assert status == 2 and message in one_sentence(err)
    assert not db.exists()


# --- one sentence for every bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--device", "tpu"], "Unknown device 'tpu'; use cpu, cuda or cuda:N."),
        (["--device", "cpu:5"], "There is no device 'cpu:5': the CPU is one device, so use cpu."),
        (["--seed", str(2**63)], "a seed must be at most"),
        (["--seed", "-1"], "a seed must be at least 0"),
        (
            ["--policy", "streaming", "--budget", "16", "--param", "sinks=-10"],
            "Parameter 'sinks' of policy 'streaming' must be a whole number (at least 0), not -10.",
        ),
        (["--policy", "snapkv", "--budget", "64", "--param", "pooling=median"], "must be one of 'avg', 'max'"),
    ],
)
def test_bad_settings_are_one_sentence(checkpoint, capsys, argv, message):
    status, out, err = run(capsys, "generate", "--model", checkpoint, "--prompt", "the cache keeps", *argv)
    assert status == 2 and out == "" and message in one_sentence(err)


@pytest.mark.parametrize("text", ["", "   \n "])
def test_an_empty_prompt_is_refused(checkpoint, capsys, text):
    status, _, err = run(capsys, "generate", "--model", checkpoint, "--prompt", text)
    assert status == 2 and "The prompt is empty" in one_sentence(err)


def test_a_model_name_too_long_for_a_path_is_one_sentence(capsys):
    status, _, err = run(capsys, "generate", "--model", "m" * 300, "--prompt", "hello")
    assert status == 2 and "No model directory at 'mmmm" in one_sentence(err) and "…'" in err
    assert len(err) < 300


def test_a_truncated_weights_file_is_one_sentence(tmp_path, capsys):
    directory = Path(save_tiny_checkpoint(tmp_path / "model"))
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    status, _, err = run(capsys, "generate", "--model", str(directory), "--prompt", "hello")
    assert status == 2 and "Could not load the weights of" in one_sentence(err)


def test_a_missing_tokenizer_is_a_whole_sentence(tmp_path, capsys):
    directory = Path(save_tiny_checkpoint(tmp_path / "model"))
    for path in directory.glob("tokenizer*"):
        path.unlink()
    status, _, err = run(capsys, "generate", "--model", str(directory), "--prompt", "hello")
    assert status == 2 and "Could not load the tokenizer of" in one_sentence(err)
    assert not err.rstrip().endswith(":") and "(1) a `tokenizers` library serialization file" in err


def test_ctrl_c_while_the_model_loads_is_one_line(capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "load_model", interrupted)
    status, _, err = run(capsys, "generate", "--prompt", "hello")
    assert status == 130 and one_sentence(err) == "Interrupted.\n"


def test_an_unexpected_error_is_one_sentence_and_its_traceback_is_logged(tmp_path, capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug deep inside")

    log = tmp_path / "kvlab.log"
    monkeypatch.setenv("KVLAB_LOG", str(log))
    monkeypatch.setattr(models, "load_model", broken)
    status, _, err = run(capsys, "generate", "--prompt", "hello")
    assert status == 1
    assert one_sentence(err).startswith(
        f"error: kvlab failed unexpectedly (RuntimeError); the traceback is in {log} under reference "
    )
    reference = err.rstrip().rstrip(".").rsplit(" ", 1)[-1]
    logged = log.read_text()
    assert f"reference {reference}" in logged and "a bug deep inside" in logged and "Traceback" in logged


@pytest.mark.model
@pytest.mark.parametrize(
    "line,message",
    [
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('{"id": "a", "context": "\\ud800 text", "question": "q", "answer": "x"}', "not valid Unicode"),
        ('{"id": "a", "context": "text", "question": "q", "answer": "  "}', "has an empty 'answer'"),
        ('{"id": "", "context": "text", "question": "q", "answer": "x"}', "has an empty 'id'"),
        (
            json.dumps({"id": "a", "context": "x" * 1_000_000, "question": "q", "answer": "x"}),
            "characters, far more than the 4,608 tokens",
        ),
        (
            json.dumps({"id": "a", "context": "the cache " * 3000, "question": "q", "answer": "x"}),
            "positions, more than the 4,608 of",
        ),
    ],
)
def test_bad_task_lines_are_one_sentence_before_anything_runs(shipped, tmp_path, line, message):
    path = tmp_path / "tasks.jsonl"
    path.write_text(line + "\n", encoding="utf-8")
    with pytest.raises(KvlabError, match="Line 1 of") as refused:
        load_jsonl(path, shipped.tokenizer, shipped.limits, 24)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_an_empty_expected_answer_cannot_be_scored():
    with pytest.raises(KvlabError, match="empty expected answer cannot be scored"):
        score("anything at all", "")


@pytest.mark.parametrize("policy,params", [("knorm", {}), ("h2o", {}), ("snapkv", {"window": 4})])
def test_keeping_the_whole_prompt_is_the_full_cache_in_both_modes(policy, params):
    loaded = wrap_model(tiny_model("llama"))
    ids = prompt(length=40)
    full = generate(loaded, ids, RunSpec(make_policy("full"), max_new_tokens=12, stop_token_ids=()))
    for mode in ("prefill", "streaming"):
        kept = generate(
            loaded,
            ids,
            RunSpec(
                make_policy(policy, **params),
                Budget(keep=1.0),
                mode=mode,
                chunk=8,
                max_new_tokens=12,
                stop_token_ids=(),
            ),
        )
        assert kept.tokens == full.tokens and kept.kept_per_layer == full.kept_per_layer
        assert kept.budget_tokens is None


def test_an_engine_prompt_past_the_positions_is_refused_before_reading():
    loaded = wrap_model(tiny_model("llama"))
    with pytest.raises(KvlabError, match="needs 1,030 positions, more than the 1,024 of 'in-memory'"):
        generate(loaded, torch.ones(1, 1000, dtype=torch.long), RunSpec(make_policy("full"), max_new_tokens=30))
