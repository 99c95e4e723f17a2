"""Serve a loaded run over HTTP (`python -m train.serve`, docs/serving.md): `limits` (what a request
may ask, parsed into decoding options), `batcher`, `app` (Starlette) and `server` (uvicorn), both
imported only when an app is built (the `serve` extra). Nothing a client sends is written anywhere."""

from ..runtime import UserError
from .app import app, run_decoder, run_info
from .batcher import Batcher, QueueFull
from .limits import SERVE_INSTALL, BadRequest, Decoding, Limits, Request, parse_request, require
from .server import Server, StoppedAtOnce, serve
