"""Average the weights of a run's newest N checkpoints (the paper's §6.1: 5 for base models, 20 for big
ones) into a new run directory that translate, evaluate and train.run --resume accept (`train.averaging`)."""

from __future__ import annotations

import dataclasses
import sys

from ..averaging import Averaging, average_run
from ..options import build, command, run


def build_parser():
    return command("aiayn average", __doc__, Averaging)


def main(argv: list[str] | None = None) -> int:
    def job(given: dict) -> None:
        averaging = build(Averaging, given)
        summary = average_run(**dataclasses.asdict(averaging))
        print(f"averaged steps {', '.join(map(str, summary['averaged_steps']))} of {averaging.src} into "
              f"{averaging.dst} (step {summary['step']})")

    return run(build_parser(), argv, job)


if __name__ == "__main__":
    sys.exit(main())
