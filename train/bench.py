"""`python -m train.bench` (`aiayn bench`): train-step time of both frameworks on the same model and batches.

    python -m train.bench --presets tiny,small,base --backends jax,torch,torch-compile --json bench.json --plot bench.png

Flags and printing; each measurement runs in a worker process of its own (`train.benchmark`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import socket
import subprocess
import sys

from torch_reference.config import TransformerConfig

from .backends import allocator
from .benchmark import BACKENDS, PRECISIONS, REMAT_MODES, _cpu_name, print_results, run_worker, write_plot
from .config import KERNEL_CHOICES
from .options import NON_NEGATIVE, POSITIVE, PROBABILITY
from .runtime import exit_status
from .runtime.files import json_text
from .runtime.output import output_path


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
    parser.add_argument("--batch-tokens", type=POSITIVE.parser(), default=1024,
                        help="tokens per side per batch: B = batch-tokens / length sentences (default 1024)")
    parser.add_argument("--length", type=POSITIVE.parser(), default=32, help="source and target length of every sentence (default 32)")
    parser.add_argument("--vocab-size", type=POSITIVE.parser(), default=8000, help="shared vocabulary size (default 8000)")
    parser.add_argument("--steps", type=POSITIVE.parser(), default=10, help="timed steps after warm-up (default 10)")
    parser.add_argument("--warmup", type=NON_NEGATIVE.parser(), default=3, help="untimed steps first, compilation included (default 3)")
    parser.add_argument("--dropout", type=PROBABILITY.parser(), default=0.0, help="dropout rate (default 0: off; the paper's 0.1 with --dropout 0.1)")
    parser.add_argument("--precisions", default="float32",
                        help=f"comma-separated, from {', '.join(PRECISIONS)} (default float32; see below)")
    parser.add_argument("--remat", choices=("off", "on", "both"), default="off",
                        help="train.run --remat: recompute each layer's activations in the backward pass; both: each "
                        "backend without then with it, side by side (default off)")
    parser.add_argument("--kernels", choices=KERNEL_CHOICES, default="auto",
                        help="train.run --kernels: the models' kernel set (default auto)")
    parser.add_argument("--devices", type=POSITIVE.parser(), default=1,
                        help="data parallel over N devices, the same global batch split over them: JAX's mesh (on a "
                        "CPU, N host devices), torch DistributedDataParallel in N processes (default 1)")
    parser.add_argument("--json", type=output_path, help="write all figures to this JSON file")
    parser.add_argument("--plot", type=output_path, help="write a bar chart of step times to this PNG")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--preset", help=argparse.SUPPRESS)
    parser.add_argument("--backend", help=argparse.SUPPRESS)
    parser.add_argument("--batch-size", type=POSITIVE.parser(), help=argparse.SUPPRESS)
    parser.add_argument("--precision", default="float32", choices=PRECISIONS, help=argparse.SUPPRESS)
    parser.add_argument("--remat-on", action="store_true", help=argparse.SUPPRESS)
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
    batch_size = max(1, args.batch_tokens // args.length)
    if batch_size % args.devices:
        parser.error(f"--devices {args.devices} does not divide the batch of {batch_size} sentences "
                     "(--batch-tokens / --length)")
    machine = {"cpu": _cpu_name(), "cpus": os.cpu_count(), "platform": platform.platform()}
    record = {"machine": machine, "batch": [batch_size, args.length],
              "args": {k: str(v) for k, v in vars(args).items()}}

    results = []
    for precision in precisions:
        for preset in presets:
            for backend, remat in itertools.product(backends, REMAT_MODES[args.remat]):
                command = [sys.executable, "-m", "train.bench", "--worker", "--preset", preset, "--backend", backend,
                           "--batch-size", str(batch_size), "--length", str(args.length),
                           "--vocab-size", str(args.vocab_size), "--steps", str(args.steps), "--warmup", str(args.warmup),
                           "--dropout", str(args.dropout), "--precision", precision, "--kernels", args.kernels,
                           "--devices", str(args.devices), *(["--remat-on"] if remat else [])]
                print(f"{precision} / {preset} / {backend}{' / remat' if remat else ''} ...", file=sys.stderr, flush=True)
                done = _run_workers(command, args.devices, backend != "jax")
                if done.returncode:
                    sys.stderr.write(done.stderr[-3000:])
                    return 1
                results.append(json.loads(done.stdout.strip().splitlines()[-1]))
                if args.json:  # after every worker, so an interrupted invocation keeps what it measured
                    args.json.update(json_text({**record, "results": results}))
    if args.json:
        args.json.write(json_text({**record, "results": results}))

    print_results(results, batch_size, args.length, args.dropout, args.devices)
    if args.plot:
        try:
            with args.plot.writing() as path:
                write_plot(results, path)
        except ImportError:
            print("matplotlib is not installed: pip install matplotlib for --plot", file=sys.stderr)
    return 0


def _run_workers(command: list[str], devices: int, torch: bool) -> subprocess.CompletedProcess:
    """One worker; on several devices JAX's with as many host devices (on a CPU), torch's as one process a
    device in torchrun's environment (process 0 prints the figures)."""
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


if __name__ == "__main__":
    allocator.use_huge_pages()  # re-executes once; see train/backends/allocator.py
    sys.exit(exit_status(main))
