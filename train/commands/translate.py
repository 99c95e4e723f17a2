"""Translate sentences (one per line) with a run trained by `python -m train.run`: one output record
per input line, in input order (`train.translate.jobs.translate_file`; docs/decoding.md), the translation or with
--format tsv|jsonl n-best lists with scores and alignments; --sample draws random translations, and several
--run-dir translate with an ensemble of runs. Cached beam search (greedy with --beam 1); the backend (jax or
torch) is the one the run was trained with. Sources longer than the model's max_len are cut to it (counted
on stderr). The input streams through in chunks, each written in input order as it finishes.
"""

from __future__ import annotations

import argparse
import sys

from ..backends.host_devices import HELP as HOST_DEVICES_HELP
from ..backends.jax_cache import HELP as JAX_CACHE_HELP
from ..options import (SAMPLING_FIELDS, RunSelection, Sample, Sampling, Search, TranslateFiles, add_flags, build,
                       command, run, sampling_of)


def build_parser() -> argparse.ArgumentParser:
    parser = command("aiayn translate", __doc__, RunSelection, Search, TranslateFiles,
                     epilog=f"{HOST_DEVICES_HELP}. {JAX_CACHE_HELP}.")
    group = parser.add_argument_group("sampling", "random translations instead of the search (docs/decoding.md)")
    add_flags(parser, Sample, group=group)
    add_flags(parser, Sampling, group=group)
    return parser


def main(argv: list[str] | None = None) -> int:
    from ..translate.jobs import translate_file

    def job(given: dict) -> None:
        translate_file(build(RunSelection, given), build(Search, given),
                       sampling_of(build(Sample, given).sample, {k: given[k] for k in SAMPLING_FIELDS if k in given}),
                       build(TranslateFiles, given))

    return run(build_parser(), argv, job)


if __name__ == "__main__":
    sys.exit(main())
