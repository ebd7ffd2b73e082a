"""kvlab dashboard: declares the pages and draws the model picker they share. Layout only; the work is in ``kvlab``.

The URL of each page differs from its file name on purpose. Because the files live in ``pages/``, Streamlit starts a
server in its legacy multipage mode, which serves each file of ``pages/`` at its file name until this script has
declared the pages; a URL that is no file name always reaches this script first.
"""

from __future__ import annotations

import streamlit as st

from kvlab.ui.session import model_sidebar

st.set_page_config(page_title="kvlab", page_icon=":material/memory:", layout="wide")
page = st.navigation([
    st.Page("pages/live_run.py", title="Live run", icon=":material/play_circle:", url_path="live", default=True),
    st.Page("pages/needle_grid.py", title="Needle grid", icon=":material/grid_on:", url_path="needle-grid"),
    st.Page("pages/accuracy_frontier.py", title="Frontier", icon=":material/show_chart:", url_path="frontier"),
    st.Page("pages/cost_calculator.py", title="Cost calculator", icon=":material/payments:", url_path="costs"),
    st.Page("pages/stored_runs.py", title="Runs", icon=":material/table_rows:", url_path="runs"),
])
model_sidebar()
page.run()
