"""The side-channel experiment (kvlab/experiments/sidechannel.py, `kvlab sidechannel`, the Side channels page): ground
truth from the heap, the attacker's threshold on separable and constant observables, the command end to end on a tiny
model, bad input as one sentence, and the page drawn from a result file. Timing values are never asserted: only that
they were measured."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
import torch
from drawn_charts import drawn_charts
from streamlit.testing.v1 import AppTest
from tiny_models import VOCAB, tiny_model

from kvlab.budget import Budget
from kvlab.cli import main
from kvlab.engine.generation import Generation
from kvlab.engine.spec import RunSpec
from kvlab.errors import KvlabError
from kvlab.experiments.sidechannel import (
    CHANNELS,
    NO_NOISE,
    CanaryPrompt,
    NoiseLevel,
    SideChannelResult,
    SideChannelSettings,
    TrialRecord,
    held_share,
    observe,
    parse_result,
    score_channel,
    split_roles,
    summarise,
)
from kvlab.models.loading import wrap_model
from kvlab.policies import make_policy

CONTEXT = 40
BUDGET = 12


@pytest.fixture(scope="module")
def loaded():
    return wrap_model(tiny_model("llama"))


def canary_prompt(positions: tuple[int, ...]) -> CanaryPrompt:
    generator = torch.Generator().manual_seed(5)
    context = torch.randint(3, VOCAB, (CONTEXT,), generator=generator).tolist()
    question = torch.randint(3, VOCAB, (5,), generator=generator).tolist()
    return CanaryPrompt(0, tuple(context), tuple(question), "QZ-4471-k9", positions, 0.5, "random", 7)


def spec(policy: str) -> RunSpec:
    return RunSpec(make_policy(policy), Budget(tokens=BUDGET), max_new_tokens=4, stop_token_ids=(), seed=7)


def survivors_before_decoding(loaded, policy: str, prompt: CanaryPrompt) -> list[torch.Tensor]:
    """What the heap held at the last event before the first decoded token, read straight from the events."""
    generation = Generation(
        loaded, spec(policy), torch.tensor([prompt.context_ids]), torch.tensor([prompt.question_ids])
    )
    held: list[torch.Tensor] = []
    for event in generation.events():
        if event.kind != "decode":
            held = event.survivors()
    return held


def test_held_share_counts_the_pairs_that_hold_every_canary_token():
    layer = torch.tensor([[[1, 2, 3, 9], [1, 2, 7, 9]]])  # one sequence, two KV heads
    other = torch.tensor([[[2, 3, 4, 5], [0, 1, 2, 3]]])
    assert held_share([layer, other], (2, 3)) == 0.75
    assert held_share([layer, other], (2, 9)) == 0.5
    assert held_share([layer, other], (8,)) == 0.0


@pytest.mark.parametrize(
    "policy,positions,expected",
    [
        ("streaming", (CONTEXT - 3, CONTEXT - 2), 1.0),  # in the recent window every head keeps
        ("streaming", (1, 2), 1.0),  # among the sinks
        ("streaming", (20, 21), 0.0),  # in between: evicted everywhere
        ("streaming", (2, 20), 0.0),  # half the code is not the code
        ("h2o", (10, 11), None),  # heavy hitters differ between heads: compared with the events below
        ("h2o", (5,), None),
    ],
)
def test_ground_truth_agrees_with_the_survivors(loaded, policy, positions, expected):
    prompt = canary_prompt(positions)
    record = observe(loaded, spec(policy), prompt, "no noise")
    survivors = survivors_before_decoding(loaded, policy, prompt)
    pairs = [set(positions) <= set(head.tolist()) for layer in survivors for head in layer[0]]
    assert record.held_share == sum(pairs) / len(pairs)
    assert record.cached == (record.held_share >= 0.5)
    if expected is not None:
        assert record.held_share == expected
    assert len(record.token_seconds) == 3 and all(seconds > 0 for seconds in record.token_seconds)
    assert set(record.observables) == set(CHANNELS)
    decoded = 3 * len(survivors)  # three decode steps wrote a token into every layer
    assert record.observables["kept_tokens"] == sum(layer.shape[-1] for layer in survivors) + decoded


def labels_and_roles(count: int = 40, seed: int = 3) -> tuple[list[bool], list[str]]:
    labels = [index % 3 == 0 for index in range(count)]
    return labels, split_roles(labels, seed)


def test_the_test_half_holds_as_many_cached_as_evicted_trials():
    labels, roles = labels_and_roles()
    test = [label for label, role in zip(labels, roles) if role == "test"]
    assert sum(test) == len(test) - sum(test) == sum(labels) // 2
    assert len(roles) == len(labels) and set(roles) == {"train", "test"}


@pytest.mark.parametrize("cached_value", [1.0, -1.0])
def test_a_threshold_on_a_separable_observable_is_always_right(cached_value):
    labels, roles = labels_and_roles()
    rng = random.Random(0)
    values = [(cached_value if label else 0.0) + rng.uniform(-0.4, 0.4) for label in labels]
    score = score_channel("answer", values, labels, roles)
    assert score.accuracy == 1.0 and score.correct == score.test_trials == sum(labels) // 2 * 2
    assert score.low is not None and score.high == 1.0 and 0.5 < score.low < 1.0  # a Wilson interval, not a point
    assert score.cached_above == (cached_value > 0)
    assert score.verdict.startswith("Leaks:")


def test_a_constant_observable_is_no_channel_and_scores_chance():
    labels, roles = labels_and_roles()
    score = score_channel("kv_bytes", [4096.0] * len(labels), labels, roles)
    assert score.spread == 0.0 and score.accuracy is not None and score.accuracy <= 0.5
    assert score.low is not None and score.high is not None and score.low < 0.5 < score.high
    assert score.verdict.startswith("No channel: every trial had the same KV bytes in use, 4,096 B")


def test_one_class_only_is_not_measurable():
    labels = [False] * 6
    score = score_channel("answer", [0.0, 1.0] * 3, labels, split_roles(labels, 0))
    assert score.accuracy is None and score.test_trials == 0
    assert score.verdict.startswith("Not measurable: the canary was cached in 0 of 6 trials")


def record(trial: int, noise: str, cached: bool, rng: random.Random) -> TrialRecord:
    depth = rng.uniform(0.7, 1.0) if cached else rng.uniform(0.4, 0.7)
    return TrialRecord(
        trial=trial,
        noise=noise,
        depth=depth,
        haystack="python-docs-1",
        canary="QZ-4471-k9",
        positions=[100, 101, 102],
        held_share=1.0 if cached else 0.0,
        cached=cached,
        answer="QZ-4471-k9" if cached else "QZ-1",
        correct=cached,
        observables={
            "decode_time": rng.uniform(0.002, 0.003),
            "kv_bytes": 65536.0,
            "kept_tokens": 640.0,
            "answer": 1.0 if cached else 0.3,
            "position": depth,
        },
        token_seconds=[0.003, 0.002, 0.002],
        decode_graphs=0,
    )


def synthetic_result() -> SideChannelResult:
    """A small result as the command writes it, from made-up records (no model run)."""
    rng = random.Random(0)
    levels = (NO_NOISE, NoiseLevel("gaussian", 2.0))
    records = {level: [record(trial, level.label, trial % 2 == 0, rng) for trial in range(8)] for level in levels}
    return SideChannelResult(
        model="kvlab-tiny-llama",
        device="cpu",
        dtype="float32",
        policy="h2o",
        params={"recent_ratio": 0.5},
        mode="prefill",
        keep=0.3,
        budget_tokens=300,
        context_tokens=1024,
        new_tokens=4,
        trials=8,
        seed=0,
        depths=(0.4, 1.0),
        canary_sentence="The access code of Ingrid is <code>.",
        question="Question: What is the access code of Ingrid?\nAnswer:",
        levels=[summarise(level, records[level], 0) for level in levels],
        records=[item for level in levels for item in records[level]],
    )


def test_a_result_survives_json_and_a_damaged_one_is_one_sentence():
    result = synthetic_result()
    text = json.dumps(result.to_json()).encode()
    assert parse_result(text, "r.json") == result
    damaged = result.to_json()
    del damaged["levels"][0]["channels"][0]["accuracy"]
    damaged["records"][0]["held_share"] = "most"
    for data, message in (
        (b"\x89PNG", "r.json is not a JSON file."),
        (b"[1, 2]", "r.json is not a side-channel result of kvlab"),
        (json.dumps(damaged).encode(), "r.json is a damaged side-channel result"),
    ):
        with pytest.raises(KvlabError, match=message.replace(".", r"\.")) as caught:
            parse_result(data, "r.json")
        assert "\n" not in str(caught.value)


def test_settings_run_no_noise_first_and_each_level_once():
    settings = SideChannelSettings(
        "h2o",
        {},
        Budget(keep=0.3),
        (NoiseLevel("gaussian", 1.0), NoiseLevel("none", 3.0), NoiseLevel("gaussian", 1.0)),
        trials=4,
    )
    assert settings.levels() == (NO_NOISE, NoiseLevel("gaussian", 1.0))
    assert settings.depth_range() == (1 - 2 * 308 / 1024, 1.0)  # two budgets of ceil(0.3 x 1024) tokens
    assert replace(settings, depths=(0.5, 0.9)).depth_range() == (0.5, 0.9)


def test_the_command_runs_end_to_end_and_writes_every_trial(checkpoint, tmp_path, capsys):
    out = tmp_path / "side.json"
    argv = ["sidechannel", "--model", checkpoint, "--policy", "streaming", "--keep", "0.5", "--trials", "4"]
    argv += ["--context", "160", "--new-tokens", "3", "--noise", "laplace", "--noise-scale", "1", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    result = parse_result(out.read_bytes(), out.name)
    assert [level.noise for level in result.levels] == ["no noise", "laplace 1"]
    assert len(result.records) == 8 and {record.trial for record in result.records} == {0, 1, 2, 3}
    for record in result.records:
        assert len(record.token_seconds) == 2 and record.observables["decode_time"] > 0
        assert record.observables["kv_bytes"] == result.records[0].observables["kv_bytes"] > 0
    for level in result.levels:
        assert level.trials == 4 and 0 <= level.retrieval_low <= level.retrieval <= level.retrieval_high <= 1
        assert f"{level.noise}: canary cached in {level.cached} of 4 trials" in printed
        kv_bytes = next(score for score in level.channels if score.channel == "kv_bytes")
        assert kv_bytes.spread == 0.0
        assert kv_bytes.accuracy is None or kv_bytes.verdict.startswith("No channel")


@pytest.mark.parametrize(
    "arguments,message",
    [
        (["--policy", "full"], "needs a policy that ranks tokens by a score"),
        (["--noise", "uniform"], "Parameter 'noise' of policy 'h2o' must be one of"),
        (["--noise-scale", "-1"], "Parameter 'noise_scale' of policy 'h2o' must be a number (at least 0)"),
        (["--param", "noise=laplace"], "Set the noise with --noise and --noise-scale"),
        (["--depths", "0.9,0.2"], "must be a range within [0, 1], low before high"),
        (["--keep", "1"], "A kept fraction of 1 evicts nothing"),
        (["--out", "/nonexistent/dir/r.json"], "the folder /nonexistent/dir does not exist"),
    ],
)
def test_bad_input_is_one_sentence_before_any_model_loads(arguments, message, capsys, monkeypatch):
    monkeypatch.setattr("kvlab.cli.sidechannel.load_model_from_args", pytest.fail)
    assert main(["sidechannel", "--model", "never-loaded", *arguments]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and message in error and error.count("\n") == 1


@pytest.mark.slow
def test_the_page_draws_a_result_file_and_refuses_a_bad_one(tmp_path):
    result = synthetic_result()
    app = AppTest.from_file("../../views/side_channel.py", default_timeout=60)
    app.run()
    assert not app.exception
    app.file_uploader[0].set_value(("r.json", json.dumps(result.to_json()).encode(), "application/json"))
    app.run()
    assert not app.exception and not app.error
    figures = {chart.title: chart.figure for chart in drawn_charts(app)}
    assert {"Attacker accuracy by channel", "Retrieval and survival by noise level"} <= set(figures)
    accuracy = figures["Attacker accuracy by channel"]
    assert [trace["name"] for trace in accuracy["data"]] == ["no noise", "gaussian 2"]
    verdicts = app.dataframe[0].value
    assert len(verdicts) == 2 * len(CHANNELS) and verdicts["verdict"].str.startswith("No channel").sum() == 4
    next(box for box in app.selectbox if box.label == "Channel").set_value("answer")
    app.run()
    assert "answer to the probe, no noise" in {chart.title for chart in drawn_charts(app)}
    app.file_uploader[0].set_value(("bad.json", b"{}", "application/json"))
    app.run()
    assert "bad.json is not a side-channel result of kvlab" in app.error[0].value.replace("\\", "")
