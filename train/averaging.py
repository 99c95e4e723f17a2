"""Checkpoint averaging (`aiayn average`, paper §6.1): the mean of a run's newest N checkpoints,
in float64 rounded once (alike bit for bit in either backend), at the newest one's step and state."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from torch_reference.config import POSITIVE

from . import data, rundir, runtime
from .backends import create_backend
from .checkpoints import CheckpointError, TrainingState
from .options import OptionError, checked, option


@checked
class Averaging:
    """What `average_run` averages: the newest `last` checkpoints of run `src` into a new run `dst`."""

    src: Path = option(None, "the trained run (keeps at least N checkpoints)", flag="--run-dir", required=True,
                     metavar="RUN")
    dst: Path = option(None, "the new run directory to write", required=True, metavar="OUT")
    last: int = option(5, "average the newest N checkpoints", range=POSITIVE, metavar="N")
    overwrite: bool = option(False, "replace --dst if it holds a run")


def average_states(states: Sequence[TrainingState]) -> TrainingState:
    """The last state with the mean weights of all (a float64 sum in order, divided and rounded once)."""
    if not states:
        raise ValueError("nothing to average")
    params = {name: (sum(s.params[name].astype(np.float64) for s in states) / len(states)).astype(value.dtype)
              for name, value in states[-1].params.items()}
    return dataclasses.replace(states[-1], params=params)


def average_run(src: str | os.PathLike, dst: str | os.PathLike, last: int = 5, overwrite: bool = False) -> dict:
    """Average the newest `last` checkpoints of run `src` into a new run `dst`, whole or not at all; a summary."""
    Averaging(src, dst, last, overwrite)  # its checks: 0 would average every checkpoint, -1 all but the oldest
    src, dst = Path(src), Path(dst)
    cfg, model_cfg, _ = rundir.read_run(src)
    runtime.check_destination(dst, overwrite, src=src)

    with (runtime.user_errors(FileNotFoundError, CheckpointError),
          contextlib.closing(create_backend(cfg, model_cfg, str(src / runtime.CHECKPOINTS))) as reader):
        steps = reader.checkpoint_steps()
        if len(steps) < last:
            have = ", ".join(map(str, steps)) or "none"
            raise OptionError("{src} keeps {n} checkpoint(s) (steps {have}), fewer than {} {last}; train keeping "
                              "{last} or more to average {last}", "last", src=src, n=len(steps), have=have, last=last)
        steps = steps[-last:]
        states = []
        for step in steps:
            meta = reader.restore(step)
            states.append(reader.export_state())
    averaged = average_states(states)

    copy = (*data.tokenizer_files(src), runtime.MODEL_FILE, runtime.CONFIG_FILE)
    with runtime.derive(src, dst, "run", overwrite, copy) as tmp:
        with contextlib.closing(create_backend(cfg, model_cfg, str(tmp / runtime.CHECKPOINTS))) as writer:
            writer.import_state(averaged)
            writer.save(meta)
        summary = {"run_dir": str(dst), "from": str(src), "averaged_steps": steps, "step": steps[-1]}
        runtime.write_json_atomic(tmp / runtime.AVERAGED_FILE, summary)
    return summary
