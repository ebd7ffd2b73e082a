"""``python -m kvlab``: the command line.

Each subcommand parses and checks its arguments before anything expensive happens, so that a bad budget or an unknown
policy costs no model load. Every :class:`~kvlab.errors.KvlabError` is printed as one sentence on stderr with a
non-zero exit status.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path
from typing import Callable, Sequence

from kvlab.errors import KvlabError

Command = Callable[[argparse.Namespace], int]


def add_policy_arguments(parser: argparse.ArgumentParser) -> None:
    """Options naming a policy, its parameters and its budget (shared by the commands that run one)."""
    parser.add_argument("--policy", default="full", help="eviction policy (see `python -m kvlab policies`)")
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                        help="a policy parameter, e.g. --param sinks=4 (repeatable)")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--keep", type=float, help="kept fraction of the context, in (0, 1]")
    budget.add_argument("--budget", type=int, help="tokens kept per layer per KV head, sinks and windows included")
    parser.add_argument("--mode", default="prefill", choices=("prefill", "streaming"))
    parser.add_argument("--chunk", type=int, help="context tokens per forward pass (default: all at once in "
                                                   "prefill mode, 256 in streaming mode)")
    parser.add_argument("--seed", type=int, default=0)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Options choosing the model and where it runs."""
    parser.add_argument("--model", default=None, help="hub id or local directory (default: the shipped model)")
    parser.add_argument("--device", default=None, help="cuda, cuda:1 or cpu (default: cuda when available)")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: bf16 on CUDA, fp32 on CPU)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="allow the model's own code from the hub to run (off unless given)")


def policy_from_args(args: argparse.Namespace):
    """The policy and budget the arguments describe, checked."""
    from kvlab.budget import Budget, check_budget
    from kvlab.policies import make_policy, parse_params

    policy = make_policy(args.policy, **parse_params(args.policy, args.param))
    budget = None
    if args.keep is not None or args.budget is not None:
        budget = Budget(tokens=args.budget, keep=args.keep)
    if budget is None or budget.tokens is not None or not policy.evicts():
        check_budget(policy, budget, context_tokens=0)
    return policy, budget


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return args.prompt
    path = Path(args.prompt_file)
    try:
        return path.read_text(encoding="utf-8")
    except OSError as error:
        raise KvlabError(f"Cannot read the prompt file {path}: {error.strerror}.") from None
    except UnicodeDecodeError:
        raise KvlabError(f"The prompt file {path} is not UTF-8 text.") from None


def run_generate(args: argparse.Namespace) -> int:
    """Generate from one prompt under a policy and print the text, or the figures as JSON."""
    from kvlab.engine import RunSpec, generate
    from kvlab.models import load_model

    policy, budget = policy_from_args(args)
    spec = RunSpec(policy, budget, mode=args.mode, chunk=args.chunk, max_new_tokens=args.max_new_tokens,
                   seed=args.seed)
    prompt = _read_prompt(args)
    loaded = load_model(args.model, device=args.device, dtype=args.dtype, trust_remote_code=args.trust_remote_code)
    input_ids = loaded.tokenizer(prompt, return_tensors="pt").input_ids
    result = generate(loaded, input_ids, spec)
    if args.json:
        payload = {"model": loaded.name, "policy": policy.name, "params": policy.params(), "mode": spec.mode,
                   **result.to_json()}
        print(json.dumps(payload))
    else:
        print(result.texts[0])
        print(
            f"[{policy.name}, {spec.mode}] context {result.context_tokens} tokens, budget "
            f"{result.budget_tokens or 'none'}; KV held {result.kv_bytes:,} B of {result.kv_bytes_full:,} B full, "
            f"peak {result.peak_kv_bytes:,} B (measured from the cache tensors on {result.device})",
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


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="python -m kvlab", description="KV-cache eviction lab bench.")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate from a prompt under a budgeted KV cache")
    add_model_arguments(generate)
    prompt = generate.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the prompt text")
    prompt.add_argument("--prompt-file", help="a UTF-8 file holding the prompt")
    add_policy_arguments(generate)
    generate.add_argument("--max-new-tokens", type=int, default=32)
    generate.add_argument("--json", action="store_true", help="print one JSON object with the figures")
    generate.set_defaults(func=run_generate)

    policies = commands.add_parser("policies", help="list the eviction policies and their parameters")
    policies.set_defaults(func=run_policies)

    from kvlab import eval_cli, store_cli

    eval_cli.register_cli(commands)
    store_cli.register_cli(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Command = args.func
    try:
        return func(args)
    except KvlabError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
