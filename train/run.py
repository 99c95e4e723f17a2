"""`python -m train.run --backend=jax|torch [flags]`: train, evaluate and save a translation model.

A thin CLI: every flag is a field of `train.config.ExperimentConfig` (its help text lives there),
and the work is `train.loop.train(config)`; `--config FILE` reads flags from a TOML recipe
(`recipe_flags`), before those of the command line. Bad values and unusable files or run directories
end with one `error:` line and exit status 2 (flags) or 1 (files), never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import signal
import sys
import tomllib
from pathlib import Path

from .backends import allocator
from .config import FIELD_RANGES, RECIPE_FILE, ExperimentConfig, flag_type, parse_model_override
from .files import UserError, read_json

GROUPS = {  # flag group -> its title in --help
    "run": "run", "model": "model", "data": "data", "optim": "optimisation", "eval": "evaluation and logging",
    "ckpt": "checkpoints", "dist": "devices, processes and precision",
}

# The TOML types a recipe key takes, by the field's type (the rest are strings).
RECIPE_TYPES = {
    "int": (int, "an integer"), "float": ((int, float), "a number"), "bool": (bool, "true or false"),
    "dict": (list, "a list of strings"),
}

EPILOG = """\
data specs (--train, --valid, --test):
  SRC:TGT:PREFIX                      two aligned text files PREFIX.SRC and PREFIX.TGT, one sentence
                                      per line, plain or gzipped (PREFIX.SRC.gz), e.g.
                                      de:en:../shared/data/multi30k/train
  FILE.tsv[.gz][#src=COL,tgt=COL]     tab-separated with a header row; columns default to source,target
  FILE.jsonl|.json[.gz][#src=F,tgt=F] JSON lines; fields default to source,target (also looked up
                                      inside a "translation" dict)
  hf:NAME[:CONFIG]:SPLIT[#src=F,tgt=F]  datasets.load_dataset(NAME, CONFIG, split=SPLIT): a hub id
                                      (needs internet) or a local dataset directory; SPLIT may slice,
                                      e.g. hf:bentrevett/multi30k:train#src=de,tgt=en
  Without --train: the embedded numbers corpus, German number words -> English (0..999,999),
  generated offline from --seed with --numbers-train/--numbers-valid/--numbers-test pairs.

examples:
  python -m train.run --backend=jax
  python -m train.run --backend=torch --steps 2000 --run-dir runs/torch-numbers
  python -m train.run --run-dir runs/m30k --train de:en:../shared/data/multi30k/train \\
      --valid de:en:../shared/data/multi30k/val --test de:en:../shared/data/multi30k/test_2016_flickr \\
      --preset small --steps 20000 --token-budget 8192
  python -m train.run --config recipes/multi30k-de-en.toml --run-dir runs/m30k   # a recipe (recipes/*.toml)
  python -m train.run --run-dir runs/torch-numbers --resume --steps 4000
  python -m train.run --devices 4 --dtype bfloat16          # data parallel over 4 devices, bf16
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m train.run   # 8 CPU devices, for testing
  python -m train.run --run-dir runs/mh --coordinator-address 127.0.0.1:12345 --num-processes 2 \\
      --process-id 0     # and the same with --process-id 1 in a second shell: one run, two processes
Ctrl-C or SIGTERM finishes the current update, saves a checkpoint and exits (status 130/143);
`--resume` continues from the newest complete checkpoint, exactly as if never stopped (a run
started from a recipe reads it again from the run directory). A
non-finite loss stops the run before it is saved (exit status 1).
then: python -m train.translate --run-dir DIR < input.txt
      python -m train.evaluate --run-dir DIR --data numbers:test
"""


def _type_name(annotation: str) -> str:
    """'int | None' -> 'int': the field's base type (annotations are strings here)."""
    return annotation.replace(" | None", "").strip()


def _flag(field: dataclasses.Field) -> str:
    return field.metadata.get("flag", "--" + field.name.replace("_", "-"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m train.run",
        description="Train the Transformer of 'Attention Is All You Need' with the JAX (Flax NNX) or the PyTorch "
        "backend, the same loop and the same semantics; evaluate it (loss, perplexity, sacreBLEU BLEU and chrF) "
        "and write checkpoints, TensorBoard events and results.json to the run directory. With no flag it "
        "trains a small model on the embedded numbers corpus in a few minutes on a CPU.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    groups = {key: parser.add_argument_group(title) for key, title in GROUPS.items()}
    defaults = ExperimentConfig()
    for field in dataclasses.fields(ExperimentConfig):
        meta = field.metadata
        flag = _flag(field)
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
            kwargs.update(
                # Numbers range-checked by the field's own rule: a bad value exits 2 with one line.
                type=FIELD_RANGES[field.name].parser(field.name) if field.name in FIELD_RANGES else str,
                choices=meta.get("choices"),
                metavar=meta.get("metavar", {"int": "N", "float": "X"}.get(kind)),
                help=help,
            )
        groups[meta["group"]].add_argument(flag, **kwargs)
    return parser


def parse_config(argv: list[str] | None = None) -> tuple[ExperimentConfig, set[str]]:
    """(config, names of the fields given on the command line); exits with a message on bad values."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    given = vars(parser.parse_args(argv))
    if "recipe" in given:  # the file's flags first: the command line's come after and win
        given = vars(parser.parse_args(recipe_flags(given["recipe"]) + argv))
    elif given.get("resume") and given.get("run_dir") and (recorded := _recorded_recipe(parser, given["run_dir"])):
        # How long and how this launch runs (steps, evaluation, checkpoints) from the recipe the run
        # was started from; how it trains is the run's own config.json, as for any resume. Not the
        # flags that say which launch this is: a recipe's `overwrite = true` is for its first start.
        launch = set(ExperimentConfig.launch_fields()) - {"run_dir", "resume", "overwrite"}
        where = f"{Path(given['run_dir']) / RECIPE_FILE} (the recipe {recorded['path']})"
        flags = vars(parser.parse_args(recipe_flags(where, recorded["toml"])))
        given = {**{k: v for k, v in flags.items() if k in launch}, **given}
        print(f"--resume: steps, evaluation and checkpoint flags from the recipe the run was started from "
              f"({recorded['path']}, kept in the run directory) unless given now", file=sys.stderr)
    if "model" in given:
        given["model"] = dict(given["model"])
    try:
        return ExperimentConfig(**given), set(given)
    except ValueError as err:
        parser.error(str(err))


def _recorded_recipe(parser: argparse.ArgumentParser, run_dir: str) -> dict[str, str] | None:
    """The recipe a run was started from ({"path", "toml"}, its recipe.json), None when it has none;
    an unreadable or malformed record ends the process with one line naming it (exit status 2)."""
    path = Path(run_dir) / RECIPE_FILE
    try:
        recorded = read_json(path, default=None)
    except UserError as err:
        parser.error(str(err))
    ok = isinstance(recorded, dict) and all(isinstance(recorded.get(k), str) for k in ("path", "toml"))
    if recorded is not None and not ok:
        parser.error(f"{path}: expected {{\"path\": ..., \"toml\": ...}}, the recipe a run was started from")
    return recorded


def recipe_flags(path: str, text: str | None = None) -> list[str]:
    """The TOML recipe at `path` (or its `text`, as a run directory keeps it) as train.run flags:
    `eval_every = 1000` -> `--eval-every=1000`, `joint_vocab = false` -> `--no-joint-vocab`,
    `set = ["a=1", "b=2"]` -> `--set=a=1 --set=b=2`. A file that cannot be read, bad TOML, an
    unknown key, a wrong type or a bad value ends the process with one line naming the file (and
    the key or line), exit status 2."""

    def fail(message: str):
        parser.exit(2, f"error: {path}: {message}\n")

    parser = build_parser()
    parser.exit_on_error = False  # a bad value raises, to be reported with the file and key
    try:
        if text is None:
            with open(path, "rb") as file:
                table = tomllib.load(file)
        else:
            table = tomllib.loads(text)
    except OSError as err:
        fail(err.strerror or str(err))
    except tomllib.TOMLDecodeError as err:  # its message names the line and column
        fail(f"invalid TOML: {err}")
    fields = {_flag(f)[2:].replace("-", "_"): f for f in dataclasses.fields(ExperimentConfig) if f.name != "recipe"}
    flags = []
    for key, value in table.items():
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            fail(f"key {key!r}: unknown" + (f" (did you mean {close[0]!r}?)" if close else
                                            ": the keys are the long flags of python -m train.run --help, with _ for -"))
        kind = _type_name(str(fields[key].type))
        types, expected = RECIPE_TYPES.get(kind, (str, "a string"))
        if (not isinstance(value, types) or isinstance(value, bool) != (kind == "bool")
                or kind == "dict" and not all(isinstance(item, str) for item in value)):
            fail(f"key {key!r}: expected {expected}, got {value!r}")
        flag = _flag(fields[key])
        if kind == "bool":
            args = [flag if value else "--no-" + flag[2:]]
        else:
            args = [f"{flag}={item}" for item in (value if kind == "dict" else [value])]
        try:
            parser.parse_args(args)
        except argparse.ArgumentError as err:
            fail(f"key {key!r}: {err.message}")
        flags += args
    return flags


def main(argv: list[str] | None = None) -> int:
    cfg, given = parse_config(argv)
    from .files import error_text
    from .loop import Interrupted, UserError, train  # after parsing: --help and flag errors stay fast

    try:
        train(cfg, explicit=given)
    except (UserError, OSError) as err:  # OSError: a full disk, a read-only place, no permission
        print(f"error: {error_text(err)}", file=sys.stderr)
        return 1
    except Interrupted as err:  # SIGTERM / Ctrl-C: a checkpoint was saved
        print(err, file=sys.stderr)
        return 128 + err.signum
    except KeyboardInterrupt:  # a second Ctrl-C, or one outside the update loop
        print("interrupted: nothing of the current step was saved; --resume continues from the last checkpoint",
              file=sys.stderr)
        return 128 + signal.SIGINT
    return 0


if __name__ == "__main__":
    allocator.use_huge_pages()  # re-executes once; see train/backends/allocator.py
    sys.exit(main())
