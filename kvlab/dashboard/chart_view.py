"""The Streamlit side of a chart: drawn with its download configuration, with its "How to read this" beside it.

Pages draw every chart through :func:`show_chart`, so every chart can be saved as an image in the format the sidebar
chose, and put each chart's :class:`~kvlab.dashboard.guides.ChartGuide` next to it with :func:`how_to_read`.
"""

from __future__ import annotations

import functools
import html
import json
import re
from pathlib import Path

import plotly.graph_objects as go
import streamlit as st
from plotly.offline import get_plotlyjs_version
from streamlit.delta_generator import DeltaGenerator

from kvlab.dashboard.guides import IMAGE_FORMATS, ChartGuide, chart_config

IMAGE_FORMAT_KEY = "kvlab_image_format"
#: The plotly.js that this plotly writes its figures for.
PLOTLY_JS_VERSION = get_plotlyjs_version()
#: kvlab's bundle of that plotly.js: its core with the scatter, bar and heatmap traces, the only ones kvlab's 2D charts
#: draw (``scripts/plotly_bundle/build.sh``), in the ``static/`` folder beside ``app.py`` that Streamlit serves under
#: ``app/static/`` (``server.enableStaticServing``).
LIGHT_BUNDLE = Path(__file__).resolve().parents[2] / "static" / f"plotly-kvlab-{PLOTLY_JS_VERSION}.min.js"
#: Its address from a page's (every page's address is one level below the app's).
LIGHT_BUNDLE_URL = f"./app/static/{LIGHT_BUNDLE.name}"
#: The script that draws kvlab's charts with that bundle, run once per page (:func:`load_chart_script`).
CHART_SCRIPT = Path(__file__).with_name("chart_component.js").read_text(encoding="utf-8")


@functools.cache
def light_traces() -> frozenset[str]:
    """The kinds of trace the light bundle draws, as it registers them (asked only where it is served)."""
    return frozenset(re.findall(r'moduleType:"trace",name:"(\w+)"', LIGHT_BUNDLE.read_text(encoding="utf-8")))


def light_bundle_served() -> bool:
    """Whether the browser can load the light bundle: Streamlit serves ``static/`` and the bundle is in it."""
    return bool(st.get_option("server.enableStaticServing")) and LIGHT_BUNDLE.is_file()


def drawn_light(figure: go.Figure) -> bool:
    """Whether ``figure`` is drawn with the light bundle: the bundle is served (:func:`light_bundle_served`) and it
    has every trace of the figure. The others (the 3D views) go through Streamlit's own chart element and the full
    Plotly.

    Why: a page's first chart in a new tab waits for the browser to run Plotly's script. On a 2-core machine the full
    Plotly (about 5 MB) takes about 0.75 s of the main thread, plotly.js's cartesian bundle about 0.37 s, and kvlab's
    (no box, violin, contour, histogram, pie, image or world calendars) about 0.13 s."""
    return light_bundle_served() and {trace.type for trace in figure.data} <= light_traces()


def chart_script_html() -> str:
    """The charts' script as a script element, with the bundle's address: its first run in a page starts loading the
    bundle, and any later run returns at once."""
    return f'<script data-bundle="{LIGHT_BUNDLE_URL}">{CHART_SCRIPT}</script>'


def load_chart_script() -> None:
    """Run the charts' script as soon as a session starts, from the sidebar: it loads the light bundle while the
    page's script runs, so that the first chart draws when it arrives."""
    if light_bundle_served():
        st.sidebar.html(chart_script_html(), unsafe_allow_javascript=True)


def chart_html(figure: go.Figure, config: dict[str, object], key: str) -> str:
    """The HTML of one chart drawn by the charts' script: the script itself (:func:`chart_script_html`), its element
    (named by ``key``), at the figure's height (Plotly's 450 pixels by default), and the script that hands it over
    with the figure and its configuration as JSON. Every ``<`` of the JSON is escaped, so no text in the figure can
    end the script.

    Why the charts' script again: in a new tab, Streamlit draws the sidebar's HTML (:func:`load_chart_script`) after
    the page's first charts at times (the Frontier's first chart element up to 0.9 s before it, in Chromium on a
    2-core machine), and the bundle only starts loading when the script runs; whichever runs first loads it."""
    height = figure.layout.height or 450
    chart = f'{{"figure": {figure.to_json()}, "config": {json.dumps(config)}}}'.replace("<", "\\u003c")
    return (
        f"{chart_script_html()}"
        f'<div class="kvlab-chart" data-key="{html.escape(key)}" style="height: {height}px"></div><script>'
        f"(window.kvlabCharts = window.kvlabCharts || []).push("
        f"{{element: document.currentScript.previousElementSibling, chart: {chart}}})</script>"
    )


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
    config = chart_config(filename, image_format)
    if not drawn_light(figure):
        where.plotly_chart(figure, key=key, config=config)
        return
    where.html(chart_html(figure, config, key), unsafe_allow_javascript=True)


def how_to_read(where: DeltaGenerator, guide: ChartGuide, key: str) -> None:
    """A small "How to read this" button in ``where`` that opens ``guide``."""
    with where.popover("How to read this", icon=":material/help:", key=key, type="tertiary"):
        st.markdown(guide.markdown())
