"""What the evaluation runs: a context, a question and the expected answer, as token ids ready for the engine.

Needle items (built by :mod:`kvlab.tasks.needle`) and user tasks from JSONL files both become a :class:`TaskItem`.
The context and the question stay apart so that the question can be read before compression (``query_aware``: the
policy sees the question, as SnapKV's observation window is meant to) or after it (the compressed cache must serve
any question). Base models get the plain completion format of the needle tasks; models with a chat template get a
user turn holding the context and question, and the assistant's turn opened.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

from kvlab import files
from kvlab.errors import KvlabError
from kvlab.hashing import text_sha256
from kvlab.models.limits import Limits
from kvlab.tasks.bos import DEFAULT_BOS, BosRule, special_ids
from kvlab.tasks.needle import ANSWER_PREFIX, QUESTION_PREFIX, NeedleItem, encode
from kvlab.tasks.ruler_build import RulerItem
from kvlab.tasks.ruler_score import join_answers, ruler_task_id

JSONL_FIELDS = ("id", "context", "question", "answer")
#: Fields of a task line that must hold some text (a question may be empty: the model then continues the context).
REQUIRED_TEXT = ("id", "context", "answer")


def item_hash(context_ids: Sequence[int], question_ids: Sequence[int], answer: str | None) -> str:
    """sha256 of what one trial answers: the prompt's token ids (context, then question) and the expected answer.
    Two trials with the same hash were measured on the same thing."""
    text = json.dumps([list(context_ids), list(question_ids), answer], separators=(",", ":"))
    return text_sha256(text)


@dataclass(frozen=True)
class TaskItem:
    """One prompt to answer. ``context_ids`` begin with the special tokens the BOS rule puts first
    (:mod:`kvlab.tasks.bos`); the prompt the model reads is ``context_ids + question_ids``.

    ``answers`` lists every string the output should contain when there are several to look for (a RULER item,
    scored by the share it contains); ``answer`` then holds them joined (:func:`~kvlab.tasks.ruler_score.join_answers`),
    so that :attr:`content_hash` covers them all. Needle and user items leave ``answers`` empty: their one
    ``answer`` is expected, and their hashes are those they always had."""

    task_id: str
    context_ids: tuple[int, ...]
    question_ids: tuple[int, ...]
    answer: str
    depth: float | None = None
    answers: tuple[str, ...] = ()

    @property
    def expected_answers(self) -> tuple[str, ...]:
        """Every string the output should contain: ``answers``, or the one ``answer``."""
        return self.answers or (self.answer,)

    @property
    def context_tokens(self) -> int:
        """Every prompt token, context and question together."""
        return len(self.context_ids) + len(self.question_ids)

    @property
    def content_hash(self) -> str:
        """The :func:`item_hash` of this item."""
        return item_hash(self.context_ids, self.question_ids, self.answer)


def from_needle(item: NeedleItem, index: int) -> TaskItem:
    """A needle item as a task item (its ids already follow the plain completion format)."""
    return TaskItem(
        task_id=f"needle-{item.kind}-{item.context_tokens}-{index}",
        context_ids=item.context_ids,
        question_ids=item.question_ids,
        answer=item.answer,
        depth=item.depth,
    )


def from_ruler(item: RulerItem, index: int) -> TaskItem:
    """A RULER item as a task item, its ``task_id`` naming its task (:func:`~kvlab.tasks.ruler_score.task_of`)."""
    return TaskItem(
        task_id=ruler_task_id(item.task, item.context_tokens, index),
        context_ids=item.context_ids,
        question_ids=item.question_ids,
        answer=join_answers(item.answers),
        depth=item.depth,
        answers=item.answers,
    )


def has_chat_template(tokenizer: Any) -> bool:
    """Whether the tokenizer's model expects its prompts in a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def _user_turn(tokenizer: Any, content: str) -> str:
    """``content`` as one user turn with the assistant's turn opened, rendered by the model's chat template."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )


def text_ids(tokenizer: Any, text: str, *, chat: bool = True, bos: BosRule = DEFAULT_BOS) -> tuple[int, ...]:
    """A prompt's ids: for a model with a chat template the text as one user turn (the model answers it, as it was
    trained to), unless ``chat`` is off; otherwise the text wrapped in the special tokens of the ``bos`` rule."""
    if chat and has_chat_template(tokenizer):
        return tuple(encode(tokenizer, _user_turn(tokenizer, text)))
    before, after = special_ids(tokenizer, bos)
    return (*before, *encode(tokenizer, text), *after)


def prompt_ids(
    tokenizer: Any, context: str, question: str, *, chat: bool = True, bos: BosRule = DEFAULT_BOS
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Context and question ids for a model: the needle format for base models (and for chat models with ``chat``
    off), wrapped in the special tokens of the ``bos`` rule, a chat turn for chat models.

    For chat models the rendered conversation is split where the question begins, so that the question (and the
    end of the user turn) can still be read after compression.
    """
    if chat and has_chat_template(tokenizer):
        marker = "\u2063kvlab-question\u2063"
        head, _, tail = _user_turn(tokenizer, f"{context}\n\n{marker}").partition(marker)
        return tuple(encode(tokenizer, head)), tuple(encode(tokenizer, question + tail))
    before, after = special_ids(tokenizer, bos)
    question_ids = encode(tokenizer, f"{QUESTION_PREFIX}{question}{ANSWER_PREFIX}")
    return (*before, *encode(tokenizer, context)), (*question_ids, *after)


def load_jsonl(
    path: str | Path, tokenizer: Any, limits: Limits = Limits(), new_tokens: int = 0, bos: BosRule = DEFAULT_BOS
) -> list[TaskItem]:
    """User tasks, one JSON object per line with string fields ``id``, ``context``, ``question``, ``answer``, their
    prompts wrapped by the ``bos`` rule.

    A malformed line is reported with its number (bad JSON, nesting too deep, text that is not valid Unicode, a
    missing or empty field, a prompt that with ``new_tokens`` generated would not fit ``limits``); nothing is run
    until the whole file reads cleanly.
    """
    path = Path(path)
    lines = files.read_text(path, "task file").splitlines()
    items: list[TaskItem] = []
    seen: set[str] = set()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"Line {number} of {path}"
        limits.check_text(line, where)
        record = _parse_line(line, where)
        if record["id"] in seen:
            raise KvlabError(f"{where} repeats the id {record['id']!r}; ids must be unique.")
        seen.add(record["id"])
        context_ids, question_ids = prompt_ids(tokenizer, record["context"], record["question"], bos=bos)
        try:
            limits.check(len(context_ids) + len(question_ids), new_tokens)
        except KvlabError as error:
            raise KvlabError(f"{where}: {error}") from None
        items.append(TaskItem(record["id"], context_ids, question_ids, record["answer"]))
    if not items:
        raise KvlabError(f"The task file {path} holds no tasks.")
    return items


def _parse_line(line: str, where: str) -> dict[str, str]:
    """One task line as its four text fields, or one sentence naming what is wrong with it."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise KvlabError(f"{where} is not valid JSON ({error.msg}).") from None
    except RecursionError:
        raise KvlabError(f"{where} is nested too deeply to be a task.") from None
    except ValueError:  # a number too long to convert (Python's integer digit limit)
        raise KvlabError(f"{where} holds a number too long to read; a task's fields are text.") from None
    if not isinstance(record, dict) or any(not isinstance(record.get(f), str) for f in JSONL_FIELDS):
        raise KvlabError(f"{where} must be an object with string fields {', '.join(JSONL_FIELDS)}.")
    for name in JSONL_FIELDS:
        try:
            record[name].encode("utf-8")
        except UnicodeEncodeError:
            raise KvlabError(f"{where} has text in {name!r} that is not valid Unicode (a lone surrogate).") from None
    empty = [name for name in REQUIRED_TEXT if not record[name].strip()]
    if empty:
        raise KvlabError(f"{where} has an empty {empty[0]!r}; every task needs an id, a context and an answer.")
    return {name: record[name] for name in JSONL_FIELDS}


@lru_cache(maxsize=16)
def _newline_tokens(tokenizer: Any) -> tuple[int, ...]:
    return tuple(i for i in range(len(tokenizer)) if "\n" in tokenizer.decode([i]))


def stop_token_ids(tokenizer: Any, eos: Sequence[int] = ()) -> tuple[int, ...]:
    """Tokens that end an answer: the end of sequence and every token that contains a line break (answers are one
    line, and scoring reads the first line)."""
    return tuple(sorted(set(eos) | set(_newline_tokens(tokenizer))))
