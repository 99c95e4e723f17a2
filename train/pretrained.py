"""Starting a run from a pretrained one (`--init-from`) with a fresh optimizer and schedule (docs/finetune.md)."""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
from pathlib import Path

import numpy as np

from torch_reference.config import TransformerConfig

from . import data, rundir, runtime
from .backends import create_backend
from .checkpoints import CheckpointError
from .config import ExperimentConfig
from .options import OptionError


@dataclasses.dataclass
class Pretrained:
    """What a new run takes from its source: its directory, model, tokenizers and weights."""

    source: Path
    model_config: TransformerConfig
    tokenizers: data.Tokenizers
    params: dict[str, np.ndarray]


def source_run(cfg: ExperimentConfig, scratch: contextlib.ExitStack) -> Path | None:
    """The run directory of `cfg.backend` --init-from's weights are read from (in `scratch`), or None."""
    source, backend = cfg.init_from, cfg.backend
    if (source is None and cfg.resume and cfg.run_dir and (Path(cfg.run_dir) / runtime.CONFIG_FILE).is_file()
            and not rundir.has_checkpoint(Path(cfg.run_dir))):
        saved = runtime.read_experiment(cfg.run_dir)
        source, backend = saved.init_from, saved.backend
    if source is None:
        return None
    from .interop.runs import init_source  # loads both frameworks: only for a source to convert

    # Made here, not for every run: a killed process leaves it behind.
    where = Path(scratch.enter_context(tempfile.TemporaryDirectory(prefix="aiayn-init-"))) / "source"
    try:
        return init_source(source, backend, where)
    except (FileNotFoundError, ValueError) as err:
        raise refused(source, runtime.error_text(err)) from None


def load(source: str | Path, cfg: ExperimentConfig) -> Pretrained:
    """The best checkpoint's weights, the tokenizers and the model of `source`, a `cfg.backend` run (`source_run`)."""
    source = Path(source)
    saved, model_cfg, tokenizers = rundir.read_run(source)
    try:
        with contextlib.closing(create_backend(saved, model_cfg, str(source / runtime.CHECKPOINTS))) as backend:
            backend.restore("best")
            params = backend.export_state().params
    except (FileNotFoundError, CheckpointError) as err:
        raise refused(cfg.init_from, str(err)) from None
    return Pretrained(source, model_cfg, tokenizers, params)


def refused(source: str | Path | None, why: str) -> OptionError:
    """An error about the source `init_from` names: `init_from SOURCE: WHY` (`--init-from` at the command line)."""
    return OptionError("{} " + f"{source}: {why}".replace("{", "{{").replace("}", "}}"), "init_from")
