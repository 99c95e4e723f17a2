"""`python -m train.loadtest --run-dir RUN --data SPEC` (`aiayn loadtest`): load a served run on loopback.

Starts `python -m train.serve` on the run (or targets --url), sends --requests requests of 1 to
--max-texts sentences from --clients concurrent clients, and prints errors, latency percentiles and
sentences/s; --unbatched repeats it with one request per batch, --cli times `python -m
train.translate` on the same sentences (`train.loadgen`, docs/serving.md#load-test).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .config import positive_int
from .loadgen import ServedRun, cli_throughput, load_test, read_lines
from .runtime import exit_status, read_experiment
from .runtime.files import UserError, error_text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m train.loadtest", description=__doc__.split("\n\n")[1])
    parser.add_argument("--run-dir", required=True, type=Path, help="the run to serve (and to translate with --cli)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", metavar="SPEC", help="the source side of a data spec: numbers:test, FILE.tsv, ...")
    source.add_argument("--input", type=Path, help="a file of source sentences, one per line")
    parser.add_argument("--url",
                        help="load this running server instead of starting one (then no --unbatched or --serve-args)")
    parser.add_argument("--clients", type=positive_int, default=64, help="concurrent clients (default 64)")
    parser.add_argument("--requests", type=positive_int, default=2000, help="requests in all (default 2000)")
    parser.add_argument("--max-texts", type=positive_int, default=8, help="sentences per request: 1 to N (default 8)")
    parser.add_argument("--beam", type=positive_int, default=4, help="beam size of every request (default 4)")
    parser.add_argument("--unbatched", action="store_true",
                        help="also serve with --max-batch-requests 1 (no batching) under the same load")
    parser.add_argument("--cli", action="store_true", help="also time python -m train.translate on the same sentences")
    parser.add_argument("--serve-args", default="", help="more flags for python -m train.serve, e.g. '--max-wait-ms 2'")
    return parser


def row(name: str, result: dict) -> str:
    if "latency_ms" not in result:
        return f"| {name} | {result['sentences']:,} | | {result['sentences_per_s']:,.1f} | | |"
    lat = result["latency_ms"]
    latency = f"{lat['p50']:,.0f} | {lat['p99']:,.0f}" if lat else "none answered | none answered"
    return f"| {name} | {result['sentences']:,} | {result['errors']} | {result['sentences_per_s']:,.1f} | {latency} |"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.url and (args.unbatched or args.serve_args):
        parser.error("--unbatched and --serve-args start servers of their own: give them without --url")
    try:
        if args.input is not None:
            lines = read_lines(args.input)
        else:
            from .data.splits import load_split

            lines = [s for s, _ in load_split(read_experiment(args.run_dir), args.data)]
        if not lines:
            raise UserError("no sentence to send")
        load = {"clients": args.clients, "requests": args.requests, "max_texts": args.max_texts, "beam": args.beam}
        results = {}
        setups = {"served, batched": args.serve_args.split()}
        if args.unbatched:
            setups["served, one request per batch"] = [*args.serve_args.split(), "--max-batch-requests", "1"]
        for name, flags in setups.items():
            if args.url:
                results[name] = load_test(args.url, lines, **load)
                break
            with ServedRun(args.run_dir, *flags) as served:
                print(f"{name}: {served.url} ...", file=sys.stderr, flush=True)
                results[name] = load_test(served.url, lines, **load)
        if args.cli:
            pool = [lines[i % len(lines)] for i in range(max(len(lines), sum(r["sentences"] for r in results.values())
                                                              // len(results)))]
            results["CLI bulk (python -m train.translate)"] = cli_throughput(args.run_dir, pool, args.beam)
    except (UserError, OSError, ValueError) as err:
        parser.exit(1, f"error: {error_text(err)}\n")
    print(json.dumps(results, indent=1))
    print(f"\n{args.clients} clients, {args.requests:,} requests of 1-{args.max_texts} sentences, beam {args.beam}\n")
    print("| setup | sentences | errors | sentences/s | p50 ms | p99 ms |\n|---|---|---|---|---|---|")
    for name, result in results.items():
        print(row(name, result))
    return 1 if any(r.get("errors") for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(exit_status(main))
