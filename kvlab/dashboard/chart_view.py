"""The Streamlit side of a chart: drawn with its download configuration, with its "How to read this" beside it.

Pages draw every chart through :func:`show_chart`, so every chart can be saved as an image in the format the sidebar
chose, and put each chart's :class:`~kvlab.dashboard.guides.ChartGuide` next to it with :func:`how_to_read`.
"""

from __future__ import annotations

import functools
from pathlib import Path

import plotly.graph_objects as go
import streamlit as st
from streamlit.delta_generator import DeltaGenerator

from kvlab.dashboard.guides import IMAGE_FORMATS, ChartGuide, chart_config

IMAGE_FORMAT_KEY = "kvlab_image_format"
#: Where Streamlit's frontend keeps its scripts, served under ``static/js/`` beside every page's address.
FRONTEND_SCRIPTS = Path(st.__file__).parent / "static" / "static" / "js"


@functools.cache
def chart_script() -> str | None:
    """The file name of the frontend's Plotly chart component in this Streamlit (its name carries a content hash),
    ``None`` where it has none."""
    found = sorted(FRONTEND_SCRIPTS.glob("PlotlyChart.*.js"))
    return found[0].name if found else None


def load_chart_script() -> None:
    """Have the browser load Plotly's chart component as soon as a session starts, while the page's script runs.

    The component (Plotly included, about 5 MB of JavaScript) is otherwise fetched, compiled and run only when the
    first chart arrives, and on a small machine that takes longer than most pages' scripts: a new tab waited about
    1.4 s after its last message for its first chart. Imported here, it is in the browser's module map when the
    chart arrives, and the chart draws at once. The import names only Streamlit's own script, by the name this
    Streamlit gave it."""
    name = chart_script()
    if name is not None:
        st.sidebar.html(f'<script>import("./static/js/{name}")</script>', unsafe_allow_javascript=True)


def image_format_sidebar() -> None:
    """The sidebar's choice of the format a chart's camera button saves (PNG by default)."""
    st.sidebar.radio(
        "Chart images",
        list(IMAGE_FORMATS),
        key=IMAGE_FORMAT_KEY,
        horizontal=True,
        help="The camera button in a chart's tool bar (shown on hover) saves the chart in this format.",
    )


def show_chart(where: DeltaGenerator, figure: go.Figure, key: str, filename: str) -> None:
    """Draw ``figure`` in ``where`` (a slot, a column or ``st``), its camera button saving ``filename``."""
    image_format = IMAGE_FORMATS[str(st.session_state.get(IMAGE_FORMAT_KEY, "PNG"))]
    where.plotly_chart(figure, key=key, config=chart_config(filename, image_format))


def how_to_read(where: DeltaGenerator, guide: ChartGuide, key: str) -> None:
    """A small "How to read this" button in ``where`` that opens ``guide``."""
    with where.popover("How to read this", icon=":material/help:", key=key, type="tertiary"):
        st.markdown(guide.markdown())
