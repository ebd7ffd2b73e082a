"""The cost calculator's figure, metrics, notices and tables: pure functions of :class:`kvlab.costs.CostEstimate`, of
``kvlab.costs.cost_table`` and of the stored runs' budgets.

Whether a configuration fits is decided once, in :mod:`kvlab.costs` (:attr:`~kvlab.costs.CostEstimate.fits`); a
configuration that does not fit has no time or price there, and everything here shows "does not fit" instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal, NamedTuple

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlab.costs import DOES_NOT_FIT, CostEstimate, Scenario
from kvlab.costs.formulas import KEY_BYTES
from kvlab.costs.measured import (
    COMPUTED,
    MEASURED_SHAPE,
    MeasuredDecode,
    MeasuredTimes,
    measured_times,
    with_measured_times,
)
from kvlab.dashboard.guides import ChartGuide
from kvlab.models.arch import ArchFacts
from kvlab.runs.tables import present, run_label, short_model_name
from kvlab.units import byte_axis, format_bytes

FULL_COLOUR = "#888888"
EVICTED_COLOUR = "#1f4e9c"


def _short(value: float) -> str:
    """A bar label: whole numbers with separators from 100 up, three significant digits below."""
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _dollars(value: float) -> str:
    """A price as a bar label: dollars, as :func:`_short` writes the number."""
    return f"${_short(value)}"


def _count(value: float) -> str:
    """A whole count with thousands separated."""
    return f"{value:,.0f}"


class _Panel(NamedTuple):
    """One panel of :func:`cost_bars`: its title, the full and evicted values (None: does not fit) and their label."""

    title: str
    full: float | None
    evicted: float | None
    label: Callable[[float], str]
    timed: bool = False


def _panels(full: CostEstimate, evicted: CostEstimate) -> tuple[_Panel, ...]:
    return (
        _Panel("KV per sequence", full.kv_bytes_per_sequence, evicted.kv_bytes_per_sequence, format_bytes),
        _Panel("sequences that fit", full.max_sequences, evicted.max_sequences, _count),
        _Panel("tokens/s (batch)", full.tokens_per_second, evicted.tokens_per_second, _short, timed=True),
        _Panel(
            "$ per million tokens", full.cost_per_million_tokens, evicted.cost_per_million_tokens, _dollars, timed=True
        ),
    )


COST_BARS_GUIDE = ChartGuide(
    axes=(
        "Four panels, each comparing the full cache (grey) with the evicted one (blue, at the kept fraction) on the "
        "same workload and GPUs: the cache of one sequence at N + M tokens, how many such sequences fit beside the "
        "weights, the batch's decode throughput and the price of a million generated tokens. All four are computed "
        "from the formulas below, except a throughput and price marked 'measured' under its bar: those follow from "
        "a decode time a GPU benchmark measured for exactly this model, GPU, prompt length and kept share."
    ),
    good=(
        "The blue bar is lower on the cache and the price and higher on sequences and tokens/s: the memory that "
        "eviction frees holds more sequences, which raises throughput and lowers the price. A grey bar marked 'does "
        "not fit' beside a blue bar means eviction is what lets the model run on these GPUs."
    ),
    bad=(
        "Blue and grey almost equal: the kept fraction saves little here (a sliding window may already cap the "
        "cache). 'does not fit' under both bars: the weights, the reserve and one sequence's cache exceed the GPUs' "
        "memory; the message above this chart says how many GPUs would fit it."
    ),
)


def cost_bars(full: CostEstimate, evicted: CostEstimate, sources: tuple[str, str] = (COMPUTED, COMPUTED)) -> go.Figure:
    """Full cache against the evicted one on four outputs that decide a deployment; a time or price that a
    configuration does not have (it does not fit) is drawn as no bar, marked "does not fit". Under the bars of the
    throughput and the price, each configuration's ``sources`` (``computed`` or ``measured``, from
    :mod:`kvlab.costs.measured`) say where its decode time came from; sizes and counts are always computed."""
    panels = _panels(full, evicted)
    figure = make_subplots(rows=1, cols=len(panels), subplot_titles=[panel.title for panel in panels])
    for column, panel in enumerate(panels, start=1):
        names = ["full", f"keep {evicted.keep_fraction:.0%}"]
        if panel.timed:
            names = [f"{name}<br>{source}" for name, source in zip(names, sources)]
        values = [panel.full, panel.evicted]
        labels = [DOES_NOT_FIT if value is None else panel.label(value) for value in values]
        figure.add_trace(
            go.Bar(
                x=names,
                y=values,
                marker_color=[FULL_COLOUR, EVICTED_COLOUR],
                text=[label if value is not None else "" for label, value in zip(labels, values)],
                textposition="auto",
                customdata=labels,
                hovertemplate=f"{panel.title}, %{{x}}: %{{customdata}}<extra></extra>",
                showlegend=False,
            ),
            row=1,
            col=column,
        )
        for name, value in zip(names, values):
            if value is None:
                figure.add_annotation(
                    x=name, y=0, text="does not<br>fit", showarrow=False, yanchor="bottom", row=1, col=column
                )
        if all(value is None for value in values):
            figure.update_yaxes(range=[0, 1], showticklabels=False, showgrid=False, row=1, col=column)
        elif not any(values):  # all zero: no sequence fits, drawn on a 0 to 1 axis rather than around zero
            figure.update_yaxes(range=[0, 1], row=1, col=column)
    largest_cache = max(full.kv_bytes_per_sequence, evicted.kv_bytes_per_sequence)
    figure.update_yaxes(**byte_axis(0, largest_cache, log=False, max_ticks=5), row=1, col=1)
    figure.update_yaxes(rangemode="tozero")
    figure.update_layout(height=300, margin=dict(t=50, b=30, l=60, r=20))
    return figure


DeltaColour = Literal["normal", "inverse", "off"]
DeltaArrow = Literal["auto", "up", "down", "off"]
#: A metric's value when the configuration has none (it does not fit); the delta under it says why.
NO_VALUE = "—"


@dataclass(frozen=True)
class Metric:
    """One ``st.metric``: what it shows and how its delta against the full cache reads."""

    label: str
    value: str
    delta: str | None = None
    delta_color: DeltaColour = "normal"
    delta_arrow: DeltaArrow = "auto"


def _milliseconds(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f} ms"


def _price(dollars: float) -> str:
    return f"${dollars:,.5f}"


def _change(evicted: float, full: float, shown: Callable[[float], str]) -> str | None:
    """``-768 MiB vs full``: the evicted value's change, signed first so that ``st.metric`` reads its direction;
    None when there is none."""
    if evicted == full:
        return None
    return f"{'-' if evicted < full else '+'}{shown(abs(evicted - full))} vs full"


def _timed_metric(label: str, full: float | None, evicted: float | None, shown: Callable[[float], str]) -> Metric:
    """A time or price of the evicted cache, with its change against the full one when both fit; a dash marked
    "does not fit" (short enough for a fifth of the page) when the evicted cache does not fit."""
    if evicted is None:
        return Metric(label, NO_VALUE, DOES_NOT_FIT, "off", "off")
    if full is None:
        return Metric(label, shown(evicted), f"full cache: {DOES_NOT_FIT}", "off", "off")
    return Metric(label, shown(evicted), _change(evicted, full, shown), "inverse")


def cost_metrics(full: CostEstimate, evicted: CostEstimate, source: str = COMPUTED) -> list[Metric]:
    """The five headline numbers of the evicted cache, each against the full cache; sizes in binary units, and
    "does not fit" for a time or price of a configuration that does not fit. The time and the price say their
    ``source`` (``computed`` or ``measured``)."""
    return [
        Metric("KV per token", format_bytes(evicted.kv_bytes_per_token)),
        Metric(
            "KV per sequence",
            format_bytes(evicted.kv_bytes_per_sequence),
            _change(evicted.kv_bytes_per_sequence, full.kv_bytes_per_sequence, format_bytes),
            "inverse",
        ),
        Metric(
            "Sequences that fit",
            _count(evicted.max_sequences),
            _change(evicted.max_sequences, full.max_sequences, _count),
        ),
        _timed_metric(f"Decode, {source}", full.decode_step_seconds, evicted.decode_step_seconds, _milliseconds),
        _timed_metric(f"Cost per query, {source}", full.cost_per_query, evicted.cost_per_query, _price),
    ]


@dataclass(frozen=True)
class Notice:
    """A message under the metrics: ``level`` is the Streamlit call that shows it (``st.error`` and so on)."""

    level: Literal["error", "warning", "info"]
    text: str


def _gpus(count: int | None, limit: int) -> str:
    """``2 GPUs``; ``more than 64 GPUs`` when no count up to ``limit`` is enough."""
    if count is None:
        return f"more than {limit} GPUs"
    return f"{count} GPU" if count == 1 else f"{count} GPUs"


def _needed(full: CostEstimate, evicted: CostEstimate) -> str:
    """How many GPUs of this kind would fit one sequence, with eviction and without."""
    if evicted.gpus_to_fit is None:
        return f"Not even {evicted.gpu_limit} GPUs of this kind, layers split over them, would fit it."
    if evicted.gpus_to_fit == full.gpus_to_fit:
        return f"{_gpus(evicted.gpus_to_fit, evicted.gpu_limit)} of this kind (layers split over them) would fit it."
    return (
        f"{_gpus(evicted.gpus_to_fit, evicted.gpu_limit)} of this kind (layers split over them) would fit it with "
        f"eviction (keep {evicted.keep_fraction:.0%}), {_gpus(full.gpus_to_fit, full.gpu_limit)} with the full cache."
    )


def _span(first: int, last: int) -> str:
    """``0–26``, or ``5`` when first and last are one."""
    return str(first) if first == last else f"{first}–{last}"


def _layers(layers: range) -> str:
    """``layers 0–26``, or ``layer 5`` for a GPU that holds one."""
    return f"{'layer' if len(layers) == 1 else 'layers'} {_span(layers.start, layers.stop - 1)}"


class _Shortfall(NamedTuple):
    """Where memory runs short, as a notice says it: the GPU (empty for one), its weights and its part of a cache."""

    where: str
    weights: str
    cache: str


def _shortfall(estimate: CostEstimate) -> _Shortfall:
    """The fullest GPU's load in words: the whole model on one GPU, its own layers' share on a pipeline's."""
    if estimate.gpu_count == 1:
        return _Shortfall(
            "",
            f"{format_bytes(estimate.weight_bytes)} of weights",
            f"one sequence's {format_bytes(estimate.kv_bytes_per_sequence)} cache",
        )
    share = estimate.gpu_shares[estimate.fullest_gpu]
    layers = sum(len(other.layers) for other in estimate.gpu_shares)
    return _Shortfall(
        f"GPU {estimate.fullest_gpu} ({_layers(share.layers)} of {layers})",
        f"its {format_bytes(share.weight_bytes)} of weights",
        f"its {format_bytes(share.kv_bytes_per_sequence)} part of one sequence's cache",
    )


def fit_notices(full: CostEstimate, evicted: CostEstimate, scenario: Scenario, gpu_name: str) -> list[Notice]:
    """What the page says about memory: a configuration that does not fit at all (and the GPUs that would fit it),
    one that fits only because of eviction, and a batch that does not fit. With several GPUs the one that runs
    short is named with its layers, its weights and its part of the cache."""
    on = f"{scenario.gpu_count} × {gpu_name}"
    reserve = f"the {scenario.memory_reserve:.0%} reserve"
    notices: list[Notice] = []
    if not evicted.fits:
        short = _shortfall(evicted)
        holder = f"on {on}, {short.where}" if short.where else on
        notices.append(
            Notice(
                "error",
                f"Does not fit: {holder} cannot hold {short.weights}, {reserve} and {short.cache}, so there is no "
                "decode time or price. " + _needed(full, evicted),
            )
        )
    elif not full.fits:
        short = _shortfall(full)
        where = f"on {short.where}, " if short.where else ""
        notices.append(
            Notice(
                "info",
                f"The full cache does not fit on {on}: {where}{short.cache} does not fit beside {short.weights} and "
                f"{reserve} ({_gpus(full.gpus_to_fit, full.gpu_limit)} would hold it). The evicted cache (keep "
                f"{evicted.keep_fraction:.0%}, {format_bytes(evicted.kv_bytes_per_sequence)} a sequence) fits "
                f"{evicted.max_sequences:,}: here eviction is what lets the model run on these GPUs at all.",
            )
        )
    if evicted.fits and not evicted.batch_fits:
        notices.append(
            Notice(
                "warning",
                f"A batch of {scenario.batch:,} does not fit: only {evicted.max_sequences:,} sequences fit beside the "
                "weights, so the decode time and prices are for a batch this memory cannot hold; "
                f"{_gpus(evicted.gpus_to_fit_batch, evicted.gpu_limit)} of this kind would hold it.",
            )
        )
    elif evicted.batch_fits and full.fits and not full.batch_fits:
        notices.append(
            Notice(
                "info",
                f"A batch of {scenario.batch:,} fits only with eviction: the full cache leaves room for "
                f"{full.max_sequences:,} sequences, so its decode time and prices are for a batch this memory cannot "
                f"hold ({_gpus(full.gpus_to_fit_batch, full.gpu_limit)} would hold it).",
            )
        )
    return notices


def _counts(values: list[int]) -> str:
    """``27, 27 and 26``."""
    words = [f"{value:,}" for value in values]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"


def _which(gpus: tuple[int, ...], count: int) -> str:
    """``GPU 0``, ``GPUs 0 and 1``, ``GPUs 0–15``, or ``Every GPU`` when all ``count`` are meant."""
    if len(gpus) == count:
        return "Every GPU"
    if len(gpus) == 1:
        return f"GPU {gpus[0]}"
    if len(gpus) > 2 and gpus[-1] - gpus[0] == len(gpus) - 1:
        return f"GPUs {_span(gpus[0], gpus[-1])}"
    return f"GPUs {_counts(list(gpus))}"


def _layer_counts(layers: int, gpus: int) -> str:
    """How many consecutive layers each GPU holds, the remainder going to the first ones (:func:`layer_split`)."""
    size, remainder = divmod(layers, gpus)

    def holding(count: int, each: bool) -> str:
        return f"{count} consecutive {'layer' if count == 1 else 'layers'}{' each' if each else ''}"

    if remainder == 0:
        return holding(size, each=True)
    first = f"{'the first GPU holds' if remainder == 1 else f'the first {remainder} hold'} "
    rest = gpus - remainder
    others = f"{'the last holds' if rest == 1 else f'the other {rest} hold'} "
    first += holding(size + 1, remainder > 1)
    others += holding(size, rest > 1)
    return f"{first} and {others}, since {gpus} does not divide {layers}"


def split_summary(evicted: CostEstimate) -> str:
    """How the layers are split over the GPUs and which GPUs limit what, for a scenario on several GPUs."""
    count, kept = len(evicted.gpu_shares), f"keep {evicted.keep_fraction:.0%}"
    total = sum(len(share.layers) for share in evicted.gpu_shares)
    split = f"the {total} layers are split over {count} GPUs"
    fullest = _which(evicted.fullest_gpus, count)
    room = (
        f"Every GPU has room for {evicted.max_sequences:,} sequences at {kept}, which the pipeline holds."
        if fullest == "Every GPU"
        else f"{fullest} {'has' if len(evicted.fullest_gpus) == 1 else 'have'} room for the fewest sequences "
        f"({evicted.max_sequences:,} at {kept}), and that is what the pipeline holds."
    )
    text = (
        f"Computed, not measured: {split}, {_layer_counts(total, count)}. Each GPU holds its layers' weights and "
        f"cache; the GPUs work in turn on every step, so a step takes as long as on one GPU while the price counts "
        f"all {count}. {room}"
    )
    if evicted.slowest_stage_seconds is None:
        return text
    slowest = _which(evicted.slowest_gpus, count)
    longest = _milliseconds(evicted.slowest_stage_seconds)
    part = (
        f"Every GPU's part of a step takes {longest}"
        if slowest == "Every GPU"
        else f"The longest part of a step is {longest}, on {slowest}"
    )
    return (
        f"{text} {part}: a pipeline kept full of micro-batches could finish a step no more often than that (not "
        "priced here)."
    )


def gpu_split_table(full: CostEstimate, evicted: CostEstimate) -> pd.DataFrame:
    """One row per GPU of the pipeline: its layers, weights, part of one sequence's cache and the sequences it has
    room for (full cache → evicted), its part of a decode step, and, when not every GPU does, which GPUs limit the
    evicted cache: the fullest (fewest sequences) and the slowest (longest part of a step)."""
    kept = f"keep {evicted.keep_fraction:.0%}"
    count = len(evicted.gpu_shares)
    marks = [
        (name, gpus)
        for name, gpus in (("fullest", evicted.fullest_gpus), ("slowest", evicted.slowest_gpus))
        if 0 < len(gpus) < count
    ]
    rows = []
    for gpu, (full_share, share) in enumerate(zip(full.gpu_shares, evicted.gpu_shares)):
        row = {
            "GPU": str(gpu),
            "Layers": _span(share.layers.start, share.layers.stop - 1),
            "Weights": format_bytes(share.weight_bytes),
            f"KV per sequence, full → {kept}": (
                f"{format_bytes(full_share.kv_bytes_per_sequence)} → {format_bytes(share.kv_bytes_per_sequence)}"
            ),
            f"Sequences, full → {kept}": (
                f"{_count(full.sequences_per_gpu[gpu])} → {_count(evicted.sequences_per_gpu[gpu])}"
            ),
            f"Step part, {kept}": (
                DOES_NOT_FIT if evicted.stage_seconds is None else _milliseconds(evicted.stage_seconds[gpu])
            ),
        }
        if marks:
            row["Limits"] = ", ".join(name for name, gpus in marks if gpu in gpus)
        rows.append(row)
    return pd.DataFrame(rows)


def scope_note(arch: ArchFacts, evicted: CostEstimate, scenario: Scenario) -> str:
    """What each eviction scope moves between GPUs per compression, from the architecture and the prompt."""
    if evicted.global_scope_gather_bytes is None or evicted.global_scope_count_bytes is None:
        return "The full cache evicts nothing, so neither eviction scope moves anything between GPUs."
    batch = (
        f" ({format_bytes(evicted.global_scope_gather_bytes * scenario.batch)} for the batch of {scenario.batch:,})"
        if scenario.batch > 1
        else ""
    )
    where = (
        "With one GPU the gather stays on the device."
        if scenario.gpu_count == 1
        else f"With {scenario.gpu_count} GPUs, every GPU but the gathering one sends its layers' share."
    )
    return (
        "Computed, not measured: a global eviction scope ranks every layer's tokens under one threshold, so each "
        "compression gathers every layer's eviction scores on one GPU, each slot's float32 score and position as one "
        f"int64 key: {arch.num_layers} layers × {arch.num_kv_heads} KV heads × {scenario.prompt_tokens:,} prompt "
        f"tokens × {KEY_BYTES} bytes = {format_bytes(evicted.global_scope_gather_bytes)} per sequence{batch}; it "
        f"reads back {arch.num_layers} per-layer counts ({format_bytes(evicted.global_scope_count_bytes)}). {where} "
        "A local scope moves nothing: each GPU ranks its own layers."
    )


def stored_keep_fractions(runs: pd.DataFrame) -> dict[str, float]:
    """Kept fractions that stored runs used, by a label naming one run each: the run's ``keep``, or its token
    budget over its context length. The full cache and runs whose fraction is unknown are left out."""
    options: dict[str, float] = {}
    for run in runs.itertuples(index=False):
        if present(run.keep):
            fraction = float(run.keep)
        elif present(run.budget_tokens) and present(run.context_length) and run.context_length:
            fraction = min(1.0, int(run.budget_tokens) / int(run.context_length))
        else:
            continue
        label = f"run {run.run_id}: {run_label(run.policy, run.mode, run.keep, run.budget_tokens, run.policy_params)}"
        options[f"{label}, {short_model_name(run.model)}, {run.task} ({fraction:.1%})"] = fraction
    return options


def with_measured(
    priced: CostEstimate,
    measured: MeasuredDecode | None,
    model_name: str,
    gpu_name: str,
    scenario: Scenario,
    configuration: str | None,
    price_per_hour: float,
) -> tuple[CostEstimate, MeasuredTimes | None]:
    """``priced`` with the times a GPU benchmark measured for ``configuration`` (a key of
    :data:`kvlab.costs.measured.SHOWN`; None: none chosen) in place of the formulas', and those times; ``priced``
    itself and None when the benchmark did not measure this scenario (:func:`kvlab.costs.measured.measured_times`).
    The full cache is matched at kept share 1."""
    if configuration is None:
        return priced, None
    as_measured = replace(scenario, keep_fraction=1.0) if configuration == "full" else scenario
    times = measured_times(measured, model_name, gpu_name, as_measured, configuration)
    if times is None:
        return priced, None
    return with_measured_times(priced, times, scenario, price_per_hour), times


def timing_sentence(full: MeasuredTimes | None, evicted: MeasuredTimes | None, measured: MeasuredDecode | None) -> str:
    """Where the decode and prefill times above come from: measured (the device, configuration, prompt length and
    batch named) or computed, for each column; when neither was measured, what the benchmark did measure."""
    if full is None and evicted is None:
        if measured is None:
            return "Decode and prefill times: computed from the formulas (no GPU benchmark results here)."
        contexts = ", ".join(f"{context:,}" for context in measured.contexts())
        return (
            f"Decode and prefill times: computed from the formulas. No GPU benchmark measured this model, GPU and "
            f"workload; the benchmark measured {MEASURED_SHAPE} on {measured.device} (one GPU, bf16) at prompts of "
            f"{contexts} tokens, keep {measured.keep_fraction:.0%} for the evicting configurations."
        )
    parts = [
        f"{name}: {times.label}" if times is not None else f"{name}: computed from the formulas"
        for name, times in (("full cache", full), ("evicted", evicted))
    ]
    return f"Decode and prefill times ({'; '.join(parts)}). Sizes, counts and memory are computed."
