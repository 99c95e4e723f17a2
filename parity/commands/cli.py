"""`aiayn`: one installed command whose subcommands are the project's commands: `aiayn train ARGS` calls
`train.commands.run.main(ARGS)`, and so on for each name below (`aiayn --help` lists them). It lives in
`parity`, the package above all the others, so that it may name the commands of both `train` and `parity`."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {  # subcommand: (module, what it does)
    "train": ("train.commands.run", "train (or resume) a model and evaluate it; recipes with --config"),
    "translate": ("train.commands.translate", "translate text with a trained run"),
    "evaluate": ("train.commands.evaluate", "score a run on parallel data: loss, BLEU, chrF, exact match"),
    "score": ("train.commands.score", "the log-probability of given translations under a trained run"),
    "average": ("train.commands.average", "average a run's last checkpoints into a new run"),
    "curves": ("train.commands.curves", "redraw a run's learning curves"),
    "serve": ("train.commands.serve", "serve a run over HTTP: batched translation, a page that shows the attention"),
    "loadtest": ("train.commands.loadtest", "load a served run with concurrent clients: latency and throughput"),
    "bench": ("train.commands.bench", "time the training step of both frameworks"),
    "profile": ("train.commands.profile_step", "where a training step's time goes"),
    "convert": ("parity.commands.convert", "weights and runs between frameworks, Marian in and out, CTranslate2"),
    "check": ("parity.commands.check", "logits, loss and gradients of both twins on the same weights"),
    "trajectory": ("parity.commands.trajectory", "one training curve in both frameworks"),
    "translate-bench": ("parity.commands.translate_bench", "search speed of both frameworks on one run's weights"),
}

USAGE = "usage: aiayn COMMAND [ARGS...]   (aiayn COMMAND --help for its flags)\n\ncommands:\n" + "".join(
    f"  {name:<16}{what}\n" for name, (_, what) in COMMANDS.items())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print("aiayn: the Transformer of 'Attention Is All You Need' in PyTorch and JAX\n\n" + USAGE)
        return 0
    if argv[0] not in COMMANDS:
        print(f"aiayn: unknown command {argv[0]!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    command = importlib.import_module(COMMANDS[argv[0]][0]).main  # it ends by the one protocol (options.run)
    return command(argv[1:], **({"process_settings": True} if argv[0] == "train" else {}))


if __name__ == "__main__":
    sys.exit(main())
