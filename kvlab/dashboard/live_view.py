"""The Streamlit side of a live run's charts, shared by the live page (running or replaying) and the overview: where
each chart goes, its "How to read this" beside it, and drawing a trace into those places; and the widget of a policy
parameter, drawn from its declaration, which the needle grid's cache options share.

A running page redraws every chart after each event, so the charts live in ``st.empty`` slots made once per page
run; their guides are drawn once, above the slots, and are not redrawn with them. A run that demotes what it evicts
gets one more row: its memory by tier, and beside it what moved between the tiers, counted when the run ends.
"""

from __future__ import annotations

from dataclasses import dataclass

import streamlit as st
from streamlit.delta_generator import DeltaGenerator

from kvlab.cache.demotion import DemotionReport
from kvlab.dashboard import live_figures as figures
from kvlab.dashboard.chart_view import how_to_read, show_chart
from kvlab.dashboard.inputs import ParamField
from kvlab.runs.live import LiveTrace


@dataclass(frozen=True)
class ChartSlots:
    """One place per live chart, and the key prefix that keeps two sets of them on one page apart; for a run that
    demotes, the places of its memory by tier and of what moved between the tiers (``None`` otherwise)."""

    memory: DeltaGenerator
    sinks: DeltaGenerator
    heads: DeltaGenerator
    landscape: DeltaGenerator
    cache: DeltaGenerator
    entropy: DeltaGenerator
    name: str
    tiers: DeltaGenerator | None = None
    moves: DeltaGenerator | None = None


def _guided(where: DeltaGenerator, guide_name: str, name: str) -> DeltaGenerator:
    """A slot under the chart's "How to read this" button."""
    how_to_read(where, figures.GUIDES[guide_name], key=f"{name}-guide-{guide_name}")
    return where.empty()


def wide_slots(name: str, tiers: bool = False) -> ChartSlots:
    """The page-wide arrangement: the three small charts in a row first (a browser draws a redraw's charts in page
    order, and the 3D view is the slowest to draw), then, with ``tiers``, the memory by tier under the memory chart
    with what moved beside it, then the 3D view beside the cache map and the entropy."""
    memory, sinks, heads = st.columns(3)
    tier_places = st.columns([1, 2]) if tiers else None
    landscape, side = st.columns([3, 2])
    return ChartSlots(
        memory=_guided(memory, "memory", name),
        sinks=_guided(sinks, "sinks", name),
        heads=_guided(heads, "heads", name),
        landscape=_guided(landscape, "landscape", name),
        cache=_guided(side, "cache", name),
        entropy=_guided(side, "entropy", name),
        name=name,
        tiers=None if tier_places is None else _guided(tier_places[0], "tiers", name),
        moves=None if tier_places is None else tier_places[1].empty(),
    )


def stacked_slots(column: DeltaGenerator, name: str, tiers: bool = False) -> ChartSlots:
    """Every chart one under the other in ``column``, for two runs side by side (with ``tiers``, the memory by tier
    and what moved right after the memory chart)."""
    with column:
        memory = _guided(column, "memory", name)
        tier_chart = _guided(column, "tiers", name) if tiers else None
        moves = column.empty() if tiers else None
        return ChartSlots(
            memory=memory,
            cache=_guided(column, "cache", name),
            sinks=_guided(column, "sinks", name),
            entropy=_guided(column, "entropy", name),
            heads=_guided(column, "heads", name),
            landscape=_guided(column, "landscape", name),
            name=name,
            tiers=tier_chart,
            moves=moves,
        )


def draw_moves(where: DeltaGenerator, trace: LiveTrace | None, report: DemotionReport | None) -> None:
    """What moved between a demoting run's tiers (:func:`~kvlab.dashboard.live_figures.demotion_table`) in ``where``;
    before the run has ended, what will be shown there."""
    box = where.container()
    box.markdown("**What moved between the tiers** (at the end of the run)")
    if report is None and trace is not None and trace.memory and not trace.demotes:
        box.caption(figures.NOT_DEMOTING)
    elif report is None:
        box.caption(
            "Counted when the run ends: pages and bytes fetched back per generated token, the recall's time per "
            "token, and pages demoted, moved to disk and dropped."
        )
    else:
        box.table(figures.demotion_table(report).set_index("measure"))  # a table wraps the notes a data frame cuts


def show_output(where: DeltaGenerator, text: str) -> None:
    """What a run has written so far, in a bordered box, as plain text (Streamlit trims the whitespace around it).
    Not Streamlit's code element, which would load a syntax highlighter (about 1.5 MB of JavaScript) into a new tab
    for text it does not highlight."""
    where.container(border=True).text(text)


def draw_charts(
    slots: ChartSlots, trace: LiveTrace | None, layer: int | None, tag: str, demotion: DemotionReport | None = None
) -> None:
    """Every chart of ``trace`` in its slot (empty charts before a run), and for a demoting run what moved between
    its tiers (``demotion``, from the finished run; ``None`` while it runs); ``tag`` keeps each redraw's elements
    distinct."""
    prefix = f"{slots.name}-{tag}"
    show_chart(slots.memory, figures.memory_figure(trace), f"{prefix}-memory", "kvlab-kv-bytes")
    if slots.tiers is not None:
        show_chart(slots.tiers, figures.tier_figure(trace), f"{prefix}-tiers", "kvlab-memory-by-tier")
    if slots.moves is not None:
        draw_moves(slots.moves, trace, demotion)
    show_chart(slots.sinks, figures.sink_figure(trace), f"{prefix}-sinks", "kvlab-sinks")
    show_chart(slots.heads, figures.head_entropy(trace), f"{prefix}-heads", "kvlab-head-entropy")
    show_chart(slots.landscape, figures.attention_landscape(trace, layer), f"{prefix}-landscape", "kvlab-attention-3d")
    show_chart(slots.cache, figures.cache_map(trace), f"{prefix}-cache", "kvlab-cache-map")
    show_chart(slots.entropy, figures.entropy_over_time(trace), f"{prefix}-entropy", "kvlab-entropy")


def param_widget(where: DeltaGenerator, field: ParamField, key: str) -> object:
    """The widget of one policy parameter in ``where``, kept for the session under ``key``, and its value: a choice
    for a parameter with choices (or bit widths), a box for a number (within its declared bounds where they are
    closed), a checkbox for a switch, a text box otherwise. Bounds a widget cannot hold (open ones) are named in its
    help and checked when the policy is made."""
    spec = field.spec
    if field.choices:
        index = field.choices.index(field.default) if field.default in field.choices else 0
        return where.selectbox(field.name, field.choices, index=index, key=key, help=spec.help, persist_state="session")
    if field.kind is bool:
        return where.checkbox(field.name, value=bool(field.default), key=key, help=spec.help, persist_state="session")
    if field.kind is int:
        whole = where.number_input(
            field.name,
            min_value=None if spec.minimum is None else int(spec.minimum),
            max_value=None if spec.maximum is None else int(spec.maximum),
            value=int(field.default),
            step=1,
            key=key,
            help=spec.help,
            persist_state="session",
        )
        return int(whole)
    if field.kind is float:
        number = where.number_input(
            field.name,
            min_value=None if spec.minimum is None or spec.open_minimum else float(spec.minimum),
            max_value=None if spec.maximum is None or spec.open_maximum else float(spec.maximum),
            value=float(field.default),
            step=0.05,
            key=key,
            help=f"{spec.help} ({spec.describe()})",
            persist_state="session",
        )
        return float(number)
    return where.text_input(field.name, value=str(field.default), key=key, help=spec.help, persist_state="session")
