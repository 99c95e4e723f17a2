"""Greedy and beam search over the Flax model's key/value cache, each one jit-compiled
`lax.while_loop` with static shapes: `torch_reference/decode.py`'s algorithm step by step (its
docstrings tell the details), with the same names, defaults and outputs, to float32 rounding.

The loop's state is a dict of arrays led by the sentence axis (or a sentence's rows next to each
other), so that over a model of the kernel set `xla_cpu` the search runs `xla_cpu.shrinking_while`'s
loop and ranks candidates with `xla_cpu.best_candidates`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from torch_reference.config import TransformerConfig, check_beam, check_prefix_rows, length_penalty, output_length

from . import xla_cpu as tuned
from .model import Transformer, padding_mask, shift_right

# A finite "minus infinity": sums of it stay finite, so no inf - inf = NaN in the scores.
NEG_INF = -1.0e9


def sentence_limits(src_ids, pad_id: int, length: int, max_len_a: float, max_len_b: int):
    """(B,) the most tokens each sentence may produce: a * its length + b, at most `length`."""
    src_len = (src_ids != pad_id).sum(axis=1).astype(jnp.float32)
    return jnp.clip(jnp.floor(max_len_a * src_len + max_len_b), 1, length).astype(jnp.int32)


def _next_logprobs(cfg: TransformerConfig, logits, must_end):
    """torch's `_next_logprobs`: log_softmax in float32, NEG_INF at pad, BOS and (where must_end) all but EOS."""
    vocab = jnp.arange(logits.shape[-1])
    masked = (must_end[..., None] & (vocab != cfg.eos_id)) | (vocab == cfg.pad_id) | (vocab == cfg.bos_id)
    return jnp.where(masked, NEG_INF, jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))


def _no_sentence(src_ids, pad_id: int):
    """(B,) True for source rows of padding only: done before the first step."""
    return (src_ids == pad_id).all(axis=1)


def _check_ids(name: str, ids, vocab_size: int, max_len: int | None = None) -> None:
    """torch's `_check_ids`: (B, L) integer ids in [0, vocab_size), L <= `max_len`; traced ones the caller checks."""
    if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"{name} must be (batch, length) integer token ids, got {ids.dtype} of shape "
                         f"{tuple(ids.shape)}")
    if ids.size and not isinstance(ids, jax.core.Tracer) and not 0 <= int(ids.min()) <= int(ids.max()) < vocab_size:
        raise ValueError(f"{name} holds ids outside [0, {vocab_size}), the vocabulary: "
                         f"{int(ids.min())}..{int(ids.max())}")
    if max_len is not None and ids.shape[1] > max_len:
        raise ValueError(f"{name} of {ids.shape[1]} tokens exceeds the model's max_len={max_len}; truncate it first")


def check_prefix(src_ids, prefix, cfg: TransformerConfig, max_len_a: float, max_len_b: int) -> None:
    """torch's `check_prefix`; values inside a trace are the caller's to check."""
    if isinstance(src_ids, jax.core.Tracer) or isinstance(prefix, jax.core.Tracer):
        return
    src_ids, prefix = jnp.asarray(src_ids), jnp.asarray(prefix)
    _check_ids("prefix", prefix, cfg.tgt_vocab_size)
    check_prefix_rows(src_ids, prefix, cfg, max_len_a, max_len_b)


def _prefix_columns(prefix, pad_id: int, length: int):
    """prefix (B, P) -> (B, length): its tokens by output position, pad_id where there is none."""
    if prefix is None:
        return None
    prefix = jnp.asarray(prefix, jnp.int32)[:, :length]
    return jnp.pad(prefix, ((0, 0), (0, length - prefix.shape[1])), constant_values=pad_id)


def _decoder(model: Transformer, src_ids, rows: int, length: int, cached: bool) -> dict:
    """torch's `_Decoder` as arrays that ride in the loop's carry (`_logits`, `_reorder`); the barrier stops XLA
    transposing the cross-attention keys every step (docs/performance.md#what-made-the-jax-search-fast)."""
    src_mask = padding_mask(src_ids, model.cfg.pad_id)
    memory = jnp.repeat(model.encode(src_ids, src_mask), rows, axis=0)  # (B*rows, S, D)
    src_mask = jnp.repeat(src_mask, rows, axis=0)
    if not cached:
        return {"cache": None, "memory": memory, "src_mask": src_mask}
    cache = model.init_cache(memory, length)
    cross = jax.lax.optimization_barrier([{"cross_k": c["cross_k"], "cross_v": c["cross_v"]} for c in cache])
    return {"cache": [{**c, **x} for c, x in zip(cache, cross)], "memory": None, "src_mask": src_mask}


def _logits(model: Transformer, decoder: dict, written, last, position):
    """torch's `_Decoder.logits`, returning the cache too."""
    if decoder["cache"] is None:
        prefix = shift_right(written, model.cfg.bos_id)
        hidden = model.decode(prefix, decoder["memory"], decoder["src_mask"])  # (N, L, D)
        return model.project(jax.lax.dynamic_index_in_dim(hidden, position, 1, keepdims=False)), None
    return model.decode_step(last, decoder["cache"], position, decoder["src_mask"])


def _reorder(cache, order):
    """torch's `_Decoder.reorder`."""
    if cache is None:
        return None
    return [{**c, "self_k": c["self_k"][order], "self_v": c["self_v"][order]} for c in cache]


def top_candidates(cfg, logits, base, must_end, n: int, xla_cpu: bool = False):
    """The n best extensions of each sentence's hypotheses: logits (B, H, V) of H hypotheses with scores
    base (B, H), must_end (B,) marking sentences at their length limit -> (values (B, n), indices (B, n)
    into H*V), by `lax.top_k` over base + `_next_logprobs`; `xla_cpu`: from `xla_cpu.best_candidates`."""
    if xla_cpu:
        return tuned.best_candidates(cfg, logits, base, must_end, n, NEG_INF)
    B, H, V = logits.shape
    logprobs = _next_logprobs(cfg, logits, must_end[:, None])  # (B, H, V)
    return jax.lax.top_k((base[..., None] + logprobs).reshape(B, H * V), n)


def _while(model: Transformer, step, result, carry, length: int):
    """Run step(position, carry) -> carry from position 0 until every sentence is done
    (carry["done"]) or `length` positions are written -> result(carry). With `model.xla_cpu`
    `xla_cpu.shrinking_while`'s loops over a shrinking batch and a growing cache instead."""
    if model.xla_cpu:
        return tuned.shrinking_while(step, result, carry, length)

    def running(state):
        return (state[0] < length) & ~state[1]["done"].all()

    return result(jax.lax.while_loop(running, lambda state: (state[0] + 1, step(*state)), (jnp.int32(0), carry))[1])


def _token_by_token(model: Transformer, src_ids, n: int, choose, carry: dict, max_len_a: float, max_len_b: int,
                    cached: bool = True):
    """torch's `_token_by_token` as one loop: choose(position, logits (b, V) float32, must_end (b,), carry)
    -> (tokens (b,), their log-probabilities (b,)) picks each step's token; `carry` holds what `choose` reads
    besides, led by the B*n rows -> (tokens (B*n, L), scores (B*n,))."""
    cfg = model.cfg
    B, S = src_ids.shape
    length = output_length(S, cfg.max_len, max_len_a, max_len_b)

    def step(position, c):
        logits, cache = _logits(model, c, c["tokens"], c["last"], position)  # (b, V)
        must_end = position + 1 >= c["limits"]  # (b,) rows at their limit emit EOS
        last, logprob = choose(position, logits.astype(jnp.float32), must_end, c)  # (b,) each
        done = c["done"]
        return {
            **c, "cache": cache, "last": last, "done": done | (last == cfg.eos_id),
            "scores": c["scores"] + jnp.where(done, 0.0, logprob),
            "tokens": c["tokens"].at[:, position].set(jnp.where(done, cfg.pad_id, last)),
        }

    carry = {
        **carry,
        "tokens": jnp.full((B * n, length), cfg.pad_id, jnp.int32),
        "scores": jnp.zeros(B * n, jnp.float32),
        "done": jnp.repeat(_no_sentence(src_ids, cfg.pad_id), n),
        "last": jnp.full((B * n,), cfg.bos_id, jnp.int32),
        **_decoder(model, src_ids, n, length, cached),
        "limits": jnp.repeat(sentence_limits(src_ids, cfg.pad_id, length, max_len_a, max_len_b), n),  # (B*n,)
    }
    return _while(model, step, lambda c: (c["tokens"], c["scores"]), carry, length)


def greedy_search(model: Transformer, src_ids, max_len_a: float = 1.5, max_len_b: int = 10, cached: bool = True,
                  prefix=None):
    """src_ids (B, S) -> (tokens (B, L), scores (B,)): torch's `greedy_search` in one compiled loop."""
    _check_ids("src_ids", src_ids, model.cfg.src_vocab_size, model.cfg.max_len)
    if prefix is not None:
        check_prefix(src_ids, prefix, model.cfg, max_len_a, max_len_b)
    return _greedy_search(model, jnp.asarray(src_ids, jnp.int32), max_len_a, max_len_b, cached, prefix)


def _forced_logprob(logits, forced):
    """log_softmax(logits (..., V)) at the tokens forced (...,): the log-prob a prefix token adds."""
    return jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), forced[..., None], axis=-1)[..., 0]


@functools.partial(nnx.jit, static_argnums=(2, 3, 4))
def _greedy_search(model: Transformer, src_ids, max_len_a: float, max_len_b: int, cached: bool, prefix=None):
    cfg = model.cfg

    def choose(position, logits, must_end, c):
        logprob, last = top_candidates(cfg, logits[:, None], jnp.zeros((len(must_end), 1)), must_end, 1, model.xla_cpu)
        last, logprob = last[:, 0], logprob[:, 0]  # (b,) the argmax token
        if c["prefix"] is None:
            return last, logprob
        forced = c["prefix"][:, position]  # the prefix's token where one is left (never masked: check_prefix)
        forcing = forced != cfg.pad_id
        return jnp.where(forcing, forced, last), jnp.where(forcing, _forced_logprob(logits, forced), logprob)

    length = output_length(src_ids.shape[1], cfg.max_len, max_len_a, max_len_b)
    prefix = {"prefix": _prefix_columns(prefix, cfg.pad_id, length)}  # (B, L) or None
    return _token_by_token(model, src_ids, 1, choose, prefix, max_len_a, max_len_b, cached)


def _gather(x, index):
    """x (B, N, ...) indexed along axis 1 by index (B, M) -> (B, M, ...)."""
    return jax.vmap(lambda row, i: row[i])(x, index)


def _done(finished_scores, live_logprob, best_possible_penalty, no_sentence):
    """(B,) True where no live hypothesis can beat the first finished one given (torch's `_done`)."""
    return (finished_scores[:, 0] >= live_logprob[:, 0] / best_possible_penalty) | no_sentence


def _forced_candidates(forced_logprob, live_logprob, forced, pad_id: int, V: int, top_logprob, top_index):
    """torch's `_forced_candidates`: the 2k candidates where a sentence has a prefix token left."""
    k = live_logprob.shape[1]
    forcing = (forced != pad_id)[:, None]  # (B, 1)
    extended = live_logprob + forced_logprob  # (B, k)
    values = jnp.concatenate([extended, jnp.full_like(extended, 2 * NEG_INF)], axis=1)  # (B, 2k)
    index = jnp.tile(jnp.arange(k)[None] * V + forced[:, None], (1, 2))  # (B, 2k)
    return jnp.where(forcing, values, top_logprob), jnp.where(forcing, index, top_index)


def _n_best(tokens, logprob, scores, no_sentence, n: int, pad_id: int):
    """torch's `_n_best`: the n best finished hypotheses, best first, (tokens (B, n, L), log-probs, scores (B, n))."""
    real = (logprob[:, :n] > NEG_INF / 2) & ~no_sentence[:, None]  # (B, n)
    return (jnp.where(real[..., None], tokens[:, :n], pad_id), jnp.where(real, logprob[:, :n], -jnp.inf),
            jnp.where(real, scores[:, :n], -jnp.inf))


def beam_search(model: Transformer, src_ids, beam_size: int = 4, alpha: float = 0.6,
                max_len_a: float = 1.5, max_len_b: int = 10, cached: bool = True, scoring: str = "gnmt",
                n_best: int | None = None, prefix=None):
    """`torch_reference.decode.beam_search` (its docstring tells the algorithm and the arguments) in one loop."""
    _check_ids("src_ids", src_ids, model.cfg.src_vocab_size, model.cfg.max_len)
    check_beam(beam_size, 0.0 if isinstance(alpha, jax.core.Tracer) else alpha, scoring, n_best)  # traced: the caller's
    if prefix is not None:
        check_prefix(src_ids, prefix, model.cfg, max_len_a, max_len_b)
    return _beam_search(model, jnp.asarray(src_ids, jnp.int32), beam_size, alpha, max_len_a, max_len_b, cached, scoring,
                        n_best, prefix)


@functools.partial(nnx.jit, static_argnums=(2, 4, 5, 6, 7, 8))  # alpha is data: one program for every alpha
def _beam_search(model: Transformer, src_ids, beam_size: int, alpha: float, max_len_a: float, max_len_b: int,
                 cached: bool, scoring: str, n_best: int | None = None, prefix=None):
    cfg = model.cfg
    n = n_best or 1
    B, S = src_ids.shape
    k, V = beam_size, cfg.tgt_vocab_size
    length = output_length(S, cfg.max_len, max_len_a, max_len_b)
    limits = sentence_limits(src_ids, cfg.pad_id, length, max_len_a, max_len_b)  # (B,)
    may_finish = jnp.arange(2 * k) < (k if scoring == "hf" else 2 * k)  # (2k,) candidate ranks

    def step(position, c):
        b = len(c["done"])  # the loop's sentences: B, or fewer in `xla_cpu.shrinking_while`
        logits, cache = _logits(model, c, c["live_tokens"].reshape(b * k, length), c["last"].reshape(b * k), position)
        must_end = position + 1 >= c["limits"]  # (b,)

        # The 2k best candidates of the k*V extensions (live log-prob + token log-prob).
        logits = logits.astype(jnp.float32).reshape(b, k, V)
        top_logprob, top_index = top_candidates(cfg, logits, c["live_logprob"], must_end, 2 * k, model.xla_cpu)
        if c["prefix"] is not None:
            forced = c["prefix"][:, position]  # (b,)
            forced_logprob = _forced_logprob(logits, jnp.broadcast_to(forced[:, None], (b, k)))  # (b, k)
            top_logprob, top_index = _forced_candidates(forced_logprob, c["live_logprob"], forced, cfg.pad_id, V,
                                                        top_logprob, top_index)
        parent, token = top_index // V, (top_index % V).astype(jnp.int32)
        top_tokens = _gather(c["live_tokens"], parent).at[:, :, position].set(token)  # (b, 2k, L)
        ends = token == cfg.eos_id
        if scoring == "hf":  # HF's <eos> forced at the limit adds nothing (its processor sets that log-prob to 0)
            top_logprob = jnp.where(must_end[:, None] & ends, _gather(c["live_logprob"], parent), top_logprob)

        # Finished: the old ones and the new EOS candidates, the best k kept.
        new_scores = jnp.where(ends & may_finish, top_logprob / length_penalty(position + 1, alpha, scoring), NEG_INF)
        finished_scores, keep = jax.lax.top_k(jnp.concatenate([c["finished_scores"], new_scores], axis=1), k)
        finished_tokens = _gather(jnp.concatenate([c["finished_tokens"], top_tokens], axis=1), keep)
        finished_logprob = _gather(jnp.concatenate([c["finished_logprob"], top_logprob], axis=1), keep)

        # Live: the best k candidates that did not end.
        live_logprob, keep = jax.lax.top_k(jnp.where(ends, NEG_INF, top_logprob), k)
        order = (jnp.arange(b)[:, None] * k + _gather(parent, keep)).reshape(b * k)
        return {
            **c, "cache": _reorder(cache, order), "last": _gather(token, keep), "live_logprob": live_logprob,
            "live_tokens": _gather(top_tokens, keep), "finished_tokens": finished_tokens,
            "finished_scores": finished_scores, "finished_logprob": finished_logprob,
            "done": _done(finished_scores[:, n - 1 :], live_logprob, c["best_possible_penalty"], c["no_sentence"]),
        }

    carry = {
        "live_tokens": jnp.full((B, k, length), cfg.pad_id, jnp.int32),
        # One live hypothesis at the start: the others are copies of it.
        "live_logprob": jnp.full((B, k), NEG_INF, jnp.float32).at[:, 0].set(0.0),
        "finished_tokens": jnp.full((B, k, length), cfg.pad_id, jnp.int32),
        "finished_scores": jnp.full((B, k), NEG_INF, jnp.float32),
        "finished_logprob": jnp.full((B, k), NEG_INF, jnp.float32),
        "last": jnp.full((B, k), cfg.bos_id, jnp.int32),
        **_decoder(model, src_ids, k, length, cached),  # B*k rows, hypothesis-major per sentence
        "limits": limits,
        "best_possible_penalty": length_penalty(limits.astype(jnp.float32), alpha, scoring),  # (B,)
        "no_sentence": _no_sentence(src_ids, cfg.pad_id),
        "done": _no_sentence(src_ids, cfg.pad_id),
        "prefix": _prefix_columns(prefix, cfg.pad_id, length),  # (B, L) or None
    }

    def result(c):
        if n_best is not None:
            return _n_best(c["finished_tokens"], c["finished_logprob"], c["finished_scores"], c["no_sentence"],
                           n_best, cfg.pad_id)
        tokens = jnp.where(c["no_sentence"][:, None], cfg.pad_id, c["finished_tokens"][:, 0])
        return tokens, jnp.where(c["no_sentence"], 0.0, c["finished_scores"][:, 0])

    return _while(model, step, result, carry, length)


def score(model: Transformer, src_ids, tgt_ids):
    """src_ids (B, S), tgt_ids (B, T) -> (B, T) each target token's log-probability, 0 at padding (torch's `score`)."""
    _check_ids("src_ids", src_ids, model.cfg.src_vocab_size, model.cfg.max_len)
    _check_ids("tgt_ids", tgt_ids, model.cfg.tgt_vocab_size, model.cfg.max_len)
    if tgt_ids.shape[0] != src_ids.shape[0]:  # not broadcast: torch gave one row for two, JAX two
        raise ValueError(f"tgt_ids has {tgt_ids.shape[0]} rows, src_ids {src_ids.shape[0]}: one target per source")
    return _score(model, jnp.asarray(src_ids, jnp.int32), jnp.asarray(tgt_ids, jnp.int32))


@nnx.jit
def _score(model: Transformer, src_ids, tgt_ids):
    logits = model(src_ids, shift_right(tgt_ids, model.cfg.bos_id))  # (B, T, V)
    logprobs = _forced_logprob(logits.astype(jnp.float32), tgt_ids)  # (B, T)
    return jnp.where(tgt_ids == model.cfg.pad_id, 0.0, logprobs)
