"""How to read a chart, and how a chart is offered for download: pure data that the pages draw next to each chart.

Every chart of the dashboard has a :class:`ChartGuide` beside its figure builder: what its axes are, what a good
run looks like on it and what a bad one does, in two or three sentences each, for someone who has not read the
papers. :func:`chart_config` is the plotly configuration every chart is drawn with: the camera button of its tool
bar downloads the chart as a PNG or an SVG, named after the chart.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The image formats a chart can be downloaded in, by the name the sidebar shows.
IMAGE_FORMATS: dict[str, str] = {"PNG": "png", "SVG": "svg"}


@dataclass(frozen=True)
class ChartGuide:
    """How to read one chart: ``axes`` says what is drawn where, ``good`` what a run that works looks like, ``bad``
    what one that fails looks like."""

    axes: str
    good: str
    bad: str

    def markdown(self) -> str:
        """The guide as three short paragraphs."""
        return f"**What is drawn.** {self.axes}\n\n**A good run.** {self.good}\n\n**A bad run.** {self.bad}"


def chart_config(filename: str, image_format: str = "png") -> dict[str, object]:
    """Plotly's configuration for one chart: its tool bar's camera button saves ``filename.png`` (at twice the
    screen's resolution) or ``filename.svg``; no plotly logo."""
    if image_format not in IMAGE_FORMATS.values():
        raise ValueError(f"image format {image_format!r} is not one of {', '.join(IMAGE_FORMATS.values())}")
    return {
        "displaylogo": False,
        "toImageButtonOptions": {
            "format": image_format,
            "filename": filename,
            "scale": 2 if image_format == "png" else 1,
        },
    }
