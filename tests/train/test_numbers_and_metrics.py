"""The numbers corpus' bands (every magnitude, held-out numbers) and the evaluation metrics: exact
match, sacreBLEU signatures, lowercased BLEU, exact match per number of digits."""

import math
from collections import Counter

import numpy as np
import pytest

from train import data, translation
from train.data import NUMBER_BANDS, numbers

_ENGLISH_1_DIGIT = {data.number_words(n)[1] for n in range(10)}


def _band_counts(pairs):
    return Counter(data.number_band(data.number_from_english(english)) for _, english in pairs)


def test_number_bands_and_english_parser():
    assert [data.band_range(d) for d in (1, 2, 6)] == [range(0, 10), range(10, 100), range(100_000, 1_000_000)]
    assert sum(len(data.band_range(d)) for d in NUMBER_BANDS) == 1_000_000
    assert [data.number_band(n) for n in (0, 9, 10, 99, 100, 999_999)] == [1, 1, 2, 2, 3, 6]
    # The parser inverts number_words' English (checked once on all 10^6 numbers; here a sample
    # and every boundary), and rejects whatever number_words would not write.
    numbers = list(range(1000)) + [1000, 1001, 1099, 1100, 7007, 100_000, 101_000, 999_999]
    numbers += np.random.default_rng(2).choice(1_000_000, 300, replace=False).tolist()
    for n in numbers:
        assert data.number_from_english(data.number_words(n)[1]) == n, n
    for text in ("Forty-three", " forty-three", "one thousand, seven", "one thousand and one hundred",
                 "seven thousand and", "thousand", "one thousand thousand", "one million", "", "sieben"):
        assert data.number_from_english(text) is None, text
    assert data.numbers_range(8, 11) == [data.number_words(n) for n in (8, 9, 10, 11)]
    assert data.numbers_range(1000, 4500, 1000) == [data.number_words(n) for n in (1000, 2000, 3000, 4000)]
    for first, last, step in ((5, 4, 1), (-1, 3, 1), (0, 1_000_000, 1), (0, 9, 0)):
        with pytest.raises(ValueError):
            data.numbers_range(first, last, step)


def test_spread_is_even_up_to_capacity():
    assert numbers._spread(1000, [10, 90, 450, 4500, 45_000, 450_000]) == [10, 90, 225, 225, 225, 225]
    assert numbers._spread(7, [5, 5, 5]) == [2, 2, 3]  # the remainder goes to the last parts
    assert numbers._spread(12, [1, 100, 2]) == [1, 9, 2]
    assert numbers._spread(0, [3, 3]) == [0, 0]
    with pytest.raises(ValueError, match="cannot place"):
        numbers._spread(10, [3, 3, 3])


def test_a_small_band_repeats_its_numbers_at_most_so_often():
    """A band too small for its share is cycled at most TRAIN_REPEATS (50) times a number, the ten
    1-digit numbers ONE_DIGIT_REPEATS (100) times; the rest of the share goes to the other bands.
    At 50 for every band, the torch default run wrote "zo" for "null"."""
    assert (numbers.TRAIN_REPEATS, numbers.ONE_DIGIT_REPEATS) == (50, 100)
    corpus = data.numbers_corpus(train_size=30_000, valid_size=0, test_size=0, seed=3)
    assert _band_counts(corpus.train) == {1: 1000, 2: 4500, 3: 6125, 4: 6125, 5: 6125, 6: 6125}
    assert set(Counter(p for p in corpus.train if p[1] in _ENGLISH_1_DIGIT).values()) == {100}
    assert set(Counter(e for _, e in corpus.train if 10 <= data.number_from_english(e) < 100).values()) == {50}


def test_numbers_corpus_covers_every_band_and_holds_numbers_out():
    corpus = data.numbers_corpus(train_size=4000, valid_size=60, test_size=600, seed=3)
    # Each split is spread evenly over the six bands; the two small bands give up their surplus.
    assert _band_counts(corpus.test) == {1: 10, 2: 90, 3: 125, 4: 125, 5: 125, 6: 125}
    assert _band_counts(corpus.valid) == {d: 10 for d in NUMBER_BANDS}
    # Training: an even share per band (4,000 / 6; the remainder to the last bands), a small band's
    # numbers cycled to fill it: the ten 1-digit numbers 66-67 times each.
    assert _band_counts(corpus.train) == {1: 666, 2: 666, 3: 667, 4: 667, 5: 667, 6: 667}
    assert sorted(Counter(p for p in corpus.train if p[1] in _ENGLISH_1_DIGIT).values()) == [66] * 4 + [67] * 6
    assert len({e for _, e in corpus.train if data.number_from_english(e) < 100}) == 100  # every 2-digit number too
    # Of each 667 pairs of 4..6 digits, 33 (ROUND_SHARE, 5%) are the band's round thousands: the nine
    # of 1,000-9,000 cycled (3-4 times each), 33 distinct ones of 5 and of 6 digits (no other pair of
    # these bands fell on a round thousand at this seed).
    assert numbers.ROUND_SHARE == 0.05
    round_thousands = Counter(n for _, e in corpus.train if (n := data.number_from_english(e)) >= 1000 and n % 1000 == 0)
    in_band = {d: {n: c for n, c in round_thousands.items() if data.number_band(n) == d} for d in (4, 5, 6)}
    assert sorted(in_band[4]) == list(range(1000, 10_000, 1000)) and set(in_band[4].values()) == {3, 4}
    assert [sum(in_band[d].values()) for d in (4, 5, 6)] == [33, 33, 33]
    assert set(in_band[5].values()) == set(in_band[6].values()) == {1}
    # Distinct pairs: the 100 numbers below 100, 667 distinct 3-digit numbers, 634 + 9 of 4 digits,
    # 667 of 5 and of 6, and 1,000 trained as "tausend" and as "eintausend" (repeats alternate).
    assert len(set(corpus.train)) == 100 + 667 + 643 + 667 + 667 + 1
    train = {source for source, _ in corpus.train}
    for split in (corpus.valid, corpus.test):
        for source, english in split:
            # Below 100: every number is a training number; from 3 digits on: none is.
            assert (source in train) == (data.number_from_english(english) < 100), source
    held_out = {s for s, e in corpus.test if data.number_from_english(e) >= 100}
    assert not held_out & {s for s, _ in corpus.valid}
    # Every band of the test split holds numbers of that many digits, and the splits are shuffled
    # (the bands are not in blocks): the first 60 test pairs already cover four bands.
    assert len(_band_counts(corpus.test[:60])) >= 4
    # The band of 3 digits (900 numbers) is held out at most by half: the rest can train.
    big = data.numbers_corpus(train_size=100, valid_size=0, test_size=6000, seed=0)
    assert _band_counts(big.test)[3] == 450
    # A band's numbers are cycled in one order: each 1-digit number 10 times in 600 pairs, and a
    # larger train_size adds pairs, removing none.
    small = data.numbers_corpus(train_size=600, valid_size=0, test_size=0, seed=0)
    assert Counter(s for s, e in small.train if e in _ENGLISH_1_DIGIT) == {data.number_words(n)[0]: 10 for n in range(10)}
    larger = Counter(data.numbers_corpus(train_size=700, valid_size=0, test_size=0, seed=0).train)
    assert not Counter(small.train) - larger


def test_exact_match_signatures_and_lowercased_bleu():
    refs = ["seven hundred and twelve thousand, three hundred and one", "forty-three", "one thousand and one"]
    hyps = ["Seven hundred and twelve thousand, three hundred and one", " forty-three ", "one thousand and two"]
    assert translation.exact_match(hyps, refs) == pytest.approx(100 / 3)  # stripped: " forty-three " counts
    assert math.isnan(translation.exact_match([], []))
    with pytest.raises(ValueError):
        translation.exact_match(hyps, refs[:2])
    plain = translation.corpus_scores(hyps, refs)
    scores = translation.corpus_scores(hyps, refs, lowercase=True)
    assert set(plain) == {"bleu", "bleu_signature", "chrf", "chrf_signature", "exact_match"}
    assert set(scores) == set(plain) | {"bleu_lc", "bleu_lc_signature"}
    assert {k: scores[k] for k in plain} == plain
    assert scores["bleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.")
    assert scores["bleu_lc_signature"].startswith("nrefs:1|case:lc|eff:no|tok:13a|smooth:exp|version:2.")
    assert scores["chrf_signature"].startswith("nrefs:1|case:mixed|")
    # Only the case of one word differs from the lowercased reference: lowercased BLEU is higher.
    assert 0 < scores["bleu"] < scores["bleu_lc"] < 100
    assert translation.corpus_scores(refs, refs, lowercase=True)["bleu_lc"] == pytest.approx(100)


def test_band_scores_from_the_numbers():
    numbers = [0, 7, 43, 100, 512, 999, 1000, 123_456]
    pairs = [data.number_words(n) for n in numbers]
    hyps = [english for _, english in pairs]
    hyps[1] = "seven thousand and seven"  # 7 wrong, 512 wrong
    hyps[4] = "five hundred and eleven"
    seen = {data.number_words(n)[0] for n in (0, 7, 512)}
    bands = translation.band_scores(pairs, hyps, seen)
    assert bands == {
        "1": {"sentences": 2, "exact_match": 50.0, "seen": 2, "unseen_exact_match": None},
        "2": {"sentences": 1, "exact_match": 100.0, "seen": 0, "unseen_exact_match": 100.0},
        "3": {"sentences": 3, "exact_match": pytest.approx(200 / 3), "seen": 1, "unseen_exact_match": 100.0},
        "4": {"sentences": 1, "exact_match": 100.0, "seen": 0, "unseen_exact_match": 100.0},
        "6": {"sentences": 1, "exact_match": 100.0, "seen": 0, "unseen_exact_match": 100.0},
    }
    assert translation.band_scores(pairs, hyps)["3"] == {
        "sentences": 3, "exact_match": pytest.approx(200 / 3), "seen": None, "unseen_exact_match": pytest.approx(200 / 3)
    }
    text = translation.bands_text(bands)
    assert text.startswith(" by digits 1:50* 2:100 3:66.67 4:100 6:100") and "seen in training" in text
    # Data that are not all numbers have no bands.
    assert translation.band_scores(pairs + [("Hallo", "hello")], hyps + ["hello"]) is None
    assert translation.band_scores([], []) is None and translation.bands_text(None) == ""


def test_number_range_specs_with_a_step():
    from train import runtime
    from train.config import ExperimentConfig

    cfg = ExperimentConfig()
    assert data.load_split(cfg, "numbers:1000-999000/1000")[:2] == [("eintausend", "one thousand"), ("zweitausend", "two thousand")]
    assert len(data.load_split(cfg, "numbers:1000-999000/1000")) == 999
    assert data.load_split(cfg, "numbers:5-7") == [data.number_words(n) for n in (5, 6, 7)]
    for spec, message in (("numbers:5-7/0", "step >= 1"), ("numbers:5-7/x", "numbers:FIRST-LAST[/STEP]")):
        with pytest.raises(runtime.UserError, match=message.replace("[", r"\[").replace("]", r"\]")):
            data.load_split(cfg, spec)


def test_evaluate_refuses_a_bad_sentence_count_or_sample_count(tiny_torch_run):
    """max_sentences=0 evaluated every pair, -1 all but the last, samples=-1 all but the last:
    silently; aiayn evaluate's --max-sentences and --samples refuse them."""
    import train
    from train.runtime import UserError

    pairs = [data.number_words(n) for n in (7, 43)]
    with train.load(tiny_torch_run) as run:
        assert run.evaluate(pairs, beam=1, max_sentences=1, samples=1)["sentences"] == 1
        for options, message in (({"max_sentences": 0}, "max_sentences must be >= 1, got 0"),
                                 ({"max_sentences": -1}, "max_sentences must be >= 1, got -1"),
                                 ({"max_sentences": 1.5}, "max_sentences must be an integer, got 1.5"),
                                 ({"samples": -1}, "samples must be >= 0, got -1")):
            with pytest.raises(UserError, match=f"^{message}$"):
                run.evaluate(pairs, beam=1, **options)


def test_evaluating_no_pairs_is_one_error_line(tiny_torch_run, capsys):
    """An empty list of pairs, or numbers:test of a run trained with numbers_test=0, was an
    IndexError from sacreBLEU, in Python and through aiayn evaluate alike."""
    import train
    from train.commands import evaluate
    from train.runtime import UserError

    from .cli import run_cli

    with train.load(tiny_torch_run) as run:
        for spec, message in (([], "pairs holds no sentence pairs"),
                              ("numbers:test", "numbers:test holds no sentence pairs")):
            with pytest.raises(UserError, match=f"^{message}$"):
                run.evaluate(spec, beam=1)
    code, out, err = run_cli(evaluate.main, capsys, "--run-dir", str(tiny_torch_run), "--data", "numbers:test")
    assert (code, out, err) == (1, "", "error: numbers:test holds no sentence pairs\n")


def test_evaluate_scores_lowercased_bleu_for_a_lowercased_run_as_the_command_does(run_copy):
    """aiayn evaluate adds bleu_lc for a run trained with --lowercase; Run.evaluate left it out."""
    import json

    import train

    config = json.loads((run_copy / "config.json").read_text())
    (run_copy / "config.json").write_text(json.dumps({**config, "lowercase": True}))
    with train.load(run_copy) as run:
        assert "bleu_lc" in run.evaluate([data.number_words(7)], beam=1)


def test_evaluate_refuses_what_is_not_a_list_of_pairs(tiny_torch_run):
    """One pair alone, or a pair of three, was a ValueError: 'too many values to unpack (expected 2)'."""
    import train
    from train.runtime import UserError

    with train.load(tiny_torch_run) as run:
        for pairs in (data.number_words(7), [(*data.number_words(7), "x")]):
            with pytest.raises(UserError, match=r"^pairs: give a data spec or a list of \(source, target\) pairs, got \["):
                run.evaluate(pairs, beam=1)
        assert run.evaluate([list(data.number_words(7))], beam=1)["sentences"] == 1


def test_evaluate_takes_a_data_file_as_a_path(tiny_torch_run, tmp_path):
    """evaluate(tmp_path / "pairs.tsv") was taken for a list of pairs: "'PosixPath' object is not iterable"."""
    import train

    rows = [data.number_words(n) for n in (7, 43)]
    (tmp_path / "pairs.tsv").write_text("source\ttarget\n" + "".join(f"{s}\t{t}\n" for s, t in rows))
    with train.load(tiny_torch_run) as run:
        result = run.evaluate(tmp_path / "pairs.tsv", beam=1)
    assert (result["data"], result["sentences"]) == (str(tmp_path / "pairs.tsv"), 2)
