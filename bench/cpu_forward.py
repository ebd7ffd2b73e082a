"""Time one forward pass of the default model over a 4096-token context on the CPU, and record it as JSON.

    python bench/cpu_forward.py                # the shipped model, float32, SDPA attention
    python bench/cpu_forward.py --attn eager   # the same with eager attention (what attention capture uses)

One warm-up pass on a short input, then ``--repeats`` timed passes over ``--tokens`` random token ids; the median is
reported. The result (with the machine's CPU count and the torch version) goes to ``bench/cpu_forward.json``
(``bench/cpu_forward_eager.json`` for eager attention).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "kvlab" / "data" / "models" / "kvlab-tiny-llama"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    parser.add_argument("--out", type=Path, help="default: bench/cpu_forward.json (cpu_forward_eager.json for eager)")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation=args.attn)
    model.eval()
    ids = torch.randint(3, model.config.vocab_size, (1, args.tokens))
    ids[0, 0] = model.config.bos_token_id
    with torch.inference_mode():
        model(ids[:, :256])
        seconds = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            model(ids)
            seconds.append(time.perf_counter() - start)
    result = {
        "command": "python bench/cpu_forward.py" + (f" --attn {args.attn}" if args.attn != "sdpa" else ""),
        "model": args.model.name,
        "attention": args.attn,
        "dtype": "float32",
        "tokens": args.tokens,
        "seconds": [round(s, 3) for s in seconds],
        "median_s": round(statistics.median(seconds), 3),
        "machine": f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), "
        f"torch {torch.__version__} with {torch.get_num_threads()} threads",
    }
    print(json.dumps(result, indent=2))
    out = args.out or ROOT / "bench" / ("cpu_forward.json" if args.attn == "sdpa" else "cpu_forward_eager.json")
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
