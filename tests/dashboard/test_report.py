"""The comparison report: one HTML file that opens without kvlab or a network, with the runs, their provenance,
the figures' data and the guides."""

from __future__ import annotations

import html
import json
from datetime import datetime
from html.parser import HTMLParser

import pandas as pd
import pytest

from kvlab.dashboard.report import Selection, frontier_report, report_html, run_sources, runs_report
from kvlab.dashboard.store_figures import FRONTIER_GUIDE, RUN_QUALITY_GUIDE
from kvlab.provenance import Provenance
from kvlab.runs.tables import frontier_points, run_label
from kvlab.store import RunConfig, RunFilter, Store, Trial

MADE_AT = datetime(2025, 3, 4, 5, 6)
#: Elements without an end tag.
VOID = {"meta", "br", "img", "hr", "input", "link"}


class Parsed(HTMLParser):
    """The document's elements: each start tag with its attributes, the text of each element, and whether every
    element that was opened was closed in order."""

    def __init__(self, document: str) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: dict[str, list[str]] = {}
        self.open: list[str] = []
        self.balanced = True
        self.feed(document)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        if tag not in VOID:
            self.open.append(tag)

    def handle_endtag(self, tag: str) -> None:
        self.balanced &= bool(self.open) and self.open.pop() == tag

    def handle_data(self, data: str) -> None:
        if self.open:
            self.text.setdefault(self.open[-1], []).append(data)


def in_figure_data(text: str, document: str) -> bool:
    """Whether ``text`` is a string of a figure's data: plotly writes it as JSON, non-ASCII characters escaped."""
    return json.dumps(text) in document


def add_run(store: Store, policy: str, keep: float | None, correct: list[bool], kv_bytes: int, model: str) -> int:
    run_id = store.begin_run(
        RunConfig(
            model=model,
            policy=policy,
            mode="prefill",
            task="needle",
            keep=keep,
            context_length=4096,
            device="cuda:0",
            dtype="bfloat16",
        ),
        provenance=Provenance("0.1.0", "abc1234", {"python": "3"}),
    )
    store.add_trials(
        run_id,
        [
            Trial(
                trial_key=str(i),
                task_id="t",
                context_tokens=4096,
                correct=ok,
                exact=ok,
                depth=0.5,
                kept_tokens=int(4096 * (keep or 1)),
                kv_bytes=kv_bytes,
                peak_kv_bytes=2 * kv_bytes,
            )
            for i, ok in enumerate(correct)
        ],
    )
    store.finish_run(run_id)
    return run_id


@pytest.fixture
def filled(store: Store) -> Store:
    add_run(store, "full", None, [True, True], 8 << 20, "org/<b>model</b>")  # a name that must not become markup
    add_run(store, "h2o", 0.1, [True, False, True], 800 << 10, "org/<b>model</b>")
    add_run(store, "streaming", 0.1, [False, False], 800 << 10, "org/<b>model</b>")
    return store


def test_a_runs_report_is_one_offline_document_with_the_runs_and_their_figures(filled):
    runs = filled.list_runs()
    document = report_html(runs_report(runs, filled.trials_frame(), "accuracy"), MADE_AT)
    parsed = Parsed(document)
    assert parsed.balanced and not parsed.open
    assert parsed.text["title"] == ["kvlab: runs 1, 2, 3 compared"]
    assert not [attrs for tag, attrs in parsed.tags if tag == "script" and attrs.get("src")]
    assert not [attrs for _, attrs in parsed.tags if str(attrs.get("href", "")).startswith(("http", "//"))]
    assert "<b>model</b>" not in document and "&lt;b&gt;model&lt;/b&gt;" in document
    assert "2025-03-04 05:06 UTC" in document and "cuda:0" in document and "abc1234" in document
    headers = [" ".join(parsed.text.get("th", []))]
    assert all(f"run {run_id}" in headers[0] for run_id in runs["run_id"])
    assert "800 KiB" in document and "8.00 MiB" in document  # the means in binary units
    for label in (run_label("h2o", "prefill", 0.1), run_label("streaming", "prefill", 0.1)):
        assert in_figure_data(label, document)
    assert document.count("Plotly.newPlot(") == 2 and document.count("plotly.js v") == 1  # inlined once
    assert html.escape(RUN_QUALITY_GUIDE.good) in document and "None" not in " ".join(parsed.text["td"])


def test_a_frontier_report_has_each_selection_with_its_guide(filled):
    frontier = filled.accuracy_frontier(RunFilter(context_lengths=(4096,)))
    selections = [
        Selection(name, "org/<b>model</b>", "needle", 4096, frontier_points(frontier, "kv_bytes"))
        for name in ("A", "B")
    ]
    document = report_html(frontier_report(selections, "kv_bytes", "accuracy", filled.list_runs()), MADE_AT)
    parsed = Parsed(document)
    assert parsed.balanced
    assert [text for text in parsed.text["h2"] if text.startswith("Selection")] == [
        "Selection A: org/<b>model</b> · needle · 4096 tokens",
        "Selection B: org/<b>model</b> · needle · 4096 tokens",
    ]
    assert document.count(html.escape(FRONTIER_GUIDE.bad)) == 2 and document.count("Plotly.newPlot(") == 2
    assert in_figure_data("h2o · prefill · keep 10%", document) and "800 KiB" in document


def test_the_sources_name_each_model_and_device_once():
    runs = pd.DataFrame(
        {
            "run_id": [1, 2, 3],
            "model": ["/m/a", "/m/a", "b/c"],
            "device": ["cuda:0", "cuda:0", "cpu"],
            "dtype": ["bfloat16", "bfloat16", "float32"],
            "kvlab_version": ["0.1.0", "0.2.0", None],
            "git_commit": ["x", "x", None],
        }
    )
    sources = run_sources(runs).set_index("model")
    assert sources.loc["a", "runs"] == 2 and sources.loc["a", "kvlab"] == "0.1.0, 0.2.0"
    assert sources.loc["b/c", "commits"] == "—"


def test_a_runs_report_tests_two_runs_on_the_items_both_answered(store: Store):
    outcomes = {"full": [True] * 12, "h2o": [True] * 4 + [False] * 8}
    for policy, correct in outcomes.items():
        run_id = add_run(store, policy, None if policy == "full" else 0.1, [], 1 << 20, "m")
        store.add_trials(
            run_id,
            [
                Trial(trial_key=str(i), task_id="t", context_tokens=4096, correct=ok, item_hash=f"item-{i}")
                for i, ok in enumerate(correct)
            ],
        )
    report = runs_report(store.list_runs(), store.trials_frame(), "accuracy")
    [compared, paired] = report.tables
    assert paired.title == "Paired test (McNemar) on the items both runs answered"
    assert "Fewer than 10 shared items are not comparable" in paired.note
    row = paired.frame.iloc[0]
    assert (row["A"], row["B"], row["items both answered"], row["only A right"]) == ("run 1", "run 2", "12", "8")
    assert row["McNemar p"] == "0.0078" and row["test"] == "exact binomial"  # 2 * (1/2)^8
    assert compared.frame.loc["accuracy % (95% CI)", "run 2"] == "33.3 (13–61)"
    document = report_html(report, MADE_AT)
    assert html.escape(paired.note) in document and "exact binomial" in document
    assert not runs_report(store.list_runs(), store.trials_frame(), "perplexity").tables[1:]  # no share: no test
