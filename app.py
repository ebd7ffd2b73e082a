"""kvlab dashboard: declares the pages, answers only to its own host names, asks for a login when the server has
one, and draws the sidebar the pages share. Layout only; the work is in ``kvlab``."""

from __future__ import annotations

import streamlit as st

from kvlab.dashboard.chart_view import image_format_sidebar, load_chart_script
from kvlab.dashboard.navigation import PAGES
from kvlab.dashboard.session import (
    access_sidebar,
    guarded,
    logged_in,
    login_page,
    model_sidebar,
    right_host,
)

st.set_page_config(page_title="kvlab", page_icon=":material/memory:", layout="wide")
own_name = right_host()
admitted = own_name and logged_in()
page = st.navigation(
    [
        st.Page(entry.script, title=entry.title, icon=entry.icon, default=index == 0)
        for index, entry in enumerate(PAGES)
    ],
    position="sidebar" if admitted else "hidden",
)
if not own_name:  # the pages are declared but hidden, and none runs for a page reached by another site's name
    st.stop()
if not admitted:  # the pages are declared (so their addresses resolve) but none runs before the login
    login_page()
    st.stop()
load_chart_script()
guarded(model_sidebar, "the sidebar")
image_format_sidebar()
access_sidebar()
guarded(page.run, f"page {page.title}")
