"""The ``profile`` command: a model's mean attention entropy per layer over a held-out text, measured with the full
cache and stored for the ``entropy`` layer allocation (:mod:`kvlab.engine.profile`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvlab.cli.options import add_model_arguments, load_model_from_args, whole
from kvlab.models.profiles import (
    DEFAULT_PROFILE_TEXT,
    DEFAULT_PROFILE_TOKENS,
    PROFILE_CHUNK,
    check_output,
    output_path,
    save_profile,
)
from kvlab.tasks.texts import read_text


def register(commands: argparse._SubParsersAction) -> None:
    """Add the ``profile`` command."""
    profile = commands.add_parser(
        "profile",
        help="measure a model's attention entropy per layer and store it for the entropy layer allocation",
        description="Read a held-out text with the full cache in chunks of "
        f"{PROFILE_CHUNK} tokens and measure each layer's mean attention entropy (nats, over its query heads and "
        "the queries after the first chunk) and per KV head; store the profile as JSON under the weights' hash, "
        "where layer_allocation=entropy finds it. Prints the entropy per layer.",
    )
    add_model_arguments(profile)
    profile.add_argument(
        "--text",
        default=None,
        metavar="FILE",
        help="a UTF-8 text the model did not train on (default: kvlab/data/haystacks/python-docs-4.txt, held out from "
        "the shipped model's training)",
    )
    profile.add_argument(
        "--tokens",
        type=whole(PROFILE_CHUNK + 1, "--tokens"),
        default=DEFAULT_PROFILE_TOKENS,
        help=f"tokens of the text to read (default {DEFAULT_PROFILE_TOKENS}; more than one chunk of {PROFILE_CHUNK})",
    )
    profile.add_argument(
        "--out",
        default=None,
        metavar="PATH",
        help="a JSON file, or a directory to write <first 16 hex digits of the weights' hash>.json in (default: "
        "$KVLAB_PROFILES, else $XDG_DATA_HOME/kvlab/profiles, else ~/.local/share/kvlab/profiles)",
    )
    profile.add_argument("--json", action="store_true", help="print the profile as one JSON object")
    profile.set_defaults(func=run_profile_command)


def run_profile_command(args: argparse.Namespace) -> int:
    """Measure the profile, save it, and print its entropy per layer."""
    from kvlab.engine.profile import measure_profile  # loads torch: not at import time

    check_output(args.out)  # a bad text or output costs no model load
    path = Path(args.text) if args.text is not None else DEFAULT_PROFILE_TEXT
    text = read_text(path)
    loaded = load_model_from_args(args)
    profile = measure_profile(loaded, text, path.stem, args.tokens)
    saved = save_profile(profile, output_path(args.out, profile.weights_hash))
    if args.json:
        print(json.dumps({**profile.to_json(), "path": str(saved)}))
        return 0
    print("layer  entropy (nats)  per KV head")
    for layer, (entropy, heads) in enumerate(zip(profile.entropy, profile.head_entropy)):
        print(f"{layer:5d}  {entropy:14.3f}  {' '.join(f'{head:.3f}' for head in heads)}")
    print(
        f"{profile.model}: mean attention entropy of {profile.num_layers} layers over "
        f"{profile.tokens - profile.chunk:,} queries of {profile.text} ({profile.tokens:,} tokens read on "
        f"{profile.device} in {profile.dtype}, the first {profile.chunk} left out); saved to {saved}",
        file=sys.stderr,
    )
    return 0
