"""RULER's multi-hop tracing and aggregation tasks: variable tracking (``vt``), common-words extraction (``cwe``) and
frequent-words extraction (``fwe``), with RULER's templates and settings.

- ``vt``: one chain of four hops (``VAR ABCDE = 12345``, then ``VAR FGHIJ = VAR ABCDE`` and so on) hidden among
  lines of the noise sentence; the answer is the chain's five variables. As in RULER, an in-context example (a short
  chain of three-letter names, with its answer) comes first. Differences: each assignment is a line of its own
  (RULER writes them inline, between noise sentences); the example holds four noise lines (RULER's fills about
  500 tokens), so that the task fits short contexts.
- ``cwe``: a numbered list of words in which 10 words appear ``freq_cw`` times and the others ``freq_ucw`` times,
  after one worked example; RULER's settings by length (below 2,048 tokens 6 and 1, below 4,096 10 and 3, else 30
  and 3; the example 3 and 1 below 4,096, else 10 and 3). The answer is the 10 common words.
- ``fwe``: coded words (six random letters) drawn with Zipf frequencies (``alpha`` = 2, the top-ranked word being
  RULER's ``...`` noise) from a vocabulary of ``length // 50`` words; the answer is the three most frequent coded
  words after the noise.

The lists grow until they cover the prompt and are cut at its last token (so the cut removes less than one step of
growth: a few list entries); a cut list whose answers no longer stand out (a context too short) is refused in one
sentence. RULER instead fills to at most the length by whole lists.
"""

from __future__ import annotations

import math
import random
import re
from collections import Counter
from typing import Any

from kvlab.errors import KvlabError
from kvlab.tasks.bos import BosRule
from kvlab.tasks.needle import encode
from kvlab.tasks.ruler_build import RulerItem, assemble, cut_window, line_window
from kvlab.tasks.ruler_niah import NOISE
from kvlab.tasks.ruler_words import random_strings, vocabulary

VT_HEAD = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
VT_QUESTION = "\nQuestion: Find all variables that are assigned the value {value} in the text above."
VT_ANSWER_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {count} variables are assigned "
    "the value {value}, they are: "
)
HOPS = 4
EXAMPLE_NOISE_LINES = 4

CWE_HEAD = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n"
)
CWE_QUESTION = "\nQuestion: What are the 10 most common words in the above list?"
CWE_ANSWER_PREFIX = " Answer: The top 10 words appearing most often in the list are:"
COMMON_WORDS = 10

FWE_HEAD = (
    "Read the following coded text and track the frequency of each coded word. "
    "Find the three most frequently appeared coded words."
)
FWE_QUESTION = (
    "\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
FWE_ANSWER_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"
ALPHA = 2.0
#: The Riemann zeta function at ``ALPHA`` (pi^2 / 6), which normalises RULER's Zipf counts.
ZETA_ALPHA = math.pi**2 / 6
CODED_LETTERS = 6


def _chain(rng: random.Random, name_letters: int) -> tuple[list[str], str, list[str]]:
    """A chain of ``HOPS`` hops: its variables, the value they all hold, and its assignments."""
    names = random_strings(rng, HOPS + 1, name_letters, upper=True)
    value = str(rng.randint(10000, 99998))
    assignments = [f"VAR {names[0]} = {value}"] + [f"VAR {b} = VAR {a}" for a, b in zip(names, names[1:])]
    return names, value, assignments


def _vt_question(names: list[str], value: str) -> str:
    return VT_QUESTION.format(value=value) + VT_ANSWER_PREFIX.format(count=len(names), value=value)


def vt_item(tokenizer: Any, length: int, rng: random.Random, bos: BosRule) -> RulerItem:
    """One variable-tracking prompt of exactly ``length`` tokens; the answers are the chain's variables."""
    example_names, example_value, example_lines = _chain(rng, 3)
    lines = [NOISE] * EXAMPLE_NOISE_LINES
    for offset, position in enumerate(sorted(rng.sample(range(len(lines) + 1), len(example_lines)))):
        lines.insert(position + offset, example_lines[offset])
    example = f"{VT_HEAD}{chr(10).join(lines)}\n{_vt_question(example_names, example_value)}{' '.join(example_names)}"
    names, value, assignments = _chain(rng, 5)
    depths = sorted(rng.random() for _ in assignments)
    noise = encode(tokenizer, f"{NOISE}\n")
    return assemble(
        tokenizer,
        "vt",
        length,
        f"{example}\n\n{VT_HEAD}",
        _vt_question(names, value),
        names,
        line_window(lambda: noise),
        [(encode(tokenizer, f"{line}\n"), depth) for line, depth in zip(assignments, depths)],
        bos=bos,
    )


def _numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {word}" for i, word in enumerate(words))


def _repeated(words: list[str], common: int, uncommon: int, rng: random.Random) -> list[str]:
    """The first ``COMMON_WORDS`` of ``words`` ``common`` times each and the rest ``uncommon`` times, shuffled."""
    listed = words[:COMMON_WORDS] * common + words[COMMON_WORDS:] * uncommon
    rng.shuffle(listed)
    return listed


def _cwe_repeats(length: int) -> tuple[tuple[int, int, int], tuple[int, int]]:
    """RULER's CWE settings by length: the example's (words, common and uncommon repeats), the prompt's repeats."""
    if length < 4096:
        return (20, 3, 1), ((6, 1) if length < 2048 else (10, 3))
    return (40, 10, 3), (30, 3)


def cwe_item(tokenizer: Any, length: int, rng: random.Random, bos: BosRule) -> RulerItem:
    """One common-words prompt of exactly ``length`` tokens; the answers are the 10 common words."""
    words = list(vocabulary().common)
    (example_count, example_common, example_uncommon), (common, uncommon) = _cwe_repeats(length)
    example_words = rng.sample(words, example_count)
    example_list = _numbered(_repeated(example_words, example_common, example_uncommon, rng))
    example = f"{CWE_HEAD}{example_list}{CWE_QUESTION}{CWE_ANSWER_PREFIX} {_numbered(example_words[:COMMON_WORDS])}"
    order = rng.sample(words, len(words))
    shuffle_seed = rng.random()

    def grown(count: int) -> list[int]:
        listed = _repeated(order[: COMMON_WORDS + count - 1], common, uncommon, random.Random(shuffle_seed))
        return encode(tokenizer, _numbered(listed))

    def check(ids: list[int]) -> None:
        counts = Counter(re.findall(r"\d+\. (\S+)", tokenizer.decode(ids)))
        _refuse_unless_above(counts, order[:COMMON_WORDS], length, "cwe")

    return assemble(
        tokenizer,
        "cwe",
        length,
        f"{example}\n{CWE_HEAD}",
        CWE_QUESTION + CWE_ANSWER_PREFIX,
        order[:COMMON_WORDS],
        cut_window("cwe", length, grown, len(words) - COMMON_WORDS + 1, check),
        bos=bos,
    )


def fwe_item(tokenizer: Any, length: int, rng: random.Random, bos: BosRule) -> RulerItem:
    """One frequent-words prompt of exactly ``length`` tokens; the answers are the three most frequent coded words."""
    coded = ["...", *random_strings(rng, max(length // 50, 4) - 1, CODED_LETTERS)]
    shuffle_seed = rng.random()

    def grown(count: int) -> list[int]:
        counts = [int(count * rank**-ALPHA / ZETA_ALPHA) for rank in range(1, len(coded) + 1)]
        listed = [word for word, times in zip(coded, counts) for _ in range(times)]
        random.Random(shuffle_seed).shuffle(listed)
        return encode(tokenizer, " " + " ".join(listed))

    def check(ids: list[int]) -> None:
        counts = Counter(tokenizer.decode(ids).split())
        del counts["..."]
        _refuse_unless_above(counts, coded[1:4], length, "fwe")

    window = cut_window("fwe", length, grown, 4 * length, check)
    return assemble(tokenizer, "fwe", length, FWE_HEAD, FWE_QUESTION + FWE_ANSWER_PREFIX, coded[1:4], window, bos=bos)


def _refuse_unless_above(counts: Counter[str], answers: list[str], length: int, task: str) -> None:
    """Refuse a list in which some answer is not more frequent than every other word: its answer would be wrong."""
    others = max((times for word, times in counts.items() if word not in answers), default=0)
    if min(counts[word] for word in answers) <= others:
        raise KvlabError(
            f"A {length}-token {task} prompt is too short for its answers to be the most frequent words; "
            "use a longer context."
        )
