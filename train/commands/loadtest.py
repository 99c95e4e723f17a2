"""`aiayn loadtest --run-dir RUN --data SPEC` (`aiayn loadtest`): load a served run on loopback.

Starts `aiayn serve` on the run (or targets --url), sends --requests requests of 1 to
--max-texts sentences from --clients concurrent clients, and prints errors, latency percentiles and
sentences/s; --unbatched repeats it with one request per batch, --cli times `python -m
aiayn translate` on the same sentences (`train.serving.loadgen.load_run`, docs/serving.md#load-test).
"""

from __future__ import annotations

import json
import sys

from ..options import build, command, run
from ..serving.loadgen import Load, load_run


def build_parser():
    return command("aiayn loadtest", __doc__.split("\n\n")[1], Load)


def row(name: str, result: dict) -> str:
    if "latency_ms" not in result:
        return f"| {name} | {result['sentences']:,} | | {result['sentences_per_s']:,.1f} | | |"
    lat = result["latency_ms"]
    latency = f"{lat['p50']:,.0f} | {lat['p99']:,.0f}" if lat else "none answered | none answered"
    return f"| {name} | {result['sentences']:,} | {result['errors']} | {result['sentences_per_s']:,.1f} | {latency} |"


def main(argv: list[str] | None = None) -> int:
    def job(given: dict) -> int:
        load = build(Load, given)
        results = load_run(load)
        print(json.dumps(results, indent=1))
        print(f"\n{load.clients} clients, {load.requests:,} requests of 1-{load.max_texts} sentences, "
              f"beam {load.beam}\n")
        print("| setup | sentences | errors | sentences/s | p50 ms | p99 ms |\n|---|---|---|---|---|---|")
        for name, result in results.items():
            print(row(name, result))
        return 1 if any(r.get("errors") for r in results.values()) else 0

    return run(build_parser(), argv, job)


if __name__ == "__main__":
    sys.exit(main())
