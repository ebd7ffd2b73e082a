"""A held-out text as one pass of the quality measurement (:mod:`kvlab.runs.quality`): the tokens it reads and
scores, its default lengths, and the checks that need no model. Torch-free, so that the command line checks a pass
before it loads one."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvlab import files
from kvlab.budget import Budget
from kvlab.errors import KvlabError
from kvlab.hashing import text_sha256
from kvlab.models.limits import MAX_CHARS_PER_TOKEN

#: Tokens read before the first scored one: one streaming chunk of context.
DEFAULT_PREFIX = 256
#: Tokens scored unless told otherwise (more when the budget needs more, see :func:`scored_tokens`).
DEFAULT_TOKENS = 1024
#: Scored tokens a pass predicts at least once the cache could hold its budget.
MIN_PAST_BUDGET = 1000


@dataclass(frozen=True)
class TextPass:
    """The tokens of one pass over a text: ``prefix`` of them read first, every later one scored."""

    name: str
    ids: tuple[int, ...]
    prefix: int

    @property
    def scored(self) -> int:
        """How many tokens the pass predicts and scores."""
        return len(self.ids) - self.prefix

    @property
    def task(self) -> str:
        """The task a stored pass is filed under."""
        return f"quality:{self.name}"

    def content_hash(self) -> str:
        """What the pass reads and scores: the token ids and where the prefix ends (so the text, the tokenizer's
        reading of it and the pass's lengths), not the file's name."""
        return text_sha256(f"{self.prefix}\n{','.join(map(str, self.ids))}")


def token_budget(budget: Budget | None) -> int | None:
    """The budget of a pass in tokens. A kept fraction is refused: the engine takes it of the prompt, which here is
    only the prefix, and a text read as it streams has no other fixed length to take it of."""
    if budget is not None and budget.keep is not None:
        raise KvlabError("A quality pass takes its budget in tokens (--budget), not as a kept fraction (--keep).")
    return None if budget is None else budget.tokens


def scored_tokens(
    budget: Budget | None, prefix: int, tokens: int | None = None, *, past_budget: int = MIN_PAST_BUDGET
) -> int:
    """How many tokens a pass scores after ``prefix``: ``tokens``, checked, or by default :data:`DEFAULT_TOKENS`, or
    more where the budget needs more, so that at least ``past_budget`` of them are predicted once the cache could
    hold its budget (a pass without a budget scores at least ``past_budget``)."""
    if prefix < 1:
        raise KvlabError(f"A pass reads a prefix of at least one token, not {prefix}.")
    filled = max(prefix, token_budget(budget) or 0)
    needed = filled - prefix + past_budget
    if tokens is None:
        return max(DEFAULT_TOKENS, needed)
    if tokens < needed:
        limit = f"a budget of {filled:,} tokens and " if filled > prefix else ""
        raise KvlabError(
            f"A quality pass scores at least {past_budget:,} tokens past the budget: with {limit}a prefix of "
            f"{prefix:,} that is {needed:,} scored tokens, not {tokens:,}."
        )
    return tokens


def read_text(path: str | Path, what: str = "text file") -> str:
    """A UTF-8 text file's content, read within kvlab's bound (:mod:`kvlab.files`); a file that cannot be read, is
    not a regular file, is too large, is not UTF-8 or holds no text is one sentence that calls it ``what`` (``text
    file``, ``prompt file``)."""
    text = files.read_text(path, what)
    if not text.strip():
        raise KvlabError(f"The {what} {path} holds no text.")
    return text


def text_pass(tokenizer: Any, text: str, name: str, prefix: int, scored: int) -> TextPass:
    """The first ``prefix + scored`` tokens of ``text`` as read by ``tokenizer`` (with its start token, if it adds
    one); a text with fewer tokens is one sentence. A long text is cut before it is tokenised, far beyond the
    characters those tokens can span (:data:`~kvlab.models.limits.MAX_CHARS_PER_TOKEN` per token), so a book costs no
    more than the pass reads. It is cut after tokenising, not by the tokenizer's truncation: asking a fast tokenizer to
    truncate changes its settings for every later call, and so the identity
    (:func:`kvlab.models.loading.tokenizer_hash`) of every run after it."""
    needed = prefix + scored
    ids = tokenizer(text[: needed * MAX_CHARS_PER_TOKEN]).input_ids
    if len(ids) < needed:
        raise KvlabError(
            f"The text {name} has {len(ids):,} tokens, fewer than the {needed:,} of this pass (a prefix of "
            f"{prefix:,} and {scored:,} scored tokens); give a longer text or fewer tokens."
        )
    return TextPass(name, tuple(int(token) for token in ids[:needed]), prefix)
