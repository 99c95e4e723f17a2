"""Every file a command writes (`Destination`), a streamed translation's output and `Progress` line."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import socket
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO, TextIO

import numpy as np

from .. import data
from .files import UserError, check_replaceable, read_json, write_bytes_atomic, write_error, write_json_atomic
from .replace import check_outside_runs

# A descriptor this process holds: `>(cmd)`, `3>file`, /dev/stdout; written through a copy of it.
_DESCRIPTOR = re.compile(r"/(?:dev|proc/self)/fd/(\d+)|/dev/std(out|err)")


def is_stream(path: Path) -> bool:
    """Whether `path` is a stream (a descriptor, or through links a FIFO, device, socket): never renamed over."""
    if _DESCRIPTOR.fullmatch(str(path)):
        return True
    try:
        mode = os.stat(path).st_mode
    except OSError:  # missing: a file to create
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def open_stream(path: Path) -> TextIO:
    """An `is_stream` output opened for writing text: a descriptor duplicated, a socket connected."""
    if match := _DESCRIPTOR.fullmatch(str(path)):
        return os.fdopen(os.dup(int(match[1]) if match[1] else {"out": 1, "err": 2}[match[2]]), "w", encoding="utf-8")
    if stat.S_ISSOCK(os.stat(path).st_mode):
        client = socket.socket(socket.AF_UNIX)
        client.connect(str(path))
        return client.makefile("w", encoding="utf-8")
    return open(path, "w", encoding="utf-8")  # a FIFO or a device; the caller closes it


class Destination:
    """A file a command writes, checked before the work (docs/operations.md#output-files): a stream is written
    directly, a link followed (as by the shell's `>`), a file replaced whole. UserError naming `flag`: a directory,
    a missing or read-only directory, a file of `inputs` (side files too), a place inside a run or an export."""

    def __init__(self, path: str | Path, flag: str, inputs: Iterable[str | Path] = (), of: str = ""):
        self.path, self.target = Path(path), None
        if is_stream(self.path):
            return
        try:
            target = self.path.resolve()
        except (RuntimeError, OSError):  # RuntimeError: Python 3.11's word for a loop
            raise UserError(f"{flag} {path}: a loop of symbolic links; give a file name") from None
        if target.is_dir():
            raise UserError(f"{flag} {path} is a directory; give a file name")
        if str(path).endswith(os.sep):  # as the shell's `>`, a file is never made or replaced at `name/`
            raise UserError(f"{flag} {path}: the trailing {os.sep} names a directory, and there is none; give a "
                            "file name")
        if not target.parent.is_dir():
            raise UserError(f"{flag} {path}: directory {target.parent} does not exist")
        if not os.access(target.parent, os.W_OK):
            raise UserError(f"{flag} {path}: directory {target.parent} is not writable")
        check_outside_runs(target, flag)
        self.target = target
        longest = max(len(os.fsencode(side.name)) for side in self.side_files)
        if longest > (room := os.pathconf(target.parent, "PC_NAME_MAX")):  # else it fails after the work
            raise UserError(f"{flag} {path}: the name leaves no room for the files written beside it meanwhile "
                            f"(.NAME.partial.json: {longest} bytes, {room} at most); give a shorter name")
        if any(os.path.exists(f) and os.path.exists(side) and os.path.samefile(f, side)
               for f in inputs for side in self.side_files):
            raise UserError(f"{flag} {path} is a file of {of}: writing it would destroy the data (or a file "
                            f"written beside it); give another {flag}")

    @property
    def side_files(self) -> tuple[Path, ...]:
        """The file and what is written beside it meanwhile (`PartialOutput`, write_bytes_atomic)."""
        t = self.target
        return () if t is None else (t, *(t.with_name(f".{t.name}{s}") for s in (".partial", ".partial.json", ".tmp")))

    def write(self, text: str | bytes) -> None:
        """`text` as the whole output: a regular file replaced atomically, a stream written directly."""
        data = text.encode("utf-8") if isinstance(text, str) else text
        if self.target is not None:
            return write_bytes_atomic(self.target, data)
        with open_stream(self.path) as stream:
            stream.flush()
            stream.buffer.write(data)

    def update(self, text: str) -> None:
        """An intermediate whole output (kept should the command be stopped): a regular file only."""
        if self.target is not None:
            self.write(text)

    @contextlib.contextmanager
    def writing(self) -> Iterator[Path]:
        """A path (same suffix) for a library to save to (a plot), written as `write` does if the block succeeds."""
        with tempfile.TemporaryDirectory(prefix="aiayn-") as tmp:
            path = Path(tmp) / f"output{self.path.suffix}"
            yield path
            self.write(path.read_bytes())


class OtherInput(UserError):
    """A partial output that translates other input lines than these."""


class StreamOutput:
    """Translations to a text stream (standard output, a FIFO, a device), flushed after every chunk; no resume."""

    digest, note = None, None

    def __init__(self, stream=None):
        self.stream, self.done = stream, 0

    def write(self, texts: Sequence[str], digest: str) -> None:
        stream = self.stream or sys.stdout
        stream.write("".join(t + "\n" for t in texts))
        stream.flush()
        self.done += len(texts)

    def finish(self) -> None:
        pass

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()


class PartialOutput:
    """--output F grown as `.F.partial` (flock'ed) one synced chunk at a time, each recorded in `.F.partial.json`
    (lines, bytes, the input's SHA-256, the settings), renamed onto F at the end; run again, it continues."""

    def __init__(self, path: Path, settings: dict[str, Any]):
        self.path, self.settings = path, settings
        self.partial = path.with_name(f".{path.name}.partial")
        self.record = path.with_name(f".{path.name}.partial.json")
        self.done, self.bytes, self.digest, self.note, self._started = 0, 0, None, None, False
        self._created = not self.partial.is_file()
        self._file = _locked(self.partial, f"{path} is being written by another translation (it holds "
                                           f"{self.partial}); wait for it to end or give another --output")
        state = None
        with contextlib.suppress(UserError):  # an unreadable record: starting afresh
            state = read_json(self.record, default=None)
        if not isinstance(state, dict) or self._created:
            return
        saved = state.get("settings")
        if saved != settings:
            differ = ", ".join(k for k in settings if not isinstance(saved, dict) or saved.get(k) != settings[k])
            self.note = f"note: {self.partial} was translated with other settings ({differ}); starting afresh"
        elif self.partial.stat().st_size < state.get("bytes", -1):
            self.note = f"note: {self.partial} is shorter than its record; starting afresh"
        else:
            self.done, self.bytes, self.digest = int(state["lines"]), int(state["bytes"]), state["input_sha256"]

    def write(self, texts: Sequence[str], digest: str) -> None:
        if not self._started:  # the first finished chunk drops what is not recorded (or of other settings)
            self._started = True
            self._file.truncate(self.bytes)
            self._file.seek(self.bytes)
        chunk = "".join(t + "\n" for t in texts).encode("utf-8")
        try:
            self._file.write(chunk)
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as err:  # a full disk: said of the file (the chunks before it stay, as recorded)
            raise write_error(err, self.partial) or err from None
        self.done, self.bytes, self.digest = self.done + len(texts), self.bytes + len(chunk), digest
        write_json_atomic(self.record, {"settings": self.settings, "lines": self.done, "bytes": self.bytes,
                                        "input_sha256": digest})

    def finish(self) -> None:
        """Rename the whole output onto F (an input whose every line was already done: as it is)."""
        if not self._started:
            self.write([], self.digest or "")
        check_replaceable(self.path)
        os.replace(self.partial, self.path)  # under the lock: no second translation takes the renamed file
        self.record.unlink(missing_ok=True)
        self._file.close()

    def close(self) -> None:
        """Release the lock; a partial file this run created and never wrote is removed."""
        if not self._file.closed:
            if self._created and not self._started:
                self.partial.unlink(missing_ok=True)
            self._file.close()

    def kept(self) -> str:
        """Where the finished chunks are, for the message of an interrupted or failed run."""
        return (f"the translations of lines 1-{self.done:,} are kept in {self.partial}: "
                "the same command continues after them")


def _locked(path: Path, busy: str) -> BinaryIO:
    """`path` opened read-write (created if missing) under an exclusive flock; UserError `busy` while it is held."""
    while True:
        file = open(os.open(path, os.O_RDWR | os.O_CREAT, 0o644), "r+b")  # noqa: SIM115 (the caller closes it)
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.close()
            raise UserError(busy) from None
        except OSError:  # a filesystem without flock: unprotected, as a run there is
            return file
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(file.fileno()), os.stat(path)):
                return file
        file.close()  # renamed onto its output by the translation that held it: open the new one


class Progress:
    """Counts and, on a terminal, a progress line rewritten in place (lines/s, tokens/s, ETA); `summary()`."""

    INTERVAL = 0.5  # seconds between two progress lines

    def __init__(self, show: bool, fraction: Callable[[], float | None]):
        self.show, self.fraction = show, fraction
        self.start = self._shown = time.perf_counter()
        self.lines = self.tokens = 0
        self._fraction0 = None

    def on_batch(self, index: np.ndarray, src: np.ndarray, tokens: np.ndarray) -> None:
        rows = index >= 0
        self.lines += int(rows.sum())
        self.tokens += int((tokens[rows] != data.PAD_ID).sum())
        now = time.perf_counter()
        if self.show and now - self._shown >= self.INTERVAL:
            self._shown = now
            print(f"\r{self.status()}\x1b[K", end="", file=sys.stderr, flush=True)

    def begin(self) -> None:
        """Translation starts now (after any lines skipped on a resume): rates and ETA count from here."""
        self.start = time.perf_counter()
        self._fraction0 = self.fraction()

    def rates(self) -> tuple[float, str]:
        """Seconds since `begin`, and the rates as text."""
        seconds = max(time.perf_counter() - self.start, 1e-9)
        return seconds, f"{self.lines / seconds:,.1f} lines/s, {self.tokens / seconds:,.0f} target tokens/s"

    def status(self) -> str:
        seconds, rates = self.rates()
        text = f"{self.lines:,} lines, {rates}"
        fraction = self.fraction()
        if fraction is not None and self._fraction0 is not None and fraction > self._fraction0:
            left = seconds * (1 - fraction) / (fraction - self._fraction0)
            text += f", {100 * fraction:.0f}% read, ETA {int(left) // 60}:{int(left) % 60:02d}"
        return text

    def clear(self) -> None:
        if self.show:
            print("\r\x1b[K", end="", file=sys.stderr, flush=True)

    def summary(self) -> str:
        seconds, rates = self.rates()
        return f"translated {self.lines:,} lines in {seconds:.1f} s: {rates}"
