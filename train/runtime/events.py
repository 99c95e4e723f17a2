"""A run's TensorBoard event file, written in the calling thread: a failed write is one OSError naming it."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

class NoWriter:
    """A SummaryWriter that writes nothing (processes other than 0)."""

    def add_scalar(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass


class Events:
    """A run's TensorBoard scalars, written here (SummaryWriter's thread printed tracebacks on a full disk)."""

    def __init__(self, logdir: Path, writer, purge_step: int | None):
        from tensorboardX.proto.event_pb2 import Event, SessionLog
        from tensorboardX.proto.summary_pb2 import Summary

        self.logdir, self._writer, self._event, self._summary = logdir, writer, Event, Summary
        if purge_step is not None:  # see summary_writer
            self._write(Event(step=purge_step, session_log=SessionLog(status=SessionLog.START)))

    def _write(self, event) -> None:
        try:
            self._writer.write_event(event)
            self._writer.flush()  # on disk as it goes: TensorBoard shows a run while it trains
        except OSError as err:
            with contextlib.suppress(OSError):
                self.close()  # what could not be written is dropped, once
            raise OSError(err.errno, err.strerror, str(self.logdir)) from None

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        summary = self._summary(value=[self._summary.Value(tag=tag, simple_value=float(value))])
        self._write(self._event(wall_time=time.time(), step=step, summary=summary))

    def close(self) -> None:
        writer, self._writer = self._writer, None
        try:
            if writer is not None:
                writer.close()
        except OSError as err:
            raise OSError(err.errno, err.strerror, str(self.logdir)) from None


def summary_writer(logdir: Path, purge_step: int | None = None) -> Events:
    """The run's TensorBoard event file; a JAX run's tensorboardX imported with torch hidden (floats need no torch)."""
    hide_torch = "torch" not in sys.modules and "tensorboardX" not in sys.modules
    if hide_torch:
        sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        from tensorboardX.event_file_writer import EventsWriter
    finally:
        if hide_torch:
            del sys.modules["torch"]
    # tensorboardX names a file by its second only: the suffix keeps each session's file (docs/operations.md#resume)
    suffix = f".{purge_step or 0:010d}.{os.getpid()}"
    logdir.mkdir(parents=True, exist_ok=True)
    return Events(logdir, EventsWriter(str(logdir / "events"), suffix), purge_step)
