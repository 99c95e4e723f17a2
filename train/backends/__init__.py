"""The backends, one per framework behind one interface (`interface.py`), and the factory.

`jax_backend.JaxBackend` and `torch_backend.TorchBackend` train alike: the micro-batches of an
update sum their per-token losses over their total target tokens (k micro-batches equal one batch
of their union); clipping is optax's formula, no epsilon; Adam(0.9, 0.98, 1e-9) on the paper's
schedule, the first update at lr(step=1). What leaves a backend is a `TrainingState`
(docs/design.md). This module imports neither framework: `create_backend` imports the one asked for.
"""

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
    """Join the run's processes (jax.distributed.initialize for a multi-process JAX run) and check
    --devices; call it before anything else touches a device. Raises ValueError on bad settings."""
    return importlib.import_module(BACKEND_MODULES[exp_cfg.backend]).initialize(exp_cfg)


def check_agreement(exp_cfg: ExperimentConfig, settings: dict) -> None:
    """UserError in every process of a multi-process run where one's `settings` (name: JSON value) differ from
    process 0's, naming the first that does (each gathers every process's digest of each setting)."""
    from ..runtime.files import OptionError

    digests = np.array([np.frombuffer(hashlib.sha256(json.dumps(value, sort_keys=True).encode()).digest()[:8], np.int32)
                        for value in settings.values()])
    gathered = importlib.import_module(BACKEND_MODULES[exp_cfg.backend]).allgather(digests)  # (processes, settings, 2)
    if (differ := (gathered != gathered[0]).any(axis=2)).any():
        first = int(differ.any(axis=0).argmax())
        name = list(settings)[first]
        raise OptionError("the run's processes disagree on " + ("{}" if name.isidentifier() else name) + ": process "
                          "{p} has another value than process 0 (this one: {value!r}); start them all with the same "
                          "settings", *[name][:name.isidentifier()], p=differ[:, first].argmax(), value=settings[name])


def launch(exp_cfg: ExperimentConfig, target, **kwargs):
    """A context around a run: where the backend starts its own processes (torch --devices N), they
    run `target(exp_cfg, **kwargs)` beside this one inside it; else nothing."""
    module = importlib.import_module(BACKEND_MODULES[exp_cfg.backend])
    return getattr(module, "launch", lambda *args, **kw: contextlib.nullcontext())(exp_cfg, target, **kwargs)


def create_backend(exp_cfg: ExperimentConfig, model_cfg: TransformerConfig,
                   checkpoint_dir: str | None = None) -> Backend:
    """A freshly initialised backend of kind `exp_cfg.backend` (weights from `exp_cfg.seed`); `checkpoint_dir` is
    where `save`/`restore` work, None disables checkpoints."""
    module = importlib.import_module(BACKEND_MODULES[exp_cfg.backend])
    return getattr(module, f"{exp_cfg.backend.title()}Backend")(exp_cfg, model_cfg, checkpoint_dir)
