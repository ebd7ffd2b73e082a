"""Frontier: quality (accuracy, or a text's perplexity and KL) against memory from stored runs, one line per policy
and mode, each share with its 95 % interval, one selection or two side by side, two of their points compared by a
paired test, downloadable as a self-contained HTML report."""

from __future__ import annotations

from functools import partial

import pandas as pd
import streamlit as st

from kvlab.claims import CLAIM_CONTEXT, side_by_side
from kvlab.claims.needle import article_rows_left_out
from kvlab.dashboard.chart_view import how_to_read, show_chart
from kvlab.dashboard.downloads import MIME_TYPES, report_file
from kvlab.dashboard.report import PAIRED_TITLE, Selection, frontier_report, paired_note
from kvlab.dashboard.session import browsed_store
from kvlab.dashboard.store_figures import FRONTIER_GUIDE
from kvlab.dashboard.store_reads import read_frame, read_frontier
from kvlab.dashboard.text import plain, plain_frame
from kvlab.runs.tables import (
    FRONTIER_AXES,
    METRICS,
    SHARE_COLUMNS,
    choices,
    claim_table_text,
    frontier_table,
    measured_metrics,
    most_runs,
    paired_test,
    point_trials,
    short_model_name,
)
from kvlab.store import RunFilter

st.title("Frontier")
st.caption(
    "Quality against memory for every policy and mode in the store: the accuracy of needle and task runs, or a "
    "held-out text's perplexity and KL from the full cache (`kvlab quality`; lower is better for both). Bytes are "
    "measured from each trial's cache tensors; whiskers are 95 % intervals and circled points the Pareto front "
    "(*How to read this* says more)."
)
store = browsed_store()
runs = read_frame(store, "list_runs") if store is not None else None
if runs is None or runs.empty or not runs["trials"].any():
    st.info(
        "The store has no runs with trials yet. Run a live run or a needle grid, or point KVLAB_DB at a "
        "database that has some."
    )
    st.stop()
assert store is not None

axis_column, metric_column, switch_column = st.columns([2, 2, 1], vertical_alignment="bottom")
axis = axis_column.selectbox("Memory axis", list(FRONTIER_AXES), format_func=FRONTIER_AXES.__getitem__)
metric = metric_column.selectbox(
    "Quality", measured_metrics(runs) or list(METRICS), format_func=lambda name: METRICS[name].title
)
# One selection at first: the page opens on its frontier sooner (a second one, its controls and its 30-odd lines,
# kept the first chart of a new tab waiting about a third of a second on a 2-core machine).
with_b = switch_column.toggle(
    "Selection B",
    key="frontier-second",
    help="A second selection beside the first (another model, task or context length), to compare them side by side "
    "and in the paired test and the report.",
)

selections: list[Selection] = []
run_filters: list[RunFilter] = []
selection_trials: list[pd.DataFrame] = []
shown_selections = ("A", "B") if with_b else ("A",)
for column, name in zip(st.columns(len(shown_selections)), shown_selections):
    with column:
        heading, guide = st.columns([3, 2], vertical_alignment="bottom")
        heading.subheader(f"Selection {name}")
        how_to_read(guide, FRONTIER_GUIDE, key=f"frontier-guide-{name}")
        models = choices(runs, "model")
        model = st.selectbox("Model", models, format_func=short_model_name, key=f"frontier-model-{name}")
        task_column, length_column = st.columns(2)
        task = task_column.selectbox("Task", choices(runs, "task", model=model), key=f"frontier-task-{name}")
        lengths = choices(runs, "context_length", model=model, task=task)
        ranked = most_runs(runs, "context_length", model=model, task=task)
        preferred = ranked[min(len(ranked) - 1, 1 if name == "B" else 0)] if ranked else None
        length = length_column.selectbox(
            "Context length (tokens)",
            lengths,
            key=f"frontier-length-{name}",
            index=lengths.index(preferred) if lengths else None,
        )
        context_length = None if length is None else int(length)
        run_filter = RunFilter(
            models=(model,), tasks=(task,), context_lengths=() if context_length is None else (context_length,)
        )
        points, figure = read_frontier(store, run_filter, axis, metric)
        show_chart(
            column,
            figure,
            key=f"frontier-{name}",
            filename=f"kvlab-frontier-{name}",
        )
        st.dataframe(
            frontier_table(points, axis, metric),
            hide_index=True,
            key=f"frontier-table-{name}",
            column_config={"run": st.column_config.TextColumn("run", width="medium")},
        )
        selections.append(Selection(name, model, task, context_length, points))
        run_filters.append(run_filter)
        selection_trials.append(read_frame(store, "trials_frame", run_filter))

covered = pd.concat([read_frame(store, "list_runs", run_filter) for run_filter in run_filters]).drop_duplicates(
    "run_id"
)
covered_trials = pd.concat(selection_trials).drop_duplicates(["run_id", "trial_key"])

if metric in SHARE_COLUMNS:
    st.subheader("Two points, paired")
    st.caption(
        f"{PAIRED_TITLE}: two points of one sweep answered the same items. {plain(paired_note(metric))} Runs pooled "
        "into one point count an item they answered alike once, and leave out an item they answered differently."
    )
    candidates = {
        f"{selection.name}: {point.label}": (point, trials)
        for selection, trials in zip(selections, selection_trials)
        for point in selection.points.itertuples(index=False)
    }
    if len(candidates) < 2:
        st.info("The selections have fewer than two points to compare.")
    else:
        names = list(candidates)
        first_column, second_column = st.columns(2)
        first = first_column.selectbox("Point A", names, index=0, key="paired-a")
        second = second_column.selectbox("Point B", names, index=1, key="paired-b")
        (point_a, trials_a), (point_b, trials_b) = candidates[first], candidates[second]
        row = paired_test(point_trials(trials_a, point_a), point_trials(trials_b, point_b), first, second, metric)
        st.table(plain_frame(pd.DataFrame({"paired test": row})))

st.download_button(
    "Report (HTML)",
    data=partial(report_file, frontier_report, selections, axis, metric, covered.sort_values("run_id"), covered_trials),
    file_name="kvlab-frontier.html",
    mime=MIME_TYPES[".html"],
    on_click="ignore",
    icon=":material/download:",
    key="download-frontier-report",
    help="The selections' charts, their points and the runs behind them, each chart with its guide, as one HTML "
    "file that opens offline.",
)

model_a = selections[0].model
st.subheader("The published needle claim, next to kvlab's measurement")
st.caption(
    "An article claims that on a 4,096-token needle test H2O keeps 100 % accuracy up to 90 % pruning while "
    "StreamingLLM falls to 14 % and random eviction to 5 %. Its rows are shown only beside kvlab's own "
    f"measurement of the same policy on {plain(short_model_name(model_a))} (selection A's model), with the fewest "
    "trials behind any cell of each row."
)
lengths = choices(runs, "context_length", model=model_a, task="needle")
if not lengths:
    st.info("Selection A's model has no stored needle runs.")
else:
    preferred = (
        CLAIM_CONTEXT
        if CLAIM_CONTEXT in lengths
        else most_runs(runs, "context_length", model=model_a, task="needle")[0]
    )
    length = st.selectbox("Context length of kvlab's rows", lengths, key="claim-length", index=lengths.index(preferred))
    table = side_by_side(
        read_frame(store, "trials_frame", RunFilter(models=(model_a,), tasks=("needle",))), int(length)
    )
    left_out = article_rows_left_out(table)
    if table.empty:
        st.info(
            f"Selection A's model has no needle runs with a kept fraction at the article's pruning ratios at "
            f"{int(length):,} tokens, so the article's table is not shown."
        )
    else:
        st.dataframe(claim_table_text(table), key="claim-table")
    if left_out and not table.empty:
        st.caption(
            f"Left out: the article's rows for {', '.join(left_out)}, which kvlab has not measured on this model at "
            f"{int(length):,} tokens (no run of them with a kept fraction at the article's pruning ratios)."
        )
