"""The corpus store's build says what it is doing where no bar is drawn (output piped, --no-progress): the
tokenizers' sample read, the tokenizers trained, then the pairs tokenized with their total, rate and time left."""

import os
import re
import subprocess
import sys
from pathlib import Path

from train import data
from train.config import ExperimentConfig
from train.data import corpus_store

REPO = Path(__file__).resolve().parents[2]


def _corpus(tmp_path: Path, size: int) -> str:
    pairs = data.numbers_corpus(size, 10, 0, seed=5).train
    (tmp_path / "c.de").write_text("".join(s + "\n" for s, _ in pairs))
    (tmp_path / "c.en").write_text("".join(t + "\n" for _, t in pairs))
    return f"de:en:{tmp_path}/c"


def test_a_piped_run_says_what_the_store_build_does(tmp_path):
    spec = _corpus(tmp_path, 300)
    result = subprocess.run(
        [sys.executable, "-m", "train.run", "--backend", "torch", "--preset", "tiny", "--train", spec,
         "--valid", "numbers:valid", "--vocab-size", "300", "--steps", "1", "--eval-sentences", "2",
         "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO), "AIAYN_DATA_CACHE": str(tmp_path / "cache")})
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    told = [re.sub(r"\d+\.\d s|[\d,]+ pairs/s|\d\d:\d\d elapsed", "#", line) for line in lines[:6]]
    assert told == [
        f"reading {spec} for the tokenizers' sample...",
        f"reading {spec} for the tokenizers' sample: 300 pairs, #, #",
        "training one joint tokenizer (byte-level BPE, up to 300 tokens) on 300 of 300 pairs",
        "tokenizers trained in #",
        f"tokenizing {spec} into its store: 300 pairs",  # the total, from the sample's pass over the corpus
        f"tokenizing {spec} into its store: 300/300 pairs (100%), #, #",
    ], lines[:8]


def test_no_progress_keeps_a_line_every_few_seconds(tmp_path, monkeypatch, capsys):
    spec = _corpus(tmp_path, 300)
    monkeypatch.setenv("AIAYN_DATA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(corpus_store.sys.stderr, "isatty", lambda: True)  # a terminal, where a bar would be drawn
    monkeypatch.setattr(corpus_store, "LINE_EVERY_S", 0.0)  # a line at every chunk
    monkeypatch.setattr(corpus_store, "CHUNK", 100)
    cfg = ExperimentConfig(train=spec, valid="numbers:valid", vocab_size=300, progress=False)
    assert len(data.train_store(cfg, data.corpus_tokenizers(cfg))) == 300
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("tokenizing")]
    assert [re.sub(r"[\d,]+ pairs/s", "#", line) for line in lines] == [
        f"tokenizing {spec} into its store: 300 pairs",
        f"tokenizing {spec} into its store: 100/300 pairs (33%), #, 00:00 elapsed, 00:00 left",
        f"tokenizing {spec} into its store: 200/300 pairs (67%), #, 00:00 elapsed, 00:00 left",
        f"tokenizing {spec} into its store: 300/300 pairs (100%), #, 00:00 elapsed",  # once: the last count
    ]
    data.train_store(cfg, data.corpus_tokenizers(cfg))  # both opened from the cache: nothing to tell
    assert capsys.readouterr().out == ""
