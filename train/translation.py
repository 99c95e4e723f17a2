"""Texts in, translations out (docs/decoding.md), and how good they are (docs/results.md)."""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np

from torch_reference.config import output_length

from . import data
from .backends import Backend, Hypotheses, Trainer, Translator
from .options import Sampling, Search
from .runtime.files import UserError, quoted

# The search's length limit (`decode.sentence_limits` at the backends' defaults): a * source tokens + b.
MAX_LEN_A, MAX_LEN_B = 1.5, 10


@dataclasses.dataclass(frozen=True)
class Hypothesis:
    """One output of a sentence."""

    text: str
    logprob: float  # of its tokens and <eos>
    score: float  # over the length penalty: what beam search ranks by
    tokens: list[str]  # no <eos>
    alignment: list[int] | None = None  # each token's source position


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
        limit = output_length(min(len(src), max_len), max_len, MAX_LEN_A, MAX_LEN_B)
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
    """Detokenized translations of `texts` in order by `search` or `sample` (`Hypothesis` lists with `n_best`,
    `alignments`, samples or `hypotheses`); `stop()` True raises EvaluationStopped; text i samples as `first_id` + i."""
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


def score_pairs(backend: Translator, tokenizers: data.Tokenizers, sources: Sequence[str], targets: Sequence[str], *,
                max_len: int, token_budget: int, batch_size: int | None = None) -> list[dict[str, Any]]:
    """Per pair, {"logprob", "tokens", "token_logprobs"} of the target given the source; a too long target UserError."""
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


# Evaluation: the translations of held-out pairs scored against their references.

def exact_match(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """Percentage of hypotheses equal to their reference, both stripped (nan for no sentences)."""
    if not hypotheses:
        return math.nan
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses for {len(references)} references")
    return 100.0 * sum(h.strip() == r.strip() for h, r in zip(hypotheses, references)) / len(hypotheses)


def moses_tokenized(texts: Sequence[str], lang: str) -> list[str]:
    """`texts` Moses-tokenized for language `lang` (sacremoses, no XML escaping): what tokenized BLEU scores."""
    from sacremoses import MosesTokenizer

    tokenizer = MosesTokenizer(lang=lang)
    return [tokenizer.tokenize(text, escape=False, return_str=True) for text in texts]


def corpus_scores(hypotheses: Sequence[str], references: Sequence[str], *, lowercase: bool = False,
                  moses: str | None = None) -> dict[str, Any]:
    """{"bleu", "chrf", "exact_match"} with "_signature"s; "bleu_lc" with `lowercase`, "bleu_moses*" with `moses`."""
    from sacrebleu.metrics import BLEU, CHRF  # here: half a second that translating alone does without

    hyps, refs = list(hypotheses), [list(references)]
    result: dict[str, Any] = {}
    metrics = [("bleu", BLEU()), ("chrf", CHRF())] + ([("bleu_lc", BLEU(lowercase=True))] if lowercase else [])
    for name, metric in metrics:
        result[name] = float(metric.corpus_score(hyps, refs).score)
        result[f"{name}_signature"] = str(metric.get_signature())
    if moses:
        tok_hyps, tok_refs = moses_tokenized(hyps, moses), [moses_tokenized(refs[0], moses)]
        for name, case in [("bleu_moses", False)] + ([("bleu_moses_lc", True)] if lowercase else []):
            metric = BLEU(tokenize="none", lowercase=case, force=True)  # pre-tokenized on purpose: no warning
            result[name] = float(metric.corpus_score(tok_hyps, tok_refs).score)
            result[f"{name}_signature"] = f"{metric.get_signature()}|pretok:moses-{moses}"
    result["exact_match"] = exact_match(hyps, refs[0])
    return result


def band_scores(pairs: Sequence[data.Pair], hypotheses: Sequence[str],
                seen: Collection[str] | None = None) -> dict[str, dict[str, Any]] | None:
    """Exact match (seen and unseen) per number of digits ("1".."6") when every reference is a number, else None."""
    numbers = [data.number_from_english(reference.strip()) for _, reference in pairs]
    if not numbers or None in numbers:
        return None

    def match(rows: list[int]) -> float:
        return exact_match([hypotheses[i] for i in rows], [pairs[i][1] for i in rows])

    bands: dict[str, dict[str, Any]] = {}
    for band in sorted({data.number_band(n) for n in numbers}):
        members = [i for i, n in enumerate(numbers) if data.number_band(n) == band]
        unseen = members if seen is None else [i for i in members if pairs[i][0] not in seen]
        bands[str(band)] = {"sentences": len(members), "exact_match": match(members),
                            "seen": None if seen is None else len(members) - len(unseen),
                            "unseen_exact_match": match(unseen) if unseen else None}
    return bands


def loss_and_perplexity(backend: Trainer, batches, stop: Callable[[], bool] | None = None) -> dict[str, float]:
    """{"loss", "nll", "ppl", "tokens"} over padded batches, dropout off, summed on the host at the end."""
    sums = []
    for batch in batches:
        if stop is not None and stop():
            raise EvaluationStopped("evaluation stopped")
        sums.append(backend.eval_loss(batch))
    loss, nll, tokens = (math.fsum(float(x) for x in column) for column in zip(*sums)) if sums else (0.0, 0.0, 0.0)
    if tokens == 0:
        return {"loss": math.nan, "nll": math.nan, "ppl": math.nan, "tokens": 0}
    mean_nll = nll / tokens
    return {"loss": loss / tokens, "nll": mean_nll, "ppl": math.exp(min(mean_nll, 700.0)), "tokens": int(tokens)}


def bands_text(bands: dict[str, Any] | None) -> str:
    """' by digits 1:100* 2:99.56 ...': `band_scores`' exact match, * on bands seen whole in training; '' for none."""
    if not bands:
        return ""
    text = " ".join(f"{band}:{scores['exact_match']:.4g}" + ("*" if scores["unseen_exact_match"] is None else "")
                    for band, scores in bands.items())
    return f" by digits {text}" + (" (*: seen in training)" if "*" in text else "")


def evaluate_pairs(backend: Backend, tokenizers: data.Tokenizers, pairs: Sequence[data.Pair], *, max_len: int,
                   token_budget: int, max_sentences: int | None = None, samples: int = 0, search: Search = Search(),
                   lowercase: bool = False, moses: str | None = None,
                   seen: Collection[str] | None = None, stop: Callable[[], bool] | None = None,
                   fixed_shapes: bool = False) -> dict[str, Any]:
    """Loss and perplexity on every pair; `corpus_scores` and "bands" of the first `max_sentences` translated."""
    examples = data.encode_pairs(tokenizers, pairs)
    batcher = data.Batcher(examples, token_budget=token_budget, max_len=max_len, shuffle=False, pack=fixed_shapes,
                           pack_length=max_len if fixed_shapes else None)
    result: dict[str, Any] = loss_and_perplexity(backend, batcher.epoch_batches(), stop)
    scored = list(pairs[:max_sentences] if max_sentences else pairs)
    hyps = translate_texts(backend, tokenizers, [s for s, _ in scored], max_len=max_len, token_budget=token_budget,
                           search=search, stop=stop, fixed_shapes=fixed_shapes)
    result.update(corpus_scores(hyps, [t for _, t in scored], lowercase=lowercase, moses=moses))
    result["sentences"] = len(scored)
    result["bands"] = band_scores(scored, hyps, seen)
    result["samples"] = [{"source": s, "reference": t, "hypothesis": h} for (s, t), h in zip(scored[:samples], hyps)]
    return result
