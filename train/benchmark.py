"""`aiayn bench`: JAX vs PyTorch eager vs torch.compile step times, each in a fresh worker (docs/performance.md)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import time
import timeit
from collections.abc import Callable
from pathlib import Path

import numpy as np

from torch_reference.config import NON_NEGATIVE, POSITIVE, PROBABILITY, TransformerConfig

from .config import KERNEL_CHOICES
from .options import OptionError, Output, checked, option
from .runtime.files import UserError, json_text

BACKENDS = ("jax", "torch", "torch-compile")
PRECISIONS = ("float32", "tf32", "bfloat16")
PRECISION_HELP = (
    "precisions: float32 = full float32 matmuls (TF32 off); tf32 = float32 with TF32 tensor-core matmuls (JAX's "
    "default on Ampere and newer GPUs; float32 on a CPU); bfloat16 = mixed precision, as train.run --dtype bfloat16")
REMAT_MODES = {"off": (False,), "on": (True,), "both": (False, True)}  # aiayn bench --remat
# One measurement in a fresh interpreter: `run_worker` of the JSON keywords given, its result the last line printed.
WORKER = ("import json, sys; from train.benchmark import run_worker; "
          "print(json.dumps(run_worker(**json.loads(sys.argv[1]))))")


@checked
class Bench:
    """What `measure` times: every precision x preset x backend (x remat), each in a worker process."""

    presets: tuple[str, ...] | str = option("tiny,small,base", "comma-separated model presets")
    backends: tuple[str, ...] | str = option(",".join(BACKENDS), f"comma-separated, from {', '.join(BACKENDS)}")
    batch_tokens: int = option(1024, "tokens per side per batch: B = batch-tokens / length sentences", range=POSITIVE)
    length: int = option(32, "source and target length of every sentence", range=POSITIVE)
    vocab_size: int = option(8000, "shared vocabulary size", range=POSITIVE)
    steps: int = option(10, "timed steps after warm-up", range=POSITIVE)
    warmup: int = option(3, "untimed steps first, compilation included", range=NON_NEGATIVE)
    dropout: float = option(0.0, "dropout rate (0: off; the paper's 0.1 with --dropout 0.1)", range=PROBABILITY)
    precisions: tuple[str, ...] | str = option("float32", f"comma-separated, from {', '.join(PRECISIONS)} (see below)")
    remat: str = option("off", "train.run --remat: recompute each layer's activations in the backward pass; both: "
                        "each backend without then with it, side by side", choices=tuple(REMAT_MODES))
    kernels: str = option("auto", "train.run --kernels: the models' kernel set", choices=KERNEL_CHOICES)
    devices: int = option(1, "data parallel over N devices, the same global batch split over them: JAX's mesh (on a "
                          "CPU, N host devices), torch DistributedDataParallel in N processes", range=POSITIVE)
    json: Output = option(None, "write all figures to this JSON file (after every measurement)")
    plot: Output = option(None, "write a bar chart of step times to this PNG")

    def check(self) -> None:
        for name, known in (("presets", TransformerConfig.presets()), ("backends", BACKENDS),
                            ("precisions", PRECISIONS)):
            value = getattr(self, name)
            names = tuple(n for n in (value.split(",") if isinstance(value, str) else value) if n)
            if not names:
                raise OptionError("{} names nothing to measure", name)
            if unknown := [n for n in names if n not in known]:
                raise OptionError("{}: " + f"unknown {name[:-1]} {unknown[0]!r}; choose from {', '.join(known)}", name)
            object.__setattr__(self, name, names)
        if self.batch_size % self.devices:
            raise OptionError("{} " + f"{self.devices} does not divide the batch of {self.batch_size} sentences (" +
                              "{} / {})", "devices", "batch_tokens", "length")

    @property
    def batch_size(self) -> int:
        return max(1, self.batch_tokens // self.length)


def step_flops(cfg: TransformerConfig, batch_size: int, src_len: int, tgt_len: int) -> int:
    """Model FLOPs of one training step: 3 x the forward pass, 2 a multiply-add of every matmul; embeddings free."""
    D, F, V = cfg.d_model, cfg.d_ff, cfg.tgt_vocab_size
    ff = (6 if cfg.activation == "swiglu" else 4) * D * F
    encoder = cfg.num_encoder_layers * src_len * (8 * D * D + ff + 4 * src_len * D)
    decoder = cfg.num_decoder_layers * (tgt_len * (8 * D * D + 4 * tgt_len * D + 4 * D * D + 4 * src_len * D + ff)
                                        + src_len * 4 * D * D)
    return 3 * batch_size * (encoder + decoder + tgt_len * 2 * D * V)


def fixed_batches(cfg: TransformerConfig, batch_size: int, length: int, count: int):
    """`count` dense batches (no padding) of random ids: every backend trains on these."""
    from .data import Batch

    rng = np.random.default_rng(0)
    for _ in range(count):
        src = rng.integers(4, cfg.src_vocab_size, size=(batch_size, length), dtype=np.int32)
        tgt = rng.integers(4, cfg.tgt_vocab_size, size=(batch_size, length), dtype=np.int32)
        tgt[:, -1] = cfg.eos_id
        tgt_in = np.concatenate([np.full((batch_size, 1), cfg.bos_id, np.int32), tgt[:, :-1]], axis=1)
        yield Batch(src, tgt_in, tgt, np.arange(batch_size), src.size, tgt.size)


def _rss_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mib() -> float:
    """The process's peak resident memory since it started, or since `_reset_peak_rss` (/proc, as `_rss_mib`)."""
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text())[1]) / 1024  # KiB


def _reset_peak_rss() -> bool:
    """Restart the peak (VmHWM) from the current resident memory (Linux >= 4.0); False where unsupported."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def set_precision(framework: str, precision: str) -> None:
    """Matmul precision of this process for `precision` (one of PRECISIONS: `PRECISION_HELP`)."""
    if framework == "jax":
        import jax

        jax.config.update("jax_default_matmul_precision",
                          {"float32": "highest", "tf32": "tensorfloat32", "bfloat16": "default"}[precision])
    else:
        import torch

        torch.set_float32_matmul_precision("high" if precision == "tf32" else "highest")
        torch.backends.cudnn.allow_tf32 = precision == "tf32"


def timings(fn: Callable[[], object], repeats: int, warmup: int = 0) -> list[float]:
    """Seconds of each of `repeats` calls of `fn` (garbage collection paused), after `warmup` untimed calls."""
    timer = timeit.Timer(fn)
    timer.repeat(warmup, 1)
    return timer.repeat(repeats, 1)


def matmul_peak_gflops(framework: str, precision: str) -> float:
    """The best of 10 n x n matmul throughputs at `precision`, GFLOP/s (n 2048 on a CPU, 8192 on a GPU)."""
    dtype_name = "bfloat16" if precision == "bfloat16" else "float32"
    if framework == "jax":
        import jax
        import jax.numpy as jnp

        n = 2048 if jax.devices()[0].platform == "cpu" else 8192
        a = jax.random.normal(jax.random.key(0), (n, n), getattr(jnp, dtype_name))
        mm = jax.jit(lambda x, y: x @ y)
        run = lambda: mm(a, a).block_until_ready()
    else:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        n = 8192 if device == "cuda" else 2048
        a = torch.randn(n, n, device=device, dtype=getattr(torch, dtype_name))
        run = lambda: (a @ a)[0, 0].item()
    return 2 * n**3 / min(timings(run, 10, warmup=1)) / 1e9


def run_worker(preset: str, backend: str, precision: str, remat: bool, batch_size: int, length: int,
               vocab_size: int, steps: int, warmup: int, dropout: float, kernels: str, devices: int) -> dict:
    """Train `steps` steps of one backend on the fixed batches and measure them."""
    from .backends import create_backend, initialize
    from .config import ExperimentConfig

    framework, name = "jax" if backend == "jax" else "torch", backend
    set_precision(framework, precision)
    cfg = TransformerConfig.preset(preset, src_vocab_size=vocab_size, tgt_vocab_size=vocab_size,
                                   max_len=max(length, 64), dropout=dropout)
    exp = ExperimentConfig(backend=framework, preset=preset, compile=backend == "torch-compile", steps=10**6,
                           warmup=4000, progress=False, dropout=cfg.dropout, kernels=kernels, remat=remat,
                           dtype="bfloat16" if precision == "bfloat16" else "float32", devices=devices)
    peak = matmul_peak_gflops(framework, precision)
    batches = list(fixed_batches(cfg, batch_size, length, 4))
    # Memory counts from here: model, optimizer state (torch's made in the first step), gradients, activations.
    initialize(exp)  # the process's settings (allocator, threads), as train.run applies them
    rss_base = _rss_mib()
    backend = create_backend(exp, cfg, None)

    times = []
    for i in range(warmup + steps):
        if i == warmup:  # compilation's transient memory is reported apart from training's
            warmup_peak = _peak_rss_mib() - rss_base
            steady = _reset_peak_rss()
        start = time.perf_counter()
        metrics = backend.train_step([batches[i % len(batches)]])
        backend.fetch([metrics])  # wait for the step, as a training loop reading its loss would
        times.append(time.perf_counter() - start)
    loss = backend.fetch([metrics])[0]["loss"]

    median = statistics.median(times[warmup:])
    flops = step_flops(cfg, batch_size, length, length)
    tokens = 2 * batch_size * length
    result = {"preset": preset, "backend": name, "devices": exp.devices, "precision": precision,
              "dropout": cfg.dropout, "kernels": backend.kernels, "remat": remat, "batch": [batch_size, length],
              "tokens_per_step": tokens, "first_step_s": times[0], "median_step_s": median,
              "step_times_s": times[warmup:], "tokens_per_s": tokens / median, "step_flops": flops,
              "achieved_gflops": flops / median / 1e9, "matmul_peak_gflops": peak, "mfu": flops / median / 1e9 / peak,
              "final_loss": loss, "num_params": backend.num_params}
    if framework == "jax":
        import jax

        device = jax.devices()[0]
        result.update(device=device.device_kind, versions={"jax": jax.__version__})
        peak_bytes = (device.memory_stats() or {}).get("peak_bytes_in_use")
    else:
        import torch

        gpu = torch.cuda.is_available()
        result.update(device=torch.cuda.get_device_name() if gpu else platform.processor() or "cpu",
                      versions={"torch": torch.__version__})
        peak_bytes = torch.cuda.max_memory_allocated() if gpu else None
    if peak_bytes is None:  # CPU: resident memory above the process before the model existed
        kind = "peak RSS over training steps" if steady else "peak RSS since start (incl. compilation)"
        result.update(peak_memory_mib=_peak_rss_mib() - rss_base, warmup_peak_memory_mib=warmup_peak, memory_kind=kind)
    else:
        result.update(peak_memory_mib=peak_bytes / 2**20, memory_kind="device peak")
    return result


def _cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def write_plot(results: list[dict], path: Path) -> None:
    """A bar chart of the median step times: a group per precision and preset, a bar per backend."""
    from matplotlib.figure import Figure  # no pyplot: no display, no global state

    groups = list(dict.fromkeys((r["precision"], r["preset"]) for r in results))
    backends = list(dict.fromkeys(r["backend"] for r in results))
    fig = Figure(figsize=(2.2 + 1.8 * len(groups), 3.6), layout="tight")
    ax = fig.subplots()
    width = 0.8 / len(backends)
    for j, backend in enumerate(backends):
        values = [next((r["median_step_s"] * 1e3 for r in results
                        if (r["precision"], r["preset"]) == group and r["backend"] == backend), 0) for group in groups]
        ax.bar(np.arange(len(groups)) + j * width, values, width, label=backend)
    ax.set_xticks(np.arange(len(groups)) + width * (len(backends) - 1) / 2,
                  [f"{preset}\n{precision}" for precision, preset in groups])
    ax.set_ylabel("median train step (ms)")
    ax.set_title(f"train step, {results[0]['device']}", fontsize=9)
    ax.legend()
    fig.savefig(path, dpi=120)


def print_results(results: list[dict], batch_size: int, length: int, dropout: float, devices: int) -> None:
    """`aiayn bench`'s table: one row per measurement, its step time against torch eager's."""
    print(f"\nmachine: {_cpu_name()}, {os.cpu_count()} CPUs; device {results[0]['device']}; batch {batch_size} x "
          f"{length} tokens per side over {devices} device(s); dropout {dropout}")
    print(f"{'precision':9s} {'preset':6s} {'backend':14s} {'step ms':>9s} {'first s':>8s} {'tok/s':>8s} "
          f"{'GFLOP/s':>8s} {'peak':>6s} {'MFU':>6s} {'mem MiB':>8s} {'vs torch':>8s}")
    for r in results:
        eager = next((x for x in results if x["preset"] == r["preset"] and x["precision"] == r["precision"]
                      and x["backend"] == "torch" and not x["remat"]), None)
        ratio = f"{r['median_step_s'] / eager['median_step_s']:.2f}" if eager else "-"
        name = r["backend"] + ("+remat" if r["remat"] else "")
        print(f"{r['precision']:9s} {r['preset']:6s} {name:14s} {r['median_step_s'] * 1e3:9.1f} {r['first_step_s']:8.2f} "
              f"{r['tokens_per_s']:8.0f} {r['achieved_gflops']:8.1f} {r['matmul_peak_gflops']:6.0f} {r['mfu']:6.2f} "
              f"{r['peak_memory_mib']:8.0f} {ratio:>8s}")


def measure(bench: Bench) -> list[dict]:
    """Every measurement of `bench` in a worker each, written to `bench.json` after each, drawn to `bench.plot`."""
    machine = {"cpu": _cpu_name(), "cpus": os.cpu_count(), "platform": platform.platform()}
    settings = {f.name: getattr(bench, f.name) for f in dataclasses.fields(bench) if f.name not in ("json", "plot")}
    record, results = {"machine": machine, "batch": [bench.batch_size, bench.length], "options": settings}, []
    fixed = {k: settings[k] for k in ("length", "vocab_size", "steps", "warmup", "dropout", "kernels", "devices")}
    for precision, preset, backend, remat in itertools.product(bench.precisions, bench.presets, bench.backends,
                                                                REMAT_MODES[bench.remat]):
        print(f"{precision} / {preset} / {backend}{' / remat' if remat else ''} ...", file=sys.stderr, flush=True)
        job = {"preset": preset, "backend": backend, "precision": precision, "remat": remat,
               "batch_size": bench.batch_size, **fixed}
        done = _run_workers([sys.executable, "-c", WORKER, json.dumps(job)], bench.devices, backend != "jax")
        if done.returncode:
            raise UserError(f"the {precision} / {preset} / {backend} worker failed:\n{done.stderr[-3000:].strip()}")
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        if bench.json:
            bench.json.update(json_text({**record, "results": results}))
    if bench.json:
        bench.json.write(json_text({**record, "results": results}))
    if bench.plot:
        with bench.plot.writing() as path:
            write_plot(results, path)
    return results


def _run_workers(command: list[str], devices: int, torch: bool) -> subprocess.CompletedProcess:
    """One worker; on several devices JAX's with host devices, torch's a process a device (process 0 reports)."""
    env = dict(os.environ)
    if not torch or devices == 1:
        if devices > 1 and "xla_force_host_platform_device_count" not in env.get("XLA_FLAGS", ""):
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
        return subprocess.run(command, capture_output=True, text=True, env=env)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]), WORLD_SIZE=str(devices),
                   LOCAL_WORLD_SIZE=str(devices))
    workers = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(devices)]
    outputs = [w.communicate() for w in workers]
    failed = next((i for i, w in enumerate(workers) if w.returncode), 0)
    return subprocess.CompletedProcess(command, workers[failed].returncode, outputs[0][0], outputs[failed][1])
