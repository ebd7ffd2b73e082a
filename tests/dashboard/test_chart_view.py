"""kvlab's chart elements: the pages draw their 2D charts with kvlab's bundle of plotly.js, served from ``static/``,
and their 3D views with Streamlit's own Plotly element; every session loads the bundle from the sidebar, and a chart's
HTML carries its figure intact whatever text the figure holds."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import plotly.graph_objects as go
import pytest
from drawn_charts import drawn_charts
from streamlit import config
from streamlit.testing.v1 import AppTest

from kvlab.dashboard import chart_view
from kvlab.dashboard.chart_view import (
    LIGHT_BUNDLE,
    LIGHT_BUNDLE_URL,
    PLOTLY_JS_VERSION,
    chart_html,
    chart_script_html,
    drawn_light,
    light_traces,
)
from kvlab.dashboard.guides import chart_config

REPO = Path(__file__).resolve().parents[2]


def test_the_bundle_is_the_plotly_js_that_plotly_writes_figures_for():
    assert LIGHT_BUNDLE.is_file(), f"{LIGHT_BUNDLE} is missing: a plotly upgrade needs scripts/plotly_bundle/build.sh"
    header = LIGHT_BUNDLE.read_text(encoding="utf-8")[:200]
    assert f"plotly.js (kvlab: scatter, bar, heatmap - minified) v{PLOTLY_JS_VERSION}" in header
    assert LIGHT_BUNDLE.parent == REPO / "static"  # the folder Streamlit serves beside app.py
    assert light_traces() == {"scatter", "bar", "heatmap"}


def test_2d_figures_take_the_bundle_and_3d_views_take_streamlits_plotly():
    assert drawn_light(go.Figure([go.Scatter(y=[1, 2]), go.Bar(y=[3]), go.Heatmap(z=[[1]])]))
    assert not drawn_light(go.Figure([go.Scatter(y=[1, 2]), go.Surface(z=[[1, 2], [3, 4]])]))
    assert not drawn_light(go.Figure(go.Scatter3d(x=[1], y=[1], z=[1])))


def test_with_static_serving_off_every_chart_is_streamlits():
    serving = config.get_option("server.enableStaticServing")
    config.set_option("server.enableStaticServing", False)
    try:
        assert not drawn_light(go.Figure(go.Scatter(y=[1, 2])))
    finally:
        config.set_option("server.enableStaticServing", serving)


def test_without_the_bundle_file_every_chart_is_streamlits(monkeypatch, tmp_path):
    monkeypatch.setattr(chart_view, "LIGHT_BUNDLE", tmp_path / LIGHT_BUNDLE.name)  # a checkout without static/
    assert not chart_view.light_bundle_served()
    assert not drawn_light(go.Figure())  # not even a figure without traces, which no script would draw


def test_a_charts_html_carries_its_figure_whatever_text_it_holds():
    hostile = '</script><script>alert("x")</script><!-- "quoted" & <b>'
    figure = go.Figure(go.Scatter(y=[1, 2], name=hostile), layout={"title": {"text": hostile}, "height": 320})
    body = chart_html(figure, chart_config("kvlab-test"), key='a "key"')
    assert body.startswith(chart_script_html())  # whichever chart runs first loads the bundle
    assert body.count("</script>") == 2 and "<!--" not in body  # nothing in the figure ends its script
    assert 'data-key="a &quot;key&quot;"' in body and "height: 320px" in body
    element = SimpleNamespace(proto=SimpleNamespace(body=body))  # an AppTest element, as drawn_charts reads it
    [chart] = drawn_charts(SimpleNamespace(get=lambda kind: [element] if kind == "html" else []))
    assert chart.key == 'a "key"' and chart.title == hostile
    assert chart.figure == json.loads(figure.to_json())


@pytest.mark.slow
def test_every_session_loads_the_bundle_from_the_sidebar_and_the_overview_draws_with_it(db):
    app = AppTest.from_file(str(REPO / "app.py"), default_timeout=120)
    app.run()
    assert not app.exception, app.exception
    loaders = [element for element in app.sidebar if element.type == "html"]
    assert len(loaders) == 1
    assert re.match(rf'<script data-bundle="{re.escape(LIGHT_BUNDLE_URL)}">', loaders[0].proto.body)
    assert "window.kvlabCharts" in loaders[0].proto.body  # the charts' script itself
    charts = drawn_charts(app)
    assert charts and all(chart.key for chart in charts)
    assert not app.get("plotly_chart")  # the Overview has no 3D view: Streamlit's 5 MB Plotly stays unloaded
