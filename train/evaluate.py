"""`python -m train.evaluate --run-dir DIR --data SPEC` (`aiayn evaluate`): score a run, print JSON.

Several --run-dir score an ensemble of runs (docs/decoding.md). Flag parsing and printing over
`train.load(...).evaluate(...)`; what each score means: `train.metrics`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .api import load
from .backends.host_devices import HELP as HOST_DEVICES_HELP
from .backends.host_devices import split_host
from .config import add_run_arguments, non_negative_int, positive_int
from .data.corpora import spec_files
from .runtime import exit_status
from .runtime.files import UserError, error_text, json_text
from .runtime.output import destination


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
    add_run_arguments(parser, ensembles=True)
    parser.add_argument("--data", required=True, help="parallel data to score (see below)")
    parser.add_argument("--max-sentences", type=positive_int,
                        help="translate only the first N pairs for BLEU/chrF; default: all")
    parser.add_argument("--lowercase", action="store_true",
                        help="also score BLEU on lowercased text (13a tokenization), as bleu_lc with its signature "
                        "(always for a run trained with --lowercase)")
    parser.add_argument("--moses", metavar="LANG",
                        help="also score BLEU on Moses-tokenized text of language LANG (e.g. de, en; sacremoses, no "
                        "escaping; sacreBLEU's tokenization off), as papers quoting tokenized BLEU do: bleu_moses, and "
                        "bleu_moses_lc with --lowercase")
    parser.add_argument("--samples", type=non_negative_int, default=0, help="include N example translations in the JSON")
    parser.add_argument("--output", type=Path, help="also write the JSON to this file, atomically (a symbolic link's "
                        "target); a FIFO, device, socket or /dev/fd/N is written directly")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)

    try:
        split_host()  # before jax is imported
        output = destination(args.output, "--output", spec_files(args.data), f"--data {args.data}")  # before the work
        run = load(args.run_dir, args.checkpoint, average=args.ensemble_average)
        lowercase = args.lowercase or run.config.lowercase
        if lowercase and not args.lowercase:  # lowercase output: cased BLEU alone would mislead
            print(f"note: {args.run_dir[0]} was trained with --lowercase, so its translations are lowercase: "
                  "bleu_lc (lowercased references) is scored too", file=sys.stderr)
        with run:
            result = run.evaluate(args.data, beam=args.beam, alpha=args.alpha, scoring=args.scoring,
                                  max_sentences=args.max_sentences, lowercase=lowercase, moses=args.moses,
                                  samples=args.samples)
    except (UserError, OSError, ValueError) as err:  # OSError: e.g. an hf: spec with the Hub out of reach
        parser.exit(1, f"error: {error_text(err)}\n")
    text = json_text(result)  # strict JSON: a non-finite score is null, never NaN
    try:
        print(text, flush=True)
        if output is not None:
            output.write(text + "\n")
    except OSError as err:  # a closed pipe (| head); a full disk, a read-only place: the JSON is on stdout
        parser.exit(1, f"error: {error_text(err)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(exit_status(main))
