"""`python -m train.translate --run-dir DIR [--input FILE]` (`aiayn translate`): translate with a trained run.

One output record per input line (FILE, or any readable stream: `data.LineReader`), in input order,
with the run's backend and checkpoint (best by validation BLEU by default): the translation, or with
--format tsv|jsonl n-best lists with scores and alignments; --sample draws random translations, and
several --run-dir translate with an ensemble of runs (docs/decoding.md). The input streams
through in chunks of --chunk-lines lines, each translated (`Run.translate`) and written before
the next is read; --output is written resumably (`runtime.output.PartialOutput`).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import itertools
import os
import sys
from pathlib import Path

from .api import load
from .backends.host_devices import HELP as HOST_DEVICES_HELP
from .backends.host_devices import split_host
from .backends.jax_cache import HELP as JAX_CACHE_HELP
from .config import add_run_arguments, positive_int
from .data.streams import MAX_LINE_BYTES, LineReader
from .runtime import Interrupted, exit_status, interruptible
from .runtime.files import UserError, error_text
from .runtime.output import OtherInput, PartialOutput, Progress, StreamOutput, destination, open_stream
from .runtime.rundir import check_set_aside
from .translation import FORMATS, Sampling, TsvColumns, check_format, check_sampling, check_search, translate_stream

CHUNK_LINES = 4000


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m train.translate",
        description="Translate sentences (one per line) with a run trained by `python -m train.run`. "
        "Cached beam search (greedy with --beam 1); the backend (jax or torch) is the one the run was "
        "trained with. Sources longer than the model's max_len are cut to it (counted on stderr). The input "
        "streams through in chunks, each written in input order as it finishes.",
        epilog=f"{HOST_DEVICES_HELP}. {JAX_CACHE_HELP}.",
    )
    add_run_arguments(parser, ensembles=True)
    parser.add_argument("--input", type=Path, help="one source sentence per line: a file (plain, or gzip when named "
                        ".gz), a FIFO, /dev/stdin or <(command); default: stdin")
    parser.add_argument("--output", type=Path,
                        help="write translations here instead of stdout: through .OUTPUT.partial, renamed onto OUTPUT "
                        "at the end (a symbolic link's target); an interrupted run (Ctrl-C, SIGTERM, a crash) leaves "
                        "OUTPUT as it was and the same command continues after the finished chunks. A FIFO, device, "
                        "socket or /dev/fd/N (>(command)) is written directly, as a stream: no partial file, no resume")
    parser.add_argument("--chunk-lines", type=positive_int, default=CHUNK_LINES,
                        help=f"lines read, translated and written at a time (default {CHUNK_LINES}); memory grows "
                        "with this, not with the input")
    parser.add_argument("--max-line-bytes", type=positive_int, default=MAX_LINE_BYTES,
                        help=f"refuse a line longer than this, naming it (default {MAX_LINE_BYTES:,}, 1 MiB)")
    parser.add_argument("--no-progress", dest="progress", action="store_false",
                        help="no progress line on stderr (shown only when stderr is a terminal); the summary stays")
    parser.add_argument("--devices", type=positive_int, help="jax runs: decode each batch data parallel over the first "
                        "N devices (default: every visible device, on a CPU one per core: see below); a torch run "
                        "translates on one device and refuses N > 1")
    parser.add_argument("--coordinator-address", metavar="HOST:PORT",
                        help="jax multi-process translation, as train.run's: every process reads the whole input, "
                        "process 0 writes; default: $JAX_COORDINATOR_ADDRESS, else a single process")
    parser.add_argument("--num-processes", type=positive_int, help="jax multi-process: number of processes")
    parser.add_argument("--process-id", type=int, help="jax multi-process: this process's id, 0..N-1")
    parser.add_argument("--batch-size", type=positive_int,
                        help="at most N sentences per batch; default: as many as the run's --token-budget")
    parser.add_argument("--plot-attention", type=Path, metavar="DIR",
                        help="also write each sentence's cross-attention heatmaps to DIR (created): NNNN.png for input "
                        "line N (the last decoder layer, heads averaged) and NNNN_layers.png (every layer x head); "
                        "translations are written as usual")
    parser.add_argument("--input-format", choices=("text", "tsv"),
                        help="text: one source sentence per line; tsv: a header row naming the columns 'source' and, "
                        "optionally, 'prefix' (each output's forced start: the search continues after it), then one "
                        "row per sentence (default: tsv for an --input named .tsv or .tsv.gz, else text)")
    parser.add_argument("--n-best", type=positive_int, metavar="K",
                        help="the K best translations of each sentence, best first (K <= --beam; with --format tsv or "
                        "jsonl)")
    parser.add_argument("--format", choices=FORMATS, default="text",
                        help="text (default): the best translation; tsv: per hypothesis its text, log-probability and "
                        "length-normalised score, tab-separated; jsonl: a JSON object with the hypotheses, their "
                        "scores and target tokens. Always one line per input line")
    parser.add_argument("--alignments", action="store_true",
                        help="with --format jsonl: one source position per target token (the argmax of the last "
                        "decoder layer's cross-attention averaged over heads), and the source tokens")
    group = parser.add_argument_group("sampling", "random translations instead of the search (docs/decoding.md#sampling)")
    group.add_argument("--sample", action="store_true",
                       help="draw each token at random from the model's distribution instead of searching (--beam "
                       "and --alpha unused; --scoring hf, --n-best and prefixes refused: a sample is not ranked); with "
                       "--format tsv/jsonl each sample's log-probability (its score too)")
    group.add_argument("--num-samples", type=int, default=1, metavar="N",
                       help="N samples per sentence (default 1; N > 1 with --format tsv or jsonl)")
    group.add_argument("--temperature", type=float, metavar="T",
                       help="divide the log-probabilities by T > 0 before drawing (default 1; < 1 sharper)")
    group.add_argument("--top-k", type=int, metavar="K", help="draw among the K most probable tokens (default 0: all)")
    group.add_argument("--top-p", type=float, metavar="P",
                       help="draw among the most probable tokens whose probabilities reach P, in (0, 1] (default 1: all)")
    group.add_argument("--seed", type=int, metavar="S",
                       help="the random numbers' seed, in [0, 2**32) (default 0): the same seed gives the same "
                       "samples, in the jax and torch backends alike, whatever the batching")
    # The benchmark needs both frameworks on one set of weights, so it lives in `parity`: say where.
    parser.add_argument("--benchmark", action="store_true", help=argparse.SUPPRESS)
    return parser


def sampling_settings(args: argparse.Namespace) -> Sampling | None:
    """The --sample settings, or None without --sample; UserError for a sampling flag without it."""
    given = [flag for flag, value in (("--num-samples", args.num_samples != 1), ("--temperature", args.temperature),
                                      ("--top-k", args.top_k), ("--top-p", args.top_p), ("--seed", args.seed))
             if value is not None and value is not False]  # --seed 0 and --top-k 0 are given too
    if not args.sample:
        if given:
            raise UserError(f"{', '.join(given)} without --sample: sampling settings, the searches take none")
        return None
    chosen = {k: getattr(args, k) for k in ("seed", "temperature", "top_k", "top_p")}
    return Sampling(num_samples=args.num_samples, **{k: v for k, v in chosen.items() if v is not None})


def sampling_options(sample: Sampling | None, fmt: str) -> dict:
    """`Run.translate`'s keywords for `sample`: each sample's scores too when the format writes them."""
    if sample is None:
        return {}
    return {"sample": True, **dataclasses.asdict(sample), "hypotheses": fmt != "text"}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.benchmark:
        parser.exit(2, "error: the translation benchmark is `python -m parity.translate_bench --run-dir RUN --input "
                       "FILE [--beam K] [--ctranslate2]`: it runs both frameworks (and CTranslate2) on the run's weights\n")

    try:
        sample = sampling_settings(args)
        check_search(args.beam, args.n_best)
        check_sampling(sample, args.n_best, False, args.scoring)
        check_format(args.format, args.n_best, args.alignments, sample.num_samples if sample else 1)
        ensemble = len(args.run_dir) > 1
        if ensemble and (args.alignments or args.plot_attention is not None):
            raise UserError(f"{'--alignments' if args.alignments else '--plot-attention'} with several --run-dir: an "
                            "ensemble's members' attention weights are not one alignment")
        split_host()  # before jax is imported
        reader = LineReader(args.input, args.max_line_bytes)
        first = next(reader, None)  # read before the run loads: bad input fails fast
        columns = None
        tsv = args.input is not None and args.input.name.endswith((".tsv", ".tsv.gz"))
        if (args.input_format or ("tsv" if tsv else "text")) == "tsv":
            if first is None:
                raise UserError(f"{reader.name} is empty: TSV input needs a header row")
            columns, first = TsvColumns(first, reader.name), next(reader, None)
            if sample is not None and columns.prefix is not None:
                raise UserError(f"--sample with {reader.name}'s prefix column: forced prefixes are for the searches")
        if args.plot_attention is not None:
            from .attention import check_plot_directory

            check_plot_directory(args.plot_attention, args.input)
        # What else shapes the output, recorded where it departs from plain text (earlier partial outputs stay valid).
        decoding = {k: v for k, v in {"n_best": args.n_best, "format": args.format, "alignments": args.alignments,
                                      "prefix": columns is not None and columns.prefix is not None,
                                      "sample": sample and dataclasses.asdict(sample),
                                      "ensemble": ensemble and [str(d.absolute()) for d in args.run_dir[1:]]}.items()
                    if v not in (None, "text", False)}
        # Checked before the work, not after it; None: a stream, written directly.
        target = (output := destination(args.output, "--output")) and output.target
        if output is not None and any(reader.same_file(f) for f in output.side_files):
            raise UserError(f"--output {args.output} is the input {reader.name}: writing it would destroy the input "
                            "(or a file written beside it); give another --output")
        for run_dir in args.run_dir:
            check_set_aside(run_dir)
        run = load(args.run_dir, args.checkpoint, devices=args.devices, average=args.ensemble_average,
                   coordinator_address=args.coordinator_address, num_processes=args.num_processes,
                   process_id=args.process_id)
        if first is None:
            raise UserError(f"{reader.name} holds no sentence to translate")
        topology = run.backend.topology
        if not topology.is_main:  # every process translates alike; process 0 alone writes
            out = StreamOutput(open(os.devnull, "w"))  # noqa: SIM115 (closed at the end)
        elif target is None:  # standard output, or a stream written directly
            out = StreamOutput(args.output and open_stream(args.output))
        else:
            out = PartialOutput(target, {"run_dir": str(args.run_dir[0].absolute()), "step": run.backend.step,
                                         "weights": run.weights_digest(), "beam": args.beam,
                                         "alpha": args.alpha, "scoring": args.scoring, **decoding})
    except (UserError, OSError, ValueError) as err:
        parser.exit(1, f"error: {error_text(err)}\n")
    if out.note:
        print(out.note, file=sys.stderr)
    progress = Progress(args.progress and topology.is_main and sys.stderr.isatty(), reader.fraction)
    counts: collections.Counter = collections.Counter()
    try:
        with interruptible():
            skipped = translate_stream(
                run, itertools.chain([first], reader), out, chunk_lines=args.chunk_lines, progress=progress,
                counts=counts, plot_attention=args.plot_attention, fmt=args.format, columns=columns,
                batch_size=args.batch_size, beam=args.beam, alpha=args.alpha, scoring=args.scoring,
                n_best=args.n_best, alignments=args.alignments, **sampling_options(sample, args.format))
        out.finish()
    except (Interrupted, KeyboardInterrupt) as stop:
        signum = getattr(stop, "signum", 2)
        progress.clear()
        kept = f"; {out.kept()}" if out.done and isinstance(out, PartialOutput) else ""
        print(f"interrupted ({Interrupted(signum)}) after {out.done:,} input lines{kept}", file=sys.stderr)
        return 128 + signum
    except (UserError, OSError) as err:  # bad input further on, a full disk: the chunks before it are kept
        progress.clear()
        resumable = out.done and isinstance(out, PartialOutput) and not isinstance(err, OtherInput)
        kept = f" ({out.kept()})" if resumable else ""
        print(f"error: {error_text(err)}{kept}", file=sys.stderr)
        return 1
    finally:
        reader.close()
        run.close()  # an ensemble's members too
        out.close()
    progress.clear()
    if topology.is_main:
        cut = f"; {counts['cut']:,} cut to the model's {run.config.max_len} tokens" if counts["cut"] else ""
        resumed = f"; continued after line {skipped:,}" if skipped else ""
        devices = f" on {topology.num_devices} devices" if topology.num_devices > 1 else ""
        print(progress.summary() + devices + cut + resumed, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(exit_status(main))
