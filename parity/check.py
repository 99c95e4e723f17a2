"""Proof that the two frameworks compute the same function and the same gradients:
`python -m parity.check` (docs/parity.md).

Builds a random PyTorch reference model, converts it to Flax, runs both on one random batch with
padding (dropout off, float32, `jax_default_matmul_precision="highest"`), and compares logits, the
label-smoothed loss and the gradient of every parameter. Exits non-zero when a bound is exceeded.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import torch

from torch_reference.config import TransformerConfig
from train.options import NON_NEGATIVE, POSITIVE, typed
from train.runtime import exit_status
from train.runtime.files import json_text
from train.runtime.output import output_path

from .comparison import VARIANTS, bounds_for, failures, run_check


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m parity.check", description=__doc__.split("\n\n")[1])
    parser.add_argument("--preset", default="tiny", choices=TransformerConfig.presets(), help="model size (default tiny)")
    parser.add_argument("--vocab-size", type=POSITIVE.parser(), default=8000, help="shared vocabulary size (default 8000)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], type=typed(TransformerConfig.parse_override),
                        metavar="FIELD=VALUE", help="override a TransformerConfig field, e.g. --set norm_position=pre")
    parser.add_argument("--variants", action="store_true",
                        help=f"check every named variant in turn: {', '.join(VARIANTS)}")
    parser.add_argument("--batch-size", type=POSITIVE.parser(), default=8)
    parser.add_argument("--src-len", type=POSITIVE.parser(), default=23, help="padded source length (default 23)")
    parser.add_argument("--tgt-len", type=POSITIVE.parser(), default=17, help="padded target length (default 17)")
    parser.add_argument("--seed", type=NON_NEGATIVE.parser(), default=0)
    parser.add_argument("--json", type=output_path, help="write the full report (every parameter) to this file")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)

    bounds = bounds_for(args.preset)
    runs = VARIANTS if args.variants else {"custom" if args.overrides else "paper": {}}
    results, failed = {}, False
    for name, overrides in runs.items():
        fields = {"src_vocab_size": args.vocab_size, "tgt_vocab_size": args.vocab_size, **overrides, **dict(args.overrides)}
        if not fields.get("share_embeddings", True) and "tgt_vocab_size" not in dict(args.overrides):
            fields["tgt_vocab_size"] = args.vocab_size + 7  # separate vocabularies: make them differ
        try:
            cfg = TransformerConfig.preset(args.preset, **fields)
        except ValueError as err:
            parser.exit(2, f"error: {err}\n")
        start = time.perf_counter()
        report = run_check(cfg, args.batch_size, args.src_len, args.tgt_len, args.seed)
        report.update(config=cfg.to_dict(), bounds=bounds, seconds=round(time.perf_counter() - start, 2))
        report["failures"] = failures(report, bounds)
        results[name] = report
        failed |= bool(report["failures"])
        status = "FAIL" if report["failures"] else "ok"
        print(f"{args.preset:5s} {name:27s} logits max abs {report['logits']['max_abs']:.2e}  "
              f"loss rel {report['loss']['rel']:.2e}  worst grad rel L2 {report['grads']['max_rel_l2']:.2e} "
              f"({report['grads']['worst']})  {status}")
        if "smooth_path_grads" in report:
            kink, smooth = report["relu_kink"], report["smooth_path_grads"]
            print(f"      {kink['units']} ReLU inputs within {kink['radius']:g} of the kink (closest {kink['closest']:.1e}); "
                  f"smooth-path (GELU, same weights) worst grad rel L2 {smooth['max_rel_l2']:.2e} ({smooth['worst']})")
        for line in report["failures"]:
            print(f"  bound exceeded: {line}")
    if args.json:
        payload = {"preset": args.preset, "passed": not failed, "device": jax.devices()[0].device_kind,
                   "versions": {"jax": jax.__version__, "torch": torch.__version__}, "results": results}
        args.json.write(json_text(payload))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(exit_status(main))
