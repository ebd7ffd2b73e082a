"""The dashboard's texts come from the code: every page script is declared once (``kvlab.dashboard.navigation``), the
app's navigation is built from that declaration, and the Overview names every registered policy and page."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from streamlit.runtime.pages_manager import PagesManager
from streamlit.testing.v1 import AppTest

from kvlab.dashboard.navigation import PAGE_DIRECTORY, PAGES, overview_opening
from kvlab.policies import POLICIES
from kvlab.policies.streaming import Streaming

REPO = Path(__file__).resolve().parents[2]


def test_every_page_script_is_declared_once():
    declared = [entry.script for entry in PAGES]
    assert len(declared) == len(set(declared))
    assert set(declared) == {str(path.relative_to(REPO)) for path in (REPO / PAGE_DIRECTORY).glob("*.py")}


def test_streamlit_never_runs_a_page_without_app_py():
    """A ``pages/`` directory beside ``app.py`` would start a server in Streamlit's legacy multipage mode, where a
    page's address runs the page file alone (no host check, no login) until a session's ``app.py`` has declared the
    pages; a server without one runs ``app.py`` for every request from its first."""
    assert PAGE_DIRECTORY != "pages" and not (REPO / "pages").exists()
    PagesManager.uses_pages_directory = None  # as in a server that has just started
    PagesManager(str(REPO / "app.py"))
    assert PagesManager.uses_pages_directory is False


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
