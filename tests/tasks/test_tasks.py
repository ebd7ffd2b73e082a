"""User tasks from JSONL files, prompts for base and chat models, and the eval command on the shipped model."""

from __future__ import annotations

import json

import pytest

from kvlab.cli import main
from kvlab.errors import KvlabError
from kvlab.tasks.items import load_jsonl, prompt_ids, stop_token_ids
from kvlab.tasks.needle import ANSWER_PREFIX, QUESTION_PREFIX

pytestmark = pytest.mark.model


def write_tasks(path, records) -> str:
    path.write_text("\n".join(json.dumps(r) if not isinstance(r, str) else r for r in records) + "\n", encoding="utf-8")
    return str(path)


FACTS = [
    {
        "id": "a",
        "context": "The release tag of project Orion is QZ-4471-k9. The weather was mild all week.",
        "question": "What is the release tag of project Orion?",
        "answer": "QZ-4471-k9",
    },
    {
        "id": "b",
        "context": "Nothing is said here about codes. The secret word chosen by Astrid is amber falcon.",
        "question": "What is the secret word chosen by Astrid?",
        "answer": "amber falcon",
    },
]


def test_jsonl_tasks_become_prompts_in_the_needle_format(shipped, tmp_path):
    items = load_jsonl(write_tasks(tmp_path / "tasks.jsonl", FACTS), shipped.tokenizer)
    assert [item.task_id for item in items] == ["a", "b"]
    tokenizer = shipped.tokenizer
    assert items[0].context_ids[0] == tokenizer.bos_token_id
    question = tokenizer.decode(list(items[0].question_ids))
    assert question == f"{QUESTION_PREFIX}{FACTS[0]['question']}{ANSWER_PREFIX}"
    assert items[0].context_tokens == len(items[0].context_ids) + len(items[0].question_ids)


@pytest.mark.parametrize(
    "line,message",
    [
        ("{not json", "Line 1 of .* is not valid JSON"),
        (json.dumps({"id": "x", "context": "c", "question": "q"}), "string fields id, context, question, answer"),
        (json.dumps({"id": 3, "context": "c", "question": "q", "answer": "a"}), "string fields"),
        ('{"id": ' + "9" * 100_000 + "}", "holds a number too long to read"),
    ],
)
def test_a_malformed_line_is_named(shipped, tmp_path, line, message):
    with pytest.raises(KvlabError, match=message):
        load_jsonl(write_tasks(tmp_path / "bad.jsonl", [line]), shipped.tokenizer)


def test_repeated_ids_and_empty_files_are_refused(shipped, tmp_path):
    with pytest.raises(KvlabError, match="repeats the id 'a'"):
        load_jsonl(write_tasks(tmp_path / "twice.jsonl", [FACTS[0], FACTS[0]]), shipped.tokenizer)
    (tmp_path / "empty.jsonl").write_text("\n", encoding="utf-8")
    with pytest.raises(KvlabError, match="holds no tasks"):
        load_jsonl(tmp_path / "empty.jsonl", shipped.tokenizer)


def test_chat_models_get_a_user_turn_split_where_the_question_begins(shipped):
    tokenizer = shipped.tokenizer
    original = tokenizer.chat_template
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    try:
        context, question = prompt_ids(tokenizer, "Some context.", "What is it?")
    finally:
        tokenizer.chat_template = original
    assert tokenizer.decode(list(context)).startswith("<|user|>Some context.")
    assert tokenizer.decode(list(question)) == "What is it?<|end|><|assistant|>"


def test_answers_stop_at_a_line_break(shipped):
    stops = stop_token_ids(shipped.tokenizer, (shipped.tokenizer.eos_token_id,))
    assert shipped.tokenizer.eos_token_id in stops
    assert all("\n" in shipped.tokenizer.decode([t]) for t in stops if t != shipped.tokenizer.eos_token_id)
    assert shipped.tokenizer.encode("\n", add_special_tokens=False)[0] in stops


def test_eval_prints_accuracy_and_items_and_stores_the_run(tmp_path, capsys):
    tasks = write_tasks(tmp_path / "tasks.jsonl", FACTS)
    db = tmp_path / "runs.duckdb"
    status = main(["eval", "--tasks", tasks, "--policy", "full", "--json", "--db", str(db)])
    out = json.loads(capsys.readouterr().out)
    assert status == 0
    assert [item["id"] for item in out["items"]] == ["a", "b"]
    assert out["accuracy"] == sum(item["correct"] for item in out["items"]) / 2
    assert out["accuracy"] == 1.0
    assert main(["runs", "--db", str(db)]) == 0
    assert "jsonl:tasks.jsonl" in capsys.readouterr().out
