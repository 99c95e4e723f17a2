"""`Batcher`: padded int32 batches under a token budget, bucketed or packed, shuffled per epoch, resumable."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from collections.abc import Iterator, Sequence

import numpy as np

from torch_reference.config import BOS_ID, EOS_ID, PAD_ID, POSITIVE

from .corpus_store import TokenStore

log = logging.getLogger(__name__)
# Pairs planned at a time: a larger corpus's epoch is planned a window at a time, its memory flat in the corpus size.
WINDOW = 1 << 20


def bucket_lengths(max_len: int) -> tuple[int, ...]:
    """Padded lengths 8, 16, 24, 32, 48, 64, 96, ... (2^k and 3*2^k) below max_len, then max_len."""
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    steps = sorted({m << k for m in (8, 24) for k in range(max_len.bit_length())})
    return tuple(length for length in steps if length < max_len) + (max_len,)


@dataclasses.dataclass(frozen=True)
class Batch:
    """One padded batch of int32 src, tgt_in, tgt_out; packed, segments as google/flax's wmt numbers them."""

    src: np.ndarray  # (B, S): source ids + eos
    tgt_in: np.ndarray  # (B, T): decoder input, shift_right(tgt_out): bos + tgt_out[:, :-1] (per segment)
    tgt_out: np.ndarray  # (B, T): target ids + eos, the labels
    ids: np.ndarray  # (B,) each row's pair in the examples, -1 for filler; packed (B, N): each row's pairs, then -1
    num_src_tokens: int  # non-pad tokens in src
    num_tgt_tokens: int  # non-pad tokens in tgt_out: what the loss averages over
    src_segments: np.ndarray | None = None  # (B, S) int32, packed batches only
    tgt_segments: np.ndarray | None = None  # (B, T) int32, packed batches only
    global_rows: int | None = None  # a process's share of a global batch of this many rows; None: the whole batch


class Batcher:
    """Padded batches under a token budget, shuffled per epoch with (seed, epoch), resumable (`state`, `restore`):
    in buckets (a pair in the smallest length L >= its longer side, floor(token_budget / (L * multiple_of)) *
    multiple_of rows, filler rows of ids -1; pairs over max_len dropped) or `pack`ed first-fit in one shape
    (docs/performance.md#sequence-packing). `process=(index, count)`: only that process's rows."""

    def __init__(self, examples: Sequence[tuple[Sequence[int], Sequence[int]]] | TokenStore, token_budget: int,
                 max_len: int = 256, multiple_of: int = 1, shuffle: bool = True, seed: int = 0, pack: bool = False,
                 pack_length: int | None = None, process: tuple[int, int] = (0, 1)):
        self.buckets = bucket_lengths(max_len)
        if multiple_of < 1:
            raise ValueError(f"multiple_of must be >= 1, got {multiple_of}")
        if token_budget < max_len * multiple_of:
            raise ValueError(f"token_budget={token_budget} cannot hold {multiple_of} sequence(s) of max_len={max_len}: "
                             f"needs at least {max_len * multiple_of}")
        self.store = examples if isinstance(examples, TokenStore) else TokenStore.from_pairs(examples)
        self.shuffle, self.seed, self.pack, self.process = shuffle, seed, pack, process
        self.max_len, self._src_len, self._tgt_len = max_len, self.store.src_len, self.store.tgt_len
        self.windows = max(1, -(-len(self.store) // WINDOW))
        self._index = np.int32 if len(self.store) < 2**31 else np.int64  # half int64's memory for any real corpus
        # One pass over the lengths, a window at a time: nothing the size of the corpus is held.
        counts, longest = np.zeros(len(self.buckets), np.int64), 0
        for start in range(0, len(self.store), WINDOW):
            part = slice(start, start + WINDOW)
            lengths = np.maximum(self._src_len[part], self._tgt_len[part])
            counts += np.bincount(np.searchsorted(self.buckets, lengths), minlength=len(self.buckets) + 1)[:-1]
            longest = max(longest, int(lengths[lengths <= max_len].max(initial=0)))
        self._counts = {length: int(n) for length, n in zip(self.buckets, counts) if n}  # kept pairs, buckets in use
        self.num_dropped = len(self.store) - sum(self._counts.values())
        if self.num_dropped:
            log.info("dropped %d of %d pairs longer than max_len=%d", self.num_dropped, len(self.store), max_len)
        if pack:
            self.pack_length = pack_length or (max(self._counts) if self._counts else max_len)
            if not longest <= self.pack_length <= max_len:
                raise ValueError(f"pack_length={self.pack_length} must hold the longest pair and be at most "
                                 f"max_len={max_len}")
        padded = (self.pack_length,) if pack else self.buckets  # the lengths batches are padded to
        self.batch_size = {length: token_budget // (length * multiple_of) * multiple_of for length in padded}
        if uneven := [size for size in self.batch_size.values() if size % process[1]]:
            raise ValueError(f"batches of {uneven[0]} rows cannot be split over {process[1]} processes")
        self.epoch, self.index = 0, 0
        self._plan_cache, self._place = (None, 0, []), (None, 0, 0)  # the last window planned; where `next` was

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """The distinct (B, L) batch shapes this data produces (one per bucket in use; packed: one)."""
        if self.pack:
            return [(self.batch_size[self.pack_length], self.pack_length)] if self._counts else []
        return [(self.batch_size[length], length) for length in self._counts]

    @property
    def num_batches(self) -> int:
        """Batches per epoch: epoch 0's (packed: another's may differ by a few; several windows: an estimate)."""
        if self.windows > 1:
            first, kept = self._window_plan(0, 0), sum(self._counts.values())
            pairs = sum(int((ids >= 0).sum()) for _, ids in first)
            if not pairs:  # a first window of dropped pairs only: not "no data" while later windows hold some
                return int(kept > 0)
            return round(len(first) * kept / pairs)
        if self.pack:
            return len(self._window_plan(0, 0))
        return sum(-(-n // self.batch_size[length]) for length, n in self._counts.items())

    def padding_share(self) -> float:
        """The share of padding among the source and target positions of epoch 0's batches (its first window's)."""
        plan = self._window_plan(0, 0)
        if not plan:
            return 0.0
        present = (ids[ids >= 0] for _, ids in plan)
        tokens = sum(int(self._src_len[i].sum()) + int(self._tgt_len[i].sum()) for i in present)
        positions = sum(2 * self.batch_size[length] * length for length, _ in plan)
        return 1.0 - tokens / positions

    def _window_plan(self, epoch: int, window: int) -> list[tuple[int, np.ndarray]]:
        """(L, pair indices) of every batch of `window` of `epoch`; several windows: window k the pairs (a * i + b)
        mod N of its range (a prime to N), each spanning the whole corpus."""
        if self._plan_cache[:2] == (epoch, window):
            return self._plan_cache[2]
        rng, n = np.random.default_rng((self.seed, epoch)), len(self.store)
        positions = np.arange(window * WINDOW, min(n, (window + 1) * WINDOW), dtype=np.int64)
        if self.shuffle and self.windows > 1:
            stride, offset = int(rng.integers(1, n)), int(rng.integers(0, n))
            while math.gcd(stride, n) != 1:
                stride += 1
            positions = (positions * stride + offset) % n
            rng = np.random.default_rng((self.seed, epoch, window))
        positions = positions.astype(self._index)
        lengths = np.maximum(self._src_len[positions], self._tgt_len[positions])
        if self.pack:
            kept = positions[lengths <= self.max_len]
            plan = [(self.pack_length, rows) for rows in self._packed(rng.permutation(kept) if self.shuffle else kept)]
        else:
            bucket_of, plan = np.searchsorted(self.buckets, lengths), []  # past max_len: len(buckets), no bucket
            for b, length in enumerate(self.buckets):
                if not len(idx := positions[bucket_of == b]):
                    continue
                if self.shuffle:
                    idx = rng.permutation(idx)
                size = self.batch_size[length]
                plan += [(length, idx[i : i + size]) for i in range(0, len(idx), size)]
        if self.shuffle:
            plan = [plan[i] for i in rng.permutation(len(plan))]
        self._plan_cache = (epoch, window, plan)
        return plan

    def _find(self, epoch: int, index: int) -> tuple[int, int, int, int]:
        """(epoch, index, window, batches before the window) of batch `index` of `epoch` (past its end: the next's)."""
        window, before = 0, 0
        if self._place[0] == epoch and self._place[2] <= index:  # the window of the last batch, or a later one
            window, before = self._place[1], self._place[2]
        while True:
            while window < self.windows:
                plan = self._window_plan(epoch, window)
                if index < before + len(plan):
                    self._place = (epoch, window, before)
                    return epoch, index, window, before
                window, before = window + 1, before + len(plan)
            epoch, index, window, before = epoch + 1, 0, 0, 0

    def _packed(self, order: np.ndarray) -> list[np.ndarray]:
        """The pairs of `order` packed first-fit into batches: per batch, a (rows, pairs a row) array, -1 after."""
        length, size = self.pack_length, self.batch_size[self.pack_length]
        src_len, tgt_len = self._src_len[order], self._tgt_len[order]
        waiting, start, window, batches = np.zeros(0, np.int64), 0, 4 * size, []  # positions in `order`
        while len(waiting) or start < len(order):
            while True:  # a window of the queue (the waiting pairs, then new ones) that holds the batch's end
                queue = np.concatenate([waiting, np.arange(start, min(len(order), start + window))])
                rows, left = _first_fit(src_len[queue], tgt_len[queue], size, length)
                if left.bit_count() >= size or start + window >= len(order):
                    break
                window *= 2
            bits = np.frombuffer(left.to_bytes(len(queue) // 8 + 1, "little"), np.uint8)
            unplaced = np.flatnonzero(np.unpackbits(bits, bitorder="little"))[:size]
            # The batch closes at its size-th pair that fits no row; those after it were not reached.
            stop = int(unplaced[-1]) if len(unplaced) == size else len(queue)
            rows = [row if row[-1] < stop else [p for p in row if p < stop] for row in rows if row[0] < stop]
            counts = np.fromiter(map(len, rows), np.int64, len(rows))
            ids = np.full((len(rows), counts.max()), -1, np.int64)
            ids[np.arange(counts.max()) < counts[:, None]] = order[queue[np.fromiter(itertools.chain(*rows), np.int64)]]
            batches.append(ids)
            # The first waiting pair always fits the empty first row, so the batch ends among the new ones.
            window = (stop - len(waiting)) * 5 // 4 + size
            start, waiting = max(start, int(queue[min(stop, len(queue) - 1)]) + 1), queue[unplaced]
        return batches

    def _collate(self, length: int, ids: np.ndarray) -> Batch:
        """The batch of pair indices `ids` ((n,) bucketed, (rows, n) packed), this process's rows of it."""
        size, (index, count) = self.batch_size[length], self.process
        present = ids[ids >= 0]
        tokens = int(self._src_len[present].sum()), int(self._tgt_len[present].sum())  # the global batch's
        full = np.full((size, *ids.shape[1:]), -1, np.int64)
        full[: len(ids)] = ids
        local = full[index * size // count : (index + 1) * size // count]
        grid = local.reshape(len(local), -1)  # (rows, pairs a row): bucketed, one pair a row, the rows in use first
        row, segment = np.nonzero(grid >= 0)  # row-major: each row's pairs in order
        arrays = {}
        for side in ("src", "tgt"):
            values, lengths = self.store.gather(side, grid[row, segment])
            before = np.cumsum(lengths) - lengths  # where each pair's ids begin among `values`
            at = np.repeat(row * length - before[np.searchsorted(row, row)], lengths) + np.arange(len(values))
            flat = {side: values, f"{side}_seg": np.repeat(segment + 1, lengths)}
            if side == "tgt" and self.pack:  # shift_right within each segment: bos, then the pair's ids but its last
                flat["tgt_in"] = np.concatenate([[BOS_ID], values[:-1]]).astype(np.int32)
                flat["tgt_in"][before] = BOS_ID
            for name, content in flat.items():
                arrays[name] = np.zeros((len(local), length), np.int32)
                arrays[name].reshape(-1)[at] = content
        src, tgt_out, global_rows = arrays["src"], arrays["tgt"], None if count == 1 else size
        if not self.pack:
            tgt_in = np.concatenate([np.full((len(local), 1), BOS_ID, np.int32), tgt_out[:, :-1]], axis=1)  # (B, T)
            return Batch(src, tgt_in, tgt_out, local, *tokens, global_rows=global_rows)
        return Batch(src, arrays["tgt_in"], tgt_out, local, *tokens, arrays["src_seg"], arrays["tgt_seg"],
                     global_rows=global_rows)

    def epoch_batches(self, epoch: int = 0) -> Iterator[Batch]:
        """All batches of one epoch; the iteration state is left alone."""
        for window in range(self.windows):
            for length, idx in self._window_plan(epoch, window):
                yield self._collate(length, idx)

    def __iter__(self) -> Batcher:
        return self

    def __next__(self) -> Batch:
        if not self._counts:
            raise StopIteration  # no data: an endless stream would spin forever
        self.epoch, index, window, before = self._find(self.epoch, self.index)
        length, idx = self._window_plan(self.epoch, window)[index - before]
        self.index = index + 1
        return self._collate(length, idx)

    def state(self) -> dict[str, int]:
        """Where `next` continues: {"epoch": e, "index": batches of epoch e already taken}."""
        return {"epoch": self.epoch, "index": self.index}

    def restore(self, state: dict[str, int]) -> None:
        """Continue from a `state()` (e.g. read back from a checkpoint's JSON)."""
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


def _first_fit(src_len: np.ndarray, tgt_len: np.ndarray, size: int, length: int) -> tuple[list[list[int]], int]:
    """First-fit of a queue of pairs into `size` rows: (each row's queue positions, the bit set of those left)."""
    fit_s, fit_t = [], []  # fit[room]: the bit set (a Python int, bit i for pair i) of the pairs that fit in room
    for lengths, fit in ((src_len, fit_s), (tgt_len, fit_t)):
        values = np.flatnonzero(np.bincount(lengths))  # the lengths present: a room fits what the longest below fits
        packed = np.packbits(lengths[None, :] <= values[:, None], axis=1, bitorder="little")
        raw, width = packed.tobytes(), packed.shape[1]
        sets = [0] + [int.from_bytes(raw[i : i + width], "little") for i in range(0, len(raw), width)]
        fit += [sets[i] for i in np.searchsorted(values, np.arange(length + 1), side="right").tolist()]
    s, t = src_len.tolist(), tgt_len.tolist()
    left, rows = (1 << len(s)) - 1, []
    while left and len(rows) < size:
        free_s, free_t, row = length, length, []
        while fits := left & fit_s[free_s] & fit_t[free_t]:
            low = fits & -fits
            p = low.bit_length() - 1
            left ^= low
            free_s, free_t = free_s - s[p], free_t - t[p]
            row.append(p)
        rows.append(row)
    return rows, left


def fixed_lengths(max_len: int) -> tuple[int, ...]:
    """The padded lengths of fixed-shape search: 64, 128, ... below max_len, then max_len."""
    return tuple(64 << k for k in range(max_len.bit_length()) if 64 << k < max_len) + (max_len,)


def source_batches(src_ids: Sequence[Sequence[int]], max_len: int, token_budget: int,
                   batch_size: int | None = None, fixed: bool = False) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(indices, padded src (B, L)) per batch, by length bucket, sorted, filler rows -1; `fixed`: `fixed_lengths`."""
    if batch_size is not None:  # 0 would mean the default, -3 one sentence: silently
        POSITIVE.check("batch_size", batch_size)
    buckets = fixed_lengths(max_len) if fixed else bucket_lengths(max_len)
    ids = [list(s) if len(s) <= max_len else [*s[: max_len - 1], EOS_ID] for s in src_ids]
    lengths = np.array([len(s) for s in ids], dtype=np.int64)
    bucket_of = np.searchsorted(buckets, lengths)
    for b, length in enumerate(buckets):
        members = np.flatnonzero(bucket_of == b)
        members = members[np.argsort(lengths[members], kind="stable")]
        if not len(members):
            continue
        # Rows: the budget's, at most the power of two above the bucket's sentences (3 do not run as 512 rows).
        fewest = token_budget if fixed else 1 << (len(members) - 1).bit_length()
        size = max(1, min(token_budget // length, batch_size or token_budget, fewest))
        for start in range(0, len(members), size):
            chunk = members[start : start + size]
            src = np.full((size, length), PAD_ID, np.int32)  # (B, L)
            for row, i in enumerate(chunk):
                src[row, : len(ids[i])] = ids[i]
            yield np.pad(chunk, (0, size - len(chunk)), constant_values=-1), src
