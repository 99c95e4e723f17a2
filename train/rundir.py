"""Claiming a run directory for training (new, --resume, --overwrite) and writing its first files."""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from torch_reference.config import TransformerConfig, escaped

from . import data
from .checkpoints import saved_experiments
from .config import RECIPE_FILE, ExperimentConfig
from .runtime.files import OptionError, UserError, say, user_errors, write_json_atomic
from .runtime.layout import (CHECKPOINTS, CONFIG_FILE, LOCK_FILE, MODEL_FILE, TENSORBOARD, experiment_of,
                             read_experiment, read_model_config)
from .runtime.lock import RunLock
from .runtime.replace import check_outside_runs, kind_of, remove


@contextlib.contextmanager
def session(cfg: ExperimentConfig, explicit: Iterable[str] | None = None, platform: str | None = None,
            is_main: bool = True, source: str | Path | None = None) -> Iterator[ExperimentConfig]:
    """The run directory claimed (process 0 locks it) and the config to train with; nothing is written but the lock."""
    run_dir = Path(cfg.run_dir or time.strftime(f"runs/{cfg.backend}-%Y%m%d-%H%M%S"))
    if ".." in run_dir.parts:  # R/checkpoints/.. names nothing once --overwrite has set checkpoints/ aside
        run_dir = run_dir.resolve()
    with contextlib.ExitStack() as claimed:
        if is_main:
            _check_claim(run_dir, cfg.resume, cfg.overwrite)
            created = not run_dir.exists()
            run_dir.mkdir(parents=True, exist_ok=True)
            claimed.enter_context(RunLock(run_dir, created))
            claimed.enter_context(replacing(run_dir, cfg.overwrite))
            if not cfg.resume:  # a new run that fails before its first checkpoint leaves nothing blocking a retry
                claimed.push(lambda failed, *_: failed is not None and not has_checkpoint(run_dir) and _clear(run_dir))
        if cfg.resume and not (run_dir / CONFIG_FILE).is_file():
            raise UserError(f"nothing to resume: {run_dir} holds no run ({CONFIG_FILE} missing)")
        saved = read_experiment(run_dir) if cfg.resume else None
        origin = None
        if source is not None and not cfg.resume:  # train.loop made init_from's source a run (pretrained.source_run)
            if not (Path(source) / CONFIG_FILE).is_file():
                raise OptionError("{} {source}: not a run directory", "init_from", source=source)
            origin = read_experiment(source)
        with user_errors(ValueError):
            cfg = cfg.replace(run_dir=str(run_dir)).resolve(platform, given=explicit, saved=saved, source=origin)
        yield cfg


def _check_claim(run_dir: Path, resume: bool, overwrite: bool) -> None:
    if run_dir.exists() and not run_dir.is_dir():
        raise OptionError("{} {dir} is a file", "run_dir", dir=run_dir)
    check_outside_runs(run_dir, "run_dir")
    check_set_aside(run_dir)
    if resume:
        check_links(run_dir)
    elif run_dir.is_dir() and any(p.name != LOCK_FILE for p in run_dir.iterdir()):
        if kind_of(run_dir) != "run":
            raise OptionError("{dir} is not empty and holds no run; choose another {}", "run_dir", dir=run_dir)
        if not overwrite:
            raise OptionError("{dir} already holds a run; pass {} to continue it or {} to replace it", "resume",
                              "overwrite", dir=run_dir)


def set_aside_path(run_dir: Path) -> Path:
    """Where a replacement keeps the old run meanwhile: beside it, however `run_dir` is spelled (R/checkpoints/..)."""
    run_dir = run_dir.resolve()
    return run_dir.with_name(f".{run_dir.name}.run-old")


def check_set_aside(run_dir: str | Path) -> None:
    """UserError naming `.RUN.run-old`, set aside by an overwrite still running or killed: any command opening a run."""
    run_dir = Path(run_dir)
    if not ((old := set_aside_path(run_dir)).exists() or old.is_symlink()):
        return
    try:  # a live --overwrite holds the lock: probed, never kept
        with open(os.open(run_dir / LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW)) as lock:
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise UserError(f"{run_dir} is being replaced by a running overwrite, the old run kept in {old} "
                        "meanwhile: wait for it to end") from None
    except OSError:
        pass
    raise UserError(f"{old} holds the run an earlier overwrite of {run_dir} set aside and was stopped before it "
                    f"could put back or delete it: move it back to {run_dir}, or delete it, first")


def has_checkpoint(run_dir: Path) -> bool:
    """Whether `run_dir` holds a complete checkpoint (both stores publish a step by renaming it to its number)."""
    checkpoints = run_dir / CHECKPOINTS
    return checkpoints.is_dir() and any(p.name.isdigit() for p in checkpoints.iterdir())


def _clear(run_dir: Path) -> None:
    for entry in run_dir.iterdir():
        if entry.name != LOCK_FILE:
            remove(entry)


@contextlib.contextmanager
def replacing(run_dir: Path, overwrite: bool) -> Iterator[None]:
    """Overwrite, the old run kept in `.NAME.run-old` until the new one holds a checkpoint (else put back)."""
    if not (overwrite and (run_dir / CONFIG_FILE).is_file()):
        yield
        return
    old = set_aside_path(run_dir)
    old.mkdir()  # session refused one already there
    say(f"overwrite: the run in {run_dir} is kept in {old} until this one holds a checkpoint, then deleted")
    try:
        for entry in run_dir.iterdir():
            if entry.name != LOCK_FILE:
                os.rename(entry, old / entry.name)
    except BaseException:  # a rename refused: what moved goes back, the old run whole
        _put_back(old, run_dir)
        raise
    try:
        yield
    except BaseException:
        if not has_checkpoint(run_dir):  # the new run holds nothing: the old one goes back
            _clear(run_dir)
            _put_back(old, run_dir)
            raise
        remove(old)
        raise
    remove(old)


def _put_back(old: Path, run_dir: Path) -> None:
    """The run set aside in `old` back in run_dir; a rename refused leaves the rest in `old`, never deleted."""
    for entry in old.iterdir():
        os.rename(entry, run_dir / entry.name)
    old.rmdir()


def check_links(run_dir: Path) -> None:
    """Refuse a run to resume whose checkpoints/, tensorboard/ or a checkpoint is a link: a run writes only inside."""
    checkpoints = run_dir / CHECKPOINTS
    steps = list(checkpoints.iterdir()) if checkpoints.is_dir() and not checkpoints.is_symlink() else []
    for part in (checkpoints, run_dir / TENSORBOARD, *steps):
        if part.is_symlink():
            raise UserError(f"{part} is a symbolic link: a run writes and deletes only inside its own directory, "
                            "never where a link points; replace the link by a copy of what it points to")


def prepare_run_dir(cfg: ExperimentConfig, model_cfg: TransformerConfig, tokenizers: data.Tokenizers | None) -> None:
    """Write the claimed run's config.json (from there on it holds this run), model and (given: new) tokenizers."""
    run_dir = Path(cfg.run_dir)
    try:  # the recipe of --config, read before anything changes
        recipe = cfg.recipe and {"path": cfg.recipe, "toml": Path(cfg.recipe).read_text("utf-8")}
    except OSError as err:
        raise OptionError("{} {path}: {why}", "recipe", path=cfg.recipe, why=err.strerror or err) from None
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run_dir / CONFIG_FILE, cfg.experiment())
    if recipe:
        write_json_atomic(run_dir / RECIPE_FILE, recipe)
    if tokenizers is not None:
        data.save_tokenizers(tokenizers, run_dir)
    write_json_atomic(run_dir / MODEL_FILE, model_cfg.to_dict())


def check_model(run_dir: Path, cfg: ExperimentConfig, model_cfg: TransformerConfig, tokenizers: data.Tokenizers,
                what: str = MODEL_FILE) -> None:
    """Refuse, before building it, a run whose `model_cfg` (from `what`) is not config.json's and its checkpoints'."""
    sizes = tokenizers.src.get_vocab_size(), tokenizers.tgt.get_vocab_size()
    sources = {f"{run_dir / CONFIG_FILE} with the tokenizer": cfg}
    for step, saved in sorted(saved_experiments(run_dir / CHECKPOINTS).items()):
        with contextlib.suppress(TypeError, ValueError):  # an older checkpoint's fields: checked when its weights load
            sources[f"the experiment saved in checkpoint {step}"] = experiment_of(saved)
    for where, experiment in sources.items():
        rebuilt = experiment.model_config(*sizes)
        if differ := [k for k, v in model_cfg.to_dict().items() if getattr(rebuilt, k) != v]:
            raise UserError(f"{run_dir / what} says {', '.join(f'{k}={getattr(model_cfg, k)!r}' for k in differ)} "
                            f"but {where} gives {', '.join(f'{k}={getattr(rebuilt, k)!r}' for k in differ)}: the "
                            "files of the run do not describe one model (edited by hand?)")


def read_run(run_dir: Path) -> tuple[ExperimentConfig, TransformerConfig, data.Tokenizers]:
    """The experiment, model and tokenizers of the run in `run_dir`, checked (`check_set_aside`, `check_model`)."""
    check_set_aside(run_dir)
    cfg = read_experiment(run_dir)
    model_cfg = read_model_config(run_dir)
    with user_errors(FileNotFoundError, ValueError):
        tokenizers = data.load_tokenizers(run_dir, cfg.joint_vocab)
    check_model(run_dir, cfg, model_cfg, tokenizers)
    return cfg, model_cfg, tokenizers


def check_checkpoint_config(meta: Mapping[str, Any], cfg: ExperimentConfig) -> None:
    """Refuse a checkpoint written by another run: one whose experiment (in its meta) differs from this run's."""
    saved = {"pack": False, **meta.get("config", cfg.experiment())}  # no "pack": saved before packing, on buckets
    if differ := [name for name, value in cfg.experiment().items() if saved.get(name) != value]:
        raise OptionError(escaped(f"checkpoint {meta.get('step')} in {cfg.run_dir} was written by a run configured "
                                  "differently, so it cannot be resumed here: ") + "; ".join(
            "{}" + escaped(f": checkpoint has {saved.get(n)!r}, run has {getattr(cfg, n)!r}") for n in differ), *differ)
