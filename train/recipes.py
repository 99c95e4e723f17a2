"""Recipes (TOML files of train.run's settings) as `ExperimentConfig` fields, and the config a launch gives."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import shlex
import stat
import sys
import tomllib
from collections.abc import Mapping
from typing import Any

from torch_reference.config import SettingError, escaped, hints, setting_error

from .config import RECIPE_FILE, ExperimentConfig, flag_name, parse_model_override
from .options import OptionError, add_flags, command, worded
from .runtime.files import UserError, quoted, read_json, shortened

GROUPS = {"run": "run", "model": "model", "data": "data", "optim": "optimisation", "eval": "evaluation and logging",
          "ckpt": "checkpoints", "dist": "devices, processes and precision"}
LAUNCH_DECISIONS = ("run_dir", "resume", "overwrite")  # which launch this is: never read from a recipe file
MAX_RECIPE_BYTES = 1 << 20  # a recipe is a page of flags; a bigger file is not one


def build_parser(epilog: str | None = None) -> argparse.ArgumentParser:
    """train.run's parser: a flag per `ExperimentConfig` field, in their groups."""
    parser = command(
        "python -m train.run", epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train the Transformer of 'Attention Is All You Need' with the JAX (Flax NNX) or the PyTorch "
        "backend, the same loop and the same semantics; evaluate it (loss, perplexity, sacreBLEU BLEU and chrF) "
        "and write checkpoints, TensorBoard events and results.json to the run directory. With no flag it "
        "trains a small model on the embedded numbers corpus in a few minutes on a CPU.")
    groups = {key: parser.add_argument_group(title) for key, title in GROUPS.items()}
    add_flags(parser, ExperimentConfig, groups=groups)
    return parser


def experiment(given: Mapping[str, Any], note: str = "settings") -> tuple[ExperimentConfig, set[str]]:
    """(the config of the fields `given`, their names) under a recipe or a resumed run's launch; UserError."""
    given = dict(given)
    if not isinstance(given.get("recipe"), (str, os.PathLike, type(None))):
        raise OptionError("{} must be a path, " + escaped(f"got {given['recipe']!r}"), "recipe")
    if isinstance(given.get("model"), list):  # --set's (field, value) pairs
        given["model"] = dict(given["model"])
    if given.get("recipe") is not None:
        given["recipe"] = os.fspath(given["recipe"])
        read = read_recipe(given["recipe"])
        model = {**read.get("model", {}), **given.get("model", {})}
        given = {**read, **given, **({"model": model} if model else {})}
    elif given.get("resume") and given.get("run_dir") and (recorded := recorded_launch(given["run_dir"])):
        # How long and how this launch runs from the recipe the run was started from; how it trains is its config.json.
        given = {**recorded[0], **given}
        print(f"--resume: steps, evaluation and checkpoint {note} from the recipe the run was started from "
              f"({recorded[1]}, kept in the run directory) unless given now", file=sys.stderr)
    recipe = escaped(f"{given['recipe']}: ") if given.get("recipe") else ""
    try:
        return ExperimentConfig(**given), set(given)
    except SettingError as err:
        raise OptionError(recipe + err.template, *err.names, **err.values) from None
    except (TypeError, ValueError) as err:
        raise OptionError(recipe + escaped(str(err))) from None


def flagged(err: UserError) -> str:
    """`err`'s message with train.run's flags for the parameters it names (`OptionError`), one line."""
    return worded(err, {field.name: flag_name(field) for field in dataclasses.fields(ExperimentConfig)})


def recorded_launch(run_dir: str | os.PathLike) -> tuple[dict[str, Any], str] | None:
    """(the launch fields of the recipe `run_dir` was started from, its path), None without; UserError if damaged."""
    path = os.path.join(run_dir, RECIPE_FILE)
    recorded = read_json(path, default=None)
    if recorded is None:
        return None
    if not (isinstance(recorded, dict) and all(isinstance(recorded.get(k), str) for k in ("path", "toml"))):
        raise UserError(f"{path}: expected {{\"path\": ..., \"toml\": ...}}, the recipe a run was started from")
    fields = read_recipe(f"{path} (the recipe {recorded['path']})", recorded["toml"])
    launch = set(ExperimentConfig.launch_fields()) - set(LAUNCH_DECISIONS)
    return {k: v for k, v in fields.items() if k in launch}, recorded["path"]


def resume_command(cfg: ExperimentConfig) -> str:
    """The command continuing the run `cfg` launches: --resume and the launch flags a bare --resume would not take."""
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
    launcher = "python"
    if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun started the processes: it starts them again
        local = int(os.environ["LOCAL_WORLD_SIZE"])
        nodes = int(os.environ["WORLD_SIZE"]) // local
        launcher = f"torchrun {f'--nnodes {nodes} ' if nodes > 1 else ''}--nproc-per-node {local}"
    return " ".join([launcher, "-m train.run --run-dir", shlex.quote(str(cfg.run_dir)), "--resume", *flags])


def read_recipe(path: str, text: str | None = None) -> dict[str, Any]:
    """The TOML recipe at `path` (or its `text`) as `ExperimentConfig` fields; UserError naming the file and key."""

    def fail(message: str):
        raise UserError(f"{path}: {message}")

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
    out: dict[str, Any] = {}
    for key, value in table.items():
        if key in LAUNCH_DECISIONS:
            if recorded:  # the recorded recipe of a run started before they were refused
                continue
            fail(f"key {key!r}: a launch decision, not a recipe key; give --{key.replace('_', '-')} on the command line")
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            fail(f"key {quoted(key)}: unknown" + (f" (did you mean {close[0]!r}?)" if close else
                                            ": the keys are the long flags of python -m train.run --help, with _ for -"))
        field = fields[key]
        try:
            if hints(ExperimentConfig)[field.name] is dict:  # --set's FIELD=VALUE strings
                if not (isinstance(value, list) and all(isinstance(item, str) for item in value)):
                    fail(f"key {key!r} must be a list of strings, got {quoted(value)}")
                value = dict(parse_model_override(item) for item in value)
            elif (problem := setting_error(field, value, hints(ExperimentConfig)[field.name]))[0] is not None:
                fail(f"key {key!r} {shortened(problem[0])}")
        except ValueError as err:
            fail(f"key {key!r}: {shortened(str(err))}")
        out[field.name] = value
    return out
