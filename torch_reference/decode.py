"""Greedy and beam search over the reference model's key/value cache (`Transformer.init_cache` / `decode_step`);
`jax_transformer/decode.py` is the same algorithm in one jit-compiled loop, with identical tokens and scores (to
float32 rounding). `cached=False` re-runs the whole decoder over every prefix: the benchmark's baseline, a cache check.

Output tokens exclude BOS, end with EOS and are padded with `pad_id`, shape (B, L) with L = output_length(S, ...) for
a padded source length S; each sentence ends within its own limit (`sentence_limits`); a source row of padding only is
no sentence (padding, score 0). n-best lists, forced prefixes and `score`: docs/decoding.md."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .config import TransformerConfig, check_beam, check_prefix_rows, length_penalty, output_length
from .model import Transformer, padding_mask, shift_right

# A finite "minus infinity": sums of it stay finite, so no inf - inf = NaN in the scores.
NEG_INF = -1.0e9


def sentence_limits(src_ids: Tensor, pad_id: int, length: int, max_len_a: float, max_len_b: int) -> Tensor:
    """(B,) the most tokens each sentence may produce: a * its length + b, at most `length`."""
    src_len = (src_ids != pad_id).sum(dim=1).float()
    return torch.clamp(torch.floor(max_len_a * src_len + max_len_b), 1, length).long()


def _next_logprobs(cfg: TransformerConfig, logits: Tensor, must_end: Tensor) -> Tensor:
    """log_softmax(logits (..., V)) in float32, NEG_INF at the tokens no translation holds (padding, BOS)
    and, in rows that must end (must_end (...,): at their length limit), at every token but EOS."""
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    masked = (must_end[..., None] & (vocab != cfg.eos_id)) | (vocab == cfg.pad_id) | (vocab == cfg.bos_id)
    return torch.where(masked, NEG_INF, torch.log_softmax(logits.float(), dim=-1))


def _no_sentence(src_ids: Tensor, pad_id: int) -> Tensor:
    """(B,) True for source rows of padding only: done before the first step."""
    return (src_ids == pad_id).all(dim=1)


def _check_ids(name: str, ids: Tensor, vocab_size: int, max_len: int | None = None) -> None:
    """ValueError unless `ids` is a (B, L) integer tensor of token ids in [0, vocab_size), L at most `max_len`."""
    if ids.ndim != 2 or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"{name} must be (batch, length) integer token ids, got {ids.dtype} of shape "
                         f"{tuple(ids.shape)}")
    if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < vocab_size:
        raise ValueError(f"{name} holds ids outside [0, {vocab_size}), the vocabulary: "
                         f"{int(ids.min())}..{int(ids.max())}")
    if max_len is not None and ids.shape[1] > max_len:
        raise ValueError(f"{name} of {ids.shape[1]} tokens exceeds the model's max_len={max_len}; truncate it first")


def check_prefix(src_ids, prefix, cfg: TransformerConfig, max_len_a: float, max_len_b: int) -> None:
    """ValueError unless prefix (B, P) holds target-vocabulary ids other than <bos> (then pad_id), a row for each
    source, each leaving its sentence room for <eos>: fewer tokens than its length limit (`sentence_limits`)."""
    _check_ids("prefix", prefix, cfg.tgt_vocab_size)
    check_prefix_rows(src_ids, prefix, cfg, max_len_a, max_len_b)


def _prefix_columns(prefix: Tensor | None, pad_id: int, length: int) -> Tensor | None:
    """prefix (B, P) -> (B, length): its tokens by output position, pad_id where there is none."""
    if prefix is None:
        return None
    prefix = prefix[:, :length].long()
    return torch.nn.functional.pad(prefix, (0, length - prefix.shape[1]), value=pad_id)


class _Decoder:
    """Next-token logits of each row (`rows` rows a sentence of src_ids (B, S), together) from the tokens it
    has written: one position per step with the key/value cache, or (cached=False) the whole decoder re-run."""

    def __init__(self, model: Transformer, src_ids: Tensor, rows: int, length: int, cached: bool):
        src_mask = padding_mask(src_ids, model.cfg.pad_id)
        memory = model.encode(src_ids, src_mask).repeat_interleave(rows, dim=0)  # (B*rows, S, D)
        self.model, self.memory, self.src_mask = model, memory, src_mask.repeat_interleave(rows, dim=0)
        self.cache = model.init_cache(memory, length) if cached else None

    def logits(self, written: Tensor, last: Tensor, position: int) -> Tensor:
        """written (N, L) tokens filled below `position`, last (N,) the one at position - 1 (BOS at 0) -> (N, V)."""
        if self.cache is None:
            prefix = shift_right(written[:, : position + 1], self.model.cfg.bos_id)  # (N, position + 1)
            return self.model.project(self.model.decode(prefix, self.memory, self.src_mask)[:, -1])
        logits, self.cache = self.model.decode_step(last, self.cache, position, self.src_mask)
        return logits

    def reorder(self, order: Tensor) -> None:
        """Rows follow `order` (N,): each kept hypothesis' parent's self-attention cache (cross-attention's: shared)."""
        if self.cache is not None:
            self.cache = [{**c, "self_k": c["self_k"][order], "self_v": c["self_v"][order]} for c in self.cache]


def _token_by_token(model: Transformer, src_ids: Tensor, n: int, choose, max_len_a: float, max_len_b: int,
                    cached: bool = True) -> tuple[Tensor, Tensor]:
    """The loop of greedy search and sampling over `n` rows a sentence (a sentence's rows together): choose(position,
    logprobs (B*n, V)) -> tokens (B*n,) picks each step's token, from log-probabilities where pad, BOS and (at a row's
    length limit) every token but EOS are masked -> (tokens (B*n, L), scores (B*n,): the chosen log-probs' sums)."""
    cfg = model.cfg
    B, S = src_ids.shape
    device = src_ids.device
    length = output_length(S, cfg.max_len, max_len_a, max_len_b)
    limits = sentence_limits(src_ids, cfg.pad_id, length, max_len_a, max_len_b).repeat_interleave(n)  # (B*n,)
    decoder = _Decoder(model, src_ids, n, length, cached)

    tokens = torch.full((B * n, length), cfg.pad_id, dtype=torch.long, device=device)
    scores = torch.zeros(B * n, device=device)
    done = _no_sentence(src_ids, cfg.pad_id).repeat_interleave(n)  # (B*n,)
    last = torch.full((B * n,), cfg.bos_id, dtype=torch.long, device=device)
    for position in range(length):
        must_end = position + 1 >= limits  # (B*n,) rows at their limit emit EOS
        logprobs = _next_logprobs(cfg, decoder.logits(tokens, last, position), must_end)  # (B*n, V)
        last = choose(position, logprobs)  # (B*n,)
        scores = scores + torch.where(done, 0.0, logprobs.gather(1, last[:, None])[:, 0])
        tokens[:, position] = torch.where(done, cfg.pad_id, last)
        done = done | (last == cfg.eos_id)
        if bool(done.all()):
            break
    return tokens, scores


@torch.no_grad()
def greedy_search(model: Transformer, src_ids: Tensor, max_len_a: float = 1.5, max_len_b: int = 10,
                  cached: bool = True, prefix: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """src_ids (B, S) -> (tokens (B, L), scores (B,)): the argmax token at each step, scored by the sum of the chosen
    tokens' log-probabilities. `cached=False`: no key/value cache. `prefix` (B, P): the first tokens of each output
    (then pad_id; `check_prefix`), forced, their log-probabilities counted in the score; the search continues after."""
    _check_ids("src_ids", src_ids, model.cfg.src_vocab_size, model.cfg.max_len)
    cfg = model.cfg
    if prefix is not None:
        check_prefix(src_ids, prefix, cfg, max_len_a, max_len_b)
    forced = _prefix_columns(prefix, cfg.pad_id, output_length(src_ids.shape[1], cfg.max_len, max_len_a, max_len_b))

    def choose(position: int, logprobs: Tensor) -> Tensor:  # the prefix's token where one is left (never masked)
        best = logprobs.argmax(dim=-1)  # (B,)
        return best if forced is None else torch.where(forced[:, position] != cfg.pad_id, forced[:, position], best)

    return _token_by_token(model, src_ids, 1, choose, max_len_a, max_len_b, cached)


def _gather(x: Tensor, index: Tensor) -> Tensor:
    """x (B, N, ...) indexed along axis 1 by index (B, M) -> (B, M, ...)."""
    return x[torch.arange(x.shape[0], device=x.device)[:, None], index]


def _done(finished_scores: Tensor, live_logprob: Tensor, best_possible_penalty: Tensor, no_sentence: Tensor) -> Tensor:
    """(B,) True where the first finished hypothesis given (finished_scores (B, m), best first: the caller's
    slice) scores at least what the best live one (live_logprob (B, k)) could still reach, its log-prob over
    the penalty of the longest output allowed: log-probs only fall and (alpha >= 0) the penalty only grows."""
    return (finished_scores[:, 0] >= live_logprob[:, 0] / best_possible_penalty) | no_sentence


def _forced_candidates(forced_logprob: Tensor, live_logprob: Tensor, forced: Tensor, pad_id: int, V: int,
                       top_logprob: Tensor, top_index: Tensor) -> tuple[Tensor, Tensor]:
    """The 2k candidates (top_logprob, top_index (B, 2k)) where a sentence has a prefix token left
    (forced (B,), else pad_id): its k hypotheses each extended by that token (forced_logprob (B, k)
    its log-prob after each), then k fillers that rank last (2 * NEG_INF) and never end."""
    k = live_logprob.shape[1]
    forcing = (forced != pad_id)[:, None]  # (B, 1)
    extended = live_logprob + forced_logprob  # (B, k)
    values = torch.cat([extended, torch.full_like(extended, 2 * NEG_INF)], dim=1)  # (B, 2k)
    index = (torch.arange(k, device=forced.device)[None] * V + forced[:, None]).repeat(1, 2)  # (B, 2k)
    return torch.where(forcing, values, top_logprob), torch.where(forcing, index, top_index)


def _n_best(tokens: Tensor, logprob: Tensor, scores: Tensor, no_sentence: Tensor, n: int, pad_id: int):
    """The n best finished hypotheses, best first: (tokens (B, n, L), log-probs (B, n), scores (B, n)); a slot with no
    hypothesis (fewer than n possible outputs, a padding row) is padding with log-prob and score -inf."""
    real = (logprob[:, :n] > NEG_INF / 2) & ~no_sentence[:, None]  # (B, n)
    return (torch.where(real[..., None], tokens[:, :n], pad_id), torch.where(real, logprob[:, :n], -math.inf),
            torch.where(real, scores[:, :n], -math.inf))


@torch.no_grad()
def beam_search(model: Transformer, src_ids: Tensor, beam_size: int = 4, alpha: float = 0.6,
                max_len_a: float = 1.5, max_len_b: int = 10, cached: bool = True, scoring: str = "gnmt",
                n_best: int | None = None, prefix: Tensor | None = None) -> tuple[Tensor, ...]:
    """src_ids (B, S) -> (tokens (B, L), scores (B,)) of the best finished hypothesis per sentence; with `n_best` K (at
    most beam_size) the K best, best first: (tokens (B, K, L), log-probs (B, K), scores (B, K)), score = log-prob /
    length_penalty (`_n_best` for missing ones).

    Each step extends every live hypothesis by every token, keeps the 2k best candidates, moves those ending in EOS to
    the finished set (scored log-prob / length_penalty) and the k best others to the live set. A sentence is done when
    its best finished hypothesis beats the best score any live one could still reach (`_done`); the search stops when
    every sentence is done (for n_best K: when its K-th best does). `cached=False`: no key/value cache. `scoring`: one
    of SCORINGS. `prefix` (B, P): forced first tokens, as in `greedy_search`."""
    _check_ids("src_ids", src_ids, model.cfg.src_vocab_size, model.cfg.max_len)
    check_beam(beam_size, alpha, scoring, n_best)
    n = n_best or 1
    cfg = model.cfg
    B, S = src_ids.shape
    k, V = beam_size, cfg.tgt_vocab_size
    device = src_ids.device
    length = output_length(S, cfg.max_len, max_len_a, max_len_b)
    limits = sentence_limits(src_ids, cfg.pad_id, length, max_len_a, max_len_b)  # (B,)
    if prefix is not None:
        check_prefix(src_ids, prefix, cfg, max_len_a, max_len_b)
    forced = _prefix_columns(prefix, cfg.pad_id, length)  # (B, L) or None
    decoder = _Decoder(model, src_ids, k, length, cached)  # batch B*k, hypothesis-major per sentence
    best_possible_penalty = length_penalty(limits.float(), alpha, scoring)  # (B,)
    may_finish = torch.arange(2 * k, device=device) < (k if scoring == "hf" else 2 * k)  # (2k,) candidate ranks
    no_sentence = _no_sentence(src_ids, cfg.pad_id)  # (B,)

    live_tokens = torch.full((B, k, length), cfg.pad_id, dtype=torch.long, device=device)
    live_logprob = torch.full((B, k), NEG_INF, device=device)
    live_logprob[:, 0] = 0.0  # one live hypothesis at the start: the others are copies of it
    finished_tokens = live_tokens.clone()
    finished_scores = torch.full((B, k), NEG_INF, device=device)
    finished_logprob = torch.full((B, k), NEG_INF, device=device)
    last = torch.full((B * k,), cfg.bos_id, dtype=torch.long, device=device)
    for position in range(length):
        logits = decoder.logits(live_tokens.reshape(B * k, length), last, position).view(B, k, V)
        must_end = position + 1 >= limits  # (B,)
        logprobs = _next_logprobs(cfg, logits, must_end[:, None])  # (B, k, V)

        candidates = (live_logprob[:, :, None] + logprobs).view(B, k * V)
        top_logprob, top_index = candidates.topk(2 * k, dim=1)  # (B, 2k)
        if forced is not None:
            forced_logprob = logprobs.gather(2, forced[:, position, None, None].expand(B, k, 1))[..., 0]  # (B, k)
            top_logprob, top_index = _forced_candidates(forced_logprob, live_logprob, forced[:, position], cfg.pad_id,
                                                        V, top_logprob, top_index)
        parent, token = top_index // V, top_index % V
        top_tokens = _gather(live_tokens, parent)  # (B, 2k, L)
        top_tokens[:, :, position] = token
        ends = token == cfg.eos_id
        if scoring == "hf":  # HF's <eos> forced at the limit adds nothing (its processor sets that log-prob to 0)
            top_logprob = torch.where(must_end[:, None] & ends, _gather(live_logprob, parent), top_logprob)

        # Finished: the old ones and the new EOS candidates, the best k kept.
        new_scores = torch.where(ends & may_finish, top_logprob / length_penalty(position + 1, alpha, scoring), NEG_INF)
        finished_scores, keep = torch.cat([finished_scores, new_scores], dim=1).topk(k, dim=1)
        finished_tokens = _gather(torch.cat([finished_tokens, top_tokens], dim=1), keep)
        finished_logprob = _gather(torch.cat([finished_logprob, top_logprob], dim=1), keep)

        # Live: the best k candidates that did not end.
        live_logprob, keep = torch.where(ends, NEG_INF, top_logprob).topk(k, dim=1)
        live_tokens = _gather(top_tokens, keep)
        last = _gather(token, keep).reshape(B * k)
        decoder.reorder((torch.arange(B, device=device)[:, None] * k + _gather(parent, keep)).reshape(B * k))

        if bool(_done(finished_scores[:, n - 1 :], live_logprob, best_possible_penalty, no_sentence).all()):
            break
    if n_best is not None:
        return _n_best(finished_tokens, finished_logprob, finished_scores, no_sentence, n_best, cfg.pad_id)
    tokens = torch.where(no_sentence[:, None], cfg.pad_id, finished_tokens[:, 0])
    return tokens, torch.where(no_sentence, 0.0, finished_scores[:, 0])


@torch.no_grad()
def score(model: Transformer, src_ids: Tensor, tgt_ids: Tensor) -> Tensor:
    """src_ids (B, S), tgt_ids (B, T) (target tokens ending with <eos>, then pad_id) -> (B, T) the log-probability of
    each target token given the source and the tokens before it (teacher forcing), 0 at padding: a row's sum is its
    target's log-probability, which a search's score of that output is (no token masked, nothing renormalised)."""
    _check_ids("src_ids", src_ids, model.cfg.src_vocab_size, model.cfg.max_len)
    _check_ids("tgt_ids", tgt_ids, model.cfg.tgt_vocab_size, model.cfg.max_len)
    if tgt_ids.shape[0] != src_ids.shape[0]:  # not broadcast: torch gave one row for two, JAX two
        raise ValueError(f"tgt_ids has {tgt_ids.shape[0]} rows, src_ids {src_ids.shape[0]}: one target per source")
    logits = model(src_ids, shift_right(tgt_ids, model.cfg.bos_id))  # (B, T, V)
    logprobs = torch.log_softmax(logits.float(), dim=-1).gather(2, tgt_ids[..., None])[..., 0]  # (B, T)
    return torch.where(tgt_ids == model.cfg.pad_id, 0.0, logprobs)
