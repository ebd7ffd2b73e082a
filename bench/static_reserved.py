"""What static decode steps reserve after prefill mode's compression, against eager decoding: the bytes of K/V held
and reserved at the end of a run (the tensors the heap holds), for SnapKV in prefill mode at keep 10% in each layout,
on the model shipped with kvlab. Static steps used to grow every compacted layer back to the whole context before
decoding; they now keep the survivors' size plus the tokens still to come, as eager decoding does.

Usage: ``python bench/static_reserved.py [--context 4096] [--out bench/results/heap/static_reserved_cpu.json]``
(``--device cuda`` on a GPU).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvlab.budget import Budget  # noqa: E402
from kvlab.cache.layouts import LAYOUTS  # noqa: E402
from kvlab.cache.spec import CacheSpec  # noqa: E402
from kvlab.engine.generation import generate  # noqa: E402
from kvlab.engine.spec import RunSpec  # noqa: E402
from kvlab.models.loading import load_model  # noqa: E402
from kvlab.paths import shipped  # noqa: E402
from kvlab.policies import make_policy  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    loaded = load_model(str(shipped("models", "kvlab-tiny-llama")), device=args.device)
    ids = torch.randint(10, 1000, (1, args.context), generator=torch.Generator().manual_seed(0)).to(args.device)
    rows = []
    for layout in LAYOUTS:
        for static in (False, True):
            spec = RunSpec(
                make_policy("snapkv"),
                Budget(keep=0.1),
                mode="prefill",
                cache=CacheSpec(layout),
                max_new_tokens=args.new_tokens,
                stop_token_ids=(),
                static=static,
            )
            result = generate(loaded, ids, spec)
            row = {
                "layout": layout,
                "decode": "static" if static else "eager",
                "kv_bytes": result.kv_bytes,
                "kv_reserved_bytes": result.kv_reserved_bytes,
                "kv_bytes_full": result.kv_bytes_full,
                "tokens": result.tokens[0],
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    header = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "model": "kvlab-tiny-llama",
        "context": args.context,
        "command": " ".join(["python", "bench/static_reserved.py", *sys.argv[1:]]),
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**header, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
