#!/usr/bin/env bash
# The side-channel experiment on a GPU (`kvlab sidechannel`, kvlab/experiments/sidechannel.py): an attacker who knows the prompt
# template tries to tell from outside whether a secret canary is still cached after eviction, from the decode time
# per token, the KV bytes and kept tokens an API could report, and the answer to a probing question, with and
# without noise on the policy's ranking. Two policies at 30 % of a 1,024-token context, prefill mode:
#   h2o     accumulated attention plus a recent window; Gaussian and Laplace noise at 0.5 and 2 score spreads
#   snapkv  the pooled attention of the context's last 32 queries, those 32 tokens kept; Gaussian noise at 0.5 and 2
# The canary's depths are where each policy decides its fate on the shipped model: a first run over the default
# range (the last 60 % of the context) found every canary before 85 % of it evicted by both policies, so h2o's
# canaries sit in the last 30 % (its recent window holds the last 15 %) and snapkv's in the last 15 %.
# One JSON per model and policy, every trial included, under bench/results/side_channel (or the first argument),
# which the Side channels page shows. Environment: PYTHON (default .venv/bin/python), KVLAB_SIDE_MODELS (labels as
# `kvlab models` prints them; default: the shipped model and the published one), KVLAB_SIDE_TRIALS (prompts per
# policy, default 200), KVLAB_DEVICE (default: cuda when available).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python="${PYTHON:-.venv/bin/python}"
out="${1:-bench/results/side_channel}"
models="${KVLAB_SIDE_MODELS:-kvlab-tiny-llama SmolLM2-135M-Instruct.Q4_1.gguf}"
trials="${KVLAB_SIDE_TRIALS:-200}"
device=()
if [ -n "${KVLAB_DEVICE:-}" ]; then device=(--device "$KVLAB_DEVICE"); fi
mkdir -p "$out"

for model in $models; do
  common=(--model "$model" "${device[@]}" --keep 0.3 --mode prefill --context 1024 --trials "$trials" --seed 0)
  "$python" -m kvlab sidechannel "${common[@]}" --policy h2o --depths 0.7,1 \
      --noise gaussian --noise laplace --noise-scale 0.5 --noise-scale 2 --out "$out/$model-h2o.json"
  "$python" -m kvlab sidechannel "${common[@]}" --policy snapkv --depths 0.85,1 \
      --noise gaussian --noise-scale 0.5 --noise-scale 2 --out "$out/$model-snapkv.json"
done
