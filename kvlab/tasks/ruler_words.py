"""The words RULER's tasks are made of, drawn from vocabularies kvlab ships (nothing is downloaded).

RULER (Hsieh et al. 2024, arXiv:2404.06654) draws keys and word values from the ``wonderwords`` package's adjectives
and nouns (``adjective-noun`` pairs such as ``abundant-cat``), numbers as 7-digit integers, UUIDs as random version-4
UUIDs, common words (CWE) from ``wonderwords``' nouns, adjectives and verbs, variable names (VT) as random upper-case
strings and coded words (FWE) as random strings of six lower-case letters. kvlab does the same, with word lists of its
own in ``kvlab/data/ruler/`` in place of ``wonderwords``'; CWE's vocabulary also takes the lower-case words of the
shipped haystacks, so that it holds enough distinct words for long contexts (3,460 words: CWE reaches beyond 40k tokens
with the shipped model's tokenizer, and refuses a context it cannot fill in one sentence).
"""

from __future__ import annotations

import random
import re
import string
import uuid
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Literal

from kvlab.paths import shipped
from kvlab.tasks.needle import HAYSTACK_DIR

WORDS_DIR = shipped("ruler")
#: What a needle's key or value is: a 7-digit number, an ``adjective-noun`` pair, or a UUID (RULER's names).
Shape = Literal["numbers", "words", "uuids"]


@dataclass(frozen=True)
class Vocabulary:
    """The shipped word lists: ``adjectives`` and ``nouns`` make keys, ``common`` (every list and the haystacks'
    lower-case words, sorted, each once) is what CWE draws from."""

    adjectives: tuple[str, ...]
    nouns: tuple[str, ...]
    common: tuple[str, ...]


def _words(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@lru_cache(maxsize=1)
def vocabulary() -> Vocabulary:
    """The vocabulary, read once."""
    adjectives, nouns, verbs = (_words(WORDS_DIR / f"{name}.txt") for name in ("adjectives", "nouns", "verbs"))
    haystack = {
        word
        for path in sorted(HAYSTACK_DIR.glob("*.txt"))
        for word in re.findall(r"[A-Za-z]+", path.read_text(encoding="utf-8"))
        if word.islower() and len(word) >= 3
    }
    return Vocabulary(tuple(adjectives), tuple(nouns), tuple(sorted(set(adjectives + nouns + verbs) | haystack)))


def draw(shape: Shape, rng: random.Random) -> str:
    """One random key or value of ``shape``, as RULER draws it."""
    if shape == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if shape == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    words = vocabulary()
    return f"{rng.choice(words.adjectives)}-{rng.choice(words.nouns)}"


def draw_distinct(shape: Shape, rng: random.Random, count: int, avoid: frozenset[str] = frozenset()) -> list[str]:
    """``count`` different draws of ``shape``, none of them in ``avoid`` (a needle's key never doubles as another's,
    and a distractor never repeats an answer)."""
    drawn: list[str] = []
    while len(drawn) < count:
        value = draw(shape, rng)
        if value not in avoid and value not in drawn:
            drawn.append(value)
    return drawn


def random_strings(rng: random.Random, count: int, length: int, *, upper: bool = False) -> list[str]:
    """``count`` different random strings of ``length`` letters: VT's variable names (upper case) and FWE's coded
    words (lower case)."""
    letters = string.ascii_uppercase if upper else string.ascii_lowercase
    drawn: dict[str, None] = {}
    while len(drawn) < count:
        drawn.setdefault("".join(rng.choices(letters, k=length)))
    return list(drawn)
