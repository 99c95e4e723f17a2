"""The training objective's maths in JAX, mirroring `torch_reference/objective.py`."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def label_smoothed_cross_entropy(logits, targets, pad_id: int, smoothing: float = 0.1, reduction: str = "mean"):
    """torch's twin, from log_softmax and a gather (never a V-wide one-hot): the "mean" or "sum" over non-pad tokens."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # (B, T, V)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]  # (B, T)
    uniform = -logp.mean(axis=-1)  # (B, T)
    per_token = (1.0 - smoothing) * nll + smoothing * uniform
    keep = targets != pad_id
    total = jnp.where(keep, per_token, 0.0).sum()
    return total if reduction == "sum" else total / keep.sum()  # like torch: NaN when every target is padding


def smoothed_sums(logits, targets, pad_id: int, smoothing: float):
    """(sum of the label-smoothed losses, sum of the NLLs) over non-pad tokens: the training step's (JAX's only)."""
    return tuple(label_smoothed_cross_entropy(logits, targets, pad_id, e, "sum") for e in (smoothing, 0.0))


def noam_learning_rate(step, d_model: int, warmup_steps: int = 4000, factor: float = 1.0):
    """lr = factor · d_model^-0.5 · min(step^-0.5, step · warmup^-1.5), steps from 1 (§5.3); `step` may be traced."""
    step = jnp.maximum(jnp.asarray(step, jnp.float32), 1.0)
    return factor * d_model**-0.5 * jnp.minimum(step**-0.5, step * warmup_steps**-1.5)
