"""The ``generate``, ``policies`` and ``models`` commands: one prompt under a policy, the list of policies, and the
models found on this machine."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from typing import TYPE_CHECKING

from kvlab.cache.spec import CacheOptions
from kvlab.cli.options import (
    add_bos_argument,
    add_generation_arguments,
    add_heap_arguments,
    add_model_arguments,
    add_policy_arguments,
    load_model_from_args,
    run_spec_from_args,
)
from kvlab.errors import KvlabError
from kvlab.models.catalog import available_models
from kvlab.params import param_spec
from kvlab.tasks.texts import read_text
from kvlab.units import exact_bytes

if TYPE_CHECKING:  # the engine imports torch; the parser must not
    from kvlab.engine.events import GenerationResult
    from kvlab.engine.spec import RunSpec


def register(commands: argparse._SubParsersAction) -> None:
    """Add the ``generate`` and ``policies`` commands."""
    generate = commands.add_parser("generate", help="generate from a prompt under a budgeted KV cache")
    add_model_arguments(generate)
    prompt = generate.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the prompt text")
    prompt.add_argument("--prompt-file", help="a UTF-8 file holding the prompt")
    add_policy_arguments(generate)
    add_heap_arguments(generate)
    add_bos_argument(generate)
    add_generation_arguments(generate, default=32)
    generate.add_argument(
        "--raw-prompt",
        action="store_true",
        help="give a chat model the prompt as it is (by default it is wrapped in the model's chat template as one "
        "user turn)",
    )
    generate.add_argument("--json", action="store_true", help="print one JSON object with the figures")
    generate.set_defaults(func=run_generate)

    policies = commands.add_parser("policies", help="list the eviction policies and their parameters")
    policies.set_defaults(func=run_policies)

    models = commands.add_parser(
        "models", help="list the models on this machine (shipped, installed packages, Hugging Face cache)"
    )
    models.add_argument("--json", action="store_true", help="print one JSON object per model")
    models.set_defaults(func=run_models)


def _read_prompt(args: argparse.Namespace) -> str:
    """The prompt's text; an empty one is refused (the model would read nothing but its start token)."""
    text = args.prompt if args.prompt is not None else read_text(args.prompt_file, "prompt file")
    if not text.strip():
        raise KvlabError("The prompt is empty; give some text to read.")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise KvlabError("The prompt holds text that is not valid Unicode (a lone surrogate).") from None
    return text


def run_generate(args: argparse.Namespace) -> int:
    """Generate from one prompt under a policy and print the text, or the figures as JSON."""
    import torch

    from kvlab.engine.generation import generate  # loads torch: not at import time
    from kvlab.tasks.items import has_chat_template, text_ids  # loads torch: not at import time

    spec = run_spec_from_args(args)
    prompt = _read_prompt(args)
    loaded = load_model_from_args(args)
    loaded.limits.check_text(prompt, "The prompt")
    chat = not args.raw_prompt and has_chat_template(loaded.tokenizer)
    input_ids = torch.tensor([text_ids(loaded.tokenizer, prompt, chat=chat, bos=spec.bos)])
    result = generate(loaded, input_ids, spec)
    source = loaded.source
    if args.json:
        payload = {
            "model": source.label,
            "model_origin": source.origin,
            "quantisation": source.quantisation,
            "licence": source.licence,
            "chat_template": chat,
            "policy": spec.policy.name,
            "params": spec.stored_params(),
            "mode": spec.mode,
            "attention": spec.attention_on(loaded.device),
            "bos": spec.bos,
            **result.to_json(),
        }
        print(json.dumps(payload))
    else:
        print(result.texts[0])
        print(f"[{source.label}: {source.describe()}]", file=sys.stderr)
        print(_figures_line(spec, result), file=sys.stderr)
    return 0


def _figures_line(spec: RunSpec, result: GenerationResult) -> str:
    """The figures of one generation in one line for a person: what the cache kept against what it read, so that
    eviction shows (a budget the prompt never reaches evicts nothing), then the bytes measured from its tensors."""
    full = result.kv_bytes_full
    share = f"{result.kv_bytes / full:.0%} of " if full else ""
    return (
        f"[{spec.policy.name}, {spec.mode}, {spec.cache.layout}] prompt {result.context_tokens:,} tokens, "
        f"{len(result.tokens[0]):,} generated, budget {result.budget_tokens or 'none'}; the cache kept "
        f"{kept_tokens(result)}; KV in use {exact_bytes(result.kv_bytes)} ({share}the {exact_bytes(full)} a full "
        "cache would hold), "
        f"peak {exact_bytes(result.peak_kv_bytes)}; reserved {exact_bytes(result.kv_reserved_bytes)}, dead share "
        f"{result.dead_share:.0%}, {result.compactions} compactions (in use, peak and reserved measured from the "
        f"cache tensors on {result.device})"
    )


def kept_tokens(result: GenerationResult) -> str:
    """How many tokens each layer's cache holds at the end: one number when the layers agree, else their range and
    mean (PyramidKV and sliding-window layers keep different numbers)."""
    low, high = min(result.kept_per_layer, default=0), max(result.kept_per_layer, default=0)
    if low == high:
        return f"{low:,} tokens per layer"
    return f"{low:,} to {high:,} tokens per layer (mean {result.mean_kept_tokens:,})"


def run_policies(args: argparse.Namespace) -> int:
    """List the policies with their parameters and defaults, then the cache options every scoring policy takes."""
    from kvlab.policies import POLICIES  # loads torch: not at import time

    width = max(map(len, POLICIES)) + 1
    for name, cls in POLICIES.items():
        params = ", ".join(f"{key}={value!r}" for key, value in cls().params().items()) or "no parameters"
        summary = " ".join((cls.__doc__ or "").split("\n\n")[0].split())
        published = ", ".join(f"{key}={value!r}" for key, value in cls.cache_defaults.items())
        print(f"{name:{width}s} {params}" + (f"; published cache options: {published}" if published else ""))
        print(textwrap.fill(summary, width=110, initial_indent=" " * (width + 1), subsequent_indent=" " * (width + 1)))
    scoring = ", ".join(name for name, cls in POLICIES.items() if cls.ranks)
    print(f"\nCache options of every scoring policy ({scoring}), set with --cache (or --param like its own):")
    defaults = CacheOptions.defaults()
    for option in CacheOptions.names():
        spec = param_spec(CacheOptions, option)
        print(f"  {option}={defaults[option]!r}: {spec.help} ({spec.describe()})")
    return 0


def run_models(args: argparse.Namespace) -> int:
    """List the models found on this machine, each with the name to pass as ``--model``, where it comes from and
    its licence."""
    from dataclasses import asdict

    for entry in available_models():
        if args.json:
            print(json.dumps(asdict(entry)))
        else:
            print(f"{entry.label}  [{entry.where}; {entry.origin}; licence {entry.licence or 'not stated'}]")
            print(f"    --model {entry.label if entry.where != 'hub cache' else entry.name}")
    return 0
