"""Translate with a trained run: `python -m train.translate --run-dir DIR [--input FILE]`.

Reads one sentence per line from FILE (or stdin), writes one translation per line to stdout (or
--output), in input order. The run's config, tokenizer and checkpoint (best by validation BLEU
by default) select the backend and the weights.

`translate_texts` batches sentences by length bucket (a few padded shapes, so jit compiles a
handful of times), runs the backend's search and keeps their order. The speed of the searches,
JAX against torch on the same weights, is `python -m parity.translate_bench`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from torch_reference.config import SCORINGS

from . import data
from .backends import Translator
from .config import non_negative_float, positive_int  # noqa: F401 (positive_int: re-exported)
from .files import UserError, check_output_file, write_text_atomic
from .rundir import open_run


class EvaluationStopped(Exception):
    """A search or evaluation stopped between batches because its `stop` callable said so."""


def translate_texts(
    backend: Translator,
    tokenizers: data.Tokenizers,
    texts: Sequence[str],
    *,
    max_len: int,
    token_budget: int,
    batch_size: int | None = None,
    beam_size: int = 4,
    alpha: float = 0.6,
    scoring: str = "gnmt",
    stop: Callable[[], bool] | None = None,
    on_batch: Callable[..., None] | None = None,
) -> list[str]:
    """Detokenized translations of `texts`, in order (an empty or whitespace-only line translates
    to ""). `stop` is asked before each batch: True raises EvaluationStopped. `on_batch(indices,
    src, tokens)` sees each batch's search (`train.attention.AttentionRecorder`)."""
    src_ids = data.encode(tokenizers.src, list(texts))
    out = [""] * len(texts)
    for index, src in data.source_batches(src_ids, max_len, token_budget, batch_size):
        if stop is not None and stop():
            raise EvaluationStopped("translation stopped")
        tokens = backend.translate(src, beam_size, alpha, scoring=scoring)
        if on_batch is not None:
            on_batch(index, src, tokens)
        hyps = data.decode_batch(tokenizers.tgt, tokens)
        for row, i in enumerate(index):
            if i >= 0 and texts[i].strip():
                # A model may emit a newline byte: kept, it would make one input line several.
                out[i] = " ".join(data.split_lines(hyps[row].replace("\r", "\n")))
    return out


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """--run-dir, --checkpoint, --beam, --alpha and --scoring, shared by translate, evaluate and
    parity.translate_bench."""
    parser.add_argument(
        "--run-dir", required=True, type=Path, help="the run directory (holds config.json, tokenizer, checkpoints/)"
    )
    parser.add_argument(
        "--checkpoint", default="best", help="'best' (by validation BLEU, the default), 'latest', or a step number"
    )
    parser.add_argument("--beam", type=positive_int, default=4, help="beam size (default 4; 1 = greedy search)")
    parser.add_argument("--alpha", type=non_negative_float, default=0.6,
                        help="beam search's length penalty exponent (default 0.6): see --scoring")
    parser.add_argument("--scoring", choices=SCORINGS, default="gnmt",
                        help="how beam search ranks finished translations: 'gnmt' (the default) divides their "
                        "log-probability by ((5+len)/6)^alpha and lets an <eos> among the 2 x beam best candidates "
                        "finish; 'hf' divides by len^alpha, lets only an <eos> among the beam best finish and counts an "
                        "<eos> forced at the length limit as free, as HF transformers' generate(num_beams=beam, "
                        "length_penalty=alpha, early_stopping='never') does")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m train.translate",
        description="Translate sentences (one per line) with a run trained by `python -m train.run`. "
        "Cached beam search (greedy with --beam 1); the backend (jax or torch) is the one the run was "
        "trained with. Sources longer than the model's max_len are cut to it.",
    )
    add_run_arguments(parser)
    parser.add_argument(
        "--input", type=Path, help="text file, one source sentence per line (plain or .gz); default: stdin"
    )
    parser.add_argument("--output", type=Path, help="write translations here instead of stdout")
    parser.add_argument(
        "--batch-size", type=positive_int,
        help="at most N sentences per batch; default: as many as the run's --token-budget",
    )
    parser.add_argument(
        "--plot-attention", type=Path, metavar="DIR",
        help="also write each sentence's cross-attention heatmaps to DIR (created): NNNN.png for input line N (the "
        "last decoder layer, heads averaged) and NNNN_layers.png (every layer x head); translations are written as "
        "usual",
    )
    # The issue that asked for it named `train.translate --benchmark`; it lives in `parity` (it needs
    # both frameworks on one set of weights, and `train` does not import `parity`): say where.
    parser.add_argument("--benchmark", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.benchmark:
        parser.exit(2, "error: the translation benchmark is `python -m parity.translate_bench --run-dir RUN --input "
                       "FILE [--beam K] [--ctranslate2]`: it runs both frameworks (and CTranslate2) on the run's weights\n")

    try:
        lines = read_lines(args.input)
        if args.plot_attention is not None:
            from .attention import check_plot_directory

            check_plot_directory(args.plot_attention)
        if args.output is not None:  # checked before the work, not after it
            check_output_file(args.output, "--output")
        run = open_run(args.run_dir, args.checkpoint)
        if not lines:
            raise UserError(f"{args.input or 'standard input'} holds no sentence to translate")
    except (UserError, FileNotFoundError, ValueError) as err:
        parser.exit(1, f"error: {err}\n")
    cfg = run.config
    recorder = None
    if args.plot_attention is not None:  # the same translations, each sentence's attention recorded on the way
        from .attention import AttentionRecorder

        recorder = AttentionRecorder(run.backend, run.tokenizers, lines)
    hyps = translate_texts(
        run.backend, run.tokenizers, lines,
        max_len=cfg.max_len, token_budget=cfg.token_budget, batch_size=args.batch_size,
        beam_size=args.beam, alpha=args.alpha, scoring=args.scoring, on_batch=recorder,
    )
    if recorder is not None:
        recorder.plot(args.plot_attention)
    text = "".join(h + "\n" for h in hyps)
    if args.output is None:
        sys.stdout.write(text)
    else:
        write_text_atomic(args.output, text)
    return 0


def read_lines(path: Path | None) -> list[str]:
    """The lines of a UTF-8 text file (plain or .gz), or of stdin when `path` is None, split by
    the one rule of `data.split_lines` (at "\n" and "\r\n" only), so output line N is input line
    N. Invalid UTF-8 raises ValueError naming the byte offset and line; a missing file
    FileNotFoundError."""
    if path is None:
        raw = sys.stdin.buffer.read()
        try:
            return data.split_lines(raw.decode("utf-8"))
        except UnicodeDecodeError as err:
            line = raw[: err.start].count(b"\n") + 1
            raise ValueError(f"standard input: invalid UTF-8 at byte offset {err.start} (line {line}): {err.reason}") from None
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    return data.read_lines(path)

if __name__ == "__main__":
    sys.exit(main())
