"""Time translation with a run's weights in JAX and torch cached search and torch's uncached loop, greedy
and with --beam (and with --sample, sampling in both): sentences/s, outputs/s, tokens/s, speed-ups and outputs
that differ from torch cached search's (`parity.search_speed.SpeedBench` says what it times;
docs/performance.md#translation-speed)."""

from __future__ import annotations

import sys

from train.backends.host_devices import split_host
from train.options import SAMPLING_FIELDS, RunSelection, Sampling, Search, add_flags, build, command, run, sampling_of
from train.runtime import exit_status


def build_parser():
    from ..search_speed import SpeedBench  # imports jax: after main's split_host

    parser = command("aiayn translate-bench", __doc__)
    add_flags(parser, RunSelection, skip=("average", "devices", "coordinator_address", "num_processes", "process_id"))
    add_flags(parser, Search, skip=("n_best", "alignments"))
    add_flags(parser, SpeedBench)
    add_flags(parser, Sampling)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Before jax is imported: the CPU split as translate splits it, one device per core (the count is no status).
    if status := exit_status(lambda: split_host() and None):
        return status
    from ..search_speed import SpeedBench, bench_file

    def job(given: dict) -> list[dict]:
        bench = build(SpeedBench, given)
        sampling = sampling_of(bench.sample, {k: given[k] for k in SAMPLING_FIELDS if k in given})
        return bench_file(build(RunSelection, given), build(Search, given), bench, sampling)

    return run(build_parser(), argv, job)


if __name__ == "__main__":
    sys.exit(main())
