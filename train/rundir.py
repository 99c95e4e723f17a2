"""Run directories: the one place that knows their files, claims them, and opens them again.

A run directory holds:
    config.json            the experiment (ExperimentConfig.experiment(): what resume checks and
                           translate, evaluate and conversion read; launch options are not saved)
    model.json             the TransformerConfig
    tokenizer.json         or src_tokenizer.json + tgt_tokenizer.json (BPE trained by the run), or
    sentencepiece.json     + its SentencePiece models (an imported model's tokenizers: train.data.spm)
    checkpoints/<step>/    the backend's checkpoints (newest N plus the best by validation BLEU),
                           each with digest.json: the SHA-256 of every file, checked on load
    tensorboard/           event files
    results.json           final metrics, written at the end
    curves.png             learning curves from results.json's history (train.curves)
    converted.json         where a converted run came from (parity.convert --run-dir)
    averaged.json          which checkpoints an averaged run holds the mean of (train.average)
    imported.json          the pretrained model an imported run came from (parity.convert --from marian)
    recipe.json            the recipe the run was launched with (train.run --config): its path and text

Every file is written whole (`write_text_atomic`: a temporary file beside it, then a rename), and
nothing in a directory changes until `prepare_run_dir`, which the loop calls once the data has
loaded. `choose_checkpoint` is the one rule for "latest", "best" and a step number.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import os
import re
import shutil
import socket
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from torch_reference.config import TransformerConfig

from . import data
from .backends import Backend, create_backend, initialize
from .config import ExperimentConfig
from .data import spm
from .files import UserError, read_json, say, write_json_atomic, write_text_atomic
from .store import CheckpointError, parse_checkpoint

CONFIG_FILE, MODEL_FILE, RESULTS_FILE, PROVENANCE_FILE = "config.json", "model.json", "results.json", "converted.json"
AVERAGED_FILE = "averaged.json"
RECIPE_FILE = "recipe.json"  # train.run --config's recipe: {"path", "toml"}; a resume without one keeps it
CURVES_FILE = "curves.png"  # learning curves, drawn at the end of a run (train.curves)
IMPORTED_FILE = "imported.json"  # a pretrained model's origin and original numbering (parity.convert --from)
CHECKPOINTS, TENSORBOARD = "checkpoints", "tensorboard"
JOINT_TOKENIZER, SRC_TOKENIZER, TGT_TOKENIZER = "tokenizer.json", "src_tokenizer.json", "tgt_tokenizer.json"
TOKENIZER_FILES = (JOINT_TOKENIZER, SRC_TOKENIZER, TGT_TOKENIZER)  # with tokenizer_files(): the spm kind's too
LOCK_FILE = ".lock"  # held (flock) by the one process that writes the run


# ----------------------------------------------------------------------------------------------
# Data and tokenizers


def load_splits(cfg: ExperimentConfig) -> data.Splits:
    """Train, validation and test pairs: the numbers corpus, or the --train/--valid/--test specs
    (test empty when not given). Bad specs and missing files raise UserError."""
    if cfg.uses_numbers_corpus:
        return data.numbers_corpus(cfg.numbers_train, cfg.numbers_valid, cfg.numbers_test, seed=cfg.seed)
    return data.Splits(*(load_split(cfg, spec) if spec else [] for spec in (cfg.train, cfg.valid, cfg.test)))


def load_split(cfg: ExperimentConfig, spec: str) -> list[data.Pair]:
    """Pairs of one data spec, of `numbers:train|valid|test`, the run's numbers corpus split, or of
    `numbers:FIRST-LAST[/STEP]`, every (STEP-th) number from FIRST to LAST (0..999,999)."""
    if spec.startswith("numbers:"):
        name = spec.partition(":")[2]
        if bounds := re.fullmatch(r"(\d+)-(\d+)(?:/(\d+))?", name):
            try:
                return data.numbers_range(int(bounds[1]), int(bounds[2]), int(bounds[3] or 1))
            except ValueError as err:
                raise UserError(f"{spec}: {err}") from None
        if name not in ("train", "valid", "test"):
            raise UserError(
                f"expected numbers:train, numbers:valid, numbers:test or numbers:FIRST-LAST[/STEP], got {spec!r}"
            )
        corpus = data.numbers_corpus(cfg.numbers_train, cfg.numbers_valid, cfg.numbers_test, seed=cfg.seed)
        return getattr(corpus, name)
    try:
        loaded = data.load_parallel(spec, cache_dir=cfg.hf_cache)
    except (FileNotFoundError, ValueError) as err:
        raise UserError(f"cannot load {spec!r}: {err}") from None
    if not loaded.pairs:
        raise UserError(f"{spec!r} holds no sentence pairs" + (
            f" ({loaded.skipped_empty} skipped: a side is empty)" if loaded.skipped_empty else ""))
    if loaded.skipped_empty:
        say(f"{spec}: skipped {loaded.skipped_empty} of {loaded.skipped_empty + len(loaded.pairs)} pairs with an empty side")
    return loaded.pairs


def save_tokenizers(tokenizers: data.Tokenizers, run_dir: str | Path) -> None:
    """Write run_dir/tokenizer.json (joint) or run_dir/src_tokenizer.json + tgt_tokenizer.json;
    SentencePiece tokenizers (train.data.spm) as run_dir/sentencepiece.json and their models."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if isinstance(tokenizers.src, spm.SentencePieceTokenizer):
        spm.save(tokenizers.src, tokenizers.tgt, run_dir, write_text_atomic)
    elif tokenizers.joint:
        write_text_atomic(run_dir / JOINT_TOKENIZER, tokenizers.src.to_str())
    else:
        write_text_atomic(run_dir / SRC_TOKENIZER, tokenizers.src.to_str())
        write_text_atomic(run_dir / TGT_TOKENIZER, tokenizers.tgt.to_str())


def load_tokenizers(run_dir: str | Path, joint: bool | None = None) -> data.Tokenizers:
    """Read what `save_tokenizers` wrote; a joint tokenizer comes back as one shared object.
    `joint`: whether the run's vocabulary is joint (config.json's joint_vocab), so that a missing
    file is named as the one the run needs; None: whichever is there. FileNotFoundError when
    there is none, ValueError when one cannot be read."""
    run_dir = Path(run_dir)
    if (run_dir / spm.SPM_TOKENIZER).is_file():
        return data.Tokenizers(*spm.load(run_dir))
    if joint is None:
        joint = (run_dir / JOINT_TOKENIZER).is_file()
    if joint:
        tokenizer = _read_tokenizer(run_dir / JOINT_TOKENIZER)
        return data.Tokenizers(tokenizer, tokenizer)
    return data.Tokenizers(*(_read_tokenizer(run_dir / name) for name in (SRC_TOKENIZER, TGT_TOKENIZER)))


def tokenizer_files(run_dir: str | Path) -> list[str]:
    """The names of the tokenizer files present in `run_dir` (what a copy of the run must carry)."""
    run_dir = Path(run_dir)
    names = [name for name in TOKENIZER_FILES if (run_dir / name).is_file()]
    if (run_dir / spm.SPM_TOKENIZER).is_file():
        names += spm.files(run_dir)
    return names


def _read_tokenizer(path: Path) -> Tokenizer:
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for unreadable JSON
        raise ValueError(f"{path} is not a readable tokenizer ({err})") from None


# ----------------------------------------------------------------------------------------------
# One writer per run directory


class RunLock:
    """The run directory's writer lock: `fcntl.flock` on DIR/.lock, exclusive and non-blocking.

    Whoever writes a run holds it (train.run from claim to exit, parity.convert over its
    destination); a second writer is refused with the holder's pid and host (read from the
    file), and translate and evaluate, which only read, never take it. The OS releases a flock
    when its process dies, however it dies, so a lock left by a killed run never blocks: the file
    stays, the lock does not. On a filesystem without flock support (some network filesystems)
    the lock cannot be taken: a warning says so and the run goes on unprotected.
    """

    def __init__(self, run_dir: str | Path, created: bool = False):
        self.path = Path(run_dir) / LOCK_FILE
        self.created = created  # the directory was made for this lock: removed again if left empty
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                holder = self.path.read_text(errors="replace").strip() or "another process"
                self.release()
                raise UserError(f"{self.path.parent} is in use by {holder}: one process writes a run at a time "
                                "(translate and evaluate can read it meanwhile)") from None
            say(f"warning: cannot lock {self.path} ({err.strerror}): this filesystem has no flock; nothing "
                 "stops a second process from writing this run")
            return self
        os.ftruncate(self._fd, 0)
        os.write(self._fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        return self

    def release(self) -> None:
        """Unlock; a directory made for the lock and still holding nothing else is removed (a run
        that failed on its data leaves nothing behind)."""
        if self._fd is None:
            return
        if self.created and [p.name for p in self.path.parent.iterdir()] == [LOCK_FILE]:
            shutil.rmtree(self.path.parent, ignore_errors=True)
        os.close(self._fd)  # closing the descriptor releases the flock
        self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def check_destination(dst: Path, overwrite: bool) -> None:
    """Refuse, before any work, a destination run directory whose replacement would lose something:
    a file, a directory holding files but no run, or a run without `overwrite`. Raises FileExistsError."""
    if dst.exists() and not dst.is_dir():
        raise FileExistsError(f"{dst} is a file, not a run directory; it is never replaced by one")
    if dst.exists() and any(dst.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{dst} exists; pass --overwrite to replace it")
        if not (dst / CONFIG_FILE).is_file():
            raise FileExistsError(f"{dst} is not empty and holds no run; it is never deleted")


@contextlib.contextmanager
def derive(src: str | Path | None, dst: str | Path, what: str, overwrite: bool = False,
           copy: Iterable[str] = ()) -> Iterator[Path]:
    """Build `dst` from the run `src` (None: from nothing) whole or not at all, for average, convert,
    import and export: `check_destination`, then the block fills `.NAME.WHAT` beside `dst` (yielded);
    `src`'s tokenizer files and the names `copy` it holds (files or directories) are copied in, the
    old `dst` renamed aside, the new one into its place, and only then the old one removed. On any
    error (Ctrl-C included) `dst` is as it was. Its lock is held meanwhile (a run in training is
    never replaced)."""
    dst = Path(dst)
    check_destination(dst, overwrite)
    guard = RunLock(dst).acquire() if dst.is_dir() else None
    tmp, old = dst.with_name(f".{dst.name}.{what}"), dst.with_name(f".{dst.name}.{what}-old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        for name in [] if src is None else [*tokenizer_files(src), *copy]:
            if (Path(src) / name).is_dir():
                shutil.copytree(Path(src) / name, tmp / name)
            elif (Path(src) / name).is_file():
                shutil.copyfile(Path(src) / name, tmp / name)
        aside = dst.exists()
        if aside:
            os.replace(dst, old)  # refused, losing nothing, while an earlier `old` holds files
        try:
            os.replace(tmp, dst)
        except BaseException:
            if aside:
                os.replace(old, dst)
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if guard is not None:
            guard.release()
    shutil.rmtree(old, ignore_errors=True)


# ----------------------------------------------------------------------------------------------
# Claiming a directory for training


def read_experiment(run_dir: str | Path) -> ExperimentConfig:
    """The experiment saved in `run_dir`'s config.json (launch options at their defaults)."""
    launch = ExperimentConfig.launch_fields()  # runs written before launch options were left out
    return _read_settings(run_dir, CONFIG_FILE, lambda saved: ExperimentConfig.from_dict(
        {k: v for k, v in saved.items() if k not in launch}))


def _read_settings(run_dir: str | Path, name: str, build: Callable[[dict], Any]) -> Any:
    """`build` of the JSON object in run_dir/name; UserError naming the file when it is missing,
    holds no object, or `build` refuses it (a hand-edited file: unknown field, wrong type or value)."""
    path = Path(run_dir) / name
    if not path.is_file():
        raise UserError(f"{run_dir} is not a run directory ({name} missing)")
    saved = read_json(path)
    if not isinstance(saved, dict):
        raise UserError(f"{path} holds no JSON object of settings")
    try:
        return build(saved)
    except (TypeError, ValueError) as err:
        raise UserError(f"{path}: {err}") from None


def _resumed_config(saved: ExperimentConfig, cfg: ExperimentConfig, explicit: Iterable[str] | None) -> ExperimentConfig:
    """The saved experiment with this launch's options; an experiment field given again with
    another value is an error (it would change how the run trains)."""
    if explicit is None:  # a programmatic call: every field that is set counts as given
        explicit = [f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) is not None]
    launch = ExperimentConfig.launch_fields()
    conflicts = [
        f"--{name.replace('_', '-')}: run has {getattr(saved, name)!r}, got {getattr(cfg, name)!r}"
        for name in explicit
        if name not in launch and getattr(cfg, name) != getattr(saved, name)
    ]
    if conflicts:
        raise UserError("--resume cannot change how the run trains:\n  " + "\n  ".join(conflicts))
    return saved.replace(**{name: getattr(cfg, name) for name in launch}).resolve()


def claim_run_dir(cfg: ExperimentConfig, explicit: Iterable[str] | None = None) -> ExperimentConfig:
    """Check the run directory against --resume/--overwrite and return the config to run with:
    the resolved `cfg` for a new run, the saved experiment with this launch's options on --resume.
    Changes nothing on disk: `prepare_run_dir` does, once the data has loaded.

    A directory holding a run (config.json) is refused unless --resume or --overwrite; a
    non-empty directory that holds no run is never deleted.
    """
    cfg = cfg.resolve()
    run_dir = Path(cfg.run_dir)
    holds_run = (run_dir / CONFIG_FILE).is_file()
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"--run-dir {run_dir} is a file")
    if cfg.resume:
        if not holds_run:
            raise UserError(f"nothing to resume: {run_dir} holds no run ({CONFIG_FILE} missing)")
        return _resumed_config(read_experiment(run_dir), cfg, explicit)
    if holds_run:
        if not cfg.overwrite:
            raise UserError(f"{run_dir} already holds a run; pass --resume to continue it or --overwrite to replace it")
    elif run_dir.is_dir() and any(p.name != LOCK_FILE for p in run_dir.iterdir()):
        raise UserError(f"{run_dir} is not empty and holds no run; choose another --run-dir")
    return cfg


def lock_run_dir(cfg: ExperimentConfig) -> RunLock:
    """Take the writer lock of the run directory `claim_run_dir` accepted (creating the directory,
    which stays empty but for the lock file until `prepare_run_dir`). UserError when another
    process holds it."""
    run_dir = Path(cfg.run_dir)
    created = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    return RunLock(run_dir, created).acquire()


def follow_run_dir(cfg: ExperimentConfig, explicit: Iterable[str] | None = None) -> ExperimentConfig:
    """`claim_run_dir` for the processes other than 0 of a multi-process run: the same config,
    without checking, creating or deleting anything (process 0 does that)."""
    cfg = cfg.resolve()
    if not cfg.resume:
        return cfg
    if not (Path(cfg.run_dir) / CONFIG_FILE).is_file():
        raise UserError(f"nothing to resume: {cfg.run_dir} holds no run ({CONFIG_FILE} missing)")
    return _resumed_config(read_experiment(cfg.run_dir), cfg, explicit)


def prepare_run_dir(cfg: ExperimentConfig, model_cfg: TransformerConfig, tokenizers: data.Tokenizers | None) -> None:
    """Create the run directory `claim_run_dir` accepted (deleting the old run on --overwrite) and
    write its experiment, model and (when given: newly trained) tokenizers. config.json first:
    from there on the directory holds this run."""
    run_dir = Path(cfg.run_dir)
    try:  # the recipe of --config, read before anything changes
        recipe = cfg.recipe and {"path": cfg.recipe, "toml": Path(cfg.recipe).read_text("utf-8")}
    except OSError as err:
        raise UserError(f"--config {cfg.recipe}: {err.strerror or err}") from None
    if cfg.overwrite and (run_dir / CONFIG_FILE).is_file():
        for entry in run_dir.iterdir():  # all but the lock this process holds
            if entry.name != LOCK_FILE:
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run_dir / CONFIG_FILE, cfg.experiment())
    if recipe:
        write_json_atomic(run_dir / RECIPE_FILE, recipe)
    if tokenizers is not None:
        save_tokenizers(tokenizers, run_dir)
    write_json_atomic(run_dir / MODEL_FILE, model_cfg.to_dict())


def check_checkpoint_config(meta: Mapping[str, Any], cfg: ExperimentConfig) -> None:
    """Refuse a checkpoint written by another run: one whose experiment (saved in its meta)
    differs from this run's."""
    saved = meta.get("config", cfg.experiment())
    differ = [
        f"--{name.replace('_', '-')}: checkpoint has {saved.get(name)!r}, run has {value!r}"
        for name, value in cfg.experiment().items()
        if saved.get(name) != value
    ]
    if differ:
        raise UserError(
            f"checkpoint {meta.get('step')} in {cfg.run_dir} was written by a run configured differently, so it "
            "cannot be resumed here:\n  " + "\n  ".join(differ)
        )


# ----------------------------------------------------------------------------------------------
# Checkpoints and opening a run


@dataclasses.dataclass
class Run:
    """A trained run opened for translation or evaluation."""

    run_dir: Path
    config: ExperimentConfig
    model_config: TransformerConfig
    tokenizers: data.Tokenizers
    backend: Backend
    meta: dict[str, Any]


def read_model_config(run_dir: str | Path) -> TransformerConfig:
    return _read_settings(run_dir, MODEL_FILE, TransformerConfig.from_dict)


def open_run(run_dir: str | Path, checkpoint: str | int = "best", launch: Mapping[str, Any] | None = None) -> Run:
    """Config, tokenizers and a backend holding checkpoint `checkpoint` ("best", "latest" or a
    step), in this process on every visible device (or those of the launch options `launch`, e.g.
    {"devices": 2}): checkpoints restore onto any mesh."""
    run_dir = Path(run_dir)
    cfg = read_experiment(run_dir)
    if launch:
        cfg = cfg.replace(**launch)
    model_cfg = read_model_config(run_dir)
    checkpoint = parse_checkpoint(checkpoint)
    try:
        tokenizers = load_tokenizers(run_dir, cfg.joint_vocab)
    except (FileNotFoundError, ValueError) as err:
        raise UserError(str(err)) from None
    initialize(cfg)  # the process's settings for its platform; this is where the reading CLIs start
    backend = create_backend(cfg, model_cfg, str(run_dir / CHECKPOINTS))
    try:
        meta = backend.restore(checkpoint)
    except (FileNotFoundError, CheckpointError) as err:
        backend.close()
        raise UserError(str(err)) from None
    return Run(run_dir, cfg, model_cfg, tokenizers, backend, meta)
