"""Writing files whole, strict JSON, and the one error users see without a traceback."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch_reference.config import SettingError


class UserError(Exception):
    """A problem with the flags, files or run directory the user gave: reported without a traceback."""


class OptionError(UserError, SettingError):
    """A UserError naming parameters (`SettingError`): `run_dir` in Python, `--run-dir` on the command line."""


@contextlib.contextmanager
def user_errors(*kinds: type[Exception]) -> Iterator[None]:
    """Within the block an error of `kinds` becomes a UserError of its message (an OptionError, naming parameters)."""
    try:
        yield
    except kinds as err:
        if isinstance(err, SettingError):
            raise OptionError(err.template, *err.names, **err.values) from None
        raise UserError(str(err)) from None


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Write `data` beside `path`, synced, and rename it into place; an OSError naming `path` on failure."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        check_replaceable(path)
        tmp.unlink(missing_ok=True)  # a leftover, or a link planted there: removed, never followed
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:
        raise OSError(err.errno, err.strerror, str(path)) from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def check_replaceable(path: Path) -> None:
    """OSError unless `path` is missing, a file or a link: a rename never replaces a device (`--output /dev/null`)."""
    with contextlib.suppress(FileNotFoundError):
        if not (stat.S_ISREG(mode := os.lstat(path).st_mode) or stat.S_ISLNK(mode)):
            raise OSError(errno.EEXIST, "not a regular file, so never replaced by one", str(path))


def write_text_atomic(path: str | Path, text: str) -> None:
    """`write_bytes_atomic` of `text` in UTF-8."""
    write_bytes_atomic(path, text.encode("utf-8"))


WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)  # full, read-only, forbidden


def write_error(err: BaseException, path: str | Path) -> OSError | None:
    """`err` as an OSError naming `path` when it says a full disk, a read-only place or no permission; else None."""
    code = err.errno if isinstance(err, OSError) and err.errno in WRITE_ERRNOS else next(
        (code for code in WRITE_ERRNOS if os.strerror(code) in str(err)), None)
    return None if code is None else OSError(code, os.strerror(code), str(path))


def error_text(err: BaseException) -> str:
    """A CLI's one `error: ` line: an OSError as `PATH: CAUSE` (a full disk, ...), any other error its message."""
    if isinstance(err, OSError) and err.strerror:
        return f"{err.filename}: {err.strerror}" if err.filename else err.strerror
    return str(err)


def finite_values(obj: Any) -> Any:
    """`obj` with every non-finite float (NaN, ±Infinity: not JSON) replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_values(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_values(v) for v in obj]
    return obj


def json_text(obj: Any) -> str:
    """Strict JSON of `obj`: a non-finite number null, a byte that was not UTF-8 (surrogateescape) a \\uDCxx escape."""
    text = json.dumps(finite_values(obj), indent=2, ensure_ascii=False, allow_nan=False)
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def write_json_atomic(path: str | Path, obj: Any) -> None:
    write_text_atomic(path, json_text(obj) + "\n")


def read_json(path: str | Path, default: Any = ...) -> Any:
    """The JSON in `path`; UserError naming the file for invalid JSON, or when missing without a `default`."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if default is not ...:
            return default
        raise UserError(f"no such file: {path}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"cannot read {path}: {err}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise UserError(f"{path} is not valid JSON: {err.msg} at line {err.lineno} column {err.colno}") from None


def shortened(text: str, limit: int = 200) -> str:
    """`text` cut to `limit` characters: a message never holds a whole line of a user's file."""
    return text if len(text) <= limit else text[:limit] + "..."


def quoted(value: Any, limit: int = 60) -> str:
    """repr(value) as a short escaped prefix (`shortened`), for user-supplied text in a message."""
    return shortened(repr(value[: limit + 1] if isinstance(value, (str, bytes)) else value), limit)


def say(text: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(text, file=sys.stdout)
