"""uvicorn serving the app (docs/serving.md): a deadline on every request head, every refusal in JSON;
SIGTERM or Ctrl-C finish the requests in flight, SIGHUP or a second Ctrl-C answer them 503 at once."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http
import ipaddress
import json
import os
import signal
import threading
from collections.abc import Callable, Sequence
from typing import Any

from .. import api
from ..options import RunSelection
from ..runtime import Interrupted, UserError
from .app import app
from .limits import Limits, require

MAX_CONNECTIONS = 2048  # thousands of idle or dropped connections cannot starve the process: past it 503


class StoppedAtOnce(Interrupted):
    """SIGHUP or a second Ctrl-C stopped the server (`signum`); the message says how many requests got 503."""


def raw_response(status: int, message: str, retry: bool = False) -> bytes:
    """A whole HTTP/1.1 answer with a JSON error, closing the connection (before or without a request)."""
    body = json.dumps({"error": message}).encode()
    head = [f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}", "content-type: application/json",
            f"content-length: {len(body)}", "connection: close", *(["retry-after: 1"] if retry else [])]
    return "".join(f"{line}\r\n" for line in head).encode() + b"\r\n" + body


@functools.cache
def uvicorn_classes() -> tuple[type, type]:
    """uvicorn's (h11 protocol, server) as this server runs them, made once uvicorn is imported."""
    uvicorn = require("uvicorn")
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        """uvicorn's h11 protocol, its keep-alive deadline kept until a whole request head arrives; refusals in JSON."""

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.refused = len(self.connections) > MAX_CONNECTIONS  # answered 503 when its request comes
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)

        def data_received(self, data: bytes) -> None:  # the head's arrival lifts the deadline (handle_events)
            if self.refused:
                self.transport.write(raw_response(503, f"the server holds {MAX_CONNECTIONS} connections: try again",
                                                  retry=True))
                self.transport.close()
                return
            self.conn.receive_data(data)
            self.handle_events()

        def send_400_response(self, msg: str) -> None:
            self.transport.write(raw_response(400, f"invalid HTTP: {msg}"))
            self.transport.close()

    class UvicornServer(uvicorn.Server):
        """uvicorn's server with these signals: SIGTERM or a first Ctrl-C stop gracefully; SIGHUP or a second
        Ctrl-C set the app's `stop_now` (503 to the requests in flight); one more Ctrl-C: uvicorn's force exit."""

        signals: list[int]
        stop_now: Callable[[], None]
        at_once = False

        @contextlib.contextmanager
        def capture_signals(self):
            self.signals = []
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            loop = asyncio.get_running_loop()
            self.stop_now = lambda: loop.call_soon_threadsafe(self.config.app.state.served.stop_now.set)
            before = {sig: signal.signal(sig, self.handle_exit)
                      for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
            try:
                yield
            finally:  # the caller's own handlers back (uvicorn re-raises the signal it caught: not here)
                for sig, handler in before.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig: int, frame) -> None:
            self.signals.append(sig)
            if sig == signal.SIGHUP or (sig == signal.SIGINT and self.should_exit):
                if self.at_once and sig == signal.SIGINT:
                    self.force_exit = True
                self.at_once = True
                self.stop_now()
            self.should_exit = True

    return Protocol, UvicornServer


class Server(contextlib.AbstractContextManager):
    """uvicorn serving `asgi_app` on host:port (0: a free one): `run()` until stopped, or `start()` on a thread."""

    def __init__(self, asgi_app, host: str = "127.0.0.1", port: int = 8000, *, access_log: bool = False):
        protocol, server = uvicorn_classes()
        idle = asgi_app.state.served.limits.idle_timeout_s
        config = require("uvicorn").Config(asgi_app, host=host, port=port, log_level="warning", access_log=access_log,
                                           http=protocol, ws="none", timeout_keep_alive=idle, lifespan="on",
                                           timeout_graceful_shutdown=120)  # bounds the wait on SIGTERM
        self.server = server(config)
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"  # an IPv6 address in brackets

    @property
    def beyond_loopback(self) -> bool:
        """Whether it listens on an address other machines may reach (0.0.0.0, '' or a public one)."""
        return not all(ipaddress.ip_address(sock.getsockname()[0]).is_loopback
                       for server in self.server.servers for sock in server.sockets)

    def run(self, on_ready: Callable[[Server], None] | None = None) -> int:
        """Serve until stopped; `on_ready(self)` once listening. Returns the signal that stopped it (0:
        none); StoppedAtOnce after SIGHUP or a second Ctrl-C, KeyboardInterrupt after a third."""

        async def serve():
            with contextlib.suppress(SystemExit):  # uvicorn's way out where it cannot listen (it logged why)
                await self.server.serve()

        async def main():
            task = asyncio.create_task(serve())
            while not self.server.started and not task.done():
                await asyncio.sleep(0.02)
            if self.server.started and on_ready is not None:
                on_ready(self)
            await task

        asyncio.run(main())
        signals = getattr(self.server, "signals", [])
        if self.server.force_exit:  # uvicorn cancelled the requests in flight
            raise KeyboardInterrupt
        if not self.server.started:
            raise UserError(f"could not listen on {self.server.config.host}:{self.server.config.port}")
        if self.server.at_once:
            name = signal.Signals(signals[-1]).name
            stopped = self.server.config.app.state.served.stopped
            raise StoppedAtOnce(signals[-1], f"stopped at once by {'Ctrl-C' if name == 'SIGINT' else name}: "
                                f"{stopped} request{'s' * (stopped != 1)} in flight answered 503 (retry)")
        return signals[0] if signals else 0

    def start(self, timeout: float = 60.0) -> Server:
        """Serve on a thread; returns once listening (UserError where it cannot listen)."""
        failed = []

        def run():
            try:
                self.run()
            except UserError as err:  # raised by start(), not printed by the thread
                failed.append(err)

        self.thread = threading.Thread(target=run, name="serve", daemon=True)
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive() or timeout <= 0:
                raise failed[0] if failed else RuntimeError("the server did not start")
            self.thread.join(0.02)
            timeout -= 0.02
        return self

    def stop(self) -> None:
        """Graceful stop, as SIGTERM; waits for a `start()`ed thread."""
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(runs: str | os.PathLike | Sequence[str | os.PathLike] | RunSelection, host: str = "127.0.0.1",
          port: int = 8000, *, limits: Limits | None = None, on_ready: Callable[[Server], None] | None = None,
          **server: Any) -> int:
    """Load `runs` (`train.load`'s) and serve them until SIGTERM or SIGINT; the signal number that stopped it."""
    require("starlette")
    require("uvicorn")
    with api.load(runs) as run:
        if run.backend.topology.process_count > 1:
            raise UserError("the server runs in one process: give no --coordinator-address")
        return Server(app(run, limits), host, port, **server).run(on_ready)
