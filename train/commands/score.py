"""Score given translations with a run trained by `python -m train.run` (`train.translate.jobs.score_file`;
docs/decoding.md#scoring): one output line per pair, in order, the log-probability of the target given the
source (the sum over its tokens, <eos> included; teacher forcing; sources longer than the model's max_len cut
to it, as translate cuts them), or with --format jsonl also its tokens and their log-probabilities.
"""

from __future__ import annotations

import sys

from ..options import RunSelection, ScoreFiles, add_flags, build, command, run


def build_parser():
    parser = command("aiayn score", __doc__)
    add_flags(parser, RunSelection, skip=("devices", "coordinator_address", "num_processes", "process_id"))
    add_flags(parser, ScoreFiles)
    return parser


def main(argv: list[str] | None = None) -> int:
    from ..translate.jobs import score_file

    return run(build_parser(), argv, lambda given: score_file(build(RunSelection, given), build(ScoreFiles, given)))


if __name__ == "__main__":
    sys.exit(main())
