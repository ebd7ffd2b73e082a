"""What each method costs beyond its kept tokens, measured side by side in one process on one device: the time to
read and compress a prompt (KVzip's reconstruction pass, RocketKV's two stages), the time per decoded token, the K/V
bytes held and the bytes attention read per decoded token (less than those held for the sparse readers, Quest and
RocketKV).

Every policy runs the same prompt (a needle item of exactly ``--context`` tokens) at the same budget, ``--repeats``
times after one untimed run at the same shapes (cuDNN and the allocator plan for each new shape; a first pass can be
several times slower), as a user's run would: the default ``RunSpec`` (static decode steps captured in CUDA graphs
where the policy allows it). Reported: medians over the repeats, the device named.

Usage (the shipped model; any hub id, local directory or GGUF file as --model):
    python bench/method_cost.py --context 4096 --keep 0.25 --policies full,snapkv,kvzip,quest,rocketkv \\
        --out bench/results/method_cost/shipped.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from kvlab.budget import Budget  # noqa: E402
from kvlab.engine.events import GenerationResult  # noqa: E402
from kvlab.engine.generation import generate
from kvlab.engine.spec import RunSpec
from kvlab.models.loading import LoadedModel, load_model  # noqa: E402
from kvlab.policies import Variant  # noqa: E402
from kvlab.runs.sweep import parse_policies  # noqa: E402
from kvlab.tasks.facts import TRAIN_TEMPLATES, make_fact  # noqa: E402
from kvlab.tasks.needle import build_needle, load_haystacks  # noqa: E402
from kvlab.units import MIB  # noqa: E402


def needle_prompt(loaded: LoadedModel, context: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One needle item of exactly ``context`` tokens, as a sweep builds it: its context and question, ``(1, n)``
    each."""
    import random

    rng = random.Random(seed)
    haystack = load_haystacks(loaded.tokenizer)[0]
    fact = make_fact(TRAIN_TEMPLATES[0], rng)
    item = build_needle(loaded.tokenizer, haystack, context, 0.5, fact, rng=rng)
    return item.prompt_ids()


def measured(
    loaded: LoadedModel,
    variant: Variant,
    keep: float,
    ids: torch.Tensor,
    question: torch.Tensor,
    new_tokens: int,
    repeats: int,
) -> dict[str, Any]:
    """Medians over ``repeats`` runs after one untimed run at the same shapes."""
    policy = variant.policy
    budget = Budget(keep=keep) if policy.evicts else None
    spec = RunSpec(policy, budget, max_new_tokens=new_tokens, stop_token_ids=(), cache=variant.cache())
    generate(loaded, ids, spec, suffix_ids=question)
    results: list[GenerationResult] = [generate(loaded, ids, spec, suffix_ids=question) for _ in range(repeats)]
    last = results[-1]
    steady = [statistics.median(r.token_seconds[len(r.token_seconds) // 2 :]) for r in results if r.token_seconds]
    return {
        "policy": policy.name,
        "params": policy.params(),
        "prefill_s": statistics.median(r.prefill_seconds for r in results),
        "reconstruction_s": statistics.median(r.reconstruction_seconds for r in results),
        "decode_ms_per_token": 1000 * statistics.median(steady) if steady else None,
        "kv_bytes": last.kv_bytes,
        "read_bytes_per_token": last.read_bytes_per_token,
        "peak_gpu_bytes": last.peak_gpu_bytes,
        "decode_graphs": last.decode_graphs,
        "kept_per_layer": last.kept_per_layer,
        "answer": last.texts[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="hub id, local directory or GGUF file (default: the shipped)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--keep", type=float, default=0.25)
    parser.add_argument("--policies", default="full,snapkv,expected_attention,kvzip,quest,rocketkv")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    loaded = load_model(args.model, device=args.device)
    ids, question = needle_prompt(loaded, args.context, args.seed)
    rows = [
        measured(loaded, policy, args.keep, ids, question, args.new_tokens, args.repeats)
        for policy in parse_policies(args.policies)
    ]
    device = torch.cuda.get_device_name() if loaded.device.type == "cuda" else "cpu"
    report = {
        "model": Path(loaded.name).name,
        "device": device,
        "dtype": loaded.dtype_name,
        "context": args.context,
        "keep": args.keep,
        "repeats": args.repeats,
        "command": " ".join(sys.argv),
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    for row in rows:
        print(
            f"{row['policy']:20} prefill {row['prefill_s'] * 1000:8.1f} ms"
            f"  decode {row['decode_ms_per_token'] or 0:6.2f} ms/token  held {row['kv_bytes'] / MIB:8.2f} MiB"
            f"  read/token {(row['read_bytes_per_token'] or 0) / MIB:8.2f} MiB"
        )


if __name__ == "__main__":
    main()
