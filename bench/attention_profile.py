"""Attention on the first token and attention entropy, per layer, of any model kvlab loads.

Attention sinks (StreamingLLM) show as a large share of every query's attention landing on the first token; the
articles also claim early layers spread attention widely (high entropy) and deep layers focus it. This reads a text
with the full cache through kvlab's own attention (its statistics hook, the one the live page draws from), in
chunks, and averages each layer's first-token share and entropy over the queries of every chunk but the first:
queries near the start of a text see only a few keys, and their share of the first token says nothing about sinks.
The first-token share counts only the queries that can see the first token: on a sliding-window layer, those whose
window still reaches it (the others put nothing there because they cannot, which says nothing about sinks either).

    python bench/attention_profile.py --model kvlab/data/models/kvlab-tiny-llama
    python bench/attention_profile.py --model path/to/SmolLM2-135M-Instruct.Q4_1.gguf

Writes ``bench/results/attention/<model label>.json``: model, device, command, tokens, and per layer the mean
first-token share and entropy (nats), head-averaged, and the largest head's share.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch

from kvlab.attention.stats import StatsRequest
from kvlab.engine.generation import Generation
from kvlab.engine.spec import RunSpec
from kvlab.models.loading import load_model
from kvlab.policies import make_policy
from kvlab.tasks.items import text_ids
from kvlab.tasks.needle import HAYSTACK_DIR

RESULTS = Path(__file__).resolve().parent / "results" / "attention"


def profile(loaded, ids: torch.Tensor, chunk: int) -> list[dict[str, float | int]]:
    """Per layer: the first-token share and entropy of attention, averaged over the queries of chunks 2 onwards
    (entropy: each chunk's mean over its queries, equal chunks weighing equally; first-token share: over the queries
    that could see the first token, each chunk weighed by how many could, a layer none could see it from at 0)."""
    spec = RunSpec(
        policy=make_policy("full"), chunk=chunk, max_new_tokens=0, stats=StatsRequest(n_sink=1, n_bins=1, span=1)
    )
    shares, seeing, entropies = [], [], []
    for event in Generation(loaded, spec, ids).events():
        if event.kind == "prefill" and event.stats is not None and event.seen_tokens > chunk:
            shares.append(event.stats["sink_mass"][:, 0].float())  # (layers, q_heads) of the first sequence
            seeing.append(event.stats["sink_queries"][:, 0].float())
            entropies.append(event.stats["entropy"][:, 0].float())
    if not shares:
        raise SystemExit(f"the text must be longer than one chunk ({chunk} tokens) to profile")
    share = first_token_share(torch.stack(shares), torch.stack(seeing))
    entropy = torch.stack(entropies).mean(0)
    return [
        {
            "layer": layer,
            "first_token_share": round(float(share[layer].mean()), 4),
            "first_token_share_max_head": round(float(share[layer].max()), 4),
            "entropy": round(float(entropy[layer].mean()), 4),
        }
        for layer in range(share.shape[0])
    ]


def first_token_share(shares: torch.Tensor, seeing: torch.Tensor) -> torch.Tensor:
    """Chunks' first-token shares ``(chunks, layers, q_heads)``, each a mean over the ``seeing`` queries that could
    see the first token, averaged over all those queries (0 where none could)."""
    return (shares * seeing).sum(0) / seeing.sum(0).clamp_min(1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="as kvlab's --model (default: the shipped model)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of haystack text to read")
    parser.add_argument("--chunk", type=int, default=256, help="tokens per forward pass")
    parser.add_argument("--out", type=Path, default=None, help="JSON to write (default: under bench/results)")
    args = parser.parse_args()
    loaded = load_model(args.model, device=args.device)
    text = " ".join(path.read_text() for path in sorted(HAYSTACK_DIR.glob("*.txt")))
    ids = torch.tensor([text_ids(loaded.tokenizer, text, chat=False)[: args.tokens]])
    layers = profile(loaded, ids, args.chunk)
    device = torch.cuda.get_device_name(loaded.device) if loaded.device.type == "cuda" else "CPU"
    result = {
        "model": loaded.source.label,
        "device": device,
        "dtype": loaded.dtype_name,
        "command": "python bench/attention_profile.py " + shlex.join(sys.argv[1:]),
        "tokens": int(ids.shape[1]),
        "chunk": args.chunk,
        "text": "kvlab/data/haystacks (Python documentation), read as plain text",
        "layers": layers,
    }
    out = args.out or RESULTS / f"{loaded.source.label}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    top = max(layers, key=lambda row: row["first_token_share"])
    print(
        f"{loaded.source.label} on {device}: largest mean first-token share {top['first_token_share']} (layer "
        f"{top['layer']}); entropy of the first layer {layers[0]['entropy']}, of the last {layers[-1]['entropy']}; "
        f"written to {out}"
    )


if __name__ == "__main__":
    main()
