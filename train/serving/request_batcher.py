"""Concurrent requests into batches, decoded on one worker thread (docs/serving.md#batching)."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import itertools
from collections.abc import Callable

from ..runtime import UserError
from .limits import Limits, Request


class QueueFull(Exception):
    """The request batcher holds `max_queue_sentences` already."""


@dataclasses.dataclass(eq=False)
class _Pending:
    request: Request
    tokens: int
    future: asyncio.Future
    arrived: float

    def key(self) -> tuple:
        """Requests of equal keys may share a batch: the same options, all with prefixes or none."""
        return self.request.options, self.request.prefix is None


class RequestBatcher:
    """Queues requests (`submit`) and decodes batches of them on one worker thread (`run`)."""

    def __init__(self, decode: Callable[..., list], limits: Limits):
        self.decode, self.limits = decode, limits
        self.queue: collections.deque[_Pending] = collections.deque()
        self.queued = 0  # sentences in `queue` and in the batch decoding
        self.stats = collections.Counter()  # batches, requests, sentences decoded
        self._wake = asyncio.Event()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="decode")

    def submit(self, request: Request, tokens: int) -> asyncio.Future:
        """Queue a request; QueueFull past `max_queue_sentences` (a request alone in an empty queue always enters)."""
        texts = len(request.texts)
        if self.queued and self.queued + texts > self.limits.max_queue_sentences:
            raise QueueFull(f"the server holds {self.queued} sentences, its limit is {self.limits.max_queue_sentences}")
        loop = asyncio.get_running_loop()
        self.queue.append(_Pending(request, tokens, loop.create_future(), loop.time()))
        self.queued += texts
        self._wake.set()
        return self.queue[-1].future

    def _batch(self) -> tuple[list[_Pending], bool]:
        """(the requests of the next batch, whether the batch is full), leaving them queued."""
        lim = self.limits
        batch, sentences, tokens = [], 0, 0
        for item in self.queue:
            if item.future.done() or (batch and item.key() != batch[0].key()):
                continue
            if batch and (sentences + len(item.request.texts) > lim.max_batch_sentences
                          or tokens + item.tokens > lim.max_batch_tokens):
                return batch, True
            batch.append(item)
            sentences, tokens = sentences + len(item.request.texts), tokens + item.tokens
            if item.request.options.sample or len(batch) == lim.max_batch_requests:  # a sample is its request's own
                return batch, True
        return batch, False

    def _drop_done(self) -> None:
        """Forget the requests whose futures are done (timed out while queued)."""
        for item in [i for i in self.queue if i.future.done()]:
            self.queue.remove(item)
            self.queued -= len(item.request.texts)

    def _decode(self, batch: list[_Pending]) -> list[list | Exception]:
        """Each request's results (or the exception that failed it), on the worker thread."""
        texts = [t for item in batch for t in item.request.texts]
        prefixes = None if batch[0].request.prefix is None else [p for item in batch for p in item.request.prefix]
        try:
            results = self.decode(texts, prefixes, batch[0].request.options)
        except UserError as err:  # one request's (a prefix too long): said to it alone
            return [err] if len(batch) == 1 else [r for item in batch for r in self._decode([item])]
        except Exception as err:  # noqa: BLE001 (the model failed on this batch: said to its requests; the server goes on)
            return [err] * len(batch)
        starts = [0, *itertools.accumulate(len(item.request.texts) for item in batch)]
        return [results[a:b] for a, b in zip(starts, starts[1:])]

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
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), wait)
                continue  # look again: the batch may have grown (or timed out)
            for item in batch:
                self.queue.remove(item)
            sentences = sum(len(item.request.texts) for item in batch)
            try:
                results = await loop.run_in_executor(self._executor, self._decode, batch)
            finally:
                self.queued -= sentences
            self.stats.update(batches=1, requests=len(batch), sentences=sentences)
            for item, result in zip(batch, results):
                if not item.future.done():
                    if isinstance(result, Exception):
                        item.future.set_exception(result)
                    else:
                        item.future.set_result(result)

    def close(self) -> None:
        """Wait for the batch decoding, then stop the worker thread."""
        self._executor.shutdown(wait=True)
