"""Several models decoding as one in one `nnx.jit` program: the twin of `torch_reference/ensemble.py`."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from torch_reference.config import AVERAGES, check_ensemble  # noqa: F401 (AVERAGES: `average`'s choices, by name)

from .model import Transformer, padding_mask


def combine(logits: list, average: str = "logprob"):
    """The members' logits (..., V) -> the ensemble's log-probabilities (..., V) by `average`."""
    logprobs = jnp.stack([jax.nn.log_softmax(x.astype(jnp.float32), axis=-1) for x in logits])  # (M, ..., V)
    if average == "prob":
        return jax.nn.logsumexp(logprobs, axis=0) - math.log(len(logits))
    return logprobs.mean(axis=0)


class Ensemble(nnx.Module):
    """`models` (same vocabularies and special ids) as one model for the searches, averaged by `average`."""

    def __init__(self, models: Sequence[Transformer], average: str = "logprob"):
        models = list(models)
        check_ensemble([m.cfg for m in models], average)
        self.members = nnx.List(models)
        self.average = average
        self.cfg = dataclasses.replace(models[0].cfg, max_len=min(m.cfg.max_len for m in models))
        self.widths = tuple(m.cfg.d_model for m in models)  # each member's slice of memory and hidden states
        self.depths = tuple(len(m.decoder.layers) for m in models)  # each member's run of cache layers
        self.xla_cpu = all(m.xla_cpu for m in models)

    def _split(self, x) -> list:
        return jnp.split(x, list(itertools.accumulate(self.widths[:-1])), axis=-1)  # (..., D1 + D2 + ...) -> (..., Di)

    def _caches(self, cache: list) -> list[list]:
        starts = [sum(self.depths[:i]) for i in range(len(self.depths))]
        return [cache[start: start + depth] for start, depth in zip(starts, self.depths)]

    def encode(self, src_ids, src_mask=None):
        """src_ids (B, S) -> memory (B, S, D1 + D2 + ...): the members' side by side."""
        if src_mask is None:
            src_mask = padding_mask(src_ids, self.cfg.pad_id)
        return jnp.concatenate([m.encode(src_ids, src_mask) for m in self.members], axis=-1)

    def decode(self, tgt_in_ids, memory, src_mask=None, tgt_mask=None):
        """tgt_in_ids (B, T), memory (B, S, D1 + ...) -> hidden states (B, T, D1 + ...), side by side."""
        return jnp.concatenate([m.decode(tgt_in_ids, x, src_mask, tgt_mask) for m, x in zip(self.members, self._split(memory))],
                               axis=-1)

    def init_cache(self, memory, max_len: int) -> list[dict]:
        """The members' decoding caches over memory (B, S, D1 + ...), their layer lists one after the other."""
        return [layer for m, x in zip(self.members, self._split(memory)) for layer in m.init_cache(x, max_len)]

    def decode_step(self, tgt_ids, cache, position, src_mask=None):
        """tgt_ids (B,) -> (the ensemble's log-probabilities (B, V) for position + 1, cache)."""
        steps = [m.decode_step(tgt_ids, c, position, src_mask) for m, c in zip(self.members, self._caches(cache))]
        return combine([logits for logits, _ in steps], self.average), [layer for _, c in steps for layer in c]

    def project(self, hidden):
        """hidden (B, T, D1 + ...) -> the ensemble's log-probabilities (B, T, V)."""
        return combine([m.project(h) for m, h in zip(self.members, self._split(hidden))], self.average)

    def __call__(self, src_ids, tgt_in_ids):
        """src_ids (B, S), tgt_in_ids (B, T) -> the ensemble's log-probabilities (B, T, V)."""
        return combine([m(src_ids, tgt_in_ids) for m in self.members], self.average)
