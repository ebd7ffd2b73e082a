#!/usr/bin/env bash
# The live runs shipped for replaying (kvlab/data/runs/examples.duckdb; the dashboard's Overview and the live page's
# replays read them): one 4,096-token needle prompt (seed 0, depth 0.5) read by the shipped model under every
# policy at 10 % in prefill mode, and by H2O and StreamingLLM in streaming mode, each stored with its replay.
# Then the two published models (SmolLM2, a Llama with strong sinks; Gemma 3, with sliding-window layers) read a
# 2,048-token prompt under the full cache, StreamingLLM in streaming mode and H2O at 25 %. Finally the store is
# copied into a fresh file, which holds the same rows without the space DuckDB leaves behind as it appends.
# The shipped model's runs were recorded on one H100 80GB HBM3, the published models' on a CPU (each run names its
# device); a CPU takes about five minutes for the published models' runs.
set -euo pipefail
db="${1:-data/runs/examples.duckdb}"
live() { python3 -m kvlab live --context 4096 --depth 0.5 --seed 0 --db "$db" "$@"; }
live --policy full --mode prefill
for policy in h2o snapkv pyramidkv streaming tova; do live --policy "$policy" --keep 0.1 --mode prefill; done
for policy in h2o streaming; do live --policy "$policy" --keep 0.1 --mode streaming; done
for model in SmolLM2-135M-Instruct.Q4_1.gguf gemma-3-270m-q4_k_m.gguf; do
  published() { python3 -m kvlab live --model "$model" --context 2048 --depth 0.5 --seed 0 --db "$db" "$@"; }
  published --policy full --mode prefill
  published --policy streaming --keep 0.25 --mode streaming
  published --policy h2o --keep 0.25 --mode prefill
done
python3 - "$db" <<'PY'
import os, sys, duckdb
db = sys.argv[1]
fresh = db + ".fresh"
with duckdb.connect() as connection:
    connection.execute(f"ATTACH '{db}' AS source (READ_ONLY)")
    connection.execute(f"ATTACH '{fresh}' AS target")
    connection.execute("COPY FROM DATABASE source TO target")
os.replace(fresh, db)
PY
