"""Checkpoints, framework-neutral: `TrainingState`, choosing a step, digests, and `CheckpointStore`."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import numbers
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..runtime.files import UserError, shortened, write_error, write_json_atomic

# The safetensors metadata key holding the TransformerConfig JSON, in weights files and checkpoints.
WEIGHTS_CONFIG_KEY = "transformer_config"


@dataclasses.dataclass
class TrainingState:
    """One backend's training state as NumPy arrays by attribute path in `framework`'s layout."""

    framework: str
    step: int
    params: dict[str, np.ndarray]
    mu: dict[str, np.ndarray] | None = None  # Adam's moments: None before an update
    nu: dict[str, np.ndarray] | None = None
    rng: np.ndarray | None = None  # the framework's random state: None once converted

    def check(self, framework: str | None = None) -> None:
        """Both moments or neither, with the parameters' keys, shapes and dtypes; of `framework`'s layout if given."""
        if framework is not None and self.framework != framework:
            raise ValueError(f"a {self.framework} training state: convert it to {framework}'s layout first "
                             "(aiayn convert)")
        if (self.mu is None) != (self.nu is None):
            raise ValueError("Adam state holds only one of its two moments")
        if self.mu is None and self.step != 0:
            raise ValueError(f"Adam state is empty but the step is {self.step}: the moments are missing")
        for name, moments in (("Adam first moments (mu / exp_avg)", self.mu),
                              ("Adam second moments (nu / exp_avg_sq)", self.nu)):
            if moments is not None:
                check_arrays(name, self.params, moments, of="parameter")

    def differences(self, other: TrainingState) -> list[str]:
        """What differs from `other`, bit for bit (empty: identical; the random state not compared)."""
        out = [f"{name} {a} != {b}" for name in ("framework", "step")
               if (a := getattr(self, name)) != (b := getattr(other, name))]
        for name in ("params", "mu", "nu"):
            x, y = getattr(self, name), getattr(other, name)
            if (x is None) != (y is None):
                out.append(f"{name}: one side empty")
            elif x is not None and x.keys() != y.keys():
                out.append(f"{name}: keys differ")
            elif x is not None:
                out += [f"{name}.{k}" for k in x if x[k].dtype != y[k].dtype or not np.array_equal(x[k], y[k])]
        return out


class CheckpointMismatchError(ValueError):
    """Weights that do not fit the architecture: lists every offending key with both shapes."""

    def __init__(self, what: str, missing=(), unexpected=(), wrong_shape=()):
        self.missing, self.unexpected, self.wrong_shape = list(missing), list(unexpected), list(wrong_shape)
        lines = [f"{what} do not match the architecture:"]
        lines += [f"  missing     {k}  expected {tuple(s)}" for k, s in self.missing]
        lines += [f"  unexpected  {k}  got {tuple(s)}" for k, s in self.unexpected]
        lines += [f"  wrong shape {k}  expected {tuple(e)}, got {tuple(g)}" for k, e, g in self.wrong_shape]
        super().__init__("\n".join(lines))


def check_keys(what: str, expected: Mapping[str, tuple], got: Mapping[str, tuple]) -> None:
    """CheckpointMismatchError unless `got` has exactly the keys and shapes of `expected`."""
    missing = [(k, expected[k]) for k in expected if k not in got]
    unexpected = [(k, got[k]) for k in got if k not in expected]
    wrong = [(k, expected[k], got[k]) for k in expected if k in got and tuple(got[k]) != tuple(expected[k])]
    if missing or unexpected or wrong:
        raise CheckpointMismatchError(what, missing, unexpected, wrong)


def check_arrays(what: str, expected: Mapping[str, Any], got: Mapping[str, Any], of: str = "target") -> None:
    """`check_keys` of the shapes, then ValueError naming each of `got` of another dtype than its `of` in `expected`."""
    check_keys(what, {k: np.shape(v) for k, v in expected.items()}, {k: np.shape(v) for k, v in got.items()})
    if wrong := [f"{k}: {np.dtype(got[k].dtype)}, {of} {np.dtype(v.dtype)}" for k, v in expected.items()
                 if np.dtype(v.dtype) != np.dtype(got[k].dtype)]:
        raise ValueError(f"{what} have other dtypes than their {of}s:\n  " + "\n  ".join(wrong))


class CheckpointError(Exception):
    """A checkpoint on disk that cannot be restored: truncated, corrupted, or of another model."""


def unreadable(directory, step: int, steps: Sequence[int], err: BaseException) -> CheckpointError:
    """The CheckpointError of checkpoint `step` failing with `err`, naming the other `steps` as the way out."""
    others = [s for s in steps if s != step]
    hint = "it is the only one there"
    if others:
        hint = (f"the other checkpoints there are steps {others}: pick one with --checkpoint STEP (translate, "
                f"evaluate), or delete {step}/ so that --resume continues from the newest one left")
    reason = " ".join(str(err).split()).split(" See full")[0]  # TensorStore appends pages of its spec
    reason = f"{type(err).__name__}: {shortened(reason, 300)}"
    return CheckpointError(f"checkpoint {step} in {directory} cannot be restored ({reason}); {hint}")


def choose_checkpoint(steps: Sequence[int], which: str | int, metrics: Callable[[int], Mapping | None], where) -> int:
    """The step `which` ("latest", "best" by BLEU, or a number) names among `steps`; FileNotFoundError if none."""
    if not steps:
        raise FileNotFoundError(f"no checkpoint in {where}")
    if which == "latest":
        return steps[-1]
    if which == "best":
        ranked = [(m["bleu"], step) for step in steps if (m := metrics(step)) is not None and "bleu" in m]
        return max(ranked)[1] if ranked else steps[-1]
    step = int(which)
    if step not in steps:
        raise FileNotFoundError(f"no checkpoint of step {step} in {where} (have {list(steps)})")
    return step


ROTATION_RETRIES = 10  # how often "latest" or "best" is chosen again while a run beside the reader rotates


def saved_experiments(directory: str | os.PathLike) -> dict[int, dict]:
    """Each checkpoint's saved experiment by step, read from its meta without a framework (none: left out)."""
    found = {}
    for step_dir in Path(directory).glob("[0-9]*"):
        for name, key in (("meta.json", "meta"), ("meta/metadata", None)):
            try:
                meta = json.loads((step_dir / name).read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            meta = meta.get(key) if key and isinstance(meta, dict) else meta
            if step_dir.name.isdigit() and isinstance(meta, dict) and isinstance(meta.get("config"), dict):
                found[int(step_dir.name)] = meta["config"]
    return found


def parse_checkpoint(which: str | int) -> str | int:
    """'best', 'latest' or a step number (as int); UserError for anything else."""
    step = isinstance(which, numbers.Integral) and not isinstance(which, bool)  # np.int64 too; True is no step
    if step or (isinstance(which, str) and which.isdigit()):
        return int(which)
    if which not in ("best", "latest"):
        raise UserError(f"checkpoint must be 'best', 'latest' or a step number, got {which!r}")
    return which


DIGEST_FILE = "digest.json"  # in each checkpoint directory: {"algorithm", "files": {path: hex}}
DIGEST_ALGORITHM = "sha256"  # hashlib's, OpenSSL-accelerated


class CheckpointDamaged(ValueError):
    """A checkpoint file that does not match the digest written with it, or is missing."""


def write_checkpoint_digest(directory: str | Path) -> None:
    """Hash every file of the checkpoint `directory` (syncing it) into its digest.json, before it is published."""
    directory = Path(directory)
    files = {}
    for path in sorted(directory.rglob("*")):
        if not path.is_file() or path.name == DIGEST_FILE or path.name.startswith(f".{DIGEST_FILE}"):
            continue
        with open(path, "rb") as f:
            os.fsync(f.fileno())
            files[path.relative_to(directory).as_posix()] = hashlib.file_digest(f, DIGEST_ALGORITHM).hexdigest()
    write_json_atomic(directory / DIGEST_FILE, {"algorithm": DIGEST_ALGORITHM, "files": files})


def verify_checkpoint(directory: str | Path) -> bool:
    """CheckpointDamaged naming the first file unlike its digest.json (or missing); False without digest.json."""
    directory = Path(directory)
    try:
        record = json.loads((directory / DIGEST_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return False
    except (OSError, ValueError) as err:
        raise CheckpointDamaged(f"{DIGEST_FILE} is unreadable ({err})") from None
    files = record.get("files") if isinstance(record, dict) else None
    if not isinstance(files, dict) or record.get("algorithm") != DIGEST_ALGORITHM:
        raise CheckpointDamaged(f"{DIGEST_FILE} is not a {DIGEST_ALGORITHM} digest of the checkpoint")
    for name, expected in sorted(files.items()):
        path = directory / name
        if not path.is_file():
            raise CheckpointDamaged(f"{name} is missing")
        with open(path, "rb") as f:
            if hashlib.file_digest(f, DIGEST_ALGORITHM).hexdigest() != expected:
                raise CheckpointDamaged(f"{name} does not match the {DIGEST_ALGORITHM} digest written with it")
    return True


class CheckpointStore:
    """What the framework's stores share: CHECKPOINTS/<step>/ in `directory`, the newest `keep` and the best kept."""

    read_errors: tuple[type[BaseException], ...] = (Exception,)  # what `load` raises for a bad checkpoint
    write_errors: tuple[type[BaseException], ...] = (OSError,)  # what `save` raises for a full or read-only disk

    def __init__(self, directory: str | os.PathLike | None, keep: int):
        self.directory = None if directory is None else Path(directory)
        self.keep = keep

    def root(self) -> Path:
        if self.directory is None:
            raise ValueError("this backend was created without a checkpoint directory")
        return self.directory

    def path(self, step: int) -> Path:
        return self.root() / str(step)

    def restore(self, which: str | int, *args: Any) -> Any:
        """`load(step, *args)` of the checkpoint `which` names, digest verified; retried while a run rotates them."""
        for attempt in range(ROTATION_RETRIES + 1):
            steps, step = self.steps(), None
            try:
                step = choose_checkpoint(steps, which, self.metrics, self.directory)
                verify_checkpoint(self.path(step))  # before a byte is read: a damaged file is named
                loaded = self.load(step, *args)
            except (*self.read_errors, CheckpointError) as err:
                if which in ("latest", "best") and attempt < ROTATION_RETRIES and self.steps() != steps:
                    continue  # rotated away while it was read: not damaged
                if step is None or isinstance(err, CheckpointError):
                    raise
                raise unreadable(self.directory, step, steps, err) from err
            if attempt:
                print(f"checkpoint steps in {self.directory} changed while reading (a run is saving there): "
                      f"read step {step}, the {which} now", file=sys.stderr)
            return loaded

    @contextlib.contextmanager
    def saving(self, step: int):
        """A failed save of `step` (a full disk, no permission) as one OSError naming it, its leftovers removed."""
        try:
            yield
        except self.write_errors as err:
            with contextlib.suppress(OSError):
                self.discard(step)
            if (failed := write_error(err, self.path(step))) is None:
                raise
            raise failed from None

    def discard(self, step: int) -> None:
        """Remove what a failed save of `step` left behind."""

    def close(self) -> None:
        """Finish pending writes."""
