"""Training sequences: plain corpus windows, and windows with needle-retrieval episodes packed into them.

Every sequence starts with BOS. A retrieval sequence is a run of episodes, each one a window of corpus text with one
or more facts inserted at sentence or line boundaries, then a question and its answer, exactly in the needle-task
format of :mod:`kvlab.tasks.needle` (the same functions build both). Episodes are single-fact, multi-key (several keys
of one template, one asked) or multi-value, often with distractor facts of other templates, sometimes about the same
key, so the model must match the whole subject of the question and not just the key. The first episode of a sequence
can span almost the whole 4608 tokens, so facts are recalled across up to about 4.5k tokens.

Answer tokens are flagged so the loop can weigh them: they are a tiny share of the tokens but the whole point.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from kvlab.tasks.facts import TRAIN_TEMPLATES, Fact, Template, composed_template, make_fact
from kvlab.tasks.needle import (
    BoundaryTable,
    answer_text,
    encode,
    fact_pieces,
    in_order_of_appearance,
    insert_at_boundaries,
    question_text,
)

MIN_EPISODE = 160


@dataclass(frozen=True)
class MixSettings:
    """How sequences are drawn. ``retrieval_fraction`` of sequences carry episodes; the rest are plain text."""

    seq_len: int
    retrieval_fraction: float = 0.5
    composed_fraction: float = 0.3
    multi_key_fraction: float = 0.3
    multi_value_fraction: float = 0.2
    distractor_fraction: float = 0.5


class MixBuilder:
    """Cuts training sequences of ``seq_len + 1`` tokens (inputs and shifted labels) from a token stream."""

    def __init__(self, tokens: np.ndarray, tokenizer: Any, settings: MixSettings) -> None:
        self.tokens = tokens
        self.tokenizer = tokenizer
        self.settings = settings
        self.table = BoundaryTable.from_tokenizer(tokenizer)
        self.bos = tokenizer.bos_token_id

    def _window(self, rng: random.Random, length: int) -> np.ndarray:
        start = rng.randrange(0, len(self.tokens) - length)
        return np.asarray(self.tokens[start : start + length], dtype=np.int64)

    def plain(self, rng: random.Random) -> tuple[np.ndarray, np.ndarray]:
        """BOS and a random corpus window; no answer tokens."""
        total = self.settings.seq_len + 1
        ids = np.concatenate([[self.bos], self._window(rng, total - 1)])
        return ids, np.zeros(total, dtype=bool)

    def _template(self, rng: random.Random) -> Template:
        if rng.random() < self.settings.composed_fraction:
            return composed_template(rng)
        return rng.choice(TRAIN_TEMPLATES)

    def _fact(
        self, rng: random.Random, template: Template, used: set[str], num_values: int = 1, key: str | None = None
    ) -> Fact:
        """A fact whose subject (with its key) is not yet stated in this sequence, so no question is ambiguous."""
        while True:
            fact = make_fact(template, rng, num_values=num_values, key=key)
            subject = template.subject.format(key=fact.key)
            if subject not in used:
                used.add(subject)
                return fact
            key = None

    def episode(self, rng: random.Random, length: int, used: set[str]) -> tuple[list[int], list[bool]] | None:
        """One episode of at most ``length`` tokens, or None when its facts and question leave no room for text."""
        s = self.settings
        template = self._template(rng)
        roll = rng.random()
        multi_value = roll < s.multi_value_fraction
        fact = self._fact(rng, template, used, num_values=rng.randint(2, 4) if multi_value else 1)
        distractors: list[Fact] = []
        if not multi_value and roll < s.multi_value_fraction + s.multi_key_fraction:
            distractors += [self._fact(rng, template, used) for _ in range(rng.randint(1, 4))]
        if rng.random() < s.distractor_fraction:
            for _ in range(rng.randint(1, 3)):
                other = self._template(rng)
                same_key = fact.key if other.key_kind == template.key_kind and rng.random() < 0.5 else None
                distractors.append(self._fact(rng, other, used, key=same_key))
        pieces = fact_pieces(self.tokenizer, fact, rng.random(), distractors, rng)
        q_ids = encode(self.tokenizer, question_text(fact))
        answer_len = len(encode(self.tokenizer, answer_text(fact)))
        window_len = length - len(q_ids) - answer_len - sum(len(p) for p, _ in pieces)
        if window_len < 16:
            return None
        window = self._window(rng, window_len)
        body, positions = insert_at_boundaries(window, self.table.boundaries(window, lines=True), pieces)
        a_ids = encode(self.tokenizer, answer_text(in_order_of_appearance(fact, positions)))
        ids = body + q_ids + a_ids
        return ids, [False] * (len(body) + len(q_ids)) + [True] * len(a_ids)

    def _episode_length(self, rng: random.Random) -> int:
        """Half long (from 45% of the sequence to all of it), half log-uniform from MIN_EPISODE up to that."""
        split = max(MIN_EPISODE, int(0.45 * self.settings.seq_len))
        if rng.random() < 0.5:
            return rng.randint(split, self.settings.seq_len)
        return int(np.exp(rng.uniform(np.log(MIN_EPISODE), np.log(split))))

    def retrieval(self, rng: random.Random) -> tuple[np.ndarray, np.ndarray]:
        """BOS, then episodes until the sequence is full; a leftover too short for an episode is plain text."""
        total = self.settings.seq_len + 1
        ids: list[int] = [self.bos]
        mask: list[bool] = [False]
        used: set[str] = set()
        while total - len(ids) >= MIN_EPISODE:
            made = self.episode(rng, min(self._episode_length(rng), total - len(ids)), used)
            if made is None:
                break
            ids += made[0]
            mask += made[1]
        rest = total - len(ids)
        if rest > 0:
            ids += self._window(rng, rest).tolist()
            mask += [False] * rest
        return np.asarray(ids[:total], dtype=np.int64), np.asarray(mask[:total], dtype=bool)

    def sequence(self, rng: random.Random) -> tuple[np.ndarray, np.ndarray]:
        """A retrieval sequence with probability ``retrieval_fraction``, else a plain one."""
        if rng.random() < self.settings.retrieval_fraction:
            return self.retrieval(rng)
        return self.plain(rng)


class MixStream(IterableDataset):
    """An endless, seeded stream of ``(ids, answer_mask)`` for a DataLoader; each worker draws its own sequences.

    ``offset`` (the step a run resumes from) is part of the seed, so a resumed run does not replay the sequences it
    has already trained on.
    """

    def __init__(self, tokens_path: Path, tokenizer_dir: Path, settings: MixSettings, seed: int, offset: int) -> None:
        super().__init__()
        self.tokens_path, self.tokenizer_dir = tokens_path, tokenizer_dir
        self.settings, self.seed, self.offset = settings, seed, offset

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        from transformers import AutoTokenizer

        info = get_worker_info()
        worker = info.id if info is not None else 0
        rng = random.Random(f"{self.seed}/{self.offset}/{worker}")
        tokens = np.load(self.tokens_path, mmap_mode="r")
        builder = MixBuilder(tokens, AutoTokenizer.from_pretrained(self.tokenizer_dir), self.settings)
        while True:
            ids, mask = builder.sequence(rng)
            yield torch.from_numpy(ids), torch.from_numpy(mask)
