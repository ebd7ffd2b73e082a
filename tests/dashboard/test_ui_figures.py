"""The live run's figure builders, on a synthetic run whose sinks, heavy hitter and evictions are known exactly."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from kvlab.dashboard import live_figures as figures
from kvlab.engine.events import Event
from kvlab.runs.live import LiveTrace, MemoryPoint

LAYERS, HEADS, KV_HEADS = 2, 4, 2
PROMPT, CHUNK, BINS = 256, 16, 32  # 8 positions per bin
SINKS = (0, 1)
HITTER = 84  # bin 10, read in the pass of tokens 80-95
RECENT = 16
#: Chromium fits about 37 characters of a bold chart title on a line in a chart a third of a 1,280-pixel page wide
#: (260 px with the sidebar open) and 26 at a 1,024-pixel page (180 px); 24 leaves room for wide letters. Charts side
#: by side leave room for two lines.
TITLE_LINE_CHARACTERS = 24
TITLE_LINES = 2
#: The 3D view's axis titles are drawn in the scene, where a long one runs out of the chart.
SCENE_TITLE_CHARACTERS = 12


def held_after(seen: int) -> list[int]:
    """What the synthetic cache keeps after reading ``seen`` tokens: two sinks, the heavy hitter, the recent window."""
    kept = set(SINKS) | set(range(max(0, seen - RECENT), seen))
    if seen > HITTER:
        kept.add(HITTER)
    return sorted(kept)


def pass_attention(before: list[int], first: int, end: int) -> np.ndarray:
    """Per-bin share of one pass: 0.3 on the sinks, 0.4 on the heavy hitter once it is cached, the rest on the keys
    the pass reads."""
    share = np.zeros(BINS)
    share[0] += 0.3
    rest = 0.7
    if HITTER in before:
        share[HITTER * BINS // PROMPT] += 0.4
        rest = 0.3
    for position in range(first, end):
        share[position * BINS // PROMPT] += rest / (end - first)
    return share


def event(kind: str, step: int, first: int, end: int, before: list[int], with_stats: bool = True) -> Event:
    kept = held_after(end)
    positions = [torch.tensor(kept).expand(1, KV_HEADS, len(kept)).clone() for _ in range(LAYERS)]
    stats = None
    if with_stats:
        share = torch.tensor(pass_attention(before, first, end), dtype=torch.float32)
        stats = {
            "pooled": share.expand(LAYERS, 1, BINS).clone(),
            "entropy": torch.arange(LAYERS * HEADS, dtype=torch.float32).reshape(LAYERS, 1, HEADS),
            "sink_mass": torch.full((LAYERS, 1, HEADS), 0.3),
        }
    return Event(
        kind=kind,
        step=step,
        seen_tokens=end,
        kept_per_layer=[len(kept)] * LAYERS,
        kv_bytes=len(kept) * 1024,
        kv_bytes_full=end * 1024,
        token_ids=[7] if kind == "decode" else None,
        stats=stats,
        positions=positions,
    )


@pytest.fixture
def trace() -> LiveTrace:
    trace = LiveTrace(LAYERS, PROMPT, 0, BINS, len(SINKS), needle=(40, 48))
    for step, first in enumerate(range(0, PROMPT, CHUNK)):
        trace.add(event("prefill", step, first, first + CHUNK, held_after(first)))
    return trace


def marks(figure) -> list:
    """The lines drawn over the 3D surface."""
    return [trace for trace in figure.data if trace.type == "scatter3d"]


def test_evicted_and_unread_positions_are_holes_not_zeros(trace):
    z = np.asarray(figures.attention_landscape(trace, layer=0).data[0].z, dtype=float)
    row = 10  # the pass over tokens 160-175: holds sinks, the heavy hitter, tokens 144-159 and its own 160-175
    held_bins = {0, HITTER * BINS // PROMPT, 18, 19, 20, 21}
    assert set(np.flatnonzero(np.isfinite(z[row]))) == held_bins
    assert np.isnan(z[row, 5])  # tokens 40-47 were read and evicted
    assert np.isnan(z[row, 30])  # tokens 240-247 are not read yet


def test_the_heavy_hitter_is_marked_where_the_data_puts_it(trace):
    rows = figures.query_rows(trace, layer=1)
    assert figures.heavy_hitter_bins(trace, rows) == [HITTER * BINS // PROMPT]
    pillar = next(m for m in marks(figures.attention_landscape(trace, layer=1)) if m.name.startswith("heavy hitter"))
    assert set(np.asarray(pillar.x)) == {83.5}  # the centre of tokens 80-87
    assert "keys 80–87" in pillar.name


def test_the_sink_mark_sits_on_the_first_tokens_at_their_measured_weight(trace):
    sink = next(m for m in marks(figures.attention_landscape(trace)) if m.name.startswith("sink"))
    assert set(np.asarray(sink.x)) == {0.5}  # between tokens 0 and 1
    np.testing.assert_allclose(np.asarray(sink.z, dtype=float), 0.3 / len(SINKS), rtol=1e-6)


def test_without_a_heavy_hitter_no_pillar_is_marked():
    trace = LiveTrace(LAYERS, PROMPT, 0, BINS, len(SINKS))
    for step, first in enumerate(range(0, PROMPT, CHUNK)):
        before = held_after(first)
        pass_event = event("prefill", step, first, first + CHUNK, [p for p in before if p != HITTER])
        trace.add(pass_event)
    assert figures.heavy_hitter_bins(trace, figures.query_rows(trace)) == []


@pytest.mark.slow
def test_point_counts_stay_bounded_on_long_runs():
    long_prompt, bins = 100_000, 128
    trace = LiveTrace(1, long_prompt, 400, bins, 4)
    kept = torch.arange(64).reshape(1, 1, 64)
    for step in range(900):
        decoding = step >= 500
        first = long_prompt + step - 500 if decoding else step * 128
        end = first + (1 if decoding else 128)
        trace.add(
            Event(
                kind="decode" if decoding else "prefill",
                step=step,
                seen_tokens=end,
                kept_per_layer=[64],
                kv_bytes=1,
                kv_bytes_full=2,
                token_ids=[1] if decoding else None,
                positions=[kept],
                stats={
                    "pooled": torch.full((1, 1, bins), 1 / bins),
                    "entropy": torch.ones(1, 1, 2),
                    "sink_mass": torch.zeros(1, 1, 2),
                },
            )
        )
    surface = figures.attention_landscape(trace).data[0]
    assert np.asarray(surface.z).shape == (figures.MAX_ROWS, bins)
    assert np.asarray(figures.cache_map(trace).data[0].z).shape[1] == figures.MAX_COLUMNS
    assert np.asarray(figures.entropy_over_time(trace).data[0].z).shape[1] <= figures.MAX_ROWS
    rows = figures.query_rows(trace)
    assert rows.label[0].startswith("prefill") and rows.label[-1].startswith("decoded tokens")


def test_pooling_never_mixes_prefill_and_decode_passes():
    groups = figures._groups(["prefill"] * 10 + ["decode"] * 90, max_rows=20)
    assert len(groups) == 20
    assert all(len({index < 10 for index in group}) == 1 for group in groups)
    assert sum(len(group) for group in groups) == 100


def test_cache_map_shows_share_held_and_leaves_unread_positions_blank(trace):
    matrix, edges = figures.survival(trace, max_columns=32)
    assert matrix.shape == (LAYERS, 32)
    layer = matrix[0]
    assert layer[0] == pytest.approx(2 / 8)  # sinks 0 and 1 of tokens 0-7
    assert layer[HITTER // 8] == pytest.approx(1 / 8)
    assert layer[5] == 0.0  # read, then evicted
    assert np.all(layer[-2:] == 1.0)  # the recent window
    assert edges[0] == 0 and edges[-1] == PROMPT
    half_read = LiveTrace(LAYERS, PROMPT, 0, BINS, 2)
    half_read.add(event("prefill", 0, 0, 128, []))
    assert np.isnan(figures.survival(half_read, 32)[0][0, 16:]).all()


def test_memory_figure_labels_measured_and_computed_bytes(trace):
    figure = figures.memory_figure(trace)
    names = [series.name for series in figure.data]
    assert names[:3] == ["full cache (computed)", "reserved (measured)", "in use (measured)"]
    assert figure.layout.yaxis.title.text == "KV bytes"
    in_use = figure.data[2]
    assert list(in_use.y)[-1] == len(held_after(PROMPT)) * 1024  # raw bytes on the axis
    assert in_use.customdata[-1][0] == f"{len(held_after(PROMPT))}.0 KiB"  # binary units in the hover


def test_memory_axis_is_ticked_at_round_binary_units(trace):
    axis = figures.memory_figure(trace).layout.yaxis
    assert all(re.fullmatch(r"\d+ KiB", label) for label in axis.ticktext)  # the full cache reaches 256 KiB
    assert axis.tickvals[0] == 0 and axis.tickvals[-1] >= PROMPT * 1024
    steps = np.diff(axis.tickvals)
    assert np.all(steps == steps[0]) and steps[0] % 1024 == 0
    larger = LiveTrace(LAYERS, PROMPT, 0, BINS, 2)
    larger.memory = [MemoryPoint("prefill", 128, 3 << 20, 12 << 20, 5 << 20)]
    assert all(label.endswith(" MiB") for label in figures.memory_figure(larger).layout.yaxis.ticktext)


def test_sink_and_entropy_figures_read_the_latest_pass(trace):
    sinks = figures.sink_figure(trace)
    np.testing.assert_allclose(sinks.data[0].y, [0.3, 0.3])
    heads = figures.head_entropy(trace)
    np.testing.assert_allclose(np.asarray(heads.data[0].z), np.arange(LAYERS * HEADS).reshape(LAYERS, HEADS))
    over_time = np.asarray(figures.entropy_over_time(trace).data[0].z)
    assert over_time.shape == (LAYERS, PROMPT // CHUNK)


def test_every_figure_has_a_placeholder_before_the_first_pass():
    empty = LiveTrace(LAYERS, PROMPT, 0, BINS, 2)
    for build in (
        figures.sink_figure,
        figures.entropy_over_time,
        figures.head_entropy,
        figures.cache_map,
        figures.memory_figure,
    ):
        assert build(None).layout.annotations[0].text == figures.IDLE
        assert build(empty).layout.annotations[0].text == figures.WAITING
    assert figures.attention_landscape(None).layout.annotations[0].text == figures.IDLE
    empty.add(event("prefill", 0, 0, CHUNK, []))
    assert figures.sink_figure(empty).data  # one pass is enough for the 2D charts
    assert figures.attention_landscape(empty).layout.annotations[0].text == figures.WAITING_FOR_ROWS


def title_lines(figure) -> list[str]:
    """The lines of a figure's title as they are drawn (HTML tags other than line breaks dropped)."""
    return re.sub(r"<(?!br>)[^>]+>", "", figure.layout.title.text).split("<br>")


def every_figure(trace: LiveTrace | None) -> list:
    return [
        figures.memory_figure(trace),
        figures.sink_figure(trace),
        figures.head_entropy(trace),
        figures.attention_landscape(trace),
        figures.attention_landscape(trace, layer=LAYERS - 1),
        figures.cache_map(trace),
        figures.entropy_over_time(trace),
    ]


def test_titles_fit_a_chart_a_third_of_a_page_wide(trace):
    many_sinks = LiveTrace(LAYERS, PROMPT, 0, BINS, 16)
    for step, first in enumerate(range(0, 2 * CHUNK, CHUNK)):
        many_sinks.add(event("prefill", step, first, first + CHUNK, held_after(first)))
    for figure in every_figure(None) + every_figure(trace) + every_figure(many_sinks):
        lines = title_lines(figure)
        assert len(lines) <= TITLE_LINES and all(0 < len(line) <= TITLE_LINE_CHARACTERS for line in lines), lines


def test_the_3d_scene_axis_titles_are_short(trace):
    scene = figures.attention_landscape(trace).layout.scene
    titles = [scene.xaxis.title.text, scene.yaxis.title.text, scene.zaxis.title.text]
    assert all(0 < len(title) <= SCENE_TITLE_CHARACTERS for title in titles), titles
    assert scene.domain.x[1] - scene.domain.x[0] == 1  # the colour bar lies below the scene, not beside it
