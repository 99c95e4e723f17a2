"""Proof that the two frameworks compute the same function and the same gradients:
`aiayn check` (docs/parity.md).

Builds a random PyTorch reference model, converts it to Flax, runs both on one random batch with
padding (dropout off, float32, `jax_default_matmul_precision="highest"`), and compares logits, the
label-smoothed loss and the gradient of every parameter. Exits non-zero when a bound is exceeded.
"""

from __future__ import annotations

import sys

from train.options import build, command, run
from train.runtime.files import json_text

from ..comparison import Check, check, environment


def build_parser():
    return command("aiayn check", __doc__.split("\n\n")[1], Check)


def main(argv: list[str] | None = None) -> int:
    return run(build_parser(), argv, lambda given: report(build(Check, given)))


def report(options: Check) -> int:
    """Run and print each comparison of `options` (and write its JSON); 1 when a bound is exceeded."""
    results = {}
    for name, r in check(options):
        results[name] = r
        print(f"{options.preset:5s} {name:27s} logits max abs {r['logits']['max_abs']:.2e}  loss rel "
              f"{r['loss']['rel']:.2e}  worst grad rel L2 {r['grads']['max_rel_l2']:.2e} ({r['grads']['worst']})  "
              f"{'FAIL' if r['failures'] else 'ok'}")
        if "smooth_path_grads" in r:
            kink, smooth = r["relu_kink"], r["smooth_path_grads"]
            print(f"      {kink['units']} ReLU inputs within {kink['radius']:g} of the kink (closest "
                  f"{kink['closest']:.1e}); smooth-path (GELU, same weights) worst grad rel L2 "
                  f"{smooth['max_rel_l2']:.2e} ({smooth['worst']})")
        for line in r["failures"]:
            print(f"  bound exceeded: {line}")
    failed = any(r["failures"] for r in results.values())
    if options.json:
        options.json.write(json_text({"preset": options.preset, "passed": not failed, **environment(),
                                      "results": results}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
