"""Where a training step's time goes: each part of the model, forward + backward, JAX vs PyTorch.

    python -m train.profile_step --preset base [--batch 32 --length 32 --vocab 8000] [--json PATH]
    python -m train.profile_step --preset small --xla-cpu-ab [--repeats 10 --sentences 64]

`train.bench` times whole steps; this times their parts on the same shapes (sublayers, layers, the
output projection with the loss, the Adam update), each as `grad(sum(part(x)))` (jit-compiled on the
JAX side, the model built as the training backend builds it), the median of --repeats runs after a
warm-up. `--xla-cpu-ab` instead times the JAX train step and a beam-4 search with and without the
XLA:CPU-tuned pieces (`jax_transformer/xla_cpu.py`), alternately.
"""

from __future__ import annotations

import argparse
import os
import statistics

from torch_reference.config import TransformerConfig

from .benchmark import _cpu_name
from .options import POSITIVE
from .profiling import jax_parts, torch_parts, xla_cpu_ab, xla_op_split
from .runtime import exit_status
from .runtime.files import json_text
from .runtime.output import output_path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m train.profile_step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="base", choices=TransformerConfig.presets())
    parser.add_argument("--batch", type=POSITIVE.parser(), default=32, help="sentences per batch (default 32)")
    parser.add_argument("--length", type=POSITIVE.parser(), default=32, help="tokens per sentence, source and target (default 32)")
    parser.add_argument("--vocab", type=POSITIVE.parser(), default=8000, help="shared vocabulary size (default 8000)")
    parser.add_argument("--repeats", type=POSITIVE.parser(), default=10, help="timed runs per part (default 10)")
    parser.add_argument("--json", type=output_path, help="also write the figures to this JSON file")
    parser.add_argument("--xla-ops", action="store_true",
                        help="instead: split JAX's forward + backward time into matmuls and other operations")
    parser.add_argument("--xla-cpu-ab", action="store_true",
                        help="instead: time JAX's train step and a beam-4 search with and without xla_cpu's pieces")
    parser.add_argument("--sentences", type=POSITIVE.parser(), default=64, help="sources of the --xla-cpu-ab search")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)

    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    cfg = TransformerConfig.preset(args.preset, src_vocab_size=args.vocab, tgt_vocab_size=args.vocab,
                                   max_len=max(args.length, 64), dropout=0.0)
    if args.xla_ops:
        split = xla_op_split(cfg, args.batch, args.length)
        print(f"{args.preset}: JAX forward + backward, batch {args.batch}x{args.length}, {os.cpu_count()} CPUs visible, "
              f"{len(os.sched_getaffinity(0))} usable")
        for key, ms in split.items():
            print(f"{key:18s} {ms:9.1f} ms")
        return 0
    if args.xla_cpu_ab:
        ab = xla_cpu_ab(cfg, args.batch, args.length, args.repeats, args.sentences)
        print(f"{args.preset}: batch {args.batch}x{args.length}, search over {args.sentences} sentences, "
              f"{_cpu_name()}, {len(os.sched_getaffinity(0))} usable CPUs, JAX on {jax.devices()[0].platform}; "
              "plain / tuned, seconds")
        for part in ("train step", "beam-4 search"):
            (plain, tuned), pairs = map(statistics.median, ab[part].values()), list(zip(*ab[part].values()))
            ratios = sorted(p / t for p, t in pairs)
            print(f"{part}: median {plain:.3f} / {tuned:.3f}; plain/tuned per repetition {ratios[0]:.2f}-"
                  f"{ratios[-1]:.2f}, median {statistics.median(ratios):.2f}; each: "
                  + " ".join(f"{p:.3f}/{t:.3f}" for p, t in pairs))
        memory = ab["temporaries MiB"]
        print(f"compiled train step's temporaries: plain {memory['plain']:.1f} MiB, tuned {memory['tuned']:.1f} MiB")
        if args.json:
            args.json.write(json_text({"preset": args.preset, "batch": [args.batch, args.length], **ab}))
        return 0
    torch_times = torch_parts(cfg, args.batch, args.length, args.repeats)
    jax_times = jax_parts(cfg, args.batch, args.length, args.repeats)
    print(f"{args.preset}: batch {args.batch}x{args.length}, vocab {args.vocab}, float32, dropout 0; "
          f"median of {args.repeats} (ms)")
    print(f"{'part (forward + backward)':28s} {'JAX':>9s} {'torch':>9s} {'JAX/torch':>10s}")
    rows = []
    for name in torch_times:
        j, t = jax_times[name] * 1e3, torch_times[name] * 1e3
        rows.append({"part": name, "jax_ms": j, "torch_ms": t, "ratio": j / t})
        print(f"{name:28s} {j:9.2f} {t:9.2f} {j / t:10.2f}")
    if args.json:
        args.json.write(json_text({"preset": args.preset, "batch": [args.batch, args.length],
                                    "vocab": args.vocab, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(exit_status(main))
