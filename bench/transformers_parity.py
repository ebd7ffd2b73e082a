"""kvlab's full cache against transformers on one device: the last prompt position's logits and the greedy tokens.

A random-weight model of a named shape (built from a transformers config, nothing downloaded) reads one prompt of
random tokens. transformers' own forward in float32 with its eager attention is the reference; transformers in the
run's dtype (eager and SDPA attention) shows how far that dtype alone moves the logits; kvlab's ``full`` runs in
every mode, chunking and attention backend asked for. A kvlab row whose logits sit much further from the reference
than transformers' own row in the same dtype, or whose greedy tokens part from transformers' early, points at a
kvlab path that is wrong on this device.

Usage: ``python bench/transformers_parity.py --shape gemma3-270m --contexts 1024,4096 --out parity.json``
(``--device cpu --dtype float32`` runs the same on a CPU).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvlab.engine.generation import Generation  # noqa: E402
from kvlab.engine.spec import RunSpec  # noqa: E402
from kvlab.models.loading import wrap_model  # noqa: E402
from kvlab.policies import make_policy  # noqa: E402

#: Model shapes by name: the config class's name in transformers and its arguments.
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    # Gemma 3 270M's attention: 4 query heads over 1 KV head of 256, five sliding layers of 512 per global one
    "gemma3-270m": (
        "Gemma3TextConfig",
        dict(
            vocab_size=32768,
            hidden_size=640,
            intermediate_size=2048,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            sliding_window=512,
            layer_types=["sliding_attention"] * 5 + ["full_attention"],
            query_pre_attn_scalar=256,
            rope_theta=1_000_000.0,
            max_position_embeddings=32768,
        ),
    ),
    "llama": (
        "LlamaConfig",
        dict(
            vocab_size=32768,
            hidden_size=512,
            intermediate_size=1536,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            max_position_embeddings=32768,
        ),
    ),
}

#: kvlab configurations: (label, mode, chunk, attention backend, static steps).
VARIANTS: list[tuple[str, str, int | None, str, bool | None]] = [
    ("prefill sdpa", "prefill", None, "sdpa", None),
    ("prefill sdpa chunk 256", "prefill", 256, "sdpa", None),
    ("prefill sdpa eager decode", "prefill", None, "sdpa", False),
    ("prefill flex", "prefill", None, "flex", None),
    ("streaming sdpa", "streaming", 256, "sdpa", None),
    ("streaming flex", "streaming", 256, "flex", None),
]


def build(shape: str, device: str, dtype: torch.dtype, attention: str) -> Any:
    """The shape's model with weights drawn from one seed, so every build holds the same weights."""
    import transformers

    config_name, arguments = SHAPES[shape]
    config = getattr(transformers, config_name)(**arguments, attn_implementation=attention)
    causal_lm = transformers.AutoModelForCausalLM.from_config(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, parameter in causal_lm.named_parameters():
            if "norm" in name:
                parameter.normal_(0.0, 0.1)
            else:
                parameter.normal_(0.0, 0.05)
    return causal_lm.to(device=device, dtype=dtype).eval()


def hf_run(model: Any, ids: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, list[int]]:
    """transformers' last-position logits (float32, on the CPU) and its greedy tokens."""
    with torch.no_grad():
        logits = model(ids).logits[0, -1].float().cpu()
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens)
    return logits, out[0, ids.shape[1] :].tolist()


def kvlab_run(model: Any, ids: torch.Tensor, new_tokens: int, variant: tuple) -> tuple[torch.Tensor, list[int]]:
    """kvlab's ``full`` in one configuration: the logits its prefill's last chunk gave and its greedy tokens."""
    _, mode, chunk, attention, static = variant
    spec = RunSpec(
        make_policy("full"),
        mode=mode,
        chunk=chunk,
        max_new_tokens=new_tokens,
        stop_token_ids=(),
        attention=attention,
        static=static,
    )
    generation = Generation(wrap_model(model), spec, ids)
    last = None
    for event in generation.events():
        if event.kind == "prefill":
            last = event.logits
    assert last is not None
    return last.reshape(-1, last.shape[-1])[-1].float().cpu(), generation.result().tokens[0]


def compare(logits: torch.Tensor, tokens: list[int], reference: torch.Tensor, hf_tokens: list[int]) -> dict:
    """How far ``logits`` are from the float32 reference and how long ``tokens`` follow transformers' own."""
    agreed = next((i for i, (a, b) in enumerate(zip(tokens, hf_tokens, strict=False)) if a != b), len(tokens))
    return {
        "max_abs": round(float((logits - reference).abs().max()), 4),
        "cosine": round(float(torch.nn.functional.cosine_similarity(logits, reference, dim=0)), 5),
        "argmax_same": int(logits.argmax()) == int(reference.argmax()),
        "tokens_agreed": agreed,
        "tokens": tokens[:8],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="gemma3-270m", choices=sorted(SHAPES))
    parser.add_argument("--contexts", default="1024,4096")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--only", default="", help="'|'-separated variant labels (default: all)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    wanted = set(args.only.split("|")) if args.only else None
    variants = [v for v in VARIANTS if wanted is None or v[0] in wanted]
    reference_model = build(args.shape, args.device, torch.float32, "eager")
    hf_models = {name: build(args.shape, args.device, dtype, name) for name in ("eager", "sdpa")}
    kvlab_model = build(args.shape, args.device, dtype, "sdpa")
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        generator = torch.Generator().manual_seed(context)
        ids = torch.randint(3, SHAPES[args.shape][1]["vocab_size"], (1, context), generator=generator).to(args.device)
        reference, reference_tokens = hf_run(reference_model, ids, args.new_tokens)
        _, hf_tokens = hf_run(hf_models["eager"], ids, args.new_tokens)
        for name, model in hf_models.items():
            logits, tokens = hf_run(model, ids, args.new_tokens)
            rows.append(
                {"context": context, "run": f"transformers {name}", **compare(logits, tokens, reference, hf_tokens)}
            )
            print(rows[-1], flush=True)
        rows.append({"context": context, "run": "transformers eager float32", "tokens": reference_tokens[:8]})
        for variant in variants:
            try:
                logits, tokens = kvlab_run(kvlab_model, ids, args.new_tokens, variant)
                row = {
                    "context": context,
                    "run": f"kvlab {variant[0]}",
                    **compare(logits, tokens, reference, hf_tokens),
                }
            except Exception as error:  # a configuration that fails is a finding too
                row = {"context": context, "run": f"kvlab {variant[0]}", "error": f"{type(error).__name__}: {error}"}
            rows.append(row)
            print(row, flush=True)
    result = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "shape": args.shape,
        "dtype": args.dtype,
        "rows": rows,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
