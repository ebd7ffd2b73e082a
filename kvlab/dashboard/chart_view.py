"""The Streamlit side of a chart: drawn with its download configuration, with its "How to read this" beside it.

Pages draw every chart through :func:`show_chart`, so every chart can be saved as an image in the format the sidebar
chose, and put each chart's :class:`~kvlab.dashboard.guides.ChartGuide` next to it with :func:`how_to_read`.
"""

from __future__ import annotations

import plotly.graph_objects as go
import streamlit as st
from streamlit.delta_generator import DeltaGenerator

from kvlab.dashboard.guides import IMAGE_FORMATS, ChartGuide, chart_config

IMAGE_FORMAT_KEY = "kvlab_image_format"


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
