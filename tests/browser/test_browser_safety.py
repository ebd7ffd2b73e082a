"""What a hostile page or a hostile text can do to the dashboard in a real browser: a page that reaches the server
by another site's name (DNS rebinding) sees one refusal and nothing else, and markup typed into a question or answer
makes the browser fetch nothing."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest
from browser import Server, free_port, idle, launch, needs_chromium

sync_api = pytest.importorskip("playwright.sync_api")
pytestmark = [needs_chromium, pytest.mark.browser, pytest.mark.model, pytest.mark.long]


class Recorder(http.server.BaseHTTPRequestHandler):
    """An HTTP server that records every path asked of it (a pixel an injected image would fetch)."""

    seen: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 (the name http.server calls)
        Recorder.seen.append(self.path)
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def recorder() -> Iterator[int]:
    port = free_port()
    server = http.server.HTTPServer(("127.0.0.1", port), Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    Recorder.seen.clear()
    yield port
    server.shutdown()


def test_a_page_reached_by_another_sites_name_gets_nothing(tmp_path):
    with Server({"KVLAB_DB": str(tmp_path / "runs.duckdb")}) as server, sync_api.sync_playwright() as playwright:
        browser = launch(playwright, "--host-resolver-rules=MAP rebound.example 127.0.0.1")
        tab = browser.new_page()
        tab.set_default_timeout(60_000)
        tab.goto(f"http://rebound.example:{server.port}/")
        tab.get_by_text("does not answer to the name this page used").wait_for()
        idle(tab)
        assert tab.get_by_role("textbox", name="Model").count() == 0
        assert tab.get_by_role("heading", name="Live run").count() == 0
        tab.goto(server.url)  # by its own name it works
        tab.get_by_text("Running on").wait_for()
        browser.close()
    assert not (tmp_path / "runs.duckdb").exists()


def test_markup_in_a_question_and_answer_fetches_nothing(tmp_path, recorder):
    pixel = f"http://127.0.0.1:{recorder}/pixel.png"
    question = f'What is the access code? ![seen]({pixel}) <img src="{pixel}?html">'
    with Server({"KVLAB_DB": str(tmp_path / "runs.duckdb")}) as server, sync_api.sync_playwright() as playwright:
        browser = launch(playwright)
        tab = browser.new_page(viewport={"width": 1400, "height": 1000})
        tab.set_default_timeout(90_000)
        tab.goto(f"{server.url}/live")
        tab.get_by_text("Running on").wait_for()
        tab.get_by_text("Your text").click()
        idle(tab)
        tab.get_by_role("textbox", name="…or paste a text").fill("The access code of Ada is 4471. " * 6)
        tab.get_by_role("textbox", name="Question").fill(question)
        tab.get_by_role("textbox", name="Expected answer").fill(f"4471 ![answer]({pixel}?answer)")
        tab.get_by_role("spinbutton", name="Tokens to generate (at most)").fill("3")
        tab.get_by_role("spinbutton", name="Tokens to generate (at most)").press("Enter")
        idle(tab)
        tab.get_by_role("button", name="Run", exact=True).click()
        tab.get_by_text("stored as run").wait_for()
        idle(tab)
        tab.wait_for_timeout(1000)
        assert tab.locator(f"img[src^='{pixel}']").count() == 0
        assert tab.locator(f"a[href^='{pixel}']").count() == 0  # not even a link
        shown = tab.evaluate("document.body.innerText").replace("\u2060", "")
        assert f"![seen]({pixel})" in shown and f"4471 ![answer]({pixel}?answer)" in shown  # the text as it is
        browser.close()
    assert Recorder.seen == []
