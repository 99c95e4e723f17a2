"""`python -m train.curves --run-dir RUN [--out FILE]` (`aiayn curves`): redraw a run's learning curves."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from .plots import IMAGE_FORMATS, plot_curves, run_title
from .runtime import CURVES_FILE, RESULTS_FILE, exit_status
from .runtime.files import UserError, error_text, json_text
from .runtime.output import Destination


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m train.curves", description="Draw a run's learning curves "
                                     "(training and validation loss, validation BLEU, against steps "
                                     "and training time) to an image from its results.json.")
    parser.add_argument("--run-dir", required=True, metavar="DIR", help="run directory written by train.run")
    parser.add_argument("--out", metavar="FILE", help="output file, replaced if it exists, in the format its suffix "
                        f"names: {', '.join(IMAGE_FORMATS)}; PNG without one (default: RUN/{CURVES_FILE})")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    try:
        results = json.loads((run_dir / RESULTS_FILE).read_text())
    except (OSError, ValueError) as err:
        parser.exit(1, f"error: no finished run in {run_dir} ({err}); TensorBoard shows a run still training\n")
    history = results.get("history") or {}
    out = Path(args.out or run_dir / CURVES_FILE)
    try:
        output = Destination(out, "--out", [run_dir / RESULTS_FILE], f"--run-dir {run_dir}") if args.out else None
        if out.suffix[1:].lower() not in ("", *IMAGE_FORMATS):  # never PNG bytes under another format's name
            raise UserError(f"--out {out}: {out.suffix} is no image format; end the name in "
                            f".{', .'.join(IMAGE_FORMATS)}")
        with output.writing() if output else contextlib.nullcontext(out) as path:  # without --out: the run's own
            plot_curves(history, path, run_title(results))
        print(json_text({"curves": str(out), "train_points": len(history.get("train") or []),
                         "valid_points": len(history.get("valid") or [])}), flush=True)
    except (UserError, OSError) as err:  # OSError: a full disk, a closed pipe (| head)
        parser.exit(1, f"error: {error_text(err)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(exit_status(main))
