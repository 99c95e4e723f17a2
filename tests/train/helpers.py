"""Helpers shared by the tests of run directories, checkpoints, crashes and disk errors: tiny run
settings (as fields and as flags), real `python -m train.run` processes, one-line error checks
and snapshots of the files under a directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


import train
from train import runtime

REPO = Path(__file__).resolve().parents[2]

# ----------------------------------------------------------------------------------------------
# Tiny runs

# ExperimentConfig fields of a tiny in-process run (1+1 layers, 16 tokens, no evaluation unless asked).
FAST_IN_PROCESS = dict(
    numbers_train=1500, numbers_valid=4, numbers_test=0, max_len=16, token_budget=512, warmup=2,
    model={"num_encoder_layers": 1, "num_decoder_layers": 1}, progress=False, samples=0,
    eval_every=100, eval_sentences=4, beam=1,
)
# The same with every step logged (tests import it as TINY).
TINY_FIELDS = dict(
    numbers_train=1500, numbers_valid=4, numbers_test=0, max_len=16, token_budget=512, warmup=2,
    model={"num_encoder_layers": 1, "num_decoder_layers": 1}, progress=False, samples=0,
    eval_sentences=4, beam=1, log_every=1,
)
# `python -m train.run` flags of a tiny torch run on one thread (tests import it as TINY).
TINY_ARGV = ["--backend", "torch", "--numbers-train", "300", "--numbers-valid", "4", "--numbers-test", "0",
             "--max-len", "16", "--token-budget", "512", "--set", "num_encoder_layers=1", "--set",
             "num_decoder_layers=1", "--no-progress", "--samples", "0", "--eval-sentences", "4", "--beam", "1",
             "--threads", "1"]

# ----------------------------------------------------------------------------------------------
# `python -m train.run` in a real process: a 20-step run saving every 5 steps

STEPS = 20
FLAGS = [
    "--numbers-train", "1500", "--numbers-valid", "8", "--numbers-test", "0", "--max-len", "16",
    "--token-budget", "512", "--set", "num_encoder_layers=1", "--set", "num_decoder_layers=1",
    "--no-progress", "--samples", "0", "--steps", str(STEPS), "--warmup", "5", "--log-every", "1",
    "--eval-every", "1000", "--save-every", "5", "--eval-sentences", "8", "--beam", "1",
]


def launch(backend: str, run_dir: Path, *extra: str) -> subprocess.Popen:
    """`python -m train.run` in a child process, stdout and stderr merged, unbuffered."""
    command = [sys.executable, "-m", "train.run", f"--backend={backend}", "--run-dir", str(run_dir), *FLAGS, *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def read_until(proc: subprocess.Popen, text: str) -> str:
    """The child's output up to the first line containing `text`; fails if it exits first."""
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if text in line:
            return "".join(seen)
    proc.wait()
    raise AssertionError(f"the run ended (exit {proc.returncode}) before printing {text!r}:\n{''.join(seen)}")


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def restored_step(run_dir: Path, which) -> int:
    run = train.load(run_dir, which)
    run.backend.close()
    return run.backend.step


# ----------------------------------------------------------------------------------------------
# Command-line results and files on disk


def one_error_line(stderr: str | bytes, *fragments: str) -> str:
    """The one non-empty stderr line, which starts with 'error: ' and holds every fragment."""
    text = stderr.decode(errors="replace") if isinstance(stderr, bytes) else stderr
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), text
    for fragment in fragments:
        assert fragment in lines[0], (fragment, text)
    return lines[0]


def exit_code(main, argv) -> int:
    """`main(argv)`'s exit status, returned or raised (argparse's parser.exit)."""
    try:
        return main([str(a) for a in argv])
    except SystemExit as exited:
        return exited.code


def _exit_status(main, argv, capsys) -> tuple[int, str]:
    """`main(argv)`'s exit status, returned or raised (SystemExit: argparse's), and its stderr."""
    try:
        code = main(argv)
    except SystemExit as info:
        code = info.code
    return code, capsys.readouterr().err


def files_of(directory: Path) -> dict[str, bytes]:
    """Every file under `directory` (links followed) with its bytes."""
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def run_files(run_dir: Path) -> dict[str, bytes]:
    """`files_of` but locks (which name the process holding them)."""
    return {name: data for name, data in files_of(run_dir).items() if Path(name).name != runtime.LOCK_FILE}
