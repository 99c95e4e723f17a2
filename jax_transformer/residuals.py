"""LayerNorm and the ReLU feed-forward's second matmul, with backward passes that keep fewer arrays.

JAX's autodiff keeps what its own backward pass reads, and XLA:CPU then keeps more: it fuses a
cheap forward computation into the backward operation that reads it (recomputing max(h + b, 0)
where the backward pass reads the ReLU's output), so the inputs of that computation stay alive
as well. For the base model at 32 × 32 tokens the compiled train step kept two (B, L, F) arrays
in every feed-forward layer (h and relu(h)), where torch keeps one, and one (B, L, D) array more
than torch for every LayerNorm (30 × 2 MiB).

    layer_norm(x, scale, bias, eps)   keeps x̂ = (x - mean) · rstd and rstd (torch: x, mean, rstd)
    relu_linear(h, w)                 relu(h) @ w keeping h alone; relu(h) is recomputed for dw

The forward passes compute exactly what `nnx.LayerNorm` (`use_fast_variance=False`) and
`linear(jax.nn.relu(h), w)` compute; the gradients are the same up to float32 rounding (tests).
Measured on XLA:CPU only (README, Benchmarks), so the model uses them on the CPU platform alone
(`matmul.cpu_tuned()`) and in float32; elsewhere it keeps Flax's LayerNorm and `jax.nn.relu`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from .matmul import _flat, cpu_tuned


def _statistics(x: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    """(x - mean, 1 / √(var + eps)) over the last axis, var = E[(x - mean)²], as Flax computes them."""
    centred = x - x.mean(-1, keepdims=True)
    return centred, jax.lax.rsqrt(jnp.mean(centred * centred, -1, keepdims=True) + eps)


@jax.custom_vjp
def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """(x - mean) / √(var + eps) · scale + bias over the last axis of x (..., D)."""
    centred, rstd = _statistics(x, eps)
    return centred * (rstd * scale) + bias  # Flax's order of operations


def _layer_norm_fwd(x, scale, bias, eps):
    centred, rstd = _statistics(x, eps)
    return centred * (rstd * scale) + bias, (centred * rstd, rstd, scale)


def _layer_norm_bwd(residuals, g):
    normed, rstd, scale = residuals  # x̂ (..., D), rstd (..., 1), scale (D,)
    g_normed = g * scale
    dx = rstd * (g_normed - g_normed.mean(-1, keepdims=True) - normed * (g_normed * normed).mean(-1, keepdims=True))
    return dx, (_flat(g) * _flat(normed)).sum(0), _flat(g).sum(0), None


layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


@jax.custom_vjp
def relu_linear(h: jax.Array, w: jax.Array) -> jax.Array:
    """relu(h) (..., F) @ w (F, D) -> (..., D)."""
    return jnp.matmul(jnp.maximum(h, 0), w)


def _relu_linear_fwd(h, w):
    return relu_linear(h, w), (h, w)


def _relu_linear_bwd(residuals, g):
    h, w = residuals
    # relu(h) again, written so that XLA neither merges it with the forward's max(h, 0) (it merges
    # `where(h > 0, h, 0)`) nor computes it during the forward pass and keeps it (it did, until
    # it read g: + 0 · g[0…0], not folded for floats). Exact: h - h = 0 for h ≤ 0.
    y = h - jnp.minimum(h, 0) + 0 * g[(0,) * g.ndim]
    dh = jnp.where(h > 0, jnp.matmul(g, w.T), 0)
    dw = jnp.matmul(_flat(y).T, _flat(g))  # (F, N) @ (N, D)
    return dh, dw.astype(w.dtype)


relu_linear.defvjp(_relu_linear_fwd, _relu_linear_bwd)


class LayerNorm(nnx.LayerNorm):
    """`nnx.LayerNorm` (the same parameters and forward pass), through `layer_norm` on XLA:CPU in
    float32 without a mask."""

    def __call__(self, x, *, mask=None):
        if cpu_tuned() and mask is None and x.dtype == jnp.float32 and self.dtype in (None, jnp.float32):
            return layer_norm(x, self.scale[...], self.bias[...], self.epsilon)
        return super().__call__(x, mask=mask)
