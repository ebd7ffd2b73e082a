"""RULER's tasks generated locally: exact lengths, answers present as specified, seeded items, RULER's scorer, the
per-run score with its intervals, and a sweep of the ``ruler`` task set storing recall per task."""

from __future__ import annotations

import dataclasses
import random
import re
from collections import Counter

import numpy as np
import pandas as pd
import pytest

from kvlab.cli import build_parser
from kvlab.cli.evaluation import sweep_grid
from kvlab.dashboard.grid import NeedleGridRequest
from kvlab.dashboard.ruler_figures import ruler_bars, ruler_rows, ruler_table
from kvlab.errors import KvlabError
from kvlab.models.loading import load_model
from kvlab.policies import make_policy
from kvlab.runs.sweep import SweepGrid, SweepRunner, trial_slots
from kvlab.stats import wilson_interval
from kvlab.store import open_store
from kvlab.tasks.items import from_ruler
from kvlab.tasks.ruler import MAX_NEW_TOKENS, RULER_TASKS, check_tasks, ruler_item, task_set_name
from kvlab.tasks.ruler_lists import CWE_QUESTION, FWE_QUESTION, VT_QUESTION
from kvlab.tasks.ruler_niah import NIAH, NOISE
from kvlab.tasks.ruler_score import (
    ANSWER_SEPARATOR,
    SCORE,
    recall,
    ruler_score,
    ruler_scores,
    scores_frame,
    split_answers,
    task_of,
)

SOME_TASKS = ("niah_single_1", "niah_multivalue", "fwe")


@pytest.fixture(scope="module")
def tokenizer(shipped):
    return shipped.tokenizer


@pytest.fixture(scope="module")
def tiny(checkpoint):
    return load_model(checkpoint)


def item(tokenizer, task: str, length: int, seed: object = 0):
    return ruler_item(tokenizer, task, length, random.Random(f"{seed}/{task}"))


def text_of(tokenizer, ids) -> str:
    return tokenizer.decode(list(ids))


def key_of(context: str, value: str) -> str:
    """The key of the one needle that states ``value``."""
    [key] = re.findall(r"for (\S+) is: " + value, context)
    return key


@pytest.mark.model
@pytest.mark.parametrize("length", [512, 4096])
def test_every_task_has_exactly_the_length_asked_for_and_holds_its_answers(tokenizer, length):
    for task in RULER_TASKS:
        made = item(tokenizer, task, length)
        assert made.context_tokens == length, task
        assert made.context_ids[0] == tokenizer.bos_token_id
        context = text_of(tokenizer, made.context_ids[1:])
        assert made.answers and all(answer in context for answer in made.answers), task
        assert (made.depth is None) == (task not in NIAH)


def test_a_byte_level_tokenizer_gets_exact_lengths_too_and_a_short_context_is_one_sentence(tiny):
    for task in ("niah_single_1", "niah_multikey_3", "niah_multiquery", "fwe"):
        assert item(tiny.tokenizer, task, 1000).context_tokens == 1000
    for task in ("vt", "cwe"):
        with pytest.raises(KvlabError, match=f"A 512-token {task} prompt"):
            item(tiny.tokenizer, task, 512)


@pytest.mark.model
def test_needles_and_questions_are_rulers_templates(tokenizer):
    single = item(tokenizer, "niah_single_1", 1024)
    [value] = single.answers
    context, question = text_of(tokenizer, single.context_ids[1:]), text_of(tokenizer, single.question_ids)
    key = key_of(context, value)
    assert re.fullmatch(r"[a-z]+-[a-z]+", key) and context.count(value) == 1
    assert context.startswith("A special magic number is hidden within the following text. Make sure to memorize it.")
    assert f"\n{NOISE}\n" in context
    assert question == (
        f"\nWhat is the special magic number for {key} mentioned in the provided text? "
        f"The special magic number for {key} mentioned in the provided text is"
    )
    multi = item(tokenizer, "niah_multiquery", 2048)
    context, question = text_of(tokenizer, multi.context_ids[1:]), text_of(tokenizer, multi.question_ids)
    keys = [key_of(context, value) for value in multi.answers]
    assert len(set(keys)) == 4 and ", and " in question and question.index(keys[0]) < question.index(keys[3])
    assert question.endswith(" mentioned in the provided text are")
    values = item(tokenizer, "niah_multivalue", 2048)
    context = text_of(tokenizer, values.context_ids[1:])
    assert len({key_of(context, value) for value in values.answers}) == 1


@pytest.mark.model
def test_multikey_tasks_hide_the_needle_among_distractors_of_the_same_shape(tokenizer):
    uuid = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
    for task, key_shape, distractors in (
        ("niah_multikey_1", r"[a-z]+-[a-z]+", 3),
        ("niah_multikey_2", r"[a-z]+-[a-z]+", 20),
        ("niah_multikey_3", uuid, 20),
    ):
        made = item(tokenizer, task, 2048)
        context = text_of(tokenizer, made.context_ids[1:])
        needles = re.findall(rf"One of the special magic \w+ for ({key_shape}) is: (\S+)\.", context)
        [asked] = [key for key, value in needles if value == made.answers[0]]
        assert asked in text_of(tokenizer, made.question_ids)
        others = [key for key, _ in needles if key != asked]
        assert len(others) >= distractors and all(re.fullmatch(key_shape, key) for key in others)
        assert [value for _, value in needles].count(made.answers[0]) == 1


@pytest.mark.model
def test_variable_tracking_hides_one_chain_and_asks_for_its_value(tokenizer):
    made = item(tokenizer, "vt", 2048)
    context = text_of(tokenizer, made.context_ids[1:])
    first, *rest = made.answers
    [value] = re.findall(rf"VAR {first} = (\d{{5}})\n", context)
    for previous, name in zip(made.answers, rest):
        assert f"\nVAR {name} = VAR {previous}\n" in context
    assert all(re.fullmatch(r"[A-Z]{5}", name) for name in made.answers)
    question = text_of(tokenizer, made.question_ids)
    assert question.startswith(VT_QUESTION.format(value=value)) and question.endswith("they are: ")


@pytest.mark.model
@pytest.mark.parametrize("task, question, count", [("cwe", CWE_QUESTION, 10), ("fwe", FWE_QUESTION, 3)])
def test_word_tasks_answers_are_the_most_frequent_words(tokenizer, task, question, count):
    made = item(tokenizer, task, 4096)
    context = text_of(tokenizer, made.context_ids[1:])
    listed = context.split("\n")[-1] if task == "cwe" else context
    words = Counter(re.findall(r"\d+\. (\S+)", listed) if task == "cwe" else listed.split())
    del words["..."]
    assert len(made.answers) == count
    assert min(words[answer] for answer in made.answers) > max(
        times for word, times in words.items() if word not in made.answers
    )
    if task == "cwe":
        assert min(words[answer] for answer in made.answers) >= 29  # 30 each at 4,096 tokens, the cut takes <= 1
    assert text_of(tokenizer, made.question_ids).startswith(question)


@pytest.mark.model
def test_items_are_drawn_from_their_seed(tokenizer):
    for task in RULER_TASKS:
        assert item(tokenizer, task, 1024, seed=1) == item(tokenizer, task, 1024, seed=1)
        assert item(tokenizer, task, 1024, seed=1).answers != item(tokenizer, task, 1024, seed=2).answers


def string_match_all(preds: list[str], refs: list[list[str]]) -> float:
    """RULER's reference scorer (``scripts/eval/synthetic/constants.py``), in percent, as RULER writes it."""
    score = sum([sum([1.0 if r.lower() in pred.lower() else 0.0 for r in ref]) / len(ref) for pred, ref in zip(preds, refs)]) / len(preds) * 100  # fmt: skip # noqa: E501
    return round(score, 2)


def test_recall_is_rulers_string_match_all():
    outputs = [
        " The special magic numbers are 1234567, 7654321 and 1111111.",
        "KPQMT BDTAC dyaya",
        "nothing",
        "  \x00\tABC-def\n",
        "apple, pear",
    ]
    answers = [["1234567", "7654321", "2222222"], ["KPQMT", "BDTAC", "DYAYA", "JXIYY"], ["x"], ["abc-def"], ["pear"]]
    assert [recall(o, a) for o, a in zip(outputs, answers)] == [2 / 3, 3 / 4, 0.0, 1.0, 1.0]
    mean = 100 * sum(recall(o, a) for o, a in zip(outputs, answers)) / len(outputs)
    assert round(mean, 2) == string_match_all(outputs, answers) == 68.33
    with pytest.raises(KvlabError, match="none of them empty"):
        recall("anything", ["1", " "])


def test_the_ruler_score_is_the_mean_over_tasks_with_intervals():
    score = ruler_score({"vt": [1.0, 0.5, 0.0, 0.5], "cwe": [1.0, 1.0, 0.0, 1.0], "fwe": [1 / 3, 2 / 3, 1.0, 0.0]})
    cwe = score.tasks["cwe"]
    assert cwe.value == 0.75 and (cwe.low, cwe.high) == wilson_interval(3, 4)
    assert score.score.value == pytest.approx((0.5 + 0.75 + 0.5) / 3) and score.score.items == 12
    for estimate in [score.score, *score.tasks.values()]:
        assert estimate.low <= estimate.value <= estimate.high
    assert score.tasks["vt"].high - score.tasks["vt"].low > 0  # a bootstrap over fractions
    nothing = ruler_score({"vt": [0.0] * 5, "cwe": [0.0] * 5})
    assert (nothing.score.low, nothing.score.high) == pytest.approx(wilson_interval(0, 10))
    uneven = ruler_score({"vt": [1.0, 1.0, 1.0, 1.0], "cwe": [0.0, 1.0]})
    assert uneven.score.value == 0.75 and uneven.score.low < 0.75 < uneven.score.high
    assert uneven == ruler_score({"cwe": [0.0, 1.0], "vt": [1.0, 1.0, 1.0, 1.0]})


def test_a_runs_score_is_read_back_from_its_trials():
    trials = pd.DataFrame(
        {
            "run_id": [1, 1, 1, 1, 2, 2],
            "task_id": [
                "ruler-vt-512-0",
                "ruler-vt-512-1",
                "ruler-niah_single_1-512-0",
                "ruler-niah_single_1-512-1",
                "needle-single-512-0",
                "ruler-cwe-512-0",
            ],
            "recall": [1.0, 0.6, 0.0, 1.0, 1.0, np.nan],
        }
    )
    scores = ruler_scores(trials)
    assert list(scores) == [1] and scores[1].score.value == pytest.approx((0.8 + 0.5) / 2)
    assert task_of("ruler-niah_multikey_2-4096-17") == "niah_multikey_2" and task_of("needle-single-512-0") is None
    frame = scores_frame(scores)
    assert list(frame["task"]) == ["niah_single_1", "vt", SCORE]
    runs = pd.DataFrame({"run_id": [1], "context_length": [512], "policy": ["h2o"], "mode": ["prefill"]}).assign(
        keep=0.5, budget_tokens=None, policy_params="{}"
    )
    rows = ruler_rows(runs, scores)
    assert list(rows["task"]) == [SCORE, "niah_single_1", "vt"] and rows["recall"].iloc[0] == pytest.approx(65.0)
    table = ruler_table(rows)
    assert list(table.columns) == ["run", "context (tokens)", SCORE, "niah_single_1", "vt", "items"]
    assert table[SCORE].iloc[0].startswith("65.0 (") and table["items"].iloc[0] == 4
    assert len(ruler_bars(rows).data) == 1


def test_task_sets_are_named_as_rulers_tasks():
    assert task_set_name(RULER_TASKS) == "ruler" and task_set_name(["vt", "niah_single_1"]) == "ruler:niah_single_1,vt"
    with pytest.raises(KvlabError, match="Unknown RULER task 'qa_1'"):
        check_tasks(["qa_1"])
    with pytest.raises(KvlabError, match="listed twice"):
        check_tasks(["vt", "vt"])


def test_the_sweep_command_reads_a_ruler_task_set():
    parser = build_parser()
    grid = sweep_grid(
        parser.parse_args("sweep --policies full --contexts 1024 --task ruler --ruler-tasks vt,cwe --trials 2".split())
    )
    assert grid.kind == "ruler" and grid.task == "ruler:vt,cwe" and grid.depths is None
    assert grid.max_new_tokens == MAX_NEW_TOKENS
    assert [key for key, _ in trial_slots(grid, 1024)] == ["cwe/trial=0", "cwe/trial=1", "vt/trial=0", "vt/trial=1"]
    needle = sweep_grid(parser.parse_args("sweep --policies full --contexts 1024".split()))
    assert needle.depths == (0, 0.25, 0.5, 0.75, 1) and needle.max_new_tokens == 24 and needle.task == "needle"
    for line, sentence in (
        ("--task ruler --depths 0.5", "leave out --depths"),
        ("--ruler-tasks vt", "use it with --task ruler"),
        ("--task ruler --ruler-tasks vt,nope", "Unknown RULER task 'nope'"),
    ):
        with pytest.raises(KvlabError, match=sentence):
            sweep_grid(parser.parse_args(f"sweep --policies full --contexts 1024 {line}".split()))


def test_a_ruler_sweep_stores_recall_per_task_and_resumes(tiny, tmp_path):
    grid = SweepGrid(
        policies=(make_policy("full"), make_policy("h2o")),
        keeps=(0.5,),
        contexts=(640,),
        depths=None,
        trials=1,
        kind="ruler",
        ruler_tasks=SOME_TASKS,
        max_new_tokens=4,
    )
    store = open_store(tmp_path / "runs.duckdb")
    summary = SweepRunner(tiny, store, grid).run()
    assert summary.ran == 2 * len(SOME_TASKS)
    runs = store.list_runs()
    assert set(runs["task"]) == {"ruler:niah_single_1,niah_multivalue,fwe"} and runs["query_aware"].all()
    assert runs["task_hash"].iloc[0] == grid.task_hash
    others = (dataclasses.replace(grid, ruler_tasks=("vt",)), dataclasses.replace(grid, kind="single", depths=(0.5,)))
    assert grid.task_hash not in {other.task_hash for other in others}
    trials = store.trials_frame()
    assert sorted(trials["task_id"].map(task_of)) == sorted(SOME_TASKS * 2)
    assert trials["recall"].between(0, 1).all() and trials["exact"].isna().all()
    assert (trials["correct"] == (trials["recall"] == 1.0)).all()
    multivalue = trials[trials["trial_key"] == "niah_multivalue/trial=0"].iloc[0]
    assert len(split_answers(multivalue["expected"])) == 4 and ANSWER_SEPARATOR in multivalue["expected"]
    one = from_ruler(ruler_item(tiny.tokenizer, "fwe", 640, random.Random("0/640/fwe/trial=0")), 0)
    assert one.content_hash in set(trials["item_hash"]) and one.expected_answers == one.answers
    assert set(ruler_scores(trials)) == set(runs["run_id"])
    assert SweepRunner(tiny, store, grid).run().ran == 0


def test_the_grid_page_request_runs_ruler_tasks_and_keeps_older_specs():
    needle = NeedleGridRequest("m", ("h2o",), 0.1, "prefill", (256,), 3, 1)
    assert set(needle.spec()) == {
        "kind",
        "model",
        "policies",
        "keep",
        "mode",
        "contexts",
        "depths",
        "trials",
        "batch_size",
    }
    assert NeedleGridRequest.from_spec(needle.spec()) == needle
    ruler = NeedleGridRequest("m", ("h2o",), 0.1, "prefill", (256,), 0, 4, tasks=("vt", "fwe"), query_aware=False)
    assert NeedleGridRequest.from_spec(ruler.spec()) == ruler and not ruler.fills(needle)
    grid = ruler.grid()
    assert grid.task == "ruler:vt,fwe" and grid.trials == 4 and not grid.query_aware
    assert "RULER vt, fwe x 4 trials · question after compression" in ruler.describe()
