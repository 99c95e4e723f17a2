"""The interface the framework-neutral loop talks to, and the factory that picks a backend.

`backend_jax.JaxBackend` and `backend_torch.TorchBackend` implement `Backend` with the same
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

import dataclasses
import importlib
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from torch_reference.config import TransformerConfig

from .config import ExperimentConfig
from .data import Batch

# What `train_step` returns: framework values still on the device (reading them syncs).
Metrics = Mapping[str, Any]


@runtime_checkable
class Backend(Protocol):
    """One framework's model, optimiser and checkpoints behind a framework-free interface.

    Arrays cross it as NumPy (batches in, token ids out); per-step metrics stay on the device
    until `fetch`, so the loop decides when to synchronise.
    """

    name: str  # the framework: "jax" or "torch", the layout of its TrainingState
    model_cfg: TransformerConfig
    exp_cfg: ExperimentConfig

    @property
    def topology(self) -> Topology:
        """Where it trains: this process among how many, over how many devices in all."""

    @property
    def step(self) -> int:
        """Optimizer updates applied so far (0 before the first)."""

    @property
    def num_params(self) -> int:
        """Trainable parameters (a shared embedding counted once)."""

    def train_step(self, batches: Sequence[Batch]) -> Metrics:
        """One update from `grad_accum` micro-batches. Returns device values, not synced:
        loss (label-smoothed, mean per target token), nll (the same without smoothing),
        grad_norm (before clipping), lr (of this update), tokens."""

    def fetch(self, metrics: Sequence[Metrics]) -> list[dict[str, float]]:
        """The host values of some `train_step` results: one synchronisation for all of them."""

    def eval_loss(self, batch: Batch) -> tuple[Any, Any, Any]:
        """(smoothed loss sum, nll sum, target tokens) of one batch, dropout off, as device scalars
        that support `+`; `float()` of a sum reads it."""

    def translate(self, src: np.ndarray, beam_size: int = 4, alpha: float = 0.6, cached: bool = True,
                  scoring: str = "gnmt") -> np.ndarray:
        """Cached search (`decode.py` of the backend's framework), dropout off: src ids (B, S) ->
        target ids (B, L) ending with <eos> then <pad>; greedy when beam_size is 1. L and each
        sentence's length limit follow decode.output_length / sentence_limits (1.5 x source + 10,
        at most the model's max_len). Never emits <pad> or <bos>. `cached=False`: the same search
        re-running the decoder over every prefix (the benchmark's baseline). `scoring`: how beams
        are ranked, "gnmt" or "hf" (`torch_reference.config.SCORINGS`)."""

    def learning_rate(self, step: int) -> float:
        """The learning rate of update number `step` (from 1)."""

    def save(self, meta: dict[str, Any], metrics: dict[str, float] | None = None) -> None:
        """Checkpoint weights, optimizer state and step, with the JSON `meta` (data position,
        config); `metrics` (e.g. {"bleu": ...}) ranks it for keep-the-best."""

    def restore(self, which: str | int = "latest") -> dict[str, Any]:
        """Load checkpoint "latest", "best" or a step number; returns its `meta`.
        Raises FileNotFoundError when there is none."""

    def checkpoint_steps(self) -> list[int]:
        """Steps of the complete checkpoints on disk, oldest first."""

    def checkpoint_metrics(self, step: int) -> dict[str, float] | None:
        """The ranking metrics checkpoint `step` was saved with (e.g. {"bleu": ...}), or None."""

    def weights(self) -> dict[str, np.ndarray]:
        """The parameters as NumPy copies keyed by attribute path, in the framework's layout."""

    def export_state(self) -> TrainingState:
        """Weights, Adam's moments, the update count and the random state, as NumPy copies."""

    def import_state(self, state: TrainingState) -> None:
        """Continue from `state` (of this framework, or converted to its layout by parity.convert):
        weights, moments and update count (the schedule's position follows it); the random state
        when it is this framework's, else the backend keeps its own. Keys, shapes and dtypes are
        checked strictly (CheckpointMismatchError, ValueError)."""

    def close(self) -> None:
        """Finish pending checkpoint writes."""

    def cross_attention(self, src: np.ndarray, tgt_in: np.ndarray) -> np.ndarray:
        """The decoder's cross-attention weights, dropout off, for src ids (B, S) and decoder
        inputs tgt_in (B, T) (teacher forcing: <bos> then the target tokens) -> float32
        (B, layers, heads, T, S), as the model computes them (`return_attention=True`). Row t
        weighs the source for the prediction after tgt_in[:, t]; each row sums to 1 and padded
        source positions get 0."""


BACKEND_MODULES = {"jax": "train.backend_jax", "torch": "train.backend_torch"}


@dataclasses.dataclass
class TrainingState:
    """One backend's training state, framework-neutral: NumPy arrays keyed by attribute path.

    `framework` names the layout of the arrays ("jax": Flax paths, kernels (in, out); "torch":
    state-dict keys, weights (out, in)). `mu` and `nu` are Adam's moments, None before the first
    update (torch keeps none then). `rng` is the framework's own random state (JAX: the run's
    key data; torch: the CPU generator), None once the state has crossed frameworks, since
    dropout streams cannot be matched. The data position travels in the checkpoint's meta.
    """

    framework: str
    step: int
    params: dict[str, np.ndarray]
    mu: dict[str, np.ndarray] | None = None
    nu: dict[str, np.ndarray] | None = None
    rng: np.ndarray | None = None

    def check(self) -> None:
        """Both moments or neither, with the parameters' keys, shapes and dtypes."""
        if (self.mu is None) != (self.nu is None):
            raise ValueError("Adam state holds only one of its two moments")
        if self.mu is None:
            if self.step != 0:
                raise ValueError(f"Adam state is empty but the step is {self.step}: the moments are missing")
            return
        shapes = {k: np.shape(v) for k, v in self.params.items()}
        for name, moments in (("Adam first moments (mu / exp_avg)", self.mu), ("Adam second moments (nu / exp_avg_sq)", self.nu)):
            check_keys(name, shapes, {k: np.shape(v) for k, v in moments.items()})
            wrong = [f"{k}: {np.dtype(m.dtype)}, parameter {np.dtype(self.params[k].dtype)}"
                     for k, m in moments.items() if m.dtype != self.params[k].dtype]
            if wrong:
                raise ValueError(f"{name} have other dtypes than their parameters:\n  " + "\n  ".join(wrong))

    def differences(self, other: TrainingState) -> list[str]:
        """What differs from `other`, bit for bit (empty: identical; the random state not compared)."""
        out = [f"{name} {a} != {b}" for name in ("framework", "step")
               if (a := getattr(self, name)) != (b := getattr(other, name))]
        for name in ("params", "mu", "nu"):
            x, y = getattr(self, name), getattr(other, name)
            if (x is None) != (y is None):
                out.append(f"{name}: one side empty")
            elif x is not None and x.keys() != y.keys():
                out.append(f"{name}: keys differ")
            elif x is not None:
                out += [f"{name}.{k}" for k in x if x[k].dtype != y[k].dtype or not np.array_equal(x[k], y[k])]
        return out


class CheckpointMismatchError(ValueError):
    """Weights that do not fit the architecture: lists every offending key with both shapes."""

    def __init__(self, what: str, missing=(), unexpected=(), wrong_shape=()):
        self.missing, self.unexpected, self.wrong_shape = list(missing), list(unexpected), list(wrong_shape)
        lines = [f"{what} do not match the architecture:"]
        lines += [f"  missing     {k}  expected {tuple(s)}" for k, s in self.missing]
        lines += [f"  unexpected  {k}  got {tuple(s)}" for k, s in self.unexpected]
        lines += [f"  wrong shape {k}  expected {tuple(e)}, got {tuple(g)}" for k, e, g in self.wrong_shape]
        super().__init__("\n".join(lines))


def check_keys(what: str, expected: Mapping[str, tuple], got: Mapping[str, tuple]) -> None:
    """CheckpointMismatchError unless `got` has exactly the keys and shapes of `expected`."""
    missing = [(k, expected[k]) for k in expected if k not in got]
    unexpected = [(k, got[k]) for k in got if k not in expected]
    wrong = [(k, expected[k], got[k]) for k in expected if k in got and tuple(got[k]) != tuple(expected[k])]
    if missing or unexpected or wrong:
        raise CheckpointMismatchError(what, missing, unexpected, wrong)


class CheckpointError(Exception):
    """A checkpoint on disk that cannot be restored: truncated, corrupted, or of another model."""


def unreadable(directory, step: int, steps: Sequence[int], err: BaseException) -> CheckpointError:
    """The CheckpointError for checkpoint `step` of `directory` failing with `err`, naming the
    other checkpoints there (`steps`) as the way out."""
    others = [s for s in steps if s != step]
    hint = (
        f"the other checkpoints there are steps {others}: pick one with --checkpoint STEP (translate, evaluate), "
        f"or delete {step}/ so that --resume continues from the newest one left"
        if others
        else "it is the only one there"
    )
    reason = " ".join(str(err).split()).split(" See full")[0]  # TensorStore appends pages of its spec
    reason = f"{type(err).__name__}: {reason[:300]}{'...' if len(reason) > 300 else ''}"
    return CheckpointError(f"checkpoint {step} in {directory} cannot be restored ({reason}); {hint}")


@dataclasses.dataclass(frozen=True)
class Topology:
    """The processes and devices a run trains on. Every update's global batch is split evenly
    over `num_devices` (all processes together); process 0 alone writes logs and results."""

    process_index: int = 0
    process_count: int = 1
    num_devices: int = 1

    @property
    def is_main(self) -> bool:
        return self.process_index == 0


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
