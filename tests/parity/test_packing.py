"""Sequence packing (several pairs a row, segment ids, positions restarting per segment): the
Batcher's packed batches, and in both twins the logits of a packed row's pairs equal those of each
pair alone, and equal across frameworks.

Tolerances: float32 with parity numerics. A pair alone and the same pair in a packed row differ only
in the masked keys (exactly zero weight after the softmax) and the matmuls' summation lengths:
1e-5 absolute on O(1) logits is ~100 ulps, the bound of the parity contract for whole models.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torch_reference as tr
from jax_transformer import model as jmodel
from parity.comparison import enable_parity_numerics
from torch_reference import model as tmodel
from train.data import BOS_ID, EOS_ID, PAD_ID, Batcher
from train.interop.weights import torch_to_jax

enable_parity_numerics()

CFG = {"src_vocab_size": 41, "tgt_vocab_size": 41, "d_model": 24, "num_heads": 3, "d_ff": 40, "num_encoder_layers": 2,
       "num_decoder_layers": 3, "dropout": 0.0, "max_len": 32, "layer_norm_eps": 1e-6}
VARIANTS = [{}, {"positions": "learned", "norm_position": "pre"}]


def pairs(n: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """n random pairs of 2-9 source and 2-7 target tokens (with <eos>): lopsided lengths."""
    rng = np.random.default_rng(seed)
    return [([*rng.integers(4, 41, rng.integers(1, 9)), EOS_ID], [*rng.integers(4, 41, rng.integers(1, 7)), EOS_ID])
            for _ in range(n)]


def packed_batch(n: int = 12, seed: int = 0):
    examples = pairs(n, seed)
    batcher = Batcher(examples, token_budget=64, max_len=16, pack=True, shuffle=False)
    return examples, next(iter(batcher.epoch_batches()))


def test_packing_holds_every_pair_once_in_one_shape():
    examples = pairs(200, seed=1)
    batcher = Batcher(examples, token_budget=256, max_len=16, pack=True, seed=3)
    batches = list(batcher.epoch_batches(0))
    assert {b.src.shape for b in batches} == {(16, 16)} == {b.tgt_out.shape for b in batches}
    assert batcher.shapes == [(16, 16)]
    seen = sorted(int(i) for b in batches for i in b.ids.ravel() if i >= 0)
    assert seen == list(range(200))  # each pair exactly once an epoch
    for b in batches:
        for row, ids in zip(range(len(b.src)), b.ids):
            ids = [int(i) for i in ids if i >= 0]
            # each row: its pairs one after the other, numbered from 1, then padding
            assert list(b.src[row][b.src_segments[row] > 0]) == [t for i in ids for t in examples[i][0]]
            assert list(b.tgt_out[row][b.tgt_segments[row] > 0]) == [t for i in ids for t in examples[i][1]]
            shifted = [t for i in ids for t in [BOS_ID, *examples[i][1][:-1]]]  # shift_right per segment
            assert list(b.tgt_in[row][b.tgt_segments[row] > 0]) == shifted
            assert (b.src[row][b.src_segments[row] == 0] == PAD_ID).all()
            assert list(np.unique(b.src_segments[row][b.src_segments[row] > 0])) == list(range(1, len(ids) + 1))
    unpacked = Batcher(examples, token_budget=256, max_len=16, seed=3)
    assert batcher.padding_share() < unpacked.padding_share()  # the point of packing
    assert batcher.num_batches < unpacked.num_batches
    assert sum(b.num_tgt_tokens for b in batches) == sum(len(t) for _, t in examples)


def test_packed_batcher_resumes_across_epochs():
    examples = pairs(100, seed=2)
    first = Batcher(examples, token_budget=128, max_len=16, pack=True, seed=5)
    taken = [next(first) for _ in range(first.num_batches + 3)]  # into the second epoch
    second = Batcher(examples, token_budget=128, max_len=16, pack=True, seed=5)
    second.restore(first.state())
    for _ in range(4):
        np.testing.assert_array_equal(next(first).src, next(second).src)
    assert not np.array_equal(taken[0].src, taken[first.num_batches].src)  # epochs are shuffled apart


@pytest.mark.parametrize("segments", [[1, 1, 1, 2, 2, 3, 0, 0], [1, 2, 3, 3, 3, 3, 3, 3]])
def test_segment_positions_restart_per_segment(segments):
    expected = {(1, 1, 1, 2, 2, 3, 0, 0): [0, 1, 2, 0, 1, 0, 0, 1], (1, 2, 3, 3, 3, 3, 3, 3): [0, 0, 0, 1, 2, 3, 4, 5]}
    seg = np.array([segments])
    assert tmodel.segment_positions(torch.from_numpy(seg)).tolist() == [expected[tuple(segments)]]
    assert np.asarray(jmodel.segment_positions(jnp.asarray(seg))).tolist() == [expected[tuple(segments)]]


def alone(examples, batch):
    """Every pair of a packed batch as its own row, padded to the batch's length: src (N, S), tgt_in (N, T)."""
    ids = [int(i) for i in batch.ids.ravel() if i >= 0]
    src = np.zeros((len(ids), batch.src.shape[1]), np.int64)
    tgt_in = np.zeros((len(ids), batch.tgt_in.shape[1]), np.int64)
    for row, i in enumerate(ids):
        s, t = examples[i]
        src[row, : len(s)], tgt_in[row, : len(t)] = s, [BOS_ID, *t[:-1]]
    return {i: row for row, i in enumerate(ids)}, src, tgt_in


def each_pair(batch):
    """(row, pair index, source slice, target slice) of every pair in a packed batch."""
    for row, ids in enumerate(batch.ids):
        for segment, i in enumerate((int(i) for i in ids if i >= 0), start=1):
            src_at = np.flatnonzero(batch.src_segments[row] == segment)
            tgt_at = np.flatnonzero(batch.tgt_segments[row] == segment)
            yield row, i, slice(src_at[0], src_at[-1] + 1), slice(tgt_at[0], tgt_at[-1] + 1)


@pytest.mark.parametrize("variant", VARIANTS, ids=["paper", "learned,pre"])
def test_torch_packed_logits_equal_each_pair_alone(variant):
    torch.manual_seed(0)
    model = tr.Transformer(tr.TransformerConfig(**{**CFG, **variant})).eval()
    examples, batch = packed_batch()
    assert batch.src_segments.max() >= 2  # rows really hold several pairs
    t = lambda x: torch.from_numpy(np.asarray(x, np.int64))
    with torch.no_grad():
        packed = model(t(batch.src), t(batch.tgt_in), src_segments=t(batch.src_segments),
                       tgt_segments=t(batch.tgt_segments)).numpy()
        where, src, tgt_in = alone(examples, batch)
        single = model(t(src), t(tgt_in)).numpy()
    for row, i, _, tgt in each_pair(batch):
        np.testing.assert_allclose(packed[row, tgt], single[where[i], : tgt.stop - tgt.start], atol=1e-5)


@pytest.mark.parametrize("kernels", jmodel.KERNELS)
@pytest.mark.parametrize("variant", VARIANTS, ids=["paper", "learned,pre"])
def test_jax_packed_logits_equal_each_pair_alone_and_torch(variant, kernels):
    torch.manual_seed(0)
    torch_model = tr.Transformer(tr.TransformerConfig(**{**CFG, **variant})).eval()
    model = torch_to_jax(torch_model)
    jmodel.set_kernels(model, kernels)  # every kernel set takes the same segment masks
    examples, batch = packed_batch()
    j = lambda x: jnp.asarray(np.asarray(x, np.int32))
    packed = np.asarray(model(j(batch.src), j(batch.tgt_in), src_segments=j(batch.src_segments),
                              tgt_segments=j(batch.tgt_segments)))
    where, src, tgt_in = alone(examples, batch)
    single = np.asarray(model(j(src), j(tgt_in)))
    for row, i, _, tgt in each_pair(batch):
        np.testing.assert_allclose(packed[row, tgt], single[where[i], : tgt.stop - tgt.start], atol=1e-5)
    t = lambda x: torch.from_numpy(np.asarray(x, np.int64))
    with torch.no_grad():
        reference = torch_model(t(batch.src), t(batch.tgt_in), src_segments=t(batch.src_segments),
                                tgt_segments=t(batch.tgt_segments)).numpy()
    real = batch.tgt_segments > 0  # padding positions attend to nothing real: compared where it counts
    np.testing.assert_allclose(packed[real], reference[real], atol=1e-5)
