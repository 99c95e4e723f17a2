"""`train.fit`: a run trained from a config, a recipe or fields (docs/python.md); `train.load` opens the runs it
leaves (api.py)."""

from __future__ import annotations

import os
from typing import Any

from .config import ExperimentConfig
from .runtime import user_errors


def fit(config: ExperimentConfig | dict[str, Any] | str | os.PathLike | None = None,
        **overrides: Any) -> dict[str, Any]:
    """Train the run `config` describes and return what its results.json holds: `config` is an
    `ExperimentConfig`, a dict of its fields, a recipe file (recipes/*.toml; also as a `recipe`
    field of the dict or the overrides) or None (the defaults: the numbers corpus); `overrides`
    are fields on top, e.g. `steps=300`, `run_dir="runs/mine"`, `resume=True`. Raises UserError
    for bad settings, `runtime.Interrupted` on SIGTERM/Ctrl-C (after saving a checkpoint)."""
    from .loop import train  # here: the loop's imports take seconds that `import train` does without
    from .recipes import experiment

    if isinstance(config, ExperimentConfig):
        with user_errors(TypeError, ValueError):
            cfg, explicit = config.replace(**overrides), None  # every field that is set counts as given
    else:
        given = {**({"recipe": config} if isinstance(config, (str, os.PathLike)) else config or {}), **overrides}
        cfg, explicit = experiment(given)
    return train(cfg, explicit=explicit)
