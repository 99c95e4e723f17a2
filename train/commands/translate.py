"""Translate sentences (one per line) with a run trained by `python -m train.run`: one output record
per input line, in input order (`train.jobs.translate_file`; docs/decoding.md), the translation or with
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
from ..options import RunSelection, Sampling, Search, TranslateFiles, add_flags, build, command, run, sampling_from
from ..runtime.files import UserError


def build_parser() -> argparse.ArgumentParser:
    parser = command("aiayn translate", __doc__, RunSelection, Search, TranslateFiles,
                     epilog=f"{HOST_DEVICES_HELP}. {JAX_CACHE_HELP}.")
    group = parser.add_argument_group("sampling", "random translations instead of the search (docs/decoding.md)")
    group.add_argument("--sample", action="store_true", default=argparse.SUPPRESS, help="draw each token at random "
                       "from the model's distribution instead of searching (--beam and --alpha unused; --scoring hf, "
                       "--n-best and prefixes refused: a sample is not ranked); with --format tsv/jsonl each "
                       "sample's log-probability (its score too)")
    add_flags(group, Sampling)
    # The benchmark needs both frameworks on one set of weights, so it lives in `parity`: say where.
    parser.add_argument("--benchmark", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    from ..jobs import translate_file

    def job(given: dict) -> None:
        if given.get("benchmark"):
            raise UserError("the translation benchmark is `aiayn translate-bench --run-dir RUN --input "
                            "FILE [--beam K] [--ctranslate2]`: it runs both frameworks (and CTranslate2) on the run's "
                            "weights")
        translate_file(build(RunSelection, given), build(Search, given), sampling_from(given),
                       build(TranslateFiles, given))

    return run(build_parser(), argv, job)


if __name__ == "__main__":
    sys.exit(main())
