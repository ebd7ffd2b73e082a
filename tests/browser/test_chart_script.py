"""kvlab's chart script in Chromium, with a stand-in for Plotly that records when each chart is drawn: charts that
arrive together, or before the bundle has loaded, are drawn one at a time in the order they arrived, each after the
one before it has been painted, so that a page's first chart shows without waiting for the others; every chart
carries the script, so charts draw before the sidebar's copy of it runs, and the bundle is loaded once."""

from __future__ import annotations

from urllib.parse import quote

import plotly.graph_objects as go
import pytest
from browser import launch, needs_chromium

from kvlab.dashboard.chart_view import CHART_SCRIPT, LIGHT_BUNDLE_URL, chart_html
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


BUNDLE = "data:text/javascript," + quote(STAND_IN)


def page(keys: list[str]) -> str:
    """A page of charts (one per key) as ``chart_html`` writes them, with the stand-in as their bundle, and no other
    script: the sidebar's comes after them at times."""
    charts = (chart_html(go.Figure(go.Scatter(y=[1, 2])), chart_config(key), key) for key in keys)
    return f"<html><body>{''.join(chart.replace(LIGHT_BUNDLE_URL, BUNDLE) for chart in charts)}</body></html>"


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
        tab.evaluate(  # the sidebar's script, drawn after the charts
            "([bundle, script]) => { const element = document.createElement('script');"
            " element.dataset.bundle = bundle; element.textContent = script; document.body.append(element); }",
            [BUNDLE, CHART_SCRIPT],
        )
        assert tab.locator("head script").count() == 1  # the bundle, loaded by the first chart's script alone
        browser.close()
    assert [key for key, _ in drawings] == keys
    frames = [frame for _, frame in drawings]
    assert all(later > earlier for earlier, later in zip(frames, frames[1:])), frames  # a paint between drawings
