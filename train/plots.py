"""A run's learning curves (RUN/curves.png; `aiayn curves`): loss and BLEU by steps and time."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .options import checked, option
from .runtime.files import OptionError, UserError, write_bytes_atomic
from .runtime.layout import CURVES_FILE, RESULTS_FILE

# What a file name's suffix may ask for (png, svg, pdf, jpg, ...); pgf needs a LaTeX installation.
IMAGE_FORMATS = sorted(set(FigureCanvasAgg.get_supported_filetypes()) - {"pgf"})


@checked
class Curves:
    """Which run's curves `draw` redraws, and where."""

    run_dir: Path = option(None, "run directory written by train.run", required=True, metavar="DIR")
    out: str | Path | None = option(None, "output file, replaced if it exists, in the format its suffix names: "
                              f"{', '.join(IMAGE_FORMATS)}; PNG without one (default: RUN/{CURVES_FILE})",
                              metavar="FILE")


def draw(curves: Curves) -> dict[str, Any]:
    """Draw the finished run's curves to `curves.out` (RUN/curves.png); where, and the points drawn."""
    from .runtime.destination import Destination

    run_dir, out = Path(curves.run_dir), curves.out
    try:
        results = json.loads((run_dir / RESULTS_FILE).read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"no finished run in {run_dir} ({err}); TensorBoard shows a run still training") from None
    history = results.get("history") or {}
    output = Destination(out, "out", [run_dir / RESULTS_FILE], f"the run {run_dir}") if out else None
    out = Path(out or run_dir / CURVES_FILE)
    if out.suffix[1:].lower() not in ("", *IMAGE_FORMATS):  # never PNG bytes under another format's name
        raise OptionError("{} {out}: {suffix} is no image format; end the name in .{formats}", "out", out=out,
                          suffix=out.suffix, formats=", .".join(IMAGE_FORMATS))
    with output.writing() if output else contextlib.nullcontext(out) as path:  # without --out: the run's own
        plot_curves(history, path, run_title(results))
    return {"curves": str(out), "train_points": len(history.get("train") or []),
            "valid_points": len(history.get("valid") or [])}


def plot_curves(history: dict[str, Any], path: str | Path, title: str = "") -> None:
    """Draw `history` (results.json's) to `path` in the format its suffix names (`IMAGE_FORMATS`; PNG without one)."""
    train, valid = history.get("train") or [], history.get("valid") or []
    fig = Figure(figsize=(11, 7), layout="constrained")
    axes = fig.subplots(2, 2)
    x_axes = [("step", "optimizer steps", 1), ("train_time_s", "training time (min)", 1 / 60)]  # key, label, scale
    for (loss_ax, bleu_ax), (x_key, x_label, scale) in zip(axes, x_axes):
        for entries, label, style in [(train, "train loss (label smoothed)", "-"), (valid, "validation loss", "o-")]:
            points = [(e[x_key] * scale, e["loss"]) for e in entries if e.get(x_key) is not None
                      and e.get("loss") is not None]
            if points:
                loss_ax.plot(*zip(*points), style, label=label, markersize=4)
        bleu = [(e[x_key] * scale, e["bleu"]) for e in valid if e.get(x_key) is not None and e.get("bleu") is not None]
        if bleu:
            bleu_ax.plot(*zip(*bleu), "o-", color="tab:green", markersize=4)
            bleu_ax.margins(y=0.15)  # room for the best score's label
            best = max(bleu, key=lambda p: p[1])
            bleu_ax.annotate(f"{best[1]:.2f}", best, textcoords="offset points", xytext=(0, 6), ha="center")
        loss_ax.set(xlabel=x_label, ylabel="loss per target token")
        bleu_ax.set(xlabel=x_label, ylabel="validation BLEU (sacreBLEU)")
        if loss_ax.lines:
            loss_ax.legend()
        else:
            loss_ax.text(0.5, 0.5, f"no {x_label} in this run's history", transform=loss_ax.transAxes, ha="center")
        for ax in (loss_ax, bleu_ax):
            ax.grid(alpha=0.3)
    if title:  # a path with undecodable bytes (surrogate escapes) is shown with U+FFFD in their place
        fig.suptitle(title.encode("utf-8", "surrogateescape").decode("utf-8", "replace"))
    save_figure(fig, path)


def save_figure(fig: Figure, path: str | Path) -> None:
    """`fig` to `path` whole or not at all (a link there replaced), in the format its suffix names (PNG without)."""
    image = io.BytesIO()
    fig.savefig(image, format=Path(path).suffix[1:].lower() or "png", dpi=100)
    write_bytes_atomic(path, image.getvalue())


def run_title(results: dict[str, Any]) -> str:
    """The heading of a run's curves: backend, model size, dropout, steps and training data."""
    model, config = results.get("model") or {}, results.get("config") or {}
    data = config.get("train") or "numbers corpus"
    return (f"{results.get('backend', '?')}: d_model {model.get('d_model', '?')}, "
            f"{model.get('num_encoder_layers', '?')}+{model.get('num_decoder_layers', '?')} layers, "
            f"dropout {model.get('dropout', '?')}; {results.get('steps', '?')} steps on {data}")
