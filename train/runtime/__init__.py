"""The run machinery: what keeps a run directory safe, apart from what trains in it.

One writer per run (`lock`), files written whole (`files`), a run claimed new, resumed or
replaced without losing the old one (`rundir`), directories built whole or not at all
(`replace.derive`), its settings read back (`layout`), signals (`signals`), TensorBoard events
(`events`) and resumable translation output (`output`). The library calls `session` to set a
training run up and the names below; docs/operations.md says what each guarantees.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from pathlib import Path

from ..config import ExperimentConfig
from .files import UserError, error_text, json_text, read_json, say, write_error, write_json_atomic, write_text_atomic
from .layout import (
    AVERAGED_FILE, CHECKPOINTS, CONFIG_FILE, CURVES_FILE, IMPORTED_FILE, LOCK_FILE, MODEL_FILE, PROVENANCE_FILE,
    RESULTS_FILE, TENSORBOARD, read_experiment, read_model_config,
)
from .lock import RunLock
from .replace import KIND_FILE, KINDS, check_destination, derive, kind_of, remove, swap_in
from .rundir import (
    check_checkpoint_config, check_model, claim_run_dir, follow_run_dir, lock_run_dir, prepare_run_dir, replacing,
    set_aside_path,
)
from .signals import Interrupted, StopSignals, interruptible


@contextlib.contextmanager
def session(cfg: ExperimentConfig, explicit: Iterable[str] | None, is_main: bool = True) -> Iterator[ExperimentConfig]:
    """The run directory claimed for training (`claim_run_dir`: new, --resume or --overwrite),
    locked, and an old run it replaces set aside until the new one holds a checkpoint; yields
    the config to train with. Processes other than 0 only follow (`follow_run_dir`)."""
    if not is_main:
        yield follow_run_dir(cfg, explicit)
        return
    cfg = claim_run_dir(cfg, explicit)
    with lock_run_dir(cfg), replacing(Path(cfg.run_dir), cfg.overwrite):
        yield cfg
