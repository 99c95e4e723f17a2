"""`python -m train.score --run-dir DIR --input PAIRS.tsv` (`aiayn score`): the log-probability
of given translations under a trained run (`train.jobs.score_file`; docs/decoding.md#scoring).

One output line per pair, in order: the log-probability of the target given the source (the sum
over its tokens, <eos> included), or with --format jsonl also its tokens and their log-probabilities.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .options import POSITIVE, RunSelection, add_flags, build, call


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m train.score", description="Score given translations with a run "
                                     "trained by `python -m train.run`: per pair the log-probability of the target "
                                     "given the source (teacher forcing; sources longer than the model's max_len cut "
                                     "to it, as translate cuts them).")
    add_flags(parser, RunSelection, skip=("devices", "coordinator_address", "num_processes", "process_id"))
    parser.add_argument("--input", required=True,
                        help="the pairs: a data spec as train.run's --valid takes (FILE.tsv with columns source and "
                        "target, SRC:TGT:PREFIX for PREFIX.SRC and PREFIX.TGT, FILE.jsonl)")
    parser.add_argument("--output", type=Path, help="write here instead of stdout")
    parser.add_argument("--format", choices=("text", "jsonl"), default="text",
                        help="text (default): the log-probability; jsonl: also the target tokens (<eos> last) and "
                        "each one's log-probability")
    parser.add_argument("--batch-size", type=POSITIVE.parser(),
                        help="at most N pairs per batch (default: the run's token budget)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from .jobs import score_file

    return call(parser, lambda: score_file(build(RunSelection, vars(args)), args.input, args.output, args.format,
                                           args.batch_size))


if __name__ == "__main__":
    sys.exit(main())
