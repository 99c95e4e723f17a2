"""Sampling with random numbers both frameworks share: the same tokens in both twins (docs/decoding.md#sampling)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .config import check_sampling
from .decode import _check_ids, _token_by_token
from .model import Transformer

# Threefry-2x32's rotation distances and key-schedule parity (Random123, threefry.h).
ROTATIONS = (13, 15, 26, 6, 17, 29, 16, 24)
PARITY = 0x1BD11BDA
MASK = 0xFFFFFFFF  # the low 32 bits: a uint32 held in an int64


def _rotl(x: Tensor, r: int) -> Tensor:
    return ((x << r) | (x >> (32 - r))) & MASK  # x < 2**32: the shift left stays below 2**63


def threefry2x32(k0, k1, x0, x1) -> tuple[Tensor, Tensor]:
    """Threefry-2x32 (20 rounds) of the key (k0, k1) at the counter (x0, x1) -> two words as int64, broadcast."""
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
    """The float32 uniform in (0, 1) of (seed, sentence id, sample, position): (2m + 1) / 2**24 from Threefry."""
    word, _ = threefry2x32(seed, sentence, sample, position)
    return ((word >> 9) * 2 + 1).float() * 2.0**-24


def _sentence_ids(sentence_ids, batch: int, device) -> Tensor:
    """(B,) int64 the ids the random numbers are keyed by: 0..B-1 unless given."""
    if sentence_ids is None:
        return torch.arange(batch, device=device)
    ids = torch.as_tensor(sentence_ids, dtype=torch.int64, device=device)
    if ids.shape != (batch,) or bool(((ids < 0) | (ids > MASK)).any()):
        raise ValueError(f"sentence_ids must be {batch} integers in [0, 2**32), one a source row")
    return ids


def sampling_distribution(logprobs: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """logprobs (N, V) -> probs (N, V) in token-id order, as HF's warpers define them: softmax of logprobs /
    temperature, then top-k (ties kept), then top-p (ties by lower id), renormalised; thresholds, nothing reordered."""
    scaled = (logprobs - logprobs.amax(dim=-1, keepdim=True)) / temperature  # best at 0: no overflow
    if top_k:
        kth = torch.topk(scaled, min(top_k, scaled.shape[-1]), dim=-1).values[:, -1:]  # (N, 1)
        scaled = torch.where(scaled >= kth, scaled, -math.inf)
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1:
        probs = torch.where(_top_p_kept(probs, top_p), probs, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _top_p_kept(probs: Tensor, top_p: float) -> Tensor:
    """probs (N, V) -> (N, V) bool, the tokens top-p keeps (ties by lowest id), the tokens staying in id order."""
    falling = torch.sort(probs, dim=-1, descending=True).values
    kept = ((falling.cumsum(dim=-1) - falling) < top_p).sum(dim=-1, keepdim=True)  # (N, 1) mass before < p
    least = falling.gather(1, kept - 1)  # (N, 1) the least kept probability
    above, tie = probs > least, probs == least
    return above | (tie & (tie.cumsum(dim=-1) <= kept - above.sum(dim=-1, keepdim=True)))


def draw(probs: Tensor, u: Tensor) -> Tensor:
    """probs (N, V), u (N,) in (0, 1) -> tokens (N,) by inverse CDF in token-id order (never one of probability 0)."""
    cdf = probs.cumsum(dim=-1)
    token = (cdf <= u[:, None] * cdf[:, -1:]).sum(dim=-1)  # tokens whose cumulative probability is passed
    ids = torch.arange(probs.shape[-1], device=probs.device)
    last = torch.where(probs > 0, ids, -1).amax(dim=-1)  # u * total rounded up to the total
    return torch.minimum(token, last)


@torch.no_grad()
def sample(
    model: Transformer, src_ids: Tensor, seed: int, num_samples: int = 1, temperature: float = 1.0,
    top_k: int = 0, top_p: float = 1.0, max_len_a: float = 1.5, max_len_b: int = 10, sentence_ids=None,
) -> tuple[Tensor, Tensor]:
    """src_ids (B, S) -> (tokens (B, N, L), untempered log-prob scores (B, N)): N samples a sentence."""
    _check_ids("src_ids", src_ids, model.cfg.src_vocab_size, model.cfg.max_len)
    check_sampling(seed, num_samples, temperature, top_k, top_p)
    ids = _sentence_ids(sentence_ids, src_ids.shape[0], src_ids.device)
    return sample_loop(model, src_ids, seed, ids, num_samples, temperature, top_k, top_p, max_len_a, max_len_b)


@torch.no_grad()
def sample_loop(model: Transformer, src_ids: Tensor, seed, sentence_ids: Tensor, num_samples: int, temperature: float,
                top_k: int, top_p: float, max_len_a: float, max_len_b: int) -> tuple[Tensor, Tensor]:
    """`sample`'s drawing loop, its settings checked and its sentence ids (B,) given."""
    B, N = src_ids.shape[0], num_samples
    sentence = sentence_ids.repeat_interleave(N)  # (B*N,)
    sample_index = torch.arange(N, device=src_ids.device).repeat(B)  # (B*N,)

    def choose(position: int, logprobs: Tensor) -> Tensor:
        u = uniform(seed, sentence, sample_index, position)  # (B*N,)
        return draw(sampling_distribution(logprobs, temperature, top_k, top_p), u)

    tokens, scores = _token_by_token(model, src_ids, N, choose, max_len_a, max_len_b)
    return tokens.view(B, N, -1), scores.view(B, N)
