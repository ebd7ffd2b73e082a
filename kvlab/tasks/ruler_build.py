"""A RULER prompt of an exact token length: instructions, a filler window with pieces inserted, and the question.

Every RULER task here has the same shape: ``BOS + head + body`` is the context and ``question`` (the question and
RULER's answer prefix) follows it, the special tokens (the BOS, where there is one) those of the BOS rule
(:mod:`kvlab.tasks.bos`), kept apart so that an engine can read it before or after compressing the cache.
Like kvlab's needle prompts (:mod:`kvlab.tasks.needle`), a prompt is assembled from token ids rather than
re-tokenised text: the head, the question and each inserted piece are tokenised on their own, and the body's filler
is cut to exactly the tokens left over, so that the prompt has exactly the length asked for. The filler is an essay
window starting at a sentence boundary (pieces go in at sentence boundaries), a run of lines (pieces go in between
lines), or a word list (no pieces; cut at its end).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from kvlab.errors import KvlabError
from kvlab.tasks.bos import BosRule, special_ids
from kvlab.tasks.needle import HAYSTACK_DIR, Haystack, encode, insert_at_boundaries

#: A filler of ``n`` tokens: its ids and the positions where a piece may be inserted.
Window = Callable[[int], tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class RulerItem:
    """One RULER prompt. ``context_ids`` start with the special tokens the BOS rule puts first and ``question_ids``
    end with those it puts last; the prompt is ``context_ids + question_ids``. ``answers`` are every string the
    output should contain; ``depth`` is where the first answer's needle sits (the share of filler tokens before it),
    ``None`` for tasks without needles."""

    task: str
    context_ids: tuple[int, ...]
    question_ids: tuple[int, ...]
    answers: tuple[str, ...]
    depth: float | None

    @property
    def context_tokens(self) -> int:
        """Every prompt token, context and question together."""
        return len(self.context_ids) + len(self.question_ids)


def assemble(
    tokenizer: Any,
    task: str,
    length: int,
    head: str,
    question: str,
    answers: Sequence[str],
    window: Window,
    pieces: Sequence[tuple[Sequence[int], float]] = (),
    asked: int | None = None,
    *,
    bos: BosRule,
) -> RulerItem:
    """The prompt of exactly ``length`` tokens: ``head``, a filler window with each ``(ids, depth)`` piece inserted at
    the insertion point nearest its depth, and ``question``, wrapped in the special tokens of the ``bos`` rule.
    ``asked`` is the piece whose depth the item records."""
    before, after = special_ids(tokenizer, bos)
    head_ids, question_ids = encode(tokenizer, head), [*encode(tokenizer, question), *after]
    window_len = length - len(before) - len(head_ids) - len(question_ids) - sum(len(ids) for ids, _ in pieces)
    if window_len < 1:
        raise KvlabError(
            f"A {length}-token {task} prompt does not fit: its instructions, inserted lines and question alone take "
            f"{length - window_len} tokens."
        )
    ids, boundaries = window(window_len)
    body, positions = insert_at_boundaries(ids, boundaries, pieces)
    return RulerItem(
        task=task,
        context_ids=(*before, *head_ids, *body),
        question_ids=tuple(question_ids),
        answers=tuple(answers),
        depth=None if asked is None else positions[asked] / window_len,
    )


@lru_cache(maxsize=8)
def essay(tokenizer: Any) -> Haystack:
    """RULER's ``essay`` haystack: its Paul Graham essays joined into one text; here the shipped haystacks (the
    Python documentation's prose, held out from the shipped model's training), joined in name order."""
    texts = [path.read_text(encoding="utf-8").strip() for path in sorted(HAYSTACK_DIR.glob("*.txt"))]
    return Haystack.from_text("essay", " ".join(texts), tokenizer)


def essay_window(tokenizer: Any, task: str, rng: random.Random) -> Window:
    """Windows of the essay that start at a sentence boundary drawn at random (RULER always starts at the essay's
    beginning; a random start gives the items of one length different text, as kvlab's needle prompts do)."""
    haystack = essay(tokenizer)

    def window(n: int) -> tuple[np.ndarray, np.ndarray]:
        starts = np.union1d(np.asarray([0]), haystack.boundaries)
        starts = starts[starts + n <= len(haystack.ids)]
        if len(starts) == 0:
            raise KvlabError(
                f"A {task} prompt needs {n:,} tokens of essay, more than the shipped haystacks hold "
                f"({len(haystack.ids):,} tokens for this tokenizer)."
            )
        start = int(rng.choice(starts.tolist()))
        inside = (haystack.boundaries > start) & (haystack.boundaries < start + n)
        return haystack.ids[start : start + n], haystack.boundaries[inside] - start

    return window


def line_window(next_line: Callable[[], Sequence[int]]) -> Window:
    """Windows made of whole lines (``next_line`` gives each line's ids, newline included), the last one cut where
    the window ends; pieces go in at line starts."""

    def window(n: int) -> tuple[np.ndarray, np.ndarray]:
        ids: list[int] = []
        starts: list[int] = []
        while len(ids) < n:
            starts.append(len(ids))
            ids.extend(next_line())
        return np.asarray(ids[:n], dtype=np.int64), np.asarray(starts[1:], dtype=np.int64)

    return window


def cut_window(
    task: str, length: int, grown: Callable[[int], list[int]], most: int, check: Callable[[list[int]], None]
) -> Window:
    """Windows of a list that grows with a count (CWE's distinct words, FWE's words): the smallest count in
    ``1..most`` whose ids (``grown(count)``) cover the window, cut at the window's end, so that the cut removes less
    than one step of growth; ``check`` then refuses, in one sentence, a cut list whose answers no longer stand out.
    A list too short even at ``most`` is one sentence."""
    ids_of = lru_cache(maxsize=None)(lambda count: tuple(grown(count)))

    def window(n: int) -> tuple[np.ndarray, np.ndarray]:
        count = smallest_count(lambda count: len(ids_of(count)), n, most)
        if count is None:
            raise KvlabError(
                f"A {length}-token {task} prompt needs more distinct words than kvlab's vocabulary holds; "
                "use a shorter context."
            )
        ids = list(ids_of(count)[:n])
        check(ids)
        return np.asarray(ids, dtype=np.int64), np.asarray([], dtype=np.int64)

    return window


def smallest_count(size: Callable[[int], int], n: int, most: int) -> int | None:
    """The smallest count in ``1..most`` whose list's ``size`` (growing with the count) reaches ``n``, or None.

    Each size tokenises a whole list, so the search guesses in proportion (a list's size is nearly proportional to
    its count), halving the bracket every third guess once it has one, so that it always ends: a few sizes instead
    of a bisection's dozen or more.
    """
    low, high = 0, most + 1  # size(low) < n; size(high) >= n, or high is past the end
    guess, tests = 1, 0
    while high - low > 1:
        tests += 1
        if size(guess) >= n:
            high = guess
        else:
            low = guess
        proportional = math.ceil(guess * n / max(size(guess), 1))
        bisect = tests % 3 == 0 and high <= most
        guess = (low + high) // 2 if bisect else min(high - 1, max(low + 1, proportional))
    return high if high <= most else None
