"""Advisor: the cheapest stored eviction configurations that keep an accuracy floor, priced for a model on a GPU."""

from __future__ import annotations

from functools import partial

import streamlit as st

from kvlab.costs import GPU_PRESETS, MODEL_PRESETS, MOST_GPUS
from kvlab.dashboard.advice_figures import ADVICE_GUIDE, advice_figure
from kvlab.dashboard.advice_view import stored_advice
from kvlab.dashboard.chart_view import how_to_read, show_chart
from kvlab.dashboard.downloads import MIME_TYPES, report_file
from kvlab.dashboard.report import advice_report
from kvlab.dashboard.text import plain
from kvlab.errors import KvlabError
from kvlab.runs.advisor import (
    AdviceRequest,
    advice_title,
    evidence_sentence,
    shown_advice,
)
from kvlab.runs.benchmarks import BENCHMARKS, SHIPPED_EVIDENCE
from kvlab.store import default_db_path, has_database

st.title("Advisor")
st.caption(
    "The cheapest stored configurations (policy, parameters, budget, layout, precision tier) whose accuracy stays "
    "above a floor relative to the full cache, with their 95% intervals and McNemar's test against the full cache. "
    "Accuracy and bytes are measured on a stored model; the chosen model's bytes, decode times and prices are "
    "computed by the cost model unless a GPU benchmark measured them, and the decode source column says which."
)
model_column, workload_column, floor_column = st.columns(3)
with model_column:
    model = st.selectbox("Model preset", list(MODEL_PRESETS), index=list(MODEL_PRESETS).index("Llama-3-8B"))
    gpu = st.selectbox("GPU", list(GPU_PRESETS), index=list(GPU_PRESETS).index("H100 SXM 80GB"))
    gpus = int(st.number_input("GPUs (layers split over them)", min_value=1, max_value=MOST_GPUS, value=1))
with workload_column:
    context = int(st.number_input("Context (prompt tokens)", min_value=1, value=32768, step=4096))
    output_tokens = int(st.number_input("Generated tokens", min_value=1, value=256, step=64))
    batch = int(st.number_input("Batch", min_value=1, value=1))
with floor_column:
    benchmark = st.radio("Floor judged on", list(BENCHMARKS), horizontal=True)
    floor = st.slider("Accuracy floor (share of the full cache's)", 0.5, 1.0, 0.95, 0.01)
    source = st.radio("Evidence", ["shipped runs", "this dashboard's store"], horizontal=True)

path = SHIPPED_EVIDENCE[benchmark] if source == "shipped runs" else default_db_path()
if not has_database(path):
    st.info("This dashboard's store holds no runs yet; choose the shipped runs.")
    st.stop()
try:
    request = AdviceRequest(model, gpu, context, floor, benchmark, gpus, output_tokens, batch)  # type: ignore[arg-type]
    advice, runs = stored_advice(path, request)
except KvlabError as error:
    st.error(plain(str(error)))
    st.stop()

st.subheader(plain(advice_title(request)))
for sentence in advice.missing:
    st.warning(plain(sentence))
chart = st.container()
how_to_read(chart, ADVICE_GUIDE, key="advice-guide")
show_chart(chart, advice_figure(advice), key="advice-chart", filename="advice")
st.caption(plain(evidence_sentence(advice)))
if advice.ranked.empty:
    st.info("No stored configuration meets the floor.")
else:
    st.dataframe(shown_advice(advice.ranked), hide_index=True)
with st.expander(f"Below the floor ({len(advice.below)})"):
    st.dataframe(shown_advice(advice.below), hide_index=True)
st.download_button(
    "Report (HTML)",
    data=partial(report_file, advice_report, advice, runs),
    file_name="kvlab-advice.html",
    mime=MIME_TYPES[".html"],
    on_click="ignore",
    icon=":material/download:",
    key="download-advice-report",
)
