"""Evaluation (docs/results.md): loss, perplexity, sacreBLEU's BLEU and chrF, exact match, numbers' bands."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from typing import Any

from sacrebleu.metrics import BLEU, CHRF

from . import data
from .backends import Backend, Trainer
from .options import Search
from .translation import EvaluationStopped, translate_texts

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
    """{"bleu", "chrf", "exact_match"} of hypotheses vs one reference each, scores with their "_signature";
    "bleu_lc" with `lowercase`, "bleu_moses" (and "bleu_moses_lc") with `moses` (a language code)."""
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
    """Exact match per number of digits ("1".."6") when every reference is a number in the numbers corpus'
    English, else None: {"sentences", "exact_match", "seen" (of the sources `seen`), "unseen_exact_match"}."""
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
    """{"loss", "nll", "ppl", "tokens"} over padded batches, dropout off, summed on the host once every
    batch is queued (device scalars would compile programs of their own); `stop()` True: EvaluationStopped."""
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
    """Loss and perplexity on every pair (but those past max_len); `corpus_scores` and "bands" of the first
    `max_sentences` translated; `samples` examples; `stop` and `fixed_shapes` as `translate_texts` takes them."""
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
