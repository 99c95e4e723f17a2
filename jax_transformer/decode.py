"""Search over the Flax model's cached decoding: greedy and beam search, each one jit-compiled
`lax.while_loop` with static shapes.

The same algorithm as `torch_reference/decode.py` (read its docstrings for the details), with the
same names and defaults; both return identical tokens and scores to float32 rounding. Output
tokens (B, L) exclude BOS, end with EOS and are padded after it, with
L = min(max_len, floor(max_len_a * S + max_len_b)) for a padded source length S; a source row of
padding only is no sentence (padding, score 0), and takes no step. `cached=False`
re-runs the whole decoder over the (padded, causally masked) prefix at every step instead.

Three speed-ups were measured on XLA:CPU only and apply there alone (`cpu_tuned()`, read at trace
time): `best_candidates`, an exact chunked top-k in place of `top_candidates`' TopK over every
extension; `_shrinking_while`'s chain of loops over ever smaller batches in place of one loop; and
its first loops over a self-attention cache a quarter and a half as long (`_cache_lengths`), so the
early positions neither attend over nor reorder the cache's unwritten end. On every backend, beam
search runs its first step on one row a sentence, where torch's runs k identical ones
(`_first_step_hypotheses`). All give the same outputs as their plain forms (tested).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
import math

import jax
import jax.numpy as jnp
from flax import nnx

from torch_reference.config import SCORINGS

from .matmul import cpu_tuned
from .model import Transformer, padding_mask, shift_right

# A finite "minus infinity": sums of it stay finite, so no inf - inf = NaN in the scores.
NEG_INF = -1.0e9


def length_penalty(length, alpha: float, scoring: str = "gnmt"):
    """The divisor of a finished hypothesis's log-probability (`config.SCORINGS` says which)."""
    return ((5.0 + length) / 6.0) ** alpha if scoring == "gnmt" else length ** alpha


def output_length(src_len: int, max_len: int, max_len_a: float, max_len_b: int) -> int:
    """The padded output length for a padded source length: a static shape."""
    return max(1, min(max_len, math.floor(max_len_a * src_len + max_len_b)))


def sentence_limits(src_ids, pad_id: int, length: int, max_len_a: float, max_len_b: int):
    """(B,) the most tokens each sentence may produce: a * its length + b, at most `length`."""
    src_len = (src_ids != pad_id).sum(axis=1).astype(jnp.float32)
    return jnp.clip(jnp.floor(max_len_a * src_len + max_len_b), 1, length).astype(jnp.int32)


def top_candidates(cfg, logits, base, must_end, n: int):
    """The n best extensions of each sentence's hypotheses: logits (B, H, V) of H hypotheses with
    scores base (B, H), must_end (B,) marking sentences at their length limit -> (values (B, n),
    indices (B, n) into H*V), by `lax.top_k` over base + log_softmax(logits), where pad, BOS and,
    for sentences that must end, every token but EOS score NEG_INF."""
    B, H, V = logits.shape
    token = jnp.arange(V)
    masked = (must_end[:, None, None] & (token != cfg.eos_id)) | (token == cfg.pad_id) | (token == cfg.bos_id)
    logprobs = jnp.where(masked, NEG_INF, jax.nn.log_softmax(logits, axis=-1))
    return jax.lax.top_k((base[..., None] + logprobs).reshape(B, H * V), n)


def candidates(cfg, logits, base, must_end, n: int):
    """`top_candidates`, computed by `best_candidates` on XLA:CPU."""
    return (best_candidates if cpu_tuned() else top_candidates)(cfg, logits, base, must_end, n)


def best_candidates(cfg, logits, base, must_end, n: int, chunk: int = 128):
    """`top_candidates`: the same values, indices and order (ties to the lower index).

    Why not that: on XLA's CPU backend it costs a pass writing B*H*V scores and a TopK
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


def _init_cache(model: Transformer, memory, length: int, cached: bool, repeat: int = 1):
    """The key/value cache over memory (B, S, D), or None for `cached=False`: cross-attention keys
    and values one row a sentence, self-attention room for B * `repeat` rows (a sentence's `repeat`
    in a row; they share its cross-attention keys and values: `MultiHeadAttention`).

    The barrier materialises the cache before the loop. Without it XLA keeps the cross-attention
    keys and values in the (B, S, H, K) layout of their projection and transposes them to
    (B, H, S, K) at every step, ~5% of a step.
    """
    if not cached:
        return None
    rows = functools.partial(jnp.repeat, repeats=repeat, axis=0)
    cache = [{**layer, "self_k": rows(layer["self_k"]), "self_v": rows(layer["self_v"])}
             for layer in model.init_cache(memory, length)]
    return jax.lax.optimization_barrier(cache)


def _next_logits(model: Transformer, cache, memory, src_mask, written, last, position):
    """written (N, L) tokens with positions < `position` filled, last (N,) the one at position - 1
    (BOS at 0) -> (logits (N, V) of the token at `position`, cache). Without a cache the decoder
    re-runs over BOS and all of `written`; causality hides the positions not yet written."""
    if cache is None:
        prefix = shift_right(written, model.cfg.bos_id)
        hidden = jax.lax.dynamic_index_in_dim(model.decode(prefix, memory, src_mask), position, 1, keepdims=False)
        return model.project(hidden), None
    return model.decode_step(last, cache, position, src_mask)


def _no_sentence(src_ids, pad_id: int):
    """(B,) True for source rows of padding only: done before the first step."""
    return (src_ids == pad_id).all(axis=1)


def _check_scoring(scoring: str) -> None:
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {', '.join(SCORINGS)}, got {scoring!r}")


def _check_source(model: Transformer, src_ids) -> None:
    if src_ids.shape[1] > model.cfg.max_len:
        raise ValueError(
            f"source of {src_ids.shape[1]} tokens exceeds the model's max_len={model.cfg.max_len}; truncate it first"
        )


def _shrinking_while(step, result, carry, length: int, smallest: int, cache_lengths: Sequence[int] = (),
                     start: int = 0):
    """Run `step` until every sentence is done or `length` positions are written, moving the live
    sentences into a batch half the size whenever they fit in one -> result of every sentence.

    carry: a pytree whose leaves all lead with the b sentences' axis, carry["done"] (b,) among
    them; step(position, carry) -> carry; result(carry) -> per-sentence outputs (leading b);
    `start`: the first position to write (the caller has stepped over those before).

    Why: a batch runs until its slowest sentence ends, and with static shapes a finished sentence
    keeps its rows in every matmul; on Multi30k val half the rows of a beam search were finished
    ones. So the search is a chain of `lax.while_loop`s over B, B/2 and B/4 sentences (MAX_STAGES;
    none below `smallest`), each left as soon as the live sentences fit the next. A finished
    sentence's result no longer changes; rows never mix, so the outputs are those of one loop over
    the whole batch.

    Why no more stages: each is one more loop to compile, and the small ones are slower to run
    too. Beam 4, 2 CPUs: the numbers corpus' 500 validation sentences took 32.9 s on the first
    call (compiling) and 1.32 s on the third with stages down to 16 sentences, 12.2 s and 1.11 s
    with three; the Multi30k small model on its 1,014 validation sentences 115.5 s and 44.0 s
    against 99.7 s and 40.8 s; one loop alone, 112.2 s and 64.8 s.
    """
    sizes = [carry["done"].shape[0]]
    while sizes[-1] // 2 >= smallest and len(sizes) < MAX_STAGES:
        sizes.append(sizes[-1] // 2)
    out = jax.tree.map(jnp.zeros_like, result(carry))
    slots = jnp.arange(sizes[0])  # the sentence in each row of the current batch
    position = jnp.int32(start)
    # The first positions attend over a shorter self-attention cache: carry["cache"] starts
    # cache_lengths[0] long and grows to the next length whenever the loop reaches its end.
    for limit, longer in zip(cache_lengths, cache_lengths[1:]):
        def within(state, limit=limit, next_size=sizes[1] if len(sizes) > 1 else 0):
            position, carry = state
            return (position < limit) & ((~carry["done"]).sum() > next_size)

        position, carry = jax.lax.while_loop(within, lambda state: (state[0] + 1, step(*state)), (position, carry))
        carry = _grow_cache(carry, longer)
    for next_size in [*sizes[1:], 0]:
        def running(state, next_size=next_size):
            position, carry = state
            return (position < length) & ((~carry["done"]).sum() > next_size)

        position, carry = jax.lax.while_loop(running, lambda state: (state[0] + 1, step(*state)), (position, carry))
        out = jax.tree.map(lambda o, r: o.at[slots].set(r), out, result(carry))
        if next_size:
            keep = jnp.argsort(carry["done"], stable=True)[:next_size]  # the live sentences first
            carry, slots = jax.tree.map(lambda x: x[keep], (carry, slots))
    return out


def _grow_cache(carry, length: int):
    """carry with its self-attention keys and values (..., L, K) padded to `length` positions."""
    grow = lambda x: jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, length - x.shape[-2]), (0, 0)])  # noqa: E731
    return {**carry, "cache": [{**layer, "self_k": grow(layer["self_k"]), "self_v": grow(layer["self_v"])}
                               for layer in carry["cache"]]}


def _cache_lengths(length: int, smallest_stage: int, cached: bool) -> tuple[int, ...]:
    """The lengths the self-attention cache takes in turn as a search writes `length` positions:
    a quarter, a half, then all of it on XLA:CPU (where `smallest_stage` is SMALLEST_STAGE; see
    _shrinking_while) for a cached search of 32 positions or more; elsewhere the whole from the start."""
    if not cached or smallest_stage > SMALLEST_STAGE or length < 32:
        return (length,)
    return (length // 4, length // 2, length)


# Batches of fewer sentences are not split further: another loop to compile saves little there.
SMALLEST_STAGE = 16
MAX_STAGES = 3  # loops over B, B/2, B/4 sentences (see _shrinking_while)


def _smallest_stage() -> int:
    """SMALLEST_STAGE on XLA:CPU; elsewhere no stage below the whole batch (one loop)."""
    return SMALLEST_STAGE if cpu_tuned() else 1 << 62


def greedy_search(model: Transformer, src_ids, max_len_a: float = 1.5, max_len_b: int = 10, cached: bool = True):
    """src_ids (B, S) -> (tokens (B, L), scores (B,)): the argmax token at each step; the score is
    the sum of the chosen tokens' log-probabilities. `cached=False`: no key/value cache."""
    _check_source(model, src_ids)
    return _greedy_search(model, jnp.asarray(src_ids, jnp.int32), max_len_a, max_len_b, cached, _smallest_stage())


@functools.partial(nnx.jit, static_argnums=(2, 3, 4, 5))
def _greedy_search(model: Transformer, src_ids, max_len_a: float, max_len_b: int, cached: bool, smallest_stage: int):
    cfg = model.cfg
    B, S = src_ids.shape
    length = output_length(S, cfg.max_len, max_len_a, max_len_b)
    cache_lengths = _cache_lengths(length, smallest_stage, cached)
    src_mask = padding_mask(src_ids, cfg.pad_id)
    memory = model.encode(src_ids, src_mask)

    def step(position, c):
        logits, cache = _next_logits(model, c["cache"], c["memory"], c["src_mask"], c["tokens"], c["last"], position)
        must_end = position + 1 >= c["limits"]  # (b,) sentences at their limit emit EOS
        b = must_end.shape[0]
        logprob, last = candidates(cfg, logits.astype(jnp.float32)[:, None], jnp.zeros((b, 1)), must_end, 1)
        last = last[:, 0]  # (b,) the argmax token
        done = c["done"]
        return {
            **c, "cache": cache, "last": last, "done": done | (last == cfg.eos_id),
            "scores": c["scores"] + jnp.where(done, 0.0, logprob[:, 0]),
            "tokens": c["tokens"].at[:, position].set(jnp.where(done, cfg.pad_id, last)),
        }

    carry = {
        "tokens": jnp.full((B, length), cfg.pad_id, jnp.int32),
        "scores": jnp.zeros(B, jnp.float32),
        "done": _no_sentence(src_ids, cfg.pad_id),
        "last": jnp.full((B,), cfg.bos_id, jnp.int32),
        "cache": _init_cache(model, memory, cache_lengths[0], cached),
        "memory": None if cached else memory,
        "src_mask": src_mask,
        "limits": sentence_limits(src_ids, cfg.pad_id, length, max_len_a, max_len_b),  # (B,)
    }
    return _shrinking_while(step, lambda c: (c["tokens"], c["scores"]), carry, length, smallest_stage, cache_lengths)


def _first_step_hypotheses(vocab_size: int, k: int) -> int:
    """Rows a sentence at the first beam step: 1 where that is exact, else k.

    The first step has one live hypothesis a sentence (the other k - 1 score NEG_INF), so it runs
    on B rows, not B*k, and its cache reorder fans each sentence's out to k rows. That ranks the
    same candidates where all 2k of them are real tokens (V - 3 >= 2k: pad and BOS never are, nor
    EOS for a sentence that must end): otherwise the k - 1 dead hypotheses' NEG_INF ones would be
    ranked too.
    """
    return 1 if vocab_size - 3 >= 2 * k else k


def _gather(x, index):
    """x (B, N, ...) indexed along axis 1 by index (B, M) -> (B, M, ...)."""
    return jax.vmap(lambda row, i: row[i])(x, index)


def beam_search(model: Transformer, src_ids, beam_size: int = 4, alpha: float = 0.6,
                max_len_a: float = 1.5, max_len_b: int = 10, cached: bool = True, scoring: str = "gnmt"):
    """src_ids (B, S) -> (tokens (B, L), scores (B,)) of the best finished hypothesis per sentence.

    See `torch_reference.decode.beam_search` for the algorithm; here it is one compiled loop.
    `cached=False`: no key/value cache. `scoring`: one of SCORINGS.
    """
    _check_source(model, src_ids)
    _check_scoring(scoring)
    return _beam_search(
        model, jnp.asarray(src_ids, jnp.int32), beam_size, alpha, max_len_a, max_len_b, cached, scoring, _smallest_stage()
    )


@functools.partial(nnx.jit, static_argnums=(2, 3, 4, 5, 6, 7, 8))
def _beam_search(model: Transformer, src_ids, beam_size: int, alpha: float, max_len_a: float, max_len_b: int,
                 cached: bool, scoring: str, smallest_stage: int):
    cfg = model.cfg
    B, S = src_ids.shape
    k, V = beam_size, cfg.tgt_vocab_size
    length = output_length(S, cfg.max_len, max_len_a, max_len_b)
    limits = sentence_limits(src_ids, cfg.pad_id, length, max_len_a, max_len_b)  # (B,)
    # A sentence's hypotheses attend over one copy of its encoder output and cross-attention keys
    # and values (`MultiHeadAttention`); torch's search repeats them k times.
    src_mask = padding_mask(src_ids, cfg.pad_id)  # (B, 1, 1, S)
    memory = model.encode(src_ids, src_mask)  # (B, S, D)
    cache_lengths = _cache_lengths(length, smallest_stage, cached)
    h = _first_step_hypotheses(V, k)
    cache = _init_cache(model, memory, cache_lengths[0], cached, repeat=h)  # self-attention rows B*h, hypothesis-major
    may_finish = jnp.arange(2 * k) < (k if scoring == "hf" else 2 * k)  # (2k,) candidate ranks

    def step(position, c):
        b, h = c["live_logprob"].shape  # h live hypotheses a sentence: k, or 1 at the first step
        rows = functools.partial(jax.tree.map, lambda x: x.reshape(-1, *x.shape[2:]))  # (b, n, ...) -> (b*n, ...)
        logits, cache = _next_logits(
            model, rows(c["cache"]), c["memory"], c["src_mask"], rows(c["live_tokens"]), rows(c["last"]), position
        )
        # The 2k best candidates of the h*V extensions (live log-prob + token log-prob).
        logits = logits.astype(jnp.float32).reshape(b, h, V)
        top_logprob, top_index = candidates(cfg, logits, c["live_logprob"], position + 1 >= c["limits"], 2 * k)
        parent, token = top_index // V, (top_index % V).astype(jnp.int32)
        top_tokens = _gather(c["live_tokens"], parent).at[:, :, position].set(token)  # (b, 2k, L)
        ends = token == cfg.eos_id
        if scoring == "hf":  # HF's <eos> forced at the limit adds nothing (its processor sets that log-prob to 0)
            must_end = (position + 1 >= c["limits"])[:, None]
            top_logprob = jnp.where(must_end & ends, _gather(c["live_logprob"], parent), top_logprob)

        # Finished: the old ones and the new EOS candidates, the best k kept.
        new_scores = jnp.where(ends & may_finish, top_logprob / length_penalty(position + 1, alpha, scoring), NEG_INF)
        finished_scores, keep = jax.lax.top_k(jnp.concatenate([c["finished_scores"], new_scores], axis=1), k)
        finished_tokens = _gather(jnp.concatenate([c["finished_tokens"], top_tokens], axis=1), keep)

        # Live: the best k candidates that did not end.
        live_logprob, keep = jax.lax.top_k(jnp.where(ends, NEG_INF, top_logprob), k)
        if cached:
            # Reorder the self-attention cache to follow the surviving hypotheses' parents (at the
            # first step: fan each sentence's one out to k). The cross-attention keys are the
            # sentence's, one copy for all its hypotheses: left as they are.
            parents = _gather(parent, keep)  # (b, k)
            cache = [
                {**layer, "self_k": _gather(layer["self_k"], parents), "self_v": _gather(layer["self_v"], parents)}
                for layer in jax.tree.map(lambda x: x.reshape(b, -1, *x.shape[1:]), cache)
            ]
        return {
            **c, "cache": cache, "live_tokens": _gather(top_tokens, keep), "live_logprob": live_logprob,
            "finished_tokens": finished_tokens, "finished_scores": finished_scores, "last": _gather(token, keep),
            "done": (finished_scores[:, -1] >= live_logprob[:, 0] / c["best_possible_penalty"]) | c["no_sentence"],
        }

    per_sentence = functools.partial(jax.tree.map, lambda x: x.reshape(B, -1, *x.shape[1:]))  # (B*n, ...) -> (B, n,...)
    carry = {
        "live_tokens": jnp.full((B, h, length), cfg.pad_id, jnp.int32),
        "live_logprob": jnp.full((B, h), NEG_INF, jnp.float32).at[:, 0].set(0.0),  # one live hypothesis at the start
        "finished_tokens": jnp.full((B, k, length), cfg.pad_id, jnp.int32),
        "finished_scores": jnp.full((B, k), NEG_INF, jnp.float32),
        "last": jnp.full((B, h), cfg.bos_id, jnp.int32),
        "cache": per_sentence(cache),
        "memory": None if cached else memory,
        "src_mask": src_mask,
        "limits": limits,
        "best_possible_penalty": length_penalty(limits.astype(jnp.float32), alpha, scoring),  # (B,)
        "no_sentence": _no_sentence(src_ids, cfg.pad_id),
        "done": _no_sentence(src_ids, cfg.pad_id),
    }

    def result(c):
        tokens = jnp.where(c["no_sentence"][:, None], cfg.pad_id, c["finished_tokens"][:, 0])
        return tokens, jnp.where(c["no_sentence"], 0.0, c["finished_scores"][:, 0])

    position = 0
    if h == 1:  # the first step on its own (see above); the loops carry k hypotheses a sentence
        carry, position = step(jnp.int32(0), carry), 1
    return _shrinking_while(step, result, carry, length, smallest_stage, cache_lengths, position)
