"""Step-time benchmark: JAX vs PyTorch eager vs torch.compile on the same model and batches.

    python -m train.bench --presets tiny,small,base --backends jax,torch,torch-compile --json bench.json --plot bench.png

For each precision, preset and backend a fresh worker process (so that one backend's memory and
threads never touch another's) builds the model from seed 0, trains on the same fixed batches and
reports the median step time after warm-up (the first, compiling step apart), tokens/s, the model
FLOPs of a step, MFU against the matmul peak measured in that process at that precision, and the
peak memory of training (device memory on GPUs; on CPUs the rise of the process's peak resident
memory). The precisions are `build_parser`'s epilog's (docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from torch_reference.config import TransformerConfig

from .backends import allocator
from .config import non_negative_int, positive_int, probability
from .runtime.files import UserError, check_output_file, json_text, write_text_atomic

BACKENDS = ("jax", "torch", "torch-compile")
PRECISIONS = ("float32", "tf32", "bfloat16")
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
    decoder = cfg.num_decoder_layers * (
        tgt_len * (8 * D * D + 4 * tgt_len * D + 4 * D * D + 4 * src_len * D + ff) + src_len * 4 * D * D
    )
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
    cfg = TransformerConfig.preset(
        args.preset, src_vocab_size=args.vocab_size, tgt_vocab_size=args.vocab_size, max_len=max(args.length, 64),
        dropout=args.dropout if args.dropout is not None else TransformerConfig.preset(args.preset).dropout,
    )
    exp = ExperimentConfig(backend=framework, preset=args.preset, compile=args.backend == "torch-compile",
                           steps=10**6, warmup=4000, progress=False, dropout=cfg.dropout,
                           dtype="bfloat16" if args.precision == "bfloat16" else "float32")
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
    result = {
        "preset": args.preset, "backend": args.backend, "precision": args.precision, "dropout": cfg.dropout,
        "batch": [args.batch_size, args.length], "tokens_per_step": tokens,
        "first_step_s": times[0], "median_step_s": median, "step_times_s": times[args.warmup:],
        "tokens_per_s": tokens / median, "step_flops": flops, "achieved_gflops": flops / median / 1e9,
        "matmul_peak_gflops": peak, "mfu": flops / median / 1e9 / peak, "final_loss": loss,
        "num_params": backend.num_params,
    }
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m train.bench",
        description="Median train-step time of the same model and batches on JAX, PyTorch eager and torch.compile, "
        "with tokens/s, model FLOPs, MFU against the matmul peak measured in the same process at the same precision, "
        "and peak memory.",
        epilog="precisions: float32 = full float32 matmuls (TF32 off); tf32 = float32 with TF32 tensor-core matmuls "
        "(JAX's default on Ampere and newer GPUs; float32 on a CPU); bfloat16 = mixed precision, as train.run --dtype "
        "bfloat16. Example on a GPU: python -m train.bench --presets base,big --precisions float32,tf32,bfloat16 "
        "--batch-tokens 16384 --length 64",
    )
    parser.add_argument("--presets", default="tiny,small,base", help="comma-separated model presets (default tiny,small,base)")
    parser.add_argument("--backends", default="jax,torch,torch-compile", help=f"comma-separated, from {', '.join(BACKENDS)}")
    parser.add_argument("--batch-tokens", type=positive_int, default=1024,
                        help="tokens per side per batch: B = batch-tokens / length sentences (default 1024)")
    parser.add_argument("--length", type=positive_int, default=32, help="source and target length of every sentence (default 32)")
    parser.add_argument("--vocab-size", type=positive_int, default=8000, help="shared vocabulary size (default 8000)")
    parser.add_argument("--steps", type=positive_int, default=10, help="timed steps after warm-up (default 10)")
    parser.add_argument("--warmup", type=non_negative_int, default=3, help="untimed steps first, compilation included (default 3)")
    parser.add_argument("--dropout", type=probability, default=0.0, help="dropout rate (default 0: off; the paper's 0.1 with --dropout 0.1)")
    parser.add_argument("--precisions", default="float32",
                        help=f"comma-separated, from {', '.join(PRECISIONS)} (default float32; see below)")
    parser.add_argument("--json", type=Path, help="write all figures to this JSON file")
    parser.add_argument("--plot", type=Path, help="write a bar chart of step times to this PNG")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--preset", help=argparse.SUPPRESS)
    parser.add_argument("--backend", help=argparse.SUPPRESS)
    parser.add_argument("--batch-size", type=positive_int, help=argparse.SUPPRESS)
    parser.add_argument("--precision", default="float32", choices=PRECISIONS, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)

    if args.worker:
        print(json.dumps(run_worker(args)))
        return 0

    presets = [p for p in args.presets.split(",") if p]
    backends = [b for b in args.backends.split(",") if b]
    precisions = [p for p in args.precisions.split(",") if p]
    for flag, names, known in (("--presets", presets, TransformerConfig.presets()), ("--backends", backends, BACKENDS),
                               ("--precisions", precisions, PRECISIONS)):
        if not names:
            parser.error(f"{flag} names nothing to measure")
        for name in names:
            if name not in known:
                parser.error(f"unknown {flag[2:-1]} {name!r}; choose from {', '.join(known)}")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None:
            try:  # before any worker runs, not after minutes of them
                check_output_file(path, flag)
            except UserError as err:
                parser.error(str(err))
    batch_size = max(1, args.batch_tokens // args.length)
    machine = {"cpu": _cpu_name(), "cpus": os.cpu_count(), "platform": platform.platform()}
    record = {"machine": machine, "batch": [batch_size, args.length],
              "args": {k: str(v) for k, v in vars(args).items()}}

    results = []
    for precision in precisions:
        for preset in presets:
            for backend in backends:
                command = [sys.executable, "-m", "train.bench", "--worker", "--preset", preset, "--backend", backend,
                           "--batch-size", str(batch_size), "--length", str(args.length),
                           "--vocab-size", str(args.vocab_size), "--steps", str(args.steps), "--warmup", str(args.warmup),
                           "--dropout", str(args.dropout), "--precision", precision]
                print(f"{precision} / {preset} / {backend} ...", file=sys.stderr, flush=True)
                done = subprocess.run(command, capture_output=True, text=True)
                if done.returncode:
                    sys.stderr.write(done.stderr[-3000:])
                    return 1
                results.append(json.loads(done.stdout.strip().splitlines()[-1]))
                if args.json:  # after every worker, so an interrupted invocation keeps what it measured
                    write_text_atomic(args.json, json_text({**record, "results": results}))

    print(f"\nmachine: {_cpu_name()}, {os.cpu_count()} CPUs; device {results[0]['device']}; batch {batch_size} x "
          f"{args.length} tokens per side; dropout {args.dropout}")
    header = f"{'precision':9s} {'preset':6s} {'backend':14s} {'step ms':>9s} {'first s':>8s} {'tok/s':>8s} {'GFLOP/s':>8s} {'peak':>6s} {'MFU':>6s} {'mem MiB':>8s} {'vs torch':>8s}"
    print(header)
    for r in results:
        eager = next((x for x in results if x["preset"] == r["preset"] and x["precision"] == r["precision"]
                      and x["backend"] == "torch"), None)
        ratio = f"{r['median_step_s'] / eager['median_step_s']:.2f}" if eager else "-"
        print(f"{r['precision']:9s} {r['preset']:6s} {r['backend']:14s} {r['median_step_s'] * 1e3:9.1f} {r['first_step_s']:8.2f} "
              f"{r['tokens_per_s']:8.0f} {r['achieved_gflops']:8.1f} {r['matmul_peak_gflops']:6.0f} {r['mfu']:6.2f} "
              f"{r['peak_memory_mib']:8.0f} {ratio:>8s}")
    if args.plot:
        try:
            write_plot(results, args.plot)
        except ImportError:
            print("matplotlib is not installed: pip install matplotlib for --plot", file=sys.stderr)
    return 0


if __name__ == "__main__":
    allocator.use_huge_pages()  # re-executes once; see train/backends/allocator.py
    sys.exit(main())
