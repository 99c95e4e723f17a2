"""Search over the Flax model's cached decoding: greedy and beam search, each one jit-compiled
`lax.while_loop` with static shapes.

The same algorithm as `torch_reference/decode.py` (read its docstrings for the details), with the
same names and defaults; both return identical tokens and scores to float32 rounding. Output
tokens (B, L) exclude BOS, end with EOS and are padded after it, with
L = min(max_len, floor(max_len_a * S + max_len_b)) for a padded source length S. `cached=False`
re-runs the whole decoder over the (padded, causally masked) prefix at every step instead.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from .model import Transformer, padding_mask

# A finite "minus infinity": sums of it stay finite, so no inf - inf = NaN in the scores.
NEG_INF = -1.0e9


def length_penalty(length, alpha: float):
    """GNMT's ((5 + length) / 6) ** alpha (Wu et al., 2016); scores are log-probability / penalty."""
    return ((5.0 + length) / 6.0) ** alpha


def output_length(src_len: int, max_len: int, max_len_a: float, max_len_b: int) -> int:
    """The padded output length for a padded source length: a static shape."""
    return max(1, min(max_len, math.floor(max_len_a * src_len + max_len_b)))


def sentence_limits(src_ids, pad_id: int, length: int, max_len_a: float, max_len_b: int):
    """(B,) the most tokens each sentence may produce: a * its length + b, at most `length`."""
    src_len = (src_ids != pad_id).sum(axis=1).astype(jnp.float32)
    return jnp.clip(jnp.floor(max_len_a * src_len + max_len_b), 1, length).astype(jnp.int32)


def best_candidates(cfg, logits, base, must_end, n: int, chunk: int = 128):
    """The n best extensions of each sentence's hypotheses, as `lax.top_k` over their scores.

    logits (B, H, V) of H hypotheses with scores base (B, H); must_end (B,) marks sentences at
    their length limit -> (values (B, n), indices (B, n) into H*V): the same as
    `lax.top_k((base[..., None] + logprobs).reshape(B, H*V), n)` for
    logprobs = where(masked, NEG_INF, log_softmax(logits)), masked = pad, BOS and, where must_end,
    every token but EOS; same values, indices and order (ties to the lower index).

    Why not that one line: on XLA's CPU backend it costs a pass writing B*H*V scores and a TopK
    that partially sorts all H*V indices of a sentence (std::partial_sort), the bulk of a step.
    Here the vocabulary is cut into chunks of c tokens. The score is monotone in the logit
    within a hypothesis (base + ((x - max) - logsumexp) rounds monotonically), so a chunk's best
    score is that of its largest logit, read from a max over the logits; only chunks holding
    pad, BOS or EOS (masked unevenly) are scored entry by entry. The n best entries lie in the n
    chunks with the best maxima: order entries by (score descending, index ascending), and a
    chunk by its first entry in that order, as top_k over the maxima does (chunks are contiguous
    in index order); an entry of any other chunk follows those n chunks' first entries, so it is
    not among the n best. Those n chunks are then scored in full, in index order, and ranked.
    """
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
        return jnp.where(v < V, base + jnp.where(masked, NEG_INF, (x - row_max) - lse), -jnp.inf)

    # Each chunk's best score: from its largest logit, or entry by entry where the mask is uneven.
    chunk_best = base[..., None] + jnp.where(end, NEG_INF, (x_max - row_max) - lse)  # (B, H, m)
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


def _init_cache(model: Transformer, memory, length: int, cached: bool):
    """The key/value cache over memory, or None for `cached=False`.

    The barrier materialises the cache before the loop. Without it XLA keeps the cross-attention
    keys and values in the (B, S, H, K) layout of their projection and transposes them to
    (B, H, S, K) at every step, ~5% of a step.
    """
    return jax.lax.optimization_barrier(model.init_cache(memory, length)) if cached else None


def _next_logits(model: Transformer, cache, memory, src_mask, written, last, position):
    """written (N, L) tokens with positions < `position` filled, last (N,) the one at position - 1
    (BOS at 0) -> (logits (N, V) of the token at `position`, cache). Without a cache the decoder
    re-runs over BOS and all of `written`; causality hides the positions not yet written."""
    if cache is None:
        prefix = jnp.concatenate([jnp.full_like(written[:, :1], model.cfg.bos_id), written[:, :-1]], axis=1)
        hidden = jax.lax.dynamic_index_in_dim(model.decode(prefix, memory, src_mask), position, 1, keepdims=False)
        return model.project(hidden), None
    return model.decode_step(last, cache, position, src_mask)


def _check_source(model: Transformer, src_ids) -> None:
    if src_ids.shape[1] > model.cfg.max_len:
        raise ValueError(
            f"source of {src_ids.shape[1]} tokens exceeds the model's max_len={model.cfg.max_len}; truncate it first"
        )


def greedy_search(model: Transformer, src_ids, max_len_a: float = 1.5, max_len_b: int = 10, cached: bool = True):
    """src_ids (B, S) -> (tokens (B, L), scores (B,)): the argmax token at each step; the score is
    the sum of the chosen tokens' log-probabilities. `cached=False`: no key/value cache."""
    _check_source(model, src_ids)
    return _greedy_search(model, jnp.asarray(src_ids, jnp.int32), max_len_a, max_len_b, cached)


@functools.partial(nnx.jit, static_argnums=(2, 3, 4))
def _greedy_search(model: Transformer, src_ids, max_len_a: float, max_len_b: int, cached: bool):
    cfg = model.cfg
    B, S = src_ids.shape
    length = output_length(S, cfg.max_len, max_len_a, max_len_b)
    limits = sentence_limits(src_ids, cfg.pad_id, length, max_len_a, max_len_b)  # (B,)
    src_mask = padding_mask(src_ids, cfg.pad_id)
    memory = model.encode(src_ids, src_mask)
    cache = _init_cache(model, memory, length, cached)

    def running(state):
        position, done = state[0], state[3]
        return (position < length) & ~done.all()

    def step(state):
        position, tokens, scores, done, last, cache = state
        logits, cache = _next_logits(model, cache, memory, src_mask, tokens, last, position)
        must_end = position + 1 >= limits  # (B,) sentences at their limit emit EOS
        logprob, last = best_candidates(cfg, logits.astype(jnp.float32)[:, None], jnp.zeros((B, 1)), must_end, 1)
        last = last[:, 0]  # (B,) the argmax token
        scores = scores + jnp.where(done, 0.0, logprob[:, 0])
        tokens = tokens.at[:, position].set(jnp.where(done, cfg.pad_id, last))
        done = done | (last == cfg.eos_id)
        return position + 1, tokens, scores, done, last, cache

    state = (
        jnp.int32(0),
        jnp.full((B, length), cfg.pad_id, jnp.int32),
        jnp.zeros(B, jnp.float32),
        jnp.zeros(B, jnp.bool_),
        jnp.full((B,), cfg.bos_id, jnp.int32),
        cache,
    )
    _, tokens, scores, *_ = jax.lax.while_loop(running, step, state)
    return tokens, scores


def _gather(x, index):
    """x (B, N, ...) indexed along axis 1 by index (B, M) -> (B, M, ...)."""
    return jax.vmap(lambda row, i: row[i])(x, index)


def beam_search(model: Transformer, src_ids, beam_size: int = 4, alpha: float = 0.6,
                max_len_a: float = 1.5, max_len_b: int = 10, cached: bool = True):
    """src_ids (B, S) -> (tokens (B, L), scores (B,)) of the best finished hypothesis per sentence.

    See `torch_reference.decode.beam_search` for the algorithm; here it is one compiled loop.
    `cached=False`: no key/value cache.
    """
    _check_source(model, src_ids)
    return _beam_search(model, jnp.asarray(src_ids, jnp.int32), beam_size, alpha, max_len_a, max_len_b, cached)


@functools.partial(nnx.jit, static_argnums=(2, 3, 4, 5, 6))
def _beam_search(model: Transformer, src_ids, beam_size: int, alpha: float, max_len_a: float, max_len_b: int,
                 cached: bool):
    cfg = model.cfg
    B, S = src_ids.shape
    k, V = beam_size, cfg.tgt_vocab_size
    length = output_length(S, cfg.max_len, max_len_a, max_len_b)
    limits = sentence_limits(src_ids, cfg.pad_id, length, max_len_a, max_len_b)  # (B,)
    src_mask = jnp.repeat(padding_mask(src_ids, cfg.pad_id), k, axis=0)  # (B*k, 1, 1, S)
    memory = jnp.repeat(model.encode(src_ids, padding_mask(src_ids, cfg.pad_id)), k, axis=0)
    cache = _init_cache(model, memory, length, cached)  # batch B*k, hypothesis-major per sentence
    best_possible_penalty = length_penalty(limits.astype(jnp.float32), alpha)  # (B,)

    def running(state):
        position, done = state[0], state[-1]
        return (position < length) & ~done.all()

    def step(state):
        position, live_tokens, live_logprob, finished_tokens, finished_scores, last, cache, _ = state
        logits, cache = _next_logits(model, cache, memory, src_mask, live_tokens.reshape(B * k, length), last, position)
        # The 2k best candidates of the k*V extensions (live log-prob + token log-prob).
        logits = logits.astype(jnp.float32).reshape(B, k, V)
        top_logprob, top_index = best_candidates(cfg, logits, live_logprob, position + 1 >= limits, 2 * k)
        parent, token = top_index // V, (top_index % V).astype(jnp.int32)
        top_tokens = _gather(live_tokens, parent).at[:, :, position].set(token)  # (B, 2k, L)
        ends = token == cfg.eos_id

        # Finished: the old ones and the new EOS candidates, the best k kept.
        new_scores = jnp.where(ends, top_logprob / length_penalty(position + 1, alpha), NEG_INF)
        finished_scores, keep = jax.lax.top_k(jnp.concatenate([finished_scores, new_scores], axis=1), k)
        finished_tokens = _gather(jnp.concatenate([finished_tokens, top_tokens], axis=1), keep)

        # Live: the best k candidates that did not end.
        live_logprob, keep = jax.lax.top_k(jnp.where(ends, NEG_INF, top_logprob), k)
        live_tokens = _gather(top_tokens, keep)
        last = _gather(token, keep).reshape(B * k)
        # Reorder the self-attention cache to follow the surviving hypotheses' parents. The
        # cross-attention keys are the same for every hypothesis of a sentence: left as they are.
        if cached:
            order = (jnp.arange(B)[:, None] * k + _gather(parent, keep)).reshape(B * k)
            cache = [{**c, "self_k": c["self_k"][order], "self_v": c["self_v"][order]} for c in cache]

        done = finished_scores[:, -1] >= live_logprob[:, 0] / best_possible_penalty
        return position + 1, live_tokens, live_logprob, finished_tokens, finished_scores, last, cache, done

    live_tokens = jnp.full((B, k, length), cfg.pad_id, jnp.int32)
    state = (
        jnp.int32(0),
        live_tokens,
        jnp.full((B, k), NEG_INF, jnp.float32).at[:, 0].set(0.0),  # one live hypothesis at the start
        live_tokens,
        jnp.full((B, k), NEG_INF, jnp.float32),
        jnp.full((B * k,), cfg.bos_id, jnp.int32),
        cache,
        jnp.zeros(B, jnp.bool_),
    )
    state = jax.lax.while_loop(running, step, state)
    finished_tokens, finished_scores = state[3], state[4]
    return finished_tokens[:, 0], finished_scores[:, 0]
