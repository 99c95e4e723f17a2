"""The backends, one per framework behind one interface (`interface.py`), and the factory.

`jax_backend.JaxBackend` and `torch_backend.TorchBackend` train alike: the micro-batches of an
update sum their per-token losses over their total target tokens (k micro-batches equal one batch
of their union); clipping is optax's formula, no epsilon; Adam(0.9, 0.98, 1e-9) on the paper's
schedule, the first update at lr(step=1). What leaves a backend is a `TrainingState`
(docs/design.md). This module imports neither framework: `create_backend` imports the one asked for.
"""

from __future__ import annotations

import contextlib
import importlib

from torch_reference.config import TransformerConfig

from ..config import ExperimentConfig
from .interface import Backend, Hypotheses, Metrics, Store, Topology, Trainer, Translator

__all__ = ["Backend", "Hypotheses", "Metrics", "Store", "Topology", "Trainer", "Translator", "create_backend",
           "initialize", "launch"]

BACKEND_MODULES = {"jax": "train.backends.jax_backend", "torch": "train.backends.torch_backend"}


def initialize(exp_cfg: ExperimentConfig) -> Topology:
    """Join the run's processes (jax.distributed.initialize for a multi-process JAX run) and check
    --devices; call it before anything else touches a device. Raises ValueError on bad settings."""
    return importlib.import_module(BACKEND_MODULES[exp_cfg.backend]).initialize(exp_cfg)


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
