"""`python -m train.evaluate --run-dir DIR --data SPEC` (`aiayn evaluate`): score a run, print JSON.

Several --run-dir score an ensemble of runs (docs/decoding.md). Flags over `train.jobs.evaluate_spec`;
what each score means: `train.metrics`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .backends.host_devices import HELP as HOST_DEVICES_HELP
from .options import Evaluation, RunSelection, Search, add_flags, build, call


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m train.evaluate",
        description="Score a run trained by `python -m train.run` on parallel data: label-smoothed loss, perplexity, "
        "sacreBLEU BLEU/chrF (with their signatures) and exact match (sentence accuracy) of beam-search translations, "
        "and for number data the exact match per number of digits. Prints one JSON object.",
        epilog="DATA is a data spec as for train.run (SRC:TGT:PREFIX, FILE.tsv, FILE.jsonl, hf:NAME[:CONFIG]:SPLIT), "
        "numbers:train|valid|test for the run's own split of the embedded numbers corpus, or numbers:FIRST-LAST[/STEP] "
        "for every (STEP-th) number from FIRST to LAST (e.g. numbers:0-999, or numbers:1000-999000/1000 for the "
        "round thousands). For a run trained on the numbers corpus, "
        f"the per-digit scores count the sentences seen in its training split. {HOST_DEVICES_HELP}.",
    )
    add_flags(parser, RunSelection)
    add_flags(parser, Search, skip=("n_best", "alignments"))
    parser.add_argument("--data", required=True, help="parallel data to score (see below)")
    add_flags(parser, Evaluation)
    parser.add_argument("--output", type=Path, help="also write the JSON to this file, atomically (a symbolic link's "
                        "target); a FIFO, device, socket or /dev/fd/N is written directly")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    given = vars(parser.parse_args(argv))
    from .jobs import evaluate_spec

    return call(parser, lambda: evaluate_spec(build(RunSelection, given), given["data"], build(Search, given),
                                              build(Evaluation, given), given.get("output")))


if __name__ == "__main__":
    sys.exit(main())
