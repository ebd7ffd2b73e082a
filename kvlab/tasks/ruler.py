"""A RULER-style task suite generated locally: RULER's synthetic tasks by their names, each item of an exact length.

RULER (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your Long-Context Language Models?",
arXiv:2404.06654) measures retrieval, multi-hop tracing and aggregation over long contexts with 13 synthetic tasks;
kvlab generates the 11 that need no downloaded data set (not its two QA tasks, which read SQuAD and HotpotQA):

| task | what is asked |
| --- | --- |
| ``niah_single_1`` | one number hidden in lines of a repeated noise sentence |
| ``niah_single_2`` | one number hidden in an essay |
| ``niah_single_3`` | one UUID hidden in an essay |
| ``niah_multikey_1`` | one number among four needles with other word keys, in an essay |
| ``niah_multikey_2`` | one number in a haystack whose every line is a needle with another word key |
| ``niah_multikey_3`` | one UUID in a haystack whose every line is a needle with another UUID key |
| ``niah_multivalue`` | the four numbers of one key, in an essay |
| ``niah_multiquery`` | the numbers of four keys, in an essay |
| ``vt`` | the five variables of a chain of assignments |
| ``cwe`` | the 10 most common words of a numbered list |
| ``fwe`` | the 3 most frequent coded words of a Zipf-distributed text |

Every task is scored as RULER scores them (``string_match_all``, :func:`kvlab.tasks.ruler_score.recall`). The
generators and their differences from RULER's are in :mod:`kvlab.tasks.ruler_niah` and
:mod:`kvlab.tasks.ruler_lists`; the words come from :mod:`kvlab.tasks.ruler_words`. Shared differences: prompts are
plain text wrapped by the BOS rule (:mod:`kvlab.tasks.bos`; no chat template, as kvlab's needle sweeps), with
RULER's answer prefix at the end of the question; items are drawn from a seed per item, so the same seed gives the
same prompts.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvlab.errors import KvlabError
from kvlab.tasks.bos import DEFAULT_BOS, BosRule
from kvlab.tasks.ruler_build import RulerItem
from kvlab.tasks.ruler_lists import cwe_item, fwe_item, vt_item
from kvlab.tasks.ruler_niah import NIAH, niah_item
from kvlab.tasks.ruler_words import WORDS_DIR

RULER_TASKS: tuple[str, ...] = (*NIAH, "vt", "cwe", "fwe")
#: The most tokens RULER lets a model generate for one of these tasks (its NIAH tasks' ``tokens_to_generate``).
MAX_NEW_TOKENS = 128
#: What the items are generated from besides the haystacks and the needle helpers: these modules (the scorer too,
#: since a stored trial's recall is computed by it) and the word lists.
RULER_SOURCES: tuple[Path, ...] = (
    *sorted(Path(__file__).resolve().parent.glob("ruler*.py")),
    *sorted(WORDS_DIR.glob("*.txt")),
)


def check_tasks(names: Sequence[str]) -> tuple[str, ...]:
    """The chosen RULER tasks in RULER's order; an unknown or repeated name, or none, is one sentence."""
    unknown = [name for name in names if name not in RULER_TASKS]
    if unknown:
        raise KvlabError(f"Unknown RULER task {unknown[0]!r}; choose from {', '.join(RULER_TASKS)}.")
    if len(set(names)) != len(names):
        raise KvlabError("A RULER task is listed twice; list each task once.")
    if not names:
        raise KvlabError("Choose at least one RULER task.")
    return tuple(task for task in RULER_TASKS if task in names)


def task_set_name(tasks: Sequence[str]) -> str:
    """The task a run of these RULER tasks is stored under: ``ruler`` for all of them, else ``ruler:`` and the chosen
    tasks in RULER's order (``ruler:niah_single_1,vt``)."""
    chosen = check_tasks(tasks)
    return "ruler" if chosen == RULER_TASKS else "ruler:" + ",".join(chosen)


def ruler_item(tokenizer: Any, task: str, length: int, rng: random.Random, bos: BosRule = DEFAULT_BOS) -> RulerItem:
    """One prompt of RULER task ``task`` with exactly ``length`` tokens for ``tokenizer``, drawn from ``rng``, its
    special tokens those of the ``bos`` rule."""
    check_tasks([task])
    if task in NIAH:
        return niah_item(tokenizer, task, length, rng, bos)
    return {"vt": vt_item, "cwe": cwe_item, "fwe": fwe_item}[task](tokenizer, length, rng, bos)
