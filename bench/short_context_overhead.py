"""Does eviction pay below 4K tokens? Time with and without eviction at 1k-4k contexts, side by side in one process.

An article claims that under 4K tokens the overhead of eviction often exceeds its benefit. This times the engine as
users run it (its own per-event seconds, CUDA graphs for decoding where the run allows them) on a haystack prompt
of each length: reading the prompt (with the policy's compression), decoding a fixed number of tokens (no stop
token, so every policy decodes the same count), and the two together, for the full cache and evicting policies at
one kept fraction. Each configuration runs once to warm up (graph capture, kernel selection at that length) and
then ``--repeats`` times at the same shapes; the median is reported with the ratio to the full cache.

    python bench/short_context_overhead.py --model SmolLM2-135M-Instruct.Q4_1.gguf --out bench/results/overhead/x.json

Absolute times mean something only from a GPU; on a CPU only the ratios do.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

import torch

from kvlab.budget import Budget
from kvlab.engine.generation import generate
from kvlab.engine.spec import RunSpec
from kvlab.models.loading import load_model
from kvlab.modes import MODES, PREFILL
from kvlab.policies import make_policy
from kvlab.tasks.items import text_ids
from kvlab.tasks.needle import HAYSTACK_DIR


def timings(loaded, ids: torch.Tensor, spec: RunSpec, repeats: int) -> dict[str, float]:
    """Median prefill, decode and total milliseconds over ``repeats`` runs after one warm-up at the same shapes."""
    generate(loaded, ids, spec)
    runs = [generate(loaded, ids, spec) for _ in range(repeats)]
    prefill = statistics.median(run.prefill_seconds for run in runs) * 1e3
    decode = statistics.median(run.decode_seconds for run in runs) * 1e3
    return {
        "prefill_ms": round(prefill, 3),
        "decode_ms": round(decode, 3),
        "decode_ms_per_token": round(decode / spec.max_new_tokens, 4),
        "total_ms": round(statistics.median((r.prefill_seconds + r.decode_seconds) * 1e3 for r in runs), 3),
        "kv_bytes": runs[-1].peak_kv_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="as kvlab's --model (default: the shipped model)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--contexts", default="1024,2048,3072,4096")
    parser.add_argument("--policies", default="streaming,h2o,snapkv,tova")
    parser.add_argument("--keep", type=float, default=0.5, help="kept fraction for the evicting policies")
    parser.add_argument("--mode", default=PREFILL, choices=MODES)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    loaded = load_model(args.model, device=args.device)
    text = " ".join(path.read_text() for path in sorted(HAYSTACK_DIR.glob("*.txt")))
    every = text_ids(loaded.tokenizer, text, chat=False)
    rows = []
    for context in (int(item) for item in args.contexts.split(",")):
        ids = torch.tensor([every[:context]])
        base = dict(mode=args.mode, max_new_tokens=args.new_tokens, stop_token_ids=())
        full = timings(loaded, ids, RunSpec(policy=make_policy("full"), **base), args.repeats)
        rows.append({"context": context, "policy": "full", "keep": None, **full})
        for name in args.policies.split(","):
            spec = RunSpec(policy=make_policy(name), budget=Budget(keep=args.keep), **base)
            measured = timings(loaded, ids, spec, args.repeats)
            rows.append(
                {
                    "context": context,
                    "policy": name,
                    "keep": args.keep,
                    **measured,
                    "total_vs_full": round(measured["total_ms"] / full["total_ms"], 3),
                    "decode_vs_full": round(measured["decode_ms"] / full["decode_ms"], 3),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    device = torch.cuda.get_device_name(loaded.device) if loaded.device.type == "cuda" else "CPU"
    result = {
        "model": loaded.source.label,
        "device": device,
        "dtype": loaded.dtype_name,
        "mode": args.mode,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "method": "median of the engine's own seconds over repeats after one warm-up run at the same shapes",
        "command": "python bench/short_context_overhead.py " + shlex.join(sys.argv[1:]),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
