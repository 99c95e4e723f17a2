"""The torch backend's checkpoints as safetensors and JSON, never pickle, renamed into place."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from typing import Any

from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from torch_reference.config import TransformerConfig

from ..runtime.files import json_text
from . import WEIGHTS_CONFIG_KEY, CheckpointStore, TrainingState, choose_checkpoint, unreadable, write_checkpoint_digest

RNG_KEY = "__torch_cpu_rng_state__"


class TorchStore(CheckpointStore):
    """Checkpoints of a torch `TrainingState` in `directory`, the newest `keep` and the best by BLEU kept."""

    read_errors = (OSError, ValueError, KeyError, RuntimeError, SafetensorError)
    write_errors = (OSError, SafetensorError)  # safetensors' says "os error 28" for a full disk

    def __init__(self, directory: str | os.PathLike | None, keep: int, model_cfg: TransformerConfig):
        super().__init__(directory, keep)
        self.model_cfg = model_cfg

    def steps(self) -> list[int]:
        if self.directory is None or not self.directory.is_dir():
            return []
        return sorted(int(p.name) for p in self.directory.iterdir() if p.name.isdigit() and (p / "meta.json").is_file())

    def metrics(self, step: int) -> dict[str, float] | None:
        try:
            return json.loads((self.path(step) / "meta.json").read_text())["metrics"]
        except (OSError, ValueError, KeyError) as err:
            raise unreadable(self.directory, step, self.steps(), err) from err

    def save(self, state: TrainingState, meta: dict[str, Any], metrics: dict[str, float] | None = None) -> None:
        root = self.root()
        tmp = root / f".tmp-{state.step}"
        with self.saving(state.step):
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            try:
                save_file(state.params, str(tmp / "model.safetensors"),
                          metadata={WEIGHTS_CONFIG_KEY: self.model_cfg.to_json()})
                moments = {RNG_KEY: state.rng}
                for name in state.mu or {}:
                    moments[f"{name}.exp_avg"], moments[f"{name}.exp_avg_sq"] = state.mu[name], state.nu[name]
                save_file(moments, str(tmp / "optimizer.safetensors"))
                # strict JSON: a non-finite metric is null
                (tmp / "meta.json").write_text(json_text({"step": state.step, "metrics": metrics, "meta": meta}))
                write_checkpoint_digest(tmp)  # every file synced and hashed, before the rename publishes them
                if (final := self.path(state.step)).exists():  # a save of this step before
                    shutil.rmtree(final)
                os.replace(tmp, final)  # the checkpoint appears complete or not at all
            finally:
                shutil.rmtree(tmp, ignore_errors=True)  # a failed save (a full disk) leaves nothing behind
        # Kept: the newest `keep` and the best by BLEU; the others, and saves interrupted earlier, deleted.
        for stale in root.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        steps = self.steps()
        keep = {*steps[-self.keep :], choose_checkpoint(steps, "best", self.metrics, self.directory)}
        for s in steps:
            if s not in keep:
                shutil.rmtree(self.path(s))

    def load(self, step: int, apply: Callable[[TrainingState], None]) -> dict[str, Any]:
        """Hand checkpoint `step`'s state to `apply` (the backend's import_state); its meta."""
        directory = self.path(step)
        record = json.loads((directory / "meta.json").read_text())
        params = load_file(str(directory / "model.safetensors"))
        moments = load_file(str(directory / "optimizer.safetensors"))
        rng = moments.pop(RNG_KEY)
        mu = {k.removesuffix(".exp_avg"): v for k, v in moments.items() if k.endswith(".exp_avg")} or None
        nu = {k.removesuffix(".exp_avg_sq"): v for k, v in moments.items() if k.endswith(".exp_avg_sq")} or None
        apply(TrainingState("torch", int(record["step"]), params, mu, nu, rng))
        return record["meta"]
