"""Translation speed, JAX against PyTorch on the same weights: `python -m parity.translate_bench`.

    python -m parity.translate_bench --run-dir RUN --input ../shared/data/multi30k/val.de.gz [--beam 4] [--json F]

Opens a run (either backend), moves its weights into the other framework (`convert_state`), and
times translating the input with JAX and torch cached search and torch's uncached loop (the
same search re-running the decoder over every prefix, as the seed repositories did), each greedy
and with --beam. Prints sentences/s, generated tokens/s, the speed-ups against torch cached and
against the uncached loop at the same beam, and for every row but the reference (torch cached)
how many sentences came out different from the reference's: 0 expected, the searches being the
same algorithm on the same weights. Each framework is timed under the allocator settings it has in
a process of its own: the JAX backend fixes glibc's thresholds for XLA (`train.backends.allocator`), which
made torch's cached beam search 1.6x slower in the same process, so torch and CTranslate2 run
under glibc's settled thresholds (`allocator.settled`). Both frameworks compute float32 matmuls in
full float32 (TF32 off: JAX's default on GPUs would otherwise round them to TF32 and change
outputs), and the machine line names the accelerator when there is one.

With --ctranslate2 (the `interop` extra) the run is also exported to CTranslate2 in float32 and in
int8 (parity.ctranslate2) and timed on the same batches, greedy and with --beam, on the CPU with
as many threads as torch: rows "ctranslate2 float32" and "ctranslate2 int8", their outputs
compared with torch cached search's too (a sentence our search ends at its own length limit by a
forced <eos>, where CTranslate2 has one limit per batch, counts as the same when the tokens before
it are: `ctranslate2.same_output`; greedy float32: 0 differences expected; beam: CTranslate2
normalises by length ** alpha, not GNMT's penalty), and the BLEU of int8's translations against
float32's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from train import data
from train.backends import allocator, create_backend, initialize
from train.config import positive_int
from train.files import UserError, json_text, write_text_atomic
from train.rundir import Run, open_run
from train.translate import add_run_arguments, read_lines

from .check import enable_parity_numerics
from .weights import convert_state

REFERENCE = "torch cached"


def _trim(out) -> list[int]:
    return [int(t) for t in out if t != data.PAD_ID]


def benchmark(run: Run, lines: Sequence[str], beam_size: int, batch_size: int | None, alpha: float = 0.6,
              ctranslate2: bool = False, scoring: str = "gnmt") -> list[dict]:
    """One row per search and beam: seconds, sentences/s, tokens/s, speed-ups, outputs that differ.

    JAX runs every batch once untimed first (jit compiles each batch shape there), torch and
    CTranslate2 the first.
    """
    cfg, model_cfg = run.config, run.model_config
    state = run.backend.export_state()
    backends = {}
    for framework in ("torch", "jax"):
        initialize(cfg.replace(backend=framework))  # each framework's process settings (threads, allocator)
        backend = create_backend(cfg.replace(backend=framework), model_cfg, None)
        backend.import_state(convert_state(state, framework, model_cfg))
        backends[framework] = backend
    src_ids = data.encode(run.tokenizers.src, list(lines))
    batches = list(data.source_batches(src_ids, cfg.max_len, cfg.token_budget, batch_size))

    def timed(search, warmup) -> tuple[float, list]:
        for _, src in warmup:
            search(src)
        outputs = [None] * len(lines)
        start = time.perf_counter()
        for index, src in batches:
            out = search(src)
            for row in np.flatnonzero(index >= 0):
                outputs[index[row]] = out[row]
        return time.perf_counter() - start, outputs

    rows, reference = [], {}
    for name, cached in (("torch", True), ("jax", True), ("torch", False)):
        search_name = f"{name} {'cached' if cached else 'uncached'}"
        for beam in sorted({1, beam_size}):
            search = lambda src, b=backends[name], k=beam, c=cached: b.translate(src, k, alpha, cached=c, scoring=scoring)
            # Each framework under the allocator it has in a process of its own (allocator.settled)
            with allocator.settled() if name == "torch" else contextlib.nullcontext():
                seconds, outputs = timed(search, batches if name == "jax" else batches[:1])
            if search_name == REFERENCE:
                reference[beam] = outputs
            rows.append({
                "search": search_name, "beam": beam, "seconds": seconds,
                "tokens": int(sum((out != data.PAD_ID).sum() for out in outputs)),
                "differ": None if search_name == REFERENCE
                else sum(_trim(a) != _trim(b) for a, b in zip(outputs, reference[beam])),
            })
    if ctranslate2:
        with allocator.settled():
            rows += _ctranslate2_rows(run, state, batches, beam_size, alpha, timed, reference)
    for row in rows:
        row.update(sentences=len(lines), sentences_per_s=len(lines) / row["seconds"], tokens_per_s=row["tokens"] / row["seconds"])
        for baseline in (REFERENCE, "torch uncached"):
            match = next(r for r in rows if r["search"] == baseline and r["beam"] == row["beam"])
            row[f"speedup_vs_{baseline.replace(' ', '_')}"] = match["seconds"] / row["seconds"]
    for backend in backends.values():
        backend.close()
    return rows


def _ctranslate2_rows(run: Run, state, batches, beam_size: int, alpha: float, timed, reference) -> list[dict]:
    """Rows "ctranslate2 float32" and "ctranslate2 int8", and int8's BLEU against float32 (in the int8 rows)."""
    import tempfile

    import sacrebleu
    import torch

    from torch_reference.decode import output_length

    from . import ctranslate2 as ct2

    params = convert_state(state, "torch", run.model_config).params
    threads = torch.get_num_threads()  # as many as torch's cached search uses
    limits = [0] * len(reference[1])  # each sentence's own limit, as our search applies it
    for index, src in batches:
        for row in np.flatnonzero(index >= 0):
            length = int((src[row] != data.PAD_ID).sum())
            limits[index[row]] = output_length(length, run.model_config.max_len, 1.5, 10)
    rows, texts = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("float32", "int8"):
            ct2.export_ctranslate2(run.run_dir, params, run.model_config, Path(tmp) / kind, quantization=kind)
            translator = ct2.Translator(Path(tmp) / kind, intra_threads=threads)
            for beam in sorted({1, beam_size}):
                def search(src, k=beam):  # this project's length limit for the batch's padded length
                    limit = output_length(src.shape[1], run.model_config.max_len, 1.5, 10)
                    return translator.translate_ids(src, beam_size=k, max_len=limit, length_penalty=alpha)

                seconds, outputs = timed(search, batches[:1])
                texts[kind, beam] = data.decode_batch(run.tokenizers.tgt, outputs)
                rows.append({
                    "search": f"ctranslate2 {kind}", "beam": beam, "seconds": seconds,
                    "tokens": int(sum(len(out) for out in outputs)),
                    "differ": sum(not ct2.same_output(_trim(ref), out, limit)
                                  for out, ref, limit in zip(outputs, reference[beam], limits)),
                })
    for row in rows:
        if row["search"] == "ctranslate2 int8":
            float32 = texts["float32", row["beam"]]
            row["bleu_vs_float32"] = sacrebleu.corpus_bleu(texts["int8", row["beam"]], [float32]).score
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m parity.translate_bench",
        description="Time translation with a run's weights in both frameworks: JAX and torch cached search and "
        "torch's uncached loop (the decoder re-run over every prefix), greedy and with --beam, on the same input. "
        "Prints sentences/s, tokens/s, speed-ups and how many outputs differ from torch cached search's.",
    )
    add_run_arguments(parser)
    parser.add_argument("--input", type=Path, help="text file, one source sentence per line (plain or .gz); default: stdin")
    parser.add_argument("--batch-size", type=positive_int, help="at most N sentences per batch; default: the run's --token-budget")
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    parser.add_argument("--ctranslate2", action="store_true", help="also time the run exported to CTranslate2 in "
                        "float32 and int8 (needs the interop extra: pip install -e \".[interop]\")")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    enable_parity_numerics()
    try:
        sentences = [line for line in read_lines(args.input) if line.strip()]
        if not sentences:
            raise UserError(f"{args.input or 'standard input'} holds no sentence to translate")
        run = open_run(args.run_dir, args.checkpoint)
    except (UserError, FileNotFoundError, ValueError) as err:
        parser.exit(1, f"error: {err}\n")
    if args.ctranslate2:
        try:
            from train.data.spm import require

            require("ctranslate2")
        except ImportError as err:
            parser.exit(1, f"error: {err}\n")
    rows = benchmark(run, sentences, args.beam, args.batch_size, args.alpha, ctranslate2=args.ctranslate2,
                     scoring=args.scoring)
    run.backend.close()
    machine = f"{platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} CPUs"
    import jax

    if jax.default_backend() != "cpu":
        machine += f", {jax.devices()[0].device_kind}"
    print(f"{len(sentences)} sentences, {run.model_config.d_model}-wide {run.config.preset} model, {machine}")
    print(f"{'search':19s} {'beam':>4s} {'seconds':>8s} {'sent/s':>8s} {'tok/s':>8s} {'vs torch cached':>16s} "
          f"{'vs uncached':>12s} {'outputs differ':>15s}")
    for r in rows:
        differ = "reference" if r["differ"] is None else str(r["differ"])
        print(f"{r['search']:19s} {r['beam']:4d} {r['seconds']:8.2f} {r['sentences_per_s']:8.1f} {r['tokens_per_s']:8.0f} "
              f"{r['speedup_vs_torch_cached']:15.2f}x {r['speedup_vs_torch_uncached']:11.2f}x {differ:>15s}"
              + (f"   BLEU vs float32 {r['bleu_vs_float32']:.2f}" if "bleu_vs_float32" in r else ""))
    if args.json:
        write_text_atomic(args.json, json_text({"run_dir": str(args.run_dir), "machine": machine, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
