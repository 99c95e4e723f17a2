"""Step-time benchmark (`python -m train.bench`): JAX vs PyTorch eager vs torch.compile on the same
model and batches.

For each precision, preset and backend a fresh worker process (so that one backend's memory and
threads never touch another's) builds the model from seed 0, trains on the same fixed batches and
reports the median step time after warm-up (the first, compiling step apart), tokens/s, the model
FLOPs of a step, MFU against the matmul peak measured in that process at that precision, and the
peak memory of training (device memory on GPUs; on CPUs the rise of the process's peak resident
memory). The precisions are `build_parser`'s epilog's (docs/performance.md).
"""

from __future__ import annotations

import os
import platform
import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from torch_reference.config import TransformerConfig


BACKENDS = ("jax", "torch", "torch-compile")
PRECISIONS = ("float32", "tf32", "bfloat16")
REMAT_MODES = {"off": (False,), "on": (True,), "both": (False, True)}  # train.bench --remat
_JAX_MATMUL_PRECISION = {"float32": "highest", "tf32": "tensorfloat32", "bfloat16": "default"}


def step_flops(cfg: TransformerConfig, batch_size: int, src_len: int, tgt_len: int) -> int:
    """Model FLOPs of one training step: 3 x the forward pass (the backward costs two forwards).

    Forward, counting 2 FLOPs per multiply-add of every matmul (embedding lookups are free):
      encoder layer, per source token: q,k,v,out projections 8D² + feed-forward 4DF (6DF for
        SwiGLU) + scores and weighted values 4SD;
      decoder layer, per target token: self-attention 8D² + 4TD, cross-attention q,out 4D² +
        4SD (+ k,v projections 4D² per source token), feed-forward as above;
      output projection 2DV per target token.
    """
    D, F, V = cfg.d_model, cfg.d_ff, cfg.tgt_vocab_size
    ff = (6 if cfg.activation == "swiglu" else 4) * D * F
    encoder = cfg.num_encoder_layers * src_len * (8 * D * D + ff + 4 * src_len * D)
    decoder = cfg.num_decoder_layers * (tgt_len * (8 * D * D + 4 * tgt_len * D + 4 * D * D + 4 * src_len * D + ff)
                                        + src_len * 4 * D * D)
    return 3 * batch_size * (encoder + decoder + tgt_len * 2 * D * V)


def fixed_batches(cfg: TransformerConfig, batch_size: int, length: int, count: int, seed: int = 0):
    """`count` dense batches (no padding) of random ids: every backend trains on these."""
    from .data import Batch

    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(count):
        src = rng.integers(4, cfg.src_vocab_size, size=(batch_size, length), dtype=np.int32)
        tgt = rng.integers(4, cfg.tgt_vocab_size, size=(batch_size, length), dtype=np.int32)
        tgt[:, -1] = cfg.eos_id
        tgt_in = np.concatenate([np.full((batch_size, 1), cfg.bos_id, np.int32), tgt[:, :-1]], axis=1)
        batches.append(Batch(src, tgt_in, tgt, np.arange(batch_size), src.size, tgt.size))
    return batches


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mib() -> float:
    """The process's peak resident memory since it started, or since `_reset_peak_rss`."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024  # KiB
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _reset_peak_rss() -> bool:
    """Restart the peak (VmHWM) from the current resident memory (Linux >= 4.0); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def set_precision(framework: str, precision: str) -> None:
    """Matmul precision of this process for `precision` (one of PRECISIONS: see `build_parser`'s epilog)."""
    if framework == "jax":
        import jax

        jax.config.update("jax_default_matmul_precision", _JAX_MATMUL_PRECISION[precision])
    else:
        import torch

        torch.set_float32_matmul_precision("high" if precision == "tf32" else "highest")
        torch.backends.cudnn.allow_tf32 = precision == "tf32"


def timings(fn: Callable[[], object], repeats: int, warmup: int = 0) -> list[float]:
    """Seconds of each of `repeats` calls of `fn`, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def matmul_peak_gflops(framework: str, precision: str = "float32", n: int | None = None, repeats: int = 10) -> float:
    """The best throughput of an n x n matmul in this process at `precision`, GFLOP/s
    (n 2048 on a CPU, 8192 on a GPU, where smaller products leave the tensor cores idle)."""
    dtype_name = "bfloat16" if precision == "bfloat16" else "float32"
    if framework == "jax":
        import jax
        import jax.numpy as jnp

        n = n or (2048 if jax.devices()[0].platform == "cpu" else 8192)
        a = jax.random.normal(jax.random.key(0), (n, n), getattr(jnp, dtype_name))
        mm = jax.jit(lambda x, y: x @ y)
        run = lambda: mm(a, a).block_until_ready()
    else:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        n = n or (8192 if device == "cuda" else 2048)
        a = torch.randn(n, n, device=device, dtype=getattr(torch, dtype_name))
        run = lambda: (a @ a)[0, 0].item()
    return 2 * n**3 / min(timings(run, repeats, warmup=1)) / 1e9


def run_worker(args) -> dict:
    """Train `args.steps` steps of one backend on the fixed batches and measure them."""
    from .backends import create_backend, initialize
    from .config import ExperimentConfig

    framework = "jax" if args.backend == "jax" else "torch"
    set_precision(framework, args.precision)
    dropout = TransformerConfig.preset(args.preset).dropout if args.dropout is None else args.dropout
    cfg = TransformerConfig.preset(args.preset, src_vocab_size=args.vocab_size, tgt_vocab_size=args.vocab_size,
                                   max_len=max(args.length, 64), dropout=dropout)
    exp = ExperimentConfig(backend=framework, preset=args.preset, compile=args.backend == "torch-compile",
                           steps=10**6, warmup=4000, progress=False, dropout=cfg.dropout,
                           dtype="bfloat16" if args.precision == "bfloat16" else "float32",
                           kernels=args.kernels, remat=args.remat_on, devices=getattr(args, "devices", 1))
    peak = matmul_peak_gflops(framework, args.precision)
    batches = fixed_batches(cfg, args.batch_size, args.length, 4)
    # Memory counts from here: the model, its optimizer state (JAX makes it at creation, torch in
    # the first step), gradients, activations and the runtime's buffers.
    initialize(exp)  # the process's settings (allocator, threads), as train.run applies them
    rss_base = _rss_mib()
    backend = create_backend(exp, cfg, None)

    times = []
    for i in range(args.warmup + args.steps):
        if i == args.warmup:  # compilation's transient memory is reported apart from training's
            warmup_peak = _peak_rss_mib() - rss_base
            steady = _reset_peak_rss()
        start = time.perf_counter()
        metrics = backend.train_step([batches[i % len(batches)]])
        backend.fetch([metrics])  # wait for the step, as a training loop reading its loss would
        times.append(time.perf_counter() - start)
    loss = backend.fetch([metrics])[0]["loss"]

    median = statistics.median(times[args.warmup:])
    flops = step_flops(cfg, args.batch_size, args.length, args.length)
    tokens = 2 * args.batch_size * args.length
    result = {"preset": args.preset, "backend": args.backend, "devices": exp.devices, "precision": args.precision,
              "dropout": cfg.dropout,
              "kernels": backend.kernels, "remat": args.remat_on, "batch": [args.batch_size, args.length],
              "tokens_per_step": tokens, "first_step_s": times[0], "median_step_s": median,
              "step_times_s": times[args.warmup:], "tokens_per_s": tokens / median, "step_flops": flops,
              "achieved_gflops": flops / median / 1e9, "matmul_peak_gflops": peak, "mfu": flops / median / 1e9 / peak,
              "final_loss": loss, "num_params": backend.num_params}
    if framework == "jax":
        import jax

        stats = jax.devices()[0].memory_stats() or {}
        result["device"] = jax.devices()[0].device_kind
        result["versions"] = {"jax": jax.__version__}
        if "peak_bytes_in_use" in stats:
            result["peak_memory_mib"] = stats["peak_bytes_in_use"] / 2**20
    else:
        import torch

        result["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
        result["versions"] = {"torch": torch.__version__}
        if torch.cuda.is_available():
            result["peak_memory_mib"] = torch.cuda.max_memory_allocated() / 2**20
    if "peak_memory_mib" not in result:  # CPU: resident memory above the process before the model existed
        result["peak_memory_mib"] = _peak_rss_mib() - rss_base
        result["warmup_peak_memory_mib"] = warmup_peak
        result["memory_kind"] = "peak RSS over training steps" if steady else "peak RSS since start (incl. compilation)"
    else:
        result["memory_kind"] = "device peak"
    return result


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def write_plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((r["precision"], r["preset"]) for r in results))
    backends = list(dict.fromkeys(r["backend"] for r in results))
    fig, ax = plt.subplots(figsize=(2.2 + 1.8 * len(groups), 3.6))
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
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_results(results: list[dict], batch_size: int, length: int, dropout: float, devices: int = 1) -> None:
    """`python -m train.bench`'s table: one row per measurement, its step time against torch eager's."""
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
