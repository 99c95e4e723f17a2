"""Score a run trained by `python -m train.run` on parallel data (`train.translate.jobs.evaluate_spec`): label-smoothed
loss, perplexity, sacreBLEU BLEU/chrF (with their signatures) and exact match (sentence accuracy) of beam-search
translations, and for number data the exact match per number of digits (`train.translation`). Prints one JSON
object. Several --run-dir score an ensemble of runs (docs/decoding.md).
"""

from __future__ import annotations

import argparse
import sys

from ..backends.host_devices import HELP as HOST_DEVICES_HELP
from ..options import EvaluateFiles, Evaluation, RunSelection, Search, add_flags, build, command, run


def build_parser() -> argparse.ArgumentParser:
    parser = command(
        "aiayn evaluate", __doc__, RunSelection, epilog="DATA is a data spec as for train.run (SRC:TGT:PREFIX, "
        "FILE.tsv, FILE.jsonl, hf:NAME[:CONFIG]:SPLIT), numbers:train|valid|test for the run's own split of the "
        "numbers corpus, or numbers:FIRST-LAST[/STEP] for every (STEP-th) number from FIRST to LAST (e.g. "
        "numbers:1000-999000/1000: the round thousands); a run trained on numbers counts the sentences seen in its "
        f"training split apart. {HOST_DEVICES_HELP}.")
    add_flags(parser, Search, skip=("n_best", "alignments"))
    add_flags(parser, EvaluateFiles, only=("data",))
    add_flags(parser, Evaluation)
    add_flags(parser, EvaluateFiles, only=("output",))
    return parser


def main(argv: list[str] | None = None) -> int:
    from ..translate.jobs import evaluate_spec

    def job(given: dict) -> dict:
        files = build(EvaluateFiles, given)
        return evaluate_spec(build(RunSelection, given), files.data, build(Search, given), build(Evaluation, given),
                             files.output)

    return run(build_parser(), argv, job)


if __name__ == "__main__":
    sys.exit(main())
