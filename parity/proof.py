"""Exports that carry their proof, read back by their own runtime (docs/interop.md#exports-with-proof)."""

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
from sacrebleu.metrics import BLEU

from torch_reference.decode import beam_search, greedy_search, output_length
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
# ONNX, StableHLO: the run's float32 function on other kernels, a few ulps an operation: 1e-5 at logits of O(1), scaled
# by the largest |logit| above 1 (a trained small model's reach 14: ORT and torch alone then differ by 9.8e-6)
EXPORT_LOGIT_DIFF = 1e-5
MASKED = -1e8  # CTranslate2 reports the logits of tokens it may not emit at a step as about -1e9


def proof_sentences(run_dir: str | os.PathLike, given: str | os.PathLike | None = None) -> list[str]:
    """The first SENTENCES non-empty lines of `given`, else of the run's validation data (or the numbers corpus's)."""
    if given is not None:
        with contextlib.closing(LineReader(Path(given), name="proof_sentences")) as lines:  # its errors name the setting
            texts = list(lines)
    else:  # a config with --train has --valid
        cfg = runtime.read_experiment(run_dir)
        texts = [source for source, _ in data.load_split(cfg, cfg.valid or "numbers:valid")]
    texts = [t for t in texts if t.strip()][:SENTENCES]
    if not texts:
        raise runtime.UserError(f"{given or run_dir}: no sentence to prove the export on")
    return texts


def reference(params: Mapping[str, np.ndarray], cfg: TransformerConfig, run_dir: Path, sentences: Sequence[str]):
    """(source ids, length limits, greedy translations, the (T, V) logits along each) by the reference on `params`."""
    src_ids = data.encode(data.load_tokenizers(run_dir).src, sentences)
    model = Transformer(cfg).eval()
    model.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in params.items()})
    outputs, logits = [], []
    with torch.no_grad():
        for ids in src_ids:
            src = torch.tensor([ids])
            tokens = output_tokens(greedy_search(model, src)[0][0].tolist())
            outputs.append(tokens)
            logits.append(model(src, torch.tensor([[cfg.bos_id, *tokens[:-1]]]))[0].numpy())
    return src_ids, [limit(len(ids), cfg) for ids in src_ids], outputs, logits


def limit(src_len: int, cfg: TransformerConfig) -> int:
    """The most tokens the run's search lets the translation of `src_len` source tokens have."""
    return output_length(src_len, cfg.max_len, 1.5, 10)


def prove(export_dir: Path, ours: Sequence[list[int]], theirs: Sequence[list[int]], diffs: Sequence[float],
          sentences: Sequence[str], limits: Sequence[int], kind: str, exact: bool, bound: float = MAX_LOGIT_DIFF,
          extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Write proof.json (with `extra`) and a README.md line into `export_dir`; refuse a float32 one out of bounds."""
    diff = max(diffs)
    agree = sum(same_output(a, b, n) for a, b, n in zip(ours, theirs, limits)) / len(ours)
    proof = {"kind": kind, "sentences": len(sentences), "greedy_agreement": agree, "max_abs_logit_diff": diff,
             "bounds": {"greedy_agreement": MIN_AGREEMENT, "max_abs_logit_diff": bound} if exact else None,
             "first_sentences": list(sentences[:3]), **(extra or {})}
    if kind not in ("jax", "torch"):  # the bytes proven, checked where an export is read (runtime.check_export)
        proof["files"] = runtime.export_digests(export_dir)
    if exact and (diff > bound or agree < MIN_AGREEMENT):
        raise runtime.UserError(f"the {kind} export does not compute what the run computes: greedy agreement "
                                f"{agree:.1%} (bound {MIN_AGREEMENT:.0%}), largest logit difference {diff:.2e} "
                                f"(bound {bound:.0e}) on {len(sentences)} sentences; nothing was written")
    runtime.write_json_atomic(export_dir / runtime.PROOF_FILE, proof)
    line = (f"Checked at export: {agree:.1%} of {len(sentences)} greedy translations equal the run's, logits "
            f"within {diff:.1e} ({runtime.PROOF_FILE}).\n")
    readme = export_dir / "README.md"
    runtime.write_text_atomic(readme, (readme.read_text("utf-8") if readme.is_file() else "") + line)
    return proof


def ctranslate2_proof(export_dir: Path, run_dir: Path, params, cfg: TransformerConfig, sentences: Sequence[str],
                      quantization: str | None) -> dict[str, Any]:
    """The CTranslate2 model in `export_dir` against the run: greedy `translate_batch` with its logits."""
    src_ids, limits, ours, ours_logits = reference(params, cfg, run_dir, sentences)
    ct2, theirs, diffs = CT2Translator(export_dir), [], []
    for ids, n, out, logits in zip(src_ids, limits, ours, ours_logits):
        (result,) = ct2.translator.translate_batch(
            [tokens(ct2.src_vocab, ids)], beam_size=1, max_decoding_length=n, min_decoding_length=0,
            return_end_token=True, return_logits_vocab=True)
        theirs.append([ct2.tgt_ids[t] for t in result.hypotheses[0]])
        # the steps both took from the same prefix: up to and with the first that differs
        same = next((i for i, (a, b) in enumerate(zip(out, theirs[-1])) if a != b), len(out))
        steps = min(same + 1, len(out), len(theirs[-1]))
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
        limits, src = [limit(len(ids), ours_run.model_config) for ids in src_ids], _batch(src_ids)
        ours, theirs = ([output_tokens(row) for row in run.backend.translate(src, beam_size=1)]
                        for run in (ours_run, theirs_run))
        diffs = [float(np.abs(a - b).max())
                 for a, b in zip(_logits(ours_run, src, ours), _logits(theirs_run, src, ours))]
    finally:
        ours_run.close()
        theirs_run.close()
    return prove(converted, ours, theirs, diffs, sentences, limits, theirs_run.config.backend, exact=True)


def _batch(rows: Sequence[Sequence[int]]) -> np.ndarray:
    """`rows` padded with <pad> into one (B, longest) array: one shape, so JAX compiles once for every sentence."""
    out = np.full((len(rows), max(map(len, rows))), PAD_ID, np.int64)
    for row, ids in enumerate(rows):
        out[row, : len(ids)] = ids
    return out


def _logits(run, src: np.ndarray, outs: Sequence[list[int]]) -> list[np.ndarray]:
    """Each row's (T, V) logits of `run`'s model for the sources `src` (B, S) and the targets `outs`, teacher-forced."""
    tgt_in = _batch([[run.model_config.bos_id, *out[:-1]] for out in outs])
    if run.config.backend == "torch":
        with torch.no_grad():
            logits = run.backend.model.eval()(torch.from_numpy(src), torch.from_numpy(tgt_in)).numpy()
    else:
        logits = np.asarray(run.backend.ctx.model(run.backend.local_params())(src, tgt_in, deterministic=True))
    return [rows[: len(out)] for rows, out in zip(logits, outs)]


def marian_proof(export_dir: Path, run_dir: Path, params, cfg: TransformerConfig, sentences: Sequence[str],
                 marian_ids: Mapping[str, int]) -> dict[str, Any]:
    """The HF Marian directory in `export_dir` against the run: greedy `generate` and a teacher-forced pass."""
    hf = spm.require("transformers").MarianMTModel.from_pretrained(str(export_dir)).eval()
    src_order, tgt_order = side_orders(marian_ids)
    to_ours = {int(m): o for o, m in enumerate(tgt_order)}
    columns = [o for o in range(cfg.tgt_vocab_size) if o not in (cfg.bos_id, cfg.pad_id)]
    src_ids, limits, ours, ours_logits = reference(params, cfg, run_dir, sentences)
    theirs, diffs = [], []
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


def export_proof(export_dir: Path, run_dir: Path, checkpoint: str | int, sentences: Sequence[str], kind: str,
                 quantization: str | None = None) -> dict[str, Any]:
    """The ONNX or StableHLO programs in `export_dir` against the run at `checkpoint`: logits, tokens and BLEU."""
    from train.interop.exported import ExportedModel, programs

    run = train.load(run_dir, checkpoint)
    try:
        cfg, src_ids, step = run.model_config, data.encode(run.tokenizers.src, sentences), run.step
        src = _batch(src_ids)
        ours = {k: [output_tokens(row) for row in run.backend.translate(src, beam_size=k)] for k in (1, 4)}
        ours_logits = _logits(run, src, ours[1])
        scale = max(1.0, max(float(np.abs(logits).max()) for logits in ours_logits))
        refs = dict(data.load_split(run.config, run.config.valid or "numbers:valid"))
    finally:
        run.close()
    references = [refs[s] for s in sentences] if all(s in refs for s in sentences) else None
    figures, search = {}, {1: greedy_search, 4: beam_search}
    for int8 in (False, True) if quantization == "int8" else (False,):
        model = ExportedModel(programs(export_dir, int8), cfg)
        theirs = {k: [output_tokens(row) for row in search[k](model, torch.from_numpy(src))[0].tolist()]
                  for k in (1, 4)}
        tgt_in = _batch([[cfg.bos_id, *out[:-1]] for out in ours[1]])
        forced = model.forced_logits(torch.from_numpy(src), torch.from_numpy(tgt_in)).numpy()
        diffs = [float(np.abs(rows[: len(out)] - logits).max())
                 for rows, out, logits in zip(forced, ours[1], ours_logits)]
        texts = data.decode_batch(run.tokenizers.tgt, theirs[4])
        figures["int8" if int8 else "float32"] = {
            "greedy_agreement": float(np.mean([a == b for a, b in zip(ours[1], theirs[1])])),
            "beam4_agreement": float(np.mean([a == b for a, b in zip(ours[4], theirs[4])])),
            "max_abs_logit_diff": max(diffs), "theirs": theirs,
            "beam4_bleu": None if references is None else BLEU().corpus_score(texts, [references]).score}
    exact = figures["float32"]
    if exact["beam4_agreement"] < MIN_AGREEMENT:
        raise runtime.UserError(f"the {kind} export's beam-4 translations differ from the run's on "
                                f"{1 - exact['beam4_agreement']:.1%} of {len(sentences)} sentences; nothing was "
                                "written")
    extra = {k: {n: v for n, v in f.items() if n != "theirs"} for k, f in figures.items()}
    return prove(export_dir, ours[1], exact["theirs"][1], [exact["max_abs_logit_diff"]], sentences,
                 [limit(len(ids), cfg) for ids in src_ids], kind, exact=True, bound=EXPORT_LOGIT_DIFF * scale,
                 extra={"step": step, "quantization": quantization or "float32", "max_abs_logit": scale, **extra})
