"""The charts a page drew, for tests that run it with Streamlit's ``AppTest``: kvlab's own chart elements (the HTML
that ``kvlab.dashboard.chart_view.chart_html`` writes) and Streamlit's Plotly elements (the 3D views)."""

from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass
from typing import Any

#: The key and the JSON that ``chart_html`` writes into a chart's HTML.
CHART_HTML = re.compile(r'<div class="kvlab-chart" data-key="([^"]*)".*?, chart: (\{.*\})\}\)</script>$', re.S)


@dataclass(frozen=True)
class DrawnChart:
    """One chart: its key and its Plotly figure (``data`` and ``layout``)."""

    key: str | None
    figure: dict[str, Any]

    @property
    def title(self) -> str:
        return str(self.figure["layout"].get("title", {}).get("text", ""))


def drawn_charts(app: Any) -> list[DrawnChart]:
    """Every chart on the page: kvlab's in the page's order, then Streamlit's."""
    charts = []
    for element in app.get("html"):
        found = CHART_HTML.search(element.proto.body)
        if found is not None:
            charts.append(DrawnChart(html.unescape(found.group(1)), json.loads(found.group(2))["figure"]))
    charts += [DrawnChart(chart.key, json.loads(chart.proto.spec)) for chart in app.get("plotly_chart")]
    return charts
