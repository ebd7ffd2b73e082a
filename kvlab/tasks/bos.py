"""Which special tokens wrap a prompt: the one rule for the BOS token, named and described once, without torch.

transformers tokenises a text with the tokenizer's own special tokens (``add_special_tokens=True``): a Llama-2
tokenizer puts its BOS first, a Qwen2 or GPT-2 one puts nothing, though both have a BOS token. kvlab follows it by
default (``auto``), so that a full-cache run gives the tokens of ``model.generate(**tokenizer(text))``. ``always``
is the rule kvlab had before the choice existed (the BOS first whenever the tokenizer has one, and nothing else), and
``never`` is the tokenizer's own rule without a BOS at the start.

Prompts are assembled from the ids of pieces tokenised without special tokens (needle and RULER prompts have an
exact length), so the rule is given as the ids that go before the first piece and after the last one
(:func:`special_ids`). A chat template renders its special tokens as text, and is read as it is rendered.

The command line's ``--bos``, :class:`kvlab.engine.spec.RunSpec`'s ``bos`` and a stored run's ``bos`` column spell
the rules from here.
"""

from __future__ import annotations

from typing import Any, Final, Literal

from kvlab.errors import KvlabError

BosRule = Literal["auto", "always", "never"]
#: The tokenizer's own special tokens, as transformers adds them by default.
AUTO: Final = "auto"
#: The BOS first whenever the tokenizer has one (every run stored before the choice existed).
ALWAYS: Final = "always"
#: The tokenizer's own special tokens, without a BOS at the start.
NEVER: Final = "never"
BOS_RULES: tuple[BosRule, ...] = (AUTO, ALWAYS, NEVER)
DEFAULT_BOS: BosRule = AUTO
#: The rules in one sentence, for the command line's and the dashboard's help.
BOS_HELP = (
    "Which special tokens wrap a prompt. auto: the tokenizer's own (as transformers tokenises by default); always: "
    "the BOS token first whenever the tokenizer has one, and nothing else (the rule of every run stored before the "
    "choice); never: the tokenizer's own without a BOS."
)
#: A text every tokenizer turns into some ids, to see where its special tokens go around them.
_PROBE = "kvlab"


def check_bos(name: str) -> BosRule:
    """``name`` as a :data:`BosRule`; any other name is one sentence."""
    for rule in BOS_RULES:
        if name == rule:
            return rule
    raise KvlabError(f"Unknown BOS rule {name!r}; use one of {', '.join(BOS_RULES)}.")


def special_ids(tokenizer: Any, rule: BosRule) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids that go before a prompt's text and after it under ``rule``. ``auto`` and ``never`` read the
    tokenizer's own by tokenising a probe with and without special tokens, so that any post-processor (a template
    that adds a BOS, an EOS, or nothing) is followed as transformers follows it."""
    bos = tokenizer.bos_token_id
    if rule == ALWAYS:
        return ((bos,) if bos is not None else ()), ()
    before, after = _own_special_ids(tokenizer)
    if rule == NEVER and before[:1] == (bos,) and bos is not None:
        before = before[1:]
    return before, after


def _own_special_ids(tokenizer: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The tokenizer's own special ids around a text: the probe's ids with special tokens, less its ids without."""
    plain = list(tokenizer.encode(_PROBE, add_special_tokens=False))
    wrapped = list(tokenizer.encode(_PROBE, add_special_tokens=True))
    for start in range(len(wrapped) - len(plain) + 1):
        if wrapped[start : start + len(plain)] == plain:
            return tuple(wrapped[:start]), tuple(wrapped[start + len(plain) :])
    raise KvlabError(
        "The tokenizer's special tokens change the ids of the text they wrap; use the always rule (--bos always)."
    )


def stored_bos(tokenizer: Any, rule: BosRule) -> str | None:
    """The rule as a run's identity stores it: one name per set of special ids this tokenizer gets, so that runs
    differ only where their prompts do. ``None`` where they are those of ``always``, which every run stored before
    the choice existed followed, so that their identities stay what they were; else ``auto`` where they are the
    tokenizer's own, else ``never``."""
    ids = special_ids(tokenizer, rule)
    if ids == special_ids(tokenizer, ALWAYS):
        return None
    return AUTO if ids == special_ids(tokenizer, AUTO) else NEVER
