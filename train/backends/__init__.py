"""The backends: one per framework behind one interface (`interface.py`), and the factory.

`jax_backend.JaxBackend` and `torch_backend.TorchBackend` implement `Backend` with the same
semantics (the numerics contract of the README):

- loss: label-smoothed cross-entropy with PyTorch's semantics, padding ignored; with gradient
  accumulation the per-token losses of all micro-batches of an update are summed and divided by
  their total non-pad target tokens, so k micro-batches equal one batch of their union;
- optional clipping with optax's `clip_by_global_norm` formula, g * max_norm / ||g|| when
  ||g|| >= max_norm, no epsilon (torch's clip_grad_norm_ would add 1e-6 to the norm);
- Adam(β1=0.9, β2=0.98, ε=1e-9) with the paper's schedule, the first update at lr(step=1);
- dropout from the seed; eval and translation without dropout.

A backend owns its framework's state. What leaves it is a `TrainingState`: NumPy arrays keyed
by the model's own attribute paths, in its framework's layout (`parity.convert` maps one layout
onto the other), so no code outside a backend reads or writes its attributes.

This module imports neither framework: `create_backend` imports the one asked for, so a torch
run never loads jax and a jax run never loads torch.
"""

from __future__ import annotations

import importlib

from torch_reference.config import TransformerConfig

from ..config import ExperimentConfig
from .interface import Backend, Metrics, Store, Topology, Trainer, Translator

__all__ = ["Backend", "Metrics", "Store", "Topology", "Trainer", "Translator", "create_backend", "initialize"]

BACKEND_MODULES = {"jax": "train.backends.jax_backend", "torch": "train.backends.torch_backend"}


def initialize(exp_cfg: ExperimentConfig) -> Topology:
    """Join the run's processes (jax.distributed.initialize for a multi-process JAX run) and check
    --devices; call it before anything else touches a device. Raises ValueError on bad settings."""
    return importlib.import_module(BACKEND_MODULES[exp_cfg.backend]).initialize(exp_cfg)


def create_backend(
    exp_cfg: ExperimentConfig, model_cfg: TransformerConfig, checkpoint_dir: str | None = None
) -> Backend:
    """A freshly initialised backend of kind `exp_cfg.backend` (weights from `exp_cfg.seed`).

    `checkpoint_dir` is where `save`/`restore` work; None disables checkpoints.
    """
    module = importlib.import_module(BACKEND_MODULES[exp_cfg.backend])
    return module.create(exp_cfg, model_cfg, checkpoint_dir)
