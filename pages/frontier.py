"""Frontier: quality (accuracy, or a text's perplexity and KL) against memory from stored runs, one line per policy
and mode, two selections side by side."""

from __future__ import annotations

import streamlit as st

from kvlab.claims import CLAIM_CONTEXT, side_by_side
from kvlab.store import RunFilter
from kvlab.ui.session import page_setup, reading_store
from kvlab.ui.store_figures import frontier_figure
from kvlab.ui.tables import FRONTIER_AXES, METRICS, choices, frontier_points, most_runs, short_model_name
from kvlab.ui.text import plain

page_setup()
st.title("Frontier")
st.caption(
    "Quality against memory for every policy and mode in the store: the accuracy of needle and task runs, or the "
    "perplexity of a held-out text and the KL divergence of each next-token distribution from the full cache's "
    "(`kvlab quality`; lower is better for both). Circled points are on the Pareto front: no other point is at "
    "least as good with less memory. KV bytes are measured from the cache tensors of each trial (per sequence) "
    "and averaged."
)
store = reading_store()
runs = store.list_runs() if store is not None else None
if runs is None or runs.empty or not runs["trials"].any():
    st.info(
        "The store has no runs with trials yet. Run a live run or a needle grid, or point KVLAB_DB at a "
        "database that has some."
    )
    st.stop()
assert store is not None

axis_column, metric_column = st.columns(2)
axis = axis_column.radio("Memory axis", list(FRONTIER_AXES), format_func=FRONTIER_AXES.get, horizontal=True)
metric = metric_column.radio("Quality", list(METRICS), format_func=lambda name: METRICS[name].title, horizontal=True)

selections = {}
for column, name in zip(st.columns(2), ("A", "B")):
    with column:
        st.subheader(f"Selection {name}")
        models = choices(runs, "model")
        model = st.selectbox("Model", models, format_func=short_model_name, key=f"frontier-model-{name}")
        task = st.selectbox("Task", choices(runs, "task", model=model), key=f"frontier-task-{name}")
        lengths = choices(runs, "context_length", model=model, task=task)
        ranked = most_runs(runs, "context_length", model=model, task=task)
        preferred = ranked[min(len(ranked) - 1, 1 if name == "B" else 0)] if ranked else None
        length = st.selectbox(
            "Context length (tokens)",
            lengths,
            key=f"frontier-length-{name}",
            index=lengths.index(preferred) if lengths else None,
        )
        points = frontier_points(
            store.accuracy_frontier(
                RunFilter(models=(model,), tasks=(task,), context_lengths=() if length is None else (int(length),))
            ),
            axis,
            metric,
        )
        st.plotly_chart(
            frontier_figure(points, FRONTIER_AXES[axis], bytes_axis=axis != "keep", metric=METRICS[metric]),
            key=f"frontier-{name}",
        )
        st.dataframe(
            points[["label", "x", "y", "trials"]],
            hide_index=True,
            key=f"frontier-table-{name}",
            column_config={
                "label": st.column_config.TextColumn("run", width="medium"),
                "x": st.column_config.NumberColumn(
                    FRONTIER_AXES[axis] + ("" if axis == "keep" else " (bytes)"), format="%.4g"
                ),
                "y": st.column_config.NumberColumn(
                    METRICS[metric].title, format="%.0f" if METRICS[metric].percent else "%.4g"
                ),
            },
        )
        selections[name] = model

st.subheader("The published needle claim, next to kvlab's measurement")
st.caption(
    "An article claims that on a 4,096-token needle test H2O keeps 100 % accuracy up to 90 % pruning while "
    "StreamingLLM falls to 14 % and random eviction to 5 %. Its rows are shown only beside kvlab's own "
    f"measurement of the same grid on {plain(short_model_name(selections['A']))} (selection A's model), with the "
    "fewest "
    "trials behind any cell of each row."
)
lengths = choices(runs, "context_length", model=selections["A"], task="needle")
if not lengths:
    st.info("Selection A's model has no stored needle runs.")
else:
    preferred = (
        CLAIM_CONTEXT
        if CLAIM_CONTEXT in lengths
        else most_runs(runs, "context_length", model=selections["A"], task="needle")[0]
    )
    length = st.selectbox("Context length of kvlab's rows", lengths, key="claim-length", index=lengths.index(preferred))
    table = side_by_side(store.trials_frame(RunFilter(models=(selections["A"],), tasks=("needle",))), int(length))
    pruned = [c for c in table.columns if c.endswith("pruned")]
    st.dataframe(
        table.style.format("{:.0f} %", subset=pruned, na_rep="—").format(
            "{:.0f}", subset=["trials per cell"], na_rep="—"
        ),
        key="claim-table",
    )
