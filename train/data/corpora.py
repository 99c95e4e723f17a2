"""`load_parallel(spec)`: sentence pairs from local files or the datasets hub (the specs of `train.run.EPILOG`)."""

from __future__ import annotations

import codecs
import collections
import contextlib
import dataclasses
import gzip
import hashlib
import itertools
import logging
import os
import re
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from ..runtime.files import UserError, quoted, read_json, shortened, write_json_atomic
from .streams import MAX_LINE_BYTES, LineReader

log = logging.getLogger(__name__)


Pair = tuple[str, str]


@dataclasses.dataclass(frozen=True)
class LoadedPairs:
    """Sentence pairs read from a spec, and how many pairs were skipped for an empty side."""

    pairs: list[Pair]
    skipped_empty: int


# The split may slice, "train[:1000]", so its colons do not separate fields.
_HUB = re.compile(r"^hf:([^:]+):(?:([^:\[]+):)?([^:\[]+(?:\[.*\])?)$")
_TEXT_PAIR = re.compile(r"^([\w-]+):([\w-]+):(.+)$")
_TSV = (".tsv", ".tsv.gz")
_JSON = (".jsonl", ".jsonl.gz", ".json", ".json.gz")
RACY_S = 2  # seconds: coarser than any filesystem's timestamps (FAT's are 2 s), git's "racy" entries


def load_parallel(spec: str, cache_dir: str | Path | None = None) -> LoadedPairs:
    """Sentence pairs from a spec string; FileNotFoundError for a missing file, ValueError for a bad spec or data."""
    stream = stream_parallel(spec, cache_dir, digest=False)[1]
    return LoadedPairs(list(stream), stream.skipped)


def stream_parallel(spec: str, cache_dir: str | Path | None = None, digest: bool = True,
                    memo: Path | None = None) -> tuple[str, PairStream]:
    """(the data's digest ("" with digest=False), its pairs); `memo`: `file_digest`'s."""
    spec, _, options = spec.partition("#")
    cache_dir = None if cache_dir is None else str(cache_dir)
    if spec.startswith("hf:"):
        match = _HUB.match(spec)
        if not match:
            raise ValueError(f"hub spec must be hf:NAME[:CONFIG]:SPLIT, got {quoted(spec, 200)}")
        name, config, split = match.groups()
        langs = config.split("-") if config and re.fullmatch(r"\w+-\w+", config) else ("source", "target")
        src, tgt = _columns(options, *langs)
        ds = _load_dataset(f"{spec}: not valid data", name, config, split=split, cache_dir=cache_dir)
        return f"{ds._fingerprint}#{src},{tgt}", PairStream(_hub_pairs(ds, src, tgt, spec))
    if spec.endswith(_TSV + _JSON):
        path, (src, tgt) = _existing(Path(spec)), _columns(options, "source", "target")
        digest = f"{file_digest([path], memo) if digest else ''}#{src},{tgt}"
        if spec.endswith(_TSV):
            return digest, PairStream(_tsv_pairs(path, src, tgt))
        if not check_text(path):  # datasets' json builder fails on an empty file
            return digest, PairStream(())
        ds = _load_dataset(f"{path}: not valid json", "json", data_files=str(path), split="train", cache_dir=cache_dir)
        return digest, PairStream(_hub_pairs(ds, src, tgt, path))
    match = _TEXT_PAIR.match(spec)
    if match and not options:
        src_lang, tgt_lang, prefix = match.groups()
        paths = [_existing(Path(f"{prefix}.{lang}"), Path(f"{prefix}.{lang}.gz")) for lang in (src_lang, tgt_lang)]
        return file_digest(paths, memo) if digest else "", PairStream(_text_pairs(paths))
    raise ValueError(f"unknown data spec {quoted(spec, 200)}: expected SRC:TGT:PREFIX, FILE.tsv, FILE.jsonl, "
                     "FILE.json (optionally .gz, with #src=..,tgt=..) or hf:NAME[:CONFIG]:SPLIT")


def file_digest(paths: Iterable[Path], memo: Path | None = None) -> str:
    """sha256 over `paths`' bytes; a file whose stat the JSON `memo` holds is not read again (unless just written)."""
    try:
        known = read_json(memo, default={}) if memo is not None else {}
    except UserError:  # a damaged memo: read every file again, and rewrite it
        known = {}
    known = known if isinstance(known, dict) else {}
    h, changed = hashlib.sha256(), False
    for path in paths:
        try:
            info = os.stat(path)
            key = f"{os.path.realpath(path)}|{info.st_size}|{info.st_mtime_ns}|{info.st_ctime_ns}|{info.st_ino}"
            digest = known.get(key)
            if digest is None:
                with open(path, "rb") as f:
                    digest = hashlib.file_digest(f, "sha256").hexdigest()
                if time.time() - max(info.st_mtime, info.st_ctime) > RACY_S:
                    known[key], changed = digest, True
        except OSError as err:
            raise ValueError(f"cannot read {path}: {err.strerror or err}") from None
        h.update(digest.encode())
    if changed and memo is not None:
        with contextlib.suppress(OSError):  # a memo not written costs a re-read next time, nothing more
            write_json_atomic(memo, known)
    return h.hexdigest()


def _text_pairs(paths: list[Path]) -> Iterator[tuple[str, str]]:
    """Line N of one file with line N of the other; ValueError when their line counts differ."""
    for path in paths:
        check_text(path)  # ValueError naming the file, as load_parallel's
    readers = [LineReader(path) for path in paths]
    try:
        for sides in itertools.zip_longest(*readers):
            if None in sides:
                for reader in readers:
                    collections.deque(reader, maxlen=0)  # count the rest
                (short, n_short), (long, n_long) = sorted(zip(paths, (r.lines for r in readers)), key=lambda p: p[1])
                extra = f"line {n_long} of {long} has" if n_long == n_short + 1 else \
                    f"lines {n_short + 1}-{n_long} of {long} have"
                raise ValueError(f"line counts differ: {paths[0]} has {readers[0].lines} lines, {paths[1]} has "
                                 f"{readers[1].lines}; {extra} no counterpart in {short}")
            yield sides
    finally:
        for reader in readers:
            reader.close()


def _hub_pairs(ds, src: str, tgt: str, where) -> Iterator[tuple]:
    """Columns `src` and `tgt` (or a `translation` dict column) of a datasets Dataset, a thousand rows at a time."""
    if src in ds.column_names and tgt in ds.column_names:
        columns = [src, tgt]
    elif "translation" in ds.column_names:
        columns = ["translation"]
    else:
        missing = src if src not in ds.column_names else tgt
        raise ValueError(f"{where}: no field {quoted(missing)} (columns: {quoted(ds.column_names, 200)})")
    for rows in ds.select_columns(columns).iter(batch_size=1000):
        if len(columns) == 2:
            yield from zip(rows[src], rows[tgt])
            continue
        for row in rows["translation"]:
            if row is None or src not in row or tgt not in row:
                name = src if row is None or src not in row else tgt
                raise ValueError(f"{where}: no field {quoted(name)} (columns: {quoted(ds.column_names, 200)})")
            yield row[src], row[tgt]


class PairStream:
    """The pairs of an iterable, both sides stripped; those with an empty side left out, counted in `skipped`."""

    def __init__(self, pairs: Iterable):
        self.pairs, self.skipped, self.read = pairs, 0, 0

    def __iter__(self) -> Iterator[Pair]:
        for s, t in self.pairs:
            s, t = ("" if s is None else str(s)).strip(), ("" if t is None else str(t)).strip()
            if s and t:
                self.read += 1
                yield s, t
            else:
                self.skipped += 1
        if self.skipped:
            log.info("skipped %d of %d pairs with an empty side", self.skipped, self.skipped + self.read)


def spec_files(spec: str) -> list[Path]:
    """The local files a data spec names that exist (what an output must not replace)."""
    spec = spec.partition("#")[0]
    if spec.endswith(_TSV + _JSON):
        paths = [Path(spec)]
    elif (match := _TEXT_PAIR.match(spec)) and not spec.startswith("hf:"):
        paths = [Path(f"{match[3]}.{lang}{gz}") for lang in match.group(1, 2) for gz in ("", ".gz")]
    else:
        paths = []
    return [path for path in paths if path.exists()]


def _load_dataset(what: str, *args, **kwargs):
    """datasets.load_dataset(*args, **kwargs); data it cannot parse raises ValueError saying `what`."""
    import datasets  # slow to import: only for hub and JSON specs

    datasets.disable_progress_bars()  # "Generating train split" bars for local files are noise
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # it also logs the parse error it raises
    try:
        return datasets.load_dataset(*args, **kwargs)
    except datasets.exceptions.DatasetGenerationError as err:
        cause = err.__cause__ or err
        reason = shortened(str(cause))  # a parser's message may quote the line
        raise ValueError(f"{what} ({type(cause).__name__}: {reason})") from None
    finally:
        datasets.logging.set_verbosity(verbosity)


def split_lines(text: str) -> list[str]:
    """The lines of `text`, each ending at "\n" ("\r\n" too); U+2028, U+0085, form feed and a lone "\r" are text."""
    return [line.removesuffix("\r") for line in text.removesuffix("\n").split("\n")] if text else []


def _tsv_pairs(path: Path, src: str, tgt: str) -> list[tuple[str, str]]:
    """Columns `src` and `tgt` of a TSV file with a header row: split at tabs, no quoting, no NA values."""
    check_text(path)  # invalid UTF-8 named by its byte offset, a missing file FileNotFoundError
    with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
        lines = split_lines(f.read().decode("utf-8"))
    if not lines:
        raise ValueError(f"{path}: empty file (a TSV needs a header row)")
    header = lines[0].split("\t")
    for col in (src, tgt):
        if col not in header:
            raise ValueError(f"{path}: no column {quoted(col)} in header {quoted(header)}")
    i, j = header.index(src), header.index(tgt)
    rows = [line.split("\t") if line else [""] * len(header) for line in lines[1:]]  # an empty row: empty sides
    for number, row in enumerate(rows, start=2):
        if len(row) != len(header):
            raise ValueError(f"{path}: line {number} has {len(row)} columns, the header (line 1) has {len(header)}")
    return [(row[i], row[j]) for row in rows]


def _existing(*candidates: Path) -> Path:
    """The first candidate that is a regular file; a directory, FIFO or device is named (data is read twice)."""
    for path in candidates:
        if path.is_file():
            return path
        if path.is_dir():
            raise ValueError(f"{path} is a directory, not a data file")
        if path.exists():
            raise ValueError(f"{path} is not a regular file (a FIFO or a device): give a file")
    raise FileNotFoundError(f"no such file: {' or '.join(map(str, candidates))}")


def check_text(path: Path, chunk_size: int = 1 << 20, max_line_bytes: int = MAX_LINE_BYTES) -> int:
    """The size in bytes of `path` (decompressed); ValueError naming invalid UTF-8, a too long line, a read error."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, lines, open_line = 0, 0, 0  # bytes and newlines before the current chunk, bytes of its open line
    try:
        with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
            while True:
                chunk = f.read(chunk_size)
                held = decoder.getstate()[0]  # the start of a sequence the last chunk cut off
                try:
                    decoder.decode(chunk, final=not chunk)
                except UnicodeDecodeError as err:  # err.start counts from the held bytes
                    line = lines + (held + chunk)[: err.start].count(b"\n") + 1
                    raise ValueError(f"{path}: invalid UTF-8 at byte offset {offset - len(held) + err.start} "
                                     f"(line {line}): {err.reason}") from None
                if not chunk:
                    return offset
                lengths = [len(part) for part in chunk.split(b"\n")]
                lengths[0] += open_line
                if long := [i for i, n in enumerate(lengths) if n > max_line_bytes]:
                    raise ValueError(f"{path}: line {lines + long[0] + 1} is longer than {max_line_bytes:,} bytes")
                offset, lines, open_line = offset + len(chunk), lines + len(lengths) - 1, lengths[-1]
    except (OSError, EOFError) as err:  # unreadable, or a truncated/corrupt .gz
        if isinstance(err, FileNotFoundError):
            raise
        raise ValueError(f"cannot read {path}: {err}") from None


def _columns(options: str, src: str, tgt: str) -> tuple[str, str]:
    """Column names from '#src=A,tgt=B' options (either may be left out)."""
    names = {"src": src, "tgt": tgt}
    for item in filter(None, options.split(",")):
        key, eq, value = item.partition("=")
        if key not in names or not eq or not value:
            raise ValueError(f"bad column option {quoted(item)}: expected src=NAME or tgt=NAME")
        names[key] = value
    return names["src"], names["tgt"]
