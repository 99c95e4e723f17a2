"""The commands, `aiayn NAME` (`train`'s here, `parity`'s in parity/commands): each its options' flags and
one call; the library never imports them. `aiayn` itself is `main` below: COMMANDS names every one."""

from __future__ import annotations

import importlib
import sys
from typing import NamedTuple


class Command(NamedTuple):
    module: str  # its `main(argv)` runs it
    what: str
    process_settings: bool = False  # main(argv, process_settings=True): it may re-execute the process (allocator)


COMMANDS = {
    "train": Command("train.commands.run", "train (or resume) a model and evaluate it; recipes with --config", True),
    "translate": Command("train.commands.translate", "translate text with a trained run"),
    "evaluate": Command("train.commands.evaluate", "score a run on parallel data: loss, BLEU, chrF, exact match"),
    "score": Command("train.commands.score", "the log-probability of given translations under a trained run"),
    "average": Command("train.commands.average", "average a run's last checkpoints into a new run"),
    "curves": Command("train.commands.curves", "redraw a run's learning curves"),
    "serve": Command("train.commands.serve", "serve a run over HTTP: batched translation, a page that shows the "
                     "attention"),
    "loadtest": Command("train.commands.loadtest", "load a served run with concurrent clients: latency and throughput"),
    "bench": Command("train.commands.bench", "time the training step of both frameworks"),
    "profile": Command("train.commands.profile_step", "where a training step's time goes"),
    "convert": Command("parity.commands.convert", "weights and runs between frameworks, Marian in and out, "
                       "CTranslate2"),
    "check": Command("parity.commands.check", "logits, loss and gradients of both twins on the same weights"),
    "trajectory": Command("parity.commands.trajectory", "one training curve in both frameworks"),
    "translate-bench": Command("parity.commands.translate_bench", "search speed of both frameworks on one run's "
                               "weights"),
}

USAGE = "usage: aiayn COMMAND [ARGS...]   (aiayn COMMAND --help for its flags)\n\ncommands:\n" + "".join(
    f"  {name:<16}{command.what}\n" for name, command in COMMANDS.items())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print("aiayn: the Transformer of 'Attention Is All You Need' in PyTorch and JAX\n\n" + USAGE)
        return 0
    if argv[0] not in COMMANDS:
        print(f"aiayn: unknown command {argv[0]!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    command = COMMANDS[argv[0]]
    run = importlib.import_module(command.module).main  # it ends by the one protocol (options.run)
    return run(argv[1:], **({"process_settings": True} if command.process_settings else {}))


if __name__ == "__main__":
    sys.exit(main())
