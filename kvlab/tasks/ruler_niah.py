"""RULER's needle-in-a-haystack tasks: niah_single_1/2/3, niah_multikey_1/2/3, niah_multivalue, niah_multiquery.

Each task is RULER's configuration (``synthetic.yaml``): a haystack (``noise``: RULER's ``repeat``, the sentence
"The grass is green. ..." on every line; ``essay``; ``needles``: RULER's ``needle``, every line a distractor needle),
the shapes of keys and values, and how many keys, values per key and asked keys. The texts are RULER's templates:
needles ``One of the special magic numbers for <key> is: <value>.``, the instruction before the haystack, and the
question with its answer prefix after it, turned singular by RULER's own word replacements when one value is asked.

Differences from RULER's generator, on purpose:

- the prompt has exactly the length asked for (RULER fills to at most the length, by whole sentences or lines): the
  haystack is cut where its tokens run out, and needles go in at the sentence boundary (essay) or line start
  (noise, needles) nearest their depth;
- the essay is kvlab's shipped haystacks, not Paul Graham's essays, and each item's window starts at a random
  sentence boundary rather than at the essay's beginning;
- depths: the essay's needles at depths drawn from RULER's 40 evenly spaced depths (as RULER); line haystacks'
  needles at uniformly random depths (RULER draws random line numbers, the same thing at line resolution);
- distractors never repeat the asked key or an answer (RULER's rarely might);
- a line haystack's lines each end with a newline (RULER joins lines with one, so its last line has none).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Literal

from kvlab.tasks.bos import BosRule
from kvlab.tasks.needle import encode, fact_piece
from kvlab.tasks.ruler_build import RulerItem, Window, assemble, essay_window, line_window
from kvlab.tasks.ruler_words import Shape, draw_distinct

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
#: RULER's needle depths in percent: 40 evenly spaced from 0 to 100, rounded.
DEPTHS = tuple(round(100 * i / 39) for i in range(40))
NEEDLE = "One of the special magic {kind} for {key} is: {value}."
HEAD = (
    "Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {kind} afterwards.\n"
)
QUESTION = "\nWhat are all the special magic {kind} for {query} mentioned in the provided text?"
ANSWER_PREFIX = " The special magic {kind} for {query} mentioned in the provided text are"
#: RULER's replacements that make its template singular when one value is asked, in its order.
SINGULAR = (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer"))


@dataclass(frozen=True)
class NiahConfig:
    """One NIAH task as RULER configures it: the haystack, the shapes of keys and values, the number of keys
    (needles with other keys are distractors), of values per key, and of keys asked."""

    haystack: Literal["noise", "essay", "needles"]
    key: Shape
    value: Shape
    keys: int = 1
    values: int = 1
    queries: int = 1


NIAH: dict[str, NiahConfig] = {
    "niah_single_1": NiahConfig("noise", "words", "numbers"),
    "niah_single_2": NiahConfig("essay", "words", "numbers"),
    "niah_single_3": NiahConfig("essay", "words", "uuids"),
    "niah_multikey_1": NiahConfig("essay", "words", "numbers", keys=4),
    "niah_multikey_2": NiahConfig("needles", "words", "numbers"),
    "niah_multikey_3": NiahConfig("needles", "uuids", "uuids"),
    "niah_multivalue": NiahConfig("essay", "words", "numbers", values=4),
    "niah_multiquery": NiahConfig("essay", "words", "numbers", keys=4, queries=4),
}


def asked_text(template: str, config: NiahConfig, query: str) -> str:
    """One of RULER's NIAH templates filled in, singular (RULER's replacements, ``numbers`` becoming ``number``)
    when one value is asked for."""
    if config.queries * config.values > 1:
        return template.format(kind=config.value, query=query)
    for plural, singular in SINGULAR:
        template = template.replace(plural, singular)
    return template.format(kind=config.value[:-1], query=query)


def niah_item(tokenizer: Any, task: str, length: int, rng: random.Random, bos: BosRule) -> RulerItem:
    """One NIAH prompt of ``task`` with exactly ``length`` tokens; its answers are the asked keys' values, in the
    order the keys are asked (RULER's order)."""
    config = NIAH[task]
    keys = draw_distinct(config.key, rng, config.keys)
    values = draw_distinct(config.value, rng, config.keys * config.values)
    by_key = [values[i * config.values : (i + 1) * config.values] for i in range(config.keys)]
    needles = [(key, value) for key, held in zip(keys, by_key) for value in held]
    rng.shuffle(needles)
    asked = rng.sample(range(config.keys), config.queries)
    answers = [value for i in asked for value in by_key[i]]
    names = [keys[i] for i in asked]
    query = names[0] if len(names) == 1 else ", ".join(names[:-1]) + ", and " + names[-1]
    statements = [NEEDLE.format(kind=config.value, key=key, value=value) for key, value in needles]
    if config.haystack == "essay":
        depths = sorted(depth / 100 for depth in rng.sample(DEPTHS, len(needles)))
        pieces = [(encode(tokenizer, fact_piece(s)), d) for s, d in zip(statements, depths)]
        window = essay_window(tokenizer, task, rng)
    else:
        depths = sorted(rng.random() for _ in needles)
        pieces = [(encode(tokenizer, f"{s}\n"), d) for s, d in zip(statements, depths)]
        window = _lines(tokenizer, config, rng, frozenset(keys), frozenset(values))
    first = next(i for i, (_, value) in enumerate(needles) if value == answers[0])
    return assemble(
        tokenizer,
        task,
        length,
        asked_text(HEAD, config, query),
        asked_text(QUESTION + ANSWER_PREFIX, config, query),
        answers,
        window,
        pieces,
        asked=first,
        bos=bos,
    )


def _lines(
    tokenizer: Any, config: NiahConfig, rng: random.Random, keys: frozenset[str], values: frozenset[str]
) -> Window:
    """A line haystack: the noise sentence on every line, or distractor needles with keys and values of the same
    shapes as the real ones (RULER's hard distractors), none repeating a real key or value."""
    if config.haystack == "noise":
        noise = encode(tokenizer, f"{NOISE}\n")
        return line_window(lambda: noise)

    def distractor() -> list[int]:
        key = draw_distinct(config.key, rng, 1, avoid=keys)[0]
        value = draw_distinct(config.value, rng, 1, avoid=values)[0]
        return encode(tokenizer, NEEDLE.format(kind=config.value, key=key, value=value) + "\n")

    return line_window(distractor)
