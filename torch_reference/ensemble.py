"""Several models decoding as one (fairseq's `EnsembleModel`): the members' states side by side, and as logits
the combined log-probabilities, "logprob" the mean of theirs, "prob" of their mean probability
(docs/decoding.md#the-twins-ensemble)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .config import AVERAGES, check_ensemble  # noqa: F401 (AVERAGES: `average`'s choices, by name)
from .model import Transformer, padding_mask


def combine(logits: list[Tensor], average: str = "logprob") -> Tensor:
    """The members' logits (..., V) -> the ensemble's log-probabilities (..., V) by `average`."""
    logprobs = torch.stack([torch.log_softmax(x.float(), dim=-1) for x in logits])  # (M, ..., V)
    if average == "prob":
        return torch.logsumexp(logprobs, dim=0) - math.log(len(logits))
    return logprobs.mean(dim=0)


class Ensemble(nn.Module):
    """`models` (same vocabularies and special ids) as one model for the searches, averaged by `average`."""

    def __init__(self, models: Sequence[Transformer], average: str = "logprob"):
        super().__init__()
        models = list(models)
        check_ensemble([m.cfg for m in models], average)
        self.members = nn.ModuleList(models)
        self.average = average
        self.cfg = dataclasses.replace(models[0].cfg, max_len=min(m.cfg.max_len for m in models))
        self.widths = [m.cfg.d_model for m in models]  # each member's slice of memory and hidden states
        self.depths = [len(m.decoder.layers) for m in models]  # each member's run of cache layers

    def _split(self, x: Tensor) -> tuple[Tensor, ...]:
        return torch.split(x, self.widths, dim=-1)  # (..., D1 + D2 + ...) -> (..., Di) each

    def _caches(self, cache: list) -> list[list]:
        starts = [sum(self.depths[:i]) for i in range(len(self.depths))]
        return [cache[start: start + depth] for start, depth in zip(starts, self.depths)]

    def encode(self, src_ids: Tensor, src_mask: Tensor | None = None) -> Tensor:
        """src_ids (B, S) -> memory (B, S, D1 + D2 + ...): the members' side by side."""
        if src_mask is None:
            src_mask = padding_mask(src_ids, self.cfg.pad_id)
        return torch.cat([m.encode(src_ids, src_mask) for m in self.members], dim=-1)

    def decode(self, tgt_in_ids: Tensor, memory: Tensor, src_mask: Tensor | None = None,
               tgt_mask: Tensor | None = None) -> Tensor:
        """tgt_in_ids (B, T), memory (B, S, D1 + ...) -> hidden states (B, T, D1 + ...), side by side."""
        return torch.cat([m.decode(tgt_in_ids, x, src_mask, tgt_mask) for m, x in zip(self.members, self._split(memory))],
                         dim=-1)

    def init_cache(self, memory: Tensor, max_len: int) -> list[dict[str, Tensor]]:
        """The members' decoding caches over memory (B, S, D1 + ...), their layer lists one after the other."""
        return [layer for m, x in zip(self.members, self._split(memory)) for layer in m.init_cache(x, max_len)]

    def decode_step(self, tgt_ids: Tensor, cache: list[dict[str, Tensor]], position: int,
                    src_mask: Tensor | None = None) -> tuple[Tensor, list[dict[str, Tensor]]]:
        """tgt_ids (B,) -> (the ensemble's log-probabilities (B, V) for position + 1, cache)."""
        steps = [m.decode_step(tgt_ids, c, position, src_mask) for m, c in zip(self.members, self._caches(cache))]
        return combine([logits for logits, _ in steps], self.average), [layer for _, c in steps for layer in c]

    def project(self, hidden: Tensor) -> Tensor:
        """hidden (B, T, D1 + ...) -> the ensemble's log-probabilities (B, T, V)."""
        return combine([m.project(h) for m, h in zip(self.members, self._split(hidden))], self.average)

    def forward(self, src_ids: Tensor, tgt_in_ids: Tensor) -> Tensor:
        """src_ids (B, S), tgt_in_ids (B, T) -> the ensemble's log-probabilities (B, T, V)."""
        return combine([m(src_ids, tgt_in_ids) for m in self.members], self.average)
