"""Figures of a live run, pure functions of a :class:`~kvlab.runs.live.LiveTrace`, and the table of what moved between
a demoting run's tiers (a function of its :class:`~kvlab.cache.demotion.DemotionReport`).

Every figure has a bounded number of points whatever the context length (rows of queries and columns of key
positions are pooled to fixed maxima), labelled axes with units, and draws what the cache did not hold as absent
(a hole, not a zero): an evicted token received no attention because it was not there, not because it was ignored.

Each figure has a :class:`~kvlab.dashboard.guides.ChartGuide` beside its builder (all of them in :data:`GUIDES`), and is
laid out for a third of a 1,280-px page (the small charts) or three fifths of it (the 3D view): titles of two lines at
most, of at most 24 characters each, legends along the bottom edge, and a 3D scene whose axis titles stay inside the
chart.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from kvlab.cache.demotion import TIERS, DemotionReport
from kvlab.dashboard.guides import ChartGuide
from kvlab.runs.live import LiveTrace, ObservedStep
from kvlab.units import byte_axis, format_bytes

MAX_ROWS = 64
MAX_COLUMNS = 256
MAX_PILLARS = 5
WEIGHT_FLOOR = 1e-6
PILLAR_RATIO = 3.0

EVICTED_COLOUR = "#f2c4c4"
RESERVED_COLOUR = "#E4A11B"
HELD_COLOUR = "#1f4e9c"
SINK_COLOUR = "#e45756"
PILLAR_COLOUR = "#f58518"
NEEDLE_COLOUR = "#54a24b"

#: Where a demoting run's bytes are, bottom to top of the tier chart: the heap, then :data:`TIERS`.
TIER_NAMES: dict[str, str] = {"gpu": "GPU beside heap", "cpu": "CPU memory", "disk": "disk file"}
TIER_COLOURS: dict[str, str] = {"heap": HELD_COLOUR, "gpu": "#8fb3e0", "cpu": "#4c9f9b", "disk": "#9d755d"}

IDLE = "Press Run to start."
WAITING = "Waiting for the first pass…"
WAITING_FOR_ROWS = "Waiting for a second pass: a surface needs two rows of queries."


def _chart_frame(title: str, height: int = 340) -> dict[str, object]:
    """The layout the 2D charts share: room for two title lines whatever the title (charts side by side keep their
    plots level), and the legend along the bottom edge, below the axis titles, never over the title."""
    return dict(
        title=title,
        height=height,
        margin=dict(t=64, b=40),
        legend=dict(orientation="h", yref="container", yanchor="bottom", y=0, x=0),
    )


def _placeholder(title: str, message: str) -> go.Figure:
    """An empty chart that keeps the layout in place until there is something to draw."""
    figure = go.Figure()
    figure.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    figure.update_layout(**_chart_frame(title), xaxis_visible=False, yaxis_visible=False)
    return figure


@dataclass(frozen=True)
class QueryRows:
    """Observed passes pooled into at most a fixed number of rows, for one layer or the mean of the layers.

    ``share`` is the attention share per key bin (rows x bins), ``held`` the positions held per bin, ``sink`` the
    mean attention weight of a held sink token per row (NaN where none was held), ``first`` the first query
    position of each row and ``label`` what each row stands for (with a short ``tick``).
    """

    share: np.ndarray
    held: np.ndarray
    sink: np.ndarray
    first: np.ndarray
    label: list[str]
    tick: list[str]

    @property
    def weight(self) -> np.ndarray:
        """Mean attention weight of one held key in each bin (a bin's share over the keys it held); NaN where the
        bin held nothing, so what was evicted or not yet read is absent rather than zero."""
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(self.held > 0, self.share / self.held, np.nan)


def _groups(kinds: list[str], max_rows: int) -> list[list[int]]:
    """Consecutive indices split into at most ``max_rows`` groups (or one per run of a kind, if there are more runs)
    that never mix prefill and decode passes. Each run of one kind first gets an equal share of the rows, then
    runs with more passes get what the shorter ones left over, so a long decode does not squeeze the prefill."""
    runs: list[list[int]] = []
    for index, kind in enumerate(kinds):
        if runs and kinds[runs[-1][0]] == kind:
            runs[-1].append(index)
        else:
            runs.append([index])
    if not runs:
        return []
    parts = [min(len(run), max(1, max_rows // len(runs))) for run in runs]
    spare = max_rows - sum(parts)
    for index, run in enumerate(runs):
        extra = max(0, min(spare, len(run) - parts[index]))
        parts[index] += extra
        spare -= extra
    return [part.tolist() for run, count in zip(runs, parts) for part in np.array_split(np.asarray(run), count)]


def _row_label(steps: list[ObservedStep], decoded_before: int) -> tuple[str, str]:
    """What a pooled row stands for, in words and as a short axis tick (first query position, or +n for the n-th
    decoded token)."""
    first, last = steps[0], steps[-1]
    if first.kind == "decode":
        start, end = decoded_before + 1, decoded_before + len(steps)
        words = f"decoded token {start}" if start == end else f"decoded tokens {start}–{end}"
        return words, f"+{start}"
    return f"prefill, tokens {first.first_position}–{last.end_position - 1}", str(first.first_position)


def query_rows(trace: LiveTrace, layer: int | None = None, max_rows: int = MAX_ROWS) -> QueryRows:
    """The observed passes of ``trace`` for one layer (or the mean over layers), pooled to ``max_rows`` rows.

    A pooled row's share and sink weight are the query-weighted means of its passes; a bin's held keys are the
    most any of its passes held. The mean over layers averages shares and held keys over layers.
    """
    steps = trace.observed
    groups = _groups([step.kind for step in steps], max_rows)
    share, held, sink, first, label, tick = [], [], [], [], [], []
    decoded = 0

    def pick(values: np.ndarray) -> np.ndarray:
        return values.mean(axis=0) if layer is None else values[layer]

    def sink_weight(step: ObservedStep) -> float:
        held_sinks = float(pick(step.sinks_held.astype(float)))
        return float(pick(step.sink_mass.mean(axis=1))) / held_sinks if held_sinks else np.nan

    for group in groups:
        members = [steps[i] for i in group]
        weights = np.asarray([s.end_position - s.first_position for s in members], dtype=float)
        share.append(np.average([pick(s.pooled) for s in members], axis=0, weights=weights))
        held.append(np.max([pick(s.held) for s in members], axis=0))
        sink.append(np.average([sink_weight(s) for s in members], weights=weights))
        first.append(members[0].first_position)
        words, short = _row_label(members, decoded)
        label.append(words)
        tick.append(short)
        decoded += len(members) if members[0].kind == "decode" else 0
    bins = trace.n_bins
    return QueryRows(
        np.asarray(share).reshape(-1, bins),
        np.asarray(held).reshape(-1, bins),
        np.asarray(sink),
        np.asarray(first, dtype=np.int64),
        label,
        tick,
    )


def sink_bins(trace: LiveTrace) -> np.ndarray:
    """The bins that hold the first ``n_sink`` positions."""
    return np.unique(trace.bin_of(np.arange(min(trace.n_sink, trace.span))))


def heavy_hitter_bins(
    trace: LiveTrace, rows: QueryRows, max_pillars: int = MAX_PILLARS, ratio: float = PILLAR_RATIO
) -> list[int]:
    """Key bins that stand as pillars: across the queries that lie well after them (more than two bins later, so
    local attention does not count) they receive at least ``ratio`` times the share a uniform spread over the held
    tokens would give them, in the median row, over at least a quarter of the rows and at least two. Sink bins are
    marked separately. The strongest ``max_pillars``, in position order."""
    edges = trace.bin_edges()
    width = trace.span / trace.n_bins
    held_total = rows.held.sum(axis=1, keepdims=True).clip(min=1)
    relative = rows.share / np.where(rows.held > 0, rows.held / held_total, np.nan)
    distant = edges[1:][None, :] <= rows.first[:, None] - 2 * width
    usable = distant & (rows.held > 0)
    usable[:, sink_bins(trace)] = False
    enough = usable.sum(axis=0) >= max(2, int(np.ceil(0.25 * len(rows.first))))
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)  # bins no distant row held have no median
        scores = np.nanmedian(np.where(usable, relative, np.nan), axis=0)
    candidates = [int(b) for b in np.flatnonzero(enough & (np.nan_to_num(scores) >= ratio))]
    strongest = sorted(candidates, key=lambda b: -scores[b])[:max_pillars]
    return sorted(strongest)


#: The most layers or heads an axis ticks one by one: two-digit labels overlap beyond this on a chart a third of
#: the page wide.
MAX_COUNT_TICKS = 12


def _count_axis(title: str, count: int) -> dict:
    """An axis of layers or heads: every one ticked while that stays readable, round steps beyond."""
    return dict(title=title, dtick=1 if count <= MAX_COUNT_TICKS else None)


def layer_name(layer: int | None) -> str:
    """How the 3D view's layer choice reads: a layer by number, or the mean over layers (``None``)."""
    return "mean over layers" if layer is None else f"layer {layer}"


LANDSCAPE_GUIDE = ChartGuide(
    axes=(
        "Key position (pooled into bins) by query (prefill chunks by their first token, then generated tokens as "
        "+1, +2, …; at most 64 rows). Height and colour (weight) are the mean attention weight one held key of a "
        "bin receives, on a log axis from 1e-6 (smaller weights lie on the floor); holes are keys the cache did "
        "not hold during that pass, evicted or not read yet."
    ),
    good=(
        "The red line (the measured weight of each of the first few tokens, the sinks) runs high through every "
        "row, and the orange pillars (bins that queries well after them attend to at least 3 times an even share) "
        "go on to the last rows: the policy kept what later queries use. Over the needle's green floor mark the "
        "surface stays whole from the row that read it to the last generated token."
    ),
    bad=(
        "A hole opens over the green needle mark after the row that read it: the fact was evicted and the answer "
        "cannot come from the cache. The red line breaks off (the sinks were evicted), or a pillar ends in a hole "
        "while the rows after it are still being read (a heavy hitter was evicted that later queries needed)."
    ),
)


def attention_landscape(trace: LiveTrace | None, layer: int | None = None, max_rows: int = MAX_ROWS) -> go.Figure:
    """The 3D view: queries (prefill passes, then decoded tokens) x key positions x attention weight.

    The height is the mean attention weight of one held key in each bin of positions, on a logarithmic axis (the
    weights span orders of magnitude: a sink or a heavy hitter receives hundreds of times an average key) that
    starts at ``WEIGHT_FLOOR``; smaller weights are drawn on the floor. Bins the cache did not hold during a row's
    pass are holes. Marked: the weight of the first ``n_sink`` tokens (measured exactly, not read off their bin),
    heavy-hitter pillars (:func:`heavy_hitter_bins`) and the needle on the floor.
    """
    title = f"Attention weight per key<br>{layer_name(layer)}"
    if trace is None or len(trace.observed) < 2:
        return _placeholder(title, IDLE if trace is None else WAITING_FOR_ROWS)
    rows = query_rows(trace, layer, max_rows)
    edges = trace.bin_edges()
    centres = (edges[:-1] + edges[1:] - 1) / 2
    weight = rows.weight
    surface = np.where(np.isnan(weight), np.nan, np.maximum(weight, WEIGHT_FLOOR))
    colour = np.log10(surface)
    low = np.log10(WEIGHT_FLOOR)
    high = max(np.ceil(np.nanmax(colour)) if np.isfinite(colour).any() else 0.0, low + 1)
    powers = np.arange(low, high + 1)
    y = np.arange(len(rows.label))
    figure = go.Figure(
        go.Surface(
            x=centres,
            y=y,
            z=surface,
            surfacecolor=colour,
            colorscale="Viridis",
            cmin=low,
            cmax=high,
            customdata=np.repeat(np.asarray(rows.label, dtype=object)[:, None], trace.n_bins, axis=1),
            hovertemplate="keys around %{x:.0f}<br>%{customdata}<br>weight per key %{z:.2e}<extra></extra>",
            colorbar=dict(
                title=dict(text="weight", side="right"),
                orientation="h",
                x=0,
                xanchor="left",
                y=0.1,
                yanchor="top",
                len=0.7,
                thickness=12,
                tickvals=powers,
                ticktext=[f"1e{int(p)}" for p in powers],
            ),
            name="attention weight per held key",
            connectgaps=False,
        )
    )
    figure.add_trace(
        go.Scatter3d(
            x=np.full(len(y), (min(trace.n_sink, trace.span) - 1) / 2),
            y=y,
            z=np.maximum(rows.sink, WEIGHT_FLOOR),
            mode="lines+markers",
            line=dict(color=SINK_COLOUR, width=6),
            marker=dict(size=3, color=SINK_COLOUR),
            name=f"sink: first {trace.n_sink} tokens",
        )
    )
    for pillar in heavy_hitter_bins(trace, rows):
        figure.add_trace(
            go.Scatter3d(
                x=np.full(len(y), centres[pillar]),
                y=y,
                z=surface[:, pillar],
                mode="lines",
                line=dict(color=PILLAR_COLOUR, width=7),
                name=f"heavy hitter, keys {edges[pillar]}–{edges[pillar + 1] - 1}",
            )
        )
    if trace.needle is not None:
        start, end = trace.needle
        figure.add_trace(
            go.Scatter3d(
                x=np.full(len(y), (start + end - 1) / 2),
                y=y,
                z=np.full(len(y), 10**low),
                mode="lines",
                line=dict(color=NEEDLE_COLOUR, width=5, dash="dash"),
                name=f"needle, tokens {start}–{end - 1}",
            )
        )
    tick_step = max(1, len(y) // 6)
    # The floor's tick is left to the colour bar: on the axis it would sit on the first key position's tick.
    power_ticks = dict(tickvals=(10.0 ** powers[1:]).tolist(), ticktext=[f"1e{int(p)}" for p in powers[1:]])
    figure.update_layout(
        title=title,
        height=600,
        margin=dict(l=10, r=10, t=60, b=10),
        legend=dict(orientation="h", yanchor="top", y=0, x=0),
        scene=dict(
            domain=dict(x=[0, 1], y=[0.12, 1]),
            xaxis=dict(title="key position", range=[0, trace.span]),
            yaxis=dict(
                title="query", tickvals=y[::tick_step].tolist(), ticktext=[rows.tick[i] for i in y[::tick_step]]
            ),
            zaxis=dict(title="weight", type="log", range=[low, high], **power_ticks),
            aspectmode="manual",
            aspectratio=dict(x=1, y=1, z=1.2),
            camera=dict(eye=dict(x=1.75, y=-2.0, z=0.9), center=dict(x=0.05, y=0.05, z=-0.1)),
        ),
    )
    return figure


SINK_GUIDE = ChartGuide(
    axes=(
        "One bar per layer: the attention share of the latest pass that goes to the first tokens of the prompt "
        "(the attention sinks; the title says how many), mean over query heads and the pass's queries. The black "
        "diamond is the head that gives them the most; 1 would mean all of a head's attention."
    ),
    good=(
        "The bars keep their height from the first chunk to the last generated token: the sinks are held "
        "(streaming keeps them by construction; scoring policies such as H2O usually keep them because they score "
        "high). How high they stand depends on the model; many pretrained models give them a large share in most "
        "layers after the first two."
    ),
    bad=(
        "Bars that fall to zero after an eviction: the sink tokens are no longer in the cache, so the attention "
        "they took is spread over whatever is left, the failure StreamingLLM's window-only baseline shows. The "
        "drop_first ablation evicts the first token on purpose: its bars lose that token's share."
    ),
)


def sink_figure(trace: LiveTrace | None) -> go.Figure:
    """Attention share on the first ``n_sink`` tokens per layer in the latest pass: mean over heads, and the
    strongest head."""
    count = f"{trace.n_sink} " if trace else ""
    title = f"Sinks: attention share<br>on the first {count}tokens"
    if trace is None or not trace.observed:
        return _placeholder(title, IDLE if trace is None else WAITING)
    latest = trace.observed[-1].sink_mass
    layers = np.arange(latest.shape[0])
    figure = go.Figure(go.Bar(x=layers, y=latest.mean(axis=1), name="mean over heads", marker_color=SINK_COLOUR))
    figure.add_trace(
        go.Scatter(
            x=layers,
            y=latest.max(axis=1),
            mode="markers",
            name="strongest head",
            marker=dict(symbol="diamond", size=9, color="#333333"),
        )
    )
    figure.update_layout(
        **_chart_frame(title),
        xaxis=_count_axis("layer", len(layers)),
        yaxis=dict(title="attention share", rangemode="tozero"),
    )
    return figure


ENTROPY_GUIDE = ChartGuide(
    axes=(
        "Layers (y) over the run (x: prefill chunks by their first token, then generated tokens as +1, +2, …; at "
        "most 64 columns). Colour is each layer's attention entropy in nats, mean over its query heads and the "
        "pass's queries: dark is attention on a few keys, yellow is attention spread wide (an even spread over n "
        "keys is ln n nats, 6.9 for 1,000)."
    ),
    good=(
        "Each layer keeps its band through the run. Entropy may rise slowly while the prompt is read (more keys "
        "to spread over) and level off once eviction holds the cache at the budget; the switch to generated "
        "tokens (one query per pass) may shift it a little."
    ),
    bad=(
        "A layer whose entropy jumps up right after eviction starts (the keys it attended to are gone and its "
        "attention spreads over the rest) or collapses towards zero (its attention piles onto one remaining "
        "token): the policy removed keys that layer relied on."
    ),
)


def entropy_over_time(trace: LiveTrace | None, max_columns: int = MAX_ROWS) -> go.Figure:
    """Mean attention entropy per layer (nats, mean over heads and the pass's queries) as the run goes on."""
    title = "Entropy over the run"
    if trace is None or not trace.observed:
        return _placeholder(title, IDLE if trace is None else WAITING)
    groups = _groups([step.kind for step in trace.observed], max_columns)
    columns, labels, ticks, decoded = [], [], [], 0
    for group in groups:
        members = [trace.observed[i] for i in group]
        columns.append(np.mean([step.entropy.mean(axis=1) for step in members], axis=0))
        words, short = _row_label(members, decoded)
        labels.append(words)
        ticks.append(short)
        decoded += len(members) if members[0].kind == "decode" else 0
    matrix = np.stack(columns, axis=1)
    figure = go.Figure(
        go.Heatmap(
            z=matrix,
            x=list(range(len(labels))),
            y=list(range(matrix.shape[0])),
            colorscale="Cividis",
            colorbar=dict(title="nats"),
            customdata=np.tile(np.asarray(labels, dtype=object), (matrix.shape[0], 1)),
            hovertemplate="layer %{y}<br>%{customdata}<br>entropy %{z:.2f} nats<extra></extra>",
        )
    )
    step = max(1, len(labels) // 6)
    figure.update_layout(
        **_chart_frame(title, height=300),
        xaxis=dict(
            title="pass (from token / +decoded)", tickvals=list(range(0, len(labels), step)), ticktext=ticks[::step]
        ),
        yaxis=_count_axis("layer", trace.num_layers),
    )
    return figure


HEAD_ENTROPY_GUIDE = ChartGuide(
    axes=(
        "Layers (rows) by query heads (columns) in the latest pass. Colour is each head's attention entropy in "
        "nats, averaged over the pass's queries: dark is a head that attends to a few keys, yellow one that "
        "spreads its attention wide (an even spread over n keys is ln n nats)."
    ),
    good=(
        "The pattern holds as the cache is evicted: focused heads stay dark, broad heads stay light, from chunk to "
        "chunk and into the generated tokens. Broad heads may read a little lower once the cache holds only the "
        "budget, since fewer keys are there to spread over."
    ),
    bad=(
        "Focused heads turning light after evictions (what they attended to was evicted and they spread over the "
        "rest), or whole layers turning dark at once (all attention on one surviving token)."
    ),
)


def head_entropy(trace: LiveTrace | None) -> go.Figure:
    """Attention entropy per layer and query head in the latest pass (nats)."""
    title = "Entropy per head<br>latest pass"
    if trace is None or not trace.observed:
        return _placeholder(title, IDLE if trace is None else WAITING)
    latest = trace.observed[-1].entropy
    figure = go.Figure(
        go.Heatmap(
            z=latest,
            colorscale="Cividis",
            colorbar=dict(title="nats"),
            hovertemplate="layer %{y}, head %{x}<br>%{z:.2f} nats<extra></extra>",
        )
    )
    figure.update_layout(
        **_chart_frame(title),
        xaxis=_count_axis("query head", latest.shape[1]),
        yaxis=_count_axis("layer", latest.shape[0]),
    )
    return figure


def survival(trace: LiveTrace, max_columns: int = MAX_COLUMNS) -> tuple[np.ndarray, np.ndarray]:
    """Per layer, the share of the positions read so far in each column that some slot still holds (averaged over
    KV heads); NaN for columns not read yet. Returns the matrix and the column edges (positions)."""
    columns = max(1, min(max_columns, trace.span))
    edges = -(-np.arange(columns + 1) * trace.span // columns)
    edges[-1] = trace.span
    seen = np.clip(np.minimum(edges[1:], trace.seen_tokens) - edges[:-1], 0, None)
    matrix = np.full((len(trace.survivors), columns), np.nan)
    for layer, positions in enumerate(trace.survivors):
        heads = positions.shape[0] if positions.ndim > 1 else 1
        held = positions[positions >= 0]  # a head holding fewer tokens than another (Ada-KV) ends in free entries
        counts = np.bincount(np.clip(held.astype(np.int64) * columns // trace.span, 0, columns - 1), minlength=columns)
        matrix[layer] = np.where(seen > 0, counts / np.maximum(seen * heads, 1), np.nan)
    return matrix, edges


CACHE_MAP_GUIDE = ChartGuide(
    axes=(
        "Original position of each token (x, in up to 256 columns) by layer (y). Colour is the share of a "
        "column's tokens held in the cache now, over KV heads: dark blue all, pale blue a few, red none (all "
        "evicted); blank columns are not read yet. The green box is the needle's tokens."
    ),
    good=(
        "A dark column at the far left (the sinks), a dark band at the right (the recent window) and scattered "
        "blue in between (the heavy hitters a scoring policy kept). In a needle task the needle's box stays blue "
        "in most layers. PyramidKV keeps less in deeper layers by design, so its upper rows are paler."
    ),
    bad=(
        "A red needle box: the fact is gone from the cache in those layers and the model cannot read it back. A "
        "red first column under a policy meant to keep sinks, or one layer far redder than the others, means the "
        "policy did not keep what it promises."
    ),
)


def cache_map(trace: LiveTrace | None, max_columns: int = MAX_COLUMNS) -> go.Figure:
    """Which original positions survive in each layer: share held per column of positions (1 = every token of the
    column in every KV head), red where everything was evicted, blank where nothing has been read yet."""
    title = "Cache map: tokens held"
    if trace is None or not trace.survivors:
        return _placeholder(title, IDLE if trace is None else WAITING)
    matrix, edges = survival(trace, max_columns)
    centres = (edges[:-1] + edges[1:] - 1) / 2
    figure = go.Figure(
        go.Heatmap(
            z=matrix,
            x=centres,
            y=list(range(matrix.shape[0])),
            zmin=0,
            zmax=1,
            colorscale=[[0.0, EVICTED_COLOUR], [0.02, "#dfe8f5"], [1.0, HELD_COLOUR]],
            colorbar=dict(title="held", tickformat=".0%"),
            hovertemplate="layer %{y}<br>tokens around %{x:.0f}<br>held %{z:.0%}<extra></extra>",
        )
    )
    if trace.needle is not None:
        start, end = trace.needle
        figure.add_vrect(
            x0=start - 0.5,
            x1=end - 0.5,
            line=dict(color=NEEDLE_COLOUR, width=2),
            annotation_text="needle",
            annotation_position="top left",
        )
    figure.update_layout(
        **_chart_frame(title),
        xaxis=dict(title="original position (token)", range=[0, trace.span]),
        yaxis=_count_axis("layer", trace.num_layers),
    )
    return figure


MEMORY_GUIDE = ChartGuide(
    axes=(
        "Tokens read (x) against KV bytes (y, binary units) after every prefill chunk and generated token. Blue "
        "dots: bytes of the slots holding a token (in use); orange: bytes of the heap's tensors (reserved), both "
        "measured; orange triangles: compactions. Grey dashes: a full cache of the same dtype and shapes after the "
        "same tokens, computed (an evicting run never holds one)."
    ),
    good=(
        "In streaming mode blue climbs with grey until the budget is full, then stays flat at the budget while grey "
        "keeps climbing: the gap is the memory saved. Orange stays flat a little above the plateau (the heap is "
        "sized to the budget plus one chunk). In prefill mode blue follows grey over the whole prompt and drops to "
        "the budget at the one compression."
    ),
    bad=(
        "Blue climbing with grey to the end: nothing was evicted (the full policy, or a budget as large as the "
        "prompt). Orange far above blue for a long stretch: evicted slots sit dead in the tensors and the heap "
        "does not compact, so the bytes evicted are not returned to the device."
    ),
)


def _bytes_trace(seen: list[int], values: list[int], notes: list[str], name: str, **style: object) -> go.Scatter:
    """One series of the memory chart: raw bytes on the axis, the bytes in binary units and a note in the hover."""
    return go.Scatter(
        x=seen,
        y=values,
        name=name,
        customdata=[[format_bytes(value), note] for value, note in zip(values, notes)],
        hovertemplate=f"%{{customdata[0]}} after %{{x:,}} tokens<br>%{{customdata[1]}}<extra>{name}</extra>",
        **style,
    )


def memory_figure(trace: LiveTrace | None) -> go.Figure:
    """The KV heap after every event: bytes of the slots holding a token and of the tensors reserved (both measured
    from the tensors held) against what a full cache of the same dtype and shapes would hold (computed), with the
    dead share in the hover and a mark where the heap compacted. Raw bytes, ticked at round binary values."""
    title = "KV cache bytes"
    if trace is None or not trace.memory:
        return _placeholder(title, IDLE if trace is None else WAITING)
    points = trace.memory
    seen = [point.seen_tokens for point in points]
    full = [point.kv_bytes_full for point in points]
    reserved = [point.kv_reserved_bytes for point in points]
    dead = [f"{point.kind}; {point.dead_share:.0%} of the slots in use are dead" for point in points]
    figure = go.Figure()
    computed = [f"{point.kind}; computed, not measured" for point in points]
    figure.add_trace(
        _bytes_trace(
            seen, full, computed, "full cache (computed)", mode="lines", line=dict(dash="dash", color="#888888")
        )
    )
    figure.add_trace(
        _bytes_trace(
            seen, reserved, dead, "reserved (measured)", mode="lines", line=dict(color=RESERVED_COLOUR, shape="hv")
        )
    )
    figure.add_trace(
        _bytes_trace(
            seen,
            [point.kv_bytes for point in points],
            dead,
            "in use (measured)",
            mode="lines+markers",
            line=dict(color=HELD_COLOUR),
            marker=dict(size=4),
        )
    )
    compacted = [i for i in range(len(points)) if points[i].compactions > (points[i - 1].compactions if i else 0)]
    if compacted:
        figure.add_trace(
            _bytes_trace(
                [seen[i] for i in compacted],
                [reserved[i] for i in compacted],
                [f"{points[i].compactions} compactions so far" for i in compacted],
                "compacted",
                mode="markers",
                marker=dict(symbol="triangle-down", size=9, color=RESERVED_COLOUR),
            )
        )
    figure.update_layout(
        **_chart_frame(title),
        xaxis=dict(title="tokens read", rangemode="tozero", nticks=5),
        yaxis=dict(
            title="KV bytes", rangemode="tozero", **byte_axis(0, max(*full, *reserved, 1), log=False, max_ticks=5)
        ),
    )
    return figure


TIER_GUIDE = ChartGuide(
    axes=(
        "Tokens read (x) against bytes (y, binary units) after every prefill chunk and generated token, stacked by "
        "where they are held: the heap's slots on the GPU (blue), demotion's page summaries, partial and recalled "
        "pages beside the heap on the GPU (light blue), pinned CPU memory (teal), the offload file (brown). Grey "
        "dashes: a full cache of the same dtype and shapes after the same tokens, computed."
    ),
    good=(
        "Blue stays flat at the budget, light blue grows only slowly (a summary per demoted page, the recalled "
        "pages) and teal grows with every eviction: the evicted tokens wait off the GPU to be recalled. Once CPU "
        "memory is full, brown takes the rest; while nothing is dropped the top runs a little above grey "
        "(summaries, positions and recalled copies)."
    ),
    bad=(
        "The top falling below grey: both tiers are full and pages are dropped for good (the table beside counts "
        "them; sliding-window layers also delete what leaves their window). A light blue band as thick as the "
        "blue one: the recalled pages take back on the GPU much of what eviction saved (fewer recall_pages shrinks "
        "it)."
    ),
)
NOT_DEMOTING = "Nothing was demoted in this run."


def tier_figure(trace: LiveTrace | None) -> go.Figure:
    """Where a demoting run's bytes are after every event, stacked fastest tier first: the heap's slots (measured
    from its tensors), then demotion's bytes on the GPU beside the heap, in CPU memory and in the offload file, with
    a full cache's bytes (computed) as a line for scale. A tier that held nothing all run is left out; a run that
    demotes nothing gets no stack at all."""
    title = "Memory by tier"
    if trace is None or not trace.memory:
        return _placeholder(title, IDLE if trace is None else WAITING)
    if not trace.demotes:
        return _placeholder(title, NOT_DEMOTING)
    points = trace.memory
    seen = [point.seen_tokens for point in points]
    layers = [("GPU heap", TIER_COLOURS["heap"], np.asarray([point.kv_bytes for point in points], dtype=np.int64))]
    for tier in TIERS:
        held = np.asarray([(point.demoted_bytes or {}).get(tier, 0) for point in points], dtype=np.int64)
        if held.any():
            layers.append((TIER_NAMES[tier], TIER_COLOURS[tier], held))
    total = np.sum([held for _, _, held in layers], axis=0)
    figure = go.Figure()
    top = np.zeros(len(points), dtype=np.int64)
    for index, (name, colour, held) in enumerate(layers):
        top = top + held
        figure.add_trace(
            go.Scatter(
                x=seen,
                y=top.tolist(),
                name=name,
                mode="lines",
                line=dict(color=colour, width=1),
                fill="tozeroy" if index == 0 else "tonexty",
                fillcolor=colour,
                customdata=[
                    [format_bytes(own), format_bytes(whole), point.kind]
                    for own, whole, point in zip(held, total, points)
                ],
                hovertemplate=(
                    f"{name}: %{{customdata[0]}}<br>all tiers: %{{customdata[1]}} after %{{x:,}} tokens"
                    "<br>%{customdata[2]}<extra></extra>"
                ),
            )
        )
    full = [point.kv_bytes_full for point in points]
    computed = [f"{point.kind}; computed, not measured" for point in points]
    figure.add_trace(  # after the stack: a filled band fills down to the trace drawn before it
        _bytes_trace(
            seen, full, computed, "full cache (computed)", mode="lines", line=dict(dash="dash", color="#888888")
        )
    )
    figure.update_layout(
        **_chart_frame(title),
        xaxis=dict(title="tokens read", range=[0, trace.span], nticks=5),
        yaxis=dict(title="bytes", rangemode="tozero", **byte_axis(0, max(*full, *total, 1), log=False, max_ticks=5)),
    )
    figure.update_layout(margin_r=24)  # room for the last tick's label: the filled bands reach the axis's end
    return figure


def demotion_table(report: DemotionReport) -> pd.DataFrame:
    """What moved between a finished run's tiers, one measure a row with its value and what it counts: pages and
    bytes fetched back per generated token, the recall's time per token (measured, the device synchronised), and
    pages demoted, moved from CPU memory to the file, and dropped. A page is ``page_tokens`` tokens of one layer,
    sequence and KV head."""

    def per_token(value: float | None, shown: Callable[[float], str]) -> str:
        return "— (nothing generated)" if value is None else shown(value)

    rows = [
        (
            "pages fetched per token",
            per_token(report.pages_per_token, lambda pages: f"{pages:,.1f}"),
            "pages copied back to the GPU per generated token, over layers and KV heads",
        ),
        (
            "bytes fetched per token",
            per_token(report.bytes_per_token, format_bytes),
            "their keys, values and positions",
        ),
        (
            "recall time per token",
            per_token(report.recall_seconds_per_token, lambda seconds: f"{seconds * 1e3:,.2f} ms"),
            "choosing, gathering and copying pages (measured, the device synchronised)",
        ),
        ("pages demoted", f"{report.demoted_pages:,}", "evicted from the heap into the tiers"),
        ("pages moved to disk", f"{report.to_disk_pages:,}", "from CPU memory to the offload file, once it was full"),
        ("pages dropped", f"{report.dropped_pages:,}", "deleted: they fit in neither tier"),
    ]
    return pd.DataFrame(rows, columns=["measure", "value", "what it counts"])


#: Each live chart's guide, by the short name the live page keys that chart with.
GUIDES: dict[str, ChartGuide] = {
    "memory": MEMORY_GUIDE,
    "tiers": TIER_GUIDE,
    "sinks": SINK_GUIDE,
    "heads": HEAD_ENTROPY_GUIDE,
    "landscape": LANDSCAPE_GUIDE,
    "cache": CACHE_MAP_GUIDE,
    "entropy": ENTROPY_GUIDE,
}
