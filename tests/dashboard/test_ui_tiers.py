"""The live page's tiers: memory by tier for a run that demotes what it evicts, what moved between the tiers, both
kept in a replay (and a replay from before runs could demote still loading), and a live run on a tiny model."""

from __future__ import annotations

import io
import json
import re

import numpy as np
import pytest
import torch
from test_pages import charts, click, open_page, widget
from tiny_models import prompt, tiny_model

from kvlab.budget import Budget
from kvlab.cache.demotion import TIERS, DemotionReport
from kvlab.dashboard import live_figures as figures
from kvlab.engine.events import Event
from kvlab.models.loading import wrap_model
from kvlab.runs.live import LivePrompt, LiveRun, LiveSettings, LiveTrace
from kvlab.runs.replay import EXAMPLES_DB, pack, unpack
from kvlab.store import open_store

LAYERS, KV_HEADS, PROMPT, CHUNK, BUDGET = 2, 2, 64, 16, 12
#: What the hand-built run holds after each chunk: the heap at its budget, the rest demoted to CPU memory until its
#: budget is full, then to the file; the GPU beside the heap holds summaries and recalled pages.
TIER_BYTES = [
    {"gpu": 0, "cpu": 0, "disk": 0},
    {"gpu": 3_000, "cpu": 20_000, "disk": 0},
    {"gpu": 3_500, "cpu": 40_000, "disk": 9_000},
    {"gpu": 4_000, "cpu": 40_000, "disk": 30_000},
]
REPORT = DemotionReport(
    gpu_bytes=4_000,
    cpu_bytes=40_000,
    disk_bytes=30_000,
    demoted_pages=52,
    to_disk_pages=7,
    dropped_pages=3,
    fetched_pages=40,
    fetched_bytes=81_920,
    pages_per_token=2.5,
    bytes_per_token=5_120.0,
    recall_seconds_per_token=0.00125,
)


def chunk_event(step: int, demoted: dict[str, int] | None) -> Event:
    """The event after reading chunk ``step``: the first sink and the latest tokens held in every layer."""
    seen = (step + 1) * CHUNK
    kept = sorted({0} | set(range(max(0, seen - BUDGET + 1), seen)))
    positions = [torch.tensor(kept).expand(1, KV_HEADS, len(kept)).clone() for _ in range(LAYERS)]
    return Event(
        kind="prefill",
        step=step,
        seen_tokens=seen,
        kept_per_layer=[len(kept)] * LAYERS,
        kv_bytes=len(kept) * 1024,
        kv_bytes_full=seen * 1024,
        positions=positions,
        demoted_bytes=demoted,
    )


def hand_built(demoting: bool) -> LiveTrace:
    trace = LiveTrace(LAYERS, PROMPT, 0, 16, 1)
    for step, held in enumerate(TIER_BYTES):
        trace.add(chunk_event(step, held if demoting else None))
    return trace


@pytest.fixture
def tiered() -> LiveTrace:
    """A run that demotes: its tiers' bytes are :data:`TIER_BYTES`."""
    return hand_built(demoting=True)


def test_the_stack_heights_are_the_bytes_of_each_tier_and_the_full_cache_is_a_line(tiered):
    figure = figures.tier_figure(tiered)
    names = [series.name for series in figure.data]
    assert names == ["GPU heap", "GPU beside heap", "CPU memory", "disk file", "full cache (computed)"]
    heap = np.asarray([point.kv_bytes for point in tiered.memory])
    tops = [np.asarray(series.y) for series in figure.data[:4]]
    np.testing.assert_array_equal(tops[0], heap)
    for below, above, tier in zip(tops, tops[1:], TIERS):
        np.testing.assert_array_equal(above - below, [held[tier] for held in TIER_BYTES])
    assert [series.fill for series in figure.data[:4]] == ["tozeroy", "tonexty", "tonexty", "tonexty"]
    full = figure.data[-1]
    assert full.fill is None and list(full.y) == [point.kv_bytes_full for point in tiered.memory]
    assert list(full.x) == [point.seen_tokens for point in tiered.memory]
    # each band's hover names its own bytes and the stack's, in binary units
    last = figure.data[3].customdata[-1]
    assert heap[-1] + 74_000 == 86_288 and (last[0], last[1]) == ("29.3 KiB", "84.3 KiB")
    ticks = figure.layout.yaxis.ticktext
    assert ticks and all(re.fullmatch(r"[\d.,]+ (B|KiB|MiB)", tick) for tick in ticks)
    assert max(figure.layout.yaxis.tickvals) >= max(tops[-1].max(), max(full.y))


def test_a_tier_that_held_nothing_is_left_out(tiered):
    cpu_only = LiveTrace(LAYERS, PROMPT, 0, 16, 1)
    for step, held in enumerate(TIER_BYTES):
        cpu_only.add(chunk_event(step, {**held, "disk": 0}))
    assert [series.name for series in figures.tier_figure(cpu_only).data] == [
        "GPU heap",
        "GPU beside heap",
        "CPU memory",
        "full cache (computed)",
    ]


def test_a_run_without_demotion_draws_no_tier():
    plain = hand_built(demoting=False)
    assert not plain.demotes
    figure = figures.tier_figure(plain)
    assert figure.data == () and figure.layout.annotations[0].text == figures.NOT_DEMOTING
    assert figures.tier_figure(None).layout.annotations[0].text == figures.IDLE
    assert figures.tier_figure(LiveTrace(LAYERS, PROMPT, 0, 16, 1)).layout.annotations[0].text == figures.WAITING


def test_the_tier_title_fits_a_third_of_the_page(tiered):
    for trace in (None, tiered):
        lines = figures.tier_figure(trace).layout.title.text.split("<br>")
        assert len(lines) <= 2 and all(0 < len(line) <= 24 for line in lines)


def test_what_moved_reads_per_token_and_in_pages():
    table = figures.demotion_table(REPORT).set_index("measure")["value"]
    assert table["pages fetched per token"] == "2.5"
    assert table["bytes fetched per token"] == "5.00 KiB"
    assert table["recall time per token"] == "1.25 ms"
    assert (table["pages demoted"], table["pages moved to disk"], table["pages dropped"]) == ("52", "7", "3")
    undecoded = DemotionReport(**{**REPORT.__dict__, "pages_per_token": None, "bytes_per_token": None})
    assert figures.demotion_table(undecoded).set_index("measure")["value"]["pages fetched per token"].startswith("—")


def test_a_replay_keeps_the_tiers_and_what_moved(tiered):
    replay = unpack(pack(tiered, [""], {"policy": "h2o"}, REPORT))
    assert replay.trace.memory == tiered.memory and replay.trace.demotes
    assert [point.demoted_bytes for point in replay.trace.memory] == TIER_BYTES
    assert replay.demotion == REPORT
    assert figures.tier_figure(replay.trace).to_dict() == figures.tier_figure(tiered).to_dict()
    scrubbed = replay.trace.at(1)  # a replay scrubbed back shows the tiers as they stood then
    assert scrubbed.memory[-1].demoted_bytes == TIER_BYTES[1]


def without_tiers(payload: bytes) -> bytes:
    """The payload as kvlab wrote it before runs could demote: no tier bytes, no report."""
    with np.load(io.BytesIO(payload)) as data:
        arrays = {name: data[name] for name in data.files if name != "demoted"}
    meta = json.loads(arrays["meta"].tobytes())
    del meta["demotion"]
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    return buffer.getvalue()


def test_a_replay_from_before_demotion_still_loads(tiered):
    old = unpack(without_tiers(pack(tiered, [""], {}, REPORT)))
    assert not old.trace.demotes and old.demotion is None
    assert [point.kv_bytes for point in old.trace.memory] == [point.kv_bytes for point in tiered.memory]
    assert figures.tier_figure(old.trace).layout.annotations[0].text == figures.NOT_DEMOTING
    with open_store(EXAMPLES_DB, read_only=True) as store:  # the shipped examples, recorded before demotion
        listed = store.replays()
        payloads = [store.replay_payload(int(row.run_id), str(row.trial_key)) for row in listed.itertuples()]
    assert payloads
    for payload in payloads:
        shipped = unpack(payload)
        assert shipped.trace.memory and not shipped.trace.demotes and shipped.demotion is None


def test_a_live_run_that_demotes_traces_its_tiers_on_a_tiny_model():
    loaded = wrap_model(tiny_model("llama"))
    ids = tuple(prompt(1, PROMPT)[0].tolist())
    live_prompt = LivePrompt(ids, (), None, "text", "tiny", "text-tiny", "live/tiny", chat=False)
    params = {"cpu_tier_mib": 1.0, "page_tokens": 4, "recall_pages": 4}
    settings = LiveSettings("h2o", params, Budget(tokens=BUDGET), chunk=CHUNK, max_new_tokens=6, n_bins=16)
    run = LiveRun(loaded, live_prompt, settings)
    events = list(run.events())
    trace = run.trace
    assert trace.demotes and all(point.demoted_bytes is not None for point in trace.memory)
    assert trace.memory[-1].demoted_bytes["cpu"] > 0 and trace.memory[-1].demoted_bytes["disk"] == 0
    assert [point.demoted_bytes for point in trace.memory] == [event.demoted_bytes for event in events]
    report = run.outcome().result.demotion
    assert report is not None and report.cpu_bytes == trace.memory[-1].demoted_bytes["cpu"]
    stack = figures.tier_figure(trace).data
    assert "CPU memory" in [series.name for series in stack]
    texts = [""] * (len(trace.token_ids) + 1)
    replay = unpack(pack(trace, texts, {}, report))
    assert replay.trace.memory == trace.memory and replay.demotion == report
    deleting = LiveRun(loaded, live_prompt, LiveSettings("h2o", {}, Budget(tokens=BUDGET), chunk=CHUNK, n_bins=16))
    list(deleting.events())
    assert not deleting.trace.demotes and deleting.outcome().result.demotion is None


@pytest.mark.model
@pytest.mark.slow
def test_the_live_page_shows_the_tiers_of_a_run_that_demotes(db):
    app = open_page("views/live.py")
    assert "Memory by tier" not in charts(app)  # a policy that deletes what it evicts: the page as before
    widget(app.selectbox, "Policy").set_value("snapkv")
    app.run()
    widget(app.number_input, "cpu_tier_mib").set_value(64.0)
    widget(app.number_input, "Context length (tokens)").set_value(256)
    widget(app.slider, "Kept fraction").set_value(0.25)  # above snapkv's window
    widget(app.number_input, "Chunk (tokens per forward pass)").set_value(128)
    widget(app.number_input, "Tokens to generate (at most)").set_value(4)
    app.run()
    assert charts(app)["Memory by tier"]["layout"]["annotations"][0]["text"] == figures.IDLE
    click(app, "Run")
    stack = charts(app)["Memory by tier"]["data"]
    assert [series["name"] for series in stack][:3] == ["GPU heap", "GPU beside heap", "CPU memory"]
    moved = app.table[0].value["value"]
    assert int(moved["pages demoted"].replace(",", "")) > 0 and moved["pages dropped"] == "0"
    stored = open_store(db).replays()
    replay = unpack(open_store(db).replay_payload(int(stored.run_id[0]), str(stored.trial_key[0])))
    assert replay.trace.demotes and replay.demotion is not None
