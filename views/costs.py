"""Cost calculator: a model's KV cache in bytes, sequences per GPU, decode speed and dollars, full against evicted."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from kvlab.costs import (
    FORMULAS,
    GPU_PRESETS,
    MODEL_PRESETS,
    MOST_GPUS,
    Scenario,
    compare,
    formatted_costs,
)
from kvlab.costs.measured import (
    COMPUTED,
    MEASURED,
    MEASURED_METHOD,
    MEASURED_SHAPE,
    SHOWN,
    load_measured_decode,
    measured_against_formula,
    measured_summary,
    measured_table,
)
from kvlab.costs.report import estimates_table
from kvlab.dashboard.chart_view import how_to_read, show_chart
from kvlab.dashboard.cost_view import (
    COST_BARS_GUIDE,
    cost_bars,
    cost_metrics,
    fit_notices,
    gpu_split_table,
    scope_note,
    split_summary,
    stored_keep_fractions,
    timing_sentence,
    with_measured,
)
from kvlab.dashboard.inputs import (
    KV_PRECISIONS,
    WEIGHT_PRECISIONS,
    gpu_spec,
    model_spec_from_json,
    model_spec_from_loaded,
)
from kvlab.dashboard.session import current_model, page_store
from kvlab.dashboard.text import plain, plain_frame
from kvlab.errors import KvlabError
from kvlab.units import GB, GIB

NOTICE_CALLS = {"error": st.error, "warning": st.warning, "info": st.info}

st.title("Cost calculator")
st.caption(
    "The estimates on this page are computed from the model's architecture and the GPU's datasheet figures with "
    "the formulas listed below (kvlab.costs). Memory and decode time are taken at the full context N + M, an "
    "upper bound. Several GPUs split the layers as a pipeline. GPU prices are editable examples, not quotes. "
    "Where a GPU benchmark measured exactly the chosen model, GPU, prompt length and kept share, its decode and "
    "prefill times replace the formulas', labelled measured with the device named; every measured figure is at the "
    "bottom of the page beside the formulas' figure for it."
)

model_column, scenario_column, gpu_column = st.columns(3)
with model_column:
    st.subheader("Model")
    source = st.radio("From", ["preset", "loaded model", "pasted config.json"], horizontal=True)
    spec = None
    try:
        if source == "preset":
            preset = st.selectbox("Preset", list(MODEL_PRESETS), index=list(MODEL_PRESETS).index("Llama-3-8B"))
            spec = MODEL_PRESETS[preset]
        elif source == "loaded model":
            loaded = current_model()
            if loaded is None:
                st.warning("No model is loaded; pick one in the sidebar.")
            else:
                spec = model_spec_from_loaded(loaded)
        else:
            pasted = st.text_area("config.json", height=160, placeholder='{"num_hidden_layers": 32, ...}')
            billions = st.number_input("Parameters (billions)", min_value=0.0, value=8.0, step=0.5)
            if pasted.strip():
                spec = model_spec_from_json(pasted, billions)
        if spec is not None:
            arch = spec.arch
            layout = "MLA latent" if arch.uses_mla else f"{arch.num_kv_heads} KV heads × head dim {arch.head_dim}"
            window = (
                f", sliding window {arch.sliding_window} on {len(arch.sliding_layers)} layers"
                if arch.sliding_layers
                else ""
            )
            st.caption(
                f"{plain(spec.name)}: {arch.num_layers} layers, {arch.num_q_heads} query heads, {layout}{window}; "
                f"{spec.params / 1e9:,.2f}B parameters."
            )
    except KvlabError as error:
        st.error(plain(str(error)))
        spec = None

with scenario_column:
    st.subheader("Workload")
    prompt_tokens = int(st.number_input("Prompt tokens (N)", min_value=0, value=7168, step=1024))
    output_tokens = int(st.number_input("Generated tokens (M)", min_value=1, value=1024, step=128))
    batch = int(st.number_input("Batch (sequences decoded together)", min_value=1, value=8))
    kv_precision = st.selectbox("KV cache precision", list(KV_PRECISIONS))
    group = int(
        st.number_input(
            "Quantisation group size (0: ignore scales)",
            min_value=0,
            value=0,
            step=32,
            disabled=KV_PRECISIONS[kv_precision] == "bf16",
            help="Each group of this many numbers carries an fp16 scale and zero-point.",
        )
    )
    weight_precision = st.selectbox("Weight precision", list(WEIGHT_PRECISIONS))
    keep_source = st.radio("Kept fraction", ["typed", "from a stored run"], horizontal=True)
    keep = 0.25
    if keep_source == "typed":
        keep = st.slider("Kept fraction of the context", 0.01, 1.0, 0.25, 0.01)
    else:
        store = page_store()
        options = stored_keep_fractions(store.list_runs()) if store is not None else {}
        if options:
            keep = options[st.selectbox("Stored run", list(options))]
        else:
            st.info("No stored run with a budget yet; the typed default of 25 % is used.")

with gpu_column:
    st.subheader("GPU")
    gpu_name = st.selectbox("Preset", list(GPU_PRESETS), index=list(GPU_PRESETS).index("H100 SXM 80GB"))
    base = GPU_PRESETS[gpu_name]
    memory = st.number_input("Memory (GiB)", min_value=1.0, value=base.memory_bytes / GIB, key=f"mem-{gpu_name}")
    bandwidth = st.number_input(
        "Bandwidth (GB/s)", min_value=1.0, value=base.bandwidth_bytes_per_s / GB, key=f"bw-{gpu_name}"
    )
    tflops = st.number_input("Dense BF16 TFLOP/s", min_value=1.0, value=base.peak_flops / 1e12, key=f"fl-{gpu_name}")
    price = st.number_input(
        "Price per hour ($, example)", min_value=0.0, value=base.price_per_hour, step=0.1, key=f"price-{gpu_name}"
    )
    gpus = int(
        st.number_input(
            "GPUs (layers split over them)",
            min_value=1,
            max_value=MOST_GPUS,
            value=1,
            help="A pipeline: each GPU holds consecutive layers, their weights and their cache, and the GPUs work in "
            "turn on every step. When the count does not divide the layers, the first GPUs take one more.",
        )
    )
    reserve = st.slider(
        "Memory kept in reserve", 0.0, 0.5, 0.10, 0.01, help="Activations, CUDA context and fragmentation."
    )
    utilisation = st.slider("Prefill utilisation of peak FLOP/s", 0.05, 1.0, 0.5, 0.05)

if spec is None:
    st.stop()
try:
    scenario = Scenario(
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        batch=batch,
        kv_precision=KV_PRECISIONS[kv_precision],
        weight_precision=WEIGHT_PRECISIONS[weight_precision],
        keep_fraction=keep,
        gpu_count=gpus,
        memory_reserve=reserve,
        prefill_utilization=utilisation,
        quant_group_size=group or None,
    )
    gpu = gpu_spec(gpu_name, memory, bandwidth, tflops, price)
    full, evicted = compare(spec, gpu, scenario)
except KvlabError as error:
    st.error(plain(str(error)))
    st.stop()
try:
    measured = load_measured_decode()
except KvlabError as error:
    st.error(plain(str(error)))
    measured = None
configuration = None
if measured is not None and measured.measures(spec.name, gpu_name):
    evicting = {name: key for key, name in SHOWN.items() if key != "full"}
    configuration = evicting[st.selectbox(f"Eviction measured on {measured.device}", list(evicting))]
full, full_times = with_measured(full, measured, spec.name, gpu_name, scenario, "full", gpu.price_per_hour)
evicted, evicted_times = with_measured(
    evicted, measured, spec.name, gpu_name, scenario, configuration, gpu.price_per_hour
)
sources = (MEASURED if full_times else COMPUTED, MEASURED if evicted_times else COMPUTED)
st.caption(plain(timing_sentence(full_times, evicted_times, measured)))
table = estimates_table(full, evicted, scenario)

for column, metric in zip(st.columns(5), cost_metrics(full, evicted, sources[1])):
    column.metric(
        metric.label, metric.value, delta=metric.delta, delta_color=metric.delta_color, delta_arrow=metric.delta_arrow
    )
for notice in fit_notices(full, evicted, scenario, gpu_name):
    NOTICE_CALLS[notice.level](plain(notice.text))
chart = st.container()
how_to_read(chart, COST_BARS_GUIDE, key="cost-bars-guide")
show_chart(chart, cost_bars(full, evicted, sources), key="cost-bars", filename="cost-full-vs-evicted")
st.table(plain_frame(formatted_costs(table).set_index("Quantity")))
if scenario.gpu_count > 1:
    st.subheader(f"Across {scenario.gpu_count} GPUs")
    st.caption(plain(split_summary(evicted)))
    st.dataframe(gpu_split_table(full, evicted), hide_index=True)
st.info(plain(scope_note(spec.arch, evicted, scenario)))
st.subheader("Decode measured on a GPU")
if measured is None:
    st.info(
        "No measured decode figures here: they come from the benchmark results of a kvlab checkout "
        "(bench/results), which an installed kvlab does not ship."
    )
else:
    st.caption(
        plain(
            f"{measured_summary(measured, scenario.context_tokens)} The estimate "
            f"above is for the GPU and model chosen here; these figures hold for {MEASURED_SHAPE} on "
            f"{measured.device} only and are not scaled. {MEASURED_METHOD}"
        )
    )
    st.dataframe(measured_table(measured), hide_index=True)
    st.markdown(f"**Measured against the formulas** ({plain(measured.device)}, {MEASURED_SHAPE})")
    st.caption(
        plain(
            f"Each measured configuration beside what the formulas compute for it on the {measured.device}'s "
            "datasheet at the same prompt length and kept share: the formulas assume decode is bound by reading the "
            "weights and the cache at datasheet bandwidth, and prefill by compute at the utilisation set above "
            "(0.5 in this table)."
        )
    )
    st.dataframe(measured_against_formula(measured), hide_index=True)
with st.expander("Formulas (N prompt tokens, M generated tokens)", expanded=True):
    st.table(pd.DataFrame(FORMULAS.items(), columns=["Quantity", "Formula"]).set_index("Quantity"))
    st.caption(
        "Not modelled: paged-cache block rounding, activations beyond the reserve, the transient full-prompt "
        "peak of prefill-mode eviction, per-layer budgets, achieved (rather than datasheet) bandwidth, the "
        "activations passed between a pipeline's GPUs, micro-batches in flight. "
        "See docs/costs.md."
    )
