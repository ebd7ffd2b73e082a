"""``python -m training <command>``: haystacks, prepare, train, evaluate, attention, card.

A full run on one GPU (about 16 minutes on one H100)::

    python -m training prepare
    python -m training train --time-budget-min 13
    python -m training evaluate
    python -m training card

``train`` resumes from ``<workdir>/checkpoint.pt`` when it exists, so it can be run in pieces. ``--tiny`` trains a
toy shape on short sequences, to check the pipeline on a CPU in a minute.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from training.model import TINY_SHAPE, ModelShape

DEFAULT_WORKDIR = Path("out/train")
DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "kvlab" / "data" / "models" / "kvlab-tiny-llama"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m training", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR, help="corpus, checkpoints and logs")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="where the trained model is written/read")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("haystacks", help="write kvlab/data/haystacks/*.txt from this Python's pydoc_data")
    p = sub.add_parser("prepare", help="build the corpus, its manifest, the tokenizer and the token streams")
    p.add_argument("--max-bytes", type=int, default=200_000_000, help="cap on the corpus size")
    p.add_argument("--tokenizer-bytes", type=int, default=40_000_000, help="corpus bytes the tokenizer is trained on")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--workers", type=int, default=8, help="processes for the contamination check")
    p.add_argument("--tiny", action="store_true", help="a toy corpus and vocabulary for a CPU check")
    t = sub.add_parser("train", help="train (or resume) and export the model")
    t.add_argument("--max-steps", type=int, help="train this many steps (overrides --time-budget-min)")
    t.add_argument(
        "--time-budget-min",
        type=float,
        default=13.0,
        help="fit the number of steps to this much training time (default 13)",
    )
    t.add_argument("--batch-size", type=int, default=16)
    t.add_argument("--lr", type=float, default=1.5e-3)
    t.add_argument("--workers", type=int, default=6)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--init-from", type=Path, help="start from an exported model's weights")
    t.add_argument("--no-compile", action="store_true")
    t.add_argument("--tiny", action="store_true", help="a toy shape on 512-token sequences")
    e = sub.add_parser("evaluate", help="needle accuracy, perplexity and attention profile into <model>/eval.json")
    e.add_argument("--per-depth", type=int, default=5, help="items per length and depth (11 depths)")
    e.add_argument("--variant-per-depth", type=int, default=2, help="the same for multi-key and multi-value")
    e.add_argument("--batch", type=int, default=16)
    sub.add_parser("attention", help="re-measure only the attention profile into <model>/eval.json (CPU is fine)")
    sub.add_parser("card", help="write <model>/README.md and the loss curve from the recorded results")
    args = parser.parse_args(argv)

    if args.command == "haystacks":
        from training.haystacks import write_haystacks

        write_haystacks()
    elif args.command == "prepare":
        from training.prepare import prepare

        scale = (
            dict(max_bytes=3_000_000, tokenizer_bytes=1_000_000, vocab_size=512)
            if args.tiny
            else dict(max_bytes=args.max_bytes, tokenizer_bytes=args.tokenizer_bytes, vocab_size=args.vocab)
        )
        max_length = (TINY_SHAPE if args.tiny else ModelShape()).max_positions
        manifest = prepare(args.workdir, max_length=max_length, workers=args.workers, **scale)
        print(json.dumps({k: manifest[k] for k in ("train", "heldout", "haystack_contamination", "prepare_seconds")}))
    elif args.command == "train":
        from training.loop import TrainSettings, train

        settings = TrainSettings(
            batch_size=args.batch_size,
            lr=args.lr,
            max_steps=args.max_steps,
            time_budget_s=None if args.max_steps else args.time_budget_min * 60,
            seed=args.seed,
            compile=not args.no_compile,
            workers=args.workers,
        )
        if args.tiny:
            settings = replace(
                settings,
                warmup_steps=5,
                checkpoint_every=10,
                log_every=2,
                eval_every=10,
                eval_batches=1,
                calibration_steps=3,
            )
        print(train(args.workdir, args.model, TINY_SHAPE if args.tiny else ModelShape(), settings, args.init_from))
    elif args.command == "evaluate":
        from training.evaluate import evaluate

        evaluate(
            args.model,
            args.workdir,
            per_depth=args.per_depth,
            variant_per_depth=args.variant_per_depth,
            batch=args.batch,
        )
    elif args.command == "attention":
        from training.evaluate import measure_attention

        print(json.dumps(measure_attention(args.model)["first_token_mass"]))
    elif args.command == "card":
        from training.card import write_card

        print(write_card(args.model, args.workdir))


if __name__ == "__main__":
    main()
