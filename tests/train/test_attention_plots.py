"""`aiayn translate --plot-attention DIR` on a tiny run: the translations as without the
flag, one heatmap and one layer x head grid per sentence, the labels and weights behind them, and
the two backends' `cross_attention` equal on the same weights."""

import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import decoders

from train.interop.weights import transfer_state
import train
from train import data, loop, translation
from train.backends import create_backend
from train.commands import translate
from train.config import ExperimentConfig
from train.options import Search
from train.translate import attention

from .cli import run_cli

REPO = Path(__file__).resolve().parents[2]
LINES = ["dreiundvierzig", "", "siebenhundertdreiundvierzigtausendzweihundertelf"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 1-step torch run (1+1 layers, 4 heads): barely trained weights, the plumbing is what is
    tested. (The JAX side is its backend's `cross_attention`, compared below on the same weights;
    a JAX run would add only the compilation of its search.)"""
    run_dir = tmp_path_factory.mktemp("attention") / "run"
    cfg = ExperimentConfig(
        backend="torch", run_dir=str(run_dir), steps=1, numbers_train=300, numbers_valid=2, numbers_test=0,
        max_len=32, token_budget=512, model={"num_encoder_layers": 1, "num_decoder_layers": 1}, progress=False,
        samples=0, eval_sentences=2, beam=1, threads=1,  # one thread: no contention with pytest's other work
    )
    loop.train(cfg)
    return run_dir


def translate_cli(capsys, monkeypatch, *args: str) -> tuple[int, str, str]:
    return run_cli(translate.main, capsys, *args, stdin="\n".join(LINES).encode() + b"\n", monkeypatch=monkeypatch)


def png_size(path) -> tuple[int, int]:
    """(width, height) from a PNG's signature and IHDR chunk."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", path
    return struct.unpack(">II", head[16:24])


def test_plot_attention_writes_one_heatmap_and_one_grid_per_sentence(trained, tmp_path, capsys, monkeypatch):
    code, plain, err = translate_cli(capsys, monkeypatch, "--run-dir", str(trained), "--beam", "1")
    assert code == 0, err
    plots = tmp_path / "plots" / "new"  # created with its parent
    code, out, err = translate_cli(capsys, monkeypatch, "--run-dir", str(trained), "--beam", "1",
                                   "--plot-attention", str(plots))
    assert code == 0, err
    assert out == plain and len(out.split("\n")) == len(LINES) + 1  # translations as without the flag
    # Line 2 is empty: no sentence, no plot.
    assert sorted(p.name for p in plots.iterdir()) == ["0001.png", "0001_layers.png", "0003.png", "0003_layers.png"]
    assert f"wrote 4 attention plots for 2 sentences to {plots}" in err
    # Readable sizes (100 dpi, at least 4.5 x 3.5 inches; the long sentence's tokens widen it).
    sizes = {p.name: png_size(p) for p in plots.iterdir()}
    assert all(w >= 450 and h >= 350 for w, h in sizes.values())
    assert sizes["0003.png"][0] > sizes["0001.png"][0]


def test_sentence_attention_labels_and_weights(trained):
    run = train.load(trained, "latest")
    limits = dict(max_len=run.config.max_len, token_budget=run.config.token_budget, search=Search(beam=1))
    recorder = attention.AttentionRecorder(run.backend, run.tokenizers, LINES)
    hyps = translation.translate_texts(run.backend, run.tokenizers, LINES, on_batch=recorder, **limits)
    found = recorder.found
    assert [a.line for a in found] == [1, 3] and [a.translation for a in found] == [hyps[0], hyps[2]]
    layers, heads = run.model_config.num_decoder_layers, run.model_config.num_heads
    for att in found:
        src = data.encode(run.tokenizers.src, [att.source])[0]
        assert att.src_tokens == [attention.token_label(run.tokenizers.src, t) for t in src]
        assert att.src_tokens[-1] == "<eos>" and att.src_tokens[0].startswith("▁")  # the word's first token
        # The source's tokens, joined, are the sentence again.
        assert "".join(att.src_tokens[:-1]).replace("▁", " ").strip() == att.source
        assert att.weights.shape == (layers, heads, len(att.tgt_tokens), len(src))
        np.testing.assert_allclose(att.weights.sum(-1), 1.0, rtol=0, atol=len(src) * 2.0**-23)  # float32 sums
    # The JAX backend on the same weights computes the same attention (parity: float32 rounding).
    jax_backend = create_backend(run.config.replace(backend="jax"), run.model_config)
    transfer_state(run.backend, jax_backend)
    src = np.array([[5, 6, 7, data.EOS_ID], [8, data.EOS_ID, data.PAD_ID, data.PAD_ID]], np.int32)
    tgt_in = np.array([[data.BOS_ID, 9, 10], [data.BOS_ID, data.PAD_ID, data.PAD_ID]], np.int32)
    weights_t, weights_j = run.backend.cross_attention(src, tgt_in), jax_backend.cross_attention(src, tgt_in)
    assert weights_t.shape == weights_j.shape == (2, layers, heads, 3, 4)
    assert weights_t.dtype == weights_j.dtype == np.float32
    np.testing.assert_allclose(weights_j, weights_t, rtol=0, atol=1e-5)  # the bound of tests/parity/test_attention.py
    assert (weights_t[1, ..., 2:] == 0).all() and (weights_j[1, ..., 2:] == 0).all()  # padding


def test_token_labels_are_the_tokens_bytes_as_text(trained):
    """Every token of the run's vocabulary is labelled with the text `tokenizers`' own byte-level
    decoder gives it, a leading space as ▁; a byte that is part of a character is shown as \\xNN."""
    tokenizer = data.load_tokenizers(trained).src
    byte_level = decoders.ByteLevel()
    partial = 0
    for token, token_id in tokenizer.get_vocab().items():
        label = attention.token_label(tokenizer, token_id)
        if token_id < 4:
            assert label == token  # <pad>, <bos>, <eos>, <unk>
            continue
        text = byte_level.decode([token])
        if "\ufffd" in text:  # an incomplete UTF-8 sequence
            partial += 1
            assert "\\x" in label
        else:
            assert label == ("▁" + text[1:] if text.startswith(" ") else text)
    assert partial >= 128  # the alphabet's bytes 0x80-0xFF at least
    # "ö" is the two bytes C3 B6, the alphabet's characters "Ã" and "¶" (tokens in every vocabulary).
    assert [attention.token_label(tokenizer, tokenizer.token_to_id(c)) for c in "Ã¶"] == ["\\xc3", "\\xb6"]


def test_plot_attention_refuses_a_file(trained, tmp_path, capsys, monkeypatch):
    taken = tmp_path / "taken.png"
    taken.write_bytes(b"keep me")
    for target in (taken, taken / "sub"):
        args = ["--run-dir", str(trained), "--plot-attention", str(target)]
        code, out, err = translate_cli(capsys, monkeypatch, *args)
        assert code == 1 and out == ""
        assert err == f"error: --plot-attention {target}: {taken} exists and is not a directory\n"
    assert taken.read_bytes() == b"keep me"


def test_attention_module_loads_no_framework():
    """Plotting a torch run's attention never loads JAX, nor the reverse: train.translate.attention imports neither."""
    code = "import sys, train.translate.attention; print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'jax'}))"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
