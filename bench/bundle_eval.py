"""How long Chromium's main thread takes to run a Plotly bundle, and then to draw a chart of the Frontier's shape
with it, each bundle in its own off-the-record browser context on this machine.

A page's first chart in a new tab waits for its Plotly bundle to be run (the page's charts' script loads it): this
times that alone, away from Streamlit. Each bundle is loaded once in a context (so that it comes from the browser's
cache, as in a dashboard that has been opened before) and then timed in a second page of that context: from adding
its script element to its ``load`` event, then ``Plotly.newPlot`` of 33 lines of 8 points with whiskers and a
grouped legend (what the Frontier draws for the shipped runs). Bundles alternate, ``--rounds`` times.

Usage: python bench/bundle_eval.py static/plotly-kvlab-4.1.1.min.js OTHER.min.js [--rounds 6]
       [--out bench/results/dashboard/bundle_eval_cpu.json]
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from browser import launch  # noqa: E402

TIMED = """async (source) => {
  const start = performance.now();
  await new Promise((resolve, reject) => {
    const script = document.createElement("script");
    script.src = source;
    script.onload = resolve;
    script.onerror = reject;
    document.head.appendChild(script);
  });
  const loaded = performance.now();
  const x = [...Array(8).keys()];
  const lines = [...Array(33).keys()].map((line) => ({
    type: "scatter", mode: "lines+markers", x, y: x.map((value) => value * line), name: `line ${line}`,
    error_y: { type: "data", array: x.map(() => 1) }, legendgroup: `g${line % 9}`,
    legendgrouptitle: { text: `policy ${line % 9}` },
  }));
  await window.Plotly.newPlot("chart", lines, { legend: { orientation: "h" } });
  return [loaded - start, performance.now() - loaded];
}"""


def serve(folder: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    """A quiet HTTP server for ``folder`` on a free port, in a thread; its address."""
    handler = functools.partial(QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bundles", nargs="+", type=Path)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="kvlab-bundles-"))
    (folder / "index.html").write_text('<html><body><div id="chart" style="width:600px;height:700px"></div></body>')
    names = []
    for index, bundle in enumerate(args.bundles):
        names.append(f"{index}-{bundle.name}")
        (folder / names[-1]).write_bytes(bundle.read_bytes())
    server, url = serve(folder)
    times: dict[str, dict[str, list[float]]] = {bundle.name: {"run_ms": [], "draw_ms": []} for bundle in args.bundles}
    try:
        from playwright.sync_api import sync_playwright

        with sync_playwright() as playwright:
            browser = launch(playwright)
            for _ in range(args.rounds):
                for bundle, name in zip(args.bundles, names):
                    context = browser.new_context()
                    first = context.new_page()
                    first.goto(f"{url}/index.html")
                    first.evaluate(TIMED, f"/{name}")  # into the browser's cache
                    page = context.new_page()
                    page.goto(f"{url}/index.html")
                    run_ms, draw_ms = page.evaluate(TIMED, f"/{name}")
                    times[bundle.name]["run_ms"].append(round(run_ms))
                    times[bundle.name]["draw_ms"].append(round(draw_ms))
                    context.close()
            browser.close()
    finally:
        server.shutdown()
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU only",
        "browser": "Chromium, a new off-the-record context per bundle and round",
        "command": "python " + " ".join(["bench/bundle_eval.py", *sys.argv[1:]]),
        "bytes": {bundle.name: bundle.stat().st_size for bundle in args.bundles},
        "ms": times,
        "median_ms": {
            name: {part: statistics.median(values) for part, values in parts.items()} for name, parts in times.items()
        },
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
