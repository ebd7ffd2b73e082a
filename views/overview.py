"""Overview: what kvlab found, at first sight and without a model: the needle frontier and the published claim beside
kvlab's measurement, and a live run replayed with its cache, its memory and its attention sinks, all from the
example runs shipped in ``kvlab/data/runs/``, measured on a GPU."""

from __future__ import annotations

import streamlit as st

from kvlab.claims import CLAIM_CONTEXT, EVIDENCE_DB
from kvlab.dashboard import live_figures as figures
from kvlab.dashboard.chart_view import how_to_read, show_chart
from kvlab.dashboard.live_view import show_output
from kvlab.dashboard.navigation import overview_opening
from kvlab.dashboard.playback import PLAY_STEP_S, play_button, scrubber
from kvlab.dashboard.session import open_page_store, shipped_needle_evidence, stored_replay
from kvlab.dashboard.store_figures import FRONTIER_GUIDE, frontier_figure
from kvlab.dashboard.text import plain
from kvlab.models.catalog import shipped_models
from kvlab.runs.replay import EXAMPLES_DB, EXAMPLES_LABEL, replay_choices, showcase
from kvlab.runs.tables import FRONTIER_AXES, METRICS, short_model_name

st.title("Overview")
st.markdown(overview_opening())
if not EVIDENCE_DB.is_file() or not EXAMPLES_DB.is_file():
    st.info("This installation has no shipped example runs (kvlab/data/runs/); open Live run to make some.")
    st.stop()

with open_page_store(EXAMPLES_DB) as examples:
    listed = examples.replays()
    shipped_replays = replay_choices(listed)
first_replay = showcase(listed, without_sinks={entry.label for entry in shipped_models()})
evidence = shipped_needle_evidence(EVIDENCE_DB)
st.caption(
    "Below: runs shipped with kvlab (`kvlab/data/runs/claims.duckdb` and `kvlab/data/runs/examples.duckdb`), "
    f"measured on {plain(', '.join(evidence.devices) or 'an unrecorded device')} with the commands in "
    "`bench/claims_evidence.sh` and `bench/example_replays.sh`."
)
replayed = listed["model"].iloc[first_replay] if len(listed) else None  # the replay's model, shown first
model = st.radio(
    "Model",
    evidence.models,
    index=evidence.models.index(replayed) if replayed in evidence.models else 0,
    horizontal=True,
    format_func=short_model_name,
    key="overview-model",
)
points, claim = evidence.frontiers[model], evidence.claims[model]

frontier_column, claim_column = st.columns([1, 1])
with frontier_column:
    st.subheader(f"Needle accuracy at {CLAIM_CONTEXT:,} tokens")
    how_to_read(frontier_column, FRONTIER_GUIDE, key="overview-frontier-guide")
    show_chart(
        frontier_column,
        frontier_figure(points, FRONTIER_AXES["keep"], bytes_axis=False, metric=METRICS["accuracy"]),
        "overview-frontier",
        "kvlab-needle-frontier",
    )
with claim_column:
    st.subheader("The published claim, beside kvlab's figure")
    st.caption(
        "An article reports H2O at 100 % up to 90 % pruning, StreamingLLM at 14 % and random eviction at 5 % on a "
        f"{CLAIM_CONTEXT:,}-token needle test. Each article row is followed by kvlab's measurement of the same "
        "pruning ratios (accuracy in %, with the 95 % Wilson interval and the fewest trials behind a cell)."
    )
    pruned = [column for column in claim.columns if column.endswith("pruned")]
    st.dataframe(
        claim.style.format("{:.0f} %", subset=pruned, na_rep="—").format(
            "{:.0f}", subset=["trials per cell"], na_rep="—"
        ),
        key="overview-claim",
    )

st.subheader("A live run, replayed")
if not shipped_replays:
    st.info("No replay is shipped; open Live run to record one.")
    st.stop()
picked = st.selectbox(
    "Run",
    list(shipped_replays),
    index=first_replay,
    format_func=lambda key: shipped_replays[key],
    key="overview-replay",
    label_visibility="collapsed",
)
replay = stored_replay(EXAMPLES_DB, *picked)
replay_key = f"overview-replay-{picked}"
playing = play_button(st.container(), replay.positions, replay_key)


@st.fragment(run_every=PLAY_STEP_S if playing else None)
def replay_view() -> None:
    """The replay at the scrubber's step: what the run wrote so far and its memory, cache map and sinks."""
    position = scrubber(
        st.container(),
        replay.positions,
        replay_key,
        "Tokens read and generated",
        "Move it to see the run as it stood after that many tokens: every prefill chunk, compression and "
        "generated token is a step.",
    )
    trace, text = replay.at(position)
    st.caption(plain(f"{replay.headline}: {replay.where_from}. Output so far:"))
    show_output(st.container(), text or "…")
    charts = st.columns(3)
    for column, (name, build, filename) in zip(
        charts,
        (
            ("memory", figures.memory_figure, "kvlab-kv-bytes"),
            ("cache", figures.cache_map, "kvlab-cache-map"),
            ("sinks", figures.sink_figure, "kvlab-sinks"),
        ),
    ):
        how_to_read(column, figures.GUIDES[name], key=f"overview-guide-{name}")
        show_chart(column, build(trace), f"overview-{name}", filename)


replay_view()
if st.button("Replay it with every chart, or two runs side by side", icon=":material/replay:"):
    st.session_state["live_source"] = "Replay stored runs"
    st.session_state["live_replay_store"] = EXAMPLES_LABEL
    st.switch_page("views/live.py")
