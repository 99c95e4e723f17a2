"""Moses-tokenized BLEU (aiayn evaluate --moses): the scoring of papers that quote tokenized BLEU."""

import math

from train.translation import corpus_scores, moses_tokenized


def test_moses_tokenizer_splits_clitics_and_punctuation_without_escaping():
    assert moses_tokenized(["It's a big dog.", 'Ein "Haus" & mehr.'], "en") == [
        "It 's a big dog .", 'Ein " Haus " & mehr .',
    ]


def test_tokenized_bleu_by_hand():
    """Tokens: It 's a big dog . / It 's a big cat . (6 each, so no brevity penalty).
    Matching n-grams: 5/6 unigrams, 3/5 bigrams, 2/4 trigrams, 1/3 4-grams; BLEU is their geometric
    mean, (5/6 * 3/5 * 2/4 * 1/3) ** (1/4) = (1/12) ** (1/4) = 0.537285. 13a keeps "It's" whole
    and has no matching 4-gram, so it differs."""
    scores = corpus_scores(["it's a big dog."], ["It's a big cat."], lowercase=True, moses="en")
    assert math.isclose(scores["bleu_moses_lc"], 100 * (1 / 12) ** 0.25, rel_tol=1e-12)
    assert scores["bleu_moses"] < scores["bleu_moses_lc"]  # "it" does not match "It" when cased
    assert scores["bleu_moses_lc_signature"].startswith("nrefs:1|case:lc|eff:no|tok:none|smooth:exp|version:")
    assert scores["bleu_moses_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:none|")
    assert scores["bleu_moses_signature"].endswith("|pretok:moses-en")
    assert abs(scores["bleu_lc"] - scores["bleu_moses_lc"]) > 5  # 13a: 42.73 here, the same output scored otherwise


def test_moses_scores_only_when_asked():
    scores = corpus_scores(["a b c d"], ["a b c d"])
    assert math.isclose(scores["bleu"], 100.0) and not any(key.startswith("bleu_moses") for key in scores)
    assert set(corpus_scores(["a b c d"], ["a b c d"], moses="de")) >= {"bleu_moses", "bleu_moses_signature"}


def test_moses_scoring_says_nothing_of_its_tokenized_input(caplog):
    """Moses-tokenized text ends in " ." on purpose: sacreBLEU's 'forgot to detokenize' warning
    (three lines per score, from 100 such lines on) would only be noise."""
    lines = ["Ein Mann schläft."] * 120
    with caplog.at_level("WARNING"):
        scores = corpus_scores(lines, lines, lowercase=True, moses="de")
    assert abs(scores["bleu_moses"] - 100) < 1e-9 and abs(scores["bleu_moses_lc"] - 100) < 1e-9  # exp(log) rounding
    assert [r.getMessage() for r in caplog.records] == []
