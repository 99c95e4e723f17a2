"""The ASGI app (Starlette): /translate, /health, /info and the page, handlers sharing one `Served`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any

import numpy as np

from .. import data
from ..options import check_single
from ..runtime import UserError
from .limits import BadRequest, Decoding, Limits, parse_request, require
from .request_batcher import QueueFull, RequestBatcher

try:
    from starlette.requests import ClientDisconnect
    from starlette.responses import HTMLResponse, JSONResponse
except ImportError:  # the serve extra: `app()` says how to install it
    ClientDisconnect = HTMLResponse = JSONResponse = None


def result_json(result) -> dict[str, Any]:
    """One text's `Run.translate` result: a string, or `Hypothesis` (n-best, samples), the first its translation."""
    if isinstance(result, str):
        return {"translation": result}
    return {"translation": result[0].text if result else "", "hypotheses": [dataclasses.asdict(h) for h in result]}


def run_decoder(run) -> Callable[..., list[dict[str, Any]]]:
    """`RequestBatcher.decode` for a loaded run (`train.load`): each text's `result_json` (and attention)."""

    def decode(texts: list[str], prefixes: list[str | None] | None, options: Decoding) -> list[dict[str, Any]]:
        recorder = None
        if options.attention:
            from ..translate.attention import AttentionRecorder

            check_single(bool(run.members), "attention")
            recorder = AttentionRecorder(run.backend, run.tokenizers, texts)
        results = run.translate(texts, prefix=prefixes, on_batch=recorder, **options.translate_options())
        out = [result_json(r) for r in results]
        if recorder is not None:  # each sentence's tokens and weights [layer][head][target][source]
            found = {att.line - 1: {"source_tokens": att.src_tokens, "target_tokens": att.tgt_tokens,
                                    "weights": np.round(att.weights.astype(np.float64), 4).tolist()}
                     for att in recorder.found}
            for i, result in enumerate(out):
                result["attention"] = found.get(i)
        return out

    return decode


def run_info(run) -> dict[str, Any]:
    """What /info says of a loaded run (an ensemble: its runs and their steps too)."""
    devices = run.backend.mesh.devices.flat if hasattr(run.backend, "mesh") else [run.backend.device]
    ensemble = {"ensemble": [str(m.run_dir) for m in run.members], "steps": run.steps} if run.members else {}
    return {"run_dir": str(run.run_dir), "step": run.step, **ensemble, "backend": run.config.backend,
            "devices": [str(d) for d in devices], "max_len": run.config.max_len,
            "model": dataclasses.asdict(run.model_config),
            **({"export": run.meta["kind"]} if "kind" in run.meta else {})}


def token_counts(run) -> Callable[[Sequence[str]], int]:
    """Source tokens of texts as the model reads them (cut to max_len), for the batch bound."""
    return lambda texts: sum(min(len(ids), run.config.max_len) for ids in data.encode(run.tokenizers.src, texts))


@dataclasses.dataclass
class Served:
    """What the handlers share; `stop_now` set (SIGHUP, a second Ctrl-C) answers the requests in flight 503."""

    limits: Limits
    decode: Callable[..., list]
    count_tokens: Callable[[Sequence[str]], int]
    info: dict[str, Any]
    html: str
    batcher: RequestBatcher | None = None
    stop_now: asyncio.Event | None = None
    stopped: int = 0  # requests answered 503 by a stop at once


def error(status: int, message: str, headers: dict | None = None):
    return JSONResponse({"error": message}, status, headers=headers)


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


async def receive(request, limits: Limits):
    """The request's body parsed (`Request`), or the error response refusing it."""
    # the rest of such a body is never read: the connection closes after the answer (a client must not reuse it)
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        return error(415, f"the content type must be application/json, not {kind or 'none'}", {"Connection": "close"})
    too_large = error(413, f"the body is larger than {limits.max_body_bytes} bytes", {"Connection": "close"})
    length = request.headers.get("content-length", "")
    if length and (not length.isdigit() or int(length) > limits.max_body_bytes):
        return too_large
    try:
        body = await asyncio.wait_for(read_body(request, limits.max_body_bytes), limits.body_timeout_s)
    except TimeoutError:
        return error(408, f"the body did not arrive within {limits.body_timeout_s:g} s", {"Connection": "close"})
    except ClientDisconnect:
        return error(400, "the client disconnected")
    if body is None:
        return too_large
    try:
        return parse_request(body, limits)
    except BadRequest as err:
        return error(400, str(err))


async def translate(request):
    served: Served = request.app.state.served
    limits = served.limits
    parsed = await receive(request, limits)
    if isinstance(parsed, JSONResponse):
        return parsed
    try:
        future = served.batcher.submit(parsed, served.count_tokens(parsed.texts))
    except QueueFull as err:
        return error(429, f"{err}: try again later", {"Retry-After": "1"})
    waits = [asyncio.ensure_future(disconnected(request)), asyncio.ensure_future(served.stop_now.wait())]
    try:
        await asyncio.wait([future, *waits], timeout=limits.request_timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
    if not future.done():  # cancelled: a request still queued is dropped, not decoded
        future.cancel()
        if served.stop_now.is_set():
            served.stopped += 1
            return error(503, "the server is stopping: try again", {"Retry-After": "5", "Connection": "close"})
        if waits[0].done():
            return error(400, "the client disconnected")
        return error(503, f"no translation within {limits.request_timeout_s:g} s: the server is busy",
                     {"Retry-After": "5"})
    if isinstance(err := future.exception(), UserError):  # what the library refuses in these options or texts
        return error(400, str(err))
    if err is not None:  # what failed the batch, in one line; the server goes on
        return error(500, f"translation failed: {type(err).__name__}: {err}".splitlines()[0])
    results = future.result()
    out: dict[str, Any] = {"translations": [r["translation"] for r in results]}
    for key in ("hypotheses", "attention"):
        if results and key in results[0]:
            out[key] = [r[key] for r in results]
    return JSONResponse(out)


async def health(request):
    batcher = request.app.state.served.batcher
    return JSONResponse({"status": "ok", "queued_sentences": batcher.queued if batcher else 0})


async def get_info(request):
    return JSONResponse({**request.app.state.served.info, "served": dict(request.app.state.served.batcher.stats)})


async def index(request):
    return HTMLResponse(request.app.state.served.html)


async def http_error(request, exc):  # 404, 405: as JSON, as every other error
    return error(exc.status_code, exc.detail, exc.headers)


async def server_error(request, exc: Exception):
    return error(500, f"internal error: {type(exc).__name__}")


@contextlib.asynccontextmanager
async def lifespan(app):
    served: Served = app.state.served
    served.batcher, served.stop_now = RequestBatcher(served.decode, served.limits), asyncio.Event()
    task = asyncio.create_task(served.batcher.run())
    try:
        yield
    finally:  # connections were drained before this: no request is waiting
        task.cancel()
        served.batcher.close()


def app(run=None, limits: Limits | None = None, *, decode: Callable | None = None,
        count_tokens: Callable[[Sequence[str]], int] | None = None, info: dict | None = None):
    """The ASGI app serving `run` (`train.load`'s) with `limits`; `decode(texts, prefixes, options)` (a dict
    with "translation" per text), `count_tokens` and `info` stand in for the run's (tests, other models)."""
    require("starlette")
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.routing import Route

    limits = limits or Limits()
    routes = [Route("/", index), Route("/translate", translate, methods=["POST"]), Route("/health", health),
              Route("/info", get_info)]
    asgi = Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers={HTTPException: http_error, 500: server_error})
    asgi.state.served = Served(limits, decode or run_decoder(run), count_tokens or token_counts(run),
                               {**(run_info(run) if info is None else info), "limits": dataclasses.asdict(limits)},
                               resources.files("train").joinpath("static/index.html").read_text(encoding="utf-8"))
    return asgi
