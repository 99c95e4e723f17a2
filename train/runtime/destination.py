"""Every file a command writes (`Destination`): checked before the work, then written whole or streamed."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import stat
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TextIO

from .files import OptionError, write_bytes_atomic
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
    directly, a link followed (as by the shell's `>`), a file replaced whole. OptionError naming parameter `name`: a
    directory, a missing or read-only directory, a file of `inputs` (`of`; side files too), a place inside a run or an
    export."""

    def __init__(self, path: str | Path, name: str, inputs: Iterable[str | Path] = (), of: str = ""):
        self.path, self.target = Path(path), None
        if is_stream(self.path):
            return
        try:
            target = self.path.resolve()
        except (RuntimeError, OSError):  # RuntimeError: Python 3.11's word for a loop
            raise OptionError("{} {path}: a loop of symbolic links; give a file name", name, path=path) from None
        if target.is_dir():
            raise OptionError("{} {path} is a directory; give a file name", name, path=path)
        if str(path).endswith(os.sep):  # as the shell's `>`, a file is never made or replaced at `name/`
            raise OptionError("{} {path}: the trailing {sep} names a directory, and there is none; give a file name",
                              name, path=path, sep=os.sep)
        if not target.parent.is_dir():
            raise OptionError("{} {path}: directory {dir} does not exist", name, path=path, dir=target.parent)
        if not os.access(target.parent, os.W_OK):
            raise OptionError("{} {path}: directory {dir} is not writable", name, path=path, dir=target.parent)
        check_outside_runs(target, name)
        self.target = target
        longest = max(len(os.fsencode(side.name)) for side in self.side_files)
        if longest > (room := os.pathconf(target.parent, "PC_NAME_MAX")):  # else it fails after the work
            raise OptionError("{} {path}: the name leaves no room for the files written beside it meanwhile "
                              "(.NAME.partial.json: {longest} bytes, {room} at most); give a shorter name", name,
                              path=path, longest=longest, room=room)
        if any(os.path.exists(f) and os.path.exists(side) and os.path.samefile(f, side)
               for f in inputs for side in self.side_files):
            raise OptionError("{} {path} is a file of {of}: writing it would destroy the data (or a file written "
                              "beside it); give another {}", name, name, path=path, of=of)

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
