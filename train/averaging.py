"""Checkpoint averaging (`aiayn average`), as the paper averages the last 5 (base) or 20
(big) checkpoints (§6.1).

OUT is a run holding one checkpoint: the element-wise mean of the weights of RUN's newest N
checkpoints, at the newest one's step, with its optimizer state and data position. The mean is
taken in float64 in step order and rounded once to the weights' dtype, so it does not depend on
the framework: the same N checkpoints averaged by either backend give the same weights, bit for bit.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from torch_reference.config import POSITIVE

from . import data, runtime
from .backends import create_backend
from .options import checked, option
from .store import CheckpointError, TrainingState


@checked
class Averaging:
    """What `average_run` averages: the newest `last` checkpoints of run `src` into a new run `dst`."""

    src: Path = option(None, "the trained run (keeps at least N checkpoints)", flag="--run-dir", required=True,
                     metavar="RUN")
    dst: Path = option(None, "the new run directory to write", required=True, metavar="OUT")
    last: int = option(5, "average the newest N checkpoints", range=POSITIVE, metavar="N")
    overwrite: bool = option(False, "replace --dst if it holds a run")


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
    Averaging(src, dst, last, overwrite)  # its checks: 0 would average every checkpoint, -1 all but the oldest
    src, dst = Path(src), Path(dst)
    runtime.rundir.check_set_aside(src)
    cfg = runtime.read_experiment(src)
    runtime.check_destination(dst, overwrite, src=src)
    model_cfg, _ = runtime.read_run(src, cfg)

    reader = create_backend(cfg, model_cfg, str(src / runtime.CHECKPOINTS))
    try:
        steps = reader.checkpoint_steps()
        if len(steps) < last:
            have = ", ".join(map(str, steps)) or "none"
            raise runtime.UserError(f"{src} keeps {len(steps)} checkpoint(s) (steps {have}), fewer than --last "
                                    f"{last}; train with --keep-checkpoints {last} or more to average {last}")
        steps = steps[-last:]
        states = []
        for step in steps:
            meta = reader.restore(step)
            states.append(reader.export_state())
    except (FileNotFoundError, CheckpointError) as err:
        raise runtime.UserError(str(err)) from None
    finally:
        reader.close()
    averaged = average_states(states)

    copy = (*data.tokenizer_files(src), runtime.MODEL_FILE, runtime.CONFIG_FILE)
    with runtime.derive(src, dst, "run", overwrite, copy) as tmp:
        writer = create_backend(cfg, model_cfg, str(tmp / runtime.CHECKPOINTS))
        try:
            writer.import_state(averaged)
            writer.save(meta)
        finally:
            writer.close()
        summary = {"run_dir": str(dst), "from": str(src), "averaged_steps": steps, "step": steps[-1]}
        runtime.write_json_atomic(tmp / runtime.AVERAGED_FILE, summary)
    return summary
