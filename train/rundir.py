"""Run directories: the one place that knows their files (docs/operations.md#run-directories),
claims them, and opens them again. Every file is written whole (`write_text_atomic`), and nothing
in a directory changes until `prepare_run_dir`, which the loop calls once the data has loaded.
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
from .config import RECIPE_FILE, ExperimentConfig
from .data import spm
from .files import UserError, read_json, say, write_bytes_atomic, write_error, write_json_atomic, write_text_atomic
from .store import CheckpointError, parse_checkpoint, saved_experiments

CONFIG_FILE, MODEL_FILE, RESULTS_FILE = "config.json", "model.json", "results.json"  # experiment, TransformerConfig
PROVENANCE_FILE = "converted.json"  # where a converted run came from (parity.convert --run-dir)
AVERAGED_FILE = "averaged.json"  # which checkpoints an averaged run holds the mean of (train.average)
CURVES_FILE = "curves.png"  # learning curves, drawn at the end of a run (train.curves)
IMPORTED_FILE = "imported.json"  # a pretrained model's origin and original numbering (parity.convert --from)
CHECKPOINTS, TENSORBOARD = "checkpoints", "tensorboard"  # checkpoints/<step>/ (train.store), event files
JOINT_TOKENIZER, SRC_TOKENIZER, TGT_TOKENIZER = "tokenizer.json", "src_tokenizer.json", "tgt_tokenizer.json"
TOKENIZER_FILES = (JOINT_TOKENIZER, SRC_TOKENIZER, TGT_TOKENIZER)  # with tokenizer_files(): the spm kind's too
LOCK_FILE = ".lock"  # held (flock) by the one process that writes the run


# ----------------------------------------------------------------------------------------------
# Data and tokenizers


def load_splits(cfg: ExperimentConfig) -> data.Splits:
    """Train, validation and test pairs: the numbers corpus, or the --train/--valid/--test specs
    (test empty when not given), every text lowercased with --lowercase. Bad specs and missing
    files raise UserError."""
    if cfg.uses_numbers_corpus:
        splits = data.numbers_corpus(cfg.numbers_train, cfg.numbers_valid, cfg.numbers_test, seed=cfg.seed)
    else:
        splits = data.Splits(*(load_split(cfg, spec) if spec else [] for spec in (cfg.train, cfg.valid, cfg.test)))
    if not cfg.lowercase:
        return splits
    return data.Splits(*([(s.lower(), t.lower()) for s, t in pairs] for pairs in (splits.train, splits.valid, splits.test)))


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
        spm.save(tokenizers.src, tokenizers.tgt, run_dir, write_bytes_atomic)
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
    """The run directory's writer lock: `fcntl.flock` on DIR/.lock, exclusive and non-blocking, held
    by whoever writes the run (docs/operations.md#signals-crashes-locks). The OS releases a flock when
    its process dies, so a killed run's lock never blocks; without flock support a warning says so."""

    def __init__(self, run_dir: str | Path, created: bool = False):
        self.path = Path(run_dir) / LOCK_FILE
        self.created = created  # the directory was made for this lock: removed again if left empty
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW  # a link (in a copied run) is never followed
        try:
            self._fd = os.open(self.path, flags, 0o644)
        except OSError as err:
            if err.errno != errno.ELOOP:
                raise
            self.path.unlink()  # a symbolic link: no lock of ours, so it is replaced by a file
            self._fd = os.open(self.path, flags, 0o644)
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


# What each kind of output is called; `kind_of` recognises it. A run is what train.run can read
# (its config.json); a model directory parity.convert exports carries KIND_FILE naming its kind.
KINDS = {"run": "run", "ctranslate2": "CTranslate2 model written by parity.convert",
         "marian": "HF Marian directory written by parity.convert"}
KIND_FILE = ".aiayn.json"  # {"kind": "ctranslate2" | "marian"}


def kind_of(path: Path) -> str | None:
    """Which of `KINDS` this project wrote at `path`; None for anything else (never replaced)."""
    try:
        marker = read_json(path / KIND_FILE, None)
        if isinstance(marker, dict) and marker.get("kind") in KINDS:
            return marker["kind"]
        read_experiment(path)
        return "run"
    except (UserError, OSError):
        return None


def remove(path: Path) -> None:
    """Delete `path`, whatever it is; a symbolic link is removed, never followed."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.is_symlink() or path.exists():
        path.unlink()


def check_destination(dst: Path, overwrite: bool, kind: str = "run", src: str | Path | None = None) -> None:
    """Refuse, before any work, a destination whose replacement would lose something: the source
    `src`, a place inside it or holding it, a file or a symbolic link, a directory holding anything
    but a `kind` this project wrote (`kind_of`: even with `overwrite`), or one without
    `overwrite`. Raises FileExistsError."""
    if src is not None:
        source, target = Path(src).resolve(), dst.resolve()
        if source == target or source in target.parents or target in source.parents:
            where = "is" if source == target else "is inside" if source in target.parents else "holds"
            raise FileExistsError(f"--dst {dst} {where} the source {src}; --dst must differ from it and lie outside it")
    if dst.is_symlink():
        raise FileExistsError(f"{dst} is a symbolic link; it is never replaced, nor what it points to")
    if dst.exists() and not dst.is_dir():
        raise FileExistsError(f"{dst} is a file, not a directory; it is never replaced")
    if dst.exists() and any(dst.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{dst} exists; pass --overwrite to replace it")
        if (found := kind_of(dst)) != kind:
            held = f"holds a {KINDS[found]}, not a {KINDS[kind]}" if found else f"is not empty and holds no {KINDS[kind]}"
            raise FileExistsError(f"{dst} {held}; it is never deleted")


def swap_in(new: Path, dst: Path, old: Path) -> None:
    """Rename `new` onto `dst`: an existing `dst` is renamed to `old` first (refused, losing
    nothing, while an earlier `old` holds files) and put back if the second rename fails. The
    caller removes `old` once it is sure."""
    aside = dst.exists()
    if aside:
        os.replace(dst, old)
    try:
        os.replace(new, dst)
    except BaseException:
        if aside:
            os.replace(old, dst)
        raise


@contextlib.contextmanager
def derive(src: str | Path | None, dst: str | Path, kind: str = "run", overwrite: bool = False,
           copy: Iterable[str] = ()) -> Iterator[Path]:
    """Build `dst`, a `kind` of `KINDS`, from `src` (a run, a model directory, or None) whole or not
    at all, for average, convert, import and export: `check_destination`, then the block fills
    `.NAME.KIND` beside `dst` (yielded); the names `copy` that `src` holds (files or directories)
    are copied in, the old `dst` renamed aside, the new one into its place, and only then the old
    one removed. On any error (Ctrl-C included) `dst` is as it was. Its lock is held meanwhile (a
    run in training is never replaced)."""
    dst = Path(dst)
    check_destination(dst, overwrite, kind, src)
    guard = RunLock(dst).acquire() if dst.is_dir() else None
    tmp, old = dst.with_name(f".{dst.name}.{kind}"), dst.with_name(f".{dst.name}.{kind}-old")
    try:
        try:
            remove(tmp)
            tmp.mkdir(parents=True)
            yield tmp
            if kind != "run":
                write_json_atomic(tmp / KIND_FILE, {"kind": kind})
            for name in copy:
                if (Path(src) / name).is_dir():
                    shutil.copytree(Path(src) / name, tmp / name)
                elif (Path(src) / name).is_file():
                    shutil.copyfile(Path(src) / name, tmp / name)
            swap_in(tmp, dst, old)
        except BaseException as err:
            with contextlib.suppress(OSError):
                remove(tmp)
            # A full disk or a read-only place met while `tmp` was written is said of `dst`.
            written = Path(getattr(err, "filename", None) or tmp).absolute()
            if tmp.absolute() in (written, *written.parents) and (failed := write_error(err, dst)):
                raise failed from None
            raise
    finally:
        if guard is not None:
            guard.release()
    remove(old)


# ----------------------------------------------------------------------------------------------
# Claiming a directory for training


def read_experiment(run_dir: str | Path) -> ExperimentConfig:
    """The experiment saved in `run_dir`'s config.json (launch options at their defaults)."""
    return _read_settings(run_dir, CONFIG_FILE, _experiment)


def _experiment(saved: Mapping[str, Any]) -> ExperimentConfig:
    """A saved experiment, without the launch options that runs written before they were left out hold."""
    launch = ExperimentConfig.launch_fields()
    return ExperimentConfig.from_dict({k: v for k, v in saved.items() if k not in launch})


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


def _resumed_config(cfg: ExperimentConfig, explicit: Iterable[str] | None) -> ExperimentConfig:
    """The experiment saved in cfg.run_dir with this launch's options; an experiment field given
    again with another value is an error (it would change how the run trains)."""
    if not (Path(cfg.run_dir) / CONFIG_FILE).is_file():
        raise UserError(f"nothing to resume: {cfg.run_dir} holds no run ({CONFIG_FILE} missing)")
    saved = read_experiment(cfg.run_dir)
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
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"--run-dir {run_dir} is a file")
    if cfg.resume:
        resumed = _resumed_config(cfg, explicit)
        check_links(run_dir)
        return resumed
    if run_dir.is_dir() and any(p.name != LOCK_FILE for p in run_dir.iterdir()):
        if kind_of(run_dir) != "run":
            raise UserError(f"{run_dir} is not empty and holds no run; choose another --run-dir")
        if not cfg.overwrite:
            raise UserError(f"{run_dir} already holds a run; pass --resume to continue it or --overwrite to replace it")
        if (old := set_aside_path(run_dir)).exists() or old.is_symlink():
            raise UserError(f"{old} holds the run an earlier --overwrite of {run_dir} set aside and was stopped before "
                            f"it could put back or delete it: move it back to {run_dir}, or delete it, first")
    return cfg


def set_aside_path(run_dir: Path) -> Path:
    """Where a replacement keeps the old run meanwhile (`replacing`, `derive`)."""
    return run_dir.with_name(f".{run_dir.name}.run-old")


def has_checkpoint(run_dir: Path) -> bool:
    """Whether `run_dir` holds a complete checkpoint (both stores publish a step by renaming it to its number)."""
    checkpoints = run_dir / CHECKPOINTS
    return checkpoints.is_dir() and any(p.name.isdigit() for p in checkpoints.iterdir())


@contextlib.contextmanager
def replacing(run_dir: Path, overwrite: bool) -> Iterator[None]:
    """`train.run --overwrite` of a run, which never loses the old run to a failed new one: the old
    run's files (all but the lock this process holds) are moved beside it into `.NAME.run-old`, the
    new run trains at its own path (where --resume, translate and TensorBoard find it), and when
    the block ends, however it ends, the old run is deleted if the new one holds a checkpoint (a
    run --resume continues) and put back as it was if not."""
    if not (overwrite and (run_dir / CONFIG_FILE).is_file()):
        yield
        return
    old = set_aside_path(run_dir)
    old.mkdir()  # claim_run_dir refused one already there
    try:
        for entry in run_dir.iterdir():
            if entry.name != LOCK_FILE:
                os.rename(entry, old / entry.name)
        yield
    except BaseException:
        if not has_checkpoint(run_dir):
            for entry in run_dir.iterdir():
                if entry.name != LOCK_FILE:
                    remove(entry)
            for entry in old.iterdir():
                os.rename(entry, run_dir / entry.name)
            old.rmdir()
        raise
    finally:
        if old.exists():
            remove(old)


def check_links(run_dir: Path) -> None:
    """Refuse a run to resume whose checkpoints/, tensorboard/ or a checkpoint in it is a symbolic
    link: a run writes (and deletes its old checkpoints) only inside its own directory. Its files
    may be links: each is replaced by a rename, never written through."""
    checkpoints = run_dir / CHECKPOINTS
    steps = list(checkpoints.iterdir()) if checkpoints.is_dir() and not checkpoints.is_symlink() else []
    for part in (checkpoints, run_dir / TENSORBOARD, *steps):
        if part.is_symlink():
            raise UserError(f"{part} is a symbolic link: a run writes and deletes only inside its own directory, "
                            "never where a link points; replace the link by a copy of what it points to")


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
    return _resumed_config(cfg, explicit) if cfg.resume else cfg


def prepare_run_dir(cfg: ExperimentConfig, model_cfg: TransformerConfig, tokenizers: data.Tokenizers | None) -> None:
    """Create the run directory `claim_run_dir` accepted (an old run set aside by `replacing`) and
    write its experiment, model and (when given: newly trained) tokenizers. config.json first:
    from there on the directory holds this run."""
    run_dir = Path(cfg.run_dir)
    try:  # the recipe of --config, read before anything changes
        recipe = cfg.recipe and {"path": cfg.recipe, "toml": Path(cfg.recipe).read_text("utf-8")}
    except OSError as err:
        raise UserError(f"--config {cfg.recipe}: {err.strerror or err}") from None
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run_dir / CONFIG_FILE, cfg.experiment())
    if recipe:
        write_json_atomic(run_dir / RECIPE_FILE, recipe)
    if tokenizers is not None:
        save_tokenizers(tokenizers, run_dir)
    write_json_atomic(run_dir / MODEL_FILE, model_cfg.to_dict())


def check_model(run_dir: Path, cfg: ExperimentConfig, model_cfg: TransformerConfig, tokenizers: data.Tokenizers,
                what: str = MODEL_FILE) -> None:
    """Refuse, before a model is built, a run whose files describe different models: `model_cfg`
    (from `what`) must be the model of config.json with the tokenizers' vocabularies and that of
    each checkpoint's own saved experiment (read without a framework or the weights). A hand-edited
    size is named here instead of allocated (d_model = 2**20 would ask for terabytes first)."""
    sizes = tokenizers.src.get_vocab_size(), tokenizers.tgt.get_vocab_size()
    sources = {f"{run_dir / CONFIG_FILE} with the tokenizer": cfg}
    for step, saved in sorted(saved_experiments(run_dir / CHECKPOINTS).items()):
        try:
            sources[f"the experiment saved in checkpoint {step}"] = _experiment(saved)
        except (TypeError, ValueError):
            continue  # an older checkpoint's fields: its weights' shapes are checked when it loads
    for where, experiment in sources.items():
        rebuilt = experiment.model_config(*sizes)
        differ = [k for k, v in model_cfg.to_dict().items() if getattr(rebuilt, k) != v]
        if differ:
            raise UserError(f"{run_dir / what} says {', '.join(f'{k}={getattr(model_cfg, k)!r}' for k in differ)} "
                            f"but {where} gives {', '.join(f'{k}={getattr(rebuilt, k)!r}' for k in differ)}: the "
                            "files of the run do not describe one model (edited by hand?)")


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
    check_model(run_dir, cfg, model_cfg, tokenizers)
    initialize(cfg)  # the process's settings for its platform; this is where the reading CLIs start
    backend = create_backend(cfg, model_cfg, str(run_dir / CHECKPOINTS))
    try:
        meta = backend.restore(checkpoint)
    except (FileNotFoundError, CheckpointError) as err:
        backend.close()
        raise UserError(str(err)) from None
    return Run(run_dir, cfg, model_cfg, tokenizers, backend, meta)
