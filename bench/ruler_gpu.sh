#!/usr/bin/env bash
# RULER (kvlab's locally generated suite, every task) for every policy at 25/50/75/90% compression, filed in one
# store, and what KVzip, RocketKV and the other methods cost beyond their kept tokens. Steps, named as arguments:
#   shipped     the shipped model at 4,096 tokens (its limit is 4,608 positions): the full cache and every policy,
#               --trials items per task; the question read after compression (kvpress's setting)
#   published   the published model (SmolLM2-135M-Instruct) at 4,096 tokens, as above
#   long        the published model at 8,128 tokens (its 8,192 positions less the 64 generated), 50% and 75% compression
#   aware       the published model at 4,096 tokens at 50% compression with the question read before compression
#   gemma       the second published model (Gemma 3 270M, sliding-window layers) at 4,096 tokens, 50% and 75%
#               compression, the question read after compression
#   cost        bench/method_cost.py on both models: prefill (KVzip's reconstruction), decode per token, bytes held
#               and read, medians of 3 runs after one at the same shapes
# Sweeps resume: a step cut short runs again without repeating a stored trial.
# Environment: PYTHON (default .venv/bin/python, else python3), KVLAB_RULER_DB (default kvlab/data/runs/ruler.duckdb),
# KVLAB_RESULTS (default bench/results), KVLAB_DEVICE (default: cuda when available), KVLAB_RULER_TRIALS (items per
# task, default 10), KVLAB_RULER_BATCH (default 32).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python="${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"
db="${KVLAB_RULER_DB:-data/runs/ruler.duckdb}"
results="${KVLAB_RESULTS:-bench/results}"
trials="${KVLAB_RULER_TRIALS:-10}"
batch="${KVLAB_RULER_BATCH:-32}"
device=()
if [ -n "${KVLAB_DEVICE:-}" ]; then device=(--device "$KVLAB_DEVICE"); fi
shipped=kvlab-tiny-llama
published=SmolLM2-135M-Instruct.Q4_1.gguf
gemma=gemma-3-270m-q4_k_m.gguf
methods=streaming,h2o,generational,snapkv,pyramidkv,tova,knorm,random,expected_attention,keydiff,chunkkv,kvzip,quest,rocketkv
mkdir -p "$(dirname "$db")"

ruler() {  # one RULER grid: every task, $trials items per task, 64 new tokens (every expected answer fits)
  "$python" -m kvlab sweep "${device[@]}" --task ruler --trials "$trials" --batch-size "$batch" \
    --max-new-tokens 64 --db "$db" --quiet "$@"
}

steps="${*:-shipped published long aware gemma cost}"
for step in $steps; do
  case "$step" in
    shipped) ruler --model "$shipped" --contexts 4096 --policies "full,$methods" --keep 0.75,0.5,0.25,0.1 \
      --query-agnostic ;;
    published) ruler --model "$published" --contexts 4096 --policies "full,$methods" --keep 0.75,0.5,0.25,0.1 \
      --query-agnostic ;;
    long) ruler --model "$published" --contexts 8128 --policies "full,$methods" --keep 0.5,0.25 --query-agnostic ;;
    aware) ruler --model "$published" --contexts 4096 --policies "full,$methods" --keep 0.5 ;;
    gemma) ruler --model "$gemma" --contexts 4096 --policies "full,$methods" --keep 0.5,0.25 --query-agnostic ;;
    cost)
      for model in "$shipped" "$published"; do
        "$python" bench/method_cost.py --model "$model" "${device[@]}" --context 4096 --keep 0.25 \
          --policies "full,snapkv,expected_attention,chunkkv,keydiff,kvzip,quest,rocketkv" \
          --out "$results/method_cost/${model%%.*}.json"
      done ;;
    *) echo "unknown step: $step" >&2; exit 2 ;;
  esac
done
