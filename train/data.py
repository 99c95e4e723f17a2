"""Corpora, tokenizers and token-budget batches for `train.run`; numpy, never torch or jax.

Corpora are lists of (source, target) sentence pairs:

- `numbers_corpus()`: the embedded default, offline and deterministic: a number in 0..999,999 as
  German words -> the same number as English words ("dreiundvierzig" -> "forty-three"), from
  `num2words` (half of the numbers starting with one hundred or one thousand without num2words'
  "ein": "hundertdrei", "tausend"), every magnitude (1 to 6 digits) equally present in each split,
  and the test and valid numbers of 3 or more digits never trained on.
- `load_parallel(spec)`: local files or a datasets-hub dataset, read through HF `datasets`.
  A spec is one of

    SRC:TGT:PREFIX                     two aligned text files PREFIX.SRC and PREFIX.TGT, one
                                       sentence per line, each plain or gzipped (PREFIX.SRC.gz is
                                       used when PREFIX.SRC does not exist), e.g.
                                       de:en:../shared/data/multi30k/train
    FILE.tsv[.gz][#src=COL,tgt=COL]    tab-separated with a header row; columns default to
                                       source,target. No quoting and no NA parsing: '"' and
                                       "null" (German for 0) are text. Every row has the
                                       header's number of columns (else ValueError naming the
                                       line); an empty row is a pair with empty sides.
    FILE.jsonl|.json[.gz][#src=F,tgt=F]  JSON lines; fields default to source,target
    hf:NAME[:CONFIG]:SPLIT[#src=F,tgt=F]  datasets.load_dataset(NAME, CONFIG, split=SPLIT); NAME is
                                       a hub id (needs internet) or a local dataset directory;
                                       SPLIT may slice ("train[:1000]"). Fields default to the two
                                       halves of a CONFIG like "de-en", else source,target.

  In JSON and hub datasets a field is looked up as a column, then inside a "translation" dict
  column (the hub's convention: {"translation": {"de": ..., "en": ...}}). Both sides are
  stripped of surrounding whitespace; pairs where either side is then empty are skipped and
  counted (`LoadedPairs.skipped_empty`).

Lines: one rule for every text file (text pairs, TSV, translate's input), `split_lines`: a line
ends at "\n" (a "\r" before it is dropped too); every other character (U+2028, U+0085, form
feed, a lone "\r") is text. Python's `str.splitlines` and universal newlines would split there.

Tokenizers are byte-level BPE (HF `tokenizers`), trained on the training split, one joint
source+target vocabulary by default. Special ids: `torch_reference.config.SPECIAL_TOKENS`
(<pad>=0, <bos>=1, <eos>=2, <unk>=3), the one definition the model, loss and search read too. Encoding
appends <eos>; decoding stops at the first <eos> and drops the other special tokens. Byte-level
BPE never maps to <unk> and decode(encode(s)) == s for every s without leading whitespace (the
one space byte-level BPE prepends is removed again, so leading whitespace is lost).

`Batcher` cuts encoded pairs into padded int32 batches under a token budget, in a few length
buckets so jit compiles a handful of shapes, shuffled per epoch from a seed, and resumable from
a JSON-able state.
"""

from __future__ import annotations

import codecs
import dataclasses
import functools
import gzip
import logging
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
from num2words import num2words
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from torch_reference.config import BOS_ID, EOS_ID, PAD_ID, SPECIAL_TOKENS, UNK_ID

log = logging.getLogger(__name__)


Pair = tuple[str, str]


# ----------------------------------------------------------------------------------------------
# The embedded numbers corpus


@dataclasses.dataclass(frozen=True)
class Splits:
    """Train, validation and test sentence pairs."""

    train: list[Pair]
    valid: list[Pair]
    test: list[Pair]


@functools.cache
def _below_1000(lang: str) -> tuple[str, ...]:
    return tuple(num2words(i, lang=lang) for i in range(1000))


def number_words(n: int, *, drop_ein: bool = False) -> Pair:
    """(German, English) words for 0 <= n < 1,000,000, exactly as `num2words` writes them, or with
    `drop_ein` without the "ein" that num2words puts before a leading hundred or thousand:
    "hundertdrei" for "einhundertdrei" (103), "tausend" for "eintausend" (1000), as correct and what
    a person types first. Other numbers are the same either way.

    num2words' German converter takes ~0.15 ms per number (it scans a table of names up to
    10^600), so numbers >= 1000 are composed from its words for 0..999 with its own thousands
    rules; tests/train/test_data.py checks the composition against num2words on a sample, and it
    was checked once on all 10^6 numbers. num2words' quirk "einhunderteinstausend" (101,000) is
    kept on purpose: the corpus is num2words' output.
    """
    if not 0 <= n < 1_000_000:
        raise ValueError(f"number_words covers 0..999999, got {n}")
    de, en = _below_1000("de"), _below_1000("en")
    thousands, rest = divmod(n, 1000)
    if thousands == 0:
        return _drop_ein(de[rest]) if drop_ein else de[rest], en[rest]
    german = ("ein" if thousands == 1 else de[thousands]) + "tausend" + (de[rest] if rest else "")
    english = en[thousands] + " thousand"
    if rest:
        english += (", " if rest >= 100 else " and ") + en[rest]
    return _drop_ein(german) if drop_ein else german, english


def _drop_ein(german: str) -> str:
    return german[3:] if german.startswith(("einhundert", "eintausend")) else german


# Bands of the numbers corpus: numbers by how many digits they have. 1 and 2 digits (0..9, 10..99)
# are too few to hold any out, so all 100 are training numbers; 3..6 digits hold numbers out.
NUMBER_BANDS = (1, 2, 3, 4, 5, 6)
SEEN_BANDS = (1, 2)
# Training repeats a number at most this often to fill its band's share (`numbers_corpus`): the
# bands of 1 to 3 digits hold too few numbers for an even share, and seen only once each, the
# numbers below 1,000 came out wrong (1-3 digits: 89-90% exact match where 4-6 reached 99.6-100%);
# at 20 repeats the torch run of 800 steps still wrote "zo" for "null" (band 1: 90%), and at 50
# the torch run of 700 steps did the same. The ten 1-digit numbers, each a word of its own that no
# other number contains ("null", "zero"), are repeated twice as often (`ONE_DIGIT_REPEATS`): at 100
# for every band, band 1 was right but the bands of 3-6 digits lost 11% of their share, and the
# torch run's 6-digit band fell to 98.67%.
TRAIN_REPEATS = 50
ONE_DIGIT_REPEATS = 100
# The share of a band's training pairs given to its round thousands (1,000, 2,000, ..., 999,000:
# 9, 90 and 900 numbers in the bands of 4, 5 and 6 digits). Drawn with the rest, a round thousand
# is one number in 1,000, and a model trained 600 steps wrote "one thousand and one" for
# "tausend", "two thousand and two" for "zweitausend" and "one hundred" for "hunderttausend":
# every one of 36 round thousands from 1,000 to 900,000 wrong, with every band at >= 99.56%.
ROUND_SHARE = 0.05


def _max_repeats(digits: int) -> int:
    return ONE_DIGIT_REPEATS if digits == 1 else TRAIN_REPEATS


def band_range(digits: int) -> range:
    """The numbers with `digits` digits: 0..9 for 1, 10..99 for 2, ..., 100,000..999,999 for 6."""
    if digits not in NUMBER_BANDS:
        raise ValueError(f"bands are 1..6 digits, got {digits}")
    return range(0 if digits == 1 else 10 ** (digits - 1), 10**digits)


def number_band(n: int) -> int:
    """How many digits n has (0 has one)."""
    return len(str(n))


@functools.cache
def _english_below_1000() -> dict[str, int]:
    return {words: n for n, words in enumerate(_below_1000("en"))}


def number_from_english(text: str) -> int | None:
    """The number 0..999,999 that `number_words` writes as `text` in English, else None
    ("forty-three" -> 43, "seven thousand and seven" -> 7007, "Forty-three" -> None)."""
    below = _english_below_1000()
    if text in below:
        return below[text]
    head, sep, tail = text.partition(" thousand")
    rest = 0 if not tail else below.get(tail[2:] if tail.startswith(", ") else tail[5:] if tail.startswith(" and ") else "")
    if not sep or head not in below or rest is None:
        return None
    n = below[head] * 1000 + rest
    return n if number_words(n)[1] == text else None  # rejects "one thousand, seven" and the like


def numbers_range(first: int, last: int, step: int = 1) -> list[Pair]:
    """(German, English) pairs of every `step`-th number from `first` up to `last` (included)."""
    if not 0 <= first <= last < 1_000_000 or step < 1:
        raise ValueError(f"expected 0 <= first <= last <= 999999 and step >= 1, got {first}-{last}/{step}")
    return [number_words(n) for n in range(first, last + 1, step)]


def _spread(total: int, capacities: Sequence[int]) -> list[int]:
    """`total` split as evenly as the capacities allow: every part at most its capacity, and a part
    below an even share only when it is full; the remainder goes to the last parts. Raises
    ValueError when the capacities hold fewer than `total`."""
    counts = [0] * len(capacities)
    left = total
    by_capacity = sorted(range(len(capacities)), key=lambda i: (capacities[i], i))
    for k, i in enumerate(by_capacity):
        counts[i] = min(capacities[i], left // (len(capacities) - k))
        left -= counts[i]
    if left:
        raise ValueError(f"cannot place {total}: the bands hold {sum(capacities)}")
    return counts


def _trailing_zeros(n: int) -> int:
    return len(str(n)) - len(str(n).rstrip("0"))


def numbers_corpus(train_size: int = 20_000, valid_size: int = 1_000, test_size: int = 1_000, seed: int = 0) -> Splits:
    """German -> English number words for numbers of every magnitude, drawn with `seed`.

    Each split is spread evenly over the six bands 1..6 digits (0..9, 10..99, ..., 100,000..999,999;
    `number_band`), so that small numbers are as present as large ones (drawn uniformly from
    0..999,999, numbers below 1,000 would be 0.1% of the corpus, and a model trained on it turns
    "sieben" into "seven thousand and seven"). A band that cannot fill its even share gives the
    rest to the others (`_spread`).

    - Test and valid hold distinct numbers. Bands 3..6 (900 numbers and more): each band's numbers
      are permuted with (seed, band) and cut test first, then valid, then train, so held-out test
      and valid numbers are never trained on, and test and valid depend only on (seed, test_size,
      valid_size), not on train_size. At most half of a band is held out. For 1,000 test pairs:
      10 + 90 + 225 + 225 + 225 + 225.
    - Bands 1 and 2 (the 100 numbers below 100) are too few to hold any out: they are training
      numbers (all of them once train_size >= 540, one share of 90), and the test and valid splits
      draw their share of these bands from the same 100 numbers: there they measure what the model
      learned on seen numbers, not generalisation (`train.evaluate` reports seen numbers apart).
    - Train: an even share of train_size per band, each band's numbers taken in their permuted
      order and cycled to fill the share: a band with fewer numbers repeats them, at most
      `TRAIN_REPEATS` times each, the 1-digit ones `ONE_DIGIT_REPEATS` times (its surplus goes to
      the larger bands). At the default 40,000: 1,000 (the ten 1-digit numbers, 100 times each),
      4,500 (2 digits, 50 times), then 8,625 per band of 3 to 6 digits (the 575 3-digit numbers
      not held out, 15 times each; 8,225 distinct numbers of 4 digits, 8,280 of 5 and 8,620 of
      6, the round thousands among them repeated). A larger train_size adds pairs and removes none.
    - Round thousands: of each band's training share from 4 digits on, `ROUND_SHARE` (5%) are its
      round thousands not held out, the roundest first, cycled the same way: at the default size
      each of 1,000-9,000 50 times, each of 10,000-99,000 about 5 times, and 437 of the 900 from
      100,000 on once (100,000-900,000 and 110,000-990,000 among them), so the others measure
      generalisation (`numbers:100000-999000/1000` in `train.evaluate`).

    So the splits share no number of 3 or more digits. Within each split the pairs are shuffled.

    Spelling: a number whose German starts with "einhundert" or "eintausend" (100-199, 1,000-1,999,
    100,000-199,999) is written with or without that "ein" ("hundertdrei", "tausend"; see
    `number_words`), as a coin drawn per number with `seed` says, the other way at each repeat. So
    about half of them in every split take each spelling, and a model trained without the short
    one turned "hundert" into "six thousand" and "tausend" into "four".
    Tokenize it with a small vocabulary (~400-500): at 8000, BPE learns whole words such as
    "siebenhundertsechsundfünfzigtausend" and the task loses its subword alignments.
    """
    if min(train_size, valid_size, test_size) < 0:
        raise ValueError(f"split sizes must be >= 0, got {train_size}, {valid_size}, {test_size}")
    rng = np.random.default_rng(seed)
    bands = {  # each band's numbers in the order (seed, band) permutes them
        d: (band_range(d).start + np.random.default_rng([seed, d]).permutation(len(band_range(d)))).tolist()
        for d in NUMBER_BANDS
    }
    held = {d: len(bands[d]) // 2 for d in NUMBER_BANDS if d not in SEEN_BANDS}  # held-out room per band
    splits: dict[str, list[int]] = {}
    for name, size in (("test", test_size), ("valid", valid_size)):
        capacity = [len(bands[d]) if d in SEEN_BANDS else held[d] for d in NUMBER_BANDS]
        counts = dict(zip(NUMBER_BANDS, _spread(size, capacity)))
        numbers = []
        for d, k in counts.items():
            if d in SEEN_BANDS:  # test from the front of the permutation, valid from the back
                numbers += bands[d][:k] if name == "test" else bands[d][::-1][:k]
            else:
                numbers += bands[d][:k]
                bands[d], held[d] = bands[d][k:], held[d] - k
        splits[name] = numbers
    # Training: an even share per band, a band's numbers cycled (at most TRAIN_REPEATS times) to fill
    # it, and from 4 digits on ROUND_SHARE of it the band's round thousands, cycled likewise.
    counts = _spread(train_size, [_max_repeats(d) * len(bands[d]) for d in NUMBER_BANDS])
    splits["train"], repeats = [], {"train": []}
    for d, k in zip(NUMBER_BANDS, counts):
        # the roundest first (900,000 before 910,000 before 911,000), else in the band's order
        round_thousands = sorted((n for n in bands[d] if n >= 1000 and n % 1000 == 0), key=_trailing_zeros, reverse=True)
        k_round = min(int(k * ROUND_SHARE), TRAIN_REPEATS * len(round_thousands))
        for numbers, count in ((round_thousands, k_round), (bands[d], k - k_round)):
            splits["train"] += [numbers[i % len(numbers)] for i in range(count)]
            repeats["train"] += [i // len(numbers) for i in range(count)]
    # Which spelling a number's n-th occurrence takes: a coin per number, alternating with n.
    coin = np.random.default_rng([seed, 1]).integers(0, 2, size=1_000_000, dtype=np.int8)
    corpus = {}
    for name, numbers in splits.items():
        order = rng.permutation(len(numbers)).tolist()
        nth = repeats.get(name, [0] * len(numbers))
        corpus[name] = [number_words(numbers[i], drop_ein=bool((coin[numbers[i]] + nth[i]) % 2)) for i in order]
    return Splits(**corpus)


# ----------------------------------------------------------------------------------------------
# Parallel files and hub datasets


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


def load_parallel(spec: str, cache_dir: str | Path | None = None) -> LoadedPairs:
    """Sentence pairs from a spec string (formats in the module docstring).

    `cache_dir` is handed to `datasets.load_dataset` (default: the HF datasets cache).
    Raises FileNotFoundError for a missing file, ValueError for an unknown format, a missing
    column, or text files whose line counts differ.
    """
    import datasets  # imported here: ~1 s, and the numbers corpus does not need it

    datasets.disable_progress_bars()  # "Generating train split" bars for local files are noise

    spec, _, options = spec.partition("#")
    cache_dir = None if cache_dir is None else str(cache_dir)
    if spec.startswith("hf:"):
        match = _HUB.match(spec)
        if not match:
            raise ValueError(f"hub spec must be hf:NAME[:CONFIG]:SPLIT, got {spec!r}")
        name, config, split = match.groups()
        langs = config.split("-") if config and re.fullmatch(r"\w+-\w+", config) else ("source", "target")
        src, tgt = _columns(options, *langs)
        ds = datasets.load_dataset(name, config, split=split, cache_dir=cache_dir)
        return _pairs(_field(ds, src, spec), _field(ds, tgt, spec))
    if spec.endswith(_TSV):
        path = _existing(Path(spec))
        src, tgt = _columns(options, "source", "target")
        return _tsv_pairs(path, src, tgt)
    if spec.endswith(_JSON):
        path = _existing(Path(spec))
        src, tgt = _columns(options, "source", "target")
        if not check_text(path):  # datasets' json builder fails on an empty file
            return LoadedPairs([], 0)
        ds = _load_dataset("json", data_files=str(path), split="train", cache_dir=cache_dir)
        return _pairs(_field(ds, src, path), _field(ds, tgt, path))
    match = _TEXT_PAIR.match(spec)
    if match and not options:
        src_lang, tgt_lang, prefix = match.groups()
        paths = [_existing(Path(f"{prefix}.{lang}"), Path(f"{prefix}.{lang}.gz")) for lang in (src_lang, tgt_lang)]
        sides = [read_lines(p) for p in paths]
        if len(sides[0]) != len(sides[1]):
            (short, n_short), (long, n_long) = sorted(zip(paths, map(len, sides)), key=lambda pair: pair[1])
            extra = f"line {n_long} of {long} has" if n_long == n_short + 1 else f"lines {n_short + 1}-{n_long} of {long} have"
            raise ValueError(
                f"line counts differ: {paths[0]} has {len(sides[0])} lines, {paths[1]} has {len(sides[1])}; "
                f"{extra} no counterpart in {short}"
            )
        return _pairs(*sides)
    raise ValueError(
        f"unknown data spec {spec!r}: expected SRC:TGT:PREFIX, FILE.tsv, FILE.jsonl, FILE.json "
        "(optionally .gz, with #src=..,tgt=..) or hf:NAME[:CONFIG]:SPLIT"
    )


def _load_dataset(builder: str, data_files: str, **kwargs):
    """datasets.load_dataset on a local file; a file it cannot parse raises ValueError naming it."""
    import datasets

    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # it also logs the parse error it raises
    try:
        return datasets.load_dataset(builder, data_files=data_files, **kwargs)
    except datasets.exceptions.DatasetGenerationError as err:
        cause = err.__cause__ or err
        raise ValueError(f"{data_files}: not valid {builder} ({type(cause).__name__}: {cause})") from None
    finally:
        datasets.logging.set_verbosity(verbosity)


def split_lines(text: str) -> list[str]:
    """The lines of `text` by the one rule of this project: each ends at "\n" ("\r\n" too);
    U+2028, U+0085, form feed and a lone "\r" are text. A last line needs no "\n"."""
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def read_lines(path: Path) -> list[str]:
    """`split_lines` of a UTF-8 text file, plain or .gz (ValueError naming the byte offset of
    invalid UTF-8, FileNotFoundError for a missing file)."""
    check_text(path)
    with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
        return split_lines(f.read().decode("utf-8"))


def _tsv_pairs(path: Path, src: str, tgt: str) -> LoadedPairs:
    """Columns `src` and `tgt` of a TSV file with a header row: every row split at tabs, no
    quoting, no NA values, and exactly the header's number of columns."""
    lines = read_lines(path)
    if not lines:
        raise ValueError(f"{path}: empty file (a TSV needs a header row)")
    header = lines[0].split("\t")
    for col in (src, tgt):
        if col not in header:
            raise ValueError(f"{path}: no column {col!r} in header {header}")
    i, j = header.index(src), header.index(tgt)
    sources, targets = [], []
    for number, line in enumerate(lines[1:], start=2):
        if not line:  # an empty row: a pair with empty sides, skipped and counted
            sources.append("")
            targets.append("")
            continue
        row = line.split("\t")
        if len(row) != len(header):
            raise ValueError(f"{path}: line {number} has {len(row)} columns, the header (line 1) has {len(header)}")
        sources.append(row[i])
        targets.append(row[j])
    return _pairs(sources, targets)


def _existing(*candidates: Path) -> Path:
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError(f"no such file: {' or '.join(map(str, candidates))}")


def check_text(path: Path, chunk_size: int = 1 << 20) -> int:
    """The size in bytes of `path` (decompressed when it ends in .gz). Raises ValueError naming
    the byte offset and line of its first invalid UTF-8 sequence, or when it cannot be read.

    `datasets` would fail on such a file too, but with an offset into one of its own chunks and
    no file name; one streaming pass here costs little next to tokenisation.
    """
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, lines = 0, 0  # bytes and newlines before the current chunk
    try:
        with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
            while True:
                chunk = f.read(chunk_size)
                held = decoder.getstate()[0]  # the start of a sequence the last chunk cut off
                try:
                    decoder.decode(chunk, final=not chunk)
                except UnicodeDecodeError as err:  # err.start counts from the held bytes
                    line = lines + (held + chunk)[: err.start].count(b"\n") + 1
                    raise ValueError(
                        f"{path}: invalid UTF-8 at byte offset {offset - len(held) + err.start} (line {line}): {err.reason}"
                    ) from None
                if not chunk:
                    return offset
                offset, lines = offset + len(chunk), lines + chunk.count(b"\n")
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
            raise ValueError(f"bad column option {item!r}: expected src=NAME or tgt=NAME")
        names[key] = value
    return names["src"], names["tgt"]


def _field(ds, name: str, where) -> list:
    """Column `name`, or key `name` of the hub's `translation` dict column."""
    if name in ds.column_names:
        return list(ds[name])
    if "translation" in ds.column_names:
        rows = list(ds["translation"])
        if all(row is not None and name in row for row in rows):
            return [row[name] for row in rows]
    raise ValueError(f"{where}: no field {name!r} (columns: {ds.column_names})")


def _pairs(sources: Iterable, targets: Iterable) -> LoadedPairs:
    pairs, skipped = [], 0
    for s, t in zip(sources, targets, strict=True):
        s, t = ("" if s is None else str(s)).strip(), ("" if t is None else str(t)).strip()
        if s and t:
            pairs.append((s, t))
        else:
            skipped += 1
    if skipped:
        log.info("skipped %d of %d pairs with an empty side", skipped, skipped + len(pairs))
    return LoadedPairs(pairs, skipped)


# ----------------------------------------------------------------------------------------------
# Tokenizers


@dataclasses.dataclass(frozen=True)
class Tokenizers:
    """Source and target tokenizers; the same object twice for a joint vocabulary."""

    src: Tokenizer
    tgt: Tokenizer

    @property
    def joint(self) -> bool:
        return self.src is self.tgt


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8000, min_frequency: int = 2) -> Tokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` trained on `texts`.

    The vocabulary holds the 4 special tokens (ids 0..3), the 256 byte symbols and merges up to
    `vocab_size` in all; it is smaller when the text runs out of merges seen `min_frequency`
    times, so read the size from `tokenizer.get_vocab_size()`. The saved tokenizer.json carries
    the whole behaviour (eos appended by its post-processor, prefix space removed by its decoder).
    """
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    # A prefix space makes a sentence's first word tokenize like the same word mid-sentence; the
    # Strip decoder removes it again after the byte-level decoder has joined all tokens into one.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tokenizer.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Strip(" ", 1, 0)])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A <eos>", special_tokens=[("<eos>", EOS_ID)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: no <unk>, ever
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == [PAD_ID, BOS_ID, EOS_ID, UNK_ID]
    return tokenizer


def train_tokenizers(
    pairs: Sequence[Pair], vocab_size: int = 8000, joint: bool = True, min_frequency: int = 2
) -> Tokenizers:
    """Tokenizers trained on the training pairs: one on both sides (joint), or one per side."""
    sources, targets = [s for s, _ in pairs], [t for _, t in pairs]
    if joint:
        tokenizer = train_tokenizer(sources + targets, vocab_size, min_frequency)
        return Tokenizers(tokenizer, tokenizer)
    return Tokenizers(
        train_tokenizer(sources, vocab_size, min_frequency), train_tokenizer(targets, vocab_size, min_frequency)
    )


def encode(tokenizer: Tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text, ending with <eos>."""
    return [e.ids for e in tokenizer.encode_batch(list(texts))]


def decode(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    """Text of one id sequence: up to the first <eos>, without <pad>/<bos>/<unk>."""
    ids = [int(i) for i in ids]
    if EOS_ID in ids:
        ids = ids[: ids.index(EOS_ID)]
    return tokenizer.decode(ids, skip_special_tokens=True)


def decode_batch(tokenizer: Tokenizer, rows: Iterable[Sequence[int]]) -> list[str]:
    """`decode` for each row of ids, e.g. of a (B, T) array."""
    return [decode(tokenizer, row) for row in rows]


def encode_pairs(tokenizers: Tokenizers, pairs: Sequence[Pair]) -> list[tuple[list[int], list[int]]]:
    """(source ids, target ids) per pair, each ending with <eos>."""
    sources = encode(tokenizers.src, [s for s, _ in pairs])
    targets = encode(tokenizers.tgt, [t for _, t in pairs])
    return list(zip(sources, targets))


# ----------------------------------------------------------------------------------------------
# Batches


def bucket_lengths(max_len: int) -> tuple[int, ...]:
    """Padded lengths 8, 16, 24, 32, 48, 64, 96, ... (2^k and 3*2^k) below max_len, then max_len.

    From 16 on, consecutive buckets differ by at most 1.5x, so padding to a bucket wastes under a
    third of it, and max_len=256 gives 10 buckets.
    """
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    steps = sorted({m << k for m in (8, 24) for k in range(max_len.bit_length())})
    return tuple(length for length in steps if length < max_len) + (max_len,)


@dataclasses.dataclass(frozen=True)
class Batch:
    """One padded batch: src, tgt_in and tgt_out are int32, padded with 0 to the bucket length S = T."""

    src: np.ndarray  # (B, S): source ids + eos
    tgt_in: np.ndarray  # (B, T): decoder input, shift_right(tgt_out): bos + tgt_out[:, :-1]
    tgt_out: np.ndarray  # (B, T): target ids + eos, the labels
    ids: np.ndarray  # (B,) index of each row's pair in the Batcher's examples; -1 for filler rows
    num_src_tokens: int  # non-pad tokens in src
    num_tgt_tokens: int  # non-pad tokens in tgt_out: what the loss averages over

    @property
    def num_sentences(self) -> int:
        return int((self.ids >= 0).sum())


class Batcher:
    """Padded batches under a token budget, in length buckets, shuffled per epoch, resumable.

    A pair goes to the smallest bucket length L >= max(len(src), len(tgt)) (lengths include
    <eos>); source and target are both padded to L, so a bucket has one batch shape (B_L, L) with
        B_L = floor(token_budget / (L * multiple_of)) * multiple_of,  i.e.  B_L * L <= token_budget.
    The last batch of a bucket is filled up with all-pad rows (ids -1, no tokens) so that shape
    never changes: at most one shape per bucket, `shapes`. Pairs longer than max_len are dropped
    and counted in `num_dropped`.

    Epoch e is shuffled by numpy's Generator seeded with (seed, e): pairs within each bucket, then
    the order of all batches. `next(batcher)` runs through epochs endlessly; `state()` is a
    JSON-able {"epoch", "index"} (batches already taken from that epoch), and `restore(state)`
    continues exactly from there. `epoch_batches(e)` yields one epoch without touching the state
    (with shuffle=False: bucket by bucket, pairs in their given order, for evaluation).
    """

    def __init__(
        self,
        examples: Sequence[tuple[Sequence[int], Sequence[int]]],
        token_budget: int,
        max_len: int = 256,
        buckets: Sequence[int] | None = None,
        multiple_of: int = 1,
        shuffle: bool = True,
        seed: int = 0,
    ):
        self.buckets = tuple(buckets) if buckets is not None else bucket_lengths(max_len)
        if list(self.buckets) != sorted(set(self.buckets)) or self.buckets[-1] != max_len:
            raise ValueError(f"buckets must increase and end at max_len={max_len}, got {self.buckets}")
        if multiple_of < 1:
            raise ValueError(f"multiple_of must be >= 1, got {multiple_of}")
        if token_budget < max_len * multiple_of:
            raise ValueError(
                f"token_budget={token_budget} cannot hold {multiple_of} sequence(s) of max_len={max_len}: "
                f"needs at least {max_len * multiple_of}"
            )
        self.examples, self.shuffle, self.seed = examples, shuffle, seed
        self.batch_size = {length: token_budget // (length * multiple_of) * multiple_of for length in self.buckets}
        lengths = np.array([max(len(s), len(t)) for s, t in examples], dtype=np.int64).reshape(-1)
        keep = lengths <= max_len
        self.num_dropped = int((~keep).sum())
        if self.num_dropped:
            log.info("dropped %d of %d pairs longer than max_len=%d", self.num_dropped, len(examples), max_len)
        bucket_of = np.searchsorted(self.buckets, lengths)  # smallest bucket >= length
        members = {length: np.flatnonzero(keep & (bucket_of == b)) for b, length in enumerate(self.buckets)}
        self._members = {length: idx for length, idx in members.items() if len(idx)}  # buckets in use
        self.epoch, self.index, self._plan_cache = 0, 0, (None, [])

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """The distinct (B, L) batch shapes this data produces (one per bucket in use)."""
        return [(self.batch_size[length], length) for length in self._members]

    @property
    def num_batches(self) -> int:
        """Batches per epoch (the same every epoch)."""
        return sum(-(-len(idx) // self.batch_size[length]) for length, idx in self._members.items())

    def _plan(self, epoch: int) -> list[tuple[int, np.ndarray]]:
        """(L, example indices) of every batch of `epoch`, in order."""
        rng = np.random.default_rng((self.seed, epoch))
        plan = []
        for length, idx in self._members.items():
            if self.shuffle:
                idx = rng.permutation(idx)
            size = self.batch_size[length]
            plan += [(length, idx[i : i + size]) for i in range(0, len(idx), size)]
        if self.shuffle:
            plan = [plan[i] for i in rng.permutation(len(plan))]
        return plan

    def _collate(self, length: int, idx: np.ndarray) -> Batch:
        size = self.batch_size[length]
        src = np.zeros((size, length), np.int32)  # (B, S)
        tgt_out = np.zeros((size, length), np.int32)  # (B, T)
        for row, i in enumerate(idx):
            s, t = self.examples[i]
            src[row, : len(s)] = s
            tgt_out[row, : len(t)] = t
        tgt_in = np.concatenate([np.full((size, 1), BOS_ID, np.int32), tgt_out[:, :-1]], axis=1)  # (B, T)
        ids = np.full(size, -1, np.int64)
        ids[: len(idx)] = idx
        return Batch(src, tgt_in, tgt_out, ids, int((src != PAD_ID).sum()), int((tgt_out != PAD_ID).sum()))

    def epoch_batches(self, epoch: int = 0) -> Iterator[Batch]:
        """All batches of one epoch; the iteration state is left alone."""
        for length, idx in self._plan(epoch):
            yield self._collate(length, idx)

    def __iter__(self) -> Batcher:
        return self

    def __next__(self) -> Batch:
        if not self._members:
            raise StopIteration  # no data: an endless stream would spin forever
        if self.index >= self.num_batches:
            self.epoch, self.index = self.epoch + 1, 0
        if self._plan_cache[0] != self.epoch:
            self._plan_cache = (self.epoch, self._plan(self.epoch))
        length, idx = self._plan_cache[1][self.index]
        self.index += 1
        return self._collate(length, idx)

    def state(self) -> dict[str, int]:
        """Where `next` continues: {"epoch": e, "index": batches of epoch e already taken}."""
        return {"epoch": self.epoch, "index": self.index}

    def restore(self, state: dict[str, int]) -> None:
        """Continue from a `state()` (e.g. read back from a checkpoint's JSON)."""
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


def source_batches(
    src_ids: Sequence[Sequence[int]], max_len: int, token_budget: int, batch_size: int | None = None
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(indices, padded src (B, L)) per batch: sentences grouped by length bucket, at most
    `token_budget` padded tokens and `batch_size` sentences per batch, every batch of a bucket
    padded with all-pad rows (index -1) to one shape. Sources longer than max_len are cut to
    max_len - 1 tokens + <eos>."""
    buckets = bucket_lengths(max_len)
    ids = [list(s) if len(s) <= max_len else [*s[: max_len - 1], EOS_ID] for s in src_ids]
    bucket_of = np.searchsorted(buckets, [len(s) for s in ids])
    for b, length in enumerate(buckets):
        members = np.flatnonzero(bucket_of == b)
        if not len(members):
            continue
        # Rows per batch: the budget's, but no more than the next power of two above the bucket's
        # sentence count (3 sentences do not run as 512 rows), so shapes stay few.
        size = max(1, min(token_budget // length, batch_size or token_budget, 1 << (len(members) - 1).bit_length()))
        for start in range(0, len(members), size):
            chunk = members[start : start + size]
            src = np.full((size, length), PAD_ID, np.int32)  # (B, L)
            for row, i in enumerate(chunk):
                src[row, : len(ids[i])] = ids[i]
            index = np.full(size, -1, np.int64)
            index[: len(chunk)] = chunk
            yield index, src
