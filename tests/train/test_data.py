"""Tests for train/data/: numbers corpus, parallel-file loaders, tokenizers and batches."""

import dataclasses
import gzip
import json
from pathlib import Path

import numpy as np
import pytest
from num2words import num2words

from train import data
from train.config import ExperimentConfig
from train.data import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Batcher

MULTI30K = Path(__file__).parents[2] / ".." / "shared" / "data" / "multi30k"
needs_multi30k = pytest.mark.skipif(
    not MULTI30K.is_dir(), reason=f"Multi30k not found at {MULTI30K} (the shared data directory is absent)"
)


@pytest.fixture(scope="module")
def corpus():
    return data.numbers_corpus(train_size=3000, valid_size=200, test_size=200, seed=0)


@pytest.fixture(scope="module")
def tokenizers(corpus):
    return data.train_tokenizers(corpus.train, vocab_size=400)


@pytest.fixture(scope="module")
def examples(corpus, tokenizers):
    return data.encode_pairs(tokenizers, corpus.train)


# ----------------------------------------------------------------------------------------------
# Numbers corpus


@pytest.mark.parametrize(
    "n, german, english",
    [
        (0, "null", "zero"),
        (7, "sieben", "seven"),
        (43, "dreiundvierzig", "forty-three"),
        (101, "einhunderteins", "one hundred and one"),
        (1000, "eintausend", "one thousand"),
        (1001, "eintausendeins", "one thousand and one"),
        (21000, "einundzwanzigtausend", "twenty-one thousand"),
        (101000, "einhunderteinstausend", "one hundred and one thousand"),  # num2words' own spelling
        (100100, "einhunderttausendeinhundert", "one hundred thousand, one hundred"),
        (
            999999,
            "neunhundertneunundneunzigtausendneunhundertneunundneunzig",
            "nine hundred and ninety-nine thousand, nine hundred and ninety-nine",
        ),
    ],
)
def test_number_words_examples(n, german, english):
    assert data.number_words(n) == (german, english)


@pytest.mark.parametrize(
    "n, german",
    [(100, "hundert"), (103, "hundertdrei"), (1000, "tausend"), (1100, "tausendeinhundert"),
     (101000, "hunderteinstausend"), (200, "zweihundert"), (43, "dreiundvierzig"), (21000, "einundzwanzigtausend")],
)
def test_number_words_without_the_leading_ein(n, german):
    # Only a leading "ein" before hundert/tausend goes; the English and every other number stay.
    assert data.number_words(n, drop_ein=True) == (german, data.number_words(n)[1])


def test_numbers_corpus_spells_a_leading_hundred_and_thousand_both_ways():
    corpus = data.numbers_corpus(train_size=40_000, valid_size=500, test_size=1000, seed=0)
    for split in (corpus.train, corpus.valid, corpus.test):
        short = sum(s.startswith(("hundert", "tausend")) for s, _ in split)
        long = sum(s.startswith(("einhundert", "eintausend")) for s, _ in split)
        # About half each (a coin per number): 1,507 and 1,442 in train, 41 and 25 in test.
        assert short > 0.3 * (short + long) and long > 0.3 * (short + long), (short, long)
        for source, english in split:  # every source is one of its number's two spellings
            n = data.number_from_english(english)
            assert source in {data.number_words(n)[0], data.number_words(n, drop_ein=True)[0]}
    # A repeated training number alternates: each 3-digit number from 100 to 199 not held out is
    # trained 15-16 times, so with both spellings.
    spellings = {}
    for source, english in corpus.train:
        if 100 <= data.number_from_english(english) < 200:
            spellings.setdefault(english, set()).add(source)
    assert len(spellings) > 50 and all(len(s) == 2 for s in spellings.values())


def test_number_words_equal_num2words():
    # The fast composition must reproduce num2words itself (checked once on all 10^6 numbers).
    numbers = np.random.default_rng(1).choice(1_000_000, 400, replace=False).tolist() + [1099, 2000, 201001, 999001]
    for n in numbers:
        assert data.number_words(n) == (num2words(n, lang="de"), num2words(n, lang="en")), n
    for bad in (-1, 1_000_000):
        with pytest.raises(ValueError):
            data.number_words(bad)


def test_numbers_corpus_deterministic_and_disjoint(corpus):
    assert (len(corpus.train), len(corpus.valid), len(corpus.test)) == (3000, 200, 200)
    assert data.numbers_corpus(3000, 200, 200, seed=0) == corpus
    assert data.numbers_corpus(3000, 200, 200, seed=1).train != corpus.train
    # A number's German words are one of its two spellings and valid and test hold each number once,
    # so distinct sources mean distinct numbers. Valid and
    # test hold distinct numbers (train repeats the small ones); across splits only the 100
    # numbers below 100 (all training numbers) recur.
    sources = [{s for s, _ in split} for split in (corpus.train, corpus.valid, corpus.test)]
    assert [len(s) for s in sources[1:]] == [200, 200]
    below_100 = {data.number_words(n)[0] for n in range(100)}
    train, valid, test = sources
    assert below_100 <= train and not (valid & train) - below_100 and not (test & train) - below_100
    assert not (valid & test) - below_100
    # valid/test do not move when only train_size changes, and a larger train adds numbers only.
    bigger = data.numbers_corpus(train_size=5000, valid_size=200, test_size=200, seed=0)
    assert (bigger.valid, bigger.test) == (corpus.valid, corpus.test)
    assert set(corpus.train) < set(bigger.train)
    with pytest.raises(ValueError):
        data.numbers_corpus(train_size=51 * 1_000_000, valid_size=1, test_size=0)  # > TRAIN_REPEATS x every number


# ----------------------------------------------------------------------------------------------
# Loaders


def _write(path: Path, text: str) -> Path:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as f:
        f.write(text)
    return path


@pytest.mark.parametrize("gz", [False, True])
def test_load_text_pair(tmp_path, gz):
    ext = ".gz" if gz else ""
    _write(tmp_path / f"train.de{ext}", 'Ein Hund.\n\n"Hallo", sagte er.\n  null  \nLetzte\n')
    _write(tmp_path / f"train.en{ext}", "A dog.\nempty source\n\"Hello,\" he said.\nzero\n\n")
    loaded = data.load_parallel(f"de:en:{tmp_path}/train", cache_dir=tmp_path / "cache")
    assert loaded.pairs == [("Ein Hund.", "A dog."), ('"Hallo", sagte er.', '"Hello," he said.'), ("null", "zero")]
    assert loaded.skipped_empty == 2


def test_load_text_pair_errors(tmp_path):
    _write(tmp_path / "x.de", "a\nb\nc\n")
    with pytest.raises(FileNotFoundError, match=r"x\.en or .*x\.en\.gz"):
        data.load_parallel(f"de:en:{tmp_path}/x")
    _write(tmp_path / "x.en.gz", "a\nb\n")
    with pytest.raises(ValueError, match=r"x\.de has 3 lines, .*x\.en\.gz has 2; line 3 of .*x\.de has no counterpart"):
        data.load_parallel(f"de:en:{tmp_path}/x", cache_dir=tmp_path / "cache")
    for spec in (f"{tmp_path}/x.de", f"{tmp_path}/x.csv", "de:en"):
        with pytest.raises(ValueError, match="unknown data spec"):
            data.load_parallel(spec)
    with pytest.raises(FileNotFoundError, match="missing.tsv"):
        data.load_parallel(f"{tmp_path}/missing.tsv")


@pytest.mark.parametrize("name", ["pairs.tsv", "pairs.tsv.gz"])
def test_load_tsv(tmp_path, name):
    rows = ["source\textra\ttarget", "null\t1\tzero", '"Hallo", sagte er\t2\t"Hello," he said', "NA\t3\t", "42\t4\t042"]
    path = _write(tmp_path / name, "\n".join(rows) + "\n")
    loaded = data.load_parallel(str(path), cache_dir=tmp_path / "cache")
    # "null"/"NA" stay text, quotes stay, numbers stay strings; the row with no target is skipped.
    assert loaded.pairs == [("null", "zero"), ('"Hallo", sagte er', '"Hello," he said'), ("42", "042")]
    assert loaded.skipped_empty == 1
    swapped = data.load_parallel(f"{path}#src=target,tgt=source", cache_dir=tmp_path / "cache")
    assert swapped.pairs[0] == ("zero", "null")
    with pytest.raises(ValueError, match="no column 'de'"):
        data.load_parallel(f"{path}#src=de", cache_dir=tmp_path / "cache")
    with pytest.raises(ValueError, match="bad column option"):
        data.load_parallel(f"{path}#source=de")


def test_load_jsonl(tmp_path):
    rows = [{"de": "eins", "en": "one"}, {"de": "zwei", "en": ""}, {"de": "drei", "en": "three"}]
    path = _write(tmp_path / "pairs.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    loaded = data.load_parallel(f"{path}#src=de,tgt=en", cache_dir=tmp_path / "cache")
    assert (loaded.pairs, loaded.skipped_empty) == ([("eins", "one"), ("drei", "three")], 1)
    with pytest.raises(ValueError, match="no field 'source'"):
        data.load_parallel(str(path), cache_dir=tmp_path / "cache")


def test_load_hub_dataset_from_local_directory(tmp_path):
    # The hf: path calls datasets.load_dataset(NAME, CONFIG, split=...); a local directory with a
    # README config stands in for the hub (no network here).
    rows = [{"translation": {"de": "vier", "en": "four"}}, {"translation": {"de": "fünf", "en": "five"}}]
    (tmp_path / "hub" / "de-en").mkdir(parents=True)
    _write(tmp_path / "hub" / "de-en" / "train.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    readme = "---\nconfigs:\n- config_name: de-en\n  data_files:\n  - split: train\n    path: de-en/train.jsonl\n---\n"
    _write(tmp_path / "hub" / "README.md", readme)
    cache = tmp_path / "cache"
    loaded = data.load_parallel(f"hf:{tmp_path}/hub:de-en:train", cache_dir=cache)
    assert loaded.pairs == [("vier", "four"), ("fünf", "five")]
    reverse = data.load_parallel(f"hf:{tmp_path}/hub:de-en:train[:1]#src=en,tgt=de", cache_dir=cache)
    assert reverse.pairs == [("four", "vier")]
    no_config = data.load_parallel(f"hf:{tmp_path}/hub/de-en:train#src=de,tgt=en", cache_dir=cache)
    assert no_config.pairs == loaded.pairs
    for bad in ("hf:only-a-name", "hf:a:b:c:d"):
        with pytest.raises(ValueError, match="hf:NAME"):
            data.load_parallel(bad)


# ----------------------------------------------------------------------------------------------
# Tokenizers


def test_tokenizer_special_ids_and_round_trip(corpus, tokenizers):
    tok = tokenizers.src
    assert tokenizers.joint and tokenizers.tgt is tok
    assert [tok.token_to_id(t) for t in ("<pad>", "<bos>", "<eos>", "<unk>")] == [PAD_ID, BOS_ID, EOS_ID, UNK_ID]
    assert tok.get_vocab_size() == 400
    texts = [s for pair in corpus.test for s in pair] + ["Größe: 3,5 € — ok?", "ünseen wörds ½"]
    ids = data.encode(tok, texts)
    assert all(row[-1] == EOS_ID and EOS_ID not in row[:-1] and UNK_ID not in row for row in ids)
    assert data.decode_batch(tok, ids) == texts
    # A German compound is split into subwords (what makes the task need attention).
    assert len(data.encode(tok, ["dreiundvierzig"])[0]) > 2
    # Decoding stops at the first eos and drops bos/pad.
    one = data.encode(tok, ["forty-three"])[0]
    assert data.decode(tok, np.array([BOS_ID, *one, *data.encode(tok, ["junk"])[0], PAD_ID])) == "forty-three"


def test_tokenizers_save_load(tmp_path, corpus, tokenizers):
    data.save_tokenizers(tokenizers, tmp_path / "joint")
    assert sorted(p.name for p in (tmp_path / "joint").iterdir()) == ["tokenizer.json"]
    loaded = data.load_tokenizers(tmp_path / "joint")
    assert loaded.joint and data.encode_pairs(loaded, corpus.valid) == data.encode_pairs(tokenizers, corpus.valid)

    separate = data.train_tokenizers(corpus.train, vocab_size=300, joint=False)
    assert not separate.joint
    data.save_tokenizers(separate, tmp_path / "sep")
    assert sorted(p.name for p in (tmp_path / "sep").iterdir()) == ["src_tokenizer.json", "tgt_tokenizer.json"]
    reloaded = data.load_tokenizers(tmp_path / "sep")
    src_vocab, tgt_vocab = reloaded.src.get_vocab(), reloaded.tgt.get_vocab()
    assert src_vocab != tgt_vocab and "tausend" in "".join(src_vocab) and "thousand" in "".join(tgt_vocab)
    assert data.encode_pairs(reloaded, corpus.valid) == data.encode_pairs(separate, corpus.valid)
    with pytest.raises(FileNotFoundError):
        data.load_tokenizers(tmp_path / "nothing")


def test_lowercase_tokenizer_and_splits(tmp_path):
    pairs = [("Ein Hund läuft über die Straße.", "A dog runs across the street.")] * 3
    src, tgt = tmp_path / "train.de", tmp_path / "train.en"
    src.write_text("\n".join(s for s, _ in pairs) + "\n", encoding="utf-8")
    tgt.write_text("\n".join(t for _, t in pairs) + "\n", encoding="utf-8")
    spec = f"de:en:{tmp_path}/train"
    cfg = ExperimentConfig(train=spec, valid=spec, test=spec, lowercase=True)
    splits = data.load_splits(cfg)
    lowered = ("ein hund läuft über die straße.", "a dog runs across the street.")
    assert splits.train == splits.valid == splits.test == [lowered] * 3
    assert data.load_splits(dataclasses.replace(cfg, lowercase=False)).train == pairs

    tokenizers = data.train_tokenizers(splits.train, vocab_size=300, lowercase=True)
    data.save_tokenizers(tokenizers, tmp_path / "run")
    tok = data.load_tokenizers(tmp_path / "run").src  # the normalizer is in tokenizer.json
    cased, lower = data.encode(tok, ["Ein HUND, Über."]), data.encode(tok, ["ein hund, über."])
    assert cased == lower and data.decode(tok, cased[0]) == "ein hund, über."
    plain = data.train_tokenizers(pairs, vocab_size=300).src
    assert data.encode(plain, ["Ein"]) != data.encode(plain, ["ein"])


# ----------------------------------------------------------------------------------------------
# Batches


def test_bucket_lengths():
    assert data.bucket_lengths(256) == (8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
    assert data.bucket_lengths(100) == (8, 16, 24, 32, 48, 64, 96, 100)
    assert data.bucket_lengths(5) == (5,)


def _all(batcher, epoch=0):
    return list(batcher.epoch_batches(epoch))


def test_batches_budget_shapes_and_contents(examples):
    budget = 1000
    batcher = Batcher(examples, token_budget=budget, max_len=64, seed=3)
    batches = _all(batcher)
    assert len(batches) == batcher.num_batches
    shapes = {b.src.shape for b in batches}
    assert shapes == set(batcher.shapes) and 2 <= len(shapes) <= len(data.bucket_lengths(64))
    seen = []
    for b in batches:
        size, length = b.src.shape
        assert b.src.dtype == b.tgt_in.dtype == b.tgt_out.dtype == np.int32
        assert b.tgt_out.shape == b.tgt_in.shape == (size, length) and length in data.bucket_lengths(64)
        assert size * length <= budget and (size + 1) * length > budget  # the largest batch that fits
        np.testing.assert_array_equal(b.tgt_in[:, 0], BOS_ID)
        np.testing.assert_array_equal(b.tgt_in[:, 1:], b.tgt_out[:, :-1])
        for row, i in enumerate(b.ids):
            if i < 0:  # filler row keeping the shape fixed
                assert not b.src[row].any() and not b.tgt_out[row].any()
                continue
            s, t = examples[i]
            assert b.src[row].tolist() == s + [PAD_ID] * (length - len(s))
            assert b.tgt_out[row].tolist() == t + [PAD_ID] * (length - len(t))
            # The smallest bucket that fits the longer side.
            assert max(len(s), len(t)) > max([x for x in data.bucket_lengths(64) if x < length], default=0)
        assert b.num_src_tokens == int((b.src != PAD_ID).sum())
        assert b.num_tgt_tokens == sum(len(examples[i][1]) for i in b.ids if i >= 0)
        seen += [int(i) for i in b.ids if i >= 0]
    # Every pair exactly once per epoch.
    assert sorted(seen) == list(range(len(examples)))
    assert sum(int((b.ids >= 0).sum()) for b in batches) == len(examples)


def test_batches_seeded_shuffle_and_resume(examples):
    def ids(batches):
        return [b.ids.tolist() for b in batches]

    a = Batcher(examples, token_budget=800, max_len=64, seed=5)
    b = Batcher(examples, token_budget=800, max_len=64, seed=5)
    first = [next(a) for _ in range(a.num_batches + 3)]  # runs into epoch 1
    assert ids(first) == ids(next(b) for _ in range(b.num_batches + 3))
    assert ids(first[: a.num_batches]) == ids(_all(a, 0))
    assert ids(first[a.num_batches :]) == ids(_all(a, 1))[:3]
    assert ids(_all(a, 0)) != ids(_all(a, 1))
    assert ids(_all(Batcher(examples, token_budget=800, max_len=64, seed=6))) != ids(_all(a, 0))
    assert a.state() == {"epoch": 1, "index": 3}

    # Resume from a JSON round trip of the state, mid-epoch, in a fresh Batcher.
    state = json.loads(json.dumps(a.state()))
    expected = [next(a) for _ in range(a.num_batches)]
    resumed = Batcher(examples, token_budget=800, max_len=64, seed=5)
    resumed.restore(state)
    got = [next(resumed) for _ in range(resumed.num_batches)]
    assert ids(got) == ids(expected)
    assert all(np.array_equal(x.src, y.src) and np.array_equal(x.tgt_in, y.tgt_in) for x, y in zip(got, expected))


def test_batches_multiple_of_drop_and_errors(examples):
    long_pair = ([5] * 70, [6] * 10)
    batcher = Batcher(list(examples) + [long_pair], token_budget=1000, max_len=64, multiple_of=8, shuffle=False)
    assert batcher.num_dropped == 1
    assert all(size % 8 == 0 and size * length <= 1000 for size, length in batcher.shapes)
    seen = [int(i) for b in _all(batcher) for i in b.ids if i >= 0]
    # shuffle=False: bucket by bucket, pairs in their given order; the too-long pair never appears.
    lengths = [max(len(s), len(t)) for s, t in examples]
    assert seen == sorted(range(len(examples)), key=lambda i: (np.searchsorted(data.bucket_lengths(64), lengths[i]), i))
    with pytest.raises(ValueError, match="needs at least 512"):
        Batcher(examples, token_budget=511, max_len=64, multiple_of=8)


# ----------------------------------------------------------------------------------------------
# Multi30k (read from ../shared, never copied)


@needs_multi30k
def test_multi30k_load_and_round_trip(tmp_path_factory):
    cache = tmp_path_factory.mktemp("hf_cache")
    train = data.load_parallel(f"de:en:{MULTI30K}/train", cache_dir=cache)
    val = data.load_parallel(f"de:en:{MULTI30K}/val", cache_dir=cache)
    assert (len(train.pairs), train.skipped_empty, len(val.pairs)) == (29000, 0, 1014)
    assert train.pairs[0] == (
        "Zwei junge weiße Männer sind im Freien in der Nähe vieler Büsche.",
        "Two young, White males are outside near many bushes.",
    )
    tokenizers = data.train_tokenizers(train.pairs, vocab_size=8000)
    assert tokenizers.src.get_vocab_size() == 8000
    for side in (0, 1):
        texts = [pair[side] for pair in val.pairs]
        assert data.decode_batch(tokenizers.src, data.encode(tokenizers.src, texts)) == texts
    batcher = Batcher(data.encode_pairs(tokenizers, val.pairs), token_budget=4096, max_len=128)
    # Val pairs are 6..49 tokens long (longer side, with eos): 6 buckets, hence 6 shapes to compile.
    assert batcher.num_dropped == 0 and [length for _, length in batcher.shapes] == [8, 16, 24, 32, 48, 64]
