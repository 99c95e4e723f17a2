"""Sampling from the reference model's cached decoding, with random numbers both frameworks share.

`jax_transformer/sampling.py` is the same algorithm in one jit-compiled `lax.while_loop`; for the
same seed and weights the two return the same tokens (docs/decoding-sampling.md).

The random numbers come from a counter-based function, not a generator's state: the uniform of a
step is Threefry-2x32 (20 rounds, Salmon et al. 2011, JAX's own PRNG) keyed by (seed, sentence id)
at the counter (sample, position), computed with integer arithmetic that rounds nowhere. A row's
tokens therefore depend on its seed, its sentence id and its model alone, never on the batch it
is in or on the framework. torch lacks uint32 arithmetic: the words are held in int64 and masked.

The token is drawn by inverse CDF over the filtered distribution sorted by falling probability:
the first token whose cumulative probability exceeds u. Only the boundaries near u matter, and in
sorted order those move with the small tail mass beyond them, so float32 differences in the
logits change a token only when u falls within about 1e-6 of a boundary.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .decode import NEG_INF, _check_source, _Decoder, _never_emitted, _no_sentence, output_length, sentence_limits
from .model import Transformer, padding_mask

# Threefry-2x32's rotation distances and key-schedule parity (Random123, threefry.h).
ROTATIONS = (13, 15, 26, 6, 17, 29, 16, 24)
PARITY = 0x1BD11BDA
MASK = 0xFFFFFFFF  # the low 32 bits: a uint32 held in an int64


def _rotl(x: Tensor, r: int) -> Tensor:
    return ((x << r) | (x >> (32 - r))) & MASK  # x < 2**32: the shift left stays below 2**63


def threefry2x32(k0, k1, x0, x1) -> tuple[Tensor, Tensor]:
    """Threefry-2x32 with 20 rounds of the key (k0, k1) at the counter (x0, x1) -> two words, each
    argument a uint32 value (int or int64 tensor in [0, 2**32)), broadcast together; int64 results."""
    k0, k1, x0, x1 = (torch.as_tensor(v, dtype=torch.int64) for v in (k0, k1, x0, x1))
    ks = (k0, k1, k0 ^ k1 ^ PARITY)
    x0, x1 = (x0 + ks[0]) & MASK, (x1 + ks[1]) & MASK
    for i in range(5):  # 5 groups of 4 rounds, the key injected after each group
        for r in ROTATIONS[4 * (i % 2): 4 * (i % 2) + 4]:
            x0 = (x0 + x1) & MASK
            x1 = _rotl(x1, r) ^ x0
        x0 = (x0 + ks[(i + 1) % 3]) & MASK
        x1 = (x1 + ks[(i + 2) % 3] + i + 1) & MASK
    return x0, x1


def uniform(seed, sentence, sample, position) -> Tensor:
    """The uniform float32 in (0, 1) of (seed, sentence id, sample, position), broadcast together:
    the top 23 bits of Threefry's first word as the odd multiple (2m + 1) / 2**24, exact in float32."""
    word, _ = threefry2x32(seed, sentence, sample, position)
    return ((word >> 9) * 2 + 1).float() * 2.0**-24


def _check_sampling(seed, num_samples, temperature, top_k, top_p) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MASK:
        raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be an integer >= 1, got {num_samples!r}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0: no limit), got {top_k!r}")
    if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1] (1: no limit), got {top_p!r}")


def _sentence_ids(sentence_ids, batch: int, device) -> Tensor:
    """(B,) int64 the ids the random numbers are keyed by: 0..B-1 unless given."""
    if sentence_ids is None:
        return torch.arange(batch, device=device)
    ids = torch.as_tensor(sentence_ids, dtype=torch.int64, device=device)
    if ids.shape != (batch,) or bool(((ids < 0) | (ids > MASK)).any()):
        raise ValueError(f"sentence_ids must be {batch} integers in [0, 2**32), one a source row")
    return ids


def sampling_distribution(logprobs: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
    """logprobs (N, V) -> (order (N, V) token ids by falling probability, probs (N, V) the sampling
    probability of each, in that order), as HF's warpers (and fairseq) define them: softmax of
    logprobs / temperature, kept to the tokens scoring at least the k-th largest (`top_k` > 0; ties
    kept), then to the smallest prefix whose probability reaches `top_p` (a token stays while the
    tokens before it hold less than top_p), renormalised. The sort is stable: ties in index order."""
    scaled, order = torch.sort(-(logprobs / temperature), dim=-1, stable=True)  # (N, V) rising -scaled
    scaled = -scaled
    if top_k:
        scaled = torch.where(scaled >= scaled[:, min(top_k, scaled.shape[-1]) - 1, None], scaled, -math.inf)
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1:
        probs = torch.where(probs.cumsum(dim=-1) - probs < top_p, probs, 0.0)  # mass before each token < p
    return order, probs / probs.sum(dim=-1, keepdim=True)


def draw(order: Tensor, probs: Tensor, u: Tensor) -> Tensor:
    """order, probs (N, V) of `sampling_distribution`, u (N,) in (0, 1) -> tokens (N,): by inverse CDF,
    the first token in `order` whose cumulative probability exceeds u (never one of probability 0)."""
    cdf = probs.cumsum(dim=-1)
    rank = (cdf <= u[:, None] * cdf[:, -1:]).sum(dim=-1)  # tokens whose cumulative probability is passed
    rank = torch.minimum(rank, (probs > 0).sum(dim=-1) - 1)  # u * total rounded up to the total
    return order.gather(1, rank[:, None])[:, 0]


@torch.no_grad()
def sample(
    model: Transformer, src_ids: Tensor, seed: int, num_samples: int = 1, temperature: float = 1.0,
    top_k: int = 0, top_p: float = 1.0, max_len_a: float = 1.5, max_len_b: int = 10, sentence_ids=None,
) -> tuple[Tensor, Tensor]:
    """src_ids (B, S) -> (tokens (B, N, L), scores (B, N)): `num_samples` N translations a sentence,
    each token drawn from `sampling_distribution` with the uniform of (seed, sentence id, sample,
    position); the score is the sum of the drawn tokens' log-probabilities under the model (as
    greedy's: without temperature or filters). `sentence_ids` (B,): the ids that key the random
    numbers, 0..B-1 unless given; pass each sentence's index in the input so that its samples do not
    depend on the batch it falls in. Lengths and padding as `decode.greedy_search`."""
    _check_source(model, src_ids)
    _check_sampling(seed, num_samples, temperature, top_k, top_p)
    cfg = model.cfg
    B, S = src_ids.shape
    N, device = num_samples, src_ids.device
    length = output_length(S, cfg.max_len, max_len_a, max_len_b)
    limits = sentence_limits(src_ids, cfg.pad_id, length, max_len_a, max_len_b).repeat_interleave(N)  # (B*N,)
    src_mask = padding_mask(src_ids, cfg.pad_id)
    memory = model.encode(src_ids, src_mask).repeat_interleave(N, dim=0)  # (B*N, S, D), a sentence's rows together
    decoder = _Decoder(model, memory, src_mask.repeat_interleave(N, dim=0), length, cached=True)
    sentence = _sentence_ids(sentence_ids, B, device).repeat_interleave(N)  # (B*N,)
    sample_index = torch.arange(N, device=device).repeat(B)  # (B*N,)
    not_eos = torch.arange(cfg.tgt_vocab_size, device=device) != cfg.eos_id  # (V,)
    never = _never_emitted(cfg, torch.arange(cfg.tgt_vocab_size, device=device))  # (V,) pad and bos

    tokens = torch.full((B * N, length), cfg.pad_id, dtype=torch.long, device=device)
    scores = torch.zeros(B * N, device=device)
    done = _no_sentence(src_ids, cfg.pad_id).repeat_interleave(N)  # (B*N,)
    last = torch.full((B * N,), cfg.bos_id, dtype=torch.long, device=device)
    for position in range(length):
        logprobs = torch.log_softmax(decoder.logits(tokens, last, position).float(), dim=-1)  # (B*N, V)
        must_end = (position + 1 >= limits)[:, None]  # rows at their limit emit EOS
        logprobs = torch.where((must_end & not_eos) | never, NEG_INF, logprobs)
        u = uniform(seed, sentence, sample_index, position)  # (B*N,)
        last = draw(*sampling_distribution(logprobs, temperature, top_k, top_p), u)
        scores = scores + torch.where(done, 0.0, logprobs.gather(1, last[:, None])[:, 0])
        tokens[:, position] = torch.where(done, cfg.pad_id, last)
        done = done | (last == cfg.eos_id)
        if bool(done.all()):
            break
    return tokens.view(B, N, length), scores.view(B, N)
