"""Translate with a trained run: `python -m train.translate --run-dir DIR [--input FILE]`.

One translation per input line (FILE, or any readable stream: `data.LineReader`), in input order,
with the run's backend and checkpoint (best by validation BLEU by default). The input streams
through in chunks of --chunk-lines lines, each translated (`translate_texts`: batched by length
bucket, so jit compiles a handful of shapes) and written before the next is read; --output is
written resumably (`streaming.PartialOutput`; docs/operations.md#translating).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import itertools
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from torch_reference.config import SCORINGS

from . import data
from .backends import Translator
from .backends.host_devices import HELP as HOST_DEVICES_HELP
from .backends.host_devices import split_host
from .backends.jax_cache import HELP as JAX_CACHE_HELP
from .config import non_negative_float, positive_int  # noqa: F401 (positive_int: re-exported)
from .data.streams import MAX_LINE_BYTES, LineReader
from .files import UserError, check_output_file, error_text
from .rundir import open_run, read_experiment
from .streaming import Interrupted, OtherInput, PartialOutput, Progress, StreamOutput, interruptible

CHUNK_LINES = 4000


class EvaluationStopped(Exception):
    """A search or evaluation stopped between batches because its `stop` callable said so."""


def translate_texts(backend: Translator, tokenizers: data.Tokenizers, texts: Sequence[str], *, max_len: int,
                    token_budget: int, batch_size: int | None = None, beam_size: int = 4, alpha: float = 0.6,
                    scoring: str = "gnmt", stop: Callable[[], bool] | None = None,
                    on_batch: Callable[..., None] | None = None,
                    counts: collections.Counter | None = None) -> list[str]:
    """Detokenized translations of `texts`, in order (an empty or whitespace-only line translates
    to ""). `stop` is asked before each batch: True raises EvaluationStopped. `on_batch(indices,
    src, tokens)` sees each batch's search (`train.attention.AttentionRecorder`). `counts["cut"]`
    grows by the sources cut to max_len."""
    src_ids = data.encode(tokenizers.src, list(texts))
    if counts is not None:
        counts["cut"] += sum(len(ids) > max_len for ids in src_ids)
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
        "trained with. Sources longer than the model's max_len are cut to it (counted on stderr). The input "
        "streams through in chunks, each written in input order as it finishes.",
        epilog=f"{HOST_DEVICES_HELP}. {JAX_CACHE_HELP}.",
    )
    add_run_arguments(parser)
    parser.add_argument(
        "--input", type=Path, help="one source sentence per line: a file (plain, or gzip when named .gz), a FIFO, "
        "/dev/stdin or <(command); default: stdin",
    )
    parser.add_argument(
        "--output", type=Path, help="write translations here instead of stdout: through .OUTPUT.partial, renamed "
        "onto OUTPUT at the end; an interrupted run (Ctrl-C, SIGTERM, a crash) leaves OUTPUT as it was and the same "
        "command continues after the finished chunks",
    )
    parser.add_argument("--chunk-lines", type=positive_int, default=CHUNK_LINES,
                        help=f"lines read, translated and written at a time (default {CHUNK_LINES}); memory grows "
                        "with this, not with the input")
    parser.add_argument("--max-line-bytes", type=positive_int, default=MAX_LINE_BYTES,
                        help=f"refuse a line longer than this, naming it (default {MAX_LINE_BYTES:,}, 1 MiB)")
    parser.add_argument("--no-progress", dest="progress", action="store_false",
                        help="no progress line on stderr (shown only when stderr is a terminal); the summary stays")
    parser.add_argument(
        "--devices", type=positive_int,
        help="jax runs: decode each batch data parallel over the first N devices (default: every visible device, on a CPU "
        "one per core: see below); "
        "a torch run translates on one device and refuses N > 1",
    )
    parser.add_argument("--coordinator-address", metavar="HOST:PORT",
                        help="jax multi-process translation, as train.run's: every process reads the whole input, "
                        "process 0 writes; default: $JAX_COORDINATOR_ADDRESS, else a single process")
    parser.add_argument("--num-processes", type=positive_int, help="jax multi-process: number of processes")
    parser.add_argument("--process-id", type=int, help="jax multi-process: this process's id, 0..N-1")
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
        split_host(args.devices or 1)  # before jax is imported
        reader = LineReader(args.input, args.max_line_bytes)
        first = next(reader, None)  # read before the run loads: bad input fails fast
        if args.plot_attention is not None:
            from .attention import check_plot_directory

            check_plot_directory(args.plot_attention)
        if args.output is not None:  # checked before the work, not after it
            check_output_file(args.output, "--output")
        if (args.devices or 1) > 1 and read_experiment(args.run_dir).backend == "torch":
            raise UserError(f"--devices {args.devices}: a torch run translates on one device")
        launch = {"devices": args.devices, "coordinator_address": args.coordinator_address,
                  "num_processes": args.num_processes, "process_id": args.process_id}
        run = open_run(args.run_dir, args.checkpoint, launch={k: v for k, v in launch.items() if v is not None})
        if first is None:
            raise UserError(f"{reader.name} holds no sentence to translate")
    except (UserError, FileNotFoundError, ValueError) as err:
        parser.exit(1, f"error: {err}\n")
    topology = run.backend.topology
    settings = {"run_dir": str(args.run_dir.absolute()), "step": run.backend.step, "beam": args.beam,
                "alpha": args.alpha, "scoring": args.scoring}
    out = StreamOutput() if args.output is None else PartialOutput(args.output, settings)
    if not topology.is_main:  # every process translates alike; process 0 alone writes
        out = StreamOutput(open("/dev/null", "w"))  # noqa: SIM115 (for the life of the process)
    if out.note:
        print(out.note, file=sys.stderr)
    progress = Progress(args.progress and topology.is_main and sys.stderr.isatty(), reader.fraction)
    counts: collections.Counter = collections.Counter()
    try:
        with interruptible():
            skipped = _stream(run, itertools.chain([first], reader), out, args, progress, counts,
                              topology.process_count > 1)
        out.finish()
    except (Interrupted, KeyboardInterrupt) as stop:
        signum = getattr(stop, "signum", 2)
        progress.clear()
        kept = f"; {out.kept()}" if out.done and args.output is not None else ""
        print(f"interrupted ({Interrupted(signum)}) after {out.done:,} input lines{kept}", file=sys.stderr)
        return 128 + signum
    except (UserError, OSError) as err:  # bad input further on, a full disk: the chunks before it are kept
        progress.clear()
        kept = f" ({out.kept()})" if out.done and args.output is not None and not isinstance(err, OtherInput) else ""
        print(f"error: {error_text(err)}{kept}", file=sys.stderr)
        return 1
    finally:
        reader.close()
        run.backend.close()
    progress.clear()
    if topology.is_main:
        cut = f"; {counts['cut']:,} cut to the model's {run.config.max_len} tokens" if counts["cut"] else ""
        resumed = f"; continued after line {skipped:,}" if skipped else ""
        devices = f" on {topology.num_devices} devices" if topology.num_devices > 1 else ""
        print(progress.summary() + devices + cut + resumed, file=sys.stderr)
    return 0


def _stream(run, lines: Iterator[str], out, args, progress: Progress, counts: collections.Counter,
            multiprocess: bool) -> int:
    """Translate `lines` chunk by chunk into `out` (after the lines it already holds); the number
    of lines skipped because `out` held them."""
    digest = hashlib.sha256()  # of every input line up to the last finished chunk, for a resume's check
    done = out.done
    if multiprocess:  # process 0 alone knows what its output holds
        from jax.experimental import multihost_utils

        done = int(multihost_utils.broadcast_one_to_all(np.int64(done)))
    skipped = 0
    for line in itertools.islice(lines, done):
        digest.update(line.encode("utf-8", "surrogateescape") + b"\n")
        skipped += 1
    if done and (skipped < done or (out.digest is not None and digest.hexdigest() != out.digest)):
        raise OtherInput(f"{out.partial} holds the translations of other input (its first {done:,} lines differ "
                        "from these): delete it to start afresh")
    recorder, seen = None, [""] * skipped  # seen: the input lines so far, for the plots' line numbers
    if args.plot_attention is not None:  # the same translations, each sentence's attention recorded on the way
        from .attention import AttentionRecorder

        recorder = AttentionRecorder(run.backend, run.tokenizers, seen)
    progress.begin()
    cfg = run.config
    for chunk in _chunks(lines, args.chunk_lines):
        offset = len(seen)

        def on_batch(index, src, tokens, offset=offset):
            progress.on_batch(index, src, tokens)
            if recorder is not None:
                recorder(np.where(index >= 0, index + offset, -1), src, tokens)

        if recorder is not None:
            seen.extend(chunk)
        hyps = translate_texts(
            run.backend, run.tokenizers, chunk, max_len=cfg.max_len, token_budget=cfg.token_budget,
            batch_size=args.batch_size, beam_size=args.beam, alpha=args.alpha, scoring=args.scoring,
            on_batch=on_batch, counts=counts,
        )
        for line in chunk:
            digest.update(line.encode("utf-8", "surrogateescape") + b"\n")
        out.write(hyps, digest.hexdigest())
    if recorder is not None:
        recorder.plot(args.plot_attention)
    return skipped


def _chunks(lines: Iterable[str], size: int) -> Iterator[list[str]]:
    lines = iter(lines)
    while chunk := list(itertools.islice(lines, size)):
        yield chunk


def read_lines(path: Path | None, max_line_bytes: int = MAX_LINE_BYTES) -> list[str]:
    """Every line of a file (plain or .gz), any readable stream, or stdin when `path` is None,
    split by the one rule of `data.split_lines` (at "\\n" and "\\r\\n" only), so output line N is
    input line N. Any problem raises UserError naming the input (`data.streams.LineReader`)."""
    reader = LineReader(path, max_line_bytes)
    try:
        return list(reader)
    finally:
        reader.close()


if __name__ == "__main__":
    sys.exit(main())
