"""Sampling: `torch_reference/sampling.py` in one jit-compiled loop, the same tokens (docs/decoding.md#sampling)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from torch_reference.config import check_sampling

from .decode import _check_ids, _next_logprobs, _token_by_token
from .model import Transformer

# Threefry-2x32's rotation distances and key-schedule parity (Random123, threefry.h).
ROTATIONS = (13, 15, 26, 6, 17, 29, 16, 24)
PARITY = 0x1BD11BDA
MASK = 0xFFFFFFFF  # the largest uint32


def _rotl(x, r: int):
    return (x << r) | (x >> (32 - r))  # uint32: the shifts drop the bits past 32


def threefry2x32(k0, k1, x0, x1):
    """Threefry-2x32 (20 rounds) of the key (k0, k1) at the counter (x0, x1) -> two uint32 words, broadcast."""
    k0, k1, x0, x1 = (jnp.asarray(v, jnp.uint32) for v in (k0, k1, x0, x1))
    ks = (k0, k1, k0 ^ k1 ^ jnp.uint32(PARITY))
    x0, x1 = x0 + ks[0], x1 + ks[1]
    for i in range(5):  # 5 groups of 4 rounds, the key injected after each group
        for r in ROTATIONS[4 * (i % 2): 4 * (i % 2) + 4]:
            x0 = x0 + x1
            x1 = _rotl(x1, r) ^ x0
        x0 = x0 + ks[(i + 1) % 3]
        x1 = x1 + ks[(i + 2) % 3] + jnp.uint32(i + 1)
    return x0, x1


def uniform(seed, sentence, sample, position):
    """The float32 uniform in (0, 1) of (seed, sentence id, sample, position): (2m + 1) / 2**24 from Threefry."""
    word, _ = threefry2x32(seed, sentence, sample, position)
    return ((word >> 9) * 2 + 1).astype(jnp.float32) * 2.0**-24


def _sentence_ids(sentence_ids, batch: int):
    """(B,) uint32 the ids the random numbers are keyed by: 0..B-1 unless given."""
    if sentence_ids is None:
        return jnp.arange(batch, dtype=jnp.uint32)
    ids = np.asarray(sentence_ids, dtype=np.int64)
    if ids.shape != (batch,) or ((ids < 0) | (ids > MASK)).any():
        raise ValueError(f"sentence_ids must be {batch} integers in [0, 2**32), one a source row")
    return jnp.asarray(ids.astype(np.uint32))


def sampling_distribution(logprobs, temperature=1.0, top_k=0, top_p=1.0):
    """logprobs (N, V) -> probs (N, V): torch's `sampling_distribution`, the settings numbers or traced scalars."""
    # XLA flushes float32 subnormals to 0; any temperature at or below the smallest normal is greedy (torch's too)
    temperature = jnp.maximum(temperature, jnp.finfo(jnp.float32).tiny)
    scaled = (logprobs - logprobs.max(axis=-1, keepdims=True)) / temperature  # best at 0: no overflow
    scaled = _where(top_k > 0, lambda x: jnp.where(x >= _kth_largest(x, top_k), x, -jnp.inf), scaled)
    probs = jax.nn.softmax(scaled, axis=-1)

    def top_p_filter(probs):
        probs = jnp.where(_top_p_kept(probs, top_p), probs, 0.0)
        return probs / probs.sum(axis=-1, keepdims=True)

    return _where(top_p < 1, top_p_filter, probs)


def _where(on, apply, x):
    """apply(x) where `on`, else x: `on` a bool, or a traced one (both compiled, one run: `lax.cond`)."""
    if isinstance(on, jax.Array):
        return jax.lax.cond(on, apply, lambda x: x, x)
    return apply(x) if on else x


def _kth_largest(scaled, top_k):
    """scaled (N, V) -> (N, 1) each row's k-th largest value (k past V: the least); k a number or a traced one."""
    V = scaled.shape[-1]
    largest = jax.lax.top_k(scaled, V if isinstance(top_k, jax.Array) else min(top_k, V))[0]  # (N, k) falling
    return jax.lax.dynamic_slice_in_dim(largest, jnp.minimum(top_k, V) - 1, 1, axis=-1)


def _top_p_kept(probs, top_p: float):
    """probs (N, V) -> (N, V) bool, the tokens top-p keeps (torch's `_top_p_kept`: only values sorted)."""
    falling = jnp.flip(jnp.sort(probs, axis=-1), axis=-1)
    kept = (jnp.cumsum(falling, axis=-1) - falling < top_p).sum(axis=-1, keepdims=True)  # (N, 1) mass before < p
    least = jnp.take_along_axis(falling, kept - 1, axis=-1)  # (N, 1) the least kept probability
    above, tie = probs > least, probs == least
    return above | (tie & (jnp.cumsum(tie, axis=-1) <= kept - above.sum(axis=-1, keepdims=True)))


def draw(probs, u):
    """probs (N, V), u (N,) in (0, 1) -> tokens (N,) by inverse CDF in token-id order (never one of probability 0)."""
    cdf = jnp.cumsum(probs, axis=-1)
    token = (cdf <= u[:, None] * cdf[:, -1:]).sum(axis=-1)  # tokens whose cumulative probability is passed
    ids = jnp.arange(probs.shape[-1])
    last = jnp.where(probs > 0, ids, -1).max(axis=-1)  # u * total rounded up to the total
    return jnp.minimum(token, last)


def sample(
    model: Transformer, src_ids, seed: int, num_samples: int = 1, temperature: float = 1.0,
    top_k: int = 0, top_p: float = 1.0, max_len_a: float = 1.5, max_len_b: int = 10, sentence_ids=None,
):
    """`torch_reference.sampling.sample` in one loop compiled once for every seed, ids and setting (traced)."""
    _check_ids("src_ids", src_ids, model.cfg.src_vocab_size, model.cfg.max_len)
    check_sampling(seed, num_samples, temperature, top_k, top_p)
    ids = _sentence_ids(sentence_ids, src_ids.shape[0])
    return sample_loop(model, jnp.asarray(src_ids, jnp.int32), jnp.uint32(seed), ids, num_samples,
                       *settings(temperature, top_k, top_p), max_len_a, max_len_b)


def settings(temperature: float, top_k: int, top_p: float) -> tuple[np.ndarray, ...]:
    """`sample_loop`'s traced settings: float32 temperature and top-p, int32 top-k (past int32: the vocabulary)."""
    return np.float32(temperature), np.int32(min(top_k, np.iinfo(np.int32).max)), np.float32(top_p)


@functools.partial(nnx.jit, static_argnums=(4, 8, 9))
def sample_loop(model: Transformer, src_ids, seed, sentence_ids, num_samples: int, temperature, top_k, top_p,
                max_len_a: float, max_len_b: int):
    """`sample`'s drawing loop, its settings checked (traced: `settings`) and its sentence ids (B,) given."""
    cfg = model.cfg
    B, N = src_ids.shape[0], num_samples

    def choose(position, logits, must_end, c):
        logprobs = _next_logprobs(cfg, logits, must_end)
        u = uniform(seed, c["sentence"], c["sample"], position)  # (b,)
        last = draw(sampling_distribution(logprobs, temperature, top_k, top_p), u).astype(jnp.int32)
        return last, jnp.take_along_axis(logprobs, last[:, None], axis=1)[:, 0]

    # The random numbers' key and counter ride with their rows.
    rows = {"sentence": jnp.repeat(sentence_ids, N), "sample": jnp.tile(jnp.arange(N, dtype=jnp.uint32), B)}
    tokens, scores = _token_by_token(model, src_ids, N, choose, rows, max_len_a, max_len_b)
    return tokens.reshape(B, N, -1), scores.reshape(B, N)
