"""Needle grid: the needle-in-a-haystack heatmap (context length x depth) for several policies at one budget."""

from __future__ import annotations

import streamlit as st

from kvlab.errors import KvlabError
from kvlab.policies import POLICIES
from kvlab.store import RunFilter
from kvlab.ui.grid import needle_grid_spec, run_needle_grid
from kvlab.ui.session import current_model, device_turn, model_name, page_setup, run_store, user_name
from kvlab.ui.store_figures import needle_heatmaps
from kvlab.ui.tables import at_budget, needle_grid, short_model_name

CONTEXTS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)

page_setup()
st.title("Needle grid")
st.caption("Each cell is the share of needle questions answered (the answer appears in the output) at one context "
           "length and depth. The grid shows what the store already holds for these settings; Run fills in the "
           "trials that are missing, and a stopped grid resumes where it stopped.")
loaded = current_model()
store = run_store()

settings, contexts_column, actions = st.columns([1.4, 1.4, 1])
with settings:
    policies = st.multiselect("Policies", list(POLICIES), default=["full", "h2o", "streaming", "random"])
    keep = st.slider("Kept fraction", 0.01, 1.0, 0.1, 0.01)
    mode = st.radio("Mode", ["prefill", "streaming"], horizontal=True)
with contexts_column:
    longest = int(getattr(loaded.model.config, "max_position_embeddings", 4096) if loaded else 4096)
    usable = [c for c in CONTEXTS if c <= longest]
    contexts = st.multiselect("Context lengths (tokens)", usable, default=[c for c in (512, 1024) if c in usable])
    depths = st.slider("Depths from 0 to 1", 2, 11, 5)
    trials = int(st.number_input("Trials per cell", min_value=1, max_value=50, value=1))
with actions:
    batch = int(st.number_input("Batch size", min_value=1, max_value=64, value=8,
                                help="Prompts of one length read together in one forward pass."))
    runnable = loaded is not None and store is not None and bool(policies) and bool(contexts)
    run = st.button("Run grid", type="primary", disabled=not runnable, icon=":material/play_arrow:")
    stop = st.button("Stop grid", icon=":material/stop:")

notice = st.empty()
if stop:
    notice.info("Stopped. Finished trials are stored; press Run grid to resume where it stopped.")
if run and loaded is not None and store is not None:
    bar = st.progress(0.0, text="Starting…")
    try:
        grid = needle_grid_spec(policies, keep, mode, contexts, depths, trials, batch)
        with device_turn(f"needle grid of {len(grid.cells()) * len(contexts)} runs", notice) as ticket:
            def report(done: int, total: int, label: str) -> None:
                ticket.progress = done / max(total, 1)
                bar.progress(ticket.progress, text=f"{done} of {total} trials · {label}")

            summary = run_needle_grid(loaded, store, grid, report, user_name())
        notice.success(f"Ran {summary.ran} trials; {summary.skipped} were already stored.")
    except KvlabError as error:
        notice.error(str(error))

if not policies or not contexts:
    st.info("Choose at least one policy and one context length.")
elif store is not None:
    runs = store.list_runs(RunFilter(models=(model_name(),), policies=tuple(policies), modes=(mode,),
                                     tasks=("needle",), context_lengths=tuple(contexts)))
    chosen = at_budget(runs, keep)
    if chosen.empty:
        st.info("No stored needle trials for these settings yet: press Run grid to measure them.")
    else:
        cells = needle_grid(store.accuracy_by_depth(RunFilter(run_ids=tuple(chosen["run_id"]))), chosen)
        st.plotly_chart(needle_heatmaps(cells), key="needle-heatmaps")
        st.caption(f"{int(chosen['trials'].sum())} stored trials of {len(chosen)} runs on "
                   f"{short_model_name(model_name())}; depths are where the needle really sits, rounded to tenths.")
