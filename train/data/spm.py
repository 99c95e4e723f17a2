"""SentencePiece tokenizers in our numbering, for runs imported from Marian (as `MarianTokenizer` encodes)."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from torch_reference.config import EOS_ID, SPECIAL_TOKENS, UNK_ID

SPM_TOKENIZER = "sentencepiece.json"
INTEROP_INSTALL = 'pip install -e ".[interop]"'


def require(module: str, extra: str = "interop") -> Any:
    """Import an optional package of the `extra`, or fail with one line naming the install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        install = INTEROP_INSTALL.replace("interop", extra)
        raise ImportError(f"{module} is not installed; it comes with the {extra} extra: {install}") from None


@dataclasses.dataclass(frozen=True)
class Encoding:  # what data.encode reads of a tokenizers.Encoding
    ids: list[int]


class SentencePieceTokenizer:
    """Segment with a SentencePiece model and map the pieces to ids through `pieces` (the first 4 special): a
    leading `>>xx<<` language code one token, an unknown piece <unk>, <eos> last."""

    def __init__(self, model: bytes, pieces: Sequence[str], decode_model: bytes | None = None,
                 model_name: str = "source.spm", decode_model_name: str | None = None):
        spm = require("sentencepiece")
        self.model, self.decode_model = bytes(model), bytes(decode_model if decode_model is not None else model)
        self.model_name, self.decode_model_name = model_name, decode_model_name or model_name
        self._encoder = spm.SentencePieceProcessor(model_proto=self.model)
        self._decoder = self._encoder if self.decode_model == self.model else spm.SentencePieceProcessor(
            model_proto=self.decode_model)
        self.pieces = list(pieces)
        if len(self.pieces) <= UNK_ID:
            raise ValueError(f"a vocabulary needs the {len(SPECIAL_TOKENS)} special tokens first")
        self._ids: dict[str, int] = {}
        for i, piece in enumerate(self.pieces):
            self._ids.setdefault(piece, i)  # a piece listed twice (a copied special row) maps to its first id

    def encode(self, text: str) -> Encoding:
        code = []
        if text.startswith(">>") and (end := text.find("<<")) != -1:  # a language code: one token
            code, text = [text[: end + 2]], text[end + 2 :]
        pieces = code + self._encoder.encode(text, out_type=str)
        return Encoding([self._ids.get(p, UNK_ID) for p in pieces] + [EOS_ID])

    def encode_batch(self, texts: Iterable[str]) -> list[Encoding]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        special = len(SPECIAL_TOKENS)
        pieces = [self.pieces[i] for i in map(int, ids) if not (skip_special_tokens and i < special)]
        return self._decoder.decode_pieces(pieces).replace("\u2581", " ").strip()

    def get_vocab_size(self) -> int:
        return len(self.pieces)

    def id_to_token(self, i: int) -> str | None:
        return self.pieces[i] if 0 <= i < len(self.pieces) else None

    def describe(self) -> dict[str, Any]:
        return {"model": self.model_name, "decode_model": self.decode_model_name, "pieces": self.pieces}


def save(src: SentencePieceTokenizer, tgt: SentencePieceTokenizer, run_dir: str | os.PathLike, write) -> None:
    """run_dir/sentencepiece.json and the model files it names, through `write(path, bytes)`."""
    run_dir = Path(run_dir)
    for tok in (src, tgt):
        for name, blob in ((tok.model_name, tok.model), (tok.decode_model_name, tok.decode_model)):
            path = run_dir / name
            if not path.is_file() or path.read_bytes() != blob:
                write(path, blob)
    spec = json.dumps({"src": src.describe(), "tgt": tgt.describe()}, ensure_ascii=False)
    write(run_dir / SPM_TOKENIZER, spec.encode("utf-8"))


def files(run_dir: str | os.PathLike) -> list[str]:
    """The names of the files of a run's SentencePiece tokenizers (sentencepiece.json first)."""
    spec = json.loads((Path(run_dir) / SPM_TOKENIZER).read_text(encoding="utf-8"))
    names = [spec[side][key] for side in ("src", "tgt") for key in ("model", "decode_model")]
    return list(dict.fromkeys([SPM_TOKENIZER, *names]))  # each once, in order


def load(run_dir: str | os.PathLike) -> tuple[SentencePieceTokenizer, SentencePieceTokenizer]:
    """(source, target) tokenizers of run_dir/sentencepiece.json; ValueError when unreadable."""
    run_dir = Path(run_dir)
    try:
        spec = json.loads((run_dir / SPM_TOKENIZER).read_text(encoding="utf-8"))
        sides = [SentencePieceTokenizer((run_dir / s["model"]).read_bytes(), s["pieces"],
                                        (run_dir / s["decode_model"]).read_bytes(), s["model"], s["decode_model"])
                 for s in (spec["src"], spec["tgt"])]
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as err:
        raise ValueError(f"{run_dir / SPM_TOKENIZER} is not a readable SentencePiece tokenizer ({err})") from None
    return sides[0], sides[1]
