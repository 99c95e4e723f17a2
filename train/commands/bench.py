"""Median train-step time of the same model and batches on JAX, PyTorch eager and torch.compile, with
tokens/s, model FLOPs, MFU against the matmul peak measured in the same process at the same precision, and
peak memory; each measurement in a worker process of its own (`train.benchmark.measure`)."""

from __future__ import annotations

import sys

from ..backends import allocator
from ..benchmark import PRECISION_HELP, Bench, measure, print_results
from ..options import build, command, run


def build_parser():
    return command("aiayn bench", __doc__, Bench, epilog=f"{PRECISION_HELP}. Example "
                   "on a GPU: aiayn bench --presets base,big --precisions float32,tf32,bfloat16 "
                   "--batch-tokens 16384 --length 64")


def main(argv: list[str] | None = None) -> int:
    def job(given: dict) -> None:
        bench = build(Bench, given)
        print_results(measure(bench), bench.batch_size, bench.length, bench.dropout, bench.devices)

    return run(build_parser(), argv, job)


if __name__ == "__main__":
    allocator.use_huge_pages()  # re-executes once; see train/backends/allocator.py
    sys.exit(main())
