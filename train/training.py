"""`train.fit`: a run trained from a config, a recipe or fields (docs/python.md); `train.load` opens the runs it
leaves (api.py)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from typing import Any

from . import pretrained
from .config import ExperimentConfig
from .runtime import UserError, read_experiment, user_errors


def fit(config: ExperimentConfig | dict[str, Any] | str | os.PathLike | None = None,
        **overrides: Any) -> dict[str, Any]:
    """Train the run `config` describes and return what its results.json holds: `config` is an
    `ExperimentConfig`, a dict of its fields, a recipe file (recipes/*.toml; also as a `recipe`
    field of the dict or the overrides) or None (the defaults: the numbers corpus); `overrides`
    are fields on top, e.g. `steps=300`, `run_dir="runs/mine"`, `resume=True`. Raises UserError
    for bad settings, `runtime.Interrupted` on SIGTERM/Ctrl-C (after saving a checkpoint)."""
    from .recipes import experiment

    if isinstance(config, ExperimentConfig):
        with user_errors(TypeError, ValueError):
            cfg, explicit = config.replace(**overrides), None  # every field that is set counts as given
    else:
        given = {**({"recipe": config} if isinstance(config, (str, os.PathLike)) else config or {}), **overrides}
        cfg, explicit = experiment(given)
    return start(cfg, explicit)


def start(cfg: ExperimentConfig, explicit: Iterable[str] | None = None) -> dict[str, Any]:
    """`loop.train(cfg)` as `train.fit` and `python -m train.run` launch it: on --resume without --backend, the
    run's own backend (its processes start); --init-from's source made a run of that backend first
    (`pretrained.source_run`, in a directory removed after), which every process then reads."""
    from .loop import train  # here: the loop's imports take seconds that `import train` does without

    if cfg.resume and cfg.run_dir and explicit is not None and "backend" not in explicit:
        with contextlib.suppress(UserError):  # no run there: the session says so
            cfg = cfg.replace(backend=read_experiment(cfg.run_dir).backend)
    with contextlib.ExitStack() as scratch:  # holds a source converted or imported for --init-from
        return train(cfg, explicit=explicit, init_dir=pretrained.source_run(cfg, scratch))
