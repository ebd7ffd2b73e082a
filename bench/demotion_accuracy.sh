#!/usr/bin/env bash
# Accuracy recovered by demotion on the published model (SmolLM2-135M-Instruct, 8,192 positions) at its longest
# needle context, with 10% of the context kept on the GPU (keep 0.1): SnapKV deleting what it evicts, SnapKV demoting
# it to pinned CPU memory and recalling 8 pages of 16 tokens per layer and KV head (with and without prefetching),
# and SnapKV deleting at keep 0.17, which holds about as many GPU bytes as the demoting runs do in all (heap, page
# summaries, recalled pages). The question is read after the compression (--query-agnostic): the policy cannot
# know what will be asked, which is where recalling evicted tokens can matter. One store, resumable.
# Then `kvlab runs` prints each run's accuracy with its interval, and McNemar's test pairs them in the dashboard.
# Environment: PYTHON (default .venv/bin/python, else python3), KVLAB_DEVICE, KVLAB_DEMOTION_TRIALS (items per
# depth, default 6), KVLAB_DEMOTION_CONTEXT (default 8100). $1: the store (default bench/results/demotion/accuracy.duckdb).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python="${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"
db="${1:-bench/results/demotion/accuracy.duckdb}"
device=()
if [ -n "${KVLAB_DEVICE:-}" ]; then device=(--device "$KVLAB_DEVICE"); fi
mkdir -p "$(dirname "$db")"
"$python" -m kvlab sweep "${device[@]}" --model SmolLM2-135M-Instruct.Q4_1.gguf \
  --policies "full,snapkv,snapkv[cpu_tier_mib=1024],snapkv[cpu_tier_mib=1024,prefetch=true]" --keep 0.1,0.17 \
  --contexts "${KVLAB_DEMOTION_CONTEXT:-8100}" --trials "${KVLAB_DEMOTION_TRIALS:-6}" --query-agnostic \
  --batch-size 8 --db "$db" --quiet
"$python" -m kvlab runs --db "$db"
