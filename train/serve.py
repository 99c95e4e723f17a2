"""`python -m train.serve --run-dir RUN [--host 127.0.0.1] [--port 8000]` (`aiayn serve`): serve a run over HTTP.

`POST /translate`, `GET /health`, `GET /info` and a page at `/` (`train.serving`, docs/serving.md).
SIGTERM or Ctrl-C stops accepting, finishes the requests in flight and exits 0; SIGHUP or a second
Ctrl-C stops at once, answering them 503 (retry), and exits 128 + the signal.
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
from pathlib import Path

from .backends.host_devices import split_host
from .config import Range, positive_int
from .runtime import exit_status
from .runtime.files import UserError, error_text
from .serving import Limits, StoppedAtOnce, serve


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m train.serve",
        description="Serve a run trained by `python -m train.run` over HTTP: POST /translate with JSON "
        '{"texts": [...], "beam": 4, ...} (every option of Run.translate: n_best, prefix, alignments, sample, '
        'seed, ...; docs/serving.md), GET /health, GET /info, '
        "and a page at / that translates and draws the cross-attention. Concurrent requests are decoded together "
        "in batches. SIGTERM or Ctrl-C stops accepting, finishes the requests in flight and exits 0; SIGHUP or "
        "a second Ctrl-C stops at once, answering them 503 (retry), and exits 129 or 130. Needs the serve extra: "
        'pip install -e ".[serve]".',
    )
    parser.add_argument("--run-dir", required=True, type=Path, action="append",
                        help="the run directory to serve; several: an ensemble (their log-probabilities averaged)")
    parser.add_argument("--checkpoint", default="best", help="'best' (the default), 'latest', or a step number")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=Range(int, low=0, below=65536).parse, default=8000,
                        help="port to listen on (default 8000; 0: a free one)")
    parser.add_argument("--devices", type=positive_int, help="jax runs: decode over the first N devices (default: "
                        "every visible device); a torch run serves on one device and refuses N > 1")
    parser.add_argument("--access-log", action="store_true", help="log every request on stderr")
    limits = parser.add_argument_group("limits and batching (docs/serving.md#limits)")
    defaults = Limits()
    for field in dataclasses.fields(Limits):
        kind = field.metadata["range"].parse
        default = getattr(defaults, field.name)
        limits.add_argument(f"--{field.name.replace('_', '-')}", type=kind, default=default, metavar="N",
                            help=f"{field.metadata['help']} (default {default if default is not None else 'none'})")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    limits = Limits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Limits)})

    def ready(server) -> None:
        public = " (listening beyond loopback: other machines can reach it)" if server.beyond_loopback else ""
        print(f"serving {' + '.join(map(str, args.run_dir))} on {server.url}{public} (POST /translate, GET /health, "
              "GET /info, the page at /); Ctrl-C or SIGTERM stops", file=sys.stderr, flush=True)

    try:
        split_host()  # before jax is imported
        signum = serve(args.run_dir, args.host, args.port, checkpoint=args.checkpoint, devices=args.devices,
                       limits=limits, on_ready=ready, access_log=args.access_log)
    except (UserError, OSError, ValueError) as err:
        parser.exit(1, f"error: {error_text(err)}\n")
    except StoppedAtOnce as stop:  # SIGHUP or a second Ctrl-C
        print(stop, file=sys.stderr)
        return 128 + stop.signum
    except KeyboardInterrupt:  # a third Ctrl-C while serving (or one while loading the run)
        print("stopped at once by Ctrl-C: any request in flight was cancelled, not answered", file=sys.stderr)
        return 128 + signal.SIGINT
    print(f"stopped{f' by signal {signum}' if signum else ''}: the requests in flight were answered", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(exit_status(main))
