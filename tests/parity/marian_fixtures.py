"""Local HF Marian directories for the interop tests: no network.

A randomly initialised `transformers.MarianMTModel` saved with `save_pretrained`, beside
SentencePiece models trained here on a few hundred Multi30k lines and a `vocab.json` numbered as
OPUS-MT numbers its vocabularies (</s> 0, <unk> 1, the pieces, <pad> last). Skips when the
interop extra or the Multi30k files are missing.
"""

from __future__ import annotations

import functools
import gzip
import io
import json
from pathlib import Path

import pytest
import torch

# Where tests/conftest.py's `multi30k` fixture looks: ../shared/data/multi30k beside the repository.
MULTI30K = Path(__file__).resolve().parents[3] / "shared" / "data" / "multi30k"
OPUS_MT_DE_EN = dict(d_model=512, encoder_attention_heads=8, decoder_attention_heads=8, encoder_layers=6,
                     decoder_layers=6, encoder_ffn_dim=2048, decoder_ffn_dim=2048, vocab_size=58101)
LOPSIDED = dict(d_model=40, encoder_attention_heads=5, decoder_attention_heads=5, encoder_layers=3,
                decoder_layers=1, encoder_ffn_dim=24, decoder_ffn_dim=24)


def lines(name: str, n: int, skip: int = 0) -> list[str]:
    path = MULTI30K / name
    if not path.is_file():
        pytest.skip(f"Multi30k not found at {MULTI30K} (it lives in ../shared beside the repository)")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        out = [line.strip() for _, line in zip(range(skip + n), f)]
    return out[skip:]


@functools.lru_cache(maxsize=4)
def train_spm(texts: tuple[str, ...], vocab_size: int) -> bytes:
    """A unigram SentencePiece model (its bytes) trained on `texts`; cached across the tests."""
    sentencepiece = pytest.importorskip("sentencepiece")
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=model, vocab_size=vocab_size, model_type="unigram",
        character_coverage=1.0, minloglevel=2, num_threads=1,
    )
    return model.getvalue()


def spm_pieces(blob: bytes) -> list[str]:
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_proto=blob)
    return [sp.id_to_piece(i) for i in range(sp.get_piece_size()) if not (sp.is_control(i) or sp.is_unknown(i))]


def make_marian_dir(path: Path, seed: int = 0, shapes: dict | None = None, vocab_size: int | None = None,
                    shared: bool = True, spm_vocab: int = 400, eos_bias: float | None = None, **config) -> Path:
    """A MarianMTModel directory at `path`: random weights (final_logits_bias random too, so it
    matters), tokenizer files from Multi30k train. `vocab_size` pads the vocabulary with unused
    pieces up to that size (OPUS-MT's 58101). `eos_bias`: final_logits_bias at </s>, so that the
    random model ends sentences (at no particular length) instead of running to its limit."""
    transformers = pytest.importorskip("transformers")
    de, en = lines("train.de.gz", 500), lines("train.en.gz", 500)
    source, target = train_spm(tuple(de), spm_vocab), train_spm(tuple(en), spm_vocab)
    src_pieces, tgt_pieces = spm_pieces(source), spm_pieces(target)
    if shared:
        words = list(dict.fromkeys(src_pieces + tgt_pieces))
        src_words = tgt_words = words
    else:
        src_words, tgt_words = src_pieces, tgt_pieces

    def vocab(words):
        pieces = ["</s>", "<unk>", *words]
        if vocab_size is not None:
            pieces += [f"<unused{i}>" for i in range(vocab_size - 1 - len(pieces))]
        return {p: i for i, p in enumerate([*pieces, "<pad>"])}

    src_vocab, tgt_vocab = vocab(src_words), vocab(tgt_words)
    pad = len(src_vocab) - 1
    if not shared:  # Marian's pad id is one for both sides: the target's pad row at the same id
        assert len(tgt_vocab) <= len(src_vocab)
        tgt_vocab = {p: i for p, i in tgt_vocab.items() if p != "<pad>"}
        tgt_vocab.update({f"<unused_t{i}>": i for i in range(len(tgt_vocab), pad)})
        tgt_vocab["<pad>"] = pad
    hf = transformers.MarianConfig(
        **{**LOPSIDED, **(shapes or {})}, vocab_size=len(src_vocab), decoder_vocab_size=len(tgt_vocab),
        share_encoder_decoder_embeddings=shared, pad_token_id=pad, decoder_start_token_id=pad, eos_token_id=0,
        forced_eos_token_id=0, max_position_embeddings=512, activation_function="swish", scale_embedding=True,
        dropout=0.1, attention_dropout=0.0, **config,
    )
    torch.manual_seed(seed)
    model = transformers.MarianMTModel(hf).eval()
    with torch.no_grad():
        model.final_logits_bias.normal_(0.0, 0.5)
        if eos_bias is not None:
            model.final_logits_bias[0, 0] = eos_bias
    model.save_pretrained(str(path))
    (path / "source.spm").write_bytes(source)
    (path / "target.spm").write_bytes(target)
    (path / "vocab.json").write_text(json.dumps(src_vocab, ensure_ascii=False), encoding="utf-8")
    if not shared:
        (path / "target_vocab.json").write_text(json.dumps(tgt_vocab, ensure_ascii=False), encoding="utf-8")
    (path / "tokenizer_config.json").write_text(json.dumps({"separate_vocabs": not shared}))
    return path


@functools.lru_cache(maxsize=2)
def hf_model(path: Path):
    """MarianMTModel.from_pretrained(path) in eval mode (cached: the tests only read it)."""
    import transformers

    return transformers.MarianMTModel.from_pretrained(str(path)).eval()


@functools.lru_cache(maxsize=2)
def hf_tokenizer(path: Path):
    import transformers

    return transformers.MarianTokenizer.from_pretrained(str(path))
