"""One training curve in two frameworks: `python -m parity.trajectory`.

Trains one model in the JAX and the PyTorch backends of `train` (the product's own `train_step`)
from one set of initial weights on identical batches of the numbers corpus, float32, dropout off,
and compares the two after every update: the loss (relative difference) and every parameter
(relative L2 distance ||a - b|| / ||b||, the worst named). `--switch K` saves each run's checkpoint
at update K, converts it, and finishes it in the other framework: jax K + torch (N-K) vs torch N,
torch K + jax (N-K) vs jax N. Exits with status 1 when a bound (`BOUNDS`) is exceeded; why the
bounds hold only on the paper's warmup, without the key projections' biases, and on ReLU's smooth
path: docs/parity.md#a-training-curve-in-both-frameworks.
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import torch

from torch_reference.config import TransformerConfig
from train.config import DERIVED_MODEL_FIELDS, flag_type, non_negative_int, positive_float, positive_int, probability
from train.runtime import exit_status
from train.runtime.files import json_text
from train.runtime.output import output_path

from .trajectories import BOUNDS, PAPER_WARMUP, experiment_config, growth, growth_exponent, parity_report, plot


def _print_comparisons(report: dict, prefix: str = "") -> None:
    for c in report["comparisons"]:
        kb = c["k_proj_bias"]
        print(f"  {prefix}{c['label']:34s} max loss rel {c['max_loss_rel']:.2e} (update {c['max_loss_rel_step']}), "
              f"final params worst rel L2 {c['final_param_rel_l2']:.2e} ({c['final_param_worst']})"
              + (f"; k_proj.bias (excluded) rel L2 {kb['max_rel_l2']:.1e}" if kb else ""))


def print_report(report: dict) -> None:
    exp = report["experiment"]
    print(f"parity.trajectory: preset {exp['preset']}, {report['steps']} updates, Adam(0.9, 0.98, 1e-9), Noam "
          f"schedule (warmup {exp['warmup']}, lr up to {max(report['lr']):.3g}), label smoothing "
          f"{exp['label_smoothing']}, clip {exp['clip_norm']}, float32 highest, dropout off; loss "
          f"{report['losses']['torch'][0]:.3f} -> {report['losses']['torch'][-1]:.3f}; {report['seconds']} s")
    _print_comparisons(report)
    first = report["comparisons"][0]
    p = growth_exponent(first)
    print("  growth, jax vs torch (update: loss rel, params rel L2): "
          + "; ".join(f"{s}: {lr:.1e}, {pr:.1e}" for s, lr, pr in growth(first))
          + (f"; params ~ update^{p:.2f} from update 10" if p is not None else ""))
    for name, exact in report["conversion_bit_exact"].items():
        print(f"  checkpoint {name} at update {report['switch']}: {'bit-exact' if exact else 'NOT bit-exact'}")
    if "smooth_path" in report:
        print("  smooth path (same initial weights, exact GELU):")
        _print_comparisons(report["smooth_path"], "  ")
    print("  bounds: loss rel <= {loss_rel:g} every update, final params rel L2 <= {param_rel_l2:g}: ".format(**BOUNDS)
          + ("met" if not report["failures"] else "EXCEEDED"))
    for line in report["failures"]:
        print(f"    {line}")


# --set FIELD=VALUE: the vocabulary sizes, max_len, dropout and embedding sharing come from the data.
_override = flag_type(functools.partial(TransformerConfig.parse_override, exclude=DERIVED_MODEL_FIELDS))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m parity.trajectory", description=__doc__.split("\n\n")[1])
    parser.add_argument("--steps", type=positive_int, default=100, help="updates (default 100)")
    parser.add_argument("--switch", type=non_negative_int, default=None, help="convert both runs' checkpoints at "
                        "this update and continue in the other framework (default: half of --steps; 0: off)")
    parser.add_argument("--preset", default="tiny", choices=TransformerConfig.presets(),
                        help="model size (default tiny)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], type=_override,
                        metavar="FIELD=VALUE", help="override a TransformerConfig field, e.g. --set activation=gelu")
    parser.add_argument("--warmup", type=positive_int, default=PAPER_WARMUP,
                        help=f"schedule warmup (default {PAPER_WARMUP}, the paper's; short warmups reach learning "
                        "rates at which float32 training is chaotic, see --control)")
    parser.add_argument("--lr-factor", type=positive_float, default=1.0, help="factor on the Noam schedule (default 1)")
    parser.add_argument("--label-smoothing", type=probability, default=0.1)
    parser.add_argument("--clip-norm", type=positive_float, default=None, help="global-norm clipping (default: none)")
    parser.add_argument("--numbers-train", type=positive_int, default=4000, help="training pairs of the numbers corpus")
    parser.add_argument("--token-budget", type=positive_int, default=1024, help="padded tokens per batch (default 1024)")
    parser.add_argument("--max-len", type=positive_int, default=128, help="longest sequence in tokens (default 128)")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--control", action="store_true", help="also train torch from the initial weights moved "
                        "by one ulp: float32's own drift (not bounded)")
    parser.add_argument("--json", type=output_path, help="write the full report (every update, every parameter) here")
    parser.add_argument("--plot", type=output_path, help="write a PNG of the differences per update here")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    switch = args.steps // 2 if args.switch is None else args.switch
    if args.steps < 1 or not 0 <= switch < args.steps:
        parser.error("need --steps >= 1 and 0 <= --switch < --steps")
    try:
        cfg = experiment_config(args.steps, args.preset, dict(args.overrides), warmup=args.warmup,
                                lr_factor=args.lr_factor, label_smoothing=args.label_smoothing,
                                clip_norm=args.clip_norm, numbers_train=args.numbers_train,
                                token_budget=args.token_budget, max_len=args.max_len, seed=args.seed)
    except ValueError as err:
        parser.error(str(err))
    report = parity_report(cfg, args.steps, switch, args.control, progress=True)
    report.update(device=jax.devices()[0].device_kind, versions={"jax": jax.__version__, "torch": torch.__version__},
                  command="python -m parity.trajectory " + " ".join(sys.argv[1:] if argv is None else argv))
    print_report(report)
    if args.json:
        args.json.write(json_text(report))
    if args.plot:
        with args.plot.writing() as path:
            plot(report, path)
        print(f"  plot: {args.plot.path}")
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(exit_status(main))
