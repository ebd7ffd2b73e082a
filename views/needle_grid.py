"""Needle grid: the needle-in-a-haystack heatmap (context length x depth) for several policies at one budget, or their
recall on RULER's tasks with the RULER score, and the sweeps that fill them, which run on the server rather than in
the tab that started them."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from kvlab.claims import CLAIM_CONTEXT, EVIDENCE_DB
from kvlab.dashboard.chart_view import how_to_read, show_chart
from kvlab.dashboard.grid import NeedleGridRequest, depth_label, evenly_spaced_depths, grid_policies
from kvlab.dashboard.grid_estimate import grid_estimate
from kvlab.dashboard.grid_figures import NEEDLE_GUIDE, at_budget, depth_accuracy, needle_grid, needle_heatmaps
from kvlab.dashboard.inputs import (
    CACHE_OPTIONS_TITLE,
    cache_option_fields,
    longest_context,
)
from kvlab.dashboard.live_view import param_widget
from kvlab.dashboard.ruler_figures import RULER_GUIDE, ruler_bars, ruler_rows, ruler_table
from kvlab.dashboard.session import (
    allowed_model,
    current_model,
    current_user,
    open_page_store,
    page_store,
    shipped_needle_evidence,
)
from kvlab.dashboard.store_figures import FRONTIER_GUIDE, frontier_figure
from kvlab.dashboard.sweep_jobs import SWEEP_JOBS, SweepJob, SweepView, filling_job, filling_sentence, sweep_views
from kvlab.dashboard.text import plain
from kvlab.errors import KvlabError
from kvlab.models.loading import LoadedModel
from kvlab.modes import MODES, modes_help
from kvlab.policies import POLICIES
from kvlab.runs.tables import FRONTIER_AXES, METRICS, short_model_name
from kvlab.store import RunFilter, Store, SweepRecord
from kvlab.tasks.ruler import RULER_TASKS
from kvlab.tasks.ruler_score import ruler_scores

CONTEXTS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
REFRESH_S = 1.0
PANELS = 6  # heatmap panels side by side that stay readable at 1,280 pixels
NOTICES = {"info": st.info, "success": st.success, "warning": st.warning, "error": st.error}

st.title("Needle grid")
st.caption(
    "Each cell is the share of needle questions answered (the answer appears in the output) at one context "
    "length and depth; with RULER's tasks, each bar is a task's recall (the share of its expected strings the "
    "answers contain, as RULER scores) and the RULER score their mean. The grid shows what the store already "
    "holds for these settings; Run grid starts a "
    "sweep on the server that fills in the missing trials. It goes on when this tab is closed, every session "
    "sees it below, and a sweep that was stopped or cut short by a server restart resumes where it stopped."
)
loaded = current_model()
store = page_store()

ruler = (
    st.radio(
        "Task",
        ["Needle", "RULER"],
        horizontal=True,
        help="Needle questions at evenly spaced depths, or RULER's synthetic tasks generated locally (needles, "
        "variable tracking, common and frequent words), each trial one item of one task.",
    )
    == "RULER"
)
settings, contexts_column, actions = st.columns([1.4, 1.4, 1])
with settings:
    policies = st.multiselect("Policies", list(POLICIES), default=["full", "h2o", "streaming", "random"])
    keep = st.slider("Kept fraction", 0.01, 1.0, 0.1, 0.01)
    mode = st.radio("Mode", MODES, horizontal=True, help=modes_help())
with contexts_column:
    longest = longest_context(loaded)
    usable = [c for c in CONTEXTS if c <= longest]
    contexts = st.multiselect("Context lengths (tokens)", usable, default=[c for c in (512, 1024) if c in usable])
    if ruler:
        picked = st.multiselect("RULER tasks", RULER_TASKS, RULER_TASKS)
        tasks = tuple(task for task in RULER_TASKS if task in picked)
        depths = 0  # RULER's tasks draw their needles' depths themselves
        trials = int(st.number_input("Trials per task", min_value=1, max_value=500, value=5))
    else:
        tasks = ()
        depths = st.slider(
            "Needle depths (how many)",
            2,
            11,
            5,
            help="How many depths to hide the needle at, evenly spaced from the start of the text (0%) to its end "
            "(100%).",
        )
        st.caption(f"Depths: {', '.join(depth_label(depth) for depth in evenly_spaced_depths(depths))}")
        trials = int(st.number_input("Trials per cell", min_value=1, max_value=50, value=1))
    query_aware = (
        st.radio(
            "Question read",
            ["before compression", "after compression"],
            horizontal=True,
            help="Before: the policy sees the question when it compresses (query-aware, as SnapKV's window is meant "
            "to). After: the compressed cache must serve any question (query-agnostic, kvpress's default).",
        )
        == "before compression"
    )
with actions:
    batch = int(
        st.number_input(
            "Batch size",
            min_value=1,
            max_value=64,
            value=8,
            help="Prompts of one length read together in one forward pass.",
        )
    )
    run_slot = st.empty()
    estimate = st.empty()

with st.expander(CACHE_OPTIONS_TITLE):
    st.caption(
        "Applied to every chosen policy that ranks tokens (not the full cache). Prefill mode only: `hot` below 1, "
        "adakv and cake; the entropy allocation needs the model's attention profile (`kvlab profile`)."
    )
    fields = cache_option_fields()
    options: dict[str, object] = {}
    for row in range(0, len(fields), 4):
        for column, field in zip(st.columns(4), fields[row : row + 4]):
            options[field.name] = param_widget(column, field, f"grid_{field.name}")
    also_without = st.checkbox(
        "Also run each policy without these options",
        value=True,
        help="One grid then compares, say, h2o with h2o holding three quarters of its kept tokens at int4.",
        key="grid_also_without",
        persist_state="session",
    )

request = (
    None
    if loaded is None
    else NeedleGridRequest(
        loaded.name,
        grid_policies(policies, options, also_without),
        keep,
        mode,
        tuple(contexts),
        depths,
        trials,
        batch,
        tasks,
        query_aware,
    )
)

chosen_enough = bool(policies) and bool(contexts) and (bool(tasks) or not ruler)
problem: str | None = None
if loaded is not None and request is not None and chosen_enough:
    try:
        grid = request.check_runs_on(loaded)
    except KvlabError as error:
        problem = str(error)
        st.error(plain(problem))
    else:
        estimate.caption(plain(grid_estimate(request, grid, loaded, store)))
runnable = loaded is not None and chosen_enough and problem is None
run = run_slot.button("Run grid", type="primary", disabled=not runnable, icon=":material/play_arrow:")

notice = st.empty()
if run and loaded is not None and request is not None:
    store = page_store(write=True, slot=notice)
    try:
        if store is not None:
            job = SWEEP_JOBS.start(request, loaded, store, current_user())
            notice.info(
                f"Sweep {job.sweep_id} runs on the server: it goes on if this tab is closed, and its "
                "progress is shown below.",
                icon=":material/cloud_sync:",
            )
    except KvlabError as error:
        notice.error(plain(str(error)))


def resume(record: SweepRecord, sweep_store: Store) -> None:
    """Start a stored sweep again on its own model (if this server still allows it), by whoever resumes it."""
    request = NeedleGridRequest.from_spec(record.spec)
    with st.spinner(f"Loading {plain(request.model)}…"):
        SWEEP_JOBS.start(
            request, allowed_model(request.model), open_page_store(sweep_store.path, write=True), current_user()
        )


def draw_sweep(view: SweepView, record: SweepRecord, sweep_store: Store) -> None:
    """One sweep: what it is, where it stands, and its Stop or Resume button."""
    with st.container(border=True):
        text, button = st.columns([6, 1], vertical_alignment="center")
        text.markdown(plain(view.title))
        with text:
            if view.level == "progress":
                st.progress(view.fraction, text=plain(view.sentence))
            else:
                NOTICES[view.level](plain(view.sentence))
        if view.can_stop:
            button.button(
                "Stop",
                key=f"stop-sweep-{view.sweep_id}",
                icon=":material/stop:",
                on_click=SWEEP_JOBS.jobs(sweep_store.path)[view.sweep_id].stop,
            )
        if view.can_resume and button.button("Resume", key=f"resume-sweep-{view.sweep_id}", icon=":material/resume:"):
            try:
                resume(record, sweep_store)
            except KvlabError as error:
                text.error(plain(str(error)))
            else:
                st.rerun()


def sweeps_panel(sweep_store: Store) -> None:
    """The server's sweeps, redrawn every second while one waits or runs; the whole page is redrawn (heatmap
    included) when the last of them ends."""
    active = any(job.active for job in SWEEP_JOBS.jobs(sweep_store.path).values())

    @st.fragment(run_every=REFRESH_S if active else None)
    def panel() -> None:
        records = sweep_store.sweeps()
        jobs = SWEEP_JOBS.jobs(sweep_store.path)
        if active and not any(job.active for job in jobs.values()):
            st.rerun()
        views = sweep_views(records, jobs)
        if views:
            st.subheader("Sweeps")
        by_id = {record.sweep_id: record for record in records}
        for view in views:
            draw_sweep(view, by_id[view.sweep_id], sweep_store)

    panel()


if store is not None:
    sweeps_panel(store)


def results_panel(heatmap_store: Store | None, model: LoadedModel, grid_request: NeedleGridRequest) -> None:
    """The stored trials of these settings as heatmaps (or RULER's table), redrawn from the store every second
    while a sweep of this server fills them (it stores them batch by batch), with what that sweep is doing."""
    jobs = {} if heatmap_store is None else SWEEP_JOBS.jobs(heatmap_store.path)
    filling = filling_job(jobs, grid_request)

    @st.fragment(run_every=REFRESH_S if filling is not None else None)
    def panel() -> None:
        draw = draw_ruler if grid_request.tasks else draw_heatmap
        draw(heatmap_store, model, grid_request, filling)

    panel()


def stored_runs(
    runs_store: Store | None, model: LoadedModel, grid_request: NeedleGridRequest, filling: SweepJob | None
) -> tuple[Store, pd.DataFrame] | None:
    """The stored runs of these settings at the chosen budget (the full cache's too), once some hold trials;
    before that, None and the sentence that says why (a sweep filling them, or how to start one)."""
    runs = (
        None
        if runs_store is None
        else runs_store.list_runs(
            RunFilter(
                models=(model.source.label,),
                policies=grid_request.policy_names(),
                modes=(grid_request.mode,),
                tasks=(grid_request.grid().task,),
                context_lengths=grid_request.contexts,
            )
        )
    )
    chosen = None if runs is None else at_budget(grid_request.own_runs(runs), grid_request.keep)
    held = runs_store is not None and chosen is not None and int(chosen["trials"].sum()) > 0
    sentence = filling_sentence(
        filling if filling is not None and filling.active else None, held, bool(grid_request.tasks)
    )
    if sentence is not None:
        st.info(plain(sentence), icon=":material/hourglass_top:" if filling is not None else None)
    return (runs_store, chosen) if held and runs_store is not None and chosen is not None else None


def shipped_needle_accuracy(model: LoadedModel) -> None:
    """Until the store holds trials of the settings above: the needle accuracy the shipped GPU sweep measured for
    the loaded model (or the first shipped one), labelled as shipped runs."""
    if not EVIDENCE_DB.is_file():
        return
    evidence = shipped_needle_evidence(EVIDENCE_DB)
    if not evidence.models:
        return
    name = model.source.label if model.source.label in evidence.models else evidence.models[0]
    st.subheader(f"Shipped runs: {short_model_name(name)} at {CLAIM_CONTEXT:,} tokens")
    st.caption(
        f"Measured on {plain(', '.join(evidence.devices) or 'an unrecorded device')} by `bench/claims_evidence.sh` "
        "(every policy, both modes, random depths; `kvlab/data/runs/claims.duckdb`), shown until this dashboard's "
        "store holds trials of the settings above."
    )
    how_to_read(st.container(), FRONTIER_GUIDE, key="needle-shipped-guide")
    figure = frontier_figure(
        evidence.frontiers[name], FRONTIER_AXES["keep"], bytes_axis=False, metric=METRICS["accuracy"]
    )
    show_chart(st.container(), figure, key="needle-shipped", filename="kvlab-shipped-needle-accuracy")


def draw_heatmap(
    heatmap_store: Store | None, model: LoadedModel, grid_request: NeedleGridRequest, filling: SweepJob | None
) -> None:
    """The heatmaps of what the store holds now for these settings, or why there are none yet (and the shipped
    runs' needle accuracy meanwhile)."""
    found = stored_runs(heatmap_store, model, grid_request, filling)
    if found is None:
        shipped_needle_accuracy(model)
        return
    heatmap_store, chosen = found
    depths = evenly_spaced_depths(grid_request.depths)
    trials = heatmap_store.trials_frame(RunFilter(run_ids=tuple(int(run_id) for run_id in chosen["run_id"])))
    cells = needle_grid(depth_accuracy(trials), chosen, depths=depths)
    how_to_read(st.container(), NEEDLE_GUIDE, key="needle-heatmaps-guide")
    show_chart(st.container(), needle_heatmaps(cells, PANELS), key="needle-heatmaps", filename="needle-grid")
    labels = cells["label"].nunique()
    if labels > PANELS:
        st.caption(
            f"The heatmap shows {PANELS} of its {labels} panels (the first in alphabetical order); choose fewer "
            "policies, or clear Also run each policy without these options, to see the others."
        )
    st.caption(
        f"{len(trials)} stored trials of {int((chosen['trials'] > 0).sum())} runs on {plain(model.source.label)}. "
        "Each column is one of the depths asked for: a trial counts at the depth it asked for (its needle sits at a "
        "sentence boundary near it), and a trial stored for these settings by a grid of other depths counts at the "
        "nearest column."
    )


def draw_ruler(
    ruler_store: Store | None, model: LoadedModel, grid_request: NeedleGridRequest, filling: SweepJob | None
) -> None:
    """Each stored run's recall per RULER task and its RULER score, with 95 % intervals, or why there are none."""
    found = stored_runs(ruler_store, model, grid_request, filling)
    if found is None:
        return
    ruler_store, chosen = found
    trials = ruler_store.trials_frame(RunFilter(run_ids=tuple(int(run_id) for run_id in chosen["run_id"])))
    rows = ruler_rows(chosen, ruler_scores(trials))
    how_to_read(st.container(), RULER_GUIDE, key="ruler-bars-guide")
    show_chart(st.container(), ruler_bars(rows), key="ruler-bars", filename="ruler-grid")
    st.dataframe(ruler_table(rows), hide_index=True)
    st.caption(
        f"{len(trials)} stored trials of {int((chosen['trials'] > 0).sum())} runs on {plain(model.source.label)}. "
        "A task's recall is RULER's: the share of its expected strings an answer contains, ignoring case, averaged "
        "over its items; the RULER score is the mean over the tasks. 95% intervals: Wilson's where every recall "
        "is 0 or 1, else a seeded bootstrap over items."
    )


if not chosen_enough:
    st.info("Choose at least one policy and one context length" + (", and one RULER task." if ruler else "."))
elif loaded is None or request is None:
    st.info(f"Load a model in the sidebar to see its stored {'RULER' if ruler else 'needle'} trials.")
elif problem is None:
    results_panel(store, loaded, request)
