"""Training at the paper's scale (docs/scale.md): tokenizers from a bounded sample of a stream, and the
WMT14 recipe for a few steps on a generated WMT-shaped corpus."""

import importlib.util
import json
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import train
from train import data
from train.commands import run
from train.config import DEFAULT_TOKENIZER_SAMPLE, ExperimentConfig
from train.data.numbers import numbers_corpus
from train.data.vocab import sample

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("wmt_sized", REPO / "recipes" / "wmt_sized.py")
wmt_sized = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(wmt_sized)


def test_a_corpus_within_the_sample_size_trains_the_tokenizers_it_trained_before():
    pairs = numbers_corpus(1000, 10, 10).train
    before = data.train_tokenizer([s for s, _ in pairs] + [t for _, t in pairs], 300).to_str()  # no sample
    for size in (DEFAULT_TOKENIZER_SAMPLE, len(pairs)):
        assert data.train_tokenizers(pairs, 300, sample_size=size).src.to_str() == before
    assert data.train_tokenizers(iter(pairs), 300).src.to_str() == before  # from a stream
    separate = data.train_tokenizers(pairs, 300, joint=False, sample_size=len(pairs) + 1)
    assert separate.src.to_str() == data.train_tokenizer([s for s, _ in pairs], 300).to_str()
    drawn = sample(pairs, 300)  # a larger corpus: the tokenizers of the sample alone
    assert data.train_tokenizers(pairs, 300, sample_size=300).src.to_str() == data.train_tokenizer(
        [s for s, _ in drawn] + [t for _, t in drawn], 300).to_str() != before


def test_a_long_stream_is_sampled_uniformly_in_bounded_memory():
    n, size = 100_000, 1000
    tracemalloc.start()
    drawn = sample((f"sentence {i:07d}" for i in range(n)), size, seed=3, chunk=1024)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    # held: the reservoir and one chunk, 2,024 texts of 66 bytes (0.13 MB); the whole stream is 6.6 MB
    assert peak < 1e6, peak
    numbers = np.array([int(text.split()[1]) for text in drawn])
    assert len(set(numbers)) == size and numbers.min() >= 0 and numbers.max() < n
    # uniform: each tenth of the stream holds 10% of the draws, within 5 binomial standard deviations (4.7%)
    shares = np.bincount(numbers * 10 // n, minlength=10) / size
    assert np.abs(shares - 0.1).max() < 5 * np.sqrt(0.1 * 0.9 / size), shares
    assert sample(map(str, range(100_000)), 50, seed=3) == sample(map(str, range(100_000)), 50, seed=3)
    assert sample(map(str, range(100_000)), 50, seed=3) != sample(map(str, range(100_000)), 50, seed=4)


def test_the_sample_size_is_a_flag():
    cfg, given = run.parse_config(["--tokenizer-sample", "5000"])
    assert cfg.tokenizer_sample == 5000 and "tokenizer_sample" in given
    assert run.parse_config([])[0].tokenizer_sample == DEFAULT_TOKENIZER_SAMPLE
    with pytest.raises(ValueError, match="tokenizer_sample must be >= 1, got 0"):
        ExperimentConfig(tokenizer_sample=0)


def test_the_generated_corpus_has_wmt14s_sentence_length(tmp_path, multi30k):
    wmt_sized.generate(20_000, str(tmp_path / "train"), multi30k=multi30k)
    sides = [(tmp_path / f"train.{lang}").read_text(encoding="utf-8").split("\n")[:-1] for lang in ("en", "de")]
    assert len(sides[0]) == len(sides[1]) == 20_000
    # English sentences average WMT14's 25.8 words within 2% (the mean of 20,000 joins of 1-3 sentences)
    assert np.mean([len(s.split()) for s in sides[0]]) == pytest.approx(wmt_sized.WMT14_EN_WORDS, rel=0.02)


@pytest.mark.scale  # about 25 minutes: 4.5M pairs tokenized once, the base model's steps on the CPU; the recipe's settings
def test_the_wmt14_recipe_trains_on_a_corpus_of_wmt_size(tmp_path, multi30k, monkeypatch):  # fast: test_recipes.py
    """The recipe as written (base model, 37,000-token BPE, the paper's schedule), its data and steps
    replaced: two steps on a generated corpus of WMT14's size and sentence lengths (4.5 million pairs),
    in batches of 2,048 tokens (25,000 on the CPU would hold 10 GB: 25,000 x 37,000 logits are 3.7 GB a
    copy), by the torch twin (JAX's compile of the base model takes minutes on 2 CPUs; the twins'
    equality is tests/parity's), in a process of its own whose anonymous memory is measured."""
    cfg = run.parse_config(["--config", str(REPO / "recipes/wmt14-en-de-base.toml")])[0]
    assert (cfg.preset, cfg.vocab_size, cfg.token_budget, cfg.warmup, cfg.steps, cfg.keep_checkpoints, cfg.beam) == (
        "base", 37000, 25000, 4000, 100_000, 5, 4)
    assert cfg.train == "hf:wmt14:de-en:train#src=en,tgt=de" and cfg.test == "hf:wmt14:de-en:test#src=en,tgt=de"
    wmt_sized.generate(4_500_000, str(tmp_path / "train"), multi30k=multi30k)
    monkeypatch.setenv("AIAYN_DATA_CACHE", str(tmp_path / "cache"))
    fit = (f"import train; train.fit({str(REPO / 'recipes/wmt14-en-de-base.toml')!r}, train='en:de:{tmp_path / 'train'}', "
           f"valid='en:de:{multi30k / 'val'}', test=None, steps=2, eval_sentences=2, token_budget=2048, "
           f"backend='torch', run_dir='{tmp_path / 'run'}', progress=False)")
    measured = wmt_sized.measure([sys.executable, "-c", fit])
    print(json.dumps(measured))  # with -s: the figures docs/scale.md quotes
    assert measured["rc"] == 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["steps"] == 2 and np.isfinite(results["train"]["loss"])
    assert results["model"]["d_model"] == 512 and results["model"]["src_vocab_size"] > 8000  # base, a large BPE
    (stored,) = [p for p in (tmp_path / "cache").iterdir() if (p / "store.json").is_file()]
    assert json.loads((stored / "store.json").read_text())["pairs"] == 4_500_000
    # Measured 2026-11-28: 3,302 MiB, the BPE trainer's on its 2 million sampled sentences and the base model
    # with Adam, nothing of the corpus's size (docs/scale.md); 20% over it for the allocators' variation.
    assert measured["peak_rss_anon_mb"] < 4000
