"""The model's two matmuls with weights, with backward passes written out for XLA:CPU.

    linear(x, w)        x (..., I) @ w (I, O)       every nnx.Linear (through `linear_dot_general`)
    tied_logits(h, e)   h (..., D) @ e (V, D)ᵀ      the output projection tied to the embedding

Both compute exactly what `jnp.matmul` computes, forward and backward; only the order of the
backward's operations is fixed here instead of left to XLA. The weight gradient contracts over
the token axis, the major axis of both the input and the incoming gradient, so one of them must
be transposed for the matmul. Left to itself, XLA:CPU transposes the incoming gradient: for the
tied projection that is a fused (N, V) -> (V, N) copy of the logits' gradient (N tokens, V
= 8000), measured at 72 ms of an 850 ms small-preset step on one core, more than the matmul it
feeds. Here the narrower operand is transposed, and the tied weight gradient is computed as
(hᵀ g)ᵀ, transposing the (D, V) result rather than the (N, V) gradient.

Measured with `python -m train.profile_step` and the bench (README, Benchmarks), on XLA:CPU only:
so they apply on the CPU platform alone (`cpu_tuned()`, read when the model is traced); on GPU and
TPU `linear_dot_general` and `logits` are plain `lax.dot_general` and `jnp.matmul`, XLA's choice.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cpu_tuned() -> bool:
    """True where the CPU findings of this project apply: the default backend is XLA:CPU."""
    return jax.default_backend() == "cpu"


def _flat(x: jax.Array) -> jax.Array:
    return x.reshape(-1, x.shape[-1])  # (..., F) -> (N, F)


@jax.custom_vjp
def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x (..., I) @ w (I, O) -> (..., O)."""
    return jnp.matmul(x, w)


def _linear_fwd(x, w):
    return linear(x, w), (x, w)


def _linear_bwd(residuals, g):
    x, w = residuals
    dx = jnp.matmul(g, w.T)  # (..., O) @ (O, I): contracts the minor axes, no transpose needed
    if x.shape[-1] <= g.shape[-1]:  # transpose the narrower of x (N, I) and g (N, O)
        dw = jnp.matmul(_flat(x).T, _flat(g))  # (I, N) @ (N, O)
    else:
        dw = jnp.matmul(_flat(g).T, _flat(x)).T  # ((O, N) @ (N, I))ᵀ
    return dx, dw.astype(w.dtype)


linear.defvjp(_linear_fwd, _linear_bwd)


@jax.custom_vjp
def tied_logits(h: jax.Array, e: jax.Array) -> jax.Array:
    """h (..., D) @ e (V, D)ᵀ -> (..., V): logits from the (shared) embedding matrix."""
    return jnp.matmul(h, e.T)


def _tied_fwd(h, e):
    return tied_logits(h, e), (h, e)


def _tied_bwd(residuals, g):
    h, e = residuals
    dh = jnp.matmul(g, e)  # (..., V) @ (V, D)
    de = jnp.matmul(_flat(h).T, _flat(g)).T  # ((D, N) @ (N, V))ᵀ: never transposes the (N, V) gradient
    return dh, de.astype(e.dtype)


tied_logits.defvjp(_tied_fwd, _tied_bwd)


def logits(h: jax.Array, e: jax.Array) -> jax.Array:
    """h (..., D) @ e (V, D)ᵀ: `tied_logits` on XLA:CPU, `jnp.matmul` elsewhere."""
    return tied_logits(h, e) if cpu_tuned() else jnp.matmul(h, e.T)


def linear_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
    """A `dot_general` for `nnx.Linear(dot_general=...)`: on XLA:CPU `linear` for the layer's own
    contraction (lhs's last axis with a 2-D rhs's first, default precision and result type),
    `lax.dot_general` for anything else and on every other platform."""
    layer_contraction = (((lhs.ndim - 1,), (0,)), ((), ()))
    if (
        cpu_tuned() and dimension_numbers == layer_contraction and rhs.ndim == 2 and precision is None
        and preferred_element_type is None and kwargs.get("out_sharding") is None
    ):
        return linear(lhs, rhs)
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type, **kwargs)
