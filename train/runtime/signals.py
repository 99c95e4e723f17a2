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
        super().__init__(signal.Signals(signum).name if message is None else message)  # "": nothing to say
        self.signum = signum


def exit_status(main: Callable[..., int | None], *args: Any, **kwargs: Any) -> int:
    """`main(*args, **kwargs)`'s exit status: an error one line and 1, a stop 128 + the signal; never a traceback."""
    try:
        status = main(*args, **kwargs)
        return status if isinstance(status, int) else 0  # a job's result (None, a dict): done
    except (UserError, OSError, ValueError) as err:  # OSError: a full disk, a read-only place, no permission
        print(f"error: {error_text(err)}", file=sys.stderr)
        return 1
    except Interrupted as err:
        if str(err):
            print(err if str(err) != signal.Signals(err.signum).name else f"interrupted ({err})", file=sys.stderr)
        return 128 + err.signum
    except KeyboardInterrupt:
        print(f"interrupted ({Interrupted(signal.SIGINT)})", file=sys.stderr)
        return 128 + signal.SIGINT


SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def _handled(handler: Callable[[int, Any], None]) -> Iterator[None]:
    """Within the block `handler` takes SIGTERM and SIGINT (main thread only; elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, handler) for s in SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def interruptible() -> contextlib.AbstractContextManager[None]:
    """Within the block SIGTERM and SIGINT raise `Interrupted` (main thread only; elsewhere nothing changes)."""

    def handler(signum, frame):
        raise Interrupted(signum)

    return _handled(handler)


class StopSignals:
    """SIGTERM and Ctrl-C ask the loop to stop (`requested`) with a checkpoint, a second at once (KeyboardInterrupt)."""

    def __init__(self, enabled: bool = True):
        self.requested: int | None = None
        self._handlers = _handled(self._handle) if enabled else contextlib.nullcontext()

    def __enter__(self) -> StopSignals:
        self._handlers.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._handlers.__exit__(*exc)

    def _handle(self, signum: int, frame) -> None:
        if self.requested is not None:
            raise KeyboardInterrupt
        self.requested = signum
        say(f"{signal.Signals(signum).name}: stopping after this update to save a checkpoint (again to stop now)")
