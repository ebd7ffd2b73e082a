#!/usr/bin/env bash
# What sharing the prefill saves on a GPU: the claim's prefill-mode cells (7 policies x 5 kept fractions, 4,096
# tokens, 100 trials per cell) with one shared prefill per batch, then with every cell reading for itself.
set -euo pipefail
out="${1:-bench/results/sharing_gpu}"
python bench/needle_claim.py --policies h2o,streaming,random,snapkv,pyramidkv,tova,knorm --trials 1 \
    --batch-size 50 --measure-sharing --sharing-trials 100 --out-dir "$out"
