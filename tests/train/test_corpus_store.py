"""The corpus store (train/data/corpus_store.py) and batches planned from its lengths (train/data/batches.py).

- The batches are main's: digests of every batch of main's (list-based) Batcher at 7b321f9 for the
  numbers corpus and Multi30k, bucketed and packed, are reproduced from a store on disk;
- a process's share of each batch is that batch's rows, with the global batch's token counts;
- a store is built once, opened in place after, and truncated, concurrent or changed-corpus cases
  are refused or rebuilt, never read wrong.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import multiprocessing
import os
import signal
import time

import numpy as np
import pytest

from train import data
from train.config import ExperimentConfig
from train.data import corpus_store as store_mod
from train.runtime import UserError


def _digest(batches) -> tuple[int, str]:
    h, n = hashlib.sha256(), 0
    for b in batches:
        for a in (b.src, b.tgt_in, b.tgt_out, b.ids, b.src_segments, b.tgt_segments):
            if a is not None:
                h.update(str(a.shape).encode())
                h.update(np.ascontiguousarray(a).tobytes())
        h.update(f"{b.num_src_tokens},{b.num_tgt_tokens}".encode())
        n += 1
    return n, h.hexdigest()[:16]


def _check(examples, expected: dict, max_len: int) -> None:
    """Epoch 0 and 3 batches of epoch 1 through next(), and epoch 2 through epoch_batches, against
    the digests main's Batcher gave (tests/train/test_corpus_store.py's _digest, computed at 7b321f9)."""
    for (pack, budget, seed, multiple_of), (count, first, second) in expected.items():
        batcher = data.Batcher(examples, token_budget=budget, max_len=max_len, seed=seed, pack=pack,
                               multiple_of=multiple_of)
        taken = [next(batcher) for _ in range(batcher.num_batches + 3)]
        assert (_digest(taken), batcher.state()) == ((count, first), {"epoch": 1, "index": 3})
        assert _digest(batcher.epoch_batches(2))[1] == second


def _store(tmp_path, tokenizers, pairs):
    return store_mod.corpus_store(tmp_path / "cache", "digest-of-test-data", tokenizers, pairs, name="test")


@pytest.fixture(scope="module")
def numbers():
    splits = data.numbers_corpus(2000, 10, 0, seed=3)
    return splits.train, data.train_tokenizers(splits.train, vocab_size=400)


def test_numbers_batches_are_mains(numbers, tmp_path):
    pairs, tokenizers = numbers
    stored = _store(tmp_path, tokenizers, pairs)
    assert (stored.src_len.base is not None or isinstance(stored.src_len, np.memmap))  # read in place
    # (pack, budget, seed, multiple_of): (batches, digest, epoch 2's digest), from main's Batcher
    _check(stored, {(False, 512, 3, 1): (48, "24807cf0eeb323e1", "08638f4678aa475f"),
                    (False, 512, 4, 2): (48, "485e374d4b9eaee4", "09ed409a1105d56a"),
                    (True, 512, 3, 1): (34, "f74f97711c0d737d", "9a5cff8405b603e4"),
                    (True, 512, 4, 2): (34, "739b2b9ff1ff306f", "4d057529632220b3")}, max_len=16)
    evaluation = data.Batcher(data.encode_pairs(tokenizers, pairs), token_budget=512, max_len=16, shuffle=False)
    assert _digest(evaluation.epoch_batches()) == (45, "0571ef82a788dfaf")


def test_multi30k_batches_are_mains(multi30k, tmp_path):
    pairs = data.load_parallel(f"de:en:{multi30k}/train").pairs
    tokenizers = data.train_tokenizers(pairs, vocab_size=8000)
    _check(_store(tmp_path, tokenizers, pairs),
           {(False, 4096, 1, 2): (148, "fbbdad2fb724508f", "0efa4e164f6fe1cf"),
            (False, 25000, 1, 1): (30, "e61f4d01fe11b4ac", "678ab56c5375421b"),
            (True, 4096, 1, 2): (122, "87724e1cf72d5460", "453d2b86f4db39a7"),
            (True, 25000, 1, 1): (23, "65fec1e6e55e50d9", "81edc4c3085ec2b1")}, max_len=128)


def _first_fit_item_by_item(src_len, tgt_len, size: int, length: int) -> list[list[list[int]]]:
    """main's packing at 7b321f9, pair by pair: each pair to the first row of the batch it fits, else it
    waits; a batch closes when `size` pairs wait, and they come first in the next one."""
    queue, batches = list(range(len(src_len))), []
    while queue:
        free, rows, waiting, reached = [[length, length] for _ in range(size)], [[] for _ in range(size)], [], 0
        for k in queue:
            reached += 1
            row = next((r for r, (s, t) in enumerate(free) if s >= src_len[k] and t >= tgt_len[k]), None)
            if row is None:
                waiting.append(k)
                if len(waiting) == size:
                    break
                continue
            rows[row].append(k)
            free[row] = [free[row][0] - src_len[k], free[row][1] - tgt_len[k]]
        queue = waiting + queue[reached:]
        batches.append([row for row in rows if row])
    return batches


@pytest.mark.parametrize("size,length,longest", [(1, 8, 8), (3, 16, 16), (32, 64, 40), (195, 128, 100)])
def test_packed_plan_is_first_fit_pair_by_pair(size, length, longest):
    """Batcher packs row by row over bit sets (train.data.batches._first_fit): the same batches as
    placing one pair at a time, on lengths like Multi30k's and WMT's (sources and targets alike) and
    skewed ones (long sources, short targets) that make pairs wait."""
    rng = np.random.default_rng(size)
    n = 40 * size + 7
    src = rng.integers(1, longest + 1, n)
    tgt = np.clip(src + rng.integers(-3, 4, n), 1, longest)
    tgt[::5] = rng.integers(1, 4, len(tgt[::5]))
    store = data.TokenStore({"src_len": src.astype(np.int32), "tgt_len": tgt.astype(np.int32)})
    batcher = data.Batcher(store, token_budget=size * length, max_len=length, pack=True, pack_length=length)
    order = rng.permutation(n)
    expected = _first_fit_item_by_item(src[order].tolist(), tgt[order].tolist(), size, length)
    got = batcher._packed(order)
    assert [ids.tolist() for ids in got] == [[[*order[row], *[-1] * (max(map(len, rows)) - len(row))] for row in rows]
                                             for rows in expected]


@pytest.mark.parametrize("pack", [False, True])
def test_a_corpus_of_several_windows_is_planned_a_window_at_a_time(numbers, pack, monkeypatch):
    """WINDOW cut to 256 pairs (2,000 numbers: 8 windows): every kept pair once an epoch, each window's pairs
    spread over the corpus, epochs in other orders, `next` resumed mid-epoch from `state()` continuing alike."""
    pairs, tokenizers = numbers
    examples = data.encode_pairs(tokenizers, pairs[:1500])
    whole = data.Batcher(examples, token_budget=256, max_len=16, seed=5, pack=pack)  # one window
    kept = sorted(np.concatenate([b.ids[b.ids >= 0] for b in whole.epoch_batches()]).tolist())
    monkeypatch.setattr(data.batches, "WINDOW", 256)
    batcher = data.Batcher(examples, token_budget=256, max_len=16, seed=5, pack=pack)
    assert (batcher.windows, batcher.num_dropped, whole.num_dropped) == (6, 1500 - len(kept), 1500 - len(kept))
    assert 0 < batcher.num_dropped < 100  # pairs longer than 16 tokens
    epochs = [[b.ids[b.ids >= 0] for b in batcher.epoch_batches(e)] for e in range(2)]
    for batches in epochs:
        assert sorted(np.concatenate(batches).tolist()) == kept
    assert [b.tolist() for b in epochs[0]] != [b.tolist() for b in epochs[1]]
    first = sorted(np.concatenate([idx[idx >= 0] for _, idx in batcher._window_plan(0, 0)]).tolist())
    assert len(first) > 200 and first[-1] - first[0] > 1200  # 256 pairs less the dropped, spread over the corpus
    actual = sum(1 for _ in batcher.epoch_batches(0))
    assert abs(batcher.num_batches - actual) <= 0.15 * actual  # an estimate from the first window
    taken = [next(batcher) for _ in range(actual + 5)]
    assert batcher.state() == {"epoch": 1, "index": 5}
    again = data.Batcher(examples, token_budget=256, max_len=16, seed=5, pack=pack)
    again.restore({"epoch": 0, "index": actual - 3})
    for want in taken[actual - 3:]:
        np.testing.assert_array_equal(next(again).src, want.src)


def test_a_first_window_of_dropped_pairs_is_not_an_empty_corpus(numbers, monkeypatch):
    """Unshuffled, windows are consecutive: 256 pairs too long, then 300 that fit."""
    monkeypatch.setattr(data.batches, "WINDOW", 256)
    pairs, tokenizers = numbers
    short = [ids for ids in data.encode_pairs(tokenizers, pairs) if max(map(len, ids)) <= 16][:300]
    examples = data.encode_pairs(tokenizers, [(pairs[0][0] + " und" * 20, "x")]) * 256 + short
    batcher = data.Batcher(examples, token_budget=256, max_len=16, shuffle=False)
    assert (batcher.windows, batcher.num_dropped) == (3, 256) and batcher.num_batches >= 1
    assert sorted(np.concatenate([b.ids[b.ids >= 0] for b in batcher.epoch_batches()]).tolist()) == list(
        range(256, 556))
    assert next(batcher).ids.max() >= 256  # next() passes over the empty first window


@pytest.mark.parametrize("pack", [False, True])
def test_process_shares_are_the_batch_rows(numbers, pack):
    pairs, tokenizers = numbers
    examples = data.encode_pairs(tokenizers, pairs)
    whole = data.Batcher(examples, token_budget=512, max_len=16, seed=1, pack=pack, multiple_of=2)
    shares = [data.Batcher(examples, token_budget=512, max_len=16, seed=1, pack=pack, multiple_of=2, process=(i, 2))
              for i in range(2)]
    for _ in range(whole.num_batches + 2):
        batch, parts = next(whole), [next(s) for s in shares]
        for name in ("src", "tgt_in", "tgt_out", "ids", "src_segments", "tgt_segments"):
            if getattr(batch, name) is not None:
                np.testing.assert_array_equal(np.concatenate([getattr(p, name) for p in parts]), getattr(batch, name))
        assert {(p.num_src_tokens, p.num_tgt_tokens, p.global_rows) for p in parts} == {
            (batch.num_src_tokens, batch.num_tgt_tokens, len(batch.src))}
    with pytest.raises(ValueError, match="cannot be split over 3 processes"):
        data.Batcher(examples, token_budget=512, max_len=16, multiple_of=2, process=(0, 3))


def test_store_holds_the_encoded_pairs(numbers, tmp_path):
    pairs, tokenizers = numbers
    stored = _store(tmp_path, tokenizers, iter(pairs[:300]))  # any iterable: read once, chunk by chunk
    expected = data.encode_pairs(tokenizers, pairs[:300])
    idx = np.array([299, 0, 17, 17])
    for k, side in enumerate(("src", "tgt")):
        values, lengths = stored.gather(side, idx)
        rows = [expected[i][k] for i in idx]
        assert lengths.tolist() == [len(r) for r in rows] and values.tolist() == [t for r in rows for t in r]
    # Opened again: the same directory, nothing rebuilt (a callable is not even called).
    again = _store(tmp_path, tokenizers, lambda: pytest.fail("rebuilt"))
    assert np.array_equal(again.src, stored.src) and len(list((tmp_path / "cache").iterdir())) == 2  # store + lock


def test_a_store_encodes_typed_special_tokens_as_text(numbers, tmp_path):
    pairs, tokenizers = numbers
    data.save_tokenizers(tokenizers, tmp_path / "tok")
    typed = [("eins <eos> zwei", "<pad> one <unk>")]
    stored = _store(tmp_path, data.load_tokenizers(tmp_path / "tok"), typed)  # a tokenizer data.encode never saw
    [(src, tgt)] = data.encode_pairs(tokenizers, typed)
    assert 2 not in src[:-1] and 0 not in tgt  # <eos> only at the end, no <pad>: the typed ones are text
    assert [stored.gather(side, np.array([0]))[0].tolist() for side in ("src", "tgt")] == [src, tgt]


def test_damaged_store_is_refused(numbers, tmp_path):
    pairs, tokenizers = numbers
    _store(tmp_path, tokenizers, pairs[:100])
    [path] = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    manifest = (path / "store.json").read_text()
    (path / "store.json").write_text(manifest.replace(path.name, "another-corpus"))  # another key's store moved here
    with pytest.raises(UserError, match=r"^corpus store .* does not match its manifest"):
        _store(tmp_path, tokenizers, pairs[:100])
    (path / "store.json").write_text(manifest)
    assert len(_store(tmp_path, tokenizers, pairs[:100])) == 100
    with open(path / "src.npy", "r+b") as f:  # one bit of a token flipped, the size unchanged
        f.seek(-3, 2)
        flipped = f.read(1)[0] ^ 1
        f.seek(-3, 2)
        f.write(bytes([flipped]))
    with pytest.raises(UserError, match=r"^corpus store .* does not match its manifest") as refused:
        _store(tmp_path, tokenizers, pairs[:100])
    assert "\n" not in str(refused.value)
    with open(path / "src.npy", "r+b") as f:
        f.seek(-3, 2)
        f.write(bytes([flipped ^ 1]))
    assert len(_store(tmp_path, tokenizers, pairs[:100])) == 100  # the byte put back
    with open(path / "tgt.npy", "r+b") as f:  # truncated: the last tokens lost
        f.truncate(f.seek(0, 2) - 8)
    with pytest.raises(UserError, match=r"^corpus store .* does not match its manifest .*delete it"):
        _store(tmp_path, tokenizers, pairs[:100])
    (path / "store.json").write_text("{")
    with pytest.raises(UserError, match=r"^corpus store .* is unreadable"):
        _store(tmp_path, tokenizers, pairs[:100])


def test_interrupted_build_leaves_no_store(numbers, tmp_path):
    pairs, tokenizers = numbers

    def broken():
        yield from pairs[:10]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _store(tmp_path, tokenizers, broken())
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [next((tmp_path / "cache").iterdir()).name]
    assert next((tmp_path / "cache").iterdir()).name.endswith(".lock")  # no store, no temporary directory
    assert len(_store(tmp_path, tokenizers, pairs[:10])) == 10  # the next run builds it


def test_a_store_is_digested_once_a_process(numbers, tmp_path, monkeypatch):
    pairs, tokenizers = numbers
    stored = _store(tmp_path, tokenizers, pairs[:100])
    assert stored.src.dtype == np.uint16 and stored.tgt.dtype == np.uint16  # a vocabulary of 400 ids
    _store(tmp_path, tokenizers, pairs[:100])  # its files written just now: digested again (they may change unseen)
    monkeypatch.setattr(store_mod, "RACY_S", -1)  # as if written long ago
    _store(tmp_path, tokenizers, pairs[:100])
    monkeypatch.setattr(store_mod, "_file_digest", lambda path: pytest.fail("digested twice"))
    assert len(_store(tmp_path, tokenizers, pairs[:100])) == 100


def test_file_digests_are_not_remembered_past_a_rewrite(tmp_path, monkeypatch):
    """The memo of file digests is keyed by the change time too: a rewrite that keeps the size and puts
    the modification time back is read again; a file written within RACY_S seconds is not remembered."""
    path, memo = tmp_path / "c.de", tmp_path / "digests.json"
    path.write_text("eins\n")
    one = hashlib.sha256(b"eins\n").hexdigest().encode()  # the digest of the file's digests
    assert data.corpora.file_digest([path], memo) == hashlib.sha256(one).hexdigest()
    assert not memo.exists()  # written just now
    monkeypatch.setattr(data.corpora, "RACY_S", -1)
    first = data.corpora.file_digest([path], memo)
    assert len(json.loads(memo.read_text())) == 1
    written = path.stat()
    time.sleep(0.05)  # past the kernel's clock tick for file times (at most 10 ms)
    path.write_text("zwei\n")
    os.utime(path, ns=(written.st_atime_ns, written.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (written.st_size, written.st_mtime_ns)
    assert data.corpora.file_digest([path], memo) != first


def _killed_build(cache, tokenizers_dir, pairs, digest, started):
    def stalled():
        yield from pairs
        started.set()
        time.sleep(120)  # killed meanwhile

    store_mod.corpus_store(cache, digest, data.load_tokenizers(tokenizers_dir), stalled(), name="test")


def test_a_build_removes_what_killed_builds_left(numbers, tmp_path):
    """SIGKILL leaves a build's temporary directory; the next build removes those of its own key and
    of keys no process is building, and leaves one whose build holds its lock."""
    pairs, tokenizers = numbers
    data.save_tokenizers(tokenizers, tmp_path / "tok")
    cache = tmp_path / "cache"
    fork = multiprocessing.get_context("fork")
    for digest in ("another-corpus", "digest-of-test-data"):
        started = fork.Event()
        build = fork.Process(target=_killed_build, args=(cache, tmp_path / "tok", pairs[:10], digest, started))
        build.start()
        assert started.wait(30)
        os.kill(build.pid, signal.SIGKILL)
        build.join(30)
        assert len(list(cache.glob(".*.tmp-*"))) == 1  # the second build removed the first's (another key)
    (cache / f".{'f' * 32}.tmp-busy").mkdir()
    with open(cache / f".{'f' * 32}.lock", "w") as busy:
        fcntl.flock(busy, fcntl.LOCK_EX)  # that store's build is running
        assert len(_store(tmp_path, tokenizers, pairs[:10])) == 10
    assert [p.name for p in cache.glob(".*.tmp-*")] == [f".{'f' * 32}.tmp-busy"]


def _slow_build(cache, tokenizers_dir, pairs, started):
    def slowly():
        started.set()
        time.sleep(0.5)  # the other build starts meanwhile
        yield from pairs

    tokenizers = data.load_tokenizers(tokenizers_dir)
    store_mod.corpus_store(cache, "digest-of-test-data", tokenizers, slowly(), name="test")


def test_two_builds_at_once_make_one_store(numbers, tmp_path):
    pairs, tokenizers = numbers
    data.save_tokenizers(tokenizers, tmp_path / "tok")
    fork = multiprocessing.get_context("fork")
    started = fork.Event()
    other = fork.Process(target=_slow_build, args=(tmp_path / "cache", tmp_path / "tok", pairs[:50], started))
    other.start()
    assert started.wait(30)
    stored = _store(tmp_path, tokenizers, lambda: pytest.fail("built twice"))  # waits for the other's build
    other.join(30)
    assert other.exitcode == 0 and len(stored) == 50
    assert sorted(p.suffix for p in (tmp_path / "cache").iterdir()) == ["", ".lock"]


def _config(tmp_path, spec: str, **changes) -> ExperimentConfig:
    return ExperimentConfig(train=spec, valid=spec, hf_cache=str(tmp_path / "hf"), progress=False, **changes)


def _stores(tmp_path) -> list:
    return sorted(p for p in (tmp_path / "hf" / "aiayn-corpora").iterdir() if p.is_dir())


def test_text_corpus_store_follows_its_files(tmp_path, numbers):
    """Built from the files a line at a time, opened in place next time (the text only digested),
    and another store for a corpus changed under it or --lowercase."""
    _, tokenizers = numbers
    pairs = [(f"  eins {i}", f"one {i}") for i in range(30)] + [("zwei", " ")]  # the last: an empty side
    for k, lang in enumerate(("de", "en")):
        (tmp_path / f"c.{lang}").write_text("".join(p[k] + "\n" for p in pairs))
    cfg = _config(tmp_path, f"de:en:{tmp_path}/c")
    stored = data.train_store(cfg, tokenizers)
    expected = data.encode_pairs(tokenizers, data.load_parallel(cfg.train).pairs)
    assert len(stored) == 30 and stored.gather("src", np.arange(30))[0].tolist() == [i for s, _ in expected for i in s]
    again = data.train_store(cfg, tokenizers, pairs=[])  # pairs given but not needed: the store is there
    assert len(again) == 30 and len(_stores(tmp_path)) == 1
    with open(tmp_path / "c.en", "a") as f:  # the corpus changes under its store
        f.write("extra\n")
    with open(tmp_path / "c.de", "a") as f:
        f.write("mehr\n")
    assert len(data.train_store(cfg, tokenizers)) == 31 and len(_stores(tmp_path)) == 2
    assert len(data.train_store(cfg.replace(lowercase=True), tokenizers)) == 31 and len(_stores(tmp_path)) == 3
    (tmp_path / "c.de").write_text("nur eine\n")
    with pytest.raises(UserError, match=r"^cannot load .*line counts differ"):
        data.train_store(cfg, tokenizers)
    assert len(_stores(tmp_path)) == 3  # nothing of the failed build left


def _hub_build_peak(tmp_path, tokenizers, n: int) -> tuple:
    """(the store, the Python memory its build peaked at) of an hf: spec of `n` pairs (a local parquet
    dataset standing in for the hub, no network here)."""
    import tracemalloc

    import pyarrow as pa
    import pyarrow.parquet as pq

    pairs = [(f"{i} und {i % 97} sind {i * 7}", f"{i} and {i % 97} are {i * 7}") for i in range(n)]
    (tmp_path / f"hub{n}" / "data").mkdir(parents=True)
    translation = pa.array([{"de": s, "en": t} for s, t in pairs])
    pq.write_table(pa.table({"translation": translation}), tmp_path / f"hub{n}" / "data" / "train.parquet")
    cfg = _config(tmp_path, f"hf:{tmp_path}/hub{n}:train#src=de,tgt=en")
    data.corpora.stream_parallel(cfg.train, cfg.hf_cache, digest=False)  # datasets converts the parquet to Arrow
    tracemalloc.start()
    stored = data.train_store(cfg, tokenizers)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    idx = np.array([0, n // 3, n - 1])
    expected = data.encode_pairs(tokenizers, [pairs[k] for k in idx])
    assert stored.gather("tgt", idx)[0].tolist() == [i for _, t in expected for i in t]
    assert len(stored) == n and len(data.train_store(cfg, tokenizers)) == n  # opened, not rebuilt
    return stored, peak


def test_hub_corpus_streams_into_the_store(tmp_path, numbers, monkeypatch):
    """hf: specs are written into the store from datasets' memory-mapped Arrow cache a chunk at a
    time: the build's Python memory does not grow with the corpus."""
    monkeypatch.setattr(store_mod, "CHUNK", 250)
    _, small = _hub_build_peak(tmp_path, numbers[1], 2_000)  # both read in several of datasets' batches of 1,000
    _, large = _hub_build_peak(tmp_path, numbers[1], 6_000)
    # Measured 909 kB and 908 kB (datasets' batches of 1,000 rows as Python, two at a time, and a chunk);
    # held whole, 4,000 more pairs would add over 800 kB (200 bytes a pair as Python strings): 200 kB
    # leaves room for allocator noise.
    assert large < small + 200_000, (small, large)
    assert len(_stores(tmp_path)) == 2


# Two processes reading their rows from one store like one process: test_distributed.py's two-process run.


def test_a_corpus_tokenizers_are_trained_from_its_stream_once(tmp_path, monkeypatch):
    pairs = data.numbers_corpus(600, 10, 0, seed=5).train
    (tmp_path / "c.de").write_text("".join(s + "\n" for s, _ in pairs))
    (tmp_path / "c.en").write_text("".join(t + "\n" for _, t in pairs))
    monkeypatch.setenv("AIAYN_DATA_CACHE", str(tmp_path / "cache"))
    cfg = ExperimentConfig(train=f"de:en:{tmp_path}/c", valid="numbers:valid", vocab_size=300)
    first = data.corpus_tokenizers(cfg)
    # Trained on the whole corpus (smaller than the sample) in order: today's tokenizer, byte for byte.
    assert first.src.to_str() == data.train_tokenizers(pairs, vocab_size=300).src.to_str()
    monkeypatch.setattr(data.splits, "train_tokenizers", None)  # a second run must not train again
    assert data.corpus_tokenizers(cfg).src.to_str() == first.src.to_str()
    (next((tmp_path / "cache").glob("tokenizers-*")) / "tokenizer.json").write_text("{damaged")
    monkeypatch.undo()
    monkeypatch.setenv("AIAYN_DATA_CACHE", str(tmp_path / "cache"))
    assert data.corpus_tokenizers(cfg).src.to_str() == first.src.to_str()  # a damaged copy is trained again


def test_a_store_without_its_manifest_is_built_again_in_place(numbers, tmp_path, capsys):
    pairs, tokenizers = numbers
    _store(tmp_path, tokenizers, pairs[:100])
    [path] = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    (path / "store.json").unlink()
    stored = _store(tmp_path, tokenizers, pairs[:100])
    assert len(stored) == 100 and (path / "store.json").is_file()
    assert f"corpus store {path} has no store.json (deleted?): building it again" in capsys.readouterr().out
    assert [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".") and ".tmp-" in p.name] == []


def test_a_full_disk_during_the_build_names_the_store(numbers, tmp_path, monkeypatch):
    pairs, tokenizers = numbers

    def full(*args):  # the arrays' headers written last, on a full disk: an error naming no file, as write()'s
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store_mod, "_npy_header", full)
    with pytest.raises(OSError) as full:
        _store(tmp_path, tokenizers, pairs[:10])
    assert str(full.value.filename).startswith(str(tmp_path / "cache" / ""))
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == []


def test_a_failed_tokenizer_save_leaves_no_directory(tmp_path, monkeypatch):
    pairs = data.numbers_corpus(200, 10, 0, seed=5).train
    (tmp_path / "c.de").write_text("".join(s + "\n" for s, _ in pairs))
    (tmp_path / "c.en").write_text("".join(t + "\n" for _, t in pairs))
    monkeypatch.setenv("AIAYN_DATA_CACHE", str(tmp_path / "cache"))

    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(data.splits, "save_tokenizers", full)
    with pytest.raises(OSError, match="No space left"):
        data.corpus_tokenizers(ExperimentConfig(train=f"de:en:{tmp_path}/c", valid="numbers:valid", vocab_size=300))
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith(".tokenizers-")] == []


def test_every_run_says_how_many_pairs_it_skipped(tmp_path, numbers, capsys):
    _, tokenizers = numbers
    pairs = [(f"eins {i}", f"one {i}") for i in range(30)] + [("zwei", " "), ("", "three")]
    for k, lang in enumerate(("de", "en")):
        (tmp_path / f"c.{lang}").write_text("".join(p[k] + "\n" for p in pairs))
    cfg = _config(tmp_path, f"de:en:{tmp_path}/c")
    for _ in range(2):  # built, then opened
        assert len(data.train_store(cfg, tokenizers)) == 30
        assert f"de:en:{tmp_path}/c: skipped 2 of 32 pairs with an empty side" in capsys.readouterr().out


def test_a_resume_on_other_data_is_refused_naming_it(tmp_path, fast_config):
    from train import loop

    pairs = data.numbers_corpus(200, 10, 0, seed=5).train

    def write(pairs):
        for k, lang in enumerate(("de", "en")):
            (tmp_path / f"c.{lang}").write_text("".join(p[k] + "\n" for p in pairs))

    write(pairs)
    spec = f"de:en:{tmp_path}/c"
    cfg = fast_config("torch", train=spec, valid="numbers:valid", vocab_size=300, steps=1, eval_sentences=2, beam=1,
                      hf_cache=str(tmp_path / "hf"))
    loop.train(cfg)
    write(pairs[::-1])  # the same pairs, so the same batch shapes, in another order
    with pytest.raises(UserError, match=rf"^train {spec}: not the data checkpoint 1 in .* was trained on"):
        loop.train(cfg.replace(resume=True, steps=2))
    write(pairs)  # put back: it continues
    assert loop.train(cfg.replace(resume=True, steps=2))["steps"] == 2
