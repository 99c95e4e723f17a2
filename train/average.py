"""`python -m train.average --run-dir RUN --last N --dst OUT` (`aiayn average`): the mean of a run's
newest N checkpoints as a new run (`train.averaging`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .averaging import average_run
from .options import POSITIVE, call


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m train.average", description="Average the weights of a run's "
                                     "newest N checkpoints (the paper's §6.1: 5 for base models, 20 for big ones) into "
                                     "a new run directory that translate, evaluate and train.run --resume accept.")
    parser.add_argument("--run-dir", type=Path, required=True, help="the trained run (keeps at least N checkpoints)")
    parser.add_argument("--last", type=POSITIVE.parser(), default=5, metavar="N",
                        help="average the newest N checkpoints (default 5)")
    parser.add_argument("--dst", type=Path, required=True, help="the new run directory to write")
    parser.add_argument("--overwrite", action="store_true", help="replace --dst if it holds a run")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)

    def job():
        summary = average_run(args.run_dir, args.dst, args.last, args.overwrite)
        print(f"averaged steps {', '.join(map(str, summary['averaged_steps']))} of {args.run_dir} into {args.dst} "
              f"(step {summary['step']})")

    return call(parser, job)


if __name__ == "__main__":
    sys.exit(main())
