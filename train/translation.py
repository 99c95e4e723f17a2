"""Texts in, translations out (docs/decoding.md): searched in batches, n-best, prefixes, alignments, scores."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import json
import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from . import data
from .backends import Hypotheses, Translator
from .options import Sampling, Search
from .runtime.files import UserError, quoted
from .runtime.output import OtherInput

# The search's length limit (`decode.sentence_limits` at the backends' defaults): a * source tokens + b.
MAX_LEN_A, MAX_LEN_B = 1.5, 10


@dataclasses.dataclass(frozen=True)
class Hypothesis:
    """One output of a sentence: text, log-probability (of its tokens and <eos>), score (over the length penalty:
    what beam search ranks by), tokens (no <eos>), with alignments each token's source position."""

    text: str
    logprob: float
    score: float
    tokens: list[str]
    alignment: list[int] | None = None


def encode_prefixes(tokenizer, prefixes: Sequence[str | None], count: int) -> list[list[int]]:
    """Target ids of each forced prefix (None: none), without <eos>; UserError for <unk>, a special token, a count."""
    if len(prefixes) != count:
        raise UserError(f"{len(prefixes)} prefixes for {count} sentences: give one per sentence (None for none)")
    ids = data.encode(tokenizer, [p or "" for p in prefixes])
    out = [row[:-1] if row[-1:] == [data.EOS_ID] else row for row in ids]  # the <eos> encoding appends
    for line, (row, text) in enumerate(zip(out, prefixes), start=1):
        if data.UNK_ID in row:
            raise UserError(f"prefix of sentence {line} ({quoted(text, 80)}) has pieces the target vocabulary lacks")
        if {data.PAD_ID, data.BOS_ID, data.EOS_ID} & set(row):  # no output holds them: <pad> meant "not forced"
            raise UserError(f"prefix of sentence {line} ({quoted(text, 80)}) holds <pad>, <bos> or <eos>: "
                            "a prefix is the output's first words")
    return out


def _check_prefix_room(src_ids: Sequence[Sequence[int]], prefix_ids: Sequence[Sequence[int]], max_len: int) -> None:
    for line, (src, prefix) in enumerate(zip(src_ids, prefix_ids), start=1):
        limit = max(1, min(max_len, math.floor(MAX_LEN_A * min(len(src), max_len) + MAX_LEN_B)))
        if len(prefix) >= limit:
            raise UserError(f"prefix of sentence {line} has {len(prefix)} tokens: its output may have at most {limit} "
                            f"tokens with <eos> ({MAX_LEN_A} x {min(len(src), max_len)} source tokens + {MAX_LEN_B}, "
                            f"at most {max_len})")


def _padded(rows: Sequence[Sequence[int]], max_len: int) -> np.ndarray | None:
    """rows as one (B, P) array padded with <pad> to a bucket length (few compiled shapes); None if all empty."""
    longest = max(map(len, rows), default=0)
    if not longest:
        return None
    buckets = data.bucket_lengths(max_len)
    out = np.full((len(rows), buckets[min(np.searchsorted(buckets, longest), len(buckets) - 1)]), data.PAD_ID, np.int32)
    for row, ids in enumerate(rows):
        out[row, : len(ids)] = ids
    return out


def _alignments(backend: Translator, src: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """src (B, S), tokens (B, n, L) -> (B, n, L): each output token's argmax source (last layer, heads' mean)."""
    B, n, L = tokens.shape
    flat = tokens.reshape(B * n, L)
    tgt_in = np.concatenate([np.full((B * n, 1), data.BOS_ID, flat.dtype), flat[:, :-1]], axis=1)
    attention = backend.cross_attention(np.repeat(src, n, axis=0), tgt_in)  # (B*n, layers, H, L, S)
    return attention[:, -1].mean(axis=1).argmax(axis=-1).reshape(B, n, L)

class EvaluationStopped(Exception):
    """A search or evaluation stopped between batches because its `stop` callable said so."""


def translate_texts(backend: Translator, tokenizers: data.Tokenizers, texts: Sequence[str], *, max_len: int,
                    token_budget: int, batch_size: int | None = None, search: Search = Search(),
                    sample: Sampling | None = None, prefixes: Sequence[str | None] | None = None,
                    stop: Callable[[], bool] | None = None, on_batch: Callable[..., None] | None = None,
                    counts: collections.Counter | None = None, fixed_shapes: bool = False, first_id: int = 0,
                    hypotheses: bool = False) -> list[str] | list[list[Hypothesis]]:
    """Detokenized translations of `texts` in order (a blank line: "") by `search` or `sample`; `Hypothesis` lists
    with `n_best` K, `alignments`, num_samples > 1 or `hypotheses`. `prefixes`: each output's forced start;
    `stop()` True before a batch raises EvaluationStopped; `on_batch(indices, src, tokens)` sees each batch;
    `counts["cut"]`: sources cut; `fixed_shapes`: a few shapes for any texts; text i samples as `first_id` + i."""
    if sample is not None:
        sample.check_with(search, prefixes is not None and any(prefixes))
    src_ids = data.encode(tokenizers.src, list(texts))
    prefix_ids = None if prefixes is None else encode_prefixes(tokenizers.tgt, prefixes, len(texts))
    _check_prefix_room(src_ids, prefix_ids or [], max_len)
    if counts is not None:
        counts["cut"] += sum(len(ids) > max_len for ids in src_ids)
    listed = search.n_best is not None or search.alignments or hypotheses or getattr(sample, "num_samples", 1) > 1
    out: list = [[] if listed else "" for _ in texts]
    for index, src in data.source_batches(src_ids, max_len, token_budget, batch_size, fixed=fixed_shapes):
        if stop is not None and stop():
            raise EvaluationStopped("translation stopped")
        prefix = None if prefix_ids is None else _padded([prefix_ids[i] if i >= 0 else [] for i in index], max_len)
        if sample is not None:
            result = backend.sample(src, sample.seed, sample.num_samples, sample.temperature, sample.top_k,
                                    sample.top_p, sentence_ids=np.maximum(index, 0) + first_id)
        else:
            result = backend.translate(src, search.beam, search.alpha, scoring=search.scoring,
                                       n_best=(search.n_best or 1) if listed else None, prefix=prefix)
        tokens = result.tokens[:, 0] if isinstance(result, Hypotheses) else result
        if on_batch is not None:
            on_batch(index, src, tokens)
        if listed:
            aligned = _alignments(backend, src, result.tokens) if search.alignments else None
            _collect(out, texts, index, result, tokenizers.tgt, aligned)
            continue
        hyps = data.decode_batch(tokenizers.tgt, tokens)
        for row, i in enumerate(index):
            if i >= 0 and texts[i].strip():
                out[i] = _one_line(hyps[row])
    return out


def _one_line(text: str) -> str:
    # A model may emit a newline byte: kept, it would make one input line several.
    return " ".join(data.split_lines(text.replace("\r", "\n")))


def _collect(out: list, texts: Sequence[str], index: np.ndarray, result: Hypotheses, tokenizer,
             aligned: np.ndarray | None) -> None:
    """Each real row's hypotheses (`Hypothesis`) into out[i], in rank order, empty slots left out."""
    for row, i in enumerate(index):
        if i < 0 or not texts[i].strip():
            continue
        for h, ids in enumerate(result.tokens[row]):
            if not np.isfinite(result.logprob[row, h]):
                continue
            ids = [int(t) for t in ids]
            ids = ids[: ids.index(data.EOS_ID)] if data.EOS_ID in ids else [t for t in ids if t != data.PAD_ID]
            out[i].append(Hypothesis(
                _one_line(data.decode(tokenizer, ids)), float(result.logprob[row, h]), float(result.score[row, h]),
                [tokenizer.id_to_token(t) for t in ids],
                None if aligned is None else [int(a) for a in aligned[row, h, : len(ids)]]))


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


def score_pairs(backend: Translator, tokenizers: data.Tokenizers, sources: Sequence[str], targets: Sequence[str], *,
                max_len: int, token_budget: int, batch_size: int | None = None) -> list[dict[str, Any]]:
    """Per pair, the target's log-probability given the source (teacher-forced): {"logprob": the sum,
    "tokens" ("<eos>" last), "token_logprobs"}; sources cut as in translation, a longer target a UserError."""
    if len(sources) != len(targets):
        raise UserError(f"{len(sources)} sources and {len(targets)} targets: give one target per source")
    src_ids, tgt_ids = data.encode(tokenizers.src, list(sources)), data.encode(tokenizers.tgt, list(targets))
    for line, ids in enumerate(tgt_ids, start=1):
        if len(ids) > max_len:
            raise UserError(f"target {line} has {len(ids)} tokens with <eos>, more than the model's max_len {max_len}")
    out: list[dict[str, Any]] = [{} for _ in sources]
    for index, src in data.source_batches(src_ids, max_len, token_budget, batch_size):
        rows = [tgt_ids[i] if i >= 0 else [data.EOS_ID] for i in index]
        logprobs = backend.score(src, _padded(rows, max_len))  # (B, T)
        for row, i in enumerate(index):
            if i >= 0:
                n = len(tgt_ids[i])
                out[i] = {"logprob": float(logprobs[row, :n].sum(dtype=np.float64)),
                          "tokens": [tokenizers.tgt.id_to_token(t) for t in tgt_ids[i]],
                          "token_logprobs": [float(x) for x in logprobs[row, :n]]}
    return out


def translate_stream(run, lines: Iterator[str], out, *, chunk_lines: int, progress, counts: collections.Counter,
                     plot_attention: Path | None = None, fmt: str = "text", columns: TsvColumns | None = None,
                     **options: Any) -> int:
    """Translate `lines` by `run.translate(**options)` chunk by chunk into `out` (a `runtime.output` writer), a
    `fmt` record a line, after the lines it holds (their count returned); `columns`: TSV rows after a header."""
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
