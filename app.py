"""kvlab dashboard: declares the pages and the model picker they share. Layout only; the work is in ``kvlab``."""

from __future__ import annotations

import streamlit as st

st.set_page_config(page_title="kvlab", layout="wide")
navigation = st.navigation([st.Page("pages/generate.py", title="Generate", icon=":material/play_arrow:")])
navigation.run()
