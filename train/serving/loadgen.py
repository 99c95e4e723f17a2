"""Load on a translation server (`aiayn loadtest`, docs/serving.md#load-test), and translate's speed."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..options import POSITIVE, OptionError, checked, option
from ..runtime.files import UserError
from .limits import Limits, require


@checked
class Load:
    """A load test of `run_dir` (`load_run`): `requests` requests of 1 to `max_texts` sentences from `clients`."""

    run_dir: Path = option(None, "the run to serve (and to translate with --cli)", required=True)
    data: str | None = option(None, "the source side of a data spec: numbers:test, FILE.tsv, ...", metavar="SPEC")
    input: Path | None = option(None, "a file of source sentences, one per line (instead of --data)")
    url: str | None = option(None, "load this running server instead of starting one (then no --unbatched or "
                             "--serve-args)")
    clients: int = option(64, "concurrent clients", range=POSITIVE)
    requests: int = option(2000, "requests in all", range=POSITIVE)
    max_texts: int = option(8, "sentences per request: 1 to N", range=POSITIVE, metavar="N")
    beam: int = option(4, "beam size of every request", range=POSITIVE)
    unbatched: bool = option(False, "also serve with --max-batch-requests 1 (no batching) under the same load")
    cli: bool = option(False, "also time aiayn translate on the same sentences")
    serve_args: str = option("", "more flags for aiayn serve, e.g. '--max-wait-ms 2'")

    def check(self) -> None:
        if (self.data is None) == (self.input is None):
            raise OptionError("give {} or {}: the sentences to send", "data", "input")
        if self.url and (self.unbatched or self.serve_args):
            raise OptionError("{} and {} start servers of their own: give them without {}", "unbatched", "serve_args",
                              "url")


def load_run(load: Load) -> dict[str, dict[str, Any]]:
    """`load_test` of each setup `load` asks for (served batched, unbatched; `cli_throughput`), by name."""
    if load.input is not None:
        lines = read_lines(load.input)
    else:
        from ..data.splits import load_split
        from ..runtime import read_experiment

        lines = [s for s, _ in load_split(read_experiment(load.run_dir), load.data)]
    if not lines:
        raise UserError("no sentence to send")
    settings = {"clients": load.clients, "requests": load.requests, "max_texts": load.max_texts, "beam": load.beam}
    setups, results = {"served, batched": load.serve_args.split()}, {}
    if load.unbatched:
        setups["served, one request per batch"] = [*load.serve_args.split(), "--max-batch-requests", "1"]
    for name, flags in setups.items():
        if load.url:
            results[name] = load_test(load.url, lines, **settings)
            break
        with ServedRun(load.run_dir, *flags) as served:
            print(f"{name}: {served.url} ...", file=sys.stderr, flush=True)
            results[name] = load_test(served.url, lines, **settings)
    if load.cli:
        sent = sum(r["sentences"] for r in results.values()) // len(results)
        pool = [lines[i % len(lines)] for i in range(max(len(lines), sent))]
        results["CLI bulk (aiayn translate)"] = cli_throughput(load.run_dir, pool, load.beam)
    return results


def load_test(url: str, lines: Sequence[str], *, clients: int = 64, requests: int = 2000, min_texts: int = 1,
              max_texts: int = 8, beam: int = 4, seed: int = 0, timeout: float = 300.0) -> dict[str, Any]:
    """`clients` clients send `requests` seeded requests: counts, rates and latency percentiles in ms."""
    httpx = require("httpx")
    rng = random.Random(seed)
    bodies = [{"texts": rng.choices(lines, k=rng.randint(min_texts, max_texts)), "beam": beam} for _ in range(requests)]
    latencies, translated, failures, statuses = [], [], [], Counter()  # each answered request's seconds and sentences

    async def client(http, pending: Iterator[dict]) -> None:
        for body in pending:  # one iterator shared by the clients: each body is sent once
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
                translated.append(len(body["texts"]))
            else:
                failures.append(f"{reply.status_code}: {reply.text[:200]}")

    async def main() -> float:
        pending = iter(bodies)
        limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as http:
            start = time.perf_counter()
            await asyncio.gather(*(client(http, pending) for _ in range(clients)))
            return time.perf_counter() - start

    seconds = asyncio.run(main())
    ms = np.array(latencies) * 1000
    sentences = sum(translated)
    return {"url": url, "clients": clients, "requests": requests, "sentences": sentences, "errors": len(failures),
            "statuses": {str(k): v for k, v in statuses.items()}, "first_errors": failures[:3],
            "seconds": round(seconds, 3), "sentences_per_s": round(sentences / seconds, 1),
            "requests_per_s": round(len(latencies) / seconds, 1),
            "latency_ms": {f"p{q}": round(float(np.percentile(ms, q)), 1) for q in (50, 90, 99)}
            | {"max": round(float(ms.max()), 1)} if latencies else None}  # none answered: no latency


def read_lines(path: str | os.PathLike, max_chars: int = Limits().max_text_chars) -> list[str]:
    """The non-blank lines of a file, stripped; one past `max_chars` (the server's bound) refused, never held whole."""
    lines = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(iter(lambda: f.readline(max_chars + 2), ""), 1):
            if len(line.rstrip("\r\n")) > max_chars:
                raise UserError(f"{path} line {number} is longer than {max_chars} characters, which the server refuses")
            if line.strip():
                lines.append(line.strip())
    return lines


class ServedRun(contextlib.AbstractContextManager):
    """`aiayn serve --run-dir RUN --port 0 ARGS` in a child process: `url` once it listens; stopped on exit."""

    def __init__(self, run_dir: str | os.PathLike, *args: str, startup_s: float = 300.0):
        command = [sys.executable, "-m", "train.commands.serve", "--run-dir", str(run_dir), "--port", "0", *args]
        self.proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.log: list[str] = []
        self.url: str | None = None
        listening = threading.Event()

        def read() -> None:  # on a thread: the deadline holds on a silent server, and a chatty one never blocks
            for line in self.proc.stderr:
                self.log.append(line)
                if self.url is None and (found := re.search(r" on (http://\S+) ", line)):
                    self.url = found[1]
                    listening.set()
            listening.set()  # it exited

        threading.Thread(target=read, daemon=True).start()
        if not listening.wait(startup_s) or self.url is None:
            self.proc.kill()
            self.proc.wait()
            raise UserError(f"the server did not start: {''.join(self.log).strip() or 'no output'}")

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(120)


def cli_throughput(run_dir: str | os.PathLike, lines: Sequence[str], beam: int = 4) -> dict[str, Any]:
    """`aiayn translate` on `lines`: its summary's lines/s (loading the run left out) and its wall time."""
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "source.txt"
        source.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "train.commands.translate", "--run-dir", str(run_dir), "--input",
                               str(source), "--output", str(Path(tmp) / "out.txt"), "--beam", str(beam)],
                              check=False, capture_output=True, text=True)
        wall = time.perf_counter() - start
    found = re.search(r"translated ([\d,]+) lines in ([\d.]+) s: ([\d,.]+) lines/s", done.stderr)
    if done.returncode or not found:
        raise UserError(f"aiayn translate failed: {done.stderr.strip().splitlines()[-1:]}")
    return {"sentences": int(found[1].replace(",", "")), "seconds": float(found[2]),
            "sentences_per_s": float(found[3].replace(",", "")), "wall_seconds": round(wall, 1)}
