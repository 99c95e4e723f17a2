"""The training objective's maths in JAX, mirroring `torch_reference/objective.py`."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def label_smoothed_cross_entropy(logits, targets, pad_id: int, smoothing: float = 0.1, reduction: str = "mean"):
    """Cross-entropy against (1-ε)·onehot + ε/V (paper §5.4), padding ignored.

    Equal to PyTorch's `CrossEntropyLoss(label_smoothing=ε, ignore_index=pad_id)`: logits (B, T, V),
    targets (B, T) -> the mean over non-pad tokens ("mean") or their sum ("sum"). Computed from
    log_softmax and a gather, never a V-wide one-hot: per token
        loss = (1-ε)·(-log p[y]) + ε·mean_v(-log p[v]).
    """
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # (B, T, V)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]  # (B, T)
    uniform = -logp.mean(axis=-1)  # (B, T)
    per_token = (1.0 - smoothing) * nll + smoothing * uniform
    keep = targets != pad_id
    total = jnp.where(keep, per_token, 0.0).sum()
    if reduction == "sum":
        return total
    return total / keep.sum()  # like torch: NaN when every target is padding


def noam_learning_rate(step, d_model: int, warmup_steps: int = 4000, factor: float = 1.0):
    """lr = factor · d_model^-0.5 · min(step^-0.5, step · warmup^-1.5), steps counted from 1 (§5.3).

    Traceable: `step` may be an optax count (counted from 0 by the caller, who adds 1).
    """
    step = jnp.maximum(jnp.asarray(step, jnp.float32), 1.0)
    return factor * d_model**-0.5 * jnp.minimum(step**-0.5, step * warmup_steps**-1.5)


@jax.custom_vjp
def _smoothed_sums(logits, targets, keep, smoothing):
    return _smoothed_sums_fwd(logits, targets, keep, smoothing)[0]


def _smoothed_sums_fwd(logits, targets, keep, smoothing):
    x = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(x, axis=-1)  # (B, T)
    nll = lse - jnp.take_along_axis(x, targets[..., None], axis=-1)[..., 0]
    uniform = lse - x.mean(axis=-1)
    per_token = (1.0 - smoothing) * nll + smoothing * uniform
    sums = (jnp.where(keep, per_token, 0.0).sum(), jnp.where(keep, nll, 0.0).sum())
    return sums, (logits, lse, targets, keep, smoothing)


def _smoothed_sums_bwd(residuals, cotangents):
    logits, lse, targets, keep, smoothing = residuals
    g_loss, g_nll = cotangents
    # d/dx of (1-ε)·nll + ε·uniform is softmax(x) - (1-ε)·onehot(y) - ε/V, of nll softmax(x) - onehot(y):
    # one (B, T, V) array, written in one pass.
    vocab = logits.shape[-1]
    softmax = jnp.exp(logits.astype(jnp.float32) - lse[..., None])
    onehot = jnp.arange(vocab, dtype=targets.dtype) == targets[..., None]
    grad = (g_loss + g_nll) * softmax - jnp.where(onehot, g_loss * (1.0 - smoothing) + g_nll, 0.0)
    grad = jnp.where(keep[..., None], grad - g_loss * smoothing / vocab, 0.0)
    return grad.astype(logits.dtype), None, None, None


_smoothed_sums.defvjp(_smoothed_sums_fwd, _smoothed_sums_bwd)


def label_smoothed_sums(logits, targets, pad_id: int, smoothing: float = 0.1):
    """(sum of `label_smoothed_cross_entropy`'s per-token losses, sum of their negative log-likelihoods)
    over non-pad tokens, with the gradient written out: softmax(x) - target distribution, one
    (B, T, V) array in the backward pass and none kept from the forward but the logits (autodiff
    of log_softmax keeps log-probabilities and builds several V-wide temporaries)."""
    return _smoothed_sums(logits, targets, targets != pad_id, jnp.float32(smoothing))
