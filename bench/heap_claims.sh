#!/usr/bin/env bash
# The GPU evidence of the claims on the cache as a managed heap (claims 12, 13, 16, 21, 27 and 35; claim 18 comes
# from `kvlab sidechannel`): needle accuracy at 4,096 tokens (100 random-depth trials per cell) and the perplexity
# and KL divergence of a held-out text (a 3,072-token prefix and 1,024 scored tokens), each against the measured
# KV bytes, every run the way users run it and filed in one store. Steps, named as arguments (run in that order):
#   budgets     SnapKV with uniform, preset, entropy-profiled and CAKE layer budgets and Ada-KV heads at 10/20/30%
#               kept; the preset again at 85% of those fractions (claim 12)
#   precision   every token kept at K8, K4, K2, V8, V4, V2 and K4/V2 bits (claim 27); H2O and SnapKV keeping 20%
#               with a quarter of it at 16 bits and the rest at 4 (claim 16), and keeping 10% at 4 bits (claim 35)
#   generational  the generational cache (default tiers, and a 10% middle) against H2O in streaming mode keeping 20%,
#               decoded eagerly so that every ranking is timed, in the compact layout (claim 21)
#   pillars     the heavy hitters removed (32 and 205 per layer and KV head) beside the full cache, the question read
#               after compression, and the question's attention entropy (bench/pillar_entropy.py) (claim 13)
#   quality     the claims' text passes (bench/heap_quality.py): the full cache, K4, K2 and V2, the hybrid
#   frontier    the other text passes: the allocations at 615 tokens, K8/V8/V4, 4 bits keeping 308, and the
#               generational cache against H2O in streaming mode (compact layout)
#   claims      `kvlab claims --refresh`: every claim evaluated against the store (needs no GPU)
# Parts of at most 8 minutes each on one H100 80GB HBM3 (estimated from the store's earlier timings):
#   KVLAB_CLAIM_MODELS=kvlab-tiny-llama bash bench/heap_claims.sh budgets precision generational pillars quality
#   KVLAB_CLAIM_MODELS=kvlab-tiny-llama bash bench/heap_claims.sh frontier
#   KVLAB_CLAIM_MODELS=SmolLM2-135M-Instruct.Q4_1.gguf bash bench/heap_claims.sh budgets precision
#   KVLAB_CLAIM_MODELS=SmolLM2-135M-Instruct.Q4_1.gguf bash bench/heap_claims.sh generational pillars quality
# Sweeps resume (a part cut short runs again without repeating a stored trial); text passes are measured again.
# Environment: PYTHON (default .venv/bin/python, else python3), KVLAB_CLAIMS_DB (default kvlab/data/runs/claims.duckdb),
# KVLAB_RESULTS (default bench/results), KVLAB_CLAIM_MODELS (labels as `kvlab models` prints them; default both
# shipped models), KVLAB_DEVICE (default: cuda when available), KVLAB_WHEELS (a folder of wheels, e.g. duckdb and the
# published model's package, installed first into a folder of their own on PYTHONPATH, for a machine without them).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python="${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"
db="${KVLAB_CLAIMS_DB:-data/runs/claims.duckdb}"
results="${KVLAB_RESULTS:-bench/results}"
models="${KVLAB_CLAIM_MODELS:-kvlab-tiny-llama SmolLM2-135M-Instruct.Q4_1.gguf}"
device=()
if [ -n "${KVLAB_DEVICE:-}" ]; then device=(--device "$KVLAB_DEVICE"); fi
if [ -n "${KVLAB_WHEELS:-}" ]; then
  site="$(mktemp -d)"
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$KVLAB_WHEELS"/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
steps="${*:-budgets precision generational pillars quality frontier claims}"
mkdir -p "$(dirname "$db")"

allocations='snapkv,snapkv[layer_allocation=preset],snapkv[layer_allocation=entropy],snapkv[layer_allocation=cake],snapkv[head_allocation=adakv]'
bits='snapkv[hot=0,key_bits=8],snapkv[hot=0,key_bits=4],snapkv[hot=0,key_bits=2],snapkv[hot=0,value_bits=8],snapkv[hot=0,value_bits=4],snapkv[hot=0,value_bits=2],snapkv[hot=0,key_bits=4,value_bits=2]'
hybrid='h2o[hot=0.25,key_bits=4,value_bits=4],snapkv[hot=0.25,key_bits=4,value_bits=4]'
quantised='h2o[hot=0,key_bits=4,value_bits=4],snapkv[hot=0,key_bits=4,value_bits=4]'

sweep() {  # the needle grid of the claims: 4,096 tokens, 100 random-depth trials per cell
  "$python" -m kvlab sweep --model "$model" "${device[@]}" --contexts 4096 --depths random --trials 100 \
    --batch-size 50 --chunk 256 --db "$db" --quiet "$@"
}
passes() {  # text passes: 1,024 scored tokens after a 3,072-token prefix of the default held-out text
  "$python" bench/heap_quality.py --model "$model" "${device[@]}" --prefix 3072 --tokens 1024 --db "$db" "$@"
}

for step in $steps; do
  for model in $models; do
    case "$step" in
      budgets)
        sweep --policies "full,$allocations" --keep 0.1,0.2,0.3 --mode prefill
        sweep --policies 'snapkv[layer_allocation=preset]' --keep 0.085,0.17,0.255 --mode prefill
        ;;
      precision)
        sweep --policies "full,$bits" --keep 1 --mode prefill
        sweep --policies "full,h2o,snapkv,$hybrid" --keep 0.2 --mode prefill
        sweep --policies "full,h2o,snapkv,$quantised" --keep 0.1 --mode prefill
        ;;
      generational)
        sweep --policies 'generational,generational[middle=0.1],h2o' --keep 0.2 --mode streaming --eager \
          --layout compact
        ;;
      pillars)
        sweep --policies 'full,drop_pillars[count=32],drop_pillars[count=205]' --mode prefill --query-agnostic
        "$python" bench/pillar_entropy.py --model "$model" "${device[@]}" --counts 32,205 --trials 20 \
          --out "$results/pillars/$model.json"
        ;;
      quality)
        passes --pass 'prefill:none:full' \
          --pass 'prefill:3072:snapkv[hot=0,key_bits=4],snapkv[hot=0,key_bits=2],snapkv[hot=0,value_bits=2]' \
          --pass 'prefill:615:h2o[hot=0.25,key_bits=4,value_bits=4]'
        ;;
      frontier)
        passes --pass "prefill:615:$allocations" \
          --pass 'prefill:3072:snapkv[hot=0,key_bits=8],snapkv[hot=0,value_bits=8],snapkv[hot=0,value_bits=4]' \
          --pass 'prefill:308:snapkv,snapkv[hot=0,key_bits=4,value_bits=4]'
        passes --pass 'streaming:615:generational,generational[middle=0.1],h2o' --layout compact
        ;;
      claims) ;;
      *)
        echo "unknown step $step (budgets, precision, generational, pillars, quality, frontier, claims)" >&2
        exit 2
        ;;
    esac
  done
  if [ "$step" = claims ]; then "$python" -m kvlab claims --db "$db" --refresh; fi
done
