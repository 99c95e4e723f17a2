"""Translate with a trained run: `python -m train.translate --run-dir DIR [--input FILE]`.

Reads one sentence per line from FILE (or stdin), writes one translation per line to stdout (or
--output), in input order. The run's config, tokenizer and checkpoint (best by validation BLEU
by default) select the backend and the weights.

`translate_ids` is the one place that runs search; `translate_texts` batches sentences by
length bucket (a few padded shapes, so jit compiles a handful of times) and keeps their order.
"""

from __future__ import annotations

import argparse
import gzip
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from . import data
from .backend import Backend


def translate_ids(backend: Backend, src: np.ndarray, beam_size: int = 4, alpha: float = 0.6) -> np.ndarray:
    """Search for one padded batch of source ids (B, S) -> target ids (B, T): the backend's
    cached beam search (greedy with beam_size 1), length penalty alpha."""
    return backend.translate(src, beam_size, alpha)


def source_batches(
    src_ids: Sequence[Sequence[int]], max_len: int, token_budget: int, batch_size: int | None = None
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(indices, padded src (B, L)) per batch: sentences grouped by length bucket, at most
    `token_budget` padded tokens and `batch_size` sentences per batch, every batch of a bucket
    padded with all-pad rows (index -1) to one shape. Sources longer than max_len are cut to
    max_len - 1 tokens + <eos>."""
    buckets = data.bucket_lengths(max_len)
    ids = [list(s) if len(s) <= max_len else [*s[: max_len - 1], data.EOS_ID] for s in src_ids]
    bucket_of = np.searchsorted(buckets, [len(s) for s in ids])
    for b, length in enumerate(buckets):
        members = np.flatnonzero(bucket_of == b)
        if not len(members):
            continue
        # Rows per batch: the budget's, but no more than the next power of two above the bucket's
        # sentence count (3 sentences do not run as 512 rows), so shapes stay few.
        size = max(1, min(token_budget // length, batch_size or token_budget, 1 << (len(members) - 1).bit_length()))
        for start in range(0, len(members), size):
            chunk = members[start : start + size]
            src = np.full((size, length), data.PAD_ID, np.int32)  # (B, L)
            for row, i in enumerate(chunk):
                src[row, : len(ids[i])] = ids[i]
            index = np.full(size, -1, np.int64)
            index[: len(chunk)] = chunk
            yield index, src


def translate_texts(
    backend: Backend,
    tokenizers: data.Tokenizers,
    texts: Sequence[str],
    *,
    max_len: int,
    token_budget: int,
    batch_size: int | None = None,
    beam_size: int = 4,
    alpha: float = 0.6,
) -> list[str]:
    """Detokenized translations of `texts`, in order (an empty line translates to "")."""
    src_ids = data.encode(tokenizers.src, list(texts))
    out = [""] * len(texts)
    for index, src in source_batches(src_ids, max_len, token_budget, batch_size):
        hyps = data.decode_batch(tokenizers.tgt, translate_ids(backend, src, beam_size, alpha))
        for row, i in enumerate(index):
            if i >= 0 and texts[i].strip():
                out[i] = hyps[row]
    return out


def benchmark(run, lines: Sequence[str], beam_size: int, batch_size: int | None, alpha: float = 0.6) -> list[dict]:
    """Sentences/s and generated tokens/s translating `lines` with the run's weights: JAX and torch
    cached search, and torch's uncached loop (the same search re-running the decoder over every
    prefix, as the seed repositories did), each greedy and with `beam_size`.

    JAX runs every batch once untimed first (jit compiles each batch shape there), torch the first
    batch. Each row also counts the sentences whose output differs from torch cached search's
    with the same beam (0 expected: the searches are the same algorithm on the same weights).
    """
    import time

    from .backend import create_backend

    cfg, model_cfg = run.config, run.model_config
    backends = {run.backend.name: run.backend}
    other = "torch" if run.backend.name == "jax" else "jax"
    backends[other] = create_backend(cfg.replace(backend=other), model_cfg, None)
    backends[other].load_torch_state_dict(run.backend.torch_state_dict())
    src_ids = data.encode(run.tokenizers.src, list(lines))
    batches = list(source_batches(src_ids, cfg.max_len, cfg.token_budget, batch_size))

    def timed(search, warmup) -> tuple[float, np.ndarray]:
        for _, src in warmup:
            search(src)
        outputs = [None] * len(lines)
        start = time.perf_counter()
        for index, src in batches:
            out = search(src)
            for row in np.flatnonzero(index >= 0):
                outputs[index[row]] = out[row]
        seconds = time.perf_counter() - start
        return seconds, outputs

    rows, reference = [], {}
    for name, cached in (("torch", True), ("jax", True), ("torch", False)):
        for beam in sorted({1, beam_size}):
            search = lambda src, b=backends[name], k=beam, c=cached: b.translate(src, k, alpha, cached=c)
            seconds, outputs = timed(search, batches if name == "jax" else batches[:1])
            reference.setdefault(beam, outputs)  # torch cached: the first configuration run
            rows.append({
                "search": f"{name} {'cached' if cached else 'uncached'}", "beam": beam, "seconds": seconds,
                "tokens": int(sum((out != data.PAD_ID).sum() for out in outputs)),
                "differ": sum(not np.array_equal(a, b) for a, b in zip(outputs, reference[beam])),
            })
    for row in rows:
        row.update(sentences=len(lines), sentences_per_s=len(lines) / row["seconds"], tokens_per_s=row["tokens"] / row["seconds"])
        for baseline in ("torch cached", "torch uncached"):
            match = next(r for r in rows if r["search"] == baseline and r["beam"] == row["beam"])
            row[f"speedup_vs_{baseline.replace(' ', '_')}"] = match["seconds"] / row["seconds"]
    return rows


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """--run-dir, --checkpoint and --beam, shared by translate and evaluate."""
    parser.add_argument(
        "--run-dir", required=True, type=Path, help="the run directory (holds config.json, tokenizer, checkpoints/)"
    )
    parser.add_argument(
        "--checkpoint", default="best", help="'best' (by validation BLEU, the default), 'latest', or a step number"
    )
    parser.add_argument("--beam", type=positive_int, default=4, help="beam size (default 4; 1 = greedy search)")


def main(argv: list[str] | None = None) -> int:
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
    parser.add_argument("--benchmark", action="store_true",
                        help="instead of printing translations, time them: JAX and torch cached search and torch's uncached "
                        "loop (the decoder re-run over every prefix), greedy and with --beam, on the same weights and "
                        "input; prints sentences/s, tokens/s, speed-ups and how many outputs differ from torch's")
    parser.add_argument("--json", type=Path, help="with --benchmark: also write the figures to this JSON file")
    parser.add_argument("--alpha", type=float, default=0.6, help="length penalty exponent of ((5+len)/6)^alpha (default 0.6)")
    args = parser.parse_args(argv)

    from .loop import UserError, open_run  # here: loads a framework

    try:
        lines = read_lines(args.input)
        run = open_run(args.run_dir, args.checkpoint)
        if not any(line.strip() for line in lines):
            raise UserError(f"{args.input or 'standard input'} holds no sentence to translate")
    except (UserError, FileNotFoundError, ValueError) as err:
        parser.exit(1, f"error: {err}\n")
    cfg = run.config
    if args.benchmark:
        import json
        import os
        import platform

        sentences = [line for line in lines if line.strip()]
        rows = benchmark(run, sentences, args.beam, args.batch_size, args.alpha)
        machine = f"{platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} CPUs"
        print(f"{len(sentences)} sentences, {run.model_config.d_model}-wide {run.config.preset} model, {machine}")
        print(f"{'search':16s} {'beam':>4s} {'seconds':>8s} {'sent/s':>8s} {'tok/s':>8s} {'vs torch cached':>16s} "
              f"{'vs uncached':>12s} {'outputs differ':>15s}")
        for r in rows:
            print(f"{r['search']:16s} {r['beam']:4d} {r['seconds']:8.2f} {r['sentences_per_s']:8.1f} {r['tokens_per_s']:8.0f} "
                  f"{r['speedup_vs_torch_cached']:15.2f}x {r['speedup_vs_torch_uncached']:11.2f}x {r['differ']:15d}")
        if args.json:
            data.write_text_atomic(args.json, json.dumps({"run_dir": str(args.run_dir), "machine": machine, "rows": rows}, indent=2))
        return 0
    hyps = translate_texts(
        run.backend, run.tokenizers, lines,
        max_len=cfg.max_len, token_budget=cfg.token_budget, batch_size=args.batch_size,
        beam_size=args.beam, alpha=args.alpha,
    )
    text = "".join(h + "\n" for h in hyps)
    if args.output is None:
        sys.stdout.write(text)
    else:
        data.write_text_atomic(args.output, text)
    return 0


def read_lines(path: Path | None) -> list[str]:
    """The lines of a UTF-8 text file (plain or .gz), or of stdin when `path` is None. Invalid
    UTF-8 raises ValueError naming the byte offset and line; a missing file FileNotFoundError."""
    if path is None:
        raw = sys.stdin.buffer.read()
        try:
            return raw.decode("utf-8").splitlines()
        except UnicodeDecodeError as err:
            line = raw[: err.start].count(b"\n") + 1
            raise ValueError(f"standard input: invalid UTF-8 at byte offset {err.start} (line {line}): {err.reason}") from None
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    data.check_text(path)
    with (gzip.open if path.suffix == ".gz" else open)(path, "rt", encoding="utf-8") as f:
        return f.read().splitlines()


if __name__ == "__main__":
    sys.exit(main())
