"""Translation speed, JAX against PyTorch on the same weights: `python -m parity.translate_bench`
(docs/performance.md#translation-speed).

    python -m parity.translate_bench --run-dir RUN --input ../shared/data/multi30k/val.de.gz [--beam 4] [--json F]

Opens a run (either backend), moves its weights into the other framework (`convert_state`), and
times translating the input with JAX and torch cached search and torch's uncached loop (the
decoder re-run over every prefix; --no-uncached leaves it out), each greedy and with --beam: seconds,
sentences/s, tokens/s, `peak_mib` (the largest growth of resident memory in the timed loop), the
speed-ups against torch cached and uncached, and how many outputs differ from torch cached search's
(0 expected). Torch and CTranslate2 run under glibc's settled allocator thresholds
(`allocator.settled`), float32 matmuls in full float32 (TF32 off) in both frameworks.

--ctranslate2 adds the run exported to CTranslate2 in float32 and int8 (`parity.ctranslate2`,
outputs compared by `ctranslate2.same_output`, int8's BLEU against float32's:
docs/interop.md#speed); --hf adds HF's `generate` on a run imported from Marian
(`train.interop.marian.to_marian`), each batch limited to our length limit for its padded length.
"""

from __future__ import annotations

if __name__ == "__main__":  # before jax is imported: the CPU as translate splits it, one device per core
    from train.backends.host_devices import split_host

    try:
        split_host()
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None

import argparse
import sys
from pathlib import Path

from train.options import POSITIVE, RunSelection, Search, add_flags, build, call
from train.runtime.output import output_path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m parity.translate_bench", description="Time translation with a "
                                     "run's weights in JAX and torch cached search and torch's uncached loop, greedy "
                                     "and with --beam: sentences/s, tokens/s, speed-ups and outputs that differ from "
                                     "torch cached search's.")
    add_flags(parser, RunSelection, skip=("average", "devices", "coordinator_address", "num_processes", "process_id"))
    add_flags(parser, Search, skip=("n_best", "alignments"))
    parser.add_argument("--input", type=Path, help="text file, one source sentence per line (plain or .gz); "
                        "default: stdin")
    parser.add_argument("--batch-size", type=POSITIVE.parser(), help="at most N sentences per batch; default: the "
                        "run's --token-budget")
    parser.add_argument("--json", type=output_path, help="also write the figures to this JSON file")
    parser.add_argument("--ctranslate2", action="store_true", help="also time the run exported to CTranslate2 in "
                        "float32 and int8 (needs the interop extra: pip install -e \".[interop]\")")
    parser.add_argument("--hf", action="store_true", help="also time HF transformers' generate on the run's weights "
                        "(a run imported from Marian: parity.convert --from marian; needs the interop extra)")
    parser.add_argument("--no-uncached", dest="uncached", action="store_false", help="leave out torch's uncached "
                        "loop (hours at large shapes); speed-ups against it are then null")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from .search_speed import bench_file

    return call(parser, lambda: bench_file(build(RunSelection, vars(args)), build(Search, vars(args)), args.input,
                                           args.batch_size, args.json, ctranslate2=args.ctranslate2, hf=args.hf,
                                           uncached=args.uncached))


if __name__ == "__main__":
    sys.exit(main())
