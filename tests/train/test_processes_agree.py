"""The processes of one run agree on its settings or refuse, before any file is written: JAX over two
processes (jax.distributed on 127.0.0.1) and torch over two nodes of one process each (torchrun's
environment, gloo), one process started with another --seed or --lr-factor than process 0."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = ["--preset", "tiny", "--numbers-train", "200", "--numbers-valid", "4", "--numbers-test", "0", "--max-len", "16",
        "--token-budget", "256", "--vocab-size", "300", "--steps", "1", "--eval-sentences", "2", "--beam", "1",
        "--samples", "0", "--no-progress", "--threads", "1"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _processes(backend: str, run_dir: Path, extra: list[list[str]]) -> list[tuple[int, str]]:
    """Two `python -m train.run` processes of one run, process i with `extra[i]`: (status, stderr) each."""
    port = _port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO), XLA_FLAGS="--xla_force_host_platform_device_count=1")
    procs = []
    for i in range(2):
        if backend == "jax":
            launch = ["--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)]
            own = {}
        else:  # what torchrun --nnodes 2 --nproc-per-node 1 gives each node's process
            launch, own = [], {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": str(i),
                               "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "train.run", *TINY, "--backend", backend, "--run-dir", str(run_dir), *launch,
             *extra[i]], cwd=REPO, env={**env, **own}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return [(p.wait(timeout=600), p.communicate()[1]) for p in procs]  # the limit only catches a hang


@pytest.mark.parametrize("backend,flag,value,named", [
    ("jax", "--seed", "7", "--seed"),
    ("jax", "--lr-factor", "3", "--lr-factor"),
    ("torch", "--seed", "7", "--seed"),
])
def test_processes_that_disagree_stop_in_one_line_before_writing(tmp_path, backend, flag, value, named):
    run_dir = tmp_path / "run"
    ended = _processes(backend, run_dir, [[], [flag, value]])
    for rank, (status, err) in enumerate(ended):
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert status == 1 and len(lines) == 1, (rank, err[-3000:])
        assert lines[0].startswith(f"error: the run's processes disagree on {named}: process 1 has another value "
                                   "than process 0"), lines
    assert not run_dir.exists()  # no run directory, so the corrected command starts afresh
