"""One generation under a budgeted KV cache, with the figures read from the cache tensors."""

from __future__ import annotations

import streamlit as st

from kvlab.budget import Budget
from kvlab.engine import RunSpec, generate
from kvlab.errors import KvlabError
from kvlab.models import LoadedModel, default_model, load_model
from kvlab.policies import POLICIES, make_policy


@st.cache_resource(show_spinner=False)
def cached_model(name: str) -> LoadedModel:
    """Each model is loaded once per server process and shared by every session."""
    return load_model(name)


def sidebar_model() -> LoadedModel | None:
    name = st.sidebar.text_input("Model (hub id or local directory)", value=default_model())
    try:
        with st.spinner(f"Loading {name}…"):
            loaded = cached_model(name)
    except KvlabError as error:
        st.sidebar.error(str(error))
        return None
    arch = loaded.arch
    st.sidebar.caption(
        f"{arch.model_type} · {arch.num_layers} layers · {arch.num_q_heads} query / {arch.num_kv_heads} KV heads · "
        f"head dim {arch.head_dim} · running on **{loaded.device}** in {str(loaded.dtype).replace('torch.', '')}"
    )
    return loaded


loaded = sidebar_model()
st.title("Generate under a KV budget")
prompt = st.text_area("Prompt", value="The attention sink is", height=150)
columns = st.columns(4)
policy_name = columns[0].selectbox("Policy", list(POLICIES), index=list(POLICIES).index("streaming"))
budget_kind = columns[1].radio("Budget", ["kept fraction", "tokens"], horizontal=True)
budget_value = (
    columns[1].number_input("Kept fraction", min_value=0.01, max_value=1.0, value=0.5, step=0.05)
    if budget_kind == "kept fraction"
    else columns[1].number_input("Tokens per layer per KV head", min_value=1, value=64, step=16)
)
mode = columns[2].radio("Mode", ["prefill", "streaming"], horizontal=True)
chunk = columns[2].number_input("Chunk (tokens)", min_value=1, value=64, step=16)
max_new = columns[3].number_input("New tokens", min_value=1, max_value=512, value=32)

if st.button("Run", type="primary", disabled=loaded is None) and loaded is not None:
    try:
        policy = make_policy(policy_name)
        budget = None
        if policy.evicts():
            budget = Budget(keep=float(budget_value)) if budget_kind == "kept fraction" else Budget(tokens=int(budget_value))
        spec = RunSpec(policy, budget, mode=mode, chunk=int(chunk), max_new_tokens=int(max_new))
        input_ids = loaded.tokenizer(prompt, return_tensors="pt").input_ids
        with st.spinner("Generating…"):
            result = generate(loaded, input_ids, spec)
    except KvlabError as error:
        st.error(str(error))
    else:
        st.subheader("Output")
        st.code(result.texts[0] or "(empty)", language=None)
        metrics = st.columns(4)
        metrics[0].metric("Context tokens", result.context_tokens)
        metrics[1].metric("KV held (measured)", f"{result.kv_bytes / 1024:,.1f} KiB")
        metrics[2].metric("Full cache would hold", f"{result.kv_bytes_full / 1024:,.1f} KiB")
        metrics[3].metric("Peak KV (measured)", f"{result.peak_kv_bytes / 1024:,.1f} KiB")
        st.caption(
            f"Bytes are read from the K/V tensors held on {result.device}; the full-cache figure is computed for the "
            f"same shapes. Tokens kept per layer: {result.kept_per_layer}."
        )
