"""Evaluation: loss, perplexity, and sacreBLEU/chrF of beam-search translations; `python -m train.evaluate`.

BLEU and chrF are sacreBLEU's corpus scores on detokenized text (its default 13a tokenization,
mixed case), the numbers every paper quotes. Perplexity is exp of the unsmoothed per-token
negative log-likelihood; `loss` is the label-smoothed training objective.

    python -m train.evaluate --run-dir runs/jax-... --data de:en:../shared/data/multi30k/test_2016_flickr
    python -m train.evaluate --run-dir runs/jax-... --data numbers:test
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import sacrebleu

from . import data
from .backend import Backend
from .rundir import UserError, load_split, open_run, write_text_atomic
from .translate import add_run_arguments, positive_int, translate_texts


def corpus_scores(hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """{"bleu", "chrf"}: sacreBLEU corpus BLEU and chrF of detokenized hypotheses vs one reference each."""
    hyps, refs = list(hypotheses), [list(references)]
    return {
        "bleu": float(sacrebleu.corpus_bleu(hyps, refs).score),
        "chrf": float(sacrebleu.corpus_chrf(hyps, refs).score),
    }


def loss_and_perplexity(backend: Backend, batches) -> dict[str, float]:
    """{"loss", "nll", "ppl", "tokens"} over padded batches, dropout off: the sums stay on the
    device and are read once."""
    loss = nll = tokens = 0
    for batch in batches:
        batch_loss, batch_nll, batch_tokens = backend.eval_loss(batch)
        loss, nll, tokens = loss + batch_loss, nll + batch_nll, tokens + batch_tokens
    tokens = float(tokens)
    if tokens == 0:
        return {"loss": math.nan, "nll": math.nan, "ppl": math.nan, "tokens": 0}
    mean_nll = float(nll) / tokens
    return {"loss": float(loss) / tokens, "nll": mean_nll, "ppl": math.exp(min(mean_nll, 700.0)), "tokens": int(tokens)}


def evaluate_pairs(
    backend: Backend,
    tokenizers: data.Tokenizers,
    pairs: Sequence[data.Pair],
    *,
    max_len: int,
    token_budget: int,
    max_sentences: int | None = None,
    samples: int = 0,
    beam_size: int = 4,
) -> dict[str, Any]:
    """Loss and perplexity on every pair (those longer than max_len are left out of the loss),
    BLEU and chrF of beam-search translations (greedy with beam_size 1) of the first `max_sentences` pairs (default: all), and
    `samples` examples as {"source", "reference", "hypothesis"}."""
    examples = data.encode_pairs(tokenizers, pairs)
    batcher = data.Batcher(examples, token_budget=token_budget, max_len=max_len, shuffle=False)
    result: dict[str, Any] = loss_and_perplexity(backend, batcher.epoch_batches())
    scored = list(pairs[:max_sentences] if max_sentences else pairs)
    hyps = translate_texts(
        backend, tokenizers, [s for s, _ in scored], max_len=max_len, token_budget=token_budget, beam_size=beam_size
    )
    result.update(corpus_scores(hyps, [t for _, t in scored]))
    result["sentences"] = len(scored)
    result["samples"] = [
        {"source": s, "reference": t, "hypothesis": h} for (s, t), h in list(zip(scored, hyps))[:samples]
    ]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m train.evaluate",
        description="Score a run trained by `python -m train.run` on parallel data: label-smoothed loss, "
        "perplexity, and sacreBLEU BLEU/chrF of beam-search translations. Prints one JSON object.",
        epilog="DATA is a data spec as for train.run (SRC:TGT:PREFIX, FILE.tsv, FILE.jsonl, hf:NAME[:CONFIG]:SPLIT), "
        "or numbers:train|valid|test for the run's own split of the embedded numbers corpus.",
    )
    add_run_arguments(parser)
    parser.add_argument("--data", required=True, help="parallel data to score (see below)")
    parser.add_argument(
        "--max-sentences", type=positive_int, help="translate only the first N pairs for BLEU/chrF; default: all"
    )
    parser.add_argument("--samples", type=int, default=0, help="include N example translations in the JSON")
    parser.add_argument("--output", type=Path, help="also write the JSON to this file")
    args = parser.parse_args(argv)

    try:
        run = open_run(args.run_dir, args.checkpoint)
        pairs = load_split(run.config, args.data)
    except (UserError, FileNotFoundError, ValueError) as err:
        parser.exit(1, f"error: {err}\n")
    cfg = run.config
    result = evaluate_pairs(
        run.backend, run.tokenizers, pairs, max_len=cfg.max_len, token_budget=cfg.token_budget,
        max_sentences=args.max_sentences, samples=args.samples, beam_size=args.beam,
    )
    result = {"run_dir": str(args.run_dir), "data": args.data, "step": run.backend.step, **result}
    text = json.dumps(result, indent=2, ensure_ascii=False)
    print(text)
    if args.output is not None:
        write_text_atomic(args.output, text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
