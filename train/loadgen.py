"""Load on a translation server (`python -m train.loadtest`, docs/serving.md#load-test): concurrent
clients on loopback, each sending requests of a few sentences one after the other, with latency
percentiles and throughput."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from .serving import require


def load_test(url: str, lines: Sequence[str], *, clients: int = 64, requests: int = 2000, min_texts: int = 1,
              max_texts: int = 8, beam: int = 4, seed: int = 0, timeout: float = 300.0) -> dict[str, Any]:
    """`clients` concurrent clients (one connection each) send `requests` POST /translate requests
    in all, each of `min_texts`..`max_texts` lines drawn from `lines` (seeded). Returns counts
    (requests, sentences, errors, statuses), seconds, sentences/s, requests/s and latency
    percentiles in ms (p50, p90, p99, max) of the answered requests."""
    httpx = require("httpx")
    rng = random.Random(seed)
    bodies = [{"texts": rng.choices(lines, k=rng.randint(min_texts, max_texts)), "beam": beam} for _ in range(requests)]
    latencies, failures, statuses = [], [], Counter()  # seconds of each answered request; what went wrong

    async def client(http, queue: asyncio.Queue) -> None:
        while not queue.empty():
            body = queue.get_nowait()
            start = time.perf_counter()
            try:
                reply = await http.post(f"{url}/translate", json=body)
            except httpx.HTTPError as err:
                statuses[type(err).__name__] += 1
                failures.append(f"{type(err).__name__}: {err}")
                continue
            statuses[reply.status_code] += 1
            if reply.status_code == 200 and len(reply.json()["translations"]) == len(body["texts"]):
                latencies.append(time.perf_counter() - start)
            else:
                failures.append(f"{reply.status_code}: {reply.text[:200]}")

    async def main() -> float:
        queue: asyncio.Queue = asyncio.Queue()
        for body in bodies:
            queue.put_nowait(body)
        limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as http:
            start = time.perf_counter()
            await asyncio.gather(*(client(http, queue) for _ in range(clients)))
            return time.perf_counter() - start

    seconds = asyncio.run(main())
    ms = np.array(latencies) * 1000 if latencies else np.zeros(1)
    sentences = sum(len(b["texts"]) for b in bodies)
    return {"url": url, "clients": clients, "requests": requests, "sentences": sentences, "errors": len(failures),
            "statuses": {str(k): v for k, v in statuses.items()}, "first_errors": failures[:3],
            "seconds": round(seconds, 3), "sentences_per_s": round(sentences / seconds, 1),
            "requests_per_s": round(requests / seconds, 1),
            "latency_ms": {f"p{q}": round(float(np.percentile(ms, q)), 1) for q in (50, 90, 99)}
            | {"max": round(float(ms.max()), 1)}}
