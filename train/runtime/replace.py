"""Building a directory whole or not at all (`derive`), and what it refuses to replace (`check_destination`)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from .files import OptionError, UserError, read_json, write_error, write_json_atomic
from .layout import read_experiment
from .lock import RunLock

# What `kind_of` recognises: a run (its config.json), or an export of aiayn convert (KIND_FILE names it).
KINDS = {"run": "run", "ctranslate2": "CTranslate2 model written by aiayn convert",
         "marian": "HF Marian directory written by aiayn convert", "onnx": "ONNX model written by aiayn convert",
         "stablehlo": "StableHLO model written by aiayn convert"}
PROGRAM_KINDS = ("onnx", "stablehlo")  # exports that translate and serve as a run does (train.interop.exported)
KIND_FILE = ".aiayn.json"  # {"kind": one of KINDS but "run"}
PROOF_FILE = "proof.json"  # what an export computes against its run, and its files' digests (parity.proof)


def export_digests(directory: Path, names: Iterable[str] | None = None) -> dict[str, str]:
    """SHA-256 of each file `names` (default: an export's but its proof, README.md, marker); None if missing."""
    directory = Path(directory)
    if names is None:
        names = [str(f.relative_to(directory)) for f in sorted(directory.rglob("*"))
                 if f.is_file() and f.name not in (PROOF_FILE, "README.md", KIND_FILE)]
    return {n: hashlib.sha256((directory / n).read_bytes()).hexdigest() if (directory / n).is_file() else None
            for n in names}


def check_export(directory: str | Path) -> None:
    """UserError when a file whose digest `directory`'s proof.json records differs or is missing: the proof is stale."""
    recorded = (read_json(Path(directory) / PROOF_FILE, None) or {}).get("files")
    if recorded is not None and (found := export_digests(Path(directory), recorded)) != recorded:
        changed = sorted(n for n in recorded if recorded[n] != found[n])
        raise UserError(f"{directory}: {', '.join(changed)} changed since its {PROOF_FILE} was written (the digests "
                        "differ): export it again")


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


def check_outside_runs(path: str | Path, name: str) -> None:
    """OptionError naming parameter `name` when `path` (links resolved) lies inside a run or an export."""
    for parent in Path(path).resolve().parents:
        if found := kind_of(parent):
            raise OptionError("{} {path} lies inside the {kind} {parent}: a command never writes into a run it did not "
                              "create; give a path outside it", name, path=path, kind=KINDS[found], parent=parent)


def remove(path: Path) -> None:
    """Delete `path`, whatever it is; a symbolic link is removed, never followed."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


class DestinationError(OptionError, FileExistsError):
    """A destination `check_destination` refuses, naming its parameters."""


def check_destination(dst: Path, overwrite: bool, kind: str = "run", src: str | Path | None = None) -> None:
    """DestinationError (a FileExistsError) for a destination whose replacement would lose something: `src`, a file,
    a link, anything but a `kind` this project wrote, or anything without `overwrite`."""
    if src is not None:
        source, target = Path(src).resolve(), dst.resolve()
        if source == target or source in target.parents or target in source.parents:
            where = "is" if source == target else "is inside" if source in target.parents else "holds"
            raise DestinationError("{} {dst} {where} the source {src}; {} must differ from it and lie outside it",
                                   "dst", "dst", dst=dst, where=where, src=src)
    check_outside_runs(dst, "dst")
    if dst.is_symlink():
        raise FileExistsError(f"{dst} is a symbolic link; it is never replaced, nor what it points to")
    if dst.exists() and not dst.is_dir():
        raise FileExistsError(f"{dst} is a file, not a directory; it is never replaced")
    if dst.exists() and any(dst.iterdir()):
        if not overwrite:
            raise DestinationError("{dst} exists; pass {} to replace it", "overwrite", dst=dst)
        if (found := kind_of(dst)) != kind:
            held = (f"holds a {KINDS[found]}, not a {KINDS[kind]}" if found
                    else f"is not empty and holds no {KINDS[kind]}")
            raise FileExistsError(f"{dst} {held}; it is never deleted")


def swap_in(new: Path, dst: Path, old: Path) -> None:
    """Rename `new` onto `dst`, an existing `dst` to `old` first (put back if that fails); the caller removes `old`."""
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
           copy: Iterable[str] = (), check: Callable[[Path], object] | None = None) -> Iterator[Path]:
    """Build `dst` from `src` whole or not at all, under its lock, in `.NAME.KIND` (yielded), then `swap_in`."""
    dst = Path(dst)
    check_destination(dst, overwrite, kind, src)
    tmp, old = dst.with_name(f".{dst.name}.{kind}"), dst.with_name(f".{dst.name}.{kind}-old")
    with RunLock(dst) if dst.is_dir() else contextlib.nullcontext():
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
            if check is not None:
                check(tmp)
            swap_in(tmp, dst, old)
        except BaseException as err:
            with contextlib.suppress(OSError):
                remove(tmp)
            # A full disk or a read-only place met while `tmp` was written is said of `dst`.
            written = Path(getattr(err, "filename", None) or tmp).absolute()
            if tmp.absolute() in (written, *written.parents) and (failed := write_error(err, dst)):
                raise failed from None
            raise
    remove(old)
