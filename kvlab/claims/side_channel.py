"""Claim 18, measured: "adding noise to H2O's ranking prevents identifying cached tokens by timing, at a small
accuracy cost".

The figures come from the side-channel experiment (``kvlab sidechannel --out``, :mod:`kvlab.experiments.sidechannel`):
an attacker fits a threshold on the decode time per token (and on the other observables) on half of the trials and
guesses on the other half, balanced, whether a canary is still cached; 50% is chance. At each noise level the claim
holds when timing identified the canary without noise (its accuracy's 95% interval above 50%), no longer does with
the noise, and the noise costs at most a negligible share of the retrieval accuracy. Where timing tells nothing even
without noise (a heap that decodes every step over the same shapes takes the same time whatever it holds), there is
nothing for the noise to prevent, and the claim does not hold as stated.
"""

from __future__ import annotations

from kvlab.claims.commands import SIDE_CHANNEL_SCRIPT, side_channel
from kvlab.claims.evidence import ChannelFigure, Evidence, NoiseFigures, SideChannel, model_name
from kvlab.claims.needle import interval_text
from kvlab.claims.needle_claims import NEGLIGIBLE_LOSS
from kvlab.claims.units import percent
from kvlab.claims.verdicts import Evaluation, judged, missing, unmeasurable

TIMING = "decode_time"
ANSWER = "answer"
CHANCE = 0.5
NO_NOISE = "none"


def leaks(figure: ChannelFigure | None) -> bool | None:
    """Whether a channel told cached from evicted better than chance (None when it could not be scored)."""
    if figure is None or figure.low is None:
        return None
    return figure.low > CHANCE


def channel_text(figure: ChannelFigure | None) -> str:
    """``62% (51–72)``: the share of test trials right with its 95% interval, or why there is no figure."""
    if figure is None or figure.accuracy is None or figure.low is None or figure.high is None:
        return "not scored (too few trials of one class)"
    if figure.spread == 0:
        return "no channel (the same in every trial)"
    return f"{percent(figure.accuracy)} ({interval_text(100 * figure.low, 100 * figure.high)})"


def level_text(level: NoiseFigures) -> str:
    """What a noise level cost: retrieval with its 95% interval, and the decode time per token where recorded."""
    text = (
        f"retrieval {percent(level.retrieval)} ({interval_text(100 * level.retrieval_low, 100 * level.retrieval_high)})"
    )
    return text + (
        f", decoding {1e3 * level.decode_seconds:.2f} ms per token" if level.decode_seconds is not None else ""
    )


def reproduce(result: SideChannel, out: str) -> str:
    """The command that runs the same experiment again."""
    budget = f"--keep {result.keep:g}" if result.keep is not None else f"--budget {result.budget_tokens}"
    low, high = result.depths
    return side_channel(
        out,
        model=model_name(result.model),
        policy=result.policy,
        params=tuple(result.params.items()),
        budget=budget,
        noise=tuple((level.kind, level.scale) for level in result.levels if level.kind != NO_NOISE),
        extra=f" --mode {result.mode} --trials {result.trials} --context {result.context_tokens} --new-tokens "
        f"{result.new_tokens} --depths {low:g},{high:g} --seed {result.seed}",
    )


def noise_hides_timing(evidence: Evidence) -> Evaluation:
    """Claim 18, from every side-channel result in the benchmark results."""
    results, problems = evidence.side_channels
    directory = evidence.results_place("side_channel")
    if not results:
        found = f" ({'; '.join(problems)})" if problems else ""
        return missing(f"the side-channel experiment{found}", directory, SIDE_CHANNEL_SCRIPT)
    parts, facts, commands = [], [], []
    for result in results:
        name = model_name(result.model)
        quiet = next((level for level in result.levels if level.kind == NO_NOISE), None)
        noisy = [level for level in result.levels if level.kind != NO_NOISE]
        if quiet is None or not noisy:
            continue
        commands.append(reproduce(result, f"{directory}/{name}-{result.policy}.json"))
        before = leaks(quiet.channels.get(TIMING))
        shown = [
            f"no noise: timing {channel_text(quiet.channels.get(TIMING))}"
            + (", nothing for noise to hide" if before is False else "")
            + f", answer {channel_text(quiet.channels.get(ANSWER))}, {level_text(quiet)}"
        ]
        for level in noisy:
            after = leaks(level.channels.get(TIMING))
            if before is None or after is None:
                continue
            cost = 100 * (quiet.retrieval - level.retrieval)
            label = f"for {result.policy} on {name} with {level.noise}"
            parts.append((label, before and not after and cost <= NEGLIGIBLE_LOSS))
            shown.append(
                f"{level.noise}: timing {channel_text(level.channels.get(TIMING))}, answer "
                f"{channel_text(level.channels.get(ANSWER))}, {level_text(level)}"
            )
        budget = f"keeping {result.keep:g}" if result.keep is not None else f"{result.budget_tokens} tokens"
        facts.append(f"{result.policy} {budget} of {result.context_tokens:,} tokens on {name}: " + "; ".join(shown))
    command = "; ".join(commands) or SIDE_CHANNEL_SCRIPT
    if not parts:
        return unmeasurable(
            "no side-channel result scores the timing channel both without and with noise; run: " + command,
            figure=" · ".join(facts) or None,
            command=command,
        )
    figure = " · ".join(facts) + (
        f" (the attacker's test accuracy, chance 50%, 95% intervals; holds: timing above chance without noise, not "
        f"with it, for at most {NEGLIGIBLE_LOSS:.0f} points of retrieval)"
    )
    models = ", ".join(dict.fromkeys(model_name(result.model) for result in results))
    devices = ", ".join(dict.fromkeys(result.device for result in results))
    return judged(parts, figure, model=models, device=devices, command=command)
