"""The server's options: `Listen`, `Limits` on a request, and a /translate body parsed (or `BadRequest`)."""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
from typing import Any

from torch_reference.config import POSITIVE, Range

from ..config import BATCH, BEAM
from ..options import SAMPLING_FIELDS, Search, checked, option, sampling_of
from ..runtime import UserError

SERVE_INSTALL = 'pip install -e ".[serve]"'


def require(module: str) -> Any:
    """Import a package of the `serve` extra, or fail with one line naming the install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"{module} is not installed; it comes with the serve extra: {SERVE_INSTALL}") from None


def _limit(default, help: str, range: Range = POSITIVE):
    return option(default, help, range=Range(float, above=0.0) if isinstance(default, float) else range)


@checked
class Limits:
    """What one request may ask and how requests are batched (docs/serving.md#limits)."""

    max_body_bytes: int = _limit(1 << 20, "larger request bodies get 413")
    max_texts: int = _limit(64, "sentences per request")
    max_text_chars: int = _limit(2000, "characters per sentence (the model reads at most max_len tokens of it)")
    max_beam: int = _limit(16, "the largest beam (and number of samples) a request may ask for", BEAM)
    max_queue_sentences: int = _limit(4096, "sentences waiting or decoding; past it 429 with Retry-After")
    max_batch_sentences: int = _limit(512, "sentences decoded together", BATCH)
    max_batch_tokens: int = _limit(16384, "source tokens decoded together")
    max_batch_requests: int | None = _limit(None, "requests decoded together (1: no batching)")
    max_wait_ms: float = _limit(5.0, "how long the oldest waiting request waits for others to join its batch")
    request_timeout_s: float = _limit(60.0, "from a body's arrival to its translation; past it 503")
    body_timeout_s: float = _limit(10.0, "to receive a whole body (a slow client); past it 408")
    idle_timeout_s: float = _limit(5.0, "a connection that sends no whole request head for this long is closed")


@checked
class Listen:
    """Where the server listens (`Server`), and whether it logs each request."""

    host: str = option("127.0.0.1", "address to listen on (the default: this machine only; any other is said on the "
                       "first line)")
    port: int = option(8000, "port to listen on (0: a free one)", range=Range(int, low=0, below=65536))
    access_log: bool = option(False, "log every request on stderr")


class BadRequest(Exception):
    """A request the server refuses (400), with a one-line message."""


@checked
class Decoding:
    """A request's `Search`, `sample` with its `sampling` keywords, `attention`: equal options share a batch."""

    search: Search = Search()
    sample: bool = False
    sampling: tuple[tuple[str, Any], ...] = ()
    attention: bool = False

    def translate_options(self) -> dict[str, Any]:
        """`Run.translate`'s arguments."""
        return {"search": self.search, "sample": self.sample or None, **dict(self.sampling)}


SEARCH_FIELDS = tuple(f.name for f in dataclasses.fields(Search))


def decoding(fields: dict[str, Any], prefixes: bool = False) -> Decoding:
    """The options objects of a request's fields, each checked by its class as `Run.translate` builds them."""
    search = Search(**{k: v for k, v in fields.items() if k in SEARCH_FIELDS})
    sampling = {k: v for k, v in fields.items() if k in SAMPLING_FIELDS}
    if sampled := sampling_of(fields.get("sample"), sampling):
        sampled.check_with(search, prefixes)
    return Decoding(search, bool(fields.get("sample")), tuple(sorted(sampling.items())), fields.get("attention", False))


@dataclasses.dataclass(frozen=True)
class Request:
    """A /translate body: its texts, their forced prefixes (None: none) and decoding options."""

    texts: list[str]
    prefix: list[str | None] | None
    options: Decoding


FIELDS = ("texts", "prefix", *SEARCH_FIELDS, "sample", *SAMPLING_FIELDS, "attention")


def _reject_constant(name: str):
    raise BadRequest(f"{name} is not valid JSON (numbers must be finite)")


def _check_text(name: str, text: str, limits: Limits) -> None:
    if len(text) > limits.max_text_chars:
        raise BadRequest(f"{name} has {len(text)} characters; at most {limits.max_text_chars}")
    if "\n" in text or "\r" in text:
        raise BadRequest(f"{name} holds a line break: send one sentence per string")
    if re.search("[\ud800-\udfff]", text):  # a \uXXXX escape of half a pair: no character, no tokens
        raise BadRequest(f"{name} holds a lone surrogate (an unpaired \\ud800-\\udfff escape)")


def _json(body: bytes) -> Any:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        raise BadRequest(f"the body is not UTF-8 (byte {err.start})") from None
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as err:
        raise BadRequest(f"the body is not JSON: {err.msg} at line {err.lineno} column {err.colno}") from None
    except RecursionError:
        raise BadRequest("the body is nested too deeply") from None
    except ValueError:  # an integer past int's bound on digits (4300 by default)
        raise BadRequest("the body holds an integer too long to read") from None


def parse_request(body: bytes, limits: Limits) -> Request:
    """The texts, prefixes and decoding options of a /translate body; raises BadRequest with the first problem."""
    request = _json(body)
    if not isinstance(request, dict):
        raise BadRequest('the body must be a JSON object: {"texts": ["..."], "beam": 4, ...}')
    if unknown := sorted(set(request) - set(FIELDS)):
        raise BadRequest(f"unknown field {unknown[0]!r}; the fields are {', '.join(FIELDS)}")
    texts = request.pop("texts", None)
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise BadRequest("texts must be a non-empty list of strings")
    if len(texts) > limits.max_texts:
        raise BadRequest(f"texts holds {len(texts)} sentences; at most {limits.max_texts} per request")
    for i, t in enumerate(texts):
        if not t.strip():
            raise BadRequest(f"texts[{i}] is empty")
        _check_text(f"texts[{i}]", t, limits)
    prefix = request.pop("prefix", None)
    if prefix is not None:
        if not isinstance(prefix, list) or len(prefix) != len(texts) or not all(
                p is None or isinstance(p, str) for p in prefix):
            raise BadRequest("prefix must be a list of one string (or null) per text")
        for i, p in enumerate(prefix):
            _check_text(f"prefix[{i}]", p or "", limits)
    for name in ("beam", "num_samples"):  # the server's own bound on the work of one request
        value = request.get(name, 1)
        if isinstance(value, int) and value > limits.max_beam:
            raise BadRequest(f"{name} {value} is more than this server's limit, {limits.max_beam}")
    try:
        options = decoding(request, prefix is not None and any(prefix))
    except UserError as err:
        raise BadRequest(str(err)) from None
    return Request(texts, prefix, options)
