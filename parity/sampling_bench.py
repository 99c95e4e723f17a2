"""Sampling speed beside greedy and beam search, both twins on a run's weights in one process, and how many
samples differ (0: one seed, the same tokens): `report(RUN, FILE, ...)`, docs/decoding.md#sampling-speed."""

from __future__ import annotations

import platform
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

import jax_transformer.decode as jd
import jax_transformer.sampling as js
import torch_reference
import torch_reference.decode as td
import torch_reference.sampling as ts
from train import data
from train.api import load
from train.backends import host_devices
from train.data.streams import read_lines
from train.interop.weights import convert_state, numpy_to_torch, torch_to_jax


def searches(beam: int, samples: int, top_p: float, seed: int) -> dict:
    """name -> (torch search, JAX search), each (model, src (B, S), sentence ids (B,)) -> tokens (B, ..., L) NumPy."""
    def twins(torch_fn, jax_fn, keyed: bool = False, **kw):  # keyed: samples by each sentence's line, any batch
        def call(fn, model, src, ids):
            return fn(model, src, **kw, **({"sentence_ids": ids} if keyed else {}))[0]

        return (lambda model, src, ids: call(torch_fn, model, torch.from_numpy(src), ids).numpy(),
                lambda model, src, ids: np.asarray(call(jax_fn, model, src, ids)))

    return {"greedy": twins(td.greedy_search, jd.greedy_search),
            f"beam {beam}": twins(td.beam_search, jd.beam_search, beam_size=beam),
            f"sample x{samples}": twins(ts.sample, js.sample, True, seed=seed, num_samples=samples, top_p=top_p)}


def benchmark(run_dir, lines: Sequence[str], beam: int = 4, samples: int = 1, top_p: float = 1.0, seed: int = 0,
              batch_size: int | None = None) -> list[dict]:
    """One row per framework and search: seconds, sentences/s, outputs/s, tokens/s (sampling's: outputs that differ)."""
    with load(run_dir) as run:
        cfg, model_cfg, tokenizer = run.config, run.model_config, run.tokenizers.src
        weights = convert_state(run.backend.export_state(), "torch", model_cfg).params
    torch_model = torch_reference.Transformer(model_cfg).eval()
    torch_model.load_state_dict({k: numpy_to_torch(v) for k, v in weights.items()}, strict=True)
    models = {"torch": torch_model, "jax": torch_to_jax(torch_model)}
    src_ids = data.encode(tokenizer, list(lines))
    # Filler rows (index -1) are padding only: never sampled, any id serves.
    batches = [(src, np.maximum(index, 0)) for index, src in
               data.source_batches(src_ids, cfg.max_len, cfg.token_budget, batch_size)]
    rows = []
    for name, pair in searches(beam, samples, top_p, seed).items():
        outputs = {}
        for framework, search in zip(("torch", "jax"), pair):
            for src, ids in batches if framework == "jax" else batches[:1]:  # compile / warm up, untimed
                search(models[framework], src, ids)
            start = time.perf_counter()
            outputs[framework] = [search(models[framework], src, ids) for src, ids in batches]
            seconds = time.perf_counter() - start
            count = len(lines) * (samples if name.startswith("sample") else 1)
            tokens = int(sum((out != data.PAD_ID).sum() for out in outputs[framework]))
            rows.append({"framework": framework, "search": name, "seconds": seconds, "outputs": count,
                         "sentences_per_s": len(lines) / seconds, "outputs_per_s": count / seconds,
                         "tokens_per_s": tokens / seconds})
        if name.startswith("sample"):  # padding rows (index -1) included: they are padding in both
            differ = sum(int((a != b).any(axis=-1).sum()) for a, b in zip(outputs["torch"], outputs["jax"]))
            rows[-2]["differ"] = rows[-1]["differ"] = differ
    return rows


def report(run_dir, input_path, **settings) -> list[dict]:
    """`benchmark` over the non-empty lines of `input_path`, printed as a table with the machine; the rows."""
    lines = [line for line in read_lines(Path(input_path)) if line.strip()]
    rows = benchmark(run_dir, lines, **settings)
    print(f"{len(lines)} sentences, {platform.processor() or platform.machine()}, {host_devices.cores()} CPUs, "
          f"torch {torch.get_num_threads()} threads")
    print(f"{'framework':9s} {'search':12s} {'seconds':>8s} {'sent/s':>8s} {'outputs/s':>9s} {'tok/s':>8s} {'differ':>6s}")
    for r in rows:
        print(f"{r['framework']:9s} {r['search']:12s} {r['seconds']:8.2f} {r['sentences_per_s']:8.1f} "
              f"{r['outputs_per_s']:9.1f} {r['tokens_per_s']:8.0f} {r.get('differ', ''):>6}")
    return rows
