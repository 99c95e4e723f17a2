"""Translation speed of a run's weights in both frameworks, CTranslate2 and HF (`aiayn translate-bench`,
docs/performance.md)."""

from __future__ import annotations

import contextlib
import platform
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np
import torch

from train import data
from train.api import Run, load
from train.backends import allocator, create_backend, host_devices, initialize
from train.benchmark import _peak_rss_mib, _reset_peak_rss, _rss_mib
from train.data.spm import require
from train.data.streams import read_lines
from train.interop import marian
from train.interop.weights import convert_state
from train.options import POSITIVE, Output, RunSelection, Search, checked, option
from train.runtime.files import UserError, json_text

from . import ctranslate2 as ct2
from . import proof
from .comparison import enable_parity_numerics

REFERENCE = "torch cached"


def _trim(out) -> list[int]:
    return [int(t) for t in out if t != data.PAD_ID]


def benchmark(run: Run, lines: Sequence[str], beam_size: int, batch_size: int | None, alpha: float = 0.6,
              ctranslate2: bool = False, scoring: str = "gnmt", hf: bool = False, uncached: bool = True) -> list[dict]:
    """One row per search and beam: seconds, sentences/s, tokens/s, speed-ups, outputs that differ
    (untimed first: every batch for JAX, which compiles each shape there, the first for the others)."""
    cfg, model_cfg = run.config, run.model_config
    state = run.backend.export_state()
    backends = {}
    for framework in ("torch", "jax"):
        initialize(cfg.replace(backend=framework))  # each framework's process settings (threads, allocator)
        backends[framework] = create_backend(cfg.replace(backend=framework), model_cfg, None)
        backends[framework].import_state(convert_state(state, framework, model_cfg))
    src_ids = data.encode(run.tokenizers.src, list(lines))
    batches = list(data.source_batches(src_ids, cfg.max_len, cfg.token_budget, batch_size))

    def timed(search, warmup) -> tuple[float, list, float]:
        """(seconds, outputs in input order, peak memory growth in MiB) of searching every batch."""
        for _, src in warmup:
            search(src)
        outputs = [None] * len(lines)
        _reset_peak_rss()  # the kernel's high-water mark (VmHWM) restarts from here
        rss, start = _rss_mib(), time.perf_counter()
        for index, src in batches:
            out = search(src)
            for row in np.flatnonzero(index >= 0):
                outputs[index[row]] = out[row]
        return time.perf_counter() - start, outputs, _peak_rss_mib() - rss

    rows, reference = [], {}
    for name, cached in (("torch", True), ("jax", True), ("torch", False))[: 3 if uncached else 2]:
        search_name = f"{name} {'cached' if cached else 'uncached'}"
        for beam in sorted({1, beam_size}):
            search = lambda src, b=backends[name], k=beam, c=cached: b.translate(src, k, alpha, cached=c,
                                                                                scoring=scoring)
            # Each framework under the allocator it has in a process of its own (allocator.settled)
            with allocator.settled() if name == "torch" else contextlib.nullcontext():
                seconds, outputs, peak = timed(search, batches if name == "jax" else batches[:1])
            if search_name == REFERENCE:
                reference[beam] = outputs
            rows.append({"search": search_name, "beam": beam, "seconds": seconds, "peak_mib": peak,
                         "tokens": int(sum((out != data.PAD_ID).sum() for out in outputs)),
                         "differ": None if search_name == REFERENCE
                         else sum(_trim(a) != _trim(b) for a, b in zip(outputs, reference[beam]))})
    for wanted, foreign_rows in ((ctranslate2, _ctranslate2_rows), (hf, _hf_rows)):
        if wanted:
            with allocator.settled():
                rows += foreign_rows(run, state, batches, beam_size, alpha, timed, reference)
    for row in rows:
        row.update(sentences=len(lines), sentences_per_s=len(lines) / row["seconds"],
                   tokens_per_s=row["tokens"] / row["seconds"])
        for baseline in (REFERENCE, "torch uncached"):
            match = next((r for r in rows if r["search"] == baseline and r["beam"] == row["beam"]), None)
            row[f"speedup_vs_{baseline.replace(' ', '_')}"] = match and match["seconds"] / row["seconds"]
    for backend in backends.values():
        backend.close()
    return rows


def _ctranslate2_rows(run: Run, state, batches, beam_size: int, alpha: float, timed, reference) -> list[dict]:
    """Rows "ctranslate2 float32" and "ctranslate2 int8", and int8's BLEU against float32 (in the int8 rows)."""
    import sacrebleu

    params = convert_state(state, "torch", run.model_config).params
    threads = torch.get_num_threads()  # as many as torch's cached search uses
    rows, texts = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("float32", "int8"):
            ct2.export_ctranslate2(run.run_dir, params, run.model_config, Path(tmp) / kind, quantization=kind)
            translator = ct2.Translator(Path(tmp) / kind, intra_threads=threads)
            for beam in sorted({1, beam_size}):
                def search(src, k=beam):
                    limit = proof.limit(src.shape[1], run.model_config)
                    return translator.translate_ids(src, beam_size=k, max_len=limit, length_penalty=alpha)

                row, outputs = _foreign_row(run, f"ctranslate2 {kind}", beam, search, batches, timed, reference)
                texts[kind, beam] = data.decode_batch(run.tokenizers.tgt, outputs)
                if kind == "int8":
                    row["bleu_vs_float32"] = sacrebleu.corpus_bleu(texts[kind, beam], [texts["float32", beam]]).score
                rows.append(row)
    return rows


def _foreign_row(run: Run, name: str, beam: int, search, batches, timed, reference) -> tuple[dict, list]:
    """(row `name`, outputs) of a search outside this project, outputs ours where `ct2.same_output` says so."""
    limits = {int(index[row]): proof.limit(int((src[row] != data.PAD_ID).sum()), run.model_config)
              for index, src in batches for row in np.flatnonzero(index >= 0)}
    seconds, outputs, peak = timed(search, batches[:1])
    ours = reference[beam]
    differ = sum(not ct2.same_output(_trim(ours[i]), out, limits[i]) for i, out in enumerate(outputs))
    return {"search": name, "beam": beam, "seconds": seconds, "peak_mib": peak,
            "tokens": int(sum(len(out) for out in outputs)), "differ": differ}, outputs


def _hf_rows(run: Run, state, batches, beam_size: int, alpha: float, timed, reference) -> list[dict]:
    """Row "hf generate": the run's weights as a MarianMTModel, `generate` on the same batches."""
    record = marian.marian_origin(run.run_dir)
    params = convert_state(state, "torch", run.model_config).params
    model = marian.marian_model(record, params, run.model_config).eval()
    ids = record["marian_ids"]
    src_order, tgt_order = marian.side_orders(ids)
    to_ours = {int(m): ours for ours, m in enumerate(tgt_order) if ours != data.BOS_ID}
    rows = []
    for beam in sorted({1, beam_size}):
        def search(src, k=beam):
            limit = proof.limit(src.shape[1], run.model_config)
            with torch.inference_mode():
                out = model.generate(
                    input_ids=torch.from_numpy(src_order[src]), attention_mask=torch.from_numpy(src != data.PAD_ID),
                    num_beams=k, do_sample=False, max_new_tokens=limit, bad_words_ids=[[ids["pad"]]],
                    forced_eos_token_id=ids["eos"],
                    **({"length_penalty": alpha, "early_stopping": "never"} if k > 1 else {}),
                )
            return [[to_ours[int(m)] for m in row[1:] if m != ids["pad"]] for row in out.tolist()]

        rows.append(_foreign_row(run, "hf generate", beam, search, batches, timed, reference)[0])
    return rows


@checked
class SpeedBench:
    """What `bench_file` times, on which sentences, and where it writes: JAX and torch cached search and torch's
    uncached loop, greedy and with the search's beam; `ctranslate2` and `hf` add those exports
    (docs/performance.md#translation-speed)."""

    input: Path | None = option(None, "text file, one source sentence per line (plain or .gz); default: stdin")
    batch_size: int | None = option(None, "at most N sentences per batch; default: the run's --token-budget",
                                    range=POSITIVE)
    json: Output = option(None, "also write the figures to this JSON file")
    ctranslate2: bool = option(False, "also time the run exported to CTranslate2 in float32 and int8 (needs the "
                               "interop extra: pip install -e \".[interop]\")")
    hf: bool = option(False, "also time HF transformers' generate on the run's weights (a run imported from Marian: "
                      "aiayn convert --from marian; needs the interop extra)")
    uncached: bool = option(True, "torch's uncached loop (hours at large shapes; --no-uncached leaves it out and "
                            "the speed-ups against it are then null)")


def bench_file(selection: RunSelection, search: Search, bench: SpeedBench = SpeedBench()) -> list[dict]:
    """`aiayn translate-bench`: `benchmark` of the run `selection` names on the sentences of
    `bench.input` (stdin), printed as a table (and written to `bench.json`)."""
    enable_parity_numerics()
    if len(selection.run_dir) > 1:
        raise UserError("--run-dir once: the benchmark times one run's weights")
    sentences = [line for line in read_lines(bench.input) if line.strip()]
    if not sentences:
        raise UserError(f"{bench.input or 'standard input'} holds no sentence to translate")
    run = load(selection)
    for package in [name for name, wanted in (("ctranslate2", bench.ctranslate2), ("transformers", bench.hf))
                    if wanted]:
        try:
            require(package)
        except ImportError as err:  # one line naming the extra
            raise UserError(str(err)) from None
    if bench.hf:
        try:
            marian.marian_origin(selection.run_dir[0])
        except ValueError as err:
            raise UserError(f"--hf: {err}") from None
    rows = benchmark(run, sentences, search.beam, bench.batch_size, search.alpha, scoring=search.scoring,
                     ctranslate2=bench.ctranslate2, hf=bench.hf, uncached=bench.uncached)
    run.backend.close()
    machine = f"{platform.processor() or platform.machine()}, {host_devices.cores()} CPUs"
    if jax.default_backend() != "cpu":
        machine += f", {jax.devices()[0].device_kind}"
    machine += f", jax on {jax.device_count()} device{'s' * (jax.device_count() > 1)}"
    print(f"{len(sentences)} sentences, {run.model_config.d_model}-wide {run.config.preset} model, {machine}")
    print(f"{'search':19s} {'beam':>4s} {'seconds':>8s} {'sent/s':>8s} {'tok/s':>8s} {'peak MiB':>8s} "
          f"{'vs torch cached':>16s} {'vs uncached':>12s} {'outputs differ':>15s}")
    for r in rows:
        differ = "reference" if r["differ"] is None else str(r["differ"])
        uncached = "-" if r["speedup_vs_torch_uncached"] is None else f"{r['speedup_vs_torch_uncached']:.2f}x"
        print(f"{r['search']:19s} {r['beam']:4d} {r['seconds']:8.2f} {r['sentences_per_s']:8.1f} "
              f"{r['tokens_per_s']:8.0f} {r['peak_mib']:8.0f} {r['speedup_vs_torch_cached']:15.2f}x {uncached:>12s} "
              f"{differ:>15s}" + (f"   BLEU vs float32 {r['bleu_vs_float32']:.2f}" if "bleu_vs_float32" in r else ""))
    if bench.json:
        bench.json.write(json_text({"run_dir": str(selection.run_dir[0]), "machine": machine, "rows": rows}))
    return rows
