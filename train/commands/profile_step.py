"""Where a training step's time goes: each part of the model, forward + backward, JAX vs PyTorch.

    aiayn profile --preset base [--batch 32 --length 32 --vocab 8000] [--json PATH]
    aiayn profile --preset small --xla-cpu-ab [--repeats 10 --sentences 64]

`aiayn bench` times whole steps; this times their parts on the same shapes (sublayers, layers, the
output projection with the loss, the Adam update), each as `grad(sum(part(x)))` (jit-compiled on the
JAX side, the model built as the training backend builds it), the median of --repeats runs after a
warm-up. `--xla-cpu-ab` instead times the JAX train step and a beam-4 search with and without the
XLA:CPU-tuned pieces (`jax_transformer/xla_cpu.py`), alternately.
"""

from __future__ import annotations

import os
import statistics
import sys

from torch_reference.config import TransformerConfig

from ..benchmark import _cpu_name
from ..options import build, command, run
from ..profiling import Profile, jax_parts, torch_parts, xla_cpu_ab, xla_op_split
from ..runtime.files import json_text


def build_parser():
    return command("aiayn profile", __doc__.split("\n\n")[0], Profile)


def main(argv: list[str] | None = None) -> int:
    return run(build_parser(), argv, lambda given: profile(build(Profile, given)))


def profile(p: Profile) -> None:
    """Time what `p` asks for and print it (and write its JSON)."""
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    cfg = TransformerConfig.preset(p.preset, src_vocab_size=p.vocab, tgt_vocab_size=p.vocab, max_len=max(p.length, 64),
                                   dropout=0.0)
    shape, usable = f"batch {p.batch}x{p.length}", f"{len(os.sched_getaffinity(0))} usable"
    if p.xla_ops:
        print(f"{p.preset}: JAX forward + backward, {shape}, {os.cpu_count()} CPUs visible, {usable}")
        for key, ms in xla_op_split(cfg, p.batch, p.length).items():
            print(f"{key:18s} {ms:9.1f} ms")
        return
    if p.xla_cpu_ab:
        ab = xla_cpu_ab(cfg, p.batch, p.length, p.repeats, p.sentences)
        print(f"{p.preset}: {shape}, search over {p.sentences} sentences, {_cpu_name()}, {usable} CPUs, JAX on "
              f"{jax.devices()[0].platform}; plain / tuned, seconds")
        for part in ("train step", "beam-4 search"):
            (plain, tuned), pairs = map(statistics.median, ab[part].values()), list(zip(*ab[part].values()))
            ratios = sorted(a / b for a, b in pairs)
            print(f"{part}: median {plain:.3f} / {tuned:.3f}; plain/tuned per repetition {ratios[0]:.2f}-"
                  f"{ratios[-1]:.2f}, median {statistics.median(ratios):.2f}; each: "
                  + " ".join(f"{a:.3f}/{b:.3f}" for a, b in pairs))
        memory = ab["temporaries MiB"]
        print(f"compiled train step's temporaries: plain {memory['plain']:.1f} MiB, tuned {memory['tuned']:.1f} MiB")
        report = {"preset": p.preset, "batch": [p.batch, p.length], **ab}
    else:
        torch_times = torch_parts(cfg, p.batch, p.length, p.repeats)
        jax_times = jax_parts(cfg, p.batch, p.length, p.repeats)
        print(f"{p.preset}: {shape}, vocab {p.vocab}, float32, dropout 0; median of {p.repeats} (ms)\n"
              f"{'part (forward + backward)':28s} {'JAX':>9s} {'torch':>9s} {'JAX/torch':>10s}")
        rows = [{"part": name, "jax_ms": jax_times[name] * 1e3, "torch_ms": t * 1e3, "ratio": jax_times[name] / t}
                for name, t in torch_times.items()]
        for r in rows:
            print(f"{r['part']:28s} {r['jax_ms']:9.2f} {r['torch_ms']:9.2f} {r['ratio']:10.2f}")
        report = {"preset": p.preset, "batch": [p.batch, p.length], "vocab": p.vocab, "rows": rows}
    if p.json:
        p.json.write(json_text(report))


if __name__ == "__main__":
    sys.exit(main())
