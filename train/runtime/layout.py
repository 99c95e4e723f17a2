"""A run directory's files (docs/operations.md#run-directories) and reading its settings back."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from torch_reference.config import TransformerConfig

from ..config import ExperimentConfig
from .files import UserError, read_json

CONFIG_FILE, MODEL_FILE, RESULTS_FILE = "config.json", "model.json", "results.json"  # experiment, TransformerConfig
PROVENANCE_FILE = "converted.json"  # where a converted run came from (aiayn convert --run-dir)
AVERAGED_FILE = "averaged.json"  # which checkpoints an averaged run holds the mean of (aiayn average)
CURVES_FILE = "curves.png"  # learning curves, drawn at the end of a run (aiayn curves)
IMPORTED_FILE = "imported.json"  # a pretrained model's origin and original numbering (aiayn convert --from)
CHECKPOINTS, TENSORBOARD = "checkpoints", "tensorboard"  # checkpoints/<step>/ (train.checkpoints), event files
LOCK_FILE = ".lock"  # held (flock) by the one process that writes the run


def read_experiment(run_dir: str | Path) -> ExperimentConfig:
    """The experiment saved in `run_dir`'s config.json (launch options at their defaults)."""
    return _read_settings(run_dir, CONFIG_FILE, experiment_of)


def experiment_of(saved: Mapping[str, Any]) -> ExperimentConfig:
    """A saved experiment without the launch options older runs saved; a run saved before packing: pack false."""
    launch = ExperimentConfig.launch_fields()
    return ExperimentConfig.from_dict({"pack": False, **{k: v for k, v in saved.items() if k not in launch}})


def _read_settings(run_dir: str | Path, name: str, build: Callable[[dict], Any]) -> Any:
    """`build` of the JSON object in run_dir/name; UserError naming the file when missing, not an object, refused."""
    path = Path(run_dir) / name
    if not path.is_file():
        raise UserError(f"{run_dir} is not a run directory ({name} missing)")
    saved = read_json(path)
    if not isinstance(saved, dict):
        raise UserError(f"{path} holds no JSON object of settings")
    try:
        return build(saved)
    except (TypeError, ValueError) as err:
        raise UserError(f"{path}: {err}") from None


def read_model_config(run_dir: str | Path) -> TransformerConfig:
    return _read_settings(run_dir, MODEL_FILE, TransformerConfig.from_dict)

