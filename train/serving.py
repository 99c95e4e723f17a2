"""Serve a loaded run over HTTP (`python -m train.serve`, docs/serving.md): an ASGI app (Starlette)
whose `POST /translate` requests are batched together by a `Batcher` and decoded by the run's
backend on one thread, plus `/health`, `/info` and a page at `/` that draws the cross-attention.

Starlette and uvicorn come with the `serve` extra and are imported when an app is built, so the
rest of `train` imports without them. Nothing a client sends is written anywhere.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import importlib
import json
import re
import signal
import threading
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any

import numpy as np

from torch_reference.config import POSITIVE, SCORINGS, Range

from . import data
from .runtime import UserError

SERVE_INSTALL = 'pip install -e ".[serve]"'


def require(module: str) -> Any:
    """Import a package of the `serve` extra, or fail with one line naming the install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"{module} is not installed; it comes with the serve extra: {SERVE_INSTALL}") from None


def _limit(default, help: str):
    allowed = Range(float, above=0.0) if isinstance(default, float) else POSITIVE  # ms and s: finite, above 0
    return dataclasses.field(default=default, metadata={"help": help, "range": allowed})


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one request may ask and how requests are batched (docs/serving.md#limits)."""

    max_body_bytes: int = _limit(1 << 20, "larger request bodies get 413")
    max_texts: int = _limit(64, "sentences per request")
    max_text_chars: int = _limit(2000, "characters per sentence (the model reads at most max_len tokens of it)")
    max_beam: int = _limit(16, "the largest beam a request may ask for")
    max_queue_sentences: int = _limit(4096, "sentences waiting or decoding; past it a request gets 429 with Retry-After")
    max_batch_sentences: int = _limit(512, "sentences decoded together")
    max_batch_tokens: int = _limit(16384, "source tokens decoded together")
    max_batch_requests: int | None = _limit(None, "requests decoded together (1: no batching)")
    max_wait_ms: float = _limit(5.0, "how long the oldest waiting request waits for others to join its batch")
    request_timeout_s: float = _limit(60.0, "from a body's arrival to its translation; past it 503")
    body_timeout_s: float = _limit(10.0, "to receive a whole body (a slow client); past it 408")

    def __post_init__(self):
        for field in dataclasses.fields(self):  # the ranges of the command's flags, for Python callers too
            value = getattr(self, field.name)
            if value is not None and (problem := field.metadata["range"].error(value)):
                raise UserError(f"{field.name} {problem}")


class QueueFull(Exception):
    """The batcher holds `max_queue_sentences` already."""


@dataclasses.dataclass(eq=False)
class _Pending:
    texts: list[str]
    tokens: int
    options: tuple
    future: asyncio.Future
    arrived: float


class Batcher:
    """Concurrent requests into batches: `submit(texts, tokens, options)` queues a request and
    returns a future of its results; `run()` (a task) takes the oldest request and those queued
    after it with the same decoding options, up to `max_batch_*`, waiting at most `max_wait_ms`
    from the oldest's arrival for more, and calls `decode(texts, options)` (blocking, on one
    worker thread) on them all at once. A request whose future was cancelled (timed out) is dropped."""

    def __init__(self, decode: Callable[[list[str], tuple], list], limits: Limits):
        self.decode, self.limits = decode, limits
        self.queue: collections.deque[_Pending] = collections.deque()
        self.queued = 0  # sentences in `queue` and in the batch decoding
        self.stats = collections.Counter()  # batches, requests, sentences decoded
        self._wake = asyncio.Event()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="decode")

    def submit(self, texts: list[str], tokens: int, options: tuple) -> asyncio.Future:
        """Queue a request; raises QueueFull when its sentences would pass `max_queue_sentences`
        (a request alone in an empty queue always enters)."""
        if self.queued and self.queued + len(texts) > self.limits.max_queue_sentences:
            raise QueueFull(f"the server holds {self.queued} sentences, its limit is {self.limits.max_queue_sentences}")
        loop = asyncio.get_running_loop()
        pending = _Pending(texts, tokens, options, loop.create_future(), loop.time())
        self.queue.append(pending)
        self.queued += len(texts)
        self._wake.set()
        return pending.future

    def _batch(self) -> tuple[list[_Pending], bool]:
        """(the requests of the next batch, whether the batch is full), leaving them queued."""
        lim = self.limits
        batch, sentences, tokens, options = [], 0, 0, None
        for item in self.queue:
            if item.future.done():
                continue
            if options is None:
                options = item.options
            elif item.options != options:
                continue
            if batch and (sentences + len(item.texts) > lim.max_batch_sentences or tokens + item.tokens > lim.max_batch_tokens):
                return batch, True
            batch.append(item)
            sentences, tokens = sentences + len(item.texts), tokens + item.tokens
            if lim.max_batch_requests is not None and len(batch) >= lim.max_batch_requests:
                return batch, True
        return batch, False

    def _drop_done(self) -> None:
        """Forget the requests whose futures are done (timed out while queued)."""
        for item in [i for i in self.queue if i.future.done()]:
            self.queue.remove(item)
            self.queued -= len(item.texts)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._drop_done()
            if not self.queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch, full = self._batch()
            wait = self.queue[0].arrived + self.limits.max_wait_ms / 1000 - loop.time()
            if not full and wait > 0:  # a bounded wait for more requests to join
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), wait)
                except TimeoutError:
                    pass
                continue  # look again: the batch may have grown (or timed out)
            for item in batch:
                self.queue.remove(item)
            texts = [t for item in batch for t in item.texts]
            try:
                results = await loop.run_in_executor(self._executor, self.decode, texts, batch[0].options)
            except Exception as err:  # noqa: BLE001 (the model failed on this batch: said to its requests; the server goes on)
                results = err
            finally:
                self.queued -= len(texts)
            self.stats.update(batches=1, requests=len(batch), sentences=len(texts))
            start = 0
            for item in batch:
                if not item.future.done():
                    if isinstance(results, Exception):
                        item.future.set_exception(results)
                    else:
                        item.future.set_result(results[start : start + len(item.texts)])
                start += len(item.texts)

    def close(self) -> None:
        """Wait for the batch decoding, then stop the worker thread."""
        self._executor.shutdown(wait=True)


# ----------------------------------------------------------------------------------------------
# Requests


class BadRequest(Exception):
    """A request the server refuses: `status` and a one-line message."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


FIELDS = ("texts", "beam", "alpha", "scoring", "attention")


def _reject_constant(name: str):
    raise BadRequest(f"{name} is not valid JSON (numbers must be finite)")


def parse_request(body: bytes, limits: Limits) -> tuple[list[str], tuple]:
    """The texts and the decoding options (beam, alpha, scoring, attention) of a /translate body;
    raises BadRequest with the first problem."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        raise BadRequest(f"the body is not UTF-8 (byte {err.start})") from None
    try:
        request = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as err:
        raise BadRequest(f"the body is not JSON: {err.msg} at line {err.lineno} column {err.colno}") from None
    except RecursionError:
        raise BadRequest("the body is nested too deeply") from None
    except ValueError:  # an integer past int's bound on digits (4300 by default)
        raise BadRequest("the body holds an integer too long to read") from None
    if not isinstance(request, dict):
        raise BadRequest('the body must be a JSON object: {"texts": ["..."], "beam": 4, ...}')
    unknown = sorted(set(request) - set(FIELDS))
    if unknown:
        raise BadRequest(f"unknown field {unknown[0]!r}; the fields are {', '.join(FIELDS)}")
    texts = request.get("texts")
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise BadRequest("texts must be a non-empty list of strings")
    if len(texts) > limits.max_texts:
        raise BadRequest(f"texts holds {len(texts)} sentences; at most {limits.max_texts} per request")
    for i, t in enumerate(texts):
        if not t.strip():
            raise BadRequest(f"texts[{i}] is empty")
        if len(t) > limits.max_text_chars:
            raise BadRequest(f"texts[{i}] has {len(t)} characters; at most {limits.max_text_chars}")
        if "\n" in t or "\r" in t:
            raise BadRequest(f"texts[{i}] holds a line break: send one sentence per string")
        if re.search("[\ud800-\udfff]", t):  # a \uXXXX escape of half a pair: no character, no tokens
            raise BadRequest(f"texts[{i}] holds a lone surrogate (an unpaired \\ud800-\\udfff escape)")
    beam = request.get("beam", 4)
    if not isinstance(beam, int) or isinstance(beam, bool) or not 1 <= beam <= limits.max_beam:
        raise BadRequest(f"beam must be an integer from 1 to {limits.max_beam}")
    alpha = request.get("alpha", 0.6)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not 0 <= alpha <= 10:
        raise BadRequest("alpha must be a number from 0 to 10")
    scoring = request.get("scoring", "gnmt")
    if scoring not in SCORINGS:
        raise BadRequest(f"scoring must be one of {', '.join(SCORINGS)}")
    attention = request.get("attention", False)
    if not isinstance(attention, bool):
        raise BadRequest("attention must be true or false")
    return texts, (beam, float(alpha), scoring, attention)


# ----------------------------------------------------------------------------------------------
# The run's side


def attention_json(att) -> dict[str, Any]:
    """A `train.attention.SentenceAttention` as JSON: tokens and weights [layer][head][target][source]."""
    return {"source_tokens": att.src_tokens, "target_tokens": att.tgt_tokens,
            "weights": np.round(att.weights.astype(np.float64), 4).tolist()}


def run_decoder(run) -> Callable[[list[str], tuple], list[dict[str, Any]]]:
    """`Batcher.decode` for a loaded run (`train.load`): its translations (and attention) of texts."""

    def decode(texts: list[str], options: tuple) -> list[dict[str, Any]]:
        beam, alpha, scoring, attention = options
        if not attention:
            return [{"translation": h} for h in run.translate(texts, beam=beam, alpha=alpha, scoring=scoring)]
        from .attention import AttentionRecorder

        recorder = AttentionRecorder(run.backend, run.tokenizers, texts)
        hyps = run.translate(texts, beam=beam, alpha=alpha, scoring=scoring, on_batch=recorder)
        found = {att.line - 1: att for att in recorder.found}
        return [{"translation": h, "attention": attention_json(found[i]) if i in found else None}
                for i, h in enumerate(hyps)]

    return decode


def run_info(run) -> dict[str, Any]:
    """What /info says of a loaded run."""
    backend = run.backend
    devices = backend.mesh.devices.flat if hasattr(backend, "mesh") else [backend.device]
    return {"run_dir": str(run.run_dir), "step": run.step, "backend": run.config.backend,
            "devices": [str(d) for d in devices], "max_len": run.config.max_len,
            "model": dataclasses.asdict(run.model_config)}


def token_counts(run) -> Callable[[Sequence[str]], int]:
    """Source tokens of texts as the model reads them (cut to max_len), for the batch bound."""
    max_len = run.config.max_len
    return lambda texts: sum(min(len(ids), max_len) for ids in data.encode(run.tokenizers.src, texts))


# ----------------------------------------------------------------------------------------------
# The app


def page() -> str:
    """The page served at `/` (train/static/index.html)."""
    return resources.files(__package__).joinpath("static/index.html").read_text(encoding="utf-8")


def app(run=None, limits: Limits | None = None, *, decode: Callable | None = None,
        count_tokens: Callable[[Sequence[str]], int] | None = None, info: dict | None = None):
    """The ASGI app serving `run` (a `train.load` result) with `limits`. `decode`, `count_tokens`
    and `info` stand in for the run's (tests, other models): `decode(texts, options)` returns one
    dict per text with at least "translation"."""
    require("starlette")
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect
    from starlette.responses import HTMLResponse, JSONResponse
    from starlette.routing import Route

    limits = limits or Limits()
    decode = decode or run_decoder(run)
    count_tokens = count_tokens or token_counts(run)
    info = {**(run_info(run) if info is None else info), "limits": dataclasses.asdict(limits)}
    state: dict[str, Any] = {}

    async def read_body(request, limit: int) -> bytes | None:
        """The body, or None past `limit` bytes (a chunked body has no length to refuse it by)."""
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                return None
        return bytes(body)

    async def disconnected(request) -> None:
        """Returns when the client has gone (its body was read: the next message is the disconnect)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass

    def error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
        return JSONResponse({"error": message}, status, headers=headers)

    async def translate(request):
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/json":
            return error(415, f"the content type must be application/json, not {kind or 'none'}")
        # the rest of such a body is never read: the connection closes after the answer
        too_large = error(413, f"the body is larger than {limits.max_body_bytes} bytes", {"Connection": "close"})
        length = request.headers.get("content-length", "")
        if length and (not length.isdigit() or int(length) > limits.max_body_bytes):
            return too_large
        try:
            body = await asyncio.wait_for(read_body(request, limits.max_body_bytes), limits.body_timeout_s)
            if body is None:
                return too_large
        except TimeoutError:
            return error(408, f"the body did not arrive within {limits.body_timeout_s:g} s", {"Connection": "close"})
        except ClientDisconnect:
            return error(400, "the client disconnected")
        try:
            texts, options = parse_request(body, limits)
        except BadRequest as err:
            return error(err.status, str(err))
        batcher: Batcher = state["batcher"]
        try:
            future = batcher.submit(texts, count_tokens(texts), options)
        except QueueFull as err:
            return error(429, f"{err}: try again later", {"Retry-After": "1"})
        gone = asyncio.ensure_future(disconnected(request))
        try:
            await asyncio.wait([future, gone], timeout=limits.request_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not future.done():  # cancelled: a request still queued is dropped, not decoded
            future.cancel()
            if gone.done():
                return error(400, "the client disconnected")
            return error(503, f"no translation within {limits.request_timeout_s:g} s: the server is busy",
                         {"Retry-After": "5"})
        if (err := future.exception()) is not None:  # what failed the batch, in one line; the server goes on
            return error(500, f"translation failed: {type(err).__name__}: {err}".splitlines()[0])
        results = future.result()
        out: dict[str, Any] = {"translations": [r["translation"] for r in results]}
        if options[3]:
            out["attention"] = [r.get("attention") for r in results]
        return JSONResponse(out)

    async def health(request):
        batcher = state.get("batcher")
        return JSONResponse({"status": "ok", "queued_sentences": batcher.queued if batcher else 0})

    async def get_info(request):
        return JSONResponse({**info, "served": dict(state["batcher"].stats)})

    html = page()

    async def index(request):
        return HTMLResponse(html)

    async def http_error(request, exc: HTTPException):  # 404, 405: as JSON, as every other error
        return error(exc.status_code, exc.detail, exc.headers)

    async def server_error(request, exc: Exception):
        return error(500, f"internal error: {type(exc).__name__}")

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        batcher = state["batcher"] = Batcher(decode, limits)
        task = asyncio.create_task(batcher.run())
        try:
            yield
        finally:  # connections were drained before this: no request is waiting
            task.cancel()
            batcher.close()

    routes = [Route("/", index), Route("/translate", translate, methods=["POST"]), Route("/health", health),
              Route("/info", get_info)]
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error, 500: server_error})


# ----------------------------------------------------------------------------------------------
# The server


class Server:
    """uvicorn serving `asgi_app` on host:port (port 0: a free one). `run()` blocks until SIGTERM,
    SIGINT or `stop()`: it stops accepting, finishes the requests in flight and returns; a second
    SIGINT (Ctrl-C) meanwhile stops at once, cancelling them, and raises KeyboardInterrupt.
    `start()` runs it on a thread instead (tests, notebooks); `url` once it is listening."""

    def __init__(self, asgi_app, host: str = "127.0.0.1", port: int = 8000, *, access_log: bool = False):
        uvicorn = require("uvicorn")
        # limit_concurrency: connections and tasks at once, past it 503 (thousands of idle or dropped
        # connections cannot starve the process); the graceful timeout bounds the wait on SIGTERM.
        config = uvicorn.Config(asgi_app, host=host, port=port, log_level="warning", access_log=access_log,
                                limit_concurrency=2048, timeout_keep_alive=5, timeout_graceful_shutdown=120,
                                lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"  # an IPv6 address in brackets

    def run(self, on_ready: Callable[[str], None] | None = None) -> int:
        """Serve until stopped; `on_ready(url)` once listening. Returns the signal that stopped it (0: none);
        KeyboardInterrupt after a second Ctrl-C."""
        stopped_by = []
        # uvicorn re-raises the signal it caught after its graceful shutdown: handled here (the process
        # then exits 0 instead of dying of it), then the caller's own handlers are put back.
        handlers = {sig: signal.signal(sig, lambda signum, frame: stopped_by.append(signum))
                    for sig in (signal.SIGTERM, signal.SIGINT) if threading.current_thread() is threading.main_thread()}

        async def serve():
            with contextlib.suppress(SystemExit):  # uvicorn's way out where it cannot listen (it logged why)
                await self.server.serve()

        async def main():
            task = asyncio.create_task(serve())
            while not self.server.started and not task.done():
                await asyncio.sleep(0.02)
            if self.server.started and on_ready is not None:
                on_ready(self.url)
            await task

        try:
            asyncio.run(main())
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        if self.server.force_exit:  # uvicorn cancelled the requests in flight (their clients got 500)
            raise KeyboardInterrupt
        if not self.server.started:
            raise UserError(f"could not listen on {self.server.config.host}:{self.server.config.port}")
        return stopped_by[0] if stopped_by else 0

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

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(run_dir, host: str = "127.0.0.1", port: int = 8000, *, checkpoint: str | int = "best",
          devices: int | None = None, limits: Limits | None = None, on_ready: Callable[[str], None] | None = None,
          **server: Any) -> int:
    """Load the run in `run_dir` (`train.load`) and serve it until SIGTERM or SIGINT (what
    `python -m train.serve` does); returns the signal number that stopped it."""
    from .api import load

    require("starlette")
    require("uvicorn")
    with load(run_dir, checkpoint, devices=devices) as run:
        if run.backend.topology.process_count > 1:
            raise UserError("the server runs in one process: give no --coordinator-address")
        return Server(app(run, limits), host, port, **server).run(on_ready)
