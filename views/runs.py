"""Runs: every stored run, filtered and downloaded as CSV or Parquet, compared side by side, and the comparison
downloaded as a self-contained HTML report."""

from __future__ import annotations

from functools import partial

import streamlit as st

from kvlab.dashboard.chart_view import how_to_read, show_chart
from kvlab.dashboard.downloads import MIME_TYPES, export_bytes, report_file
from kvlab.dashboard.report import runs_report
from kvlab.dashboard.session import browsed_store, shown_store
from kvlab.dashboard.store_reads import read_frame, read_shares
from kvlab.dashboard.text import plain, plain_frame
from kvlab.runs.tables import (
    METRICS,
    choices,
    compare_runs,
    measured_metrics,
    runs_table,
    short_model_name,
    with_shares,
)
from kvlab.store import RunFilter, default_db_path

st.title("Runs")
store = browsed_store()
everything = read_frame(store, "list_runs") if store is not None else None
if everything is None or everything.empty:
    st.info(
        f"No runs are stored in {plain(shown_store(default_db_path()))} yet. Run a live run or a needle grid, or point "
        "KVLAB_DB at a database that has some."
    )
    st.stop()
assert store is not None

filters = st.columns(4)
models = filters[0].multiselect("Model", choices(everything, "model"), format_func=short_model_name)
policies = filters[1].multiselect("Policy", choices(everything, "policy"))
modes = filters[2].multiselect("Mode", choices(everything, "mode"))
tasks = filters[3].multiselect("Task", choices(everything, "task"))
selection = RunFilter(models=tuple(models), policies=tuple(policies), modes=tuple(modes), tasks=tuple(tasks))
runs = read_frame(store, "list_runs", selection)
selected_trials = read_frame(store, "trials_frame", selection)
st.dataframe(
    runs_table(with_shares(runs, read_shares(store, selection))),
    hide_index=True,
    key="runs-table",
    column_config={
        name: st.column_config.ProgressColumn(name, min_value=0, max_value=100, format="%.0f%%")
        for name in ("accuracy %", "recall %")
    },
)
st.caption(
    f"{len(runs)} of {len(everything)} runs. Accuracy: the answer appears in the output; exact: it is the "
    "output's first line; recall: RULER's share of the expected strings found. Each 95% CI is Wilson's for "
    "right-or-wrong answers and a seeded percentile bootstrap for recalls that are fractions: with 100 trials near "
    "50% it spans about 20 points, so runs whose intervals overlap may not differ. Tie share: the share of eviction "
    "cuts where the best evicted token scored the same as the worst kept one, so that position, not score, decided "
    "(— where the run did not record it). Perplexity and KL (from the full cache, nats per token): passes over a "
    "held-out text (`kvlab quality`), which answer nothing."
)

st.subheader("Download")
st.caption(
    f"The runs the filters show ({len(runs)}, whatever is picked for comparison below) and their "
    f"{int(runs['trials'].sum())} trials: one row per run, or one row per trial with its run's columns, as "
    "`python -m kvlab export` writes them."
)
buttons = st.columns(4)
for column, (table, suffix) in zip(
    buttons, [("runs", ".csv"), ("runs", ".parquet"), ("trials", ".csv"), ("trials", ".parquet")]
):
    column.download_button(
        f"{table.capitalize()} ({'CSV' if suffix == '.csv' else 'Parquet'})",
        data=partial(export_bytes, store, table, suffix, selection),
        file_name=f"kvlab-{table}{suffix}",
        mime=MIME_TYPES[suffix],
        on_click="ignore",
        icon=":material/download:",
        key=f"download-{table}{suffix}",
    )

st.subheader("Compare")
ids = runs["run_id"].tolist()
picked = st.multiselect("Runs to compare", ids, default=ids[-2:], format_func=lambda i: f"run {i}")
if picked:
    chosen = runs[runs["run_id"].isin(picked)]
    trials = selected_trials[selected_trials["run_id"].isin(picked)]
    st.table(plain_frame(compare_runs(chosen, trials)))
    measures = measured_metrics(chosen, trials)
    metric = (
        st.radio("Quality", measures, format_func=lambda name: METRICS[name].title, horizontal=True)
        if measures
        else "accuracy"
    )
    report = runs_report(chosen, trials, metric)
    for shown in report.tables[1:]:  # the first, the compared runs, is shown above the choice of quality
        st.markdown(f"**{plain(shown.title)}**")
        st.caption(plain(shown.note))
        st.dataframe(shown.frame, hide_index=not shown.index)
    for column, figure in zip(st.columns(len(report.figures)), report.figures):
        column.markdown(f"**{plain(figure.title)}**")
        how_to_read(column, figure.guide, key=f"guide-{figure.filename}")
        show_chart(column, figure.figure, key=f"chart-{figure.filename}", filename=figure.filename)
    st.download_button(
        "Report (HTML)",
        data=partial(report_file, lambda: report),
        file_name=f"kvlab-runs-{'-'.join(str(run_id) for run_id in picked)}.html",
        mime=MIME_TYPES[".html"],
        on_click="ignore",
        icon=":material/download:",
        key="download-report",
        help="The compared runs' table and charts, each with its guide, as one HTML file that opens offline.",
    )
