"""`aiayn translate`'s stream: input lines translated chunk by chunk, resumably (docs/decoding.md)."""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .. import data
from ..runtime.files import UserError, quoted
from ..translation import Hypothesis
from .output import OtherInput


def format_record(result: str | list[Hypothesis], fmt: str, source_tokens: list[str] | None = None) -> str:
    """One output line per input line in format `fmt`: "text" (the best), "tsv" (each hypothesis's scores), "jsonl"."""
    hyps = [Hypothesis(result, math.nan, math.nan, [])] if isinstance(result, str) else result
    if fmt == "text":
        return hyps[0].text if hyps else ""
    if fmt == "tsv":
        return "\t".join(f"{h.text.replace(chr(9), ' ')}\t{_number(h.logprob)}\t{_number(h.score)}" for h in hyps)
    return json.dumps({"hypotheses": [
        {"text": h.text, "logprob": _number(h.logprob), "score": _number(h.score), "tokens": h.tokens,
         **({} if h.alignment is None else {"alignment": h.alignment})} for h in hyps],
        **({} if source_tokens is None else {"source_tokens": source_tokens})}, ensure_ascii=False)


def _number(x: float) -> float | None:
    return None if not math.isfinite(x) else float(f"{x:.7g}")  # float32's digits


def source_tokens(tokenizers: data.Tokenizers, texts: Sequence[str], max_len: int) -> list[list[str]]:
    """The source tokens each text is translated from, as the search cuts them: what alignments point into."""
    ids = [s if len(s) <= max_len else [*s[: max_len - 1], data.EOS_ID] for s in data.encode(tokenizers.src, list(texts))]
    return [[tokenizers.src.id_to_token(int(i)) for i in row] for row in ids]


class TsvColumns:
    """A TSV input's columns `source` and (optional) `prefix`, named by its header row; no quoting."""

    def __init__(self, header: str, name: str):
        self.header, self.name = header.split("\t"), name
        if "source" not in self.header:
            raise UserError(f"{name}: no column 'source' in the header row {quoted(self.header)} (TSV input: a header "
                            "row naming the columns source and, optionally, prefix)")
        self.source = self.header.index("source")
        self.prefix = self.header.index("prefix") if "prefix" in self.header else None

    def split(self, rows: Sequence[str], first_line: int) -> tuple[list[str], list[str] | None]:
        """(sources, prefixes or None) of `rows`, the first of which is line `first_line` of the input."""
        cells = [row.split("\t") for row in rows]
        for number, row in enumerate(cells, start=first_line):
            if len(row) != len(self.header):
                raise UserError(f"{self.name}: line {number} has {len(row)} columns, the header (line 1) has "
                                f"{len(self.header)}")
        return [row[self.source] for row in cells], None if self.prefix is None else [row[self.prefix] for row in cells]


def translate_stream(run, lines: Iterator[str], out, *, chunk_lines: int, progress, counts: collections.Counter,
                     plot_attention: Path | None = None, fmt: str = "text", columns: TsvColumns | None = None,
                     **options: Any) -> int:
    """Translate `lines` chunk by chunk into `out`, a `fmt` record a line after those it holds (their count)."""
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
    rows = skipped  # input lines (rows) before the chunk
    for chunk in iter(lambda: list(itertools.islice(lines, chunk_lines)), []):
        def on_batch(index, src, tokens, offset=rows):  # rows: the lines before this chunk, as `seen` holds them
            progress.on_batch(index, src, tokens)
            if recorder is not None:
                recorder(np.where(index >= 0, index + offset, -1), src, tokens)

        # line 1 of a TSV input is the header
        sources, prefixes = (chunk, None) if columns is None else columns.split(chunk, rows + 2)
        first = {"first_id": rows} if options.get("sample") else {}  # samples keyed by input line, not by chunk
        rows += len(chunk)
        if recorder is not None:
            seen.extend(sources)
        results = run.translate(sources, on_batch=on_batch, counts=counts, prefix=prefixes, **first, **options)
        aligned = getattr(options.get("search"), "alignments", options.get("alignments"))
        tokens = source_tokens(run.tokenizers, sources, run.config.max_len) if aligned else None
        records = [format_record(r, fmt, tokens and tokens[i]) for i, r in enumerate(results)]
        for line in chunk:
            digest.update(line.encode("utf-8", "surrogateescape") + b"\n")
        out.write(records, digest.hexdigest())
    if recorder is not None:
        recorder.plot(plot_attention)
    return skipped
