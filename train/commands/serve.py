"""Serve a run trained by `python -m train.run` over HTTP (`train.serving`, docs/serving.md): POST
/translate with JSON {"texts": [...], "beam": 4, ...} (every option of Run.translate: n_best, prefix,
alignments, sample, seed, ...), GET /health, GET /info, and a page at / that translates and draws the
cross-attention. Concurrent requests are decoded together in batches. SIGTERM or Ctrl-C stops accepting,
finishes the requests in flight and exits 0; SIGHUP or a second Ctrl-C stops at once, answering them 503
(retry), and exits 129 or 130. Needs the serve extra: pip install -e ".[serve]".
"""

from __future__ import annotations

import argparse
import sys

from ..backends.host_devices import split_host
from ..options import RunSelection, add_flags, build, command, run
from ..serving import Limits, Listen, serve


def build_parser() -> argparse.ArgumentParser:
    parser = command("aiayn serve", __doc__, Listen)
    add_flags(parser, RunSelection, skip=("coordinator_address", "num_processes", "process_id"))
    add_flags(parser, Limits, group=parser.add_argument_group("limits and batching (docs/serving.md#limits)"))
    return parser


def main(argv: list[str] | None = None) -> int:
    def job(given: dict) -> None:
        selection = build(RunSelection, given)

        def ready(server) -> None:
            public = " (listening beyond loopback: other machines can reach it)" if server.beyond_loopback else ""
            print(f"serving {' + '.join(map(str, selection.run_dir))} on {server.url}{public} (POST /translate, GET "
                  "/health, GET /info, the page at /); Ctrl-C or SIGTERM stops", file=sys.stderr, flush=True)

        split_host()  # before jax is imported
        listen = build(Listen, given)
        signum = serve(selection, listen.host, listen.port, limits=build(Limits, given), on_ready=ready,
                       access_log=listen.access_log)
        print(f"stopped{f' by signal {signum}' if signum else ''}: the requests in flight were answered",
              file=sys.stderr)

    return run(build_parser(), argv, job)


if __name__ == "__main__":
    sys.exit(main())
