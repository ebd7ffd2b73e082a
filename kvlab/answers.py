"""Whether an output holds an expected answer: the one matching rule of the needle and RULER scorers.

RULER's reference scorer (``string_match_all`` after ``postprocess_pred``) strips the output, turns control
characters into newlines and compares without regard to case. The needle task scores by the same rule, so that a
model that starts its answer with a capital (``Plain glacier.`` for ``plain glacier``, as base models do) is not
counted as missing the needle. Stored verdicts are recomputed from the stored outputs by the store's migration when
this rule changes, so every verdict in a store follows it.

Pure string functions: no torch, importable by the store.
"""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x1f]")


def normalised(output_text: str) -> str:
    """An output as answers are matched against it: stripped, control characters as newlines, lower case."""
    return _CONTROL.sub("\n", output_text.strip()).strip().lower()


def holds(output_text: str, answer: str) -> bool:
    """Whether ``answer`` occurs in the output, ignoring case (an empty answer occurs in every output)."""
    return answer.lower() in normalised(output_text)


def first_line_is(output_text: str, answer: str) -> bool:
    """Whether the output's first line, stripped, is ``answer``, ignoring case."""
    return output_text.split("\n", 1)[0].strip().lower() == answer.lower()
