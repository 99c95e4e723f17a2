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
(`parity.marian.to_marian`), each batch limited to our length limit for its padded length.
"""

from __future__ import annotations

if __name__ == "__main__":  # before jax is imported: the CPU as translate splits it, one device per core
    from train.backends.host_devices import split_host

    try:
        split_host()
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None

import sys

from train.options import RunSelection, Search, add_flags, build, command, run

from .search_speed import SpeedBench, bench_file


def build_parser():
    parser = command("python -m parity.translate_bench", "Time translation with a run's weights in JAX and torch "
                     "cached search and torch's uncached loop, greedy and with --beam: sentences/s, tokens/s, "
                     "speed-ups and outputs that differ from torch cached search's.")
    add_flags(parser, RunSelection, skip=("average", "devices", "coordinator_address", "num_processes", "process_id"))
    add_flags(parser, Search, skip=("n_best", "alignments"))
    add_flags(parser, SpeedBench)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run(build_parser(), argv, lambda given: bench_file(build(RunSelection, given), build(Search, given),
                                                              build(SpeedBench, given)))


if __name__ == "__main__":
    sys.exit(main())
