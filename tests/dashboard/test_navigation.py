"""The dashboard's texts come from the code: every page script is declared once (``kvlab.dashboard.navigation``), the
app's navigation is built from that declaration, and the Overview names every registered policy and page."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from streamlit.testing.v1 import AppTest

from kvlab.dashboard.chart_view import FRONTEND_SCRIPTS, chart_script
from kvlab.dashboard.navigation import PAGES, overview_opening
from kvlab.policies import POLICIES
from kvlab.policies.streaming import Streaming

REPO = Path(__file__).resolve().parents[2]


def test_every_page_script_is_declared_once():
    declared = [entry.script for entry in PAGES]
    assert len(declared) == len(set(declared))
    assert set(declared) == {str(path.relative_to(REPO)) for path in (REPO / "pages").glob("*.py")}


def test_the_overview_names_every_policy_and_every_other_page():
    opening = overview_opening()
    assert all(f"`{name}`" in opening for name in POLICIES)
    assert f"one of its {len(POLICIES)} policies" in opening
    assert all(f"**{entry.title}**" in opening for entry in PAGES if entry.title != "Overview")


@dataclass
class Lookalike(Streaming):
    """A policy registered by a test only."""

    name: ClassVar[str] = "lookalike_for_the_overview"


def test_a_policy_added_to_the_registry_is_in_the_overviews_list(db, monkeypatch):
    monkeypatch.setitem(POLICIES, Lookalike.name, Lookalike)
    app = AppTest.from_file(str(REPO / "app.py"), default_timeout=120)
    app.run()
    assert not app.exception, app.exception
    assert app.title[0].value == "Overview"
    assert any(f"`{Lookalike.name}`" in block.value for block in app.markdown)
    assert any(f"one of its {len(POLICIES)} policies" in block.value for block in app.markdown)


def test_every_session_loads_the_chart_component_of_this_streamlit_from_the_start(db):
    name = chart_script()
    assert name is not None and (FRONTEND_SCRIPTS / name).is_file()  # the file this Streamlit's frontend serves
    app = AppTest.from_file(str(REPO / "app.py"), default_timeout=120)
    app.run()
    assert not app.exception, app.exception
    loaders = [element for element in app.sidebar if element.type == "html"]
    assert len(loaders) == 1
    assert f'import("./static/js/{name}")' in loaders[0].proto.body
