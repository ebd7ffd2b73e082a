"""The ``sidechannel`` command: an attacker outside the server tries to tell whether a secret canary is still cached
(:mod:`kvlab.experiments.sidechannel`), with and without a noise floor on the policy's ranking."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvlab.budget import Budget
from kvlab.cli.options import (
    add_heap_arguments,
    add_model_arguments,
    add_policy_arguments,
    heap_settings,
    load_model_from_args,
    numbers,
    whole,
)
from kvlab.errors import KvlabError

if TYPE_CHECKING:  # the experiment imports torch; the parser must not
    from kvlab.experiments.sidechannel import SideChannelResult, SideChannelSettings

DEFAULT_POLICY = "h2o"
DEFAULT_KEEP = 0.3
DEFAULT_NOISE = "gaussian"
DEFAULT_SCALES = (0.5, 2.0)


def register(commands: argparse._SubParsersAction) -> None:
    """Add the ``sidechannel`` command."""
    parser = commands.add_parser(
        "sidechannel",
        help="can an attacker tell from outside whether a secret canary is still cached?",
        description="Hide a canary sentence with a random code in needle prompts at varying depths, run each prompt "
        "under the policy with and without noise on its ranking, and let an attacker who knows the template fit a "
        "threshold on one half of the trials and guess on the other half whether the canary is still cached, from "
        "the decode time per token, the KV bytes and kept tokens an API could report, and the answer to a probing "
        "question. Prints each channel's accuracy against 50 % chance with a 95 % interval and the retrieval "
        "accuracy each noise level leaves; --out writes every trial as JSON. Without --policy and a budget: "
        f"{DEFAULT_POLICY} keeping {DEFAULT_KEEP:g} of the context.",
    )
    add_model_arguments(parser)
    add_policy_arguments(parser)
    parser.set_defaults(policy=DEFAULT_POLICY)
    add_heap_arguments(parser)
    parser.add_argument(
        "--trials", type=whole(4, "--trials"), default=40, help="prompts, each run at every noise level (default 40)"
    )
    parser.add_argument(
        "--noise",
        action="append",
        default=None,
        metavar="KIND",
        help=f"noise added to the scores: gaussian or laplace (repeatable; default {DEFAULT_NOISE})",
    )
    parser.add_argument(
        "--noise-scale",
        action="append",
        type=float,
        default=None,
        metavar="SCALE",
        help="noise scale relative to the spread of the scores, run with every --noise (repeatable; default "
        f"{', '.join(f'{scale:g}' for scale in DEFAULT_SCALES)}); a run without noise is always included",
    )
    parser.add_argument(
        "--context", type=whole(64, "--context"), default=1024, help="tokens per prompt, question included (1024)"
    )
    parser.add_argument(
        "--new-tokens",
        type=whole(2, "--new-tokens"),
        default=16,
        help="tokens decoded per trial, always all of them (default 16)",
    )
    parser.add_argument(
        "--depths",
        default=None,
        metavar="LOW,HIGH",
        help="the range of depths the canary is placed at, e.g. 0.5,1 (default: the last two budgets' worth of "
        "the context)",
    )
    parser.add_argument("--out", default=None, metavar="FILE", help="write the result, every trial included, as JSON")
    parser.set_defaults(func=run_sidechannel_command)


def settings_from_args(args: argparse.Namespace) -> SideChannelSettings:
    """The experiment the arguments describe, checked before any model is loaded."""
    from kvlab.experiments.sidechannel import NoiseLevel, SideChannelSettings  # loads torch: not at import time
    from kvlab.policies import parse_params  # loads torch: not at import time

    keep = DEFAULT_KEEP if args.keep is None else args.keep
    budget = Budget(tokens=args.budget) if args.budget is not None else Budget(keep=keep)
    depths = None
    if args.depths is not None:
        bounds = numbers(args.depths, float, "--depths")
        if len(bounds) != 2:
            raise KvlabError(f"--depths takes two numbers, LOW,HIGH, not {args.depths[:60]!r}.")
        depths = (bounds[0], bounds[1])
    kinds = args.noise or [DEFAULT_NOISE]
    scales = args.noise_scale or list(DEFAULT_SCALES)
    return SideChannelSettings(
        policy=args.policy,
        params=parse_params(args.policy, args.param),
        budget=budget,
        noise=tuple(NoiseLevel(kind, scale) for kind in kinds for scale in scales),
        mode=args.mode,
        trials=args.trials,
        context_tokens=args.context,
        new_tokens=args.new_tokens,
        seed=args.seed,
        depths=depths,
        chunk=args.chunk,
        **heap_settings(args),
    )


def run_sidechannel_command(args: argparse.Namespace) -> int:
    """Run the experiment, print its table and write the JSON."""
    from kvlab.experiments.sidechannel import run_side_channel  # loads torch: not at import time

    settings = settings_from_args(args)
    out = Path(args.out) if args.out is not None else None
    if out is not None and not out.parent.is_dir():
        raise KvlabError(f"Cannot write {out}: the folder {out.parent} does not exist.")
    loaded = load_model_from_args(args)
    step = max(1, settings.trials // 10)

    def progress(done: int, total: int) -> None:
        if done % step == 0 or done == total:
            print(f"trial {done} of {total}", file=sys.stderr)

    result = run_side_channel(loaded, settings, progress)
    print("\n".join(report_lines(result)))
    if out is not None:
        out.write_text(json.dumps(result.to_json(), indent=1) + "\n", encoding="utf-8")
        print(f"wrote {out}", file=sys.stderr)
    return 0


def report_lines(result: SideChannelResult) -> list[str]:
    """The table the command prints: per noise level, the canary's survival and the retrieval accuracy, then each
    channel's accuracy, interval and verdict."""
    from kvlab.experiments.sidechannel import CHANNELS  # loads torch: not at import time

    budget = f"keep {result.keep:g}" if result.keep is not None else f"budget {result.budget_tokens}"
    lines = [
        f"{result.policy} ({budget}: {result.budget_tokens} tokens of {result.context_tokens}), {result.mode} mode, "
        f"{result.trials} trials on {result.model} ({result.device}); the canary at depths "
        f"{result.depths[0]:.2f} to {result.depths[1]:.2f}"
    ]
    width = max(len(label) for label in CHANNELS.values())
    for level in result.levels:
        lines.append("")
        lines.append(
            f"{level.noise}: canary cached in {level.cached} of {level.trials} trials; retrieval "
            f"{level.retrieved} of {level.trials} ({level.retrieval:.0%}, 95 % CI {level.retrieval_low:.0%} to "
            f"{level.retrieval_high:.0%}); {1000 * level.decode_seconds:.3f} ms per decoded token (median)"
        )
        for score in level.channels:
            accuracy = "   n/a" if score.accuracy is None else f"{score.accuracy:6.0%}"
            lines.append(f"  {CHANNELS[score.channel]:<{width}} {accuracy}  {score.verdict}")
    return lines
