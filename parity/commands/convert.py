"""Convert Transformer weights between the PyTorch reference (safetensors) and the Flax mirror (orbax
checkpoint directory): the config travels with the weights, every key and shape is checked strictly.
With --run-dir: a whole training run of `train.run` (weights, Adam moments, step and schedule
position, data position, tokenizer, config) to the other backend, so that `python -m train.run
--run-dir DST --resume` continues it there. With the interop extra: HF Marian models in and out, and
CTranslate2 export; with the export extra, ONNX (--to onnx), and StableHLO (--to stablehlo), which
translate and serve as a run does (`parity.conversions.convert`; docs/interop.md#deploying)."""

from __future__ import annotations

import argparse
import sys

from train.checkpoints import CheckpointError
from train.options import build, command, run
from train.runtime.files import UserError, error_text

from ..conversions import Conversion, convert


def build_parser() -> argparse.ArgumentParser:
    return command(
        "aiayn convert", __doc__, Conversion, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  aiayn convert --to jax --src model.safetensors --dst jax_ckpt/\n"
        "  aiayn convert --to torch --src jax_ckpt/ --dst model.safetensors\n"
        "  aiayn convert --to torch --run-dir runs/jax-numbers --dst runs/torch-numbers\n"
        "  python -m train.run --run-dir runs/torch-numbers --resume --steps 1600")


def main(argv: list[str] | None = None) -> int:
    def job(given: dict) -> None:
        try:
            print(convert(build(Conversion, given)))
        except (ImportError, RuntimeError, CheckpointError) as err:  # a missing extra, unreadable weights: one line
            raise UserError(error_text(err)) from None

    return run(build_parser(), argv, job)


if __name__ == "__main__":
    sys.exit(main())
