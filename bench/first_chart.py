"""How long every dashboard page takes to show its first chart, in Chromium, with the dashboard started by the
README's command (``scripts/dashboard.sh``) on this machine.

First, the first page view of the just-started server: the Overview opened in a new tab until its first chart (the
server then imports kvlab, lists the machine's models and loads the sidebar's model, which every later session
shares). Then two ways to arrive, each timed ``--rounds`` times after one warming visit of every page (so that the
server's imports, its cached model and the browser's cached scripts are what a user who has the dashboard open
meets):

* ``sidebar``: the page reached by its sidebar link from a settled page, until its script has finished and a chart
  is drawn (an upper bound of its first chart: the chart may land before the script ends);
* ``new tab``: the page's address opened in a new tab of the same browser (a new session: Streamlit's frontend
  starts, connects and runs the whole app), until the first chart is drawn.

The server keeps its runs in a store of its own, empty, as a new user's is: every page then shows the shipped runs,
whatever this machine's own store holds.

By default the tabs open in Playwright's own browser context, which is off the record: Chromium keeps no compiled
code there, so every new tab compiles Plotly's bundle again. ``--profile`` opens them in a browser profile kept on
disk, as a user's browser is, where V8's code cache holds the compiled bundle from its third load on.

Usage: python bench/first_chart.py [--rounds 3] [--profile] [--out bench/results/dashboard/first_chart_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from browser import CHROMIUM, CHROMIUM_ARGS, Server, idle, launch  # noqa: E402

#: A drawn chart: kvlab's (``kvlab.dashboard.chart_view``) or Streamlit's Plotly element (its SVG layer, or the canvas
#: of a WebGL one).
CHART = ".kvlab-chart .main-svg, [data-testid=stPlotlyChart] .main-svg, [data-testid=stPlotlyChart] canvas"
#: The pages with a chart at first sight, by address and sidebar title (Claims draws its table first).
PAGES = {
    "": "Overview",
    "live": "Live run",
    "needle_grid": "Needle grid",
    "frontier": "Frontier",
    "costs": "Cost calculator",
    "advisor": "Advisor",
    "side_channel": "Side channels",
    "runs": "Runs",
}
SETTLED_WITH_CHART = (
    f"!document.querySelector('[data-testid=stStatusWidget]') && !!document.querySelector({json.dumps(CHART)})"
)


def by_sidebar(tab: Any, url: str, path: str, title: str) -> float:
    """Seconds from clicking ``title`` in the sidebar until the page at ``path`` has finished with a chart drawn."""
    start = time.perf_counter()
    tab.get_by_role("link", name=title).first.click()
    tab.wait_for_url(f"{url}/{path}", timeout=60_000)
    tab.wait_for_timeout(50)  # the status widget shows once the new script starts
    tab.wait_for_function(SETTLED_WITH_CHART, timeout=60_000)
    return time.perf_counter() - start


def in_new_tab(context: Any, url: str, path: str) -> float:
    """Seconds from opening ``path`` in a new tab until its first chart is drawn."""
    tab = context.new_page()
    start = time.perf_counter()
    tab.goto(f"{url}/{path}")
    tab.wait_for_selector(CHART, timeout=60_000)
    seconds = time.perf_counter() - start
    tab.close()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="open the tabs in a browser profile kept on disk")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    store = Path(tempfile.mkdtemp(prefix="kvlab-first-chart-")) / "runs.duckdb"
    server = Server({"KVLAB_DB": str(store)})
    url = server.start()
    times: dict[str, dict[str, list[float]]] = {"sidebar": {}, "new tab": {}}
    first_view = None
    try:
        from playwright.sync_api import ViewportSize, sync_playwright

        with sync_playwright() as playwright:
            viewport: ViewportSize = {"width": 1280, "height": 1000}
            if args.profile:
                context = playwright.chromium.launch_persistent_context(
                    tempfile.mkdtemp(prefix="kvlab-profile-"),
                    executable_path=str(CHROMIUM),
                    args=CHROMIUM_ARGS,
                    viewport=viewport,
                )
            else:
                context = launch(playwright).new_context(viewport=viewport)
            first_view = round(in_new_tab(context, url, ""), 2)
            tab = context.new_page()
            for path in PAGES:  # one warming visit of every page
                tab.goto(f"{url}/{path}")
                idle(tab)
            for _ in range(args.rounds):
                tab.goto(url)
                idle(tab)
                for path, title in PAGES.items():
                    if path:
                        times["sidebar"].setdefault(title, []).append(round(by_sidebar(tab, url, path, title), 2))
                        idle(tab)
                for path, title in PAGES.items():
                    times["new tab"].setdefault(title, []).append(round(in_new_tab(context, url, path), 2))
            context.close()
            if context.browser is not None:
                context.browser.close()
    finally:
        server.stop()
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU only",
        "browser": "a profile kept on disk" if args.profile else "an off-the-record context",
        "command": "python " + " ".join(["bench/first_chart.py", *sys.argv[1:]]),
        "rounds": args.rounds,
        "first_view_s": first_view,
        "seconds": times,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
