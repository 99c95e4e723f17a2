"""`LineReader`: the lines of a file (plain or .gz), a FIFO, a process substitution or standard input,
one at a time, by the rule of `corpora.split_lines`; a line over `max_bytes` is refused by number, not
read whole (`< /dev/zero` ends in one error, not a MemoryError). Every problem is a UserError naming the input.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import stat
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path

from ..runtime.files import OptionError, UserError

MAX_LINE_BYTES = 1 << 20  # 1 MiB: far beyond any sentence, far below a machine's memory


class LineReader(Iterator[str]):
    """Iterate over the lines (str) of `path`, or of standard input when it is None; `lines` counts them."""

    def __init__(self, path: Path | None, max_bytes: int = MAX_LINE_BYTES, name: str = "input"):
        self.name = "standard input" if path is None else str(path)
        self.max_bytes, self.lines, self.offset, self._size = max_bytes, 0, 0, None
        if path is None:
            self._raw = self._stream = sys.stdin.buffer
            return
        if path.is_dir():
            raise OptionError("{} {path} is a directory; give a file (one sentence per line)", name, path=path)
        try:
            self._raw = open(path, "rb")  # noqa: SIM115 (closed by close())
        except FileNotFoundError:
            raise UserError(f"no such file: {path}") from None
        except OSError as err:
            raise UserError(f"cannot read {path}: {err.strerror or err}") from None
        info = os.fstat(self._raw.fileno())
        self._size = info.st_size if stat.S_ISREG(info.st_mode) else None
        self._stream = gzip.GzipFile(fileobj=self._raw) if path.suffix == ".gz" else self._raw

    def fraction(self) -> float | None:
        """The part of a regular file read so far (of its compressed bytes for .gz), else None."""
        return min(1.0, self._raw.tell() / self._size) if self._size else None

    def __next__(self) -> str:
        try:
            raw = self._stream.readline(self.max_bytes + 1)
        except (OSError, EOFError, zlib.error) as err:  # unreadable, or a truncated/corrupt .gz
            raise UserError(f"cannot read {self.name}: {getattr(err, 'strerror', None) or err}") from None
        if not raw:
            raise StopIteration
        self.lines += 1
        if len(raw) > self.max_bytes and not raw.endswith(b"\n"):
            raise OptionError("{file}: line {n} is longer than {max:,} bytes ({})", "max_line_bytes", file=self.name,
                              n=self.lines, max=self.max_bytes)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise UserError(f"{self.name}: invalid UTF-8 at byte offset {self.offset + err.start} "
                            f"(line {self.lines}): {err.reason}") from None
        self.offset += len(raw)
        return text.removesuffix("\n").removesuffix("\r")

    def same_file(self, path: Path) -> bool:
        """Whether `path` names the file read here (by any name: a link, a hard link, a redirection)."""
        try:
            return os.path.samestat(os.fstat(self._raw.fileno()), os.stat(path))
        except (OSError, ValueError):  # no such file; an input without a descriptor
            return False

    def close(self) -> None:
        if self._raw is not sys.stdin.buffer:
            self._raw.close()


def read_lines(path: Path | None, max_line_bytes: int = MAX_LINE_BYTES) -> list[str]:
    """Every line of a file, any readable stream, or stdin when `path` is None (`LineReader`), so that
    output line N is input line N; any problem raises UserError naming the input."""
    with contextlib.closing(LineReader(path, max_line_bytes)) as reader:
        return list(reader)
