"""SIGTERM and SIGINT: training stops with a checkpoint, translation between operations; `exit_status`."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from .files import UserError, error_text, say


class Interrupted(Exception):
    """SIGTERM or Ctrl-C (SIGINT) stopped the work; `signum` says which."""

    def __init__(self, signum: int, message: str | None = None):
        super().__init__(message or signal.Signals(signum).name)
        self.signum = signum


def exit_status(main: Callable[..., int | None], *args: Any, **kwargs: Any) -> int:
    """`main(*args, **kwargs)`'s exit status, every command's: a UserError, OSError or ValueError one
    line `error: ...` and 1; a stop (SIGTERM, Ctrl-C) one line and 128 + the signal; never a traceback."""
    try:
        status = main(*args, **kwargs)
        return status if isinstance(status, int) else 0  # a job's result (None, a dict): done
    except (UserError, OSError, ValueError) as err:  # OSError: a full disk, a read-only place, no permission
        print(f"error: {error_text(err)}", file=sys.stderr)
        return 1
    except Interrupted as err:
        print(err if str(err) != signal.Signals(err.signum).name else f"interrupted ({err})", file=sys.stderr)
        return 128 + err.signum
    except KeyboardInterrupt:
        print(f"interrupted ({Interrupted(signal.SIGINT)})", file=sys.stderr)
        return 128 + signal.SIGINT


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Within the block SIGTERM and SIGINT raise `Interrupted` (main thread only; elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Interrupted(signum)

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


class StopSignals:
    """SIGTERM and Ctrl-C ask the loop to stop (`requested`) with a checkpoint, a second at once (KeyboardInterrupt);
    only in the main thread of a single process (several would have to agree on the step)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, enabled: bool = True):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.requested: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if self.enabled:
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame) -> None:
        if self.requested is not None:
            raise KeyboardInterrupt
        self.requested = signum
        say(f"{signal.Signals(signum).name}: stopping after this update to save a checkpoint (again to stop now)")
