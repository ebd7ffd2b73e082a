"""The ``generate`` and ``policies`` commands: one prompt under a policy, and the list of policies."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

from kvlab.cli.options import (
    add_generation_arguments,
    add_heap_arguments,
    add_model_arguments,
    add_policy_arguments,
    run_spec_from_args,
)
from kvlab.errors import KvlabError


def register(commands: argparse._SubParsersAction) -> None:
    """Add the ``generate`` and ``policies`` commands."""
    generate = commands.add_parser("generate", help="generate from a prompt under a budgeted KV cache")
    add_model_arguments(generate)
    prompt = generate.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the prompt text")
    prompt.add_argument("--prompt-file", help="a UTF-8 file holding the prompt")
    add_policy_arguments(generate)
    add_heap_arguments(generate)
    add_generation_arguments(generate, default=32)
    generate.add_argument("--json", action="store_true", help="print one JSON object with the figures")
    generate.set_defaults(func=run_generate)

    policies = commands.add_parser("policies", help="list the eviction policies and their parameters")
    policies.set_defaults(func=run_policies)


def _read_prompt(args: argparse.Namespace) -> str:
    """The prompt's text; an empty one is refused (the model would read nothing but its start token)."""
    if args.prompt is not None:
        text = args.prompt
    else:
        path = Path(args.prompt_file)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as error:
            raise KvlabError(f"Cannot read the prompt file {path}: {error.strerror}.") from None
        except UnicodeDecodeError:
            raise KvlabError(f"The prompt file {path} is not UTF-8 text.") from None
    if not text.strip():
        raise KvlabError("The prompt is empty; give some text to read.")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise KvlabError("The prompt holds text that is not valid Unicode (a lone surrogate).") from None
    return text


def run_generate(args: argparse.Namespace) -> int:
    """Generate from one prompt under a policy and print the text, or the figures as JSON."""
    from kvlab.engine import generate
    from kvlab.models import load_model

    spec = run_spec_from_args(args)
    prompt = _read_prompt(args)
    loaded = load_model(args.model, device=args.device, dtype=args.dtype, trust_remote_code=args.trust_remote_code)
    loaded.limits.check_text(prompt, "The prompt")
    input_ids = loaded.tokenizer(prompt, return_tensors="pt").input_ids
    result = generate(loaded, input_ids, spec)
    if args.json:
        payload = {
            "model": loaded.name,
            "policy": spec.policy.name,
            "params": spec.policy.params(),
            "mode": spec.mode,
            **result.to_json(),
        }
        print(json.dumps(payload))
    else:
        print(result.texts[0])
        print(
            f"[{spec.policy.name}, {spec.mode}, {spec.layout}] context {result.context_tokens} tokens, budget "
            f"{result.budget_tokens or 'none'}; KV in use {result.kv_bytes:,} B of {result.kv_bytes_full:,} B full, "
            f"peak {result.peak_kv_bytes:,} B; reserved {result.kv_reserved_bytes:,} B, dead share "
            f"{result.dead_share:.0%}, {result.compactions} compactions (measured from the cache tensors on "
            f"{result.device})",
            file=sys.stderr,
        )
    return 0


def run_policies(args: argparse.Namespace) -> int:
    """List the policies with their parameters and defaults."""
    from kvlab.policies import POLICIES

    for name, cls in POLICIES.items():
        params = ", ".join(f"{key}={value!r}" for key, value in cls().params().items()) or "no parameters"
        summary = " ".join((cls.__doc__ or "").split("\n\n")[0].split())
        print(f"{name:10s} {params}")
        print(textwrap.fill(summary, width=110, initial_indent=" " * 11, subsequent_indent=" " * 11))
    return 0
