"""A corpus tokenized once (`TokenStore`), built whole or not at all (docs/operations.md#the-corpus-store)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import itertools
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import xxhash
from tqdm.auto import tqdm

from ..runtime.files import UserError, say
from .corpora import RACY_S
from .vocab import Tokenizers, encode

FORMAT = "aiayn-token-store/2"
MANIFEST = "store.json"
SIDES = ("src", "tgt")
CHUNK = 20_000  # pairs per encode_batch call: the tokenizer's threads busy, a bounded buffer
HEADER = 128  # bytes of a 1-D .npy header (format 1.0), whatever the array's length
_VERIFIED: set[tuple] = set()  # the stores this process has digested, with their files' stat: read once
LINE_EVERY_S = 5.0  # seconds between two progress lines where no bar is drawn: a log stays short, a stall shows


def meter(desc: str, total: int | None = None, bar: bool = True):
    """Progress counted in pairs: tqdm's bar when `bar`, else a line every LINE_EVERY_S seconds and one at the end."""
    if bar and sys.stderr.isatty():
        return tqdm(total=total, desc=desc, unit=" pairs", dynamic_ncols=True)
    return _Lines(desc, total)


class _Lines:
    """A bar's figures as lines, flushed (a log followed as it grows): pairs done of the total, rate, time left."""

    def __init__(self, desc: str, total: int | None):
        self.desc, self.total, self.n, self.told = desc, total, 0, None
        self.start = self.shown = time.monotonic()
        tell(f"{desc}: {total:,} pairs" if total else f"{desc}...")

    def update(self, n: int) -> None:
        self.n += n
        if time.monotonic() - self.shown >= LINE_EVERY_S:
            self.shown, self.told = time.monotonic(), self.n
            tell(self.line())

    def line(self) -> str:
        elapsed, total = time.monotonic() - self.start, self.total
        rate = self.n / max(elapsed, 1e-9)
        done = f"{self.n:,}/{total:,} pairs ({self.n / total:.0%})" if total else f"{self.n:,} pairs"
        left = f", {tqdm.format_interval((total - self.n) / rate)} left" if total and rate and self.n < total else ""
        return f"{self.desc}: {done}, {rate:,.0f} pairs/s, {tqdm.format_interval(elapsed)} elapsed{left}"

    def __enter__(self) -> _Lines:
        return self

    def __exit__(self, kind, *_) -> None:
        if kind is None and self.told != self.n:  # the last count, once
            tell(self.line())


def tell(text: str) -> None:
    """A line of what the data's preparation is doing, on standard output now, even when it is a pipe."""
    say(text)
    sys.stdout.flush()


class TokenStore:
    """Flat token ids of both sides, each pair's lengths and start offsets (arrays or memory maps); `digest`."""

    def __init__(self, arrays: dict[str, np.ndarray], digest: str | None = None, skipped: int = 0):
        self.arrays, self.skipped = arrays, skipped  # skipped: pairs with an empty side, left out
        self.digest = digest or xxhash.xxh3_128_hexdigest(b"".join(arrays[k].tobytes() for k in sorted(arrays)))
        self.__dict__.update(arrays)  # store.src_len for store.arrays["src_len"]

    def __len__(self) -> int:
        return len(self.src_len)

    @classmethod
    def from_pairs(cls, examples: Iterable[tuple[Iterable[int], Iterable[int]]]) -> TokenStore:
        """A store in memory from (source ids, target ids) pairs."""
        examples = list(examples)
        arrays = {}
        for k, side in enumerate(SIDES):
            rows = [np.asarray(pair[k], np.int32).reshape(-1) for pair in examples]
            lengths = np.array([len(r) for r in rows], np.int32)
            arrays[side] = np.concatenate(rows) if rows else np.zeros(0, np.int32)
            arrays[f"{side}_len"], arrays[f"{side}_start"] = lengths, _starts(lengths)
        return cls(arrays)

    def gather(self, side: str, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the ids of pairs `idx` one after another, their lengths) on `side`."""
        starts, lengths = self.arrays[f"{side}_start"][idx], self.arrays[f"{side}_len"][idx].astype(np.int64)
        before = np.cumsum(lengths) - lengths  # where each pair begins in the output
        positions = np.repeat(starts - before, lengths) + np.arange(int(lengths.sum()))
        return np.asarray(self.arrays[side][positions]), lengths


def _starts(lengths: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Each pair's offset in the flat ids: 0, then the running sum of the lengths before it."""
    out = np.empty(len(lengths), np.int64) if out is None else out
    out[:1] = 0
    np.cumsum(lengths[:-1], out=out[1:])
    return out


def tokenizers_digest(tokenizers: Tokenizers) -> str:
    """A digest of what the tokenizers do (their serialized form; SentencePiece: models and pieces)."""
    h = hashlib.sha256()
    for tok in (tokenizers.src, tokenizers.tgt):
        if hasattr(tok, "to_str"):
            h.update(tok.to_str().encode())
        else:
            h.update(tok.model + tok.decode_model + "\n".join(tok.pieces).encode())
    return h.hexdigest()


def cache_dir(hf_cache: str | None = None) -> Path:
    """Where stores live: `$AIAYN_DATA_CACHE`, else `aiayn-corpora/` in --hf-cache, else in HF's datasets cache."""
    if os.environ.get("AIAYN_DATA_CACHE") and hf_cache is None:
        return Path(os.environ["AIAYN_DATA_CACHE"])
    hf_home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    return Path(hf_cache or os.environ.get("HF_DATASETS_CACHE") or hf_home / "datasets") / "aiayn-corpora"


def corpus_store(root: Path, data_digest: str, tokenizers: Tokenizers, pairs: Iterable[tuple[str, str]],
                 name: str = "corpus", progress: bool = True, total: int | None = None, skipped=None) -> TokenStore:
    """The store of `data_digest` by `tokenizers` under `root`: opened, else built from `pairs`."""
    key = hashlib.sha256(f"{FORMAT}\n{data_digest}\n{tokenizers_digest(tokenizers)}".encode()).hexdigest()[:32]
    path = root / key
    if not (path / MANIFEST).is_file():
        root.mkdir(parents=True, exist_ok=True)
        with open(root / f".{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # a second build of the key waits, then opens the first's store
            if not (path / MANIFEST).is_file():
                _remove_stale(root, key)
                if path.exists():  # stores are renamed into place whole: this one lost its manifest since
                    say(f"corpus store {path} has no {MANIFEST} (deleted?): building it again")
                    shutil.rmtree(path)
                build_store(path, pairs, tokenizers, key, name, progress, total, skipped)
    return open_store(path, key)


def _remove_stale(root: Path, key: str) -> None:  # killed builds' temporary directories: of `key`, of unlocked keys
    for tmp in root.glob(".*.tmp-*"):
        owner = re.fullmatch(r"\.([0-9a-f]{32})\.tmp-.*", tmp.name)  # a store's (tokenizers' take no lock)
        if not owner:
            continue
        with open(root / f".{owner[1]}.lock", "a") as lock, contextlib.suppress(BlockingIOError):
            if owner[1] != key:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: being built now
            shutil.rmtree(tmp, ignore_errors=True)


def build_store(path: Path, pairs: Iterable[tuple[str, str]], tokenizers: Tokenizers, key: str = "",
                name: str = "corpus", progress: bool = True, total: int | None = None, skipped=None) -> None:
    """Tokenize `pairs` chunk by chunk into a new store at `path`, built beside it and renamed into place."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    ids = np.uint16 if max(tok.get_vocab_size() for tok in (tokenizers.src, tokenizers.tgt)) <= 1 << 16 else np.int32
    kinds = {"src": ids, "tgt": ids, "src_len": np.int32, "tgt_len": np.int32}  # uint16 ids: half the bytes
    try:
        with contextlib.ExitStack() as stack:
            files = {name_: stack.enter_context(open(tmp / f"{name_}.npy", "wb")) for name_ in kinds}
            for f in files.values():
                f.seek(HEADER)  # the header is written last, when the length is known
            counts = dict.fromkeys(files, 0)
            bar = stack.enter_context(meter(f"tokenizing {name} into its store", total, progress))
            pairs = iter(pairs)
            while chunk := list(itertools.islice(pairs, CHUNK)):
                for side, tok, texts in zip(SIDES, (tokenizers.src, tokenizers.tgt), zip(*chunk)):
                    rows = encode(tok, texts)  # as every other text is encoded
                    lengths = np.fromiter(map(len, rows), np.int32, len(rows))
                    flat = np.fromiter(itertools.chain.from_iterable(rows), kinds[side], int(lengths.sum()))
                    for array, name_ in ((flat, side), (lengths, f"{side}_len")):
                        files[name_].write(array.tobytes())
                        counts[name_] += len(array)
                bar.update(len(chunk))
            for name_, f in files.items():  # the headers now say how long the arrays are
                f.seek(0)
                f.write(_npy_header(counts[name_], kinds[name_]))
        for side in SIDES:  # written in place: no array of the corpus's size in memory
            lengths = np.load(tmp / f"{side}_len.npy", mmap_mode="r")
            starts = np.lib.format.open_memmap(tmp / f"{side}_start.npy", "w+", np.int64, (len(lengths),))
            _starts(lengths, starts).flush()
            del starts
        manifest = {"format": FORMAT, "key": key, "pairs": counts["src_len"], "skipped": skipped() if skipped else 0,
                    "tokens": {s: counts[s] for s in SIDES},
                    "files": {p.name: p.stat().st_size for p in sorted(tmp.iterdir())},
                    "xxh3_128": {p.name: _file_digest(p) for p in sorted(tmp.iterdir())}}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        os.rename(tmp, path)
    except OSError as err:
        err.filename = err.filename or str(path)  # a write names no file (a full disk): the store's directory
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def open_store(path: Path, key: str | None = None) -> TokenStore:
    """The store at `path`, memory-mapped; UserError in one line when its files do not match its manifest."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        stats = {p.name: p.stat() for p in path.iterdir() if p.name != MANIFEST}
        sizes = {name: stat.st_size for name, stat in stats.items()}
        seen = (str(path), *sorted((n, s.st_size, s.st_mtime_ns, s.st_ctime_ns, s.st_ino) for n, s in stats.items()))
        bad = manifest.get("format") != FORMAT or (key is not None and manifest.get("key") != key) or \
            sizes != manifest["files"] or (seen not in _VERIFIED and any(
                _file_digest(path / name) != digest for name, digest in manifest["xxh3_128"].items()))
        # Plain arrays over the maps: np.memmap's own indexing adds checks to every gather.
        arrays = {} if bad else {p[:-4]: np.asarray(np.load(path / p, mmap_mode="r")) for p in sizes}
        bad = bad or any(
            len(arrays[f"{s}_len"]) != manifest["pairs"] or len(arrays[s]) != manifest["tokens"][s]
            or len(arrays[f"{s}_start"]) != manifest["pairs"] for s in SIDES)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(f"corpus store {path} is unreadable ({err}): delete it and run again to rebuild it") from None
    if bad:
        raise UserError(f"corpus store {path} does not match its manifest (truncated or changed): delete it and run "
                        "again to rebuild it")
    if time.time() - max(max(s.st_mtime, s.st_ctime) for s in stats.values()) > RACY_S:  # else may change unseen
        _VERIFIED.add(seen)
    return TokenStore(arrays, manifest["key"], manifest.get("skipped", 0))


def _file_digest(path: Path) -> str:
    """xxh3-128 of a file's bytes: not cryptographic, a check against damage at memory speed."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, xxhash.xxh3_128).hexdigest()


def _npy_header(length: int, dtype) -> bytes:
    """A 1-D .npy header of HEADER bytes."""
    buf = io.BytesIO()
    header = {"descr": np.dtype(dtype).str, "fortran_order": False, "shape": (length,)}
    np.lib.format.write_array_header_1_0(buf, header)
    assert len(buf.getvalue()) == HEADER
    return buf.getvalue()

