"""Checkpoint averaging: `python -m train.average --run-dir RUN --last N --dst OUT`, as the paper
averages the last 5 (base) or 20 (big) checkpoints (§6.1).

OUT is a run holding one checkpoint: the element-wise mean of the weights of RUN's newest N
checkpoints, at the newest one's step, with its optimizer state and data position. The mean is
taken in float64 in step order and rounded once to the weights' dtype, so it does not depend on
the framework: the same N checkpoints averaged by either backend give the same weights, bit for bit.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from . import files, rundir
from .backends import create_backend
from .config import positive_int
from .store import CheckpointError, TrainingState


def average_states(states: Sequence[TrainingState]) -> TrainingState:
    """The last state with its weights replaced by the mean of every state's (float64 sum in the
    given order, divided once, rounded once to each weight's dtype)."""
    if not states:
        raise ValueError("nothing to average")
    last = states[-1]
    params = {}
    for name, value in last.params.items():
        total = np.zeros(value.shape, np.float64)
        for state in states:
            total += state.params[name]
        params[name] = (total / len(states)).astype(value.dtype)
    return dataclasses.replace(last, params=params)


def average_run(src: str | os.PathLike, dst: str | os.PathLike, last: int = 5, overwrite: bool = False) -> dict:
    """Average the newest `last` checkpoints of run `src` into a new run directory `dst` (built
    beside it and renamed into place, so an interrupted average leaves nothing). Returns a summary."""
    src, dst = Path(src), Path(dst)
    cfg, model_cfg = rundir.read_experiment(src), rundir.read_model_config(src)
    rundir.check_destination(dst, overwrite, src=src)
    try:
        rundir.check_model(src, cfg, model_cfg, rundir.load_tokenizers(src, cfg.joint_vocab))
    except (FileNotFoundError, ValueError) as err:  # the tokenizer missing or unreadable
        raise files.UserError(str(err)) from None

    reader = create_backend(cfg, model_cfg, str(src / rundir.CHECKPOINTS))
    try:
        steps = reader.checkpoint_steps()
        if len(steps) < last:
            raise files.UserError(
                f"{src} keeps {len(steps)} checkpoint(s) (steps {', '.join(map(str, steps)) or 'none'}), fewer than "
                f"--last {last}; train with --keep-checkpoints {last} or more to average {last}"
            )
        steps = steps[-last:]
        states = []
        for step in steps:
            meta = reader.restore(step)
            states.append(reader.export_state())
    except (FileNotFoundError, CheckpointError) as err:
        raise files.UserError(str(err)) from None
    finally:
        reader.close()
    averaged = average_states(states)

    copy = (*rundir.tokenizer_files(src), rundir.MODEL_FILE, rundir.CONFIG_FILE)
    with rundir.derive(src, dst, "run", overwrite, copy) as tmp:
        writer = create_backend(cfg, model_cfg, str(tmp / rundir.CHECKPOINTS))
        try:
            writer.import_state(averaged)
            writer.save(meta)
        finally:
            writer.close()
        summary = {"run_dir": str(dst), "from": str(src), "averaged_steps": steps, "step": steps[-1]}
        files.write_json_atomic(tmp / rundir.AVERAGED_FILE, summary)
    return summary


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m train.average",
        description="Average the weights of a run's newest N checkpoints (the paper's §6.1: 5 for base models, 20 "
        "for big ones) into a new run directory that translate, evaluate and train.run --resume accept.",
    )
    parser.add_argument("--run-dir", type=Path, required=True, help="the trained run (keeps at least N checkpoints)")
    parser.add_argument("--last", type=positive_int, default=5, metavar="N",
                        help="average the newest N checkpoints (default 5)")
    parser.add_argument("--dst", type=Path, required=True, help="the new run directory to write")
    parser.add_argument("--overwrite", action="store_true", help="replace --dst if it holds a run")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        summary = average_run(args.run_dir, args.dst, args.last, args.overwrite)
    except (files.UserError, OSError) as err:  # OSError: a full disk, a read-only place, no permission
        parser.exit(1, f"error: {files.error_text(err)}\n")
    print(f"averaged steps {', '.join(map(str, summary['averaged_steps']))} of {args.run_dir} into {args.dst} "
          f"(step {summary['step']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
