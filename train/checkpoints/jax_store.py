"""The JAX backend's checkpoints: orbax's `CheckpointManager`, restored onto the target's shardings."""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from . import CheckpointStore, write_checkpoint_digest


@contextlib.contextmanager
def quiet_orbax():
    """Within: absl and asyncio logs off, and TensorStore's 'Event loop is closed' tracebacks dropped."""
    levels, previous = {name: logging.getLogger(name).level for name in ("absl", "asyncio")}, sys.unraisablehook
    sys.unraisablehook = lambda r: None if repr(r.exc_value) == "RuntimeError('Event loop is closed')" else previous(r)
    for name in levels:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        sys.unraisablehook = previous
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


class JaxStore(CheckpointStore):
    """Checkpoints of a JAX state pytree in `directory` (made absolute: orbax wants it so)."""

    write_errors = (OSError, ValueError, RuntimeError)  # TensorStore's RESOURCE_EXHAUSTED is a ValueError

    def __init__(self, directory: str | os.PathLike | None, keep: int):
        super().__init__(None if directory is None else Path(directory).absolute(), keep)

    @functools.cached_property
    def manager(self) -> ocp.CheckpointManager:
        policies, bleu = ocp.checkpoint_managers, operator.itemgetter("bleu")  # the metric checkpoints rank by
        preservation = policies.AnyPreservationPolicy([
            policies.LatestN(self.keep),
            policies.BestN(get_metric_fn=bleu, n=1, keep_checkpoints_without_metrics=False),
        ])
        options = ocp.CheckpointManagerOptions(  # synchronous: the next train_step donates the state's buffers
            best_fn=bleu, best_mode="max", preservation_policy=preservation, enable_async_checkpointing=False)
        return ocp.CheckpointManager(self.root(), options=options, item_names=("state", "meta"))

    def save(self, step: int, state: Any, meta: dict[str, Any], metrics: dict[str, float] | None = None) -> None:
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        with self.saving(step), quiet_orbax():
            self.manager.save(step, args=args, metrics=metrics)
            self.manager.wait_until_finished()
            # orbax has renamed the step into place by now (its "before the rename" is internal): the digest follows
            if jax.process_index() == 0:
                write_checkpoint_digest(self.path(step))

    def discard(self, step: int) -> None:
        for partial in self.root().glob(f"{step}.orbax-checkpoint-tmp*"):  # orbax's, of a failed save
            shutil.rmtree(partial)

    def steps(self) -> list[int]:
        if self.directory is None or not self.directory.is_dir():
            return []
        self.manager.reload()
        return sorted(self.manager.all_steps())

    def metrics(self, step: int) -> dict[str, float] | None:
        metrics = self.manager.metrics(step)
        return None if metrics is None else dict(metrics)

    def load(self, step: int, target: Any) -> tuple[Any, dict[str, Any]]:
        """(checkpoint `step`'s state on `target`'s shapes, dtypes and shardings, its meta)."""
        args = ocp.args.Composite(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore())
        with quiet_orbax():
            restored = self.manager.restore(step, args=args)
        return restored["state"], dict(restored["meta"])

    def close(self) -> None:
        if (manager := self.__dict__.pop("manager", None)) is not None:  # made by a first use (cached_property)
            manager.wait_until_finished()
            manager.close()
