"""A login round trip against a real OIDC provider: ``oidc-provider-mock`` serves OpenID Connect on localhost, the
dashboard's ``[auth]`` points at it, and Chromium logs in, runs, logs out and tries a forged cookie."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import pytest
from browser import Server, free_port, idle, launch, needs_chromium

from kvlab.store import open_store

pytestmark = [pytest.mark.model, pytest.mark.browser, pytest.mark.long]

sync_api = pytest.importorskip("playwright.sync_api")
if importlib.util.find_spec("oidc_provider_mock") is None:  # found, not imported: it runs in its own process
    pytest.skip("needs oidc-provider-mock (the test extra)", allow_module_level=True)

ADA = {"sub": "ada", "email": "ada@example.org", "name": "Ada Lovelace"}


@pytest.fixture
def provider() -> Iterator[str]:
    """``oidc-provider-mock`` on a free local port, with one user; its address."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "oidc_provider_mock", "--port", str(port), "--user-claims", json.dumps(ADA)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"{url}/.well-known/openid-configuration", timeout=1):
                break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the OIDC provider did not start") from None
            time.sleep(0.2)
    yield url
    process.terminate()
    process.wait(10)


def login_page_only(tab) -> None:
    tab.get_by_role("button", name="Log in").wait_for()
    idle(tab)
    assert tab.locator("[data-testid=stSidebarNav]").count() == 0
    assert tab.get_by_text("Running on").count() == 0


@needs_chromium
def test_a_login_round_trip_against_an_oidc_provider(tmp_path, provider):
    database = tmp_path / "runs.duckdb"
    server = Server({"KVLAB_DB": str(database)}, "--secrets.files", str(tmp_path / "secrets.toml"))
    (tmp_path / "secrets.toml").write_text(
        f'[auth]\nredirect_uri = "{server.url}/oauth2callback"\n'
        'cookie_secret = "a-cookie-secret-of-32-characters"\nclient_id = "kvlab"\nclient_secret = "kvlab-secret"\n'
        f'server_metadata_url = "{provider}/.well-known/openid-configuration"\n'
    )
    with server, sync_api.sync_playwright() as playwright:
        browser = launch(playwright)
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        tab = context.new_page()
        tab.set_default_timeout(90_000)
        for path in ("/live", "/runs", "/"):  # before the login: the login page at every address
            tab.goto(server.url + path)
            login_page_only(tab)
        tab.get_by_role("button", name="Log in").click()
        tab.wait_for_url(re.compile(re.escape(provider) + ".*/oauth2/authorize"))
        tab.get_by_role("button", name="ada", exact=True).click()  # the provider's own form: log in as ada
        tab.wait_for_url(re.compile(re.escape(server.url)))
        tab.get_by_text("Logged in as").wait_for()
        shown = tab.get_by_text("Logged in as").inner_text().replace("\u2060", "")  # a word joiner keeps it no link
        assert "ada@example.org" in shown
        sync_api.expect(tab.locator("[data-testid=stSidebarNav]")).to_have_count(1)  # drawn after the greeting

        tab.goto(f"{server.url}/live")  # a run, recorded with who ran it
        tab.get_by_text("Running on").wait_for()
        tab.get_by_role("spinbutton", name="Context length (tokens)").fill("256")
        tab.get_by_role("spinbutton", name="Tokens to generate (at most)").fill("4")
        tab.get_by_role("spinbutton", name="Tokens to generate (at most)").press("Enter")
        idle(tab)
        tab.get_by_role("button", name="Run", exact=True).click()
        tab.get_by_text("stored as run").wait_for()

        forged = browser.new_context()  # a cookie this server did not sign: the login page, nothing else
        forged.add_cookies(
            [{"name": "_streamlit_user", "value": json.dumps({**ADA, "is_logged_in": True}), "url": server.url}]
        )
        stranger = forged.new_page()
        stranger.set_default_timeout(90_000)
        stranger.goto(f"{server.url}/runs")
        login_page_only(stranger)
        forged.close()

        tab.get_by_role("button", name="Log out").click()
        tab.wait_for_url(re.compile(re.escape(provider) + ".*/end_session"))  # the provider ends its session too
        tab.get_by_role("button", name="End session").click()
        tab.wait_for_url(re.compile(re.escape(server.url)))
        tab.goto(server.url)
        login_page_only(tab)
        tab.goto(f"{server.url}/runs")
        login_page_only(tab)
        browser.close()
    with open_store(database, read_only=True) as store:
        runs = store.list_runs()
    assert runs["started_by"].tolist() == ["ada@example.org"]
