"""The side-channel experiment as the dashboard shows it: the attacker's accuracy per channel with and without noise,
what the noise costs in retrieval, and one channel trial by trial. Pure functions of a
:class:`~kvlab.experiments.sidechannel.SideChannelResult`, each chart with its
:class:`~kvlab.dashboard.guides.ChartGuide`."""

from __future__ import annotations

import random
import textwrap
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
from plotly.colors import qualitative

from kvlab.dashboard.guides import ChartGuide
from kvlab.experiments.sidechannel import CHANNELS, SideChannelResult
from kvlab.paths import bench_results
from kvlab.stats import wilson_interval
from kvlab.units import byte_axis, format_bytes

#: No noise in grey, each noise level in a colour of its own.
NO_NOISE_COLOUR = "#888888"
LEVEL_COLOURS = qualitative.Safe
CHANCE = 50.0


def shipped_results(results: Path | None = None) -> list[Path]:
    """The side-channel results ``bench/side_channel.sh`` wrote into the benchmark results (``results``, by default
    :func:`kvlab.paths.bench_results`), by name; none where kvlab is installed without them."""
    folder = results if results is not None else bench_results()
    directory = folder / "side_channel" if folder is not None else None
    return sorted(directory.glob("*.json")) if directory is not None and directory.is_dir() else []


def describe(result: SideChannelResult) -> str:
    """One sentence on what ran, as plain text (the page escapes it: a result file may come from anyone)."""
    budget = f"keeping {result.keep:g} of the context" if result.keep is not None else "with a fixed budget"
    params = ", ".join(f"{name}={value}" for name, value in result.params.items())
    return (
        f"{result.policy} ({params}) {budget} ({result.budget_tokens:,} of {result.context_tokens:,} tokens), "
        f"{result.mode} mode, on {result.model} ({result.device}, {result.dtype}): {result.trials} prompts, each "
        f'answered at {len(result.levels)} noise levels, the canary sentence "{result.canary_sentence}" at depths '
        f"{result.depths[0]:.0%} to {result.depths[1]:.0%}, {result.new_tokens} tokens decoded per answer."
    )


def _colour(index: int) -> str:
    return NO_NOISE_COLOUR if index == 0 else LEVEL_COLOURS[(index - 1) % len(LEVEL_COLOURS)]


def _wrapped(label: str, width: int = 16) -> str:
    return "<br>".join(textwrap.wrap(label, width))


def _percent(value: float | None) -> float | None:
    return None if value is None else 100 * value


def _whiskers(value: float | None, low: float | None, high: float | None) -> tuple[float | None, float | None]:
    """Plotly's error bar lengths above and below a share, in percent (none where there is no share)."""
    if value is None or low is None or high is None:
        return None, None
    return 100 * (high - value), 100 * (value - low)


ACCURACY_GUIDE = ChartGuide(
    axes=(
        "One group of bars per channel, one bar per noise level (grey: no noise): the share of test trials in which "
        "the attacker's threshold, fitted on the other half, told correctly whether the canary was still cached. "
        "Half the test trials had it cached, so guessing scores 50 % (dashed line); the whisker is the 95 % Wilson "
        "interval. The last group is a reference: the canary's position, which the attacker does not observe."
    ),
    good=(
        "For a private cache, every observed channel's whisker crosses the 50 % line. Bars at exactly 50 % with the "
        "verdict 'no channel' mean the observable was the same in every trial: there is nothing to read."
    ),
    bad=(
        "A whisker wholly above 50 %: that channel tells the attacker whether the canary survived. A position bar "
        "that noise does not lower means the noise did not change which tokens survive."
    ),
)


def accuracy_figure(result: SideChannelResult) -> go.Figure:
    """The attacker's accuracy per channel (grouped by channel, a bar per noise level) with Wilson intervals."""
    figure = go.Figure()
    labels = [_wrapped(CHANNELS[channel]) for channel in CHANNELS]
    for index, level in enumerate(result.levels):
        scores = {score.channel: score for score in level.channels}
        ordered = [scores[channel] for channel in CHANNELS]
        accuracy = [_percent(score.accuracy) for score in ordered]
        whiskers = [_whiskers(score.accuracy, score.low, score.high) for score in ordered]
        figure.add_trace(
            go.Bar(
                name=level.noise,
                x=labels,
                y=accuracy,
                marker_color=_colour(index),
                error_y=dict(
                    type="data",
                    symmetric=False,
                    array=[above for above, _ in whiskers],
                    arrayminus=[below for _, below in whiskers],
                ),
                customdata=[[score.correct, score.test_trials, score.verdict] for score in ordered],
                hovertemplate=f"{level.noise}<br>%{{customdata[0]}} of %{{customdata[1]}} test trials right"
                "<br>%{customdata[2]}<extra></extra>",
            )
        )
    figure.add_hline(
        y=CHANCE, line_dash="dash", line_color="#444444", annotation_text="chance", annotation_position="top left"
    )
    figure.update_layout(
        title="Attacker accuracy by channel",
        barmode="group",
        yaxis=dict(title="right on the test half (%)", range=[0, 105]),
        legend=dict(title="noise", orientation="h", y=-0.25),
        height=430,
        margin=dict(t=50, b=40, l=60, r=20),
    )
    return figure


RETRIEVAL_GUIDE = ChartGuide(
    axes=(
        "One pair of bars per noise level: the share of trials whose answer held the canary's code (retrieval) and "
        "the share in which the heap still held the canary in at least half of its layer and head pairs (cached), "
        "each with its 95 % Wilson interval."
    ),
    good=(
        "Retrieval with noise as high as without: the noise floor costs nothing. Retrieval close to the cached share "
        "means the model answers whenever the canary is there."
    ),
    bad=(
        "Retrieval that falls as the noise grows: the noise evicts tokens the policy would have kept for a reason, "
        "and that is the price of the noise floor."
    ),
)


def retrieval_figure(result: SideChannelResult) -> go.Figure:
    """Retrieval accuracy and the canary's survival per noise level, with Wilson intervals."""
    names = [level.noise for level in result.levels]
    figure = go.Figure()
    counted = {
        "retrieval": [(level.retrieved, level.trials) for level in result.levels],
        "cached": [(level.cached, level.trials) for level in result.levels],
    }
    for (name, counts), colour in zip(counted.items(), ("#1f4e9c", "#9fb6dd")):
        shares = [hits / trials for hits, trials in counts]
        whiskers = [_whiskers(share, *wilson_interval(hits, trials)) for share, (hits, trials) in zip(shares, counts)]
        figure.add_trace(
            go.Bar(
                name=name,
                x=names,
                y=[100 * share for share in shares],
                marker_color=colour,
                error_y=dict(
                    type="data",
                    symmetric=False,
                    array=[above for above, _ in whiskers],
                    arrayminus=[below for _, below in whiskers],
                ),
                customdata=counts,
                hovertemplate=f"{name}, %{{x}}: %{{customdata[0]}} of %{{customdata[1]}} trials<extra></extra>",
            )
        )
    figure.update_layout(
        title="Retrieval and survival by noise level",
        barmode="group",
        yaxis=dict(title="trials (%)", range=[0, 105]),
        legend=dict(orientation="h", y=-0.2),
        height=380,
        margin=dict(t=50, b=40, l=60, r=20),
    )
    return figure


OBSERVABLE_GUIDE = ChartGuide(
    axes=(
        "Every trial of one noise level as a point: left, those whose canary the heap still held (cached); right, "
        "those it had evicted; up, what the attacker observed. Hollow points fitted the threshold (dashed line), "
        "filled ones scored it. Points are spread sideways only so that they do not hide one another."
    ),
    good=(
        "For a private channel, the two columns overlap and no line separates them. All points on one horizontal "
        "line: the observable never changed, so there is no channel."
    ),
    bad=(
        "Two columns that a horizontal line separates: the observable gives the canary's fate away, as the answer "
        "does when the model retrieves."
    ),
)


def observable_figure(result: SideChannelResult, noise: str, channel: str) -> go.Figure:
    """One channel's observable per trial of one noise level, by ground truth, with the fitted threshold."""
    records = [record for record in result.records if record.noise == noise]
    score = next(score for score in result.level(noise).channels if score.channel == channel)
    scale = 1000.0 if channel == "decode_time" else 100.0 if channel in ("answer", "position") else 1.0
    jitter = random.Random(0)
    figure = go.Figure()
    for role, symbol in (("train", "circle-open"), ("test", "circle")):
        chosen = [record for record in records if record.role == role]
        values = [record.observables[channel] for record in chosen]
        figure.add_trace(
            go.Scatter(
                name=f"{role} half",
                x=[(0.0 if record.cached else 1.0) + jitter.uniform(-0.25, 0.25) for record in chosen],
                y=[scale * value for value in values],
                mode="markers",
                marker=dict(symbol=symbol, size=8, color="#1f4e9c"),
                customdata=[
                    [record.trial, f"{record.depth:.0%}", record.answer[:40], _shown(channel, value)]
                    for record, value in zip(chosen, values)
                ],
                hovertemplate="trial %{customdata[0]}, canary at %{customdata[1]}<br>answer: %{customdata[2]}"
                "<br>observed: %{customdata[3]}<extra></extra>",
            )
        )
    if score.cut is not None:
        figure.add_hline(
            y=scale * score.cut,
            line_dash="dash",
            line_color="#444444",
            annotation_text="threshold",
            annotation_position="top left",
        )
    values = [record.observables[channel] for record in records]
    yaxis: dict[str, object] = {"title": _axis_title(channel)}
    if channel == "kv_bytes":
        yaxis.update(byte_axis(min(values), max(values), log=False, max_ticks=5))
    figure.update_layout(
        title=_wrapped(f"{CHANNELS[channel]}, {noise}", 48),
        xaxis=dict(tickvals=[0, 1], ticktext=["cached", "evicted"], range=[-0.6, 1.6]),
        yaxis=yaxis,
        legend=dict(orientation="h", y=-0.15),
        height=400,
        margin=dict(t=60, b=40, l=70, r=20),
    )
    return figure


def _axis_title(channel: str) -> str:
    return {
        "decode_time": "ms per token (steady half)",
        "kv_bytes": "KV bytes in use",
        "kept_tokens": "tokens kept, all layers",
        "answer": "share of the code answered (%)",
        "position": "canary depth (%)",
    }[channel]


def _shown(channel: str, value: float) -> str:
    if channel == "decode_time":
        return f"{1000 * value:.3f} ms"
    if channel == "kv_bytes":
        return format_bytes(value)
    if channel == "kept_tokens":
        return f"{value:,.0f} tokens"
    return f"{value:.0%}"


def channel_table(result: SideChannelResult) -> pd.DataFrame:
    """Every channel's score at every noise level, with its verdict."""
    rows = []
    for level in result.levels:
        for score in level.channels:
            interval = "" if score.low is None or score.high is None else f"{score.low:.0%} to {score.high:.0%}"
            rows.append(
                {
                    "noise": level.noise,
                    "channel": CHANNELS[score.channel],
                    "accuracy": "" if score.accuracy is None else f"{score.accuracy:.0%}",
                    "95 % CI": interval,
                    "test trials": score.test_trials,
                    "verdict": score.verdict,
                }
            )
    return pd.DataFrame(rows)


def level_table(result: SideChannelResult) -> pd.DataFrame:
    """Per noise level: how often the canary stayed cached, the retrieval accuracy, what the noise cost in retrieval
    against no noise (in percentage points), and the median decode time per token."""
    baseline = result.levels[0].retrieval
    return pd.DataFrame(
        [
            {
                "noise": level.noise,
                "trials": level.trials,
                "canary cached": f"{level.cached} ({level.cached / level.trials:.0%})",
                "retrieval": f"{level.retrieval:.0%}",
                "95 % CI": f"{level.retrieval_low:.0%} to {level.retrieval_high:.0%}",
                "retrieval lost (points)": f"{100 * (baseline - level.retrieval):+.0f}" if index else "",
                "ms per token": f"{1000 * level.decode_seconds:.3f}",
            }
            for index, level in enumerate(result.levels)
        ]
    )
