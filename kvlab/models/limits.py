"""How large an input may be, checked before any work: prompts, uploaded texts, contexts, generation lengths, seeds.

A prompt and the tokens generated after it must fit the model's positions (``max_position_embeddings``): beyond them
a model's output is not a measurement of anything. An operator can set tighter limits for a shared server with
``KVLAB_MAX_PROMPT_TOKENS`` and ``KVLAB_MAX_NEW_TOKENS``. A text is refused before it is tokenised when even the
longest tokens could not make it fit, so a huge upload costs no tokenizer time either.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from kvlab.errors import KvlabError
from kvlab.models.arch import ArchFacts
from kvlab.settings import positive_setting

MAX_PROMPT_TOKENS_ENV = "KVLAB_MAX_PROMPT_TOKENS"
MAX_NEW_TOKENS_ENV = "KVLAB_MAX_NEW_TOKENS"
#: No tokenizer's tokens average more characters than this over a text, so a longer text cannot fit the tokens.
MAX_CHARS_PER_TOKEN = 128
#: Seeds are stored as signed 64-bit integers.
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class Limits:
    """The most prompt tokens and new tokens a run may have: the model's ``positions`` (shared by the prompt and
    what is generated) and the operator's ``prompt_tokens`` and ``new_tokens`` (``None``: no limit of that kind)."""

    positions: int | None = None
    prompt_tokens: int | None = None
    new_tokens: int | None = None

    def most_prompt_tokens(self) -> int | None:
        """The longest prompt any run may read (before counting what it generates)."""
        bounds = [bound for bound in (self.positions, self.prompt_tokens) if bound is not None]
        return min(bounds) if bounds else None

    def check_text(self, text: str, what: str = "The text") -> None:
        """Refuse, before tokenising, a text too long to fit even if every token were as long as tokens get."""
        most = self.most_prompt_tokens()
        if most is not None and len(text) > most * MAX_CHARS_PER_TOKEN:
            raise KvlabError(
                f"{what} has {len(text):,} characters, far more than the {most:,} tokens a prompt may "
                "have here; shorten it."
            )

    def check(self, prompt_tokens: int, new_tokens: int, model: str = "the model") -> None:
        """Refuse a run whose prompt or generation is longer than allowed, in one sentence saying which limit."""
        if self.new_tokens is not None and new_tokens > self.new_tokens:
            raise KvlabError(
                f"Generating {new_tokens:,} tokens is more than the {self.new_tokens:,} this server allows "
                f"({MAX_NEW_TOKENS_ENV})."
            )
        if self.prompt_tokens is not None and prompt_tokens > self.prompt_tokens:
            raise KvlabError(
                f"The prompt has {prompt_tokens:,} tokens, more than the {self.prompt_tokens:,} this "
                f"server allows ({MAX_PROMPT_TOKENS_ENV}); shorten it."
            )
        if self.positions is not None and prompt_tokens + new_tokens > self.positions:
            raise KvlabError(
                f"A prompt of {prompt_tokens:,} tokens plus {new_tokens:,} generated ones needs "
                f"{prompt_tokens + new_tokens:,} positions, more than the {self.positions:,} of {model}; "
                "shorten the prompt or generate fewer tokens."
            )


def configured(env: Mapping[str, str] = os.environ) -> tuple[int | None, int | None]:
    """The operator's limits on prompt tokens and new tokens, from the environment (unset or empty: none)."""
    return positive_setting(MAX_PROMPT_TOKENS_ENV, "tokens", env), positive_setting(MAX_NEW_TOKENS_ENV, "tokens", env)


def limits_for(arch: ArchFacts, env: Mapping[str, str] = os.environ) -> Limits:
    """The limits of a model: its positions and the operator's settings."""
    prompt_tokens, new_tokens = configured(env)
    return Limits(arch.max_positions, prompt_tokens, new_tokens)


def check_seed(seed: int) -> int:
    """A seed that can be stored and given to torch: a whole number from 0 to 2^63 - 1."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise KvlabError(f"A seed must be a whole number from 0 to {MAX_SEED:,}, not {seed!r}.")
    return seed
