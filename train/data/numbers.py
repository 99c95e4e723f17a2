"""`numbers_corpus()`: the embedded default corpus, offline and deterministic: a number in 0..999,999 as
German words -> the same number as English words ("dreiundvierzig" -> "forty-three"), from
`num2words` (half of the numbers starting with one hundred or one thousand without num2words'
"ein": "hundertdrei", "tausend"), every magnitude (1 to 6 digits) equally present in each split,
and the test and valid numbers of 3 or more digits never trained on.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np
from num2words import num2words

from .corpora import Pair


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

    num2words' German converter is slow (it scans a table of names up to 10^600), so numbers >= 1000
    are composed from its words for 0..999 with its own thousands rules, checked against num2words
    (tests/train/test_data.py; docs/results.md#the-numbers-corpus). num2words' quirk
    "einhunderteinstausend" (101,000) is kept on purpose: the corpus is num2words' output.
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
# Training repeats a number at most this often to fill its band's share (`numbers_corpus`): the bands of
# 1 to 3 digits hold too few numbers for an even share, and fewer repeats leave small numbers wrong. The
# ten 1-digit numbers, each a word no other number contains ("null", "zero"), repeat twice as often
# (`ONE_DIGIT_REPEATS`): as often for every band would starve the larger ones (docs/results.md#the-numbers-corpus).
TRAIN_REPEATS = 50
ONE_DIGIT_REPEATS = 100
# The share of a band's training pairs given to its round thousands (1,000, 2,000, ..., 999,000: 9, 90
# and 900 numbers in the bands of 4, 5 and 6 digits): drawn with the rest, a round thousand is one number
# in 1,000, too rare to learn "tausend" or "zweitausend" (docs/results.md#the-numbers-corpus).
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
    0..999,999, numbers below 1,000 would be 0.1% of the corpus, too few to learn:
    docs/results.md#the-numbers-corpus). A band that cannot fill its even share gives the rest
    to the others (`_spread`).

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
    about half of them in every split take each spelling, and a model learns both.
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
