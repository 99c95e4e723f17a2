"""A streamed translation's output (stdout, a stream, or a resumable file) and its `Progress` line."""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from .. import data
from ..runtime.files import UserError, check_replaceable, read_json, write_error, write_json_atomic


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
    """--output F grown as `.F.partial` a synced chunk at a time (`.F.partial.json`), renamed onto F; resumable."""

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
