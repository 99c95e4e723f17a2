"""A run's train/validation/test pairs from its experiment: the numbers corpus or data specs."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from ..config import ExperimentConfig
from ..runtime.files import UserError, quoted, say
from .corpora import Pair, load_parallel, stream_parallel
from .corpus_store import TokenStore, cache_dir, corpus_store, meter, tell
from .numbers import Splits, numbers_corpus, numbers_range
from .vocab import Tokenizers, encode_pairs, load_tokenizers, sample, save_tokenizers, train_tokenizers

PAIRS_FILE = "pairs.txt"  # beside a corpus's tokenizers: how many pairs it holds
MAX_SPEC = 4096  # characters of a data spec: PATH_MAX, with room for SRC:TGT: and #src=..,tgt=..


def load_splits(cfg: ExperimentConfig, train: bool = True) -> Splits:
    """Train, validation and test pairs (lowercased with --lowercase); `train=False`: --train left to `train_store`."""
    if cfg.uses_numbers_corpus:
        splits = numbers_corpus(cfg.numbers_train, cfg.numbers_valid, cfg.numbers_test, seed=cfg.seed)
    else:
        splits = Splits(*(load_split(cfg, spec) if spec and (train or k) else []
                          for k, spec in enumerate((cfg.train, cfg.valid, cfg.test))))
    return Splits(*(list(_lowered(cfg, pairs)) for pairs in (splits.train, splits.valid, splits.test)))


def load_split(cfg: ExperimentConfig, spec: str) -> list[Pair]:
    """Pairs of one data spec, of `numbers:train|valid|test`, the run's numbers corpus split, or of
    `numbers:FIRST-LAST[/STEP]`, every (STEP-th) number from FIRST to LAST (0..999,999)."""
    with _loading(spec):  # its length checked first, a numbers: spec's too
        if spec.startswith("numbers:"):
            return _numbers_split(cfg, spec)
        loaded = load_parallel(spec, cache_dir=cfg.hf_cache)
    _check_pairs(spec, len(loaded.pairs), loaded.skipped_empty)
    return loaded.pairs


def _numbers_split(cfg: ExperimentConfig, spec: str) -> list[Pair]:
    name = spec.partition(":")[2]
    if bounds := re.fullmatch(r"(\d+)-(\d+)(?:/(\d+))?", name):
        try:
            return numbers_range(int(bounds[1]), int(bounds[2]), int(bounds[3] or 1))
        except ValueError as err:
            raise UserError(f"{spec}: {err}") from None
    if name not in ("train", "valid", "test"):
        raise UserError(f"expected numbers:train, numbers:valid, numbers:test or numbers:FIRST-LAST[/STEP], "
                        f"got {spec!r}")
    return getattr(numbers_corpus(cfg.numbers_train, cfg.numbers_valid, cfg.numbers_test, seed=cfg.seed), name)


def train_store(cfg: ExperimentConfig, tokenizers: Tokenizers, pairs: list[Pair] | None = None,
                progress: bool = True) -> TokenStore:
    """The training pairs tokenized: a --train spec's store on disk (opened or built), the numbers corpus in memory."""
    if cfg.uses_numbers_corpus or cfg.train.startswith("numbers:"):
        return TokenStore.from_pairs(encode_pairs(tokenizers, load_splits(cfg).train if pairs is None else pairs))
    with _loading(cfg.train):
        root, digest, stream = _training_stream(cfg)
        stored = corpus_store(root, f"{digest}#lowercase={cfg.lowercase}", tokenizers, _lowered(cfg, stream),
                              name=cfg.train, progress=progress and cfg.progress,
                              total=_counted(_tokenizers_path(cfg, root, digest)), skipped=lambda: stream.skipped)
    _check_pairs(cfg.train, len(stored), stored.skipped)  # counted when the store was built
    return stored


def corpus_tokenizers(cfg: ExperimentConfig) -> Tokenizers:
    """Tokenizers trained on a --train spec streamed, kept beside its stores: a second run does not train them again."""
    with _loading(cfg.train):
        root, digest, stream = _training_stream(cfg)
    path = _tokenizers_path(cfg, root, digest)
    with contextlib.suppress(FileNotFoundError, ValueError):  # none yet, or damaged: train them (again)
        return load_tokenizers(path, cfg.joint_vocab)
    with _loading(cfg.train), meter(f"reading {cfg.train} for the tokenizers' sample", bar=cfg.progress) as bar:
        pairs = sample(_counting(_lowered(cfg, stream), bar), cfg.tokenizer_sample)
    if not pairs:
        _check_pairs(cfg.train, 0, stream.skipped)
    kind = "one joint tokenizer" if cfg.joint_vocab else "a tokenizer a side"
    tell(f"training {kind} (byte-level BPE, up to {cfg.vocab_size:,} tokens) on {len(pairs):,} of "
         f"{stream.read:,} pairs")
    start = time.monotonic()
    tokenizers = train_tokenizers(pairs, vocab_size=cfg.vocab_size, joint=cfg.joint_vocab, lowercase=cfg.lowercase,
                                  sample_size=cfg.tokenizer_sample)
    tell(f"tokenizers trained in {time.monotonic() - start:.1f} s")
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=root))
    try:
        save_tokenizers(tokenizers, tmp)
        (tmp / PAIRS_FILE).write_text(f"{stream.read}\n")  # the store's build then shows its total and time left
        shutil.rmtree(path, ignore_errors=True)
        with contextlib.suppress(OSError):  # whole or absent; another process's identical copy may have won the race
            os.rename(tmp, path)
    finally:  # a failed save (a full disk) leaves no temporary directory
        shutil.rmtree(tmp, ignore_errors=True)
    return tokenizers


def _tokenizers_path(cfg: ExperimentConfig, root: Path, digest: str) -> Path:
    settings = [digest, cfg.vocab_size, cfg.joint_vocab, cfg.lowercase, cfg.tokenizer_sample]
    return root / ("tokenizers-" + hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:32])


def _counting(pairs, bar, every: int = 10_000):  # the pairs, counted on `bar` every `every` of them
    count = 0
    for count, pair in enumerate(pairs, start=1):
        if count % every == 0:
            bar.update(every)
        yield pair
    bar.update(count % every)


def _counted(path: Path) -> int | None:  # the pairs the tokenizers' sample read, when they were trained here
    with contextlib.suppress(OSError, ValueError):
        return int((path / PAIRS_FILE).read_text())
    return None


@contextlib.contextmanager
def _loading(spec: str):  # a spec too long for a path, a missing file or bad data: one UserError naming the spec
    if len(spec) > MAX_SPEC:  # quoted whole, it would flood the message
        raise UserError(f"data spec {quoted(spec)} is {len(spec):,} characters long: no file has such a name")
    try:
        yield
    except (FileNotFoundError, ValueError) as err:
        raise UserError(f"cannot load {spec!r}: {err}") from None


def _check_pairs(spec: str, kept: int, skipped: int) -> None:  # no pair: an error; pairs skipped: a line
    if not kept:
        why = f" ({skipped} skipped: a side is empty)" if skipped else ""
        raise UserError(f"{spec!r} holds no sentence pairs{why}")
    if skipped:
        say(f"{spec}: skipped {skipped} of {skipped + kept} pairs with an empty side")


def _training_stream(cfg: ExperimentConfig):  # within _loading(cfg.train)
    root = cache_dir(cfg.hf_cache)
    root.mkdir(parents=True, exist_ok=True)
    digest, stream = stream_parallel(cfg.train, cache_dir=cfg.hf_cache, memo=root / "file-digests.json")
    return root, digest, stream


def _lowered(cfg: ExperimentConfig, pairs):
    return ((s.lower(), t.lower()) for s, t in pairs) if cfg.lowercase else pairs
