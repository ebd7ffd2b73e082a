"""Figures of a live run, pure functions of a :class:`~kvlab.ui.live.LiveTrace`.

Every figure has a bounded number of points whatever the context length (rows of queries and columns of key
positions are pooled to fixed maxima), labelled axes with units, and draws what the cache did not hold as absent
(a hole, not a zero): an evicted token received no attention because it was not there, not because it was ignored.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go

from kvlab.ui.live import LiveTrace, ObservedStep

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

IDLE = "Press Run to start."
WAITING = "Waiting for the first pass…"
WAITING_FOR_ROWS = "Waiting for a second pass: a surface needs two rows of queries."


def byte_unit(largest: float) -> tuple[float, str]:
    """The divisor and name of the binary unit that shows ``largest`` bytes as a number of sensible size."""
    for divisor, name in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if largest >= divisor:
            return float(divisor), name
    return 1.0, "bytes"


def _placeholder(title: str, message: str) -> go.Figure:
    """An empty chart that keeps the layout in place until there is something to draw."""
    figure = go.Figure()
    figure.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    figure.update_layout(title=title, xaxis_visible=False, yaxis_visible=False, height=320)
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


def _count_axis(title: str, count: int) -> dict:
    """An axis of layers or heads: every one ticked while that stays readable."""
    return dict(title=title, dtick=1 if count <= 32 else None)


def layer_name(layer: int | None) -> str:
    """How the 3D view's layer choice reads: a layer by number, or the mean over layers (``None``)."""
    return "mean over layers" if layer is None else f"layer {layer}"


def attention_landscape(trace: LiveTrace | None, layer: int | None = None, max_rows: int = MAX_ROWS) -> go.Figure:
    """The 3D view: queries (prefill passes, then decoded tokens) x key positions x attention weight.

    The height is the mean attention weight of one held key in each bin of positions, on a logarithmic axis (the
    weights span orders of magnitude: a sink or a heavy hitter receives hundreds of times an average key) that
    starts at ``WEIGHT_FLOOR``; smaller weights are drawn on the floor. Bins the cache did not hold during a row's
    pass are holes. Marked: the weight of the first ``n_sink`` tokens (measured exactly, not read off their bin),
    heavy-hitter pillars (:func:`heavy_hitter_bins`) and the needle on the floor.
    """
    title = f"Attention weight per key over the run ({layer_name(layer)})"
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
            colorbar=dict(title="weight", len=0.6, tickvals=powers, ticktext=[f"1e{int(p)}" for p in powers]),
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
    tick_step = max(1, len(y) // 8)
    figure.update_layout(
        title=title,
        height=560,
        margin=dict(l=0, r=0, t=40, b=0),
        legend=dict(orientation="h", yanchor="bottom", y=-0.08, x=0),
        scene=dict(
            xaxis=dict(title="key position (token)", range=[0, trace.span]),
            yaxis=dict(
                title="query (from token / +decoded)",
                tickvals=y[::tick_step].tolist(),
                ticktext=[rows.tick[i] for i in y[::tick_step]],
            ),
            zaxis=dict(title="weight/key", type="log", range=[low, high], exponentformat="power"),
            camera=dict(eye=dict(x=1.45, y=-1.65, z=0.85)),
        ),
    )
    return figure


def sink_figure(trace: LiveTrace | None) -> go.Figure:
    """Attention share on the first ``n_sink`` tokens per layer in the latest pass: mean over heads, and the
    strongest head."""
    title = f"Sinks: attention share on the first {trace.n_sink if trace else 'few'} tokens"
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
        title=title,
        height=320,
        margin=dict(t=40, b=40),
        xaxis=_count_axis("layer", len(layers)),
        yaxis=dict(title="attention share", rangemode="tozero"),
        legend=dict(orientation="h", y=-0.3, x=0),
    )
    return figure


def entropy_over_time(trace: LiveTrace | None, max_columns: int = MAX_ROWS) -> go.Figure:
    """Mean attention entropy per layer (nats, mean over heads and the pass's queries) as the run goes on."""
    title = "Entropy per layer over the run"
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
    step = max(1, len(labels) // 8)
    figure.update_layout(
        title=title,
        height=300,
        margin=dict(t=40, b=40),
        xaxis=dict(
            title="pass (from token / +decoded)", tickvals=list(range(0, len(labels), step)), ticktext=ticks[::step]
        ),
        yaxis=_count_axis("layer", trace.num_layers),
    )
    return figure


def head_entropy(trace: LiveTrace | None) -> go.Figure:
    """Attention entropy per layer and query head in the latest pass (nats)."""
    title = "Entropy per layer and head (latest pass)"
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
        title=title,
        height=320,
        margin=dict(t=40, b=40),
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
        counts = np.bincount(
            np.clip(positions.ravel().astype(np.int64) * columns // trace.span, 0, columns - 1), minlength=columns
        )
        matrix[layer] = np.where(seen > 0, counts / np.maximum(seen * heads, 1), np.nan)
    return matrix, edges


def cache_map(trace: LiveTrace | None, max_columns: int = MAX_COLUMNS) -> go.Figure:
    """Which original positions survive in each layer: share held per column of positions (1 = every token of the
    column in every KV head), red where everything was evicted, blank where nothing has been read yet."""
    title = "Cache map: surviving positions per layer"
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
        title=title,
        height=320,
        margin=dict(t=40, b=40),
        xaxis=dict(title="original position (token)", range=[0, trace.span]),
        yaxis=_count_axis("layer", trace.num_layers),
    )
    return figure


def memory_figure(trace: LiveTrace | None) -> go.Figure:
    """The KV heap after every event: bytes of the slots holding a token and of the tensors reserved (both measured
    from the tensors held) against what a full cache of the same dtype and shapes would hold (computed), with the
    dead share in the hover and a mark where the heap compacted."""
    title = "KV cache bytes"
    if trace is None or not trace.memory:
        return _placeholder(title, IDLE if trace is None else WAITING)
    points = trace.memory
    seen = [point.seen_tokens for point in points]
    divisor, unit = byte_unit(max(max(max(p.kv_bytes_full, p.kv_reserved_bytes) for p in points), 1))
    figure = go.Figure()
    figure.add_trace(
        go.Scatter(
            x=seen,
            y=[p.kv_bytes_full / divisor for p in points],
            mode="lines",
            name="full cache (computed)",
            line=dict(dash="dash", color="#888888"),
        )
    )
    dead = [f"{p.kind}; {p.dead_share:.0%} of the slots in use are dead" for p in points]
    hover = f"after %{{customdata}}, %{{x}} tokens<br>%{{y:.2f}} {unit}<extra></extra>"
    figure.add_trace(
        go.Scatter(
            x=seen,
            y=[p.kv_reserved_bytes / divisor for p in points],
            mode="lines",
            name="reserved (measured from tensors)",
            line=dict(color=RESERVED_COLOUR, shape="hv"),
            customdata=dead,
            hovertemplate=hover,
        )
    )
    figure.add_trace(
        go.Scatter(
            x=seen,
            y=[p.kv_bytes / divisor for p in points],
            mode="lines+markers",
            name="in use (measured from tensors)",
            line=dict(color=HELD_COLOUR),
            marker=dict(size=4),
            customdata=dead,
            hovertemplate=hover,
        )
    )
    compacted = [i for i in range(len(points)) if points[i].compactions > (points[i - 1].compactions if i else 0)]
    if compacted:
        figure.add_trace(
            go.Scatter(
                x=[seen[i] for i in compacted],
                y=[points[i].kv_reserved_bytes / divisor for i in compacted],
                mode="markers",
                name="compacted",
                marker=dict(symbol="triangle-down", size=9, color=RESERVED_COLOUR),
                hovertemplate="compacted after %{x} tokens<extra></extra>",
            )
        )
    figure.update_layout(
        title=title,
        height=320,
        margin=dict(t=40, b=40),
        xaxis=dict(title="tokens read", rangemode="tozero"),
        yaxis=dict(title=f"KV bytes ({unit})", rangemode="tozero"),
        legend=dict(orientation="h", y=-0.3, x=0),
    )
    return figure
