"""Recipes: a TOML file of train.run's flags (recipes/*.toml), and the flag parser they are checked
with, built from the fields of `ExperimentConfig`."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import shlex
import stat
import tomllib
from collections.abc import Mapping
from typing import Any

from .config import FIELD_RANGES, RECIPE_FILE, ExperimentConfig, flag_name, flag_type, parse_model_override
from .runtime.files import UserError, quoted, read_json, shortened

# flag group -> its title in --help
GROUPS = {"run": "run", "model": "model", "data": "data", "optim": "optimisation", "eval": "evaluation and logging",
          "ckpt": "checkpoints", "dist": "devices, processes and precision"}
LAUNCH_DECISIONS = ("run_dir", "resume", "overwrite")  # which launch this is: never read from a recipe file
MAX_RECIPE_BYTES = 1 << 20  # a recipe is a page of flags; a bigger file is not one
# The TOML types a recipe key takes, by the field's type (the rest are strings).
RECIPE_TYPES = {"int": (int, "an integer"), "float": ((int, float), "a number"), "bool": (bool, "true or false"),
                "dict": (list, "a list of strings")}


def _type_name(annotation: str) -> str:
    """'int | None' -> 'int': the field's base type (annotations are strings here)."""
    return annotation.replace(" | None", "").strip()


def build_parser(epilog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m train.run",
        description="Train the Transformer of 'Attention Is All You Need' with the JAX (Flax NNX) or the PyTorch "
        "backend, the same loop and the same semantics; evaluate it (loss, perplexity, sacreBLEU BLEU and chrF) "
        "and write checkpoints, TensorBoard events and results.json to the run directory. With no flag it "
        "trains a small model on the embedded numbers corpus in a few minutes on a CPU.",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    groups = {key: parser.add_argument_group(title) for key, title in GROUPS.items()}
    defaults = ExperimentConfig()
    for field in dataclasses.fields(ExperimentConfig):
        meta = field.metadata
        default = getattr(defaults, field.name)
        kind = _type_name(str(field.type))
        # SUPPRESS: only flags actually given reach the config, so --resume can tell them apart.
        kwargs: dict = {"dest": field.name, "default": argparse.SUPPRESS}
        # Automatic defaults (None) are explained in the help text itself.
        help = meta["help"] if default is None or kind == "dict" else f"{meta['help']} (default: {default})"
        if kind == "bool":
            kwargs.update(action=argparse.BooleanOptionalAction, help=help)
        elif kind == "dict":
            kwargs.update(action="append", type=flag_type(parse_model_override), metavar=meta.get("metavar"), help=help)
        else:
            # Numbers range-checked by the field's own rule: a bad value exits 2 with one line.
            kwargs.update(type=FIELD_RANGES[field.name].parser(field.name) if field.name in FIELD_RANGES else str,
                          choices=meta.get("choices"), help=help,
                          metavar=meta.get("metavar", {"int": "N", "float": "X"}.get(kind)))
        groups[meta["group"]].add_argument(flag_name(field), **kwargs)
    return parser


def recipe_config(path: str, overrides: Mapping[str, Any] | None = None) -> tuple[ExperimentConfig, set[str]]:
    """(the experiment of the recipe at `path` with `overrides` (field names) on top, the names of the
    fields given); UserError naming the file, key or field for anything it refuses."""
    given = vars(build_parser().parse_args(recipe_flags(path)))
    if "model" in given:
        given["model"] = dict(given["model"])
    given = {**given, "recipe": path, **(overrides or {})}
    try:
        return ExperimentConfig(**given), set(given)
    except (TypeError, ValueError) as err:
        raise UserError(f"{path}: {err}") from None


def recorded_launch(run_dir: str | os.PathLike) -> tuple[dict[str, Any], str] | None:
    """(the launch fields of the recipe the run in `run_dir` was started from: steps, evaluation and
    checkpoints, not which launch this is; that recipe's path), None for a run started without one:
    what a resume takes where they are not given again. UserError for a damaged record."""
    path = os.path.join(run_dir, RECIPE_FILE)
    recorded = read_json(path, default=None)
    if recorded is None:
        return None
    if not (isinstance(recorded, dict) and all(isinstance(recorded.get(k), str) for k in ("path", "toml"))):
        raise UserError(f"{path}: expected {{\"path\": ..., \"toml\": ...}}, the recipe a run was started from")
    flags = vars(build_parser().parse_args(recipe_flags(f"{path} (the recipe {recorded['path']})", recorded["toml"])))
    launch = set(ExperimentConfig.launch_fields()) - set(LAUNCH_DECISIONS)
    return {k: v for k, v in flags.items() if k in launch}, recorded["path"]


def resume_command(cfg: ExperimentConfig) -> str:
    """The command that continues the run `cfg` launches as launched: --resume and the launch flags
    (steps, intervals, devices) whose values a bare --resume would not take again."""
    bare = ExperimentConfig(**(recorded_launch(cfg.run_dir) or ({}, ""))[0])
    bare = bare.replace(save_every=bare.save_every or cfg.eval_every)  # --save-every defaults to --eval-every
    flags, skip = [], {*LAUNCH_DECISIONS, "recipe"}
    for field in dataclasses.fields(ExperimentConfig):
        value, flag = getattr(cfg, field.name), flag_name(field)
        if not field.metadata["launch"] or field.name in skip or value == getattr(bare, field.name):
            continue
        if isinstance(value, bool):
            flags.append(flag if value else f"--no-{flag[2:]}")
        else:
            flags.append(f"{flag} {shlex.quote(str(value))}")
    return " ".join(["python -m train.run --run-dir", shlex.quote(str(cfg.run_dir)), "--resume", *flags])


def recipe_flags(path: str, text: str | None = None) -> list[str]:
    """The TOML recipe at `path` (or its `text`, as a run directory keeps it) as train.run flags:
    `eval_every = 1000` -> `--eval-every=1000`, `joint_vocab = false` -> `--no-joint-vocab`,
    `set = ["a=1", "b=2"]` -> `--set=a=1 --set=b=2`. A file that cannot be read, bad TOML, an
    unknown key, a launch decision (run_dir, resume, overwrite: flags only, so that a shared recipe
    never deletes a run), a wrong type or a bad value raise UserError naming the file (and the key
    or line)."""

    def fail(message: str):
        raise UserError(f"{path}: {message}")

    parser = build_parser()
    parser.exit_on_error = False  # a bad value raises, to be reported with the file and key
    recorded = text is not None
    try:
        if not recorded:  # only a regular file: a FIFO without a writer would block, a device never end
            info = os.stat(path)
            if not stat.S_ISREG(info.st_mode):
                fail("not a regular file (a directory, FIFO or device); a recipe is a TOML file")
            if info.st_size > MAX_RECIPE_BYTES:
                fail(f"{info.st_size:,} bytes, more than a recipe's {MAX_RECIPE_BYTES:,}")
            with open(path, "rb") as file:
                text = file.read().decode("utf-8")
        table = tomllib.loads(text.removeprefix("\ufeff"))  # a byte order mark some editors write
    except OSError as err:
        fail(err.strerror or str(err))
    except UnicodeDecodeError as err:
        fail(f"not UTF-8 text: byte {err.start} ({err.object[err.start:err.start + 1]!r}) {err.reason}")
    except tomllib.TOMLDecodeError as err:  # its message names the line and column
        fail(f"invalid TOML: {err}")
    fields = {flag_name(f)[2:].replace("-", "_"): f for f in dataclasses.fields(ExperimentConfig) if f.name != "recipe"}
    flags = []
    for key, value in table.items():
        if key in LAUNCH_DECISIONS:
            if recorded:  # the recorded recipe of a run started before they were refused
                continue
            fail(f"key {key!r}: a launch decision, not a recipe key; give --{key.replace('_', '-')} on the command line")
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            fail(f"key {quoted(key)}: unknown" + (f" (did you mean {close[0]!r}?)" if close else
                                            ": the keys are the long flags of python -m train.run --help, with _ for -"))
        kind = _type_name(str(fields[key].type))
        types, expected = RECIPE_TYPES.get(kind, (str, "a string"))
        if (not isinstance(value, types) or isinstance(value, bool) != (kind == "bool")
                or kind == "dict" and not all(isinstance(item, str) for item in value)):
            fail(f"key {key!r}: expected {expected}, got {quoted(value)}")
        flag = flag_name(fields[key])
        if kind == "bool":
            args = [flag if value else "--no-" + flag[2:]]
        else:
            args = [f"{flag}={item}" for item in (value if kind == "dict" else [value])]
        try:
            parser.parse_args(args)
        except argparse.ArgumentError as err:
            fail(f"key {key!r}: {shortened(err.message)}")  # a bad choice quotes the value
        flags += args
    return flags
