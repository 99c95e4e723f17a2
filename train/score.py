"""`python -m train.score --run-dir DIR --input PAIRS.tsv` (`aiayn score`): the log-probability
of given translations under a trained run (`Run.score`; docs/decoding.md#scoring).

One output line per pair, in order: the log-probability of the target given the source (the sum
over its tokens, <eos> included), or with --format jsonl also its tokens and their log-probabilities.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .api import load
from .backends.host_devices import split_host
from .config import add_ensemble_average, positive_int
from .data import load_parallel
from .data.corpora import spec_files
from .runtime import exit_status
from .runtime.files import UserError, error_text
from .runtime.output import destination


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m train.score", description="Score given translations with a run "
                                     "trained by `python -m train.run`: per pair the log-probability of the target "
                                     "given the source (teacher forcing; sources longer than the model's max_len cut "
                                     "to it, as translate cuts them).")
    parser.add_argument("--run-dir", required=True, type=Path, action="append",
                        help="the run directory; given again, an ensemble's score (the runs' log-probabilities "
                        "averaged: docs/decoding.md#ensembles)")
    add_ensemble_average(parser)
    parser.add_argument("--checkpoint", default="best", help="'best' (the default), 'latest', or a step number")
    parser.add_argument("--input", required=True,
                        help="the pairs: a data spec as train.run's --valid takes (FILE.tsv with columns source and "
                        "target, SRC:TGT:PREFIX for PREFIX.SRC and PREFIX.TGT, FILE.jsonl)")
    parser.add_argument("--output", type=Path, help="write here instead of stdout")
    parser.add_argument("--format", choices=("text", "jsonl"), default="text",
                        help="text (default): the log-probability; jsonl: also the target tokens (<eos> last) and "
                        "each one's log-probability")
    parser.add_argument("--batch-size", type=positive_int,
                        help="at most N pairs per batch (default: the run's token budget)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        split_host()  # before jax is imported
        output = destination(args.output, "--output", spec_files(args.input), f"--input {args.input}")  # before work
        loaded = load_parallel(args.input)
        if loaded.skipped_empty:  # skipped, line N would no longer be pair N's score
            raise UserError(f"--input {args.input}: {loaded.skipped_empty:,} pairs with an empty side; every pair gets "
                            "its line, so remove them or give them text")
        if not loaded.pairs:
            raise UserError(f"{args.input} holds no pair to score")
        with load(args.run_dir, args.checkpoint, average=args.ensemble_average) as run:
            scores = run.score([s for s, _ in loaded.pairs], [t for _, t in loaded.pairs], batch_size=args.batch_size)
        lines = [json.dumps(s, ensure_ascii=False) if args.format == "jsonl" else f"{s['logprob']:.7g}" for s in scores]
        text = "".join(line + "\n" for line in lines)
        if output is None:
            sys.stdout.write(text)
            sys.stdout.flush()
        else:
            output.write(text)
    except (UserError, OSError, ValueError) as err:
        parser.exit(1, f"error: {error_text(err)}\n")
    print(f"scored {len(scores):,} pairs", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(exit_status(main))
