#!/usr/bin/env bash
# The measurements behind the Claims page and `python -m kvlab claims`, on the shipped model and the published one,
# each run the way users run it:
#   needle    the needle table at 4,096 tokens: `kvlab sweep`, every policy, both modes, 10-90% pruning
#   sinks     the attention-sink ablation: `bench/sink_ablation.py` (`kvlab quality` passes: full cache, first
#             token removed, StreamingLLM with 0, 1, 4, 8, 32 sinks at budgets of 64, 128 and 256 tokens)
#   overhead  eviction below 4K tokens: `bench/short_context_overhead.py` (time with and without eviction)
#   profile   attention on the first token and entropy per layer: `bench/attention_profile.py`
#   claims    `kvlab claims --refresh`: every claim evaluated against the store and the JSONs, written into the store
# Every run goes into one store (default kvlab/data/runs/claims.duckdb, the evidence the Claims page shows), every JSON
# under bench/results (or $KVLAB_RESULTS). Name steps as arguments to run only those (default: all, in that order).
# Environment: PYTHON (default .venv/bin/python), KVLAB_CLAIMS_DB, KVLAB_RESULTS, KVLAB_CLAIM_MODELS (labels as
# `kvlab models` prints them), KVLAB_NEEDLE_TRIALS (trials per cell, default 100), KVLAB_DEVICE (default: cuda
# when available).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python="${PYTHON:-.venv/bin/python}"
db="${KVLAB_CLAIMS_DB:-data/runs/claims.duckdb}"
results="${KVLAB_RESULTS:-bench/results}"
models="${KVLAB_CLAIM_MODELS:-kvlab-tiny-llama SmolLM2-135M-Instruct.Q4_1.gguf}"
trials="${KVLAB_NEEDLE_TRIALS:-100}"
device=()
if [ -n "${KVLAB_DEVICE:-}" ]; then device=(--device "$KVLAB_DEVICE"); fi
steps="${*:-needle sinks overhead profile claims}"
mkdir -p "$(dirname "$db")"

for step in $steps; do
  for model in $models; do
    case "$step" in
      needle)
        "$python" -m kvlab sweep --model "$model" "${device[@]}" \
          --policies full,streaming,h2o,snapkv,pyramidkv,tova,knorm,random --keep 0.9,0.7,0.5,0.3,0.1 \
          --mode prefill,streaming --contexts 4096 --depths random --trials "$trials" --batch-size 50 --chunk 256 \
          --db "$db" --quiet
        ;;
      sinks)
        for budget in 64 128 256; do
          "$python" bench/sink_ablation.py --model "$model" "${device[@]}" --budget "$budget" --prefix 256 \
            --tokens 1024 --db "$db" --out "$results/sinks/$model-budget-$budget.json"
        done
        ;;
      overhead)
        "$python" bench/short_context_overhead.py --model "$model" "${device[@]}" --contexts 1024,2048,3072,4096 \
          --policies streaming,h2o,snapkv,tova --keep 0.5 --new-tokens 64 --repeats 5 \
          --out "$results/overhead/$model.json"
        ;;
      profile)
        "$python" bench/attention_profile.py --model "$model" "${device[@]}" --tokens 2048 --chunk 256 \
          --out "$results/attention/$model.json"
        ;;
      claims) ;;
      *) echo "unknown step $step (needle, sinks, overhead, profile, claims)" >&2; exit 2 ;;
    esac
  done
  if [ "$step" = claims ]; then "$python" -m kvlab claims --db "$db" --refresh; fi
done
