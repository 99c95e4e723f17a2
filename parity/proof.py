"""Exports that carry their proof (docs/interop.md#exports-with-proof): read back by their own runtime and
held against the run (greedy agreement, logit differences), the figures in proof.json and README.md."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

import train
from torch_reference.config import PAD_ID, TransformerConfig
from torch_reference.decode import greedy_search, output_length
from torch_reference.model import Transformer
from train import data, runtime
from train.data import spm
from train.data.streams import LineReader
from train.interop.marian import side_orders
from train.translate.attention import output_tokens

from .ctranslate2 import CT2Translator, same_output, tokens

SENTENCES = 32  # validation sources proved on: enough to cover the vocabulary's common rows, fast on a CPU
# A float32 export computes the run's function with other kernels: the twins' own logits bound, every greedy alike.
MAX_LOGIT_DIFF = 1e-4
MIN_AGREEMENT = 1.0
MASKED = -1e8  # CTranslate2 reports the logits of tokens it may not emit at a step as about -1e9


def proof_sentences(run_dir: str | os.PathLike, given: str | os.PathLike | None = None) -> list[str]:
    """The first SENTENCES non-empty lines of `given`, else of the run's validation data (or the numbers corpus's)."""
    if given is not None:
        with contextlib.closing(LineReader(Path(given), flag="--proof-sentences")) as lines:  # its errors name the flag
            texts = list(lines)
    else:  # a config with --train has --valid
        cfg = runtime.read_experiment(run_dir)
        texts = [source for source, _ in data.load_split(cfg, cfg.valid or "numbers:valid")]
    texts = [t for t in texts if t.strip()][:SENTENCES]
    if not texts:
        raise runtime.UserError(f"{given or run_dir}: no sentence to prove the export on")
    return texts


def reference(params: Mapping[str, np.ndarray], cfg: TransformerConfig, src_ids: list[list[int]]):
    """(the run's greedy translations, the (T, V) logits along each) by the reference on `params`, one at a time."""
    model = Transformer(cfg).eval()
    model.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in params.items()})
    outputs, logits = [], []
    with torch.no_grad():
        for ids in src_ids:
            src = torch.tensor([ids])
            tokens = output_tokens(greedy_search(model, src)[0][0].tolist())
            outputs.append(tokens)
            logits.append(model(src, torch.tensor([[cfg.bos_id, *tokens[:-1]]]))[0].numpy())
    return outputs, logits


def limit(src_len: int, cfg: TransformerConfig) -> int:
    """The most tokens the run's search lets the translation of `src_len` source tokens have."""
    return output_length(src_len, cfg.max_len, 1.5, 10)


def prove(export_dir: Path, ours: Sequence[list[int]], theirs: Sequence[list[int]], diffs: Sequence[float],
          sentences: Sequence[str], limits: Sequence[int], kind: str, exact: bool) -> dict[str, Any]:
    """Write proof.json and a README.md line into `export_dir`; refuse a float32 (`exact`) export out of bounds."""
    diff = max(diffs)
    agree = sum(same_output(a, b, n) for a, b, n in zip(ours, theirs, limits)) / len(ours)
    proof = {"kind": kind, "sentences": len(sentences), "greedy_agreement": agree, "max_abs_logit_diff": diff,
             "bounds": {"greedy_agreement": MIN_AGREEMENT, "max_abs_logit_diff": MAX_LOGIT_DIFF} if exact else None,
             "first_sentences": list(sentences[:3])}
    if kind in ("ctranslate2", "marian"):  # the bytes proven, checked where an export is read (runtime.check_export)
        proof["files"] = runtime.export_digests(export_dir)
    if exact and (diff > MAX_LOGIT_DIFF or agree < MIN_AGREEMENT):
        raise runtime.UserError(f"the {kind} export does not compute what the run computes: greedy agreement "
                                f"{agree:.1%} (bound {MIN_AGREEMENT:.0%}), largest logit difference {diff:.2e} "
                                f"(bound {MAX_LOGIT_DIFF:.0e}) on {len(sentences)} sentences; nothing was written")
    runtime.write_json_atomic(export_dir / runtime.PROOF_FILE, proof)
    line = (f"Checked at export: {agree:.1%} of {len(sentences)} greedy translations equal the run's, logits "
            f"within {diff:.1e} ({runtime.PROOF_FILE}).\n")
    readme = export_dir / "README.md"
    runtime.write_text_atomic(readme, (readme.read_text("utf-8") if readme.is_file() else "") + line)
    return proof


def _shared_steps(ours: list[int], theirs: list[int]) -> int:
    """How many steps both greedy outputs took from the same prefix."""
    same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    return min(same + 1, len(ours), len(theirs))


def ctranslate2_proof(export_dir: Path, run_dir: Path, params, cfg: TransformerConfig, sentences: Sequence[str],
                      quantization: str | None) -> dict[str, Any]:
    """The CTranslate2 model in `export_dir` against the run: greedy `translate_batch` with its logits."""
    src_ids = data.encode(data.load_tokenizers(run_dir).src, sentences)
    ours, ours_logits = reference(params, cfg, src_ids)
    ct2, theirs, diffs, limits = CT2Translator(export_dir), [], [], [limit(len(ids), cfg) for ids in src_ids]
    for ids, n, out, logits in zip(src_ids, limits, ours, ours_logits):
        (result,) = ct2.translator.translate_batch(
            [tokens(ct2.src_vocab, ids)], beam_size=1, max_decoding_length=n, min_decoding_length=0,
            return_end_token=True, return_logits_vocab=True)
        theirs.append([ct2.tgt_ids[t] for t in result.hypotheses[0]])
        steps = _shared_steps(out, theirs[-1])
        theirs_logits = np.stack([np.asarray(step).reshape(-1) for step in result.logits[0][:steps]])
        diffs.append(float(np.abs(theirs_logits - logits[:steps])[theirs_logits > MASKED].max()))
    return prove(export_dir, ours, theirs, diffs, sentences, limits, "ctranslate2",
                 exact=quantization in (None, "float32"))


def run_proof(converted: Path, run_dir: Path, sentences: Sequence[str]) -> dict[str, Any]:
    """A run `converted` to the other framework against its source at that step: greedy searches, logits along them."""
    theirs_run = train.load(converted, "latest")
    ours_run = train.load(run_dir, theirs_run.step)
    try:
        src_ids = data.encode(ours_run.tokenizers.src, sentences)
        limits = [limit(len(ids), ours_run.model_config) for ids in src_ids]
        ours, theirs = ([output_tokens(run.backend.translate(np.array([ids]), beam_size=1)[0]) for ids in src_ids]
                        for run in (ours_run, theirs_run))
        diffs = [float(np.abs(_logits(ours_run, ids, out) - _logits(theirs_run, ids, out)).max())
                 for ids, out in zip(src_ids, ours)]
    finally:
        ours_run.close()
        theirs_run.close()
    return prove(converted, ours, theirs, diffs, sentences, limits, theirs_run.config.backend, exact=True)


def _logits(run, ids: list[int], out: list[int]) -> np.ndarray:
    """The (T, V) logits of `run`'s model for source `ids` and target `out`, teacher-forced."""
    src, tgt_in = np.array([ids]), np.array([[run.model_config.bos_id, *out[:-1]]])
    if run.config.backend == "torch":
        with torch.no_grad():
            return run.backend.model.eval()(torch.from_numpy(src), torch.from_numpy(tgt_in))[0].numpy()
    return np.asarray(run.backend.ctx.model(run.backend.local_params())(src, tgt_in, deterministic=True))[0]


def marian_proof(export_dir: Path, run_dir: Path, params, cfg: TransformerConfig, sentences: Sequence[str],
                 marian_ids: Mapping[str, int]) -> dict[str, Any]:
    """The HF Marian directory in `export_dir` against the run: greedy `generate` and a teacher-forced pass,
    in Marian's numbering; our pad and bos columns left out (Marian's one row for both, never emitted)."""
    hf = spm.require("transformers").MarianMTModel.from_pretrained(str(export_dir)).eval()
    src_order, tgt_order = side_orders(marian_ids)
    to_ours = {int(m): o for o, m in enumerate(tgt_order)}
    columns = [o for o in range(cfg.tgt_vocab_size) if o not in (cfg.bos_id, cfg.pad_id)]
    src_ids = data.encode(data.load_tokenizers(run_dir).src, sentences)
    ours, ours_logits = reference(params, cfg, src_ids)
    theirs, diffs, limits = [], [], [limit(len(ids), cfg) for ids in src_ids]
    with torch.no_grad():
        for ids, out, logits, n in zip(src_ids, ours, ours_logits, limits):
            src, start = torch.tensor([[int(src_order[i]) for i in ids]]), marian_ids["decoder_start"]
            generated = hf.generate(src, num_beams=1, do_sample=False, max_new_tokens=n,
                                    decoder_start_token_id=start)[0, 1:].tolist()
            theirs.append([to_ours.get(m, PAD_ID) for m in generated if m != marian_ids["pad"]])
            labels = [int(tgt_order[i]) for i in out]
            hf_logits = hf(input_ids=src, decoder_input_ids=torch.tensor([[start, *labels[:-1]]])).logits[0].numpy()
            diffs.append(float(np.abs(hf_logits[:, tgt_order[columns]] - logits[:, columns]).max()))
    return prove(export_dir, ours, theirs, diffs, sentences, limits, "marian", exact=True)
