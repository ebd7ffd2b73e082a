"""The dashboard in a real browser, started with the README's command (``scripts/dashboard.sh``) and driven by
Playwright through Debian's chromium. It opens on the Overview, opens every page at 1,280 x 800 and 1,920 x 1,080
and checks that no chart title or axis title is cut off, runs a live run and replays it, runs a needle grid to
completion, downloads a CSV (its rows against the filter) and a chart image (PNG and SVG), checks that a bad upload
is one sentence, and measures how soon the first chart of a 2k-token live run appears, how long the run takes and
how long page switches take. Screenshots go to a temporary directory, or to ``$KVLAB_SCREENSHOTS`` when set
(``scripts/screenshots.sh`` sets it to ``docs/screenshots/`` to refresh the README's pictures), so the test suite
never changes tracked files.
"""

from __future__ import annotations

import io
import os
import re
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
from browser import Server, idle, launch, needs_chromium

sync_api = pytest.importorskip("playwright.sync_api")

WIDTH = 1280
VIEWPORTS = ((1280, 800), (1920, 1080))
# Wall-clock limits that catch a hang or a page that stops streaming, not the targets themselves (2 s to the first
# chart, 15 s for the run, 1 s per page switch): the measured figures are printed (run with -s) and reported in the
# README; on a shared 2-core machine one switch now and then takes a few seconds while the other core is busy.
FIRST_CHART_LIMIT_S = 10.0
RUN_LIMIT_S = 60.0
PAGE_SWITCH_LIMIT_S = 10.0
PAGES = ("Overview", "Live run", "Needle grid", "Frontier", "Cost calculator", "Claims", "Runs")

pytestmark = [needs_chromium, pytest.mark.browser, pytest.mark.model, pytest.mark.long]

# Marks, in the page's clock, when the live run's first chart with data (the KV bytes legend) and its 3D view
# appear, counted from the last click.
OBSERVE = """() => {
  window.marks = {};
  document.addEventListener('click', () => { window.marks = {clicked: performance.now()}; }, true);
  new MutationObserver(() => {
    const m = window.marks;
    if (m.clicked === undefined) return;
    const now = performance.now() - m.clicked;
    if (m.chart === undefined && [...document.querySelectorAll('svg text')]
        .some(e => e.textContent.includes('in use (measured)'))) m.chart = now;
    if (m.landscape === undefined && document.querySelector('.gl-container canvas')) m.landscape = now;
  }).observe(document.body, {subtree: true, childList: true, characterData: true});
}"""

# The titles (chart, axes, colour bars) of every 2D chart on the page that reach outside the chart's own box or lie
# under its legend.
CLIPPED = """() => {
  const cut = [];
  const apart = (a, b) => a.right <= b.left || b.right <= a.left || a.bottom <= b.top || b.bottom <= a.top;
  for (const chart of document.querySelectorAll('.js-plotly-plot')) {
    const svg = chart.querySelector('.main-svg');
    if (!svg) continue;
    const box = svg.getBoundingClientRect();
    const legend = chart.querySelector('.legend .bg');
    const under = legend ? legend.getBoundingClientRect() : null;
    for (const title of chart.querySelectorAll('.gtitle, .xtitle, .ytitle, .cbtitle text')) {
      const r = title.getBoundingClientRect();
      if (r.width === 0) continue;
      if (r.left < box.left - 1 || r.right > box.right + 1 || r.top < box.top - 1 || r.bottom > box.bottom + 1)
        cut.push(title.textContent);
      if (under && under.width > 0 && !apart(r, under)) cut.push(`${title.textContent} (under the legend)`);
    }
  }
  return cut;
}"""


@pytest.fixture(scope="module")
def database(tmp_path_factory, shipped) -> Path:
    """A store with a small sweep on the shipped model, so the frontier and runs pages have real measurements."""
    from kvlab.runs.sweep import SweepGrid, SweepRunner, parse_policies
    from kvlab.store import open_store

    path = tmp_path_factory.mktemp("browser") / "runs.duckdb"
    store = open_store(path)
    grid = SweepGrid(
        parse_policies("full,h2o,streaming,random"),
        keeps=(0.1, 0.3, 0.6),
        contexts=(512, 1024),
        depths=(0.1, 0.9),
        trials=1,
    )
    SweepRunner(shipped, store, grid).run()
    store.close()
    return path


@pytest.fixture(scope="module")
def server(database) -> Iterator[str]:
    with Server({"KVLAB_DB": str(database)}) as running:
        yield running.url


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory) -> Path:
    """Where the screenshots go: ``$KVLAB_SCREENSHOTS``, or a temporary directory."""
    chosen = os.environ.get("KVLAB_SCREENSHOTS")
    return Path(chosen) if chosen else tmp_path_factory.mktemp("screenshots")


@pytest.fixture(scope="module")
def page(server):
    with sync_api.sync_playwright() as playwright:
        browser = launch(playwright)
        tab = browser.new_page(viewport={"width": WIDTH, "height": 800}, accept_downloads=True)
        tab.set_default_timeout(90_000)
        tab.goto(server)
        tab.get_by_text("Running on").wait_for()  # the model is loaded (and warmed up) once per server
        tab.evaluate(OBSERVE)
        yield tab
        browser.close()


def screenshot(tab, directory: Path, name: str, viewport: tuple[int, int] = (WIDTH, 800)) -> None:
    """The whole page at a viewport's width as a small PNG: the viewport stretched to the content, halved, reduced
    to 256 colours; the viewport is set back afterwards."""
    from PIL import Image

    width, height = viewport
    tab.set_viewport_size({"width": width, "height": height})
    tab.wait_for_timeout(800)
    content = tab.evaluate("document.querySelector('[data-testid=stMain]').scrollHeight")
    tab.set_viewport_size({"width": width, "height": min(int(content) + 40, 4000)})
    tab.wait_for_timeout(1500)  # charts resize to the new viewport
    image = Image.open(io.BytesIO(tab.screenshot())).convert("RGB")
    image = image.resize((image.width // 2, image.height // 2), Image.Resampling.LANCZOS)
    directory.mkdir(parents=True, exist_ok=True)
    image.quantize(colors=256).save(directory / f"{name}.png", optimize=True)
    tab.set_viewport_size({"width": WIDTH, "height": 800})


def at_both_sizes(tab, directory: Path, name: str) -> None:
    """Check the page at each viewport (no title or axis title cut off) and save its screenshots: ``name`` at
    1,280 px, ``name-1920`` at 1,920 px."""
    for width, height in VIEWPORTS:
        tab.set_viewport_size({"width": width, "height": height})
        tab.wait_for_timeout(1200)
        cut = tab.evaluate(CLIPPED)
        assert not cut, f"{name} at {width} x {height}: titles cut off: {cut}"
        screenshot(tab, directory, name if width == WIDTH else f"{name}-{width}", (width, height))


def go_to(tab, title: str) -> float:
    """Open a page from the sidebar; seconds until its title shows."""
    started = time.perf_counter()
    tab.locator("[data-testid=stSidebarNav] a", has_text=title).click()
    tab.get_by_role("heading", name=title, exact=True).wait_for()
    took = time.perf_counter() - started
    idle(tab)
    return took


def download_chart(tab, chart, expected: bytes) -> None:
    """Save ``chart`` through its tool bar's camera button and check the file's first bytes."""
    chart.hover()
    with tab.expect_download() as download:
        chart.locator(".modebar-btn[data-title^='Download plot']").click()
    assert Path(download.value.path()).read_bytes().lstrip()[: len(expected)] == expected


def test_every_page_in_a_browser(page, screenshots, record_property):
    overview = page.get_by_role("heading", name="Overview", exact=True)
    overview.wait_for()  # the sidebar (what the fixture waits for) can be drawn before the page's title
    assert overview.is_visible()  # the app opens on the Overview
    idle(page)
    at_both_sizes(page, screenshots, "overview")

    go_to(page, "Live run")
    started = time.perf_counter()
    page.get_by_role("button", name="Run").click()  # defaults: 2,048-token needle, h2o at 10 %, streaming
    page.get_by_text("stored as run").wait_for()
    run_s = time.perf_counter() - started
    idle(page)
    marks = page.evaluate("window.marks")
    first_chart = marks["chart"] / 1000
    record_property("first_chart_s", round(first_chart, 3))
    record_property("first_3d_view_s", round(marks["landscape"] / 1000, 3))
    record_property("live_run_s", round(run_s, 3))
    at_both_sizes(page, screenshots, "live-run")

    page.get_by_text("Replay stored runs").click()
    page.get_by_text("this server's runs").click()
    idle(page)
    scrubber = page.locator("[data-testid=stSlider]", has_text="Tokens read and generated").get_by_role("slider")
    scrubber.focus()
    scrubber.press("Home")  # back to the first chunk
    page.get_by_text("Reading the prompt: 256 of 2,048 tokens").wait_for()
    idle(page)
    at_both_sizes(page, screenshots, "replay")
    page.get_by_text("Run a model").click()
    idle(page)
    page.locator(".gl-container canvas").wait_for()  # the result's 3D view is drawn: the page has settled
    page.wait_for_timeout(1000)

    switches = {}
    for title in (*PAGES[2:], *PAGES[:2]):
        switches[title] = go_to(page, title)
    record_property("page_switch_s", {title: round(took, 3) for title, took in switches.items()})

    go_to(page, "Needle grid")
    depths = page.locator("[data-testid=stSlider]", has_text="Needle depths").get_by_role("slider")
    depths.focus()
    depths.press("Home")  # two depths: 0 and 1
    idle(page)
    page.get_by_role("button", name="Run grid").click()
    page.get_by_text("were already stored").wait_for()
    idle(page)
    at_both_sizes(page, screenshots, "needle-grid")

    go_to(page, "Frontier")
    at_both_sizes(page, screenshots, "frontier")
    for width, height in VIEWPORTS:  # the first selection's plot is in sight as the page opens, its legend under it
        page.set_viewport_size({"width": width, "height": height})
        page.wait_for_timeout(1200)
        plot_top = page.evaluate("document.querySelector('.kvlab-chart .nsewdrag').getBoundingClientRect().top")
        assert plot_top < height, f"the Frontier's first plot starts {plot_top:.0f} px down a {height} px view"
    page.set_viewport_size({"width": WIDTH, "height": 800})
    chart = page.locator(".js-plotly-plot").first
    download_chart(page, chart, b"\x89PNG")
    page.get_by_text("SVG", exact=True).click()  # the sidebar's format for chart images
    idle(page)
    download_chart(page, page.locator(".js-plotly-plot").first, b"<svg")

    go_to(page, "Cost calculator")
    at_both_sizes(page, screenshots, "cost-calculator")
    page.locator("[data-testid=stSelectbox]", has_text="Preset").nth(1).click()  # the GPU's preset
    page.get_by_role("option", name="H200 141GB").click()
    idle(page)
    for label, value in (("Prompt tokens (N)", "32768"), ("Batch (sequences decoded together)", "1")):
        page.get_by_label(label).fill(value)
        page.get_by_label(label).press("Enter")
        idle(page)
    kept = page.locator("[data-testid=stSlider]", has_text="Kept fraction of the context").get_by_role("slider")
    kept.focus()
    for _ in range(15):  # 25 % down to 10 %, the benchmark's kept share
        kept.press("ArrowLeft")
    idle(page)
    page.get_by_text("full cache: measured on NVIDIA H200").wait_for()
    page.get_by_text("Decode, measured").first.wait_for()
    at_both_sizes(page, screenshots, "cost-calculator-measured")

    go_to(page, "Advisor")
    page.locator(".js-plotly-plot").first.wait_for()
    page.get_by_text("no needle runs at 32,768 tokens").wait_for()  # visible, within the default timeout
    at_both_sizes(page, screenshots, "advisor")

    go_to(page, "Runs")
    filters = page.locator("[data-testid=stMultiSelect]", has_text="Policy")
    filters.click()
    page.get_by_role("option", name="h2o", exact=True).click()
    page.keyboard.press("Escape")
    idle(page)
    shown = int(page.get_by_text(re.compile(r"^\d+ of \d+ runs\.")).inner_text().split(" of ")[0])
    at_both_sizes(page, screenshots, "runs")
    with page.expect_download() as download:
        page.get_by_role("button", name="Runs (CSV)").click()
    runs = pd.read_csv(download.value.path())
    assert len(runs) == shown and set(runs["policy"]) == {"h2o"}  # what the filter shows, not the compared runs

    go_to(page, "Side channels")  # the shipped side-channel results, drawn without a model
    page.get_by_text("Attacker accuracy by channel").first.wait_for()
    at_both_sizes(page, screenshots, "side-channels")

    go_to(page, "Live run")
    page.get_by_text("Your text").click()
    idle(page)
    page.locator("[data-testid=stFileUploaderDropzoneInput]").set_input_files(
        files=[{"name": "weights.txt", "mimeType": "text/plain", "buffer": b"\x00\x01\x02 binary"}]
    )
    page.get_by_text("weights.txt is binary, not text").wait_for()
    # The error is drawn before the button below it: wait for the rerun to reach the button (5 s at most).
    sync_api.expect(page.get_by_role("button", name="Run")).to_be_disabled(timeout=5000)

    summary = (
        f"first chart {first_chart:.2f} s after Run (3D view {marks['landscape'] / 1000:.2f} s), live run "
        f"{run_s:.2f} s; page switches " + ", ".join(f"{title} {took:.2f} s" for title, took in switches.items())
    )
    print(summary)
    assert first_chart < FIRST_CHART_LIMIT_S and run_s < RUN_LIMIT_S, summary
    assert statistics.median(switches.values()) < PAGE_SWITCH_LIMIT_S, summary
    assert max(switches.values()) < PAGE_SWITCH_LIMIT_S, summary
