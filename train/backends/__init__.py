"""The backends, one per framework behind `interface.py`, and the factory; this module imports neither framework."""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json

import numpy as np

from torch_reference.config import TransformerConfig

from ..config import ExperimentConfig
from .interface import Backend, Hypotheses, Metrics, Store, Topology, Trainer, Translator

__all__ = ["Backend", "Hypotheses", "Metrics", "Store", "Topology", "Trainer", "Translator", "create_backend",
           "check_agreement", "initialize", "launch"]

BACKEND_MODULES = {"jax": "train.backends.jax_backend", "torch": "train.backends.torch_backend"}


def initialize(exp_cfg: ExperimentConfig) -> Topology:
    """Join the run's processes and check --devices before anything touches a device; ValueError on bad settings."""
    return importlib.import_module(BACKEND_MODULES[exp_cfg.backend]).initialize(exp_cfg)


def check_agreement(exp_cfg: ExperimentConfig, settings: dict) -> None:
    """OptionError in every process where one's `settings` (name: JSON value) differ from process 0's, naming one."""
    from ..runtime.files import OptionError

    digests = np.array([np.frombuffer(hashlib.sha256(json.dumps(value, sort_keys=True).encode()).digest()[:8], np.int32)
                        for value in settings.values()])
    module = importlib.import_module(BACKEND_MODULES[exp_cfg.backend])
    gathered = module.allgather(digests)  # (processes, settings, 2)
    if (differ := (gathered != gathered[0]).any(axis=2)).any():
        getattr(module, "leave", lambda: None)()  # torch: gloo's threads end here, not aborting the interpreter's exit
        first = int(differ.any(axis=0).argmax())
        name = list(settings)[first]
        raise OptionError("the run's processes disagree on " + ("{}" if name.isidentifier() else name) + ": process "
                          "{p} has another value than process 0 (this one: {value!r}); start them all with the same "
                          "settings", *[name][:name.isidentifier()], p=differ[:, first].argmax(), value=settings[name])


def launch(exp_cfg: ExperimentConfig, target, **kwargs):
    """A context in which torch --devices N runs `target(exp_cfg, **kwargs)` in its other processes; else nothing."""
    module = importlib.import_module(BACKEND_MODULES[exp_cfg.backend])
    return getattr(module, "launch", lambda *args, **kw: contextlib.nullcontext())(exp_cfg, target, **kwargs)


def create_backend(exp_cfg: ExperimentConfig, model_cfg: TransformerConfig,
                   checkpoint_dir: str | None = None) -> Backend:
    """A new backend of `exp_cfg.backend` seeded by `exp_cfg.seed`; `checkpoint_dir` None: no checkpoints."""
    module = importlib.import_module(BACKEND_MODULES[exp_cfg.backend])
    return getattr(module, f"{exp_cfg.backend.title()}Backend")(exp_cfg, model_cfg, checkpoint_dir)
