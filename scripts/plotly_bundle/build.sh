#!/usr/bin/env bash
# Builds static/plotly-kvlab-<version>.min.js: plotly.js's core (scatter) with the bar and heatmap traces, the only
# traces kvlab's 2D charts draw (kvlab/dashboard/chart_view.py sends any other figure to Streamlit's own element).
#
# Why not plotly.js's cartesian bundle: it also carries box, violin, contour, histograms, pie, image and the world
# calendars (tables of dates run as the script loads); a browser ran it in about 0.37 s of a 2-core machine's main
# thread, and this one in about 0.13 s (bench/results/dashboard/bundle_eval_cpu.json), and a page's first chart waits
# for it in a new tab.
#
# The version is the plotly.js that the installed plotly writes its figures for. Needs node and npm (the package
# registry); nothing else in kvlab does.
# Usage: bash scripts/plotly_bundle/build.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
python="${PYTHON:-$root/.venv/bin/python}"
version="$("$python" -c 'from plotly.offline import get_plotlyjs_version; print(get_plotlyjs_version())')"
esbuild_version=0.28.2
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cp "$here/entry.js" "$work/"
(cd "$work" && npm install --silent --no-audit --no-fund "plotly.js@$version" "esbuild@$esbuild_version" >/dev/null)
out="$root/static/plotly-kvlab-$version.min.js"
{
    printf '/**\n* plotly.js (kvlab: scatter, bar, heatmap - minified) v%s\n' "$version"
    printf '* Copyright 2012-2026, Plotly, Inc. Licensed under the MIT license (static/plotly-LICENSE.txt)\n'
    printf '* Built by scripts/plotly_bundle/build.sh with esbuild %s\n*/\n' "$esbuild_version"
    (cd "$work" && npx esbuild entry.js --bundle --minify --format=iife --define:global=window \
        --loader:.css=empty --legal-comments=eof --log-level=warning)
} >"$out"
cp "$work/node_modules/plotly.js/LICENSE" "$root/static/plotly-LICENSE.txt"
echo "wrote $out ($(wc -c <"$out") bytes)"
