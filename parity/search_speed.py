"""Translation and sampling speed of a run's weights in both frameworks, CTranslate2 and HF
(`aiayn translate-bench`, docs/performance.md, docs/decoding.md#sampling-speed)."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np
import torch

import torch_reference
from train import data
from train.api import Run, load
from train.backends import allocator, create_backend, host_devices, initialize
from train.benchmark import _cpu_name, _peak_rss_mib, _reset_peak_rss, _rss_mib
from train.data.spm import require
from train.data.streams import read_lines
from train.interop import marian
from train.interop.weights import convert_state
from train.options import POSITIVE, Output, RunSelection, Sampling, Search, checked, option, sampling_of
from train.runtime.destination import Destination
from train.runtime.files import UserError, json_text, user_errors

from . import ctranslate2 as ct2
from . import proof
from .comparison import enable_parity_numerics

REFERENCE = "torch cached"


def _trim(out) -> list[int]:
    return [int(t) for t in out if t != data.PAD_ID]


def benchmark(run: Run, lines: Sequence[str], beam_size: int, batch_size: int | None, alpha: float = 0.6,
              ctranslate2: bool = False, scoring: str = "gnmt", hf: bool = False, uncached: bool = True,
              sampling: Sampling | None = None, exports: bool = False) -> list[dict]:
    """One row per search and beam: seconds, sentences/s, outputs/s, tokens/s, speed-ups, outputs that differ
    (untimed first: every batch for JAX and StableHLO, which compile each shape there, the first for the others); with
    `sampling`, "torch sample" and "jax sample" (beam 1), JAX's samples held against torch's."""
    cfg, model_cfg = run.config, run.model_config
    state = run.backend.export_state()
    backends = {}
    for framework in ("torch", "jax"):
        initialize(cfg.replace(backend=framework))  # each framework's process settings (threads, allocator)
        backends[framework] = create_backend(cfg.replace(backend=framework), model_cfg, None)
        backends[framework].import_state(convert_state(state, framework, model_cfg))
    src_ids = data.encode(run.tokenizers.src, list(lines))
    batches = list(data.source_batches(src_ids, cfg.max_len, cfg.token_budget, batch_size))

    outputs_of = {}  # (search, beam): outputs in input order (a sample row's: each sentence's samples in turn)

    def row(name: str, beam: int, search, warmup, limits: dict | None = None) -> dict:
        """`search` (index, src) over every batch after `warmup`: its time, memory growth, and outputs held against
        torch cached search's (torch sample's for a sample): equal, or for a search outside this project (`limits`:
        each sentence's length limit) the same where `ct2.same_output` says so."""
        print(f"{name} / beam {beam} ...", file=sys.stderr, flush=True)  # untimed first: minutes where XLA compiles
        for batch in warmup:
            search(*batch)
        outputs = [None] * len(lines)
        _reset_peak_rss()  # the kernel's high-water mark (VmHWM) restarts from here
        rss, start = _rss_mib(), time.perf_counter()
        for index, src in batches:
            out = search(index, src)
            for r in np.flatnonzero(index >= 0):
                outputs[index[r]] = out[r]
        seconds, peak = time.perf_counter() - start, _peak_rss_mib() - rss
        reference = REFERENCE
        if name.endswith("sample"):  # each sentence's samples in turn, held against torch's
            reference, outputs = "torch sample", [sample for samples in outputs for sample in samples]
        outputs_of[name, beam] = outputs
        pairs = enumerate(zip(map(_trim, outputs_of[reference, beam]), outputs))
        same = [ct2.same_output(ours, out, limits[i]) if limits else ours == _trim(out) for i, (ours, out) in pairs]
        return {"search": name, "beam": beam, "seconds": seconds, "peak_mib": peak, "outputs": len(outputs),
                "tokens": sum(len(_trim(out)) for out in outputs),
                "differ": None if name == reference else same.count(False)}

    rows, beams = [], sorted({1, beam_size})
    plans = [(f"{name} {'cached' if cached else 'uncached'}", beam,
              lambda _, src, b=backends[name], k=beam, c=cached: b.translate(src, k, alpha, cached=c, scoring=scoring))
             for name, cached in (("torch", True), ("jax", True), ("torch", False))[: 3 if uncached else 2]
             for beam in beams]
    # Samples keyed by each sentence's line, so batching leaves them alone; filler rows (-1) are padding only.
    plans += [(f"{name} sample", 1,
               lambda index, src, b=backends[name]: b.sample(src, sentence_ids=np.maximum(index, 0),
                                                            **dataclasses.asdict(sampling)).tokens)
              for name in ("torch", "jax") if sampling]
    for name, beam, search in plans:
        # Each framework under the allocator it has in a process of its own (allocator.settled)
        with allocator.settled() if name.startswith("torch") else contextlib.nullcontext():
            rows.append(row(name, beam, search, batches if name.startswith("jax") else batches[:1]))
    params = convert_state(state, "torch", model_cfg).params
    limits = {int(index[r]): proof.limit(int((src[r] != data.PAD_ID).sum()), model_cfg)
              for index, src in batches for r in np.flatnonzero(index >= 0)}
    with allocator.settled(), tempfile.TemporaryDirectory() as tmp:
        disk = _weights_mib(params, state, model_cfg, Path(tmp))
        for r in rows:
            r["disk_mib"] = disk[r["search"].split()[0]]
        for name, beam, search, mib in itertools.chain(
                _ctranslate2_searches(run, params, beams, alpha, Path(tmp)) if ctranslate2 else (),
                _hf_searches(run, params, beams, alpha) if hf else ()):
            rows.append({**row(name, beam, search, batches[:1], limits), "disk_mib": mib})
        for name, beam, search, mib in _export_searches(run, params, beams, alpha, Path(tmp)) if exports else ():
            warmup = batches if name == "stablehlo" else batches[:1]  # XLA compiles each shape, as for JAX
            rows.append({**row(name, beam, search, warmup), "disk_mib": mib})
    for r in rows:
        if not r["search"].endswith("sample"):  # the searches' tokens held against JAX's, position by position
            theirs = outputs_of["jax cached", r["beam"]]
            r["tokens_differ_from_jax"] = sum(a != b for ours, out in zip(theirs, outputs_of[r["search"], r["beam"]])
                                              for a, b in itertools.zip_longest(_trim(ours), _trim(out)))
        if r["search"].endswith(" int8"):  # how far quantization moves the translations
            import sacrebleu

            int8, exact = (data.decode_batch(run.tokenizers.tgt, outputs_of[r["search"].replace("int8", k), r["beam"]])
                           for k in ("int8", "float32"))
            r["bleu_vs_float32"] = sacrebleu.corpus_bleu(int8, [exact]).score
        r.update(sentences=len(lines), sentences_per_s=len(lines) / r["seconds"],
                 outputs_per_s=r["outputs"] / r["seconds"], tokens_per_s=r["tokens"] / r["seconds"])
        for baseline in (REFERENCE, "torch uncached"):
            match = next((x for x in rows if x["search"] == baseline and x["beam"] == r["beam"]), None)
            r[f"speedup_vs_{baseline.replace(' ', '_')}"] = match and match["seconds"] / r["seconds"]
    for backend in backends.values():
        backend.close()
    return rows


def _mib(path: Path) -> float:
    return sum(f.stat().st_size for f in ([path] if path.is_file() else path.rglob("*")) if f.is_file()) / 2**20


def _weights_mib(params, state, model_cfg, tmp: Path) -> dict[str, float]:
    """MiB on disk of the weights as `aiayn convert --to torch` and `--to jax` write them."""
    from train.interop.runs import save_jax_weights, save_torch_weights
    from train.interop.weights import jax_model_from_params

    torch_model = torch_reference.Transformer(model_cfg)
    torch_model.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in params.items()})
    jax_model = jax_model_from_params(convert_state(state, "jax", model_cfg).params, model_cfg)
    return {"torch": _mib(save_torch_weights(torch_model, tmp / "torch.safetensors")),
            "jax": _mib(save_jax_weights(jax_model, tmp / "jax") / "params")}


def _ctranslate2_searches(run: Run, params, beams: list[int], alpha: float, tmp: Path):
    """("ctranslate2 float32" | "ctranslate2 int8", beam, search, MiB on disk) of the run exported under `tmp`."""
    threads = torch.get_num_threads()  # as many as torch's cached search uses
    for kind in ("float32", "int8"):
        ct2.export_ctranslate2(run.run_dir, params, run.model_config, tmp / kind, quantization=kind)
        translator = ct2.CT2Translator(tmp / kind, intra_threads=threads)
        for beam in beams:
            def search(_, src, k=beam, translator=translator):
                limit = proof.limit(src.shape[1], run.model_config)
                return translator.translate_ids(src, beam_size=k, max_len=limit, length_penalty=alpha)

            yield f"ctranslate2 {kind}", beam, search, _mib(tmp / kind)


def _export_searches(run: Run, params, beams: list[int], alpha: float, tmp: Path):
    """("onnxruntime float32" | "onnxruntime int8" | "stablehlo", beam, search, MiB on disk) of exports under `tmp`."""
    from train.interop.exported import (ONNX_FILES, STABLEHLO_FILES, ExportBackend, OnnxPrograms, StableHloPrograms,
                                        quantized)

    from .onnx_export import write_onnx
    from .stablehlo_export import write_stablehlo

    for kind, write in (("onnx", lambda d: write_onnx(params, run.model_config, d, "int8")),
                        ("stablehlo", lambda d: write_stablehlo(params, run.model_config, d))):
        (tmp / kind).mkdir()
        write(tmp / kind)
    threads = torch.get_num_threads()  # as many as torch's cached search uses
    for name, programs, files in (
            ("onnxruntime float32", lambda: OnnxPrograms(tmp / "onnx", False, threads), ONNX_FILES),
            ("onnxruntime int8", lambda: OnnxPrograms(tmp / "onnx", True, threads), map(quantized, ONNX_FILES)),
            ("stablehlo", lambda: StableHloPrograms(tmp / "stablehlo"), STABLEHLO_FILES)):
        backend = ExportBackend(programs(), run.model_config, run.step)
        disk = sum(_mib(tmp / ("stablehlo" if name == "stablehlo" else "onnx") / f) for f in files)
        for beam in beams:
            yield name, beam, lambda _, src, k=beam, b=backend: b.translate(src, k, alpha), disk


def _hf_searches(run: Run, params, beams: list[int], alpha: float):
    """("hf generate", beam, search): the run's weights as a MarianMTModel, `generate` on the same batches."""
    record = marian.marian_origin(run.run_dir)
    model = marian.marian_model(record, params, run.model_config).eval()
    ids = record["marian_ids"]
    src_order, tgt_order = marian.side_orders(ids)
    to_ours = {int(m): ours for ours, m in enumerate(tgt_order) if ours != data.BOS_ID}
    for beam in beams:
        def search(_, src, k=beam):
            limit = proof.limit(src.shape[1], run.model_config)
            with torch.inference_mode():
                out = model.generate(
                    input_ids=torch.from_numpy(src_order[src]), attention_mask=torch.from_numpy(src != data.PAD_ID),
                    num_beams=k, do_sample=False, max_new_tokens=limit, bad_words_ids=[[ids["pad"]]],
                    forced_eos_token_id=ids["eos"],
                    **({"length_penalty": alpha, "early_stopping": "never"} if k > 1 else {}),
                )
            return [[to_ours[int(m)] for m in row[1:] if m != ids["pad"]] for row in out.tolist()]

        yield "hf generate", beam, search, None


@checked
class SpeedBench:
    """What `bench_file` times, on which sentences, and where it writes (docs/performance.md#translation-speed)."""

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
    exports: bool = option(False, "also time the run exported to ONNX (ONNX Runtime, float32 and int8) and StableHLO "
                           "(jax.export), decoded by this project's search over them (needs the export extra: pip "
                           "install -e \".[export]\")")
    sample: bool = option(False, "also time sampling in both frameworks as --num-samples, --temperature, --top-k, "
                          "--top-p and --seed say (outputs: samples; JAX's held against torch's)")


def bench_file(selection: RunSelection, search: Search, bench: SpeedBench = SpeedBench(),
               sampling: Sampling | None = None) -> list[dict]:
    """`aiayn translate-bench`: `benchmark` of `selection`'s run on `bench.input` (stdin), printed."""
    enable_parity_numerics()
    if len(selection.run_dir) > 1:
        raise UserError("--run-dir once: the benchmark times one run's weights")
    sentences = [line for line in read_lines(bench.input) if line.strip()]
    if not sentences:
        raise UserError(f"{bench.input or 'standard input'} holds no sentence to translate")
    if bench.json is not None and bench.input is not None:  # the figures would replace the sentences
        Destination(bench.json.path, "--json", [bench.input], f"--input {bench.input}")
    with user_errors(ImportError):  # one line naming the extra, before minutes of work
        for package, extra in [(name, extra) for name, extra, wanted in (
                ("ctranslate2", "interop", bench.ctranslate2), ("transformers", "interop", bench.hf),
                ("onnxruntime", "export", bench.exports)) if wanted]:
            require(package, extra)
    if bench.hf:
        try:
            marian.marian_origin(selection.run_dir[0])
        except ValueError as err:
            raise UserError(f"--hf: {err}") from None
    with load(selection) as run:
        rows = benchmark(run, sentences, search.beam, bench.batch_size, search.alpha, scoring=search.scoring,
                         ctranslate2=bench.ctranslate2, hf=bench.hf, uncached=bench.uncached, exports=bench.exports,
                         sampling=sampling_of(sampling or bench.sample, {}))
    accelerator = "" if jax.default_backend() == "cpu" else f", {jax.devices()[0].device_kind}"
    machine = (f"{_cpu_name()}, {host_devices.cores()} CPUs{accelerator}, "
               f"jax on {jax.device_count()} device{'s' * (jax.device_count() > 1)}")
    print(f"{len(sentences)} sentences, {run.model_config.d_model}-wide {run.config.preset} model, {machine}")
    print(f"{'search':19s} {'beam':>4s} {'seconds':>8s} {'sent/s':>8s} {'out/s':>8s} {'tok/s':>8s} {'peak MiB':>8s} "
          f"{'vs torch cached':>16s} {'vs uncached':>12s} {'outputs differ':>15s} {'tokens differ from jax':>22s}")
    for r in rows:
        differ = "reference" if r["differ"] is None else str(r["differ"])
        uncached = "-" if r["speedup_vs_torch_uncached"] is None else f"{r['speedup_vs_torch_uncached']:.2f}x"
        print(f"{r['search']:19s} {r['beam']:4d} {r['seconds']:8.2f} {r['sentences_per_s']:8.1f} "
              f"{r['outputs_per_s']:8.1f} {r['tokens_per_s']:8.0f} {r['peak_mib']:8.0f} "
              f"{r['speedup_vs_torch_cached']:15.2f}x {uncached:>12s} {differ:>15s} "
              f"{r.get('tokens_differ_from_jax', '-'):>22}"
              + (f"   BLEU vs float32 {r['bleu_vs_float32']:.2f}" if "bleu_vs_float32" in r else "")
              + (f"   {r['disk_mib']:.1f} MiB on disk" if r.get("disk_mib") is not None else ""))
    if bench.json:
        bench.json.write(json_text({"run_dir": str(selection.run_dir[0]), "machine": machine, "rows": rows}))
    return rows
