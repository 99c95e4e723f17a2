"""`numbers_corpus()`: the embedded default corpus: a number in 0..999,999 as German words -> English words."""

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
    """(German, English) words for 0 <= n < 1,000,000 as `num2words` writes them, or with `drop_ein` without the
    "ein" before a leading hundred or thousand; composed from num2words' words for 0..999 (its German is slow)."""
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


# Bands of the numbers corpus by digits (1 and 2 too few to hold out); repeats and round shares: `numbers_corpus`.
NUMBER_BANDS = (1, 2, 3, 4, 5, 6)
SEEN_BANDS = (1, 2)
TRAIN_REPEATS = 50
ONE_DIGIT_REPEATS = 100
ROUND_SHARE = 0.05


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
    """`total` split as evenly as the capacities allow; ValueError when they hold fewer than `total`."""
    counts = [0] * len(capacities)
    left = total
    by_capacity = sorted(range(len(capacities)), key=lambda i: (capacities[i], i))
    for k, i in enumerate(by_capacity):
        counts[i] = min(capacities[i], left // (len(capacities) - k))
        left -= counts[i]
    if left:
        raise ValueError(f"cannot place {total}: the bands hold {sum(capacities)}")
    return counts


def numbers_corpus(train_size: int = 20_000, valid_size: int = 1_000, test_size: int = 1_000, seed: int = 0) -> Splits:
    """German -> English number words drawn with `seed`, no 3+ digit number in two splits (docs/results.md)."""
    if min(train_size, valid_size, test_size) < 0:
        raise ValueError(f"split sizes must be >= 0, got {train_size}, {valid_size}, {test_size}")
    rng = np.random.default_rng(seed)
    # each band's numbers in the order (seed, band) permutes them
    bands = {d: (band_range(d).start + np.random.default_rng([seed, d]).permutation(len(band_range(d)))).tolist()
             for d in NUMBER_BANDS}
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
    repeat = {d: ONE_DIGIT_REPEATS if d == 1 else TRAIN_REPEATS for d in NUMBER_BANDS}
    counts = _spread(train_size, [repeat[d] * len(bands[d]) for d in NUMBER_BANDS])
    splits["train"], repeats = [], {"train": []}
    for d, k in zip(NUMBER_BANDS, counts):
        # the roundest first (900,000 before 910,000 before 911,000), else in the band's order
        round_thousands = sorted((n for n in bands[d] if n >= 1000 and n % 1000 == 0),
                                 key=lambda n: len(str(n)) - len(str(n).rstrip("0")), reverse=True)  # trailing zeros
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
