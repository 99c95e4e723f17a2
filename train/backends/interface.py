"""What the framework-neutral code asks of a backend (NumPy in and out): `Trainer`, `Translator`, `Store`, `Backend`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from torch_reference.config import TransformerConfig

from ..checkpoints import TrainingState
from ..config import ExperimentConfig
from ..data import Batch

# What `train_step` returns: framework values still on the device (reading them syncs).
Metrics = Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class Topology:
    """The processes and devices a run trains on; process 0 alone writes logs and results."""

    process_index: int = 0
    process_count: int = 1
    num_devices: int = 1
    platform: str = "cpu"  # the devices' kind, as JAX names it: cpu, gpu, tpu

    @property
    def is_main(self) -> bool:
        return self.process_index == 0


@runtime_checkable
class Trainer(Protocol):
    """One framework's model and optimiser: updates and the evaluation loss."""

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
        """One update from `grad_accum` micro-batches: loss, nll, grad_norm, lr, tokens as device values, not synced."""

    def fetch(self, metrics: Sequence[Metrics]) -> list[dict[str, float]]:
        """The host values of some `train_step` results: one synchronisation for all of them."""

    def eval_loss(self, batch: Batch) -> tuple[Any, Any, Any]:
        """(smoothed loss sum, nll sum, target tokens) of one batch, dropout off, as device scalars `float()` reads."""

    def learning_rate(self, step: int) -> float:
        """The learning rate of update number `step` (from 1)."""


@dataclasses.dataclass(frozen=True)
class Hypotheses:
    """A search's n best as NumPy, best first; an empty slot holds padding and -inf."""

    tokens: np.ndarray  # (B, n, L) int32: target ids ending with <eos>, then <pad>
    logprob: np.ndarray  # (B, n) float32: the sum of the tokens' log-probabilities, <eos> included
    score: np.ndarray  # (B, n) float32: logprob / the length penalty, what the beam ranks by


@runtime_checkable
class Translator(Protocol):
    """Search, scores and attention weights, dropout off."""

    def translate(self, src: np.ndarray, beam_size: int = 4, alpha: float = 0.6, cached: bool = True,
                  scoring: str = "gnmt", n_best: int | None = None,
                  prefix: np.ndarray | None = None) -> np.ndarray | Hypotheses:
        """Cached search, dropout off: src ids (B, S) -> target ids (B, L) ending with <eos>; `n_best`: `Hypotheses`."""

    def sample(self, src: np.ndarray, seed: int, num_samples: int = 1, temperature: float = 1.0, top_k: int = 0,
               top_p: float = 1.0, sentence_ids: np.ndarray | None = None) -> Hypotheses:
        """`num_samples` N random translations of each source (`sampling.sample`): `Hypotheses` (B, N, L)."""

    def score(self, src: np.ndarray, tgt: np.ndarray) -> np.ndarray:
        """Each target token's log-probability, dropout off: src (B, S), tgt (B, T) -> float32 (B, T), 0 at padding."""

    def cross_attention(self, src: np.ndarray, tgt_in: np.ndarray) -> np.ndarray:
        """Cross-attention weights, dropout off: src (B, S), tgt_in (B, T) -> float32 (B, layers, heads, T, S)."""

    def ensemble(self, others: Sequence[Any], average: str = "logprob") -> None:
        """Translate, sample and score from now on with the `Ensemble` of this model and `others`'."""


@runtime_checkable
class Store(Protocol):
    """Checkpoints on disk and the training state as NumPy."""

    def save(self, meta: dict[str, Any], metrics: dict[str, float] | None = None) -> None:
        """Checkpoint the state with the JSON `meta`; `metrics` (e.g. {"bleu": ...}) ranks it for keep-the-best."""

    def restore(self, which: str | int = "latest") -> dict[str, Any]:
        """Load checkpoint "latest", "best" or a step number; returns its `meta` (FileNotFoundError if none)."""

    def checkpoint_steps(self) -> list[int]:
        """Steps of the complete checkpoints on disk, oldest first."""

    def checkpoint_metrics(self, step: int) -> dict[str, float] | None:
        """The ranking metrics checkpoint `step` was saved with (e.g. {"bleu": ...}), or None."""

    def weights(self) -> dict[str, np.ndarray]:
        """The parameters as NumPy copies keyed by attribute path, in the framework's layout."""

    def export_state(self) -> TrainingState:
        """Weights, Adam's moments, the update count and the random state, as NumPy copies."""

    def import_state(self, state: TrainingState) -> None:
        """Continue from `state` in this framework's layout, checked strictly (CheckpointMismatchError, ValueError)."""

    def close(self) -> None:
        """Finish pending checkpoint writes."""


class StoreMethods:
    """The `Store` methods a backend hands unchanged to its checkpoint store, `self.store`."""

    def checkpoint_steps(self) -> list[int]:
        return self.store.steps()

    def checkpoint_metrics(self, step: int) -> dict[str, float] | None:
        return self.store.metrics(step)

    def close(self) -> None:
        self.store.close()


@runtime_checkable
class Backend(Trainer, Translator, Store, Protocol):
    """One framework's model, optimiser and checkpoints behind a framework-free interface."""
