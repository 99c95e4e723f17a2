"""Serve a loaded run over HTTP (`aiayn serve`, docs/serving.md): Starlette and uvicorn."""

from ..runtime import UserError
from .app import app, run_decoder, run_info
from .limits import SERVE_INSTALL, BadRequest, Decoding, Limits, Listen, Request, parse_request, require
from .request_batcher import QueueFull, RequestBatcher
from .server import Server, StoppedAtOnce, serve
