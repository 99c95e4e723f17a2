"""Texts in, translations out: batched by length, searched by a backend, detokenized in order."""

from __future__ import annotations

import collections
import hashlib
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from . import data
from .backends import Translator
from .runtime.output import OtherInput

class EvaluationStopped(Exception):
    """A search or evaluation stopped between batches because its `stop` callable said so."""


def translate_texts(backend: Translator, tokenizers: data.Tokenizers, texts: Sequence[str], *, max_len: int,
                    token_budget: int, batch_size: int | None = None, beam_size: int = 4, alpha: float = 0.6,
                    scoring: str = "gnmt", stop: Callable[[], bool] | None = None,
                    on_batch: Callable[..., None] | None = None,
                    counts: collections.Counter | None = None, fixed_shapes: bool = False) -> list[str]:
    """Detokenized translations of `texts`, in order (an empty or whitespace-only line translates
    to ""). `stop` is asked before each batch: True raises EvaluationStopped. `on_batch(indices,
    src, tokens)` sees each batch's search (`train.attention.AttentionRecorder`). `counts["cut"]`
    grows by the sources cut to max_len. `fixed_shapes`: search in `data.source_batches`' few fixed
    shapes (shared by any set of texts: fewer programs for JAX to compile)."""
    src_ids = data.encode(tokenizers.src, list(texts))
    if counts is not None:
        counts["cut"] += sum(len(ids) > max_len for ids in src_ids)
    out = [""] * len(texts)
    for index, src in data.source_batches(src_ids, max_len, token_budget, batch_size, fixed=fixed_shapes):
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


def translate_stream(run, lines: Iterator[str], out, *, chunk_lines: int, progress, counts: collections.Counter,
                     plot_attention: Path | None = None, **search: Any) -> int:
    """Translate `lines` with the loaded run `run` (`train.load`) chunk by chunk into `out` (a
    `runtime.output` writer), after the lines it already holds; returns how many lines were
    skipped because `out` held them. `search`: `Run.translate`'s options; `progress` sees each
    batch; `plot_attention`: a directory for each sentence's cross-attention heatmaps."""
    digest = hashlib.sha256()  # of every input line up to the last finished chunk, for a resume's check
    done = out.done
    if run.backend.topology.process_count > 1:  # process 0 alone knows what its output holds
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
    if plot_attention is not None:  # the same translations, each sentence's attention recorded on the way
        from .attention import AttentionRecorder

        recorder = AttentionRecorder(run.backend, run.tokenizers, seen)
    progress.begin()
    for chunk in _chunks(lines, chunk_lines):
        offset = len(seen)

        def on_batch(index, src, tokens, offset=offset):
            progress.on_batch(index, src, tokens)
            if recorder is not None:
                recorder(np.where(index >= 0, index + offset, -1), src, tokens)

        if recorder is not None:
            seen.extend(chunk)
        hyps = run.translate(chunk, on_batch=on_batch, counts=counts, **search)
        for line in chunk:
            digest.update(line.encode("utf-8", "surrogateescape") + b"\n")
        out.write(hyps, digest.hexdigest())
    if recorder is not None:
        recorder.plot(plot_attention)
    return skipped


def _chunks(lines: Iterable[str], size: int) -> Iterator[list[str]]:
    lines = iter(lines)
    while chunk := list(itertools.islice(lines, size)):
        yield chunk
