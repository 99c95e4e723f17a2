"""Translation speed, JAX against PyTorch on the same weights: `python -m parity.translate_bench`
(docs/performance.md#translation-speed).

    python -m parity.translate_bench --run-dir RUN --input ../shared/data/multi30k/val.de.gz [--beam 4] [--json F]

Opens a run (either backend), moves its weights into the other framework (`convert_state`), and
times translating the input with JAX and torch cached search and torch's uncached loop (the
decoder re-run over every prefix; --no-uncached leaves it out), each greedy and with --beam: seconds,
sentences/s, tokens/s, `peak_mib` (the largest growth of resident memory in the timed loop), the
speed-ups against torch cached and uncached, and how many outputs differ from torch cached search's
(0 expected). Torch and CTranslate2 run under glibc's settled allocator thresholds
(`allocator.settled`), float32 matmuls in full float32 (TF32 off) in both frameworks.

--ctranslate2 adds the run exported to CTranslate2 in float32 and int8 (`parity.ctranslate2`,
outputs compared by `ctranslate2.same_output`, int8's BLEU against float32's:
docs/interop.md#speed); --hf adds HF's `generate` on a run imported from Marian
(`parity.marian.to_marian`), each batch limited to our length limit for its padded length.
"""

from __future__ import annotations

if __name__ == "__main__":  # before jax is imported: the CPU as translate splits it, one device per core
    from train.backends.host_devices import split_host

    try:
        split_host()
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None

import argparse
import platform
import sys
from pathlib import Path

from train.api import load
from train.backends import host_devices
from train.config import add_run_arguments, positive_int
from train.data.spm import require
from train.data.streams import read_lines
from train.runtime import exit_status
from train.runtime.files import UserError, json_text
from train.runtime.output import output_path

from .comparison import enable_parity_numerics
from .search_speed import benchmark


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m parity.translate_bench", description="Time translation with a "
                                     "run's weights in JAX and torch cached search and torch's uncached loop, greedy "
                                     "and with --beam: sentences/s, tokens/s, speed-ups and outputs that differ from "
                                     "torch cached search's.")
    add_run_arguments(parser)
    parser.add_argument("--input", type=Path, help="text file, one source sentence per line (plain or .gz); default: stdin")
    parser.add_argument("--batch-size", type=positive_int, help="at most N sentences per batch; default: the run's --token-budget")
    parser.add_argument("--json", type=output_path, help="also write the figures to this JSON file")
    parser.add_argument("--ctranslate2", action="store_true", help="also time the run exported to CTranslate2 in "
                        "float32 and int8 (needs the interop extra: pip install -e \".[interop]\")")
    parser.add_argument("--hf", action="store_true", help="also time HF transformers' generate on the run's weights "
                        "(a run imported from Marian: parity.convert --from marian; needs the interop extra)")
    parser.add_argument("--no-uncached", dest="uncached", action="store_false",
                        help="leave out torch's uncached loop (hours at large shapes); speed-ups against it are then null")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    enable_parity_numerics()
    try:
        sentences = [line for line in read_lines(args.input) if line.strip()]
        if not sentences:
            raise UserError(f"{args.input or 'standard input'} holds no sentence to translate")
        run = load(args.run_dir, args.checkpoint)
    except (UserError, FileNotFoundError, ValueError) as err:
        parser.exit(1, f"error: {err}\n")
    for wanted, package in ((args.ctranslate2, "ctranslate2"), (args.hf, "transformers")):
        if wanted:
            try:
                require(package)
            except ImportError as err:
                parser.exit(1, f"error: {err}\n")
    if args.hf:
        try:
            from .marian import marian_origin

            marian_origin(args.run_dir)
        except ValueError as err:
            parser.exit(1, f"error: --hf: {err}\n")
    rows = benchmark(run, sentences, args.beam, args.batch_size, args.alpha, ctranslate2=args.ctranslate2,
                     scoring=args.scoring, hf=args.hf, uncached=args.uncached)
    run.backend.close()
    machine = f"{platform.processor() or platform.machine()}, {host_devices.cores()} CPUs"
    import jax

    if jax.default_backend() != "cpu":
        machine += f", {jax.devices()[0].device_kind}"
    machine += f", jax on {jax.device_count()} device{'s' * (jax.device_count() > 1)}"
    print(f"{len(sentences)} sentences, {run.model_config.d_model}-wide {run.config.preset} model, {machine}")
    print(f"{'search':19s} {'beam':>4s} {'seconds':>8s} {'sent/s':>8s} {'tok/s':>8s} {'peak MiB':>8s} "
          f"{'vs torch cached':>16s} {'vs uncached':>12s} {'outputs differ':>15s}")
    for r in rows:
        differ = "reference" if r["differ"] is None else str(r["differ"])
        uncached = "-" if r["speedup_vs_torch_uncached"] is None else f"{r['speedup_vs_torch_uncached']:.2f}x"
        print(f"{r['search']:19s} {r['beam']:4d} {r['seconds']:8.2f} {r['sentences_per_s']:8.1f} {r['tokens_per_s']:8.0f} "
              f"{r['peak_mib']:8.0f} {r['speedup_vs_torch_cached']:15.2f}x {uncached:>12s} {differ:>15s}"
              + (f"   BLEU vs float32 {r['bleu_vs_float32']:.2f}" if "bleu_vs_float32" in r else ""))
    if args.json:
        args.json.write(json_text({"run_dir": str(args.run_dir), "machine": machine, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(exit_status(main))
