"""A comparison of stored runs as one self-contained HTML file, for people who do not have the dashboard.

The file carries everything it shows: plotly's JavaScript is inlined once, so it opens offline and fetches nothing
from any address; every figure keeps its "how to read this" text beside it; the tables are the dashboard's own
(:mod:`kvlab.runs.tables`), with bytes in binary units; and it says when it was made, by which kvlab, and which
models and devices the runs came from. Pure functions: the pages offer the text as a download.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio

from kvlab import __version__
from kvlab.dashboard.guides import ChartGuide, chart_config
from kvlab.dashboard.store_figures import (
    FRONTIER_GUIDE,
    RUN_MEMORY_GUIDE,
    RUN_QUALITY_GUIDE,
    axis_frontier_figure,
    run_memory_figure,
    run_quality_figure,
)
from kvlab.runs.advisor import Advice, advice_title, evidence_sentence, shown_advice
from kvlab.runs.tables import (
    FRONTIER_AXES,
    METRICS,
    SHARE_COLUMNS,
    compare_runs,
    frontier_table,
    paired_tests,
    run_memory,
    run_quality,
    run_shares,
    runs_table,
    short_model_name,
    with_shares,
)
from kvlab.stats import MIN_PAIRED_ITEMS


@dataclass(frozen=True)
class ReportTable:
    """A table of the report under its heading, with a ``note`` on how to read it where it needs one; ``index``
    says whether its row labels are part of it."""

    title: str
    frame: pd.DataFrame
    index: bool = False
    note: str = ""


@dataclass(frozen=True)
class ReportFigure:
    """A figure of the report under its heading, with its guide; ``filename`` names the image its camera button
    saves."""

    title: str
    figure: go.Figure
    guide: ChartGuide
    filename: str


@dataclass(frozen=True)
class Report:
    """What a report shows: a title, a sentence on what is compared, the runs it covers (``Store.list_runs`` rows,
    for where they came from), and its tables and figures in the order they are read."""

    title: str
    summary: str
    runs: pd.DataFrame
    parts: tuple[ReportTable | ReportFigure, ...]

    @property
    def figures(self) -> list[ReportFigure]:
        """The report's figures, in order."""
        return [part for part in self.parts if isinstance(part, ReportFigure)]

    @property
    def tables(self) -> list[ReportTable]:
        """The report's tables, in order."""
        return [part for part in self.parts if isinstance(part, ReportTable)]


@dataclass(frozen=True)
class Selection:
    """One selection of the Frontier page: its name, the model, task and context length it filters on, and its
    points (:func:`kvlab.runs.tables.frontier_points`)."""

    name: str
    model: str
    task: str
    context_length: int | None
    points: pd.DataFrame

    @property
    def title(self) -> str:
        """``Selection A: kvlab-tiny-llama · needle · 4096 tokens``."""
        length = "every length" if self.context_length is None else f"{self.context_length} tokens"
        return f"Selection {self.name}: {short_model_name(self.model)} · {self.task} · {length}"


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 1200px; padding: 0 1rem; color: #222; }
h1 { margin-bottom: 0.2rem; } .made { color: #666; margin-top: 0; }
.scroll { overflow-x: auto; } table { border-collapse: collapse; font-size: 0.85rem; margin: 0.5rem 0 1.5rem; }
th, td { border: 1px solid #ddd; padding: 0.25rem 0.5rem; text-align: left; vertical-align: top; }
th { background: #f4f4f4; } .guide { background: #f8f8f8; border-left: 3px solid #888; padding: 0.2rem 1rem; }
"""


def run_sources(runs: pd.DataFrame) -> pd.DataFrame:
    """Where the runs came from: one row per model, device and dtype, with how many runs and which kvlab versions
    and commits made them."""
    sources = runs.assign(model=runs["model"].map(short_model_name)).fillna({"kvlab_version": "—", "git_commit": "—"})
    grouped = sources.groupby(["model", "device", "dtype"], dropna=False).agg(
        runs=("run_id", "count"),
        kvlab=("kvlab_version", lambda values: ", ".join(sorted(set(map(str, values))))),
        commits=("git_commit", lambda values: ", ".join(sorted(set(map(str, values))))),
    )
    return grouped.reset_index()


def _table_html(table: ReportTable) -> str:
    shown = table.frame.astype(object).where(table.frame.notna(), "—")
    frame = shown.to_html(index=table.index, escape=True, border=0)
    note = f"<p>{html.escape(table.note)}</p>\n" if table.note else ""
    return f"<h2>{html.escape(table.title)}</h2>\n{note}<div class='scroll'>{frame}</div>"


def _guide_html(guide: ChartGuide) -> str:
    parts = (("What is drawn.", guide.axes), ("A good run.", guide.good), ("A bad run.", guide.bad))
    paragraphs = "".join(f"<p><b>{name}</b> {html.escape(text)}</p>" for name, text in parts)
    return f"<div class='guide'><p><b>How to read this</b></p>{paragraphs}</div>"


def _figure_html(figure: ReportFigure, first: bool) -> str:
    """A figure's heading, guide and plot; the first figure carries plotly's JavaScript, inlined."""
    plot = pio.to_html(
        figure.figure,
        full_html=False,
        include_plotlyjs=first,
        config=chart_config(figure.filename),
    )
    return f"<h2>{html.escape(figure.title)}</h2>\n{_guide_html(figure.guide)}\n{plot}"


def report_html(report: Report, made_at: datetime) -> str:
    """The report as one HTML document: its title, when it was made (``made_at``, UTC) and by which kvlab, what
    it compares, where the runs came from, its tables and its figures each with its guide."""
    sources = ReportTable("Where the runs came from", run_sources(report.runs))
    first_figure = report.figures[0] if report.figures else None
    body = [
        f"<h1>{html.escape(report.title)}</h1>",
        f"<p class='made'>Made {made_at:%Y-%m-%d %H:%M} UTC by kvlab {html.escape(__version__)}.</p>",
        f"<p>{html.escape(report.summary)}</p>",
        _table_html(sources),
        *(
            _figure_html(part, part is first_figure) if isinstance(part, ReportFigure) else _table_html(part)
            for part in report.parts
        ),
    ]
    return (
        "<!DOCTYPE html>\n<html lang='en'>\n<head>\n<meta charset='utf-8'>\n"
        f"<title>{html.escape(report.title)}</title>\n<style>{_STYLE}</style>\n</head>\n<body>\n"
        + "\n".join(body)
        + "\n</body>\n</html>\n"
    )


#: What counts as right in a paired test on each share metric.
_RIGHT = {
    "accuracy": "the answer in the output",
    "exact_accuracy": "the answer as the output's first line",
    "recall": "every expected string recalled",
}


PAIRED_TITLE = "Paired test (McNemar) on the items both runs answered"


def paired_note(metric: str) -> str:
    """How to read the paired tests on a share metric (a key of :data:`~kvlab.runs.tables.SHARE_COLUMNS`): what
    pairs, what counts as right, and when two runs are not comparable."""
    return (
        f"Items pair by the hash of their prompt. McNemar's test reads only the items where one is right and the "
        f"other wrong (right: {_RIGHT[metric]}); a p-value below 0.05 says the difference is unlikely to be chance. "
        f"B − A is the mean difference in {METRICS[metric].title} over the paired items, with its bootstrap 95 % "
        f"interval. Fewer than {MIN_PAIRED_ITEMS} shared items are not comparable."
    )


def runs_report(runs: pd.DataFrame, trials: pd.DataFrame, metric: str) -> Report:
    """The Runs page's comparison: the compared runs (``Store.list_runs`` rows) side by side, their quality on
    ``metric`` (a key of :data:`~kvlab.runs.tables.METRICS`) and their memory, from their trials; for a share and
    two runs or more, every two of them by McNemar's paired test on the items both answered."""
    names = ", ".join(str(run_id) for run_id in runs["run_id"])
    paired = (
        (ReportTable(PAIRED_TITLE, paired_tests(runs, trials, metric), note=paired_note(metric)),)
        if metric in SHARE_COLUMNS and len(runs) > 1
        else ()
    )
    return Report(
        title=f"kvlab: runs {names} compared",
        summary=(
            f"{len(runs)} stored runs side by side: their configuration, where they ran, and the means of their "
            f"{len(trials)} trials. Bytes are measured from the cache tensors of each trial and averaged. Shares "
            "carry their 95 % interval: Wilson's for right-or-wrong answers, a seeded percentile bootstrap for "
            "RULER's recall."
        ),
        runs=runs,
        parts=(
            ReportTable("The compared runs", compare_runs(runs, trials), index=True),
            *paired,
            ReportFigure(
                f"Quality per run: {METRICS[metric].title}",
                run_quality_figure(run_quality(runs, trials, metric), metric),
                RUN_QUALITY_GUIDE,
                "kvlab-run-quality",
            ),
            ReportFigure(
                "KV cache memory per run", run_memory_figure(run_memory(runs, trials)), RUN_MEMORY_GUIDE, "kvlab-memory"
            ),
        ),
    )


def frontier_report(
    selections: Sequence[Selection],
    axis: str,
    metric: str,
    runs: pd.DataFrame,
    trials: pd.DataFrame | None = None,
) -> Report:
    """The Frontier page's selections (one, or two side by side): each one's frontier on ``axis`` against
    ``metric`` (keys of :data:`~kvlab.runs.tables.FRONTIER_AXES` and :data:`~kvlab.runs.tables.METRICS`) with its
    points, and the runs behind them (``Store.list_runs`` rows, with their intervals and tie shares from their
    ``trials``)."""
    return Report(
        title="kvlab: quality against memory, " + " and ".join(f"selection {s.name}" for s in selections),
        summary=(
            f"{METRICS[metric].title.capitalize()} against {FRONTIER_AXES[axis]}, one line per policy and mode, "
            f"from {len(runs)} stored runs. " + " ".join(f"{selection.title}." for selection in selections)
        ),
        runs=runs,
        parts=(
            *(part for selection in selections for part in _selection_parts(selection, axis, metric)),
            ReportTable(
                "The runs behind them", runs_table(runs if trials is None else with_shares(runs, run_shares(trials)))
            ),
        ),
    )


def _selection_parts(selection: Selection, axis: str, metric: str) -> tuple[ReportFigure, ReportTable]:
    """A selection's frontier and the table of its points."""
    figure = axis_frontier_figure(selection.points, axis, metric)
    return (
        ReportFigure(selection.title, figure, FRONTIER_GUIDE, f"kvlab-frontier-{selection.name}"),
        ReportTable(f"Points of selection {selection.name}", frontier_table(selection.points, axis, metric)),
    )


def advice_report(advice: Advice, runs: pd.DataFrame) -> Report:
    """The advisor's answer as a report: what was asked, where the accuracy comes from and what was transferred,
    the ranked configurations, the closest below the floor and what the store lacks (with the sweep that adds it);
    ``runs`` are the runs it rests on (:func:`kvlab.runs.advisor.evidence_runs`)."""
    parts = [
        ReportTable("Configurations that meet the floor, cheapest first", shown_advice(advice.ranked)),
        ReportTable("Below the floor, closest first", shown_advice(advice.below)),
    ]
    if advice.missing:
        parts.append(ReportTable("Missing evidence", pd.DataFrame({"what the store lacks": list(advice.missing)})))
    return Report(advice_title(advice.request), evidence_sentence(advice), runs, tuple(parts))
