"""What evaluating a claim gives: kvlab's figure, a verdict from four, and where the figure came from.

A verdict is computed from the figure by a small rule per claim, never typed in: the rules below are the only
places where "about", "holds under a condition" and "cannot be measured" are decided.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

Verdict = Literal["holds", "does not hold", "holds only under a condition", "cannot be measured here"]
VERDICTS: tuple[Verdict, ...] = get_args(Verdict)
HOLDS, FAILS, CONDITIONAL, UNMEASURABLE = VERDICTS

ABOUT = 0.10
"""How far kvlab's figure may be from an article's round figure ("about 40 GB", "400 %") for the article to be
right: 10 % of the article's figure, which also absorbs the GB/GiB ambiguity (7 %) of sloppy units."""

FORMULA = "formula"
"""The device of a figure computed from published configs and datasheets rather than measured on one."""


def about(value: float, claimed: float, tolerance: float = ABOUT) -> bool:
    """Whether ``value`` is within ``tolerance`` (a share of the claimed figure) of ``claimed``."""
    return abs(value - claimed) <= tolerance * abs(claimed)


@dataclass(frozen=True)
class Evaluation:
    """One claim evaluated: kvlab's ``figure`` (text with units) or the ``reason`` there is none, the verdict
    (with its ``condition`` when it holds only under one), the ``model`` and ``device`` the figure came from and the
    ``command`` that reproduces it (the catalogue fills in ``kvlab claims --only <id>`` when there is none)."""

    verdict: Verdict
    figure: str | None = None
    condition: str | None = None
    reason: str | None = None
    model: str | None = None
    device: str | None = None
    command: str | None = None

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"unknown verdict {self.verdict!r}")
        if not (self.figure or self.reason):
            raise ValueError("an evaluated claim needs kvlab's figure or the reason there is none")
        if (self.verdict == CONDITIONAL) != bool(self.condition):
            raise ValueError("a condition goes with, and only with, 'holds only under a condition'")
        if self.verdict == UNMEASURABLE and not self.reason:
            raise ValueError("a claim that cannot be measured here needs the reason")

    @property
    def verdict_text(self) -> str:
        """The verdict as stored and shown: ``holds only under a condition: <which>`` names its condition."""
        return f"{self.verdict}: {self.condition}" if self.condition else self.verdict


def unmeasurable(
    reason: str,
    *,
    figure: str | None = None,
    model: str | None = None,
    device: str | None = None,
    command: str | None = None,
) -> Evaluation:
    """A claim kvlab cannot check here, and why (with whatever partial figure it can give, and where from)."""
    return Evaluation(UNMEASURABLE, figure=figure, reason=reason, model=model, device=device, command=command)


def verdict_of(text: str) -> Verdict:
    """The verdict of a stored verdict text (its condition left off)."""
    head = text.split(":", 1)[0].strip()
    if head not in VERDICTS:
        raise ValueError(f"unknown verdict {text!r}")
    return head


def combine(parts: Sequence[tuple[str, bool]]) -> tuple[Verdict, str | None]:
    """One verdict from a claim checked in several settings (modes, models, depths...), each ``(label, holds)``:
    it holds when it holds in all of them, does not when in none, and otherwise holds only under the condition
    of the settings where it does (their labels, e.g. ``in prefill mode``). No setting is no verdict."""
    if not parts:
        raise ValueError("a verdict needs at least one setting")
    holding = [label for label, held in parts if held]
    if len(holding) == len(parts):
        return HOLDS, None
    if not holding:
        return FAILS, None
    return CONDITIONAL, "; ".join(holding)


def judged(
    parts: Sequence[tuple[str, bool]],
    figure: str,
    *,
    model: str | None = None,
    device: str | None = None,
    command: str | None = None,
) -> Evaluation:
    """An :class:`Evaluation` whose verdict :func:`combine` takes from ``parts``."""
    verdict, condition = combine(parts)
    return Evaluation(verdict, figure=figure, condition=condition, model=model, device=device, command=command)


def about_count(value: int, claimed: int) -> bool:
    """Whether a count (users, sequences) matches the article's: within :data:`ABOUT`, or within one, since a count
    rounded down by one less byte of memory is the same answer."""
    return abs(value - claimed) <= max(1.0, ABOUT * abs(claimed))


def missing(what: str, db: str, command: str, figure: str | None = None) -> Evaluation:
    """A measured claim whose runs are not in the store: which runs, where, and the command that makes them (with
    what can be said without them, a figure computed from the claim's own numbers, say)."""
    return unmeasurable(f"no runs of {what} in {db}; run: {command}", figure=figure, command=command)


def per_model(results: Sequence[tuple[str, Evaluation]]) -> Evaluation:
    """One evaluation from a claim checked on several models separately, each ``(model, evaluation)``: the models
    that could not be measured are left out (unless none could); it holds when it holds on every model, does not
    when it holds on none, and otherwise holds only on the models (and under the conditions) where it does."""
    measured = [(model, result) for model, result in results if result.verdict != UNMEASURABLE]
    if len(measured) <= 1:
        return measured[0][1] if measured else results[0][1]
    verdicts = {result.verdict for _, result in measured}
    holding = [
        f"on {model}" + (f", {result.condition}" if result.condition else "")
        for model, result in measured
        if result.verdict in (HOLDS, CONDITIONAL)
    ]
    if verdicts == {HOLDS}:
        verdict, condition = HOLDS, None
    elif not holding:
        verdict, condition = FAILS, None
    else:
        verdict, condition = CONDITIONAL, "; ".join(holding)
    return Evaluation(
        verdict,
        figure=" · ".join(f"{model}: {result.figure}" for model, result in measured),
        condition=condition,
        model=", ".join(model for model, _ in measured),
        device=", ".join(dict.fromkeys(str(result.device) for _, result in measured)),
        command="; ".join(dict.fromkeys(str(result.command) for _, result in measured if result.command)),
    )
