"""One writer per run directory: an flock on DIR/.lock."""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import socket
from pathlib import Path

from .files import UserError, say
from .layout import LOCK_FILE


class RunLock:
    """The run's writer lock: an exclusive flock on DIR/.lock, which the OS releases when its process dies."""

    def __init__(self, run_dir: str | Path, created: bool = False):
        self.path = Path(run_dir) / LOCK_FILE
        self.created = created  # the directory was made for this lock: removed again if left empty
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        if self.path.is_symlink():  # a link (in a copied run) is no lock of ours: replaced by a file, never followed
            self.path.unlink()
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
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
        """Unlock; a directory made for the lock and holding nothing else is removed (a failed run leaves nothing)."""
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

