"""The attention-sink ablation on one model: the perplexity of a held-out text, and the KL divergence of each
next-token distribution from the full cache's, with the full cache, with only the first token removed
(``drop_first``), and with StreamingLLM keeping 0, 1, 4, 8 and 32 sinks at one budget, in streaming mode over at
least 1,000 scored tokens past the budget. Every pass is the one ``kvlab quality`` runs (``kvlab.runs.quality``),
stored as a run in ``--db``; the summary goes to ``--out`` as JSON.

Usage (the shipped model on a CPU; any hub id, local directory or GGUF file as --model):
    python bench/sink_ablation.py --budget 256 --prefix 256 --tokens 1024 --db sinks.duckdb \
        --out bench/results/sinks/shipped_cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvlab.budget import Budget  # noqa: E402
from kvlab.engine.spec import RunSpec  # noqa: E402
from kvlab.models.loading import load_model  # noqa: E402
from kvlab.policies import make_policy  # noqa: E402
from kvlab.runs.quality import DEFAULT_TEXT, model_pass, run_quality  # noqa: E402
from kvlab.store import open_store  # noqa: E402
from kvlab.tasks.texts import DEFAULT_PREFIX, read_text, scored_tokens  # noqa: E402

SINK_COUNTS = (0, 1, 4, 8, 32)
#: (policy, parameters, whether it takes the budget): the full cache, the first-token ablation, StreamingLLM.
CONFIGURATIONS: tuple[tuple[str, dict[str, int], bool], ...] = (
    ("full", {}, False),
    ("drop_first", {}, False),
    *(("streaming", {"sinks": sinks}, True) for sinks in SINK_COUNTS),
)


def label(policy: str, params: dict[str, int]) -> str:
    if policy == "streaming":
        return f"streaming, {params['sinks']} sinks"
    return {"full": "full cache", "drop_first": "first token removed"}[policy]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="hub id, local directory or GGUF file (default: the shipped)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--text", default=None, help=f"a held-out UTF-8 text (default: {DEFAULT_TEXT.name})")
    parser.add_argument("--budget", type=int, default=256, help="StreamingLLM's tokens per layer and KV head")
    parser.add_argument("--prefix", type=int, default=DEFAULT_PREFIX)
    parser.add_argument("--tokens", type=int, default=None, help="scored tokens (default: as kvlab quality)")
    parser.add_argument("--chunk", type=int, default=None, help="prefix tokens per forward pass (default 256)")
    parser.add_argument("--db", required=True, help="DuckDB store every pass is filed in")
    parser.add_argument("--out", required=True, help="the JSON summary")
    args = parser.parse_args()

    budget = Budget(tokens=args.budget)
    tokens = scored_tokens(budget, args.prefix, args.tokens)  # at least 1,000 past the budget, checked first
    path = Path(args.text) if args.text else DEFAULT_TEXT
    text = read_text(path)
    store = open_store(args.db)
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    passage = model_pass(loaded, text, path.stem, args.prefix, tokens)
    device = torch.cuda.get_device_name(loaded.device) if loaded.device.type == "cuda" else "CPU"
    rows = []
    for policy, params, budgeted in CONFIGURATIONS:
        spec = RunSpec(make_policy(policy, **params), budget if budgeted else None, mode="streaming", chunk=args.chunk)
        started = time.perf_counter()
        quality, run_id = run_quality(loaded, spec, passage, store)
        figures = quality.to_json()
        rows.append(
            {
                "configuration": label(policy, params),
                "policy": policy,
                "params": params,
                "budget_tokens": quality.result.budget_tokens,
                "perplexity": quality.perplexity,
                "ratio_to_full": quality.perplexity / quality.full_perplexity,
                "kl": quality.kl,
                "full_perplexity": quality.full_perplexity,
                **{key: figures[key] for key in ("kept_tokens", "kv_bytes", "peak_kv_bytes", "decode_seconds")},
                "wall_seconds": time.perf_counter() - started,
                "run_id": run_id,
            }
        )
        row = rows[-1]
        print(
            f"{row['configuration']:22s} perplexity {row['perplexity']:9.3f}  x{row['ratio_to_full']:6.3f}  "
            f"KL {row['kl']:.4f} nats  kept {row['kept_tokens']:5d}  ({row['wall_seconds']:.0f} s)",
            flush=True,
        )
    summary = {
        "model": loaded.source.label,
        "device": device,
        "dtype": loaded.dtype_name,
        "text": passage.name,
        "budget": args.budget,
        "prefix": passage.prefix,
        "tokens": passage.scored,
        "mode": "streaming",
        "command": "python " + " ".join(sys.argv),
        "configurations": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    store.close()


if __name__ == "__main__":
    main()
