"""Starting a run from a pretrained one (`--init-from`): its model, tokenizers and weights, trained
on new data with a fresh optimizer and schedule (docs/finetune.md).

The library starts from a run directory of its own backend; a Marian model, a hub name or a run of
the other framework is first made one by `parity.runs.init_source` (which `train.run` calls).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from torch_reference.config import TransformerConfig

from . import data, runtime
from .backends import create_backend
from .config import ExperimentConfig
from .store import CheckpointError

# The experiment fields that decide the model's shape and vocabulary: the source's, never changed.
SOURCE_FIELDS = ("preset", "model", "vocab_size", "joint_vocab", "max_len", "lowercase")


@dataclasses.dataclass
class Pretrained:
    """What a new run takes from its source: the source's experiment, model, tokenizers and weights."""

    source: Path
    experiment: ExperimentConfig
    model_config: TransformerConfig
    tokenizers: data.Tokenizers
    params: dict[str, np.ndarray]


def adopt(cfg: ExperimentConfig, explicit: Iterable[str] | None, source: str | Path) -> ExperimentConfig:
    """`cfg` with the model fields of the run in `source` (SOURCE_FIELDS); one given (`explicit`,
    None: every field that differs from the defaults) with another value is refused by name."""
    saved = _source_experiment(source)
    defaults = ExperimentConfig()
    given = set(explicit) if explicit is not None else {
        f for f in SOURCE_FIELDS if getattr(cfg, f) != getattr(defaults, f)}
    flags = {f.name: f.metadata.get("flag", "--" + f.name.replace("_", "-")) for f in dataclasses.fields(cfg)}
    refused = [f"{flags[name]}: {source} has {getattr(saved, name)!r}, got {getattr(cfg, name)!r}"
               for name in SOURCE_FIELDS if name in given and getattr(cfg, name) != getattr(saved, name)]
    if refused:
        raise runtime.UserError("--init-from takes the model's shape and vocabulary from its source:\n  "
                                + "\n  ".join(refused))
    return cfg.replace(**{name: getattr(saved, name) for name in SOURCE_FIELDS})


def load(source: str | Path, cfg: ExperimentConfig) -> Pretrained:
    """The best checkpoint's weights, the tokenizers and the model of the run in `source`, which
    must be a run of `cfg.backend` whose model `cfg` rebuilds (dropout aside)."""
    saved, source = _source_experiment(source), Path(source)
    if saved.backend != cfg.backend:
        raise runtime.UserError(f"--init-from {source} is a {saved.backend} run and this one trains {cfg.backend}: "
                                f"convert it first (python -m parity.convert --to {cfg.backend} --run-dir {source} "
                                "--dst DIR), or start it with python -m train.run, which does")
    model_cfg = runtime.read_model_config(source)
    try:
        tokenizers = data.load_tokenizers(source, saved.joint_vocab)
    except (FileNotFoundError, ValueError) as err:
        raise runtime.UserError(str(err)) from None
    runtime.check_model(source, saved, model_cfg, tokenizers)
    backend = create_backend(saved, model_cfg, str(source / runtime.CHECKPOINTS))
    try:
        backend.restore("best")
        params = backend.export_state().params
    except (FileNotFoundError, CheckpointError) as err:
        raise runtime.UserError(f"--init-from {source}: {err}") from None
    finally:
        backend.close()
    return Pretrained(source, saved, model_cfg, tokenizers, params)


def _source_experiment(source: str | Path) -> ExperimentConfig:
    if not (Path(source) / runtime.CONFIG_FILE).is_file():
        raise runtime.UserError(f"--init-from {source}: not a run directory; train.fit starts from a run of its "
                                "backend (python -m train.run also takes a Marian directory or hf:ORG/NAME)")
    return runtime.read_experiment(source)
