"""Quality passes of several cache configurations over one held-out text, in one process: each the pass
``kvlab quality`` makes (:mod:`kvlab.runs.quality`: perplexity of the scored tokens and KL divergence from the full
cache's predictions), stored as its run in ``--db`` with the same settings, so the same run the command would file.

Each ``--pass MODE:BUDGET:POLICIES`` runs the comma-separated policies (``kvlab sweep --policies`` syntax, cache
options in brackets) in one mode at one budget in tokens (``none`` for none; a policy that takes no budget, the full
cache or an ablation, always runs without one). Every pass reads the same tokens: the prefix, then as many scored
tokens as the most demanding budget needs (at least ``--tokens``).

Usage (the shipped model; any hub id, local directory or GGUF file as --model):
    python bench/heap_quality.py --prefix 3072 --tokens 1024 --db heap.duckdb \\
        --pass 'prefill:none:full' --pass 'prefill:3072:snapkv[hot=0,key_bits=4],snapkv[hot=0,value_bits=2]'
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvlab.budget import Budget  # noqa: E402
from kvlab.cache.layouts import DEFAULT_LAYOUT, LAYOUTS  # noqa: E402
from kvlab.engine.spec import RunSpec
from kvlab.errors import KvlabError  # noqa: E402
from kvlab.models.loading import load_model  # noqa: E402
from kvlab.modes import (  # noqa: E402
    MODES,
    Mode,
    check_mode,  # noqa: E402
)
from kvlab.policies import Variant  # noqa: E402
from kvlab.runs.quality import DEFAULT_TEXT, model_pass, run_quality  # noqa: E402
from kvlab.runs.sweep import parse_policies  # noqa: E402
from kvlab.store import open_store  # noqa: E402
from kvlab.tasks.texts import DEFAULT_PREFIX, read_text, scored_tokens  # noqa: E402
from kvlab.units import exact_bytes  # noqa: E402


def parse_pass(text: str) -> list[tuple[Mode, Variant, Budget | None]]:
    """One ``MODE:BUDGET:POLICIES`` argument as (mode, policy, budget) triples."""
    mode, budget, policies = (text.split(":", 2) + ["", ""])[:3]
    if mode not in MODES or not policies or not (budget == "none" or budget.isdigit()):
        raise KvlabError(f"A pass is written MODE:BUDGET:POLICIES (e.g. prefill:615:h2o,snapkv), not {text!r}.")
    tokens = None if budget == "none" else Budget(tokens=int(budget))
    chosen = parse_policies(policies)
    return [(check_mode(mode), variant, tokens if variant.policy.evicts else None) for variant in chosen]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="hub id, local directory or GGUF file (default: the shipped)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--text", default=None, help=f"a held-out UTF-8 text (default: {DEFAULT_TEXT.name})")
    parser.add_argument("--prefix", type=int, default=DEFAULT_PREFIX, help="tokens read before the first scored one")
    parser.add_argument("--tokens", type=int, default=None, help="scored tokens (default: as kvlab quality)")
    parser.add_argument("--chunk", type=int, default=None, help="prefix tokens per forward pass (as kvlab quality)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layout", default=DEFAULT_LAYOUT, choices=LAYOUTS, help="the heap's layout, as kvlab quality")
    parser.add_argument("--pass", dest="passes", action="append", required=True, metavar="MODE:BUDGET:POLICIES")
    parser.add_argument("--db", required=True, help="DuckDB store every pass is filed in")
    args = parser.parse_args()

    try:
        runs = [run for text in args.passes for run in parse_pass(text)]
        tokens = max(scored_tokens(budget, args.prefix, args.tokens) for _, _, budget in runs)
        path = Path(args.text) if args.text else DEFAULT_TEXT
        text = read_text(path)
        store = open_store(args.db)
        loaded = load_model(args.model, device=args.device, dtype=args.dtype)
        passage = model_pass(loaded, text, path.stem, args.prefix, tokens)
    except KvlabError as error:
        raise SystemExit(str(error)) from None
    print(
        f"{loaded.source.label} on {loaded.device_kind}: {passage.prefix:,} + {passage.scored:,} tokens of {path.stem}"
    )
    for mode, variant, budget in runs:
        spec = RunSpec(
            variant.policy,
            budget,
            mode=mode,
            chunk=args.chunk,
            max_new_tokens=tokens,
            seed=args.seed,
            cache=variant.cache(args.layout),
        )
        started = time.perf_counter()
        quality, run_id = run_quality(loaded, spec, passage, store)
        result = quality.result
        shown = f"{variant.name} {variant.params()}" if variant.params() else variant.name
        print(
            f"{mode:9s} {budget.tokens if budget is not None else 'none':>5} {shown}: perplexity "
            f"{quality.perplexity:.3f} (x{quality.perplexity / quality.full_perplexity:.3f}), KL {quality.kl:.4f} "
            f"nats, KV {exact_bytes(result.kv_bytes)}, ranked {result.ranked_slots:,} slots in "
            f"{result.ranking_seconds:.3f} s, "
            f"run {run_id} ({time.perf_counter() - started:.0f} s)",
            flush=True,
        )
    store.close()


if __name__ == "__main__":
    main()
