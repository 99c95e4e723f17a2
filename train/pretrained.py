"""Starting a run from a pretrained one (`--init-from`): its model, tokenizers and weights, trained
on new data with a fresh optimizer and schedule (docs/finetune.md).

The library starts from a run directory of its own backend; a Marian model, a hub name or a run of
the other framework is first made one by `parity.runs.init_source` (which `train.run` calls).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from torch_reference.config import TransformerConfig

from . import data, runtime
from .backends import create_backend
from .config import ExperimentConfig
from .store import CheckpointError


@dataclasses.dataclass
class Pretrained:
    """What a new run takes from its source: the source's experiment, model, tokenizers and weights."""

    source: Path
    experiment: ExperimentConfig
    model_config: TransformerConfig
    tokenizers: data.Tokenizers
    params: dict[str, np.ndarray]


def load(source: str | Path, cfg: ExperimentConfig) -> Pretrained:
    """The best checkpoint's weights, the tokenizers and the model of the run in `source`, which
    must be a run of `cfg.backend` whose model `cfg` rebuilds (dropout aside)."""
    saved, source = runtime.read_experiment(source), Path(source)
    if saved.backend != cfg.backend:
        raise runtime.UserError(f"--init-from {source} is a {saved.backend} run and this one trains {cfg.backend}: "
                                f"convert it first (python -m parity.convert --to {cfg.backend} --run-dir {source} "
                                "--dst DIR), or start it with python -m train.run, which does")
    model_cfg, tokenizers = runtime.read_run(source, saved)
    backend = create_backend(saved, model_cfg, str(source / runtime.CHECKPOINTS))
    try:
        backend.restore("best")
        params = backend.export_state().params
    except (FileNotFoundError, CheckpointError) as err:
        raise runtime.UserError(f"--init-from {source}: {err}") from None
    finally:
        backend.close()
    return Pretrained(source, saved, model_cfg, tokenizers, params)
