"""kvlab's chart script in Chromium, with a stand-in for Plotly that records when each chart is drawn: charts that
arrive together, or before the bundle has loaded, are drawn one at a time in the order they arrived, each after the
one before it has been painted, so that a page's first chart shows without waiting for the others."""

from __future__ import annotations

import json
from urllib.parse import quote

import plotly.graph_objects as go
import pytest
from browser import launch, needs_chromium

from kvlab.dashboard.chart_view import CHART_SCRIPT, chart_html
from kvlab.dashboard.guides import chart_config

sync_api = pytest.importorskip("playwright.sync_api")
pytestmark = [needs_chromium, pytest.mark.browser, pytest.mark.long]

#: Stands in for the bundle: every drawing is logged with the number of frames the page had painted by then.
STAND_IN = """
window.frames_painted = 0;
(function count() { requestAnimationFrame(() => { window.frames_painted += 1; count(); }); })();
window.drawings = [];
window.Plotly = {
  react(element) {
    window.drawings.push([element.dataset.key, window.frames_painted]);
    element.innerHTML = '<svg class="main-svg"></svg>';
    return Promise.resolve(element);
  },
  purge() {},
  Plots: { resize() {} },
};
"""


def page(keys: list[str]) -> str:
    """A page whose charts (one per key) arrive before the charts' script, as on a page whose sidebar is drawn after
    its first charts, then the script with the stand-in as its bundle."""
    charts = "".join(chart_html(go.Figure(go.Scatter(y=[1, 2])), chart_config(key), key) for key in keys)
    bundle = "data:text/javascript," + quote(STAND_IN)
    return f"<html><body>{charts}<script data-bundle={json.dumps(bundle)}>{CHART_SCRIPT}</script></body></html>"


def test_charts_are_drawn_one_at_a_time_in_order_each_after_the_last_one_painted():
    keys = ["first", "second", "third"]
    with sync_api.sync_playwright() as playwright:
        browser = launch(playwright)
        tab = browser.new_page()
        tab.set_content(page(keys))
        tab.wait_for_function("window.drawings && window.drawings.length === 3", timeout=10_000)
        drawings = tab.evaluate("window.drawings")
        tab.evaluate(  # a chart that arrives once the script runs
            "() => { const element = Object.assign(document.createElement('div'), {className: 'kvlab-chart'});"
            " element.dataset.key = 'late'; document.body.append(element);"
            " window.kvlabCharts.push({element, chart: {figure: {data: []}, config: {}}}); }"
        )
        tab.wait_for_function("window.drawings.length === 4", timeout=10_000)
        assert tab.locator(".kvlab-chart .main-svg").count() == 4
        browser.close()
    assert [key for key, _ in drawings] == keys
    frames = [frame for _, frame in drawings]
    assert all(later > earlier for earlier, later in zip(frames, frames[1:])), frames  # a paint between drawings
