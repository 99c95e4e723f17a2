"""The kernel set `xla_cpu`, faster on XLA:CPU (docs/performance.md#the-xlacpu-tuned-path-side-by-side)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def _flat(x: jax.Array) -> jax.Array:
    return x.reshape(-1, x.shape[-1])  # (..., F) -> (N, F)


@jax.custom_vjp
def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x (..., I) @ w (I, O) -> (..., O)."""
    return jnp.matmul(x, w)


def _linear_bwd(residuals, g):
    x, w = residuals
    dx = jnp.matmul(g, w.T)  # (..., O) @ (O, I): contracts the minor axes, no transpose needed
    if x.shape[-1] <= g.shape[-1]:  # transpose the narrower of x (N, I) and g (N, O)
        dw = jnp.matmul(_flat(x).T, _flat(g))  # (I, N) @ (N, O)
    else:
        dw = jnp.matmul(_flat(g).T, _flat(x)).T  # ((O, N) @ (N, I))ᵀ
    return dx, dw.astype(w.dtype)


linear.defvjp(lambda x, w: (linear(x, w), (x, w)), _linear_bwd)


def linear_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
    """`nnx.Linear`'s `dot_general`: `linear` for the layer's own contraction, else `lax.dot_general`."""
    layer_contraction = (((lhs.ndim - 1,), (0,)), ((), ()))
    if (dimension_numbers == layer_contraction and rhs.ndim == 2 and precision is None
            and preferred_element_type is None and kwargs.get("out_sharding") is None):
        return linear(lhs, rhs)
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type, **kwargs)


@jax.custom_vjp
def tied_logits(h: jax.Array, e: jax.Array) -> jax.Array:
    """h (..., D) @ e (V, D)ᵀ -> (..., V): logits from the (shared) embedding matrix."""
    return jnp.matmul(h, e.T)


def _tied_bwd(residuals, g):
    h, e = residuals
    dh = jnp.matmul(g, e)  # (..., V) @ (V, D)
    de = jnp.matmul(_flat(h).T, _flat(g)).T  # ((D, N) @ (N, V))ᵀ: never transposes the (N, V) gradient
    return dh, de.astype(e.dtype)


tied_logits.defvjp(lambda h, e: (tied_logits(h, e), (h, e)), _tied_bwd)


def attend(embed: nnx.Embed, query: jax.Array) -> jax.Array:
    """`embed.attend(query)`, query (..., D) -> (..., V), through `tied_logits`."""
    query, embedding = embed.promote_dtype((query, embed.embedding[...]), dtype=embed.dtype)
    return tied_logits(query, embedding)


@jax.custom_vjp
def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """(x - mean) / √(var + eps) · scale + bias over the last axis of x (..., D), var = E[(x - mean)²]."""
    return _layer_norm_fwd(x, scale, bias, eps)[0]


def _layer_norm_fwd(x, scale, bias, eps):
    centred = x - x.mean(-1, keepdims=True)  # the statistics as Flax computes them
    rstd = jax.lax.rsqrt(jnp.mean(centred * centred, -1, keepdims=True) + eps)
    return centred * (rstd * scale) + bias, (centred * rstd, rstd, scale)  # Flax's order of operations


def _layer_norm_bwd(residuals, g):
    normed, rstd, scale = residuals  # x̂ (..., D), rstd (..., 1), scale (D,)
    g_normed = g * scale
    dx = rstd * (g_normed - g_normed.mean(-1, keepdims=True) - normed * (g_normed * normed).mean(-1, keepdims=True))
    return dx, (_flat(g) * _flat(normed)).sum(0), _flat(g).sum(0), None


layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


class LayerNorm(nnx.LayerNorm):
    """`nnx.LayerNorm`; under the kernel set `xla_cpu` through `layer_norm` (float32, no mask)."""

    layer_norm = None  # model.set_kernels: the kernel set's (`layer_norm` under xla_cpu)

    def __call__(self, x, *, mask=None):
        if self.layer_norm and mask is None and x.dtype == jnp.float32 and self.dtype in (None, jnp.float32):
            return self.layer_norm(x, self.scale[...], self.bias[...], self.epsilon)
        return super().__call__(x, mask=mask)


@jax.custom_vjp
def relu_linear(h: jax.Array, w: jax.Array) -> jax.Array:
    """relu(h) (..., F) @ w (F, D) -> (..., D)."""
    return jnp.matmul(jnp.maximum(h, 0), w)


def _relu_linear_bwd(residuals, g):
    h, w = residuals
    # relu(h) again, written so that XLA neither merges it with the forward's max(h, 0) (it merges
    # `where(h > 0, h, 0)`) nor computes it in the forward pass and keeps it: + 0 · g[0…0] (not folded
    # for floats) makes it wait for g. Exact: h - h = 0 for h ≤ 0.
    y = h - jnp.minimum(h, 0) + 0 * g[(0,) * g.ndim]
    dh = jnp.where(h > 0, jnp.matmul(g, w.T), 0)
    dw = jnp.matmul(_flat(y).T, _flat(g))  # (F, N) @ (N, D)
    return dh, dw.astype(w.dtype)


relu_linear.defvjp(lambda h, w: (relu_linear(h, w), (h, w)), _relu_linear_bwd)


@jax.custom_vjp
def _smoothed_sums(logits, targets, keep, smoothing):
    return _smoothed_sums_fwd(logits, targets, keep, smoothing)[0]


def _smoothed_sums_fwd(logits, targets, keep, smoothing):
    x = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(x, axis=-1)  # (B, T)
    nll = lse - jnp.take_along_axis(x, targets[..., None], axis=-1)[..., 0]
    per_token = (1.0 - smoothing) * nll + smoothing * (lse - x.mean(axis=-1))
    sums = (jnp.where(keep, per_token, 0.0).sum(), jnp.where(keep, nll, 0.0).sum())
    return sums, (logits, lse, targets, keep, smoothing)


def _smoothed_sums_bwd(residuals, cotangents):
    logits, lse, targets, keep, smoothing = residuals
    g_loss, g_nll = cotangents
    # d/dx of (1-ε)·nll + ε·uniform is softmax(x) - (1-ε)·onehot(y) - ε/V, of nll softmax(x) - onehot(y).
    vocab = logits.shape[-1]
    softmax = jnp.exp(logits.astype(jnp.float32) - lse[..., None])
    onehot = jnp.arange(vocab, dtype=targets.dtype) == targets[..., None]
    grad = (g_loss + g_nll) * softmax - jnp.where(onehot, g_loss * (1.0 - smoothing) + g_nll, 0.0)
    grad = jnp.where(keep[..., None], grad - g_loss * smoothing / vocab, 0.0)
    return grad.astype(logits.dtype), None, None, None


_smoothed_sums.defvjp(_smoothed_sums_fwd, _smoothed_sums_bwd)


def smoothed_sums(logits, targets, pad_id: int, smoothing: float):
    """(smoothed loss sum, NLL sum) over non-pad tokens, the gradient softmax - target: one (B, T, V) array."""
    return _smoothed_sums(logits, targets, targets != pad_id, jnp.float32(smoothing))


def shared_keys(x, context, kv):
    """For cross-attention: x (B, T, D) as (B / g, g * T, D) where keys and values of B / g rows serve g
    consecutive rows of x (`shrinking_while` keeps one copy a sentence); None where every row has its own."""
    rows = len(context if kv is None else kv[0])
    return None if rows == len(x) else x.reshape(rows, -1, x.shape[-1])


def best_candidates(cfg, logits, base, must_end, n: int, neg_inf: float, chunk: int = 128):
    """`decode.top_candidates` to the bit, scoring in full only the n chunks of c tokens of the largest logits."""
    B, H, V = logits.shape
    cap = max(1, min(chunk, V // n))  # small vocabularies: still at least n chunks per hypothesis
    c = next((d for d in range(cap, cap // 2, -1) if V % d == 0), cap)  # one dividing V: no padding
    m = -(-V // c)  # chunks per hypothesis; the last one padded with -inf logits
    x = jnp.pad(logits, ((0, 0), (0, 0), (0, m * c - V)), constant_values=-jnp.inf).reshape(B, H, m, c)
    x_max = x.max(axis=-1)  # (B, H, m)
    # = logits.max(-1); the barrier keeps XLA from rewriting it as a second pass over the logits.
    row_max = jax.lax.optimization_barrier(x_max).max(axis=-1, keepdims=True)  # (B, H, 1)
    lse = jnp.log(jnp.exp(logits - row_max).sum(axis=-1, keepdims=True))  # (B, H, 1)
    end = must_end[:, None, None]

    def score(x, v, base, row_max, lse):
        """Scores of logits x at token ids v (-inf past the vocabulary); the rest broadcast to x."""
        masked = (end & (v != cfg.eos_id)) | (v == cfg.pad_id) | (v == cfg.bos_id)
        return jnp.where(v < V, base + jnp.where(masked, neg_inf, (x - row_max) - lse), -jnp.inf)

    # Each chunk's best score: from its largest logit, or entry by entry where the mask is uneven.
    chunk_best = base[..., None] + jnp.where(end, neg_inf, (x_max - row_max) - lse)  # (B, H, m)
    for i in sorted({cfg.pad_id // c, cfg.bos_id // c, cfg.eos_id // c} & set(range(m))):
        special = score(x[:, :, i], i * c + jnp.arange(c), base[..., None], row_max, lse)  # (B, H, c)
        chunk_best = chunk_best.at[:, :, i].set(special.max(axis=-1))
    _, best = jax.lax.top_k(chunk_best.reshape(B, H * m), n)  # (B, n) chunk ids, hypothesis-major
    best = jnp.sort(best, axis=-1)  # index order: ties resolve as in top_k over all entries
    hyp, first = best // m, (best % m) * c  # (B, n) hypothesis and first token of each chunk
    row = jnp.arange(B)[:, None]
    entries = score(
        jnp.take_along_axis(x.reshape(B, H * m, c), best[:, :, None], axis=1),  # (B, n, c)
        first[:, :, None] + jnp.arange(c),
        base[row, hyp][..., None], row_max[row, hyp], lse[row, hyp],
    ).reshape(B, n * c)
    values, j = jax.lax.top_k(entries, n)
    return values, jnp.take_along_axis(hyp * V + first, j // c, axis=1) + j % c


# Batches of fewer sentences are not split further: another loop to compile saves little there.
SMALLEST_STAGE = 8
MAX_STAGES = 5  # loops over B, B/2, ..., B/16 sentences (see shrinking_while)


def shrinking_while(step, result, carry, length: int):
    """`decode`'s loop: `step(position, carry)` until every sentence is done or `length` positions are written ->
    `result(carry)`: `lax.while_loop`s over B, B/2, B/4, ... sentences (MAX_STAGES, SMALLEST_STAGE), rows never
    mixing (docs/performance.md#what-made-the-jax-search-fast). carry's leaves lead with the b sentences' (or b * n
    rows') axis; carry["done"] (b,), carry["cache"], carry["memory"] and carry["src_mask"] among them."""
    sizes = [carry["done"].shape[0]]
    while sizes[-1] // 2 >= SMALLEST_STAGE and len(sizes) < MAX_STAGES:
        sizes.append(sizes[-1] // 2)
    n = len(carry["src_mask"]) // sizes[0]  # rows a sentence
    one = lambda x: x[::n]  # noqa: E731 (a sentence's first row)
    cache = carry["cache"] and [{**c, "cross_k": one(c["cross_k"]), "cross_v": one(c["cross_v"])}
                                 for c in carry["cache"]]
    carry = {**carry, "cache": cache, "memory": jax.tree.map(one, carry["memory"]), "src_mask": one(carry["src_mask"])}
    cache_lengths = (length,) if carry["cache"] is None or length < 32 else (length // 4, length // 2, length)
    if len(cache_lengths) > 1:
        carry = _resize_cache(carry, cache_lengths[0])
    out = jax.tree.map(jnp.zeros_like, result(carry))
    slots = jnp.arange(sizes[0])  # the sentence in each row of the current batch

    def loop(position, carry, limit: int, next_size: int):  # until `limit` positions or `next_size` sentences live
        def going(state):
            return (state[0] < limit) & ((~state[1]["done"]).sum() > next_size)

        return jax.lax.while_loop(going, lambda state: (state[0] + 1, step(*state)), (position, carry))

    position = jnp.int32(0)
    for limit, longer in zip(cache_lengths, cache_lengths[1:]):
        position, carry = loop(position, carry, limit, sizes[1] if len(sizes) > 1 else 0)
        carry = _resize_cache(carry, longer)
    for next_size in [*sizes[1:], 0]:
        position, carry = loop(position, carry, length, next_size)
        out = jax.tree.map(lambda o, r: o.at[slots].set(r), out, result(carry))
        if next_size:
            keep = jnp.argsort(carry["done"], stable=True)[:next_size]  # the live sentences first
            b = carry["done"].shape[0]
            rows = lambda x: x.reshape(b, -1, *x.shape[1:])[keep].reshape(-1, *x.shape[1:])  # noqa: E731
            carry, slots = jax.tree.map(rows, (carry, slots))
    return out


def _resize_cache(carry, length: int):
    """carry with its self-attention keys and values (..., L, K) cut or padded to `length` positions."""
    def resize(x):
        return x[..., :length, :] if length <= x.shape[-2] else jnp.pad(
            x, [(0, 0)] * (x.ndim - 2) + [(0, length - x.shape[-2]), (0, 0)])

    return {**carry, "cache": [{**layer, "self_k": resize(layer["self_k"]), "self_v": resize(layer["self_v"])}
                               for layer in carry["cache"]]}
