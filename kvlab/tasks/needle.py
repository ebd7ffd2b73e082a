"""Needle-in-a-haystack prompts of an exact length, and their scoring.

A prompt is ``BOS + haystack with the fact sentence(s) inserted + "\\n\\nQuestion: <question>\\nAnswer:"``, its
special tokens (the BOS, where there is one) those of the BOS rule (:mod:`kvlab.tasks.bos`). The model should continue
with ``" <answer>\\n"``. The prompt is assembled from token ids, not re-tokenised text, so that its
length is exactly the number of tokens asked for and the fact sits exactly where the item says: the haystack is
tokenised once, a window of it is cut to the length left over by the BOS, the fact(s) and the question, and each fact
is inserted at the sentence boundary nearest its requested depth. Every piece is tokenised on its own and the pieces
meet at pre-tokenisation boundaries (a sentence's final ``.`` and the space that starts the next word), so tokenising
``item.context + item.question`` gives the same ids except, rarely, at the one point where the window is cut.

The question is kept apart (``question_ids``) so that an engine can read it before or after compressing the cache.
The training mix of the shipped model is built by the same functions, so its format is this one by construction.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal, Sequence

import numpy as np
import torch

from kvlab.answers import first_line_is, holds
from kvlab.errors import KvlabError
from kvlab.paths import shipped
from kvlab.tasks.bos import DEFAULT_BOS, BosRule, special_ids
from kvlab.tasks.facts import Fact, Template, make_fact

HAYSTACK_DIR = shipped("haystacks")
QUESTION_PREFIX = "\n\nQuestion: "
ANSWER_PREFIX = "\nAnswer:"
Kind = Literal["single", "multi-key", "multi-value"]


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` with no special tokens (the assembler adds the prompt's, by the BOS rule).

    Haystacks are longer than the model's context on purpose (prompts are windows of them), so the tokenizer's
    too-long warning is silenced.
    """
    return list(tokenizer.encode(text, add_special_tokens=False, verbose=False))


def question_text(fact: Fact) -> str:
    """What follows the context: ``"\\n\\nQuestion: <question>\\nAnswer:"``."""
    return f"{QUESTION_PREFIX}{fact.question}{ANSWER_PREFIX}"


def fact_piece(statement: str) -> str:
    """How a statement is inserted after a sentence: with one leading space, like the sentence that follows it."""
    return f" {statement}"


def answer_text(fact: Fact) -> str:
    """What the model should generate after ``Answer:``: a space, the answer and a newline."""
    return f" {fact.answer}\n"


@dataclass(frozen=True)
class BoundaryTable:
    """Per-vocabulary-entry flags that find sentence and line boundaries in a sequence of token ids.

    A sentence boundary is a position whose previous token ends with ``.``, ``!`` or ``?`` and whose token starts with
    whitespace; a line boundary is a position whose previous token ends with a newline. Working on ids keeps the
    training mix free of detokenising and retokenising millions of windows.
    """

    ends_sentence: np.ndarray
    ends_line: np.ndarray
    starts_space: np.ndarray

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> "BoundaryTable":
        """Decode every vocabulary entry once and record its flags."""
        size = len(tokenizer)
        texts = [tokenizer.decode([i]) for i in range(size)]
        return cls(
            ends_sentence=np.array([t.endswith((".", "!", "?")) for t in texts]),
            ends_line=np.array([t.endswith("\n") for t in texts]),
            starts_space=np.array([t[:1] in (" ", "\n") for t in texts]),
        )

    def boundaries(self, ids: np.ndarray, *, lines: bool = False) -> np.ndarray:
        """Positions ``i`` in ``1..len(ids)-1`` where a sentence (or, with ``lines``, a line) ends just before ``i``."""
        prev, cur = ids[:-1], ids[1:]
        mask = self.ends_sentence[prev] & self.starts_space[cur]
        if lines:
            mask |= self.ends_line[prev]
        return np.flatnonzero(mask) + 1


@lru_cache(maxsize=8)
def _table(tokenizer: Any) -> BoundaryTable:
    return BoundaryTable.from_tokenizer(tokenizer)


@dataclass(frozen=True)
class Haystack:
    """A tokenised text to hide facts in, with its sentence boundaries (window starts and insertion points)."""

    name: str
    ids: np.ndarray
    boundaries: np.ndarray

    @classmethod
    def from_text(cls, name: str, text: str, tokenizer: Any) -> "Haystack":
        """Tokenise ``text`` once and find its sentence boundaries."""
        ids = np.asarray(encode(tokenizer, text), dtype=np.int64)
        return cls(name, ids, _table(tokenizer).boundaries(ids))


def load_haystacks(tokenizer: Any, directory: Path = HAYSTACK_DIR) -> list[Haystack]:
    """Every ``*.txt`` file of ``directory`` (by default kvlab's held-out haystacks), tokenised, in name order."""
    files = sorted(directory.glob("*.txt"))
    if not files:
        raise KvlabError(f"No haystack text files (*.txt) were found in {directory}.")
    return [Haystack.from_text(f.stem, f.read_text(encoding="utf-8"), tokenizer) for f in files]


def insert_at_boundaries(
    window: np.ndarray, boundaries: np.ndarray, pieces: Sequence[tuple[Sequence[int], float]]
) -> tuple[list[int], list[int]]:
    """Insert each ``(ids, depth)`` piece at the boundary of ``window`` nearest ``depth * len(window)``.

    ``boundaries`` are positions in ``window`` (0, the window's start, is always allowed). Returns the new ids and,
    for each piece in the order given, the number of window tokens before it (its position in the haystack).
    """
    allowed = np.union1d(np.asarray([0]), boundaries)
    positions = [int(allowed[np.abs(allowed - depth * len(window)).argmin()]) for _, depth in pieces]
    order = sorted(range(len(pieces)), key=lambda i: (positions[i], i))
    out: list[int] = []
    cursor = 0
    for i in order:
        out.extend(window[cursor : positions[i]].tolist())
        out.extend(pieces[i][0])
        cursor = positions[i]
    out.extend(window[cursor:].tolist())
    return out, positions


@dataclass(frozen=True)
class NeedleItem:
    """One needle prompt. ``context_ids`` start with the special tokens the BOS rule puts first (a BOS, or none) and
    ``question_ids`` end with those it puts last; the prompt is ``context_ids + question_ids``.

    ``context`` and ``question`` are the texts of the prompt without its special tokens. ``depth`` is where the asked
    fact really sits (the fraction of haystack tokens before it), ``requested_depth`` what was asked for.
    ``context_tokens`` counts every prompt token: special tokens, haystack, facts and question.
    """

    context: str
    question: str
    answer: str
    depth: float
    context_tokens: int
    context_ids: tuple[int, ...]
    question_ids: tuple[int, ...]
    requested_depth: float
    template: str
    key: str
    kind: Kind
    num_facts: int
    haystack: str

    def prompt_ids(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt split in two ``(1, n)`` long tensors: the context and the question."""
        return (torch.tensor([self.context_ids], dtype=torch.long), torch.tensor([self.question_ids], dtype=torch.long))


def fact_pieces(
    tokenizer: Any, fact: Fact, depth: float, distractors: Sequence[Fact], rng: random.Random
) -> list[tuple[list[int], float]]:
    """The ``(ids, depth)`` pieces to insert: the asked fact's statements first (its first value at ``depth``, any
    other values at random depths), then each distractor's statements at random depths."""
    depths = [depth] + [rng.random() for _ in fact.values[1:]]
    pieces = [(encode(tokenizer, fact_piece(s)), d) for s, d in zip(fact.statements, depths)]
    pieces += [(encode(tokenizer, fact_piece(s)), rng.random()) for f in distractors for s in f.statements]
    return pieces


def in_order_of_appearance(fact: Fact, positions: Sequence[int]) -> Fact:
    """``fact`` with its values sorted by where they were inserted (the first ``len(values)`` positions)."""
    order = sorted(range(len(fact.values)), key=lambda i: (positions[i], i))
    return Fact(fact.template, fact.key, tuple(fact.values[i] for i in order))


def build_needle(
    tokenizer: Any,
    haystack: Haystack,
    context_tokens: int,
    depth: float,
    fact: Fact,
    *,
    distractors: Sequence[Fact] = (),
    rng: random.Random | None = None,
    bos: BosRule = DEFAULT_BOS,
) -> NeedleItem:
    """A prompt of exactly ``context_tokens`` tokens asking for ``fact``, hidden at ``depth`` of ``haystack``.

    ``distractors`` are other facts stated at random depths (same template and other keys make a multi-key task).
    A multi-value fact's first value goes at ``depth`` and the others at random depths; the expected answer lists the
    values in the order they appear. The haystack window starts at a sentence boundary, the first one unless ``rng``
    is given, in which case it is drawn at random (so items at one length see different text). The special tokens
    around the prompt are those of the ``bos`` rule, counted in its length.
    """
    if not 0.0 <= depth <= 1.0:
        raise KvlabError(f"A needle depth must lie in [0, 1]; got {depth}.")
    pieces = fact_pieces(tokenizer, fact, depth, distractors, rng or random.Random(0))
    before, after = special_ids(tokenizer, bos)
    q_ids = [*encode(tokenizer, question_text(fact)), *after]
    window_len = context_tokens - len(before) - len(q_ids) - sum(len(p) for p, _ in pieces)
    starts = np.union1d(np.asarray([0]), haystack.boundaries)
    starts = starts[starts + window_len <= len(haystack.ids)]
    if window_len <= 0 or len(starts) == 0:
        raise KvlabError(
            f"A {context_tokens}-token needle prompt does not fit haystack {haystack.name!r} "
            f"({len(haystack.ids)} tokens) with its facts and question."
        )
    start = int(rng.choice(starts.tolist())) if rng is not None else int(starts[0])
    window = haystack.ids[start : start + window_len]
    local = haystack.boundaries[(haystack.boundaries > start) & (haystack.boundaries < start + window_len)] - start
    body, positions = insert_at_boundaries(window, local, pieces)
    context_ids = (*before, *body)
    kind: Kind = (
        "multi-value"
        if fact.multi_value
        else ("multi-key" if any(f.template.name == fact.template.name for f in distractors) else "single")
    )
    return NeedleItem(
        context=tokenizer.decode(body),
        question=question_text(fact),
        answer=in_order_of_appearance(fact, positions).answer,
        depth=positions[0] / window_len,
        context_tokens=len(context_ids) + len(q_ids),
        context_ids=context_ids,
        question_ids=tuple(q_ids),
        requested_depth=depth,
        template=fact.template.name,
        key=fact.key,
        kind=kind,
        num_facts=len(pieces),
        haystack=haystack.name,
    )


def needle_suite(
    tokenizer: Any,
    haystacks: Sequence[Haystack],
    templates: Sequence[Template],
    *,
    lengths: Sequence[int],
    depths: Sequence[float],
    per_depth: int,
    seed: int = 0,
    kind: Kind = "single",
    num_keys: int = 4,
    num_values: int = 3,
) -> list[NeedleItem]:
    """A seeded grid of needle items: for each length and depth, ``per_depth`` items cycling templates and haystacks.

    ``kind="multi-key"`` adds ``num_keys - 1`` facts of the same template with other keys; ``kind="multi-value"``
    states ``num_values`` values of the asked key.
    """
    rng = random.Random(seed)
    items: list[NeedleItem] = []
    counter = 0
    for length in lengths:
        for depth in depths:
            for _ in range(per_depth):
                template = templates[counter % len(templates)]
                haystack = haystacks[counter % len(haystacks)]
                counter += 1
                fact = make_fact(template, rng, num_values=num_values if kind == "multi-value" else 1)
                distractors: list[Fact] = []
                if kind == "multi-key":
                    used = {fact.key}
                    for _ in range(num_keys - 1):
                        distractors.append(make_fact(template, rng, avoid_keys=frozenset(used)))
                        used.add(distractors[-1].key)
                items.append(build_needle(tokenizer, haystack, length, depth, fact, distractors=distractors, rng=rng))
    return items


@dataclass(frozen=True)
class Score:
    """``exact``: the output's first line, stripped, is the answer. ``contains``: the answer occurs anywhere. Both
    ignore case (:mod:`kvlab.answers`)."""

    contains: bool
    exact: bool


def score(output_text: str, answer: str) -> Score:
    """Score a model's continuation of ``Answer:`` against the expected answer (which must hold some text: an
    empty answer is contained in every output)."""
    if not answer.strip():
        raise KvlabError("An empty expected answer cannot be scored: every output contains it.")
    return Score(contains=holds(output_text, answer), exact=first_line_is(output_text, answer))
