"""Side channels: can an attacker outside the server tell whether a secret canary is still cached, with and without
a noise floor on the policy's ranking? Shows a result of ``kvlab sidechannel``: a shipped one, or an uploaded file."""

from __future__ import annotations

import streamlit as st

from kvlab.dashboard.chart_view import how_to_read, show_chart
from kvlab.dashboard.sidechannel_view import (
    ACCURACY_GUIDE,
    OBSERVABLE_GUIDE,
    RETRIEVAL_GUIDE,
    accuracy_figure,
    channel_table,
    describe,
    level_table,
    observable_figure,
    retrieval_figure,
    shipped_results,
)
from kvlab.dashboard.text import plain
from kvlab.errors import KvlabError
from kvlab.experiments.sidechannel import CHANNELS, SideChannelResult, parse_result

st.title("Side channels")
st.caption(
    "An attacker who planted a canary sentence in the context and knows the prompt template, but not where the "
    "canary sits, tries to tell from outside whether it is still cached after eviction: from the decode time per "
    "token, from the KV bytes and kept tokens an API could report, and from the answer to a probing question. A "
    "threshold fitted on half the trials is scored on the other half, which holds as many cached as evicted "
    "canaries, so guessing scores 50 %. Results come from `kvlab sidechannel --out`; timings are measured."
)

shipped = shipped_results()
upload = st.file_uploader("Upload a result (JSON written by kvlab sidechannel --out)", type=["json"])
result: SideChannelResult
try:
    if upload is not None:
        result = parse_result(upload.getvalue(), upload.name)
    elif shipped:
        path = st.selectbox("Shipped result", shipped, format_func=lambda item: item.stem)
        result = parse_result(path.read_bytes(), path.name)
    else:
        st.info("No side-channel results are shipped yet; upload one written by `kvlab sidechannel --out`.")
        st.stop()
except KvlabError as error:
    st.error(plain(str(error)))
    st.stop()

st.markdown(plain(describe(result)))

accuracy = st.container()
how_to_read(accuracy, ACCURACY_GUIDE, key="side-channel-accuracy-guide")
show_chart(accuracy, accuracy_figure(result), key="side-channel-accuracy", filename="kvlab-side-channel-accuracy")
st.dataframe(channel_table(result), hide_index=True, key="side-channel-verdicts")

retrieval, trials = st.columns(2)
with retrieval:
    st.subheader("What the noise costs")
    how_to_read(retrieval, RETRIEVAL_GUIDE, key="side-channel-retrieval-guide")
    show_chart(
        retrieval, retrieval_figure(result), key="side-channel-retrieval", filename="kvlab-side-channel-retrieval"
    )
    st.dataframe(level_table(result), hide_index=True, key="side-channel-levels")
with trials:
    st.subheader("One channel, trial by trial")
    channel_column, noise_column = st.columns(2)
    channel = channel_column.selectbox("Channel", list(CHANNELS), format_func=lambda name: CHANNELS[name])
    noise = noise_column.selectbox("Noise", [level.noise for level in result.levels])
    how_to_read(trials, OBSERVABLE_GUIDE, key="side-channel-observable-guide")
    show_chart(
        trials,
        observable_figure(result, noise, channel),
        key="side-channel-observable",
        filename="kvlab-side-channel-trials",
    )
