"""The Claims page in a real browser: ``streamlit run app.py`` on a copy of the needle grid's trials, driven by
Playwright through Debian's chromium. Every claim is on the page with kvlab's figure or the reason there is none, a
refresh stores them (the server holds the file, so the page says so), and the page is saved as a screenshot (to a
temporary directory, or ``$KVLAB_SCREENSHOTS``)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from browser import Server, idle, launch, needs_chromium
from test_browser import WIDTH, at_both_sizes

from kvlab.claims import CATALOGUE

sync_api = pytest.importorskip("playwright.sync_api")
pytestmark = [needs_chromium, pytest.mark.browser, pytest.mark.model, pytest.mark.long]
NEEDLE_GRID = Path(__file__).resolve().parents[2] / "bench" / "results" / "needle_claim" / "trials.duckdb"


@pytest.fixture(scope="module")
def database(tmp_path_factory) -> Path:
    """A copy of the needle grid measured for the published claim (``bench/results/needle_claim``), so that the
    needle claims show real measurements; the copy is migrated, the committed file is left as it is."""
    path = tmp_path_factory.mktemp("claims") / "runs.duckdb"
    shutil.copyfile(NEEDLE_GRID, path)
    return path


@pytest.fixture(scope="module")
def page(database) -> Iterator:
    with Server({"KVLAB_DB": str(database)}) as server, sync_api.sync_playwright() as playwright:
        browser = launch(playwright)
        tab = browser.new_page(viewport={"width": WIDTH, "height": 1000})
        tab.set_default_timeout(90_000)
        tab.goto(server.url)
        tab.get_by_text("Running on").wait_for()
        yield tab
        browser.close()


def test_the_claims_page_in_a_browser(page, tmp_path):
    page.locator("[data-testid=stSidebarNav] a", has_text="Claims").click()
    page.get_by_role("heading", name="Claims", exact=True).wait_for()
    page.locator(f".st-key-claim-{CATALOGUE[-1].claim_id}").wait_for()  # the last card is drawn
    idle(page)
    cards = page.locator("[class*=st-key-claim-]")
    texts = cards.all_inner_texts()
    assert len(texts) == len(CATALOGUE)
    for text in texts:
        assert "kvlab:" in text or "Not measured here:" in text, text
        assert "nan" not in text.split() and "None" not in text.split(), text
    page.get_by_text("not stored yet").wait_for()  # visible
    page.get_by_role("button", name="Refresh from the store").click()
    page.get_by_text("as stored in").wait_for()
    idle(page)
    nine = cards.nth(8).inner_text()
    assert "h2o prefill 47/37/22/12/7%" in nine and "kvlab-tiny-llama" in nine  # measured from the store's runs
    page.mouse.move(0, 0)  # no tooltip over the picture
    chosen = os.environ.get("KVLAB_SCREENSHOTS")
    at_both_sizes(page, Path(chosen) if chosen else tmp_path, "claims")
