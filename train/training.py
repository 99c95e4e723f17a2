"""`train.fit`: a run trained from a config, a recipe or fields (docs/python.md)."""

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
    """Train the run `config` (a config, a dict, a recipe file or None) with `overrides`: results.json's content."""
    from .recipes import experiment

    if isinstance(config, ExperimentConfig):
        with user_errors(TypeError, ValueError):
            cfg, explicit = config.replace(**overrides), None  # every field that is set counts as given
    else:
        given = {**({"recipe": config} if isinstance(config, (str, os.PathLike)) else config or {}), **overrides}
        cfg, explicit = experiment(given)
    return start(cfg, explicit)


def start(cfg: ExperimentConfig, explicit: Iterable[str] | None = None) -> dict[str, Any]:
    """`loop.train(cfg)` as launched: --resume on the run's own backend, --init-from's source made such a run first."""
    from .loop import train  # here: the loop's imports take seconds that `import train` does without

    if cfg.resume and cfg.run_dir and explicit is not None and "backend" not in explicit:
        with contextlib.suppress(UserError):  # no run there: the session says so
            cfg = cfg.replace(backend=read_experiment(cfg.run_dir).backend)
    with contextlib.ExitStack() as scratch:  # holds a source converted or imported for --init-from
        return train(cfg, explicit=explicit, init_dir=pretrained.source_run(cfg, scratch))
