"""Byte-level BPE tokenizers (HF `tokenizers`); encoding appends <eos>, decoding stops at the first."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from torch_reference.config import BOS_ID, EOS_ID, PAD_ID, SPECIAL_TOKENS, UNK_ID

from ..config import DEFAULT_TOKENIZER_SAMPLE
from ..runtime.files import UserError, quoted, write_bytes_atomic, write_text_atomic
from . import spm
from .corpora import Pair


@dataclasses.dataclass(frozen=True)
class Tokenizers:
    """Source and target tokenizers; the same object twice for a joint vocabulary."""

    src: Tokenizer
    tgt: Tokenizer

    @property
    def joint(self) -> bool:
        return self.src is self.tgt

    def __repr__(self) -> str:  # a tokenizer's own repr is its whole configuration and vocabulary
        if self.joint:
            return f"Tokenizers(joint, {self.src.get_vocab_size()} tokens)"
        return f"Tokenizers(source {self.src.get_vocab_size()} tokens, target {self.tgt.get_vocab_size()} tokens)"


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8000, lowercase: bool = False) -> Tokenizer:
    """A byte-level BPE tokenizer on `texts`: 4 special tokens, 256 bytes, merges up to `vocab_size`."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    if lowercase:
        tokenizer.normalizer = normalizers.Lowercase()
    # A prefix space: a first word tokenizes as mid-sentence; the Strip decoder removes it after the join.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tokenizer.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Strip(" ", 1, 0)])
    tokenizer.post_processor = processors.TemplateProcessing(single="$A <eos>", special_tokens=[("<eos>", EOS_ID)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # every byte: no <unk>, ever
    tokenizer.train_from_iterator(texts, trainer)
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == [PAD_ID, BOS_ID, EOS_ID, UNK_ID]
    return tokenizer


def sample(items: Iterable, size: int, seed: int = 0, chunk: int = 1 << 16) -> list:
    """`size` items drawn uniformly from a stream (reservoir sampling, seeded); all, in order, if no more."""
    items = iter(items)
    reservoir = list(itertools.islice(items, size))
    rng, seen = np.random.default_rng(seed), len(reservoir)
    while block := list(itertools.islice(items, chunk)):
        # item number i (0-based) replaces a random slot with probability size / (i + 1)
        slots = rng.integers(0, np.arange(seen + 1, seen + len(block) + 1))
        for item, slot in zip(block, slots.tolist()):
            if slot < size:
                reservoir[slot] = item
        seen += len(block)
    return reservoir


def train_tokenizers(pairs: Iterable[Pair], vocab_size: int = 8000, joint: bool = True, lowercase: bool = False,
                     sample_size: int = DEFAULT_TOKENIZER_SAMPLE) -> Tokenizers:
    """Tokenizers trained on the pairs, or a seed-0 sample of `sample_size` of them (any seed, one vocabulary)."""
    pairs = sample(pairs, sample_size)
    sources, targets = [s for s, _ in pairs], [t for _, t in pairs]
    if joint:
        tokenizer = train_tokenizer(sources + targets, vocab_size, lowercase)
        return Tokenizers(tokenizer, tokenizer)
    return Tokenizers(train_tokenizer(sources, vocab_size, lowercase), train_tokenizer(targets, vocab_size, lowercase))


def encode(tokenizer: Tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text, ending with <eos>; UserError for a text that is not a string."""
    texts = list(texts)
    for number, text in enumerate(texts, start=1):
        if not isinstance(text, str):  # the tokenizer's own TypeError names none of it
            raise UserError(f"text {number} is {quoted(text)} ({type(text).__name__}), not a string")
    if isinstance(tokenizer, Tokenizer):  # typed "<pad>", "<eos>", "<bos>", "<unk>" is text, never a control id
        tokenizer.encode_special_tokens = True
    return [e.ids for e in getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)(texts)]  # fast: no offsets


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
    return list(zip(encode(tokenizers.src, [s for s, _ in pairs]), encode(tokenizers.tgt, [t for _, t in pairs])))


JOINT_TOKENIZER, SRC_TOKENIZER, TGT_TOKENIZER = "tokenizer.json", "src_tokenizer.json", "tgt_tokenizer.json"
TOKENIZER_FILES = (JOINT_TOKENIZER, SRC_TOKENIZER, TGT_TOKENIZER)  # with tokenizer_files(): the spm kind's too


def save_tokenizers(tokenizers: Tokenizers, run_dir: str | Path) -> None:
    """run_dir/tokenizer.json (joint) or src_ and tgt_tokenizer.json; SentencePiece ones as sentencepiece.json."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if isinstance(tokenizers.src, spm.SentencePieceTokenizer):
        spm.save(tokenizers.src, tokenizers.tgt, run_dir, write_bytes_atomic)
    elif tokenizers.joint:
        write_text_atomic(run_dir / JOINT_TOKENIZER, tokenizers.src.to_str())
    else:
        write_text_atomic(run_dir / SRC_TOKENIZER, tokenizers.src.to_str())
        write_text_atomic(run_dir / TGT_TOKENIZER, tokenizers.tgt.to_str())


def load_tokenizers(run_dir: str | Path, joint: bool | None = None) -> Tokenizers:
    """Read what `save_tokenizers` wrote (`joint`: which); FileNotFoundError, or ValueError for a bad one."""
    run_dir = Path(run_dir)
    if (run_dir / spm.SPM_TOKENIZER).is_file():
        return Tokenizers(*spm.load(run_dir))
    if joint is None:
        joint = (run_dir / JOINT_TOKENIZER).is_file()
    if joint:
        tokenizer = _read_tokenizer(run_dir / JOINT_TOKENIZER)
        return Tokenizers(tokenizer, tokenizer)
    return Tokenizers(*(_read_tokenizer(run_dir / name) for name in (SRC_TOKENIZER, TGT_TOKENIZER)))


def tokenizer_files(run_dir: str | Path) -> list[str]:
    """The names of the tokenizer files present in `run_dir` (what a copy of the run must carry)."""
    run_dir = Path(run_dir)
    names = [name for name in TOKENIZER_FILES if (run_dir / name).is_file()]
    if (run_dir / spm.SPM_TOKENIZER).is_file():
        names += spm.files(run_dir)
    return names


def _read_tokenizer(path: Path) -> Tokenizer:
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for unreadable JSON
        raise ValueError(f"{path} is not a readable tokenizer ({err})") from None
