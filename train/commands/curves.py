"""Draw a run's learning curves (training and validation loss, validation BLEU, against steps and training
time) to an image from its results.json (`train.plots.draw`)."""

from __future__ import annotations

import sys

from ..options import build, command, run
from ..plots import Curves, draw
from ..runtime.files import json_text


def build_parser():
    return command("aiayn curves", __doc__, Curves)


def main(argv: list[str] | None = None) -> int:
    return run(build_parser(), argv, lambda given: print(json_text(draw(build(Curves, given))), flush=True))


if __name__ == "__main__":
    sys.exit(main())
