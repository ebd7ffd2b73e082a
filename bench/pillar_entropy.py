"""The attention entropy of a question asked of a cache whose heavy hitters ("pillars") were removed, against the
full cache's, on the needle prompts of ``kvlab sweep`` (the first ``--trials`` of its grid at ``--context``
tokens, needle at a random depth, seed 0).

Each prompt's context is read, compressed (``drop_pillars`` removes the ``count`` tokens with the most accumulated
attention per layer and KV head, sparing the first ``sinks``; the full cache removes nothing), and the question is
read after the compression; kvlab's attention statistics (the hook the live page draws from) give the mean entropy
of the question's queries per layer, over heads and prompts. The needle accuracy of the same configurations comes
from ``kvlab sweep --query-agnostic`` (the store), this only adds what a stored run does not keep.

Usage (the shipped model; any hub id, local directory or GGUF file as --model):
    python bench/pillar_entropy.py --counts 32,205 --trials 20 --out bench/results/pillars/kvlab-tiny-llama.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvlab.attention.stats import StatsRequest  # noqa: E402
from kvlab.engine.generation import Generation  # noqa: E402
from kvlab.engine.spec import RunSpec
from kvlab.models.loading import LoadedModel, load_model  # noqa: E402
from kvlab.policies import Policy, make_policy  # noqa: E402
from kvlab.runs.sweep import SweepGrid, needle_items, prompt_tensors, shape_batches  # noqa: E402


def question_entropy(loaded: LoadedModel, grid: SweepGrid, policy: Policy, batch_size: int) -> list[float]:
    """Per layer, the mean attention entropy (nats) of the questions' queries under ``policy``, over heads and
    prompts (each prompt's mean over its question's queries weighs the same)."""
    context = grid.contexts[0]
    items = needle_items(loaded, grid, context)
    spec = RunSpec(policy, mode="prefill", chunk=grid.chunk, max_new_tokens=0, stats=StatsRequest(1, 1, 1))
    sums: torch.Tensor | None = None
    for batch in shape_batches(items, batch_size, query_aware=False):
        ids, question = prompt_tensors(batch, False, loaded.device)
        for event in Generation(loaded, spec, ids, question).events():
            if event.kind == "prefill" and event.seen_tokens > ids.shape[1] and event.stats is not None:
                entropy = event.stats["entropy"].double().mean(dim=2).sum(dim=1)  # (layers,): summed over prompts
                sums = entropy if sums is None else sums + entropy
    assert sums is not None, "every prompt has a question"
    return [round(float(value) / len(items), 5) for value in sums]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="as kvlab's --model (default: the shipped model)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--context", type=int, default=4096, help="tokens per needle prompt (default 4096)")
    parser.add_argument("--counts", default="32,205", help="heavy hitters removed per layer and KV head")
    parser.add_argument("--sinks", type=int, default=4, help="first tokens never removed (default 4)")
    parser.add_argument("--trials", type=int, default=20, help="prompts (the sweep's first ones)")
    parser.add_argument("--chunk", type=int, default=256, help="context tokens per forward pass, as the sweep")
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--out", type=Path, required=True, help="JSON to write")
    args = parser.parse_args()
    loaded = load_model(args.model, device=args.device)
    policies = [make_policy("full")] + [
        make_policy("drop_pillars", count=int(count), sinks=args.sinks) for count in args.counts.split(",")
    ]
    grid = SweepGrid(
        policies=tuple(policies),
        keeps=(),
        contexts=(args.context,),
        depths=None,
        trials=args.trials,
        chunk=args.chunk,
        query_aware=False,
    )
    grid.check_fits(loaded)
    configurations = []
    for policy in policies:
        entropy = question_entropy(loaded, grid, policy, args.batch_size)
        configurations.append({"policy": policy.name, "params": policy.params(), "entropy": entropy})
        print(f"{policy.name} {policy.params()}: mean entropy {sum(entropy) / len(entropy):.4f} nats", flush=True)
    device = torch.cuda.get_device_name(loaded.device) if loaded.device.type == "cuda" else "CPU"
    result = {
        "model": loaded.source.label,
        "device": device,
        "dtype": loaded.dtype_name,
        "command": "python bench/pillar_entropy.py " + shlex.join(sys.argv[1:]),
        "context": args.context,
        "trials": args.trials,
        "chunk": args.chunk,
        "query_aware": False,
        "configurations": configurations,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
