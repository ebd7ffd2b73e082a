"""Options shared by the commands, each parsed and checked in one place, before anything expensive happens."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvlab.attention.backends import ATTENTION_BACKENDS, ATTENTION_HELP, DEFAULT_ATTENTION
from kvlab.budget import Budget
from kvlab.cache.layouts import DEFAULT_COMPACT_AT, DEFAULT_LAYOUT, LAYOUT_HELP, LAYOUTS
from kvlab.cache.spec import CacheOptions
from kvlab.errors import KvlabError
from kvlab.models.limits import MAX_SEED
from kvlab.modes import MODES, PREFILL, modes_help
from kvlab.store import DB_ENV_VAR
from kvlab.tasks.bos import BOS_HELP, BOS_RULES, DEFAULT_BOS

if TYPE_CHECKING:  # loading a model imports torch; the parser must not
    from kvlab.models.loading import LoadedModel


def whole(minimum: int, what: str) -> Callable[[str], int]:
    """An argparse type for a whole number of at least ``minimum`` (``what`` names it in the error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be a whole number, not {text[:40]!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{what} must be at least {minimum}, not {value}")
        return value

    return parse


def seed(text: str) -> int:
    """An argparse type for a seed: a whole number from 0 to 2^63 - 1 (it is stored as a signed 64-bit integer)."""
    value = whole(0, "a seed")(text)
    if value > MAX_SEED:
        raise argparse.ArgumentTypeError(f"a seed must be at most {MAX_SEED}, not {text[:40]}")
    return value


def fraction(text: str) -> float:
    """An argparse type for a number (the kept fraction's range is checked with the budget)."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a kept fraction must be a number, not {text[:40]!r}") from None


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Options choosing the model and where it runs."""
    parser.add_argument(
        "--model",
        default=None,
        help="hub id, local directory or GGUF file (path/to/x.gguf or owner/repo/x.gguf; default: the shipped model)",
    )
    parser.add_argument(
        "--gguf-file", default=None, help="a GGUF file inside the --model directory or hub repository to load"
    )
    parser.add_argument("--device", default=None, help="cuda, cuda:1 or cpu (default: cuda when available)")
    parser.add_argument(
        "--device-map",
        default=None,
        metavar="MAP",
        help="split the model's layers over the visible GPUs instead of --device: auto, balanced, sequential, or a "
        "JSON file or object mapping module names to a GPU index, cpu or disk",
    )
    parser.add_argument(
        "--dtype", default=None, help="float32, bfloat16 or float16 (default: bf16 on CUDA, fp32 on CPU)"
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow the model's own code from the hub to run (off unless given)",
    )


def load_model_from_args(args: argparse.Namespace) -> LoadedModel:
    """The model the model options name, loaded (the one place the command line loads a model)."""
    from kvlab.models.loading import load_model  # loads torch: not at import time

    return load_model(
        args.model,
        gguf_file=args.gguf_file,
        device=args.device,
        device_map=args.device_map,
        dtype=args.dtype,
        trust_remote_code=args.trust_remote_code,
    )


def add_policy_arguments(parser: argparse.ArgumentParser) -> None:
    """Options naming a policy, its parameters and its budget (shared by the commands that run one)."""
    parser.add_argument("--policy", default="full", help="eviction policy (see `kvlab policies`)")
    parser.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a policy parameter, e.g. --param sinks=4, or a cache option of a scoring policy (repeatable)",
    )
    parser.add_argument(
        "--cache",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a cache option, e.g. --cache hot=0.25 --cache key_bits=4 (repeatable; see `kvlab policies`)",
    )
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--keep", type=fraction, help="kept fraction of the context, in (0, 1]; 1 is the full cache")
    budget.add_argument(
        "--budget", type=whole(1, "a budget"), help="tokens kept per layer per KV head, sinks and windows included"
    )
    parser.add_argument("--mode", default=PREFILL, choices=MODES, help=modes_help())
    parser.add_argument(
        "--chunk",
        type=whole(1, "a chunk"),
        help="context tokens per forward pass (default: all at once in prefill mode, 256 in streaming mode)",
    )
    add_seed_argument(parser)


def add_heap_arguments(parser: argparse.ArgumentParser, eager: bool = True) -> None:
    """Options of the KV heap: its layout, the threshold layout's dead share, and (with ``eager``) eager decoding and
    the attention backend of static steps (a command that observes attention always decodes eagerly, and has
    neither option)."""

    parser.add_argument(
        "--layout",
        default=DEFAULT_LAYOUT,
        choices=LAYOUTS,
        help=f"{LAYOUT_HELP} The threshold is --compact-at. Default: {DEFAULT_LAYOUT}.",
    )
    parser.add_argument(
        "--compact-at",
        type=fraction,
        default=DEFAULT_COMPACT_AT,
        help=f"the threshold layout's dead share, in (0, 1] (default {DEFAULT_COMPACT_AT})",
    )
    if not eager:
        return
    parser.add_argument(
        "--eager",
        action="store_true",
        help="decode one eager forward pass per token instead of replaying CUDA graphs on a GPU",
    )
    parser.add_argument(
        "--attention",
        default=DEFAULT_ATTENTION,
        choices=ATTENTION_BACKENDS,
        help=f"{ATTENTION_HELP} Default: {DEFAULT_ATTENTION}.",
    )


def add_bos_argument(parser: argparse.ArgumentParser) -> None:
    """The BOS rule of a command that tokenises prompts (``generate``, ``eval``, ``sweep``)."""
    parser.add_argument("--bos", default=DEFAULT_BOS, choices=BOS_RULES, help=f"{BOS_HELP} Default: {DEFAULT_BOS}.")


def add_seed_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=seed, default=0, help="seed of random eviction and of generated tasks")


def add_generation_arguments(parser: argparse.ArgumentParser, default: int) -> None:
    """How many tokens to generate at most."""
    parser.add_argument(
        "--max-new-tokens",
        type=whole(1, "--max-new-tokens"),
        default=default,
        help=f"tokens to generate at most (default: {default})",
    )


def add_db_argument(parser: argparse.ArgumentParser, help_text: str) -> None:
    parser.add_argument(
        "--db",
        default=None,
        metavar="FILE",
        help=f"{help_text} (default: ${DB_ENV_VAR}, else "
        "$XDG_DATA_HOME/kvlab/runs.duckdb, else ~/.local/share/kvlab/runs.duckdb)",
    )


def policy_from_args(args: argparse.Namespace) -> tuple[Any, Any]:
    """The variant (the policy with its cache options: ``--param``, ``--cache``) and the budget the arguments
    describe, checked."""
    from kvlab.policies import configure, parse_params  # loads torch: not at import time
    from kvlab.policies.base import check_budget  # loads torch: not at import time

    not_options = [pair for pair in args.cache if pair.partition("=")[0] not in CacheOptions.names()]
    if not_options:
        raise KvlabError(
            f"--cache takes the cache options ({', '.join(CacheOptions.names())}), not {not_options[0]!r}; a policy's "
            "own parameters go to --param."
        )
    variant = configure(args.policy, **parse_params(args.policy, [*args.param, *args.cache]))
    budget = None
    if args.keep is not None or args.budget is not None:
        budget = Budget(tokens=args.budget, keep=args.keep)
    if budget is None or budget.tokens is not None or not variant.policy.evicts:
        check_budget(variant.policy, budget, context_tokens=0)
    return variant, budget


def run_spec_from_args(args: argparse.Namespace, max_new_tokens: int | None = None) -> Any:
    """The ``RunSpec`` of the variant the arguments describe (``generate``, ``eval``, ``quality``), stopping at the
    model's end-of-sequence tokens until a caller sets other stop tokens; its BOS rule is ``--bos`` where the command
    has one (``quality`` reads texts as the tokenizer reads them)."""
    from kvlab.engine.spec import RunSpec  # loads torch: not at import time

    variant, budget = policy_from_args(args)
    heap = heap_settings(args)
    return RunSpec(
        variant.policy,
        budget,
        mode=args.mode,
        chunk=args.chunk,
        max_new_tokens=args.max_new_tokens if max_new_tokens is None else max_new_tokens,
        seed=args.seed,
        cache=variant.cache(heap["layout"], heap["compact_at"]),
        static=heap["static"],
        attention=heap["attention"],
        bos=getattr(args, "bos", DEFAULT_BOS),
    )


def heap_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The heap options as runs and sweeps take them: the layout, its threshold, whether to decode eagerly and the
    attention backend of static steps."""
    return {
        "layout": args.layout,
        "compact_at": args.compact_at,
        "static": False if args.eager else None,
        "attention": args.attention,
    }


def numbers(text: str, kind: type, what: str) -> tuple[Any, ...]:
    """A comma-separated list of numbers; an empty list is the caller's to refuse."""
    try:
        return tuple(kind(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise KvlabError(f"{what} must be a comma-separated list of numbers, not {text[:60]!r}.") from None
