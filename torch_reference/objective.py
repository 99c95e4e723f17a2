"""The training objective's maths in PyTorch; `jax_transformer/objective.py` mirrors it."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def label_smoothed_cross_entropy(logits: Tensor, targets: Tensor, pad_id: int, smoothing: float = 0.1,
                                 reduction: str = "mean") -> Tensor:
    """Exactly `CrossEntropyLoss(label_smoothing=ε, ignore_index=pad_id)` (§5.4) in float32: "mean" or "sum"."""
    V = logits.shape[-1]
    return F.cross_entropy(logits.reshape(-1, V).float(), targets.reshape(-1), ignore_index=pad_id,
                           label_smoothing=smoothing, reduction=reduction)


def noam_learning_rate(step: int | Tensor, d_model: int, warmup_steps: int = 4000, factor: float = 1.0):
    """lr = factor · d_model^-0.5 · min(step^-0.5, step · warmup^-1.5), steps counted from 1 (§5.3)."""
    step = max(int(step), 1)
    return factor * d_model**-0.5 * min(step**-0.5, step * warmup_steps**-1.5)
