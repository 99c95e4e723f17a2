"""One training curve in two frameworks: `aiayn trajectory`.

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

import sys

from train.config import ExperimentConfig
from train.options import add_flags, build, command, run
from train.runtime.files import json_text

from ..comparison import environment
from ..trajectories import BOUNDS, Trajectory, experiment_config, growth, growth_exponent, parity_report, plot


def _print_comparisons(report: dict, prefix: str = "") -> None:
    for c in report["comparisons"]:
        kb = c["k_proj_bias"]
        print(f"  {prefix}{c['label']:34s} max loss rel {c['max_loss_rel']:.2e} (update {c['max_loss_rel_step']}), "
              f"final params worst rel L2 {c['final_param_rel_l2']:.2e} ({c['final_param_worst']})"
              + (f"; k_proj.bias (excluded) rel L2 {kb['max_rel_l2']:.1e}" if kb else ""))


def print_report(report: dict) -> None:
    exp = report["experiment"]
    print(f"aiayn trajectory: preset {exp['preset']}, {report['steps']} updates, Adam(0.9, 0.98, 1e-9), Noam "
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


# The training settings a trajectory takes, as train.run's flags (`trajectories.experiment_config` has its defaults).
SETTINGS = ("preset", "model", "warmup", "lr_factor", "label_smoothing", "clip_norm", "numbers_train", "token_budget",
            "max_len", "seed")


def build_parser():
    parser = command("aiayn trajectory", __doc__.split("\n\n")[1], Trajectory, epilog="defaults: --preset tiny, "
                     "--warmup 4000 (the paper's; a short warmup reaches learning rates at which float32 training is "
                     "chaotic, see --control), --numbers-train 4000, --token-budget 1024, otherwise train.run's")
    add_flags(parser, ExperimentConfig, only=SETTINGS, show_defaults=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run(build_parser(), argv, lambda given: report(build(Trajectory, given), given, argv))


def report(t: Trajectory, given: dict, argv: list[str] | None) -> int:
    """Train, compare and print `t` with the training settings `given` (and write its JSON and plot)."""
    settings = {k: v for k, v in given.items() if k in SETTINGS}
    cfg = experiment_config(t.steps, **settings)
    result = parity_report(cfg, t.steps, t.switch, t.control, progress=True)
    result.update(environment(), command="aiayn trajectory " + " ".join(sys.argv[1:] if argv is None else argv))
    print_report(result)
    if t.json:
        t.json.write(json_text(result))
    if t.plot:
        with t.plot.writing() as path:
            plot(result, path)
        print(f"  plot: {t.plot.path}")
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
