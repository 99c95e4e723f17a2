"""`python -m train.curves --run-dir RUN [--out FILE]` (`aiayn curves`): redraw a run's learning curves."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from .plots import IMAGE_FORMATS, plot_curves, run_title
from .options import call
from .runtime import CURVES_FILE, RESULTS_FILE
from .runtime.files import UserError, json_text
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
    return call(parser, lambda: draw(Path(args.run_dir), args.out))


def draw(run_dir: Path, out: str | None = None) -> None:
    """Draw the curves of the finished run in `run_dir` to `out` (RUN/curves.png) and print where, as JSON."""
    try:
        results = json.loads((run_dir / RESULTS_FILE).read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"no finished run in {run_dir} ({err}); TensorBoard shows a run still training") from None
    history = results.get("history") or {}
    output = Destination(out, "--out", [run_dir / RESULTS_FILE], f"--run-dir {run_dir}") if out else None
    out = Path(out or run_dir / CURVES_FILE)
    if out.suffix[1:].lower() not in ("", *IMAGE_FORMATS):  # never PNG bytes under another format's name
        raise UserError(f"--out {out}: {out.suffix} is no image format; end the name in .{', .'.join(IMAGE_FORMATS)}")
    with output.writing() if output else contextlib.nullcontext(out) as path:  # without --out: the run's own
        plot_curves(history, path, run_title(results))
    print(json_text({"curves": str(out), "train_points": len(history.get("train") or []),
                     "valid_points": len(history.get("valid") or [])}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
