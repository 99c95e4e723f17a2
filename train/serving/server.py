"""Hypercorn serving the app through its documented settings only (docs/serving.md)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any

from .. import api
from ..options import RunSelection
from ..runtime import Interrupted, UserError
from ..runtime.files import OptionError
from .app import app
from .limits import Limits, require


MAX_CONNECTIONS = 2048  # requests in flight (bodies buffered, answers awaited); past it 503. Idle ones: the deadline


class StoppedAtOnce(Interrupted):
    """SIGHUP or a second Ctrl-C stopped the server (`signum`); the message says how many requests got 503."""


def capped(asgi_app):
    """`asgi_app` answering 503 (JSON, Retry-After) to a request that comes while MAX_CONNECTIONS are in flight."""
    JSONResponse = require("starlette.responses").JSONResponse
    in_flight = 0

    async def capped_app(scope, receive, send):
        nonlocal in_flight
        if scope["type"] == "http" and in_flight >= MAX_CONNECTIONS:
            refusal = JSONResponse({"error": f"the server holds {MAX_CONNECTIONS} connections: try again"}, 503,
                                   headers={"retry-after": "1", "connection": "close"})
            return await refusal(scope, receive, send)
        in_flight += 1
        try:
            await asgi_app(scope, receive, send)
        finally:
            in_flight -= 1

    return capped_app


class Server(contextlib.AbstractContextManager):
    """Hypercorn serving `asgi_app` on host:port (0: a free one): `run()` until stopped, or `start()` on a thread."""

    def __init__(self, asgi_app, host: str = "127.0.0.1", port: int = 8000, *, access_log: bool = False):
        self.app, self.host, self.port = asgi_app, host, port
        self.config = require("hypercorn.config").Config()
        # Hypercorn's slow-client mitigation (its "Denial Of Service mitigations"): no request head in time, closed.
        self.config.keep_alive_timeout = asgi_app.state.served.limits.idle_timeout_s
        self.config.graceful_timeout = 120  # bounds the wait on SIGTERM
        self.config.loglevel = "WARNING"
        if access_log:  # its access logger at INFO, on stderr (its "-" is stdout at `loglevel`)
            self.config.accesslog = logging.getLogger("train.serving.access")
            self.config.accesslog.setLevel(logging.INFO)
            self.config.accesslog.handlers = [logging.StreamHandler()]
        self.signals: list[int] = []
        self.at_once, self.loop, self.thread, self.started = False, None, None, threading.Event()

    @property
    def url(self) -> str:
        host, port = self.address[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"  # an IPv6 address in brackets

    @property
    def beyond_loopback(self) -> bool:
        """Whether it listens on an address other machines may reach (0.0.0.0, '' or a public one)."""
        return not ipaddress.ip_address(self.address[0]).is_loopback

    def _signal(self, sig: int, frame) -> None:
        """SIGTERM, Ctrl-C: stop; SIGHUP, a second Ctrl-C: 503 to those in flight; a third: KeyboardInterrupt."""
        self.signals.append(sig)
        if sig == signal.SIGHUP or (sig == signal.SIGINT and self.stopping.is_set()):
            if self.at_once and sig == signal.SIGINT:
                raise KeyboardInterrupt
            self.at_once = True
            self.loop.call_soon_threadsafe(self.app.state.served.stop_now.set)
        self.loop.call_soon_threadsafe(self.stopping.set)

    def run(self, on_ready: Callable[[Server], None] | None = None) -> int:
        """Serve until stopped (`_signal`), `on_ready(self)` once listening; the signal that stopped it, or 0."""
        serve, served, handlers = require("hypercorn.asyncio").serve, self.app.state.served, {}
        try:
            family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
            sock = socket.create_server((self.host, self.port), family=family, backlog=2048)
        except OSError:
            raise UserError(f"could not listen on {self.host}:{self.port}") from None
        self.address = sock.getsockname()
        self.config.bind = [f"fd://{sock.detach()}"]  # hypercorn's socket from now on

        async def main():
            self.loop, self.stopping = asyncio.get_running_loop(), asyncio.Event()
            if threading.current_thread() is threading.main_thread():
                handlers.update({sig: signal.signal(sig, self._signal)
                                 for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)})
            task = asyncio.create_task(serve(capped(self.app), self.config, shutdown_trigger=self.stopping.wait))
            while served.stop_now is None and not task.done():  # the app's lifespan has not started yet
                await asyncio.sleep(0.02)
            self.started.set()
            if on_ready is not None and not task.done():
                on_ready(self)
            await task

        try:
            asyncio.run(main())
        finally:  # the caller's own handlers back
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        if self.at_once:
            name = signal.Signals(self.signals[-1]).name
            raise StoppedAtOnce(self.signals[-1], f"stopped at once by {'Ctrl-C' if name == 'SIGINT' else name}: "
                                f"{served.stopped} request{'s' * (served.stopped != 1)} in flight answered 503 (retry)")
        return self.signals[0] if self.signals else 0

    def start(self, timeout: float = 60.0) -> Server:
        """Serve on a thread; returns once listening (UserError where it cannot listen)."""
        failed = []

        def run():
            try:
                self.run()
            except UserError as err:  # raised by start(), not printed by the thread
                failed.append(err)
            finally:
                self.started.set()

        self.thread = threading.Thread(target=run, name="serve", daemon=True)
        self.thread.start()
        if not self.started.wait(timeout) or failed or not self.thread.is_alive():
            raise failed[0] if failed else RuntimeError("the server did not start")
        return self

    def stop(self) -> None:
        """Graceful stop, as SIGTERM; waits for a `start()`ed thread."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.stopping.set)
        if self.thread is not None:
            self.thread.join()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(runs: str | os.PathLike | Sequence[str | os.PathLike] | RunSelection, host: str = "127.0.0.1",
          port: int = 8000, *, limits: Limits | None = None, on_ready: Callable[[Server], None] | None = None,
          **server: Any) -> int:
    """Load `runs` (`train.load`'s) and serve them until SIGTERM or SIGINT; the signal number that stopped it."""
    require("starlette")
    require("hypercorn")
    with api.load(runs) as run:
        if run.backend.topology.process_count > 1:
            raise OptionError("the server runs in one process: give no {}", "coordinator_address")
        return Server(app(run, limits), host, port, **server).run(on_ready)
