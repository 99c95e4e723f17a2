"""Serve a loaded run over HTTP (`aiayn serve`, docs/serving.md): `limits` (what a request
may ask, and its parsing into decoding options), `batcher` (requests decoded together on one
thread), `app` (the Starlette app: /translate, /health, /info and the page) and `server` (uvicorn,
its deadlines and its stops).

Starlette and uvicorn come with the `serve` extra and are imported when an app is built, so the
rest of `train` imports without them. Nothing a client sends is written anywhere.
"""

from ..runtime import UserError
from .app import app, run_decoder, run_info
from .batcher import Batcher, QueueFull
from .limits import SERVE_INSTALL, BadRequest, Decoding, Limits, Request, parse_request, require
from .server import Server, StoppedAtOnce, serve

__all__ = ["SERVE_INSTALL", "BadRequest", "Batcher", "Decoding", "Limits", "QueueFull", "Request", "Server",
           "StoppedAtOnce", "UserError", "app", "parse_request", "require", "run_decoder", "run_info", "serve"]
