#!/usr/bin/env bash
# The live runs shipped for replaying (kvlab/data/runs/examples.duckdb; the dashboard's Overview and the live page's
# replays read them): one 4,096-token needle prompt (seed 0, depth 0.5) read by the shipped model under every
# policy at 10 % in prefill mode, and by H2O and StreamingLLM in streaming mode, each stored with its replay.
# Recorded on one H100 80GB HBM3; run it on a GPU (a CPU works too, and names itself as the device).
set -euo pipefail
db="${1:-data/runs/examples.duckdb}"
live() { python3 -m kvlab live --context 4096 --depth 0.5 --seed 0 --db "$db" "$@"; }
live --policy full --mode prefill
for policy in h2o snapkv pyramidkv streaming tova; do live --policy "$policy" --keep 0.1 --mode prefill; done
for policy in h2o streaming; do live --policy "$policy" --keep 0.1 --mode streaming; done
