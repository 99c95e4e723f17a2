"""`python -m train.run` (`aiayn train`): train, evaluate and save a translation model: the flags of
`train.config.ExperimentConfig`'s fields, a TOML recipe's first with `--config FILE` (`train.recipes`),
and `train.training.start(config)`; one `error:` line and status 2 (flags) or 1 (files), never a traceback."""

from __future__ import annotations

import argparse
import signal
import sys

from torch_reference.config import SettingError

from .. import recipes
from ..backends.host_devices import MAX_DEVICES, check_xla_flags, split_host
from ..config import ExperimentConfig
from ..recipes import experiment
from ..runtime import Interrupted, exit_status, read_experiment
from ..runtime.files import UserError

EPILOG = """\
data specs (--train, --valid, --test; docs/operations.md#training-and-data):
  SRC:TGT:PREFIX                      aligned text files PREFIX.SRC and PREFIX.TGT, one sentence a line,
                                      plain or gzipped, e.g. de:en:../shared/data/multi30k/train
  FILE.tsv[.gz][#src=COL,tgt=COL]     tab-separated with a header row; columns default to source,target
  FILE.jsonl|.json[.gz][#src=F,tgt=F] JSON lines; fields source,target, or inside a "translation" dict
  hf:NAME[:CONFIG]:SPLIT[#src=F,tgt=F]  datasets.load_dataset: a hub id or a local dataset directory;
                                      SPLIT may slice, e.g. hf:bentrevett/multi30k:train#src=de,tgt=en
  Without --train: the embedded numbers corpus, German number words -> English, made from --seed.

examples:
  python -m train.run --backend=jax
  python -m train.run --backend=torch --steps 2000 --run-dir runs/torch-numbers
  python -m train.run --config recipes/multi30k-de-en.toml --run-dir runs/m30k   # a recipe (recipes/*.toml)
  python -m train.run --run-dir runs/torch-numbers --resume --steps 4000
  python -m train.run --devices 4 --dtype bfloat16   # data parallel over 4 devices, bf16
  python -m train.run --backend torch --devices 2    # PyTorch DDP, 2 processes (several hosts: docs/operations.md)
  torchrun --nproc-per-node 8 -m train.run --backend torch --param-sharding fsdp   # FSDP2 over 8 GPUs
Ctrl-C or SIGTERM finishes the current update, saves a checkpoint and exits (status 130/143);
`--resume` continues from the newest complete checkpoint, exactly as if never stopped (a run
started from a recipe reads it again from the run directory). A non-finite loss stops the run
before it is saved (exit status 1).
then: aiayn translate --run-dir DIR < input.txt
      aiayn evaluate --run-dir DIR --data numbers:test
"""


def parse_config(argv: list[str] | None = None) -> tuple[ExperimentConfig, set[str]]:
    """(config, names of the fields given on the command line); exits with a message on bad values."""
    parser = build_parser()
    try:
        return experiment(vars(parser.parse_args(argv)), note="flags")
    except UserError as err:  # a recipe it refused, a value the config refuses
        parser.exit(2, f"error: {recipes.flagged(err)}\n")


def build_parser() -> argparse.ArgumentParser:
    return recipes.build_parser(epilog=EPILOG)


def main(argv: list[str] | None = None, *, process_settings: bool = False) -> int:
    """The command; `process_settings`: apply the allocator setting a JAX run wants first (it
    re-executes the process once, so only `python -m train.run` and `aiayn train` ask for it)."""
    cfg, given = parse_config(argv)
    return exit_status(_train, cfg, given, process_settings)


def _train(cfg: ExperimentConfig, given: set[str], process_settings: bool) -> None:
    check_xla_flags()  # before jax reads them: XLA would abort printing its 94-line flag list
    if _backend(cfg) == "jax" and 1 < (cfg.devices or 1) <= MAX_DEVICES and cfg.num_processes in (None, 1):
        split_host(count=cfg.devices)  # on a CPU, --devices N devices as torch's N processes (before jax starts)
    if process_settings and _backend(cfg) == "jax":
        from ..backends import allocator

        allocator.use_huge_pages()
    from ..training import start  # after parsing: --help and flag errors stay fast

    try:
        start(cfg, explicit=given)
    except SettingError as err:  # the library names the parameter (init_from), the command its flag (--init-from)
        raise UserError(recipes.flagged(err)) from None
    except KeyboardInterrupt:  # a second Ctrl-C, or one outside the update loop
        raise Interrupted(signal.SIGINT, "interrupted: nothing of the current step was saved; --resume continues "
                          "from the last checkpoint") from None


def _backend(cfg: ExperimentConfig) -> str:
    """The backend this launch trains with: on --resume the run's own, which --backend need not repeat."""
    try:
        return read_experiment(cfg.run_dir).backend if cfg.resume and cfg.run_dir else cfg.backend
    except UserError:  # no run there, or a damaged one: train() says so
        return cfg.backend


if __name__ == "__main__":
    sys.exit(main(process_settings=True))
