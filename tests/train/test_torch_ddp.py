"""The torch backend on two processes (gloo, CPU): DistributedDataParallel through `train.run --devices 2`.

- the 2-process curve equals the 1-device curve (same global batches), with DDP and with FSDP2 (whose
  checkpoint resumes on one device);
- a run trained on torch over 2 processes continues on JAX over 2 devices and the other way, the
  losses those of the run continuing in its own framework (the torch 2-process curve against JAX's);
- SIGTERM to process 0 saves one checkpoint (all processes stop at the same update), a killed
  process ends the others in one line, and --resume continues after both;
- NCCL asked for on a CPU is one line.

Bound 1e-5 relative per update: docs/parity.md's training-curve bound (dropout off).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from train import loop
from train.commands import run as train_run
from train.config import ExperimentConfig
from train.interop.runs import convert_run

REPO = Path(__file__).resolve().parents[2]
# buckets of 8 and 16 tokens, batches of 32 and 16 rows: the same for 1 and 2 devices
FLAGS = dict(preset="tiny", numbers_train=300, numbers_valid=4, numbers_test=0, max_len=16, token_budget=256,
             dropout=0.0, warmup=4, log_every=1, eval_every=1000, eval_sentences=4, samples=0, progress=False,
             threads=1, save_every=3, average_last=1)  # resumed past their end: from their own weights, not a mean
RTOL = 1e-5  # docs/parity.md: a training curve, float32 rounding of two frameworks / summation orders


def _argv(run_dir: Path, **changes) -> list[str]:
    args = []
    for key, value in {**FLAGS, **changes}.items():
        flag = "--" + key.replace("_", "-")
        args += [flag if value is True else f"--no-{flag[2:]}"] if isinstance(value, bool) else [flag, str(value)]
    return [*args, "--run-dir", str(run_dir)]


def _cli(run_dir: Path, backend: str, *extra: str, wait: bool = True, **changes):
    """`python -m train.run` in a subprocess; JAX with 2 host devices."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "MASTER_", "RANK", "WORLD_SIZE"))}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
               PYTHONUNBUFFERED="1")  # its step lines as they come
    args = [sys.executable, "-m", "train.run", *_argv(run_dir, **changes), "--backend", backend, "--devices", "2",
            *extra]
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if not wait:
        return proc
    out, err = proc.communicate(timeout=600)  # only catches a hang
    assert proc.returncode == 0, out[-2000:] + err[-2000:]
    return _losses(run_dir)


def _losses(run_dir: Path) -> np.ndarray:
    history = json.loads((run_dir / "results.json").read_text())["history"]["train"]
    assert [e["step"] for e in history] == list(range(1, len(history) + 1))
    return np.array([e["loss"] for e in history])


def _torch(run_dir: Path, devices: int, steps: int = 6, resume: bool = False) -> np.ndarray:
    """A torch run in this process (process 0; with 2 devices one more process is started)."""
    loop.train(ExperimentConfig(backend="torch", run_dir=str(run_dir), steps=steps, devices=devices, resume=resume,
                                **FLAGS))
    return _losses(run_dir)


@pytest.fixture(scope="module")
def torch_2(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("ddp") / "torch-2"
    _torch(run_dir, 2)
    return run_dir


def test_two_processes_take_the_updates_of_one_device_replicated_or_sharded(torch_2, tmp_path):
    one = _torch(tmp_path / "torch-1", 1, steps=9)
    two = _losses(torch_2)
    assert len(two) == 6 and two[-1] < two[0]
    np.testing.assert_allclose(two, one[:6], rtol=RTOL)
    assert sorted(p.name for p in (torch_2 / "checkpoints").iterdir() if p.name.isdigit()) == ["3", "6"]
    # FSDP2 over 2 processes: the same updates; its checkpoint (gathered whole) resumes on one device.
    sharded = tmp_path / "fsdp"
    loop.train(ExperimentConfig(backend="torch", run_dir=str(sharded), steps=6, devices=2, param_sharding="fsdp",
                                **FLAGS))
    np.testing.assert_allclose(_losses(sharded), one[:6], rtol=RTOL)
    np.testing.assert_allclose(_torch(sharded, 1, steps=9, resume=True), one, rtol=RTOL)


def test_resume_across_frameworks_on_two_devices_each_way(torch_2, tmp_path):
    # torch over 2 processes -> JAX over 2 devices from step 3: JAX's updates 4-6 are torch's.
    convert_run(torch_2, tmp_path / "as-jax", which="3")
    jax_losses = _cli(tmp_path / "as-jax", "jax", "--resume", steps=9)
    np.testing.assert_allclose(jax_losses[:6], _losses(torch_2), rtol=RTOL)
    # and back, JAX's checkpoint of step 6 -> torch over 2 processes: torch's updates 7-9 are JAX's.
    convert_run(tmp_path / "as-jax", tmp_path / "as-torch", which="6")
    np.testing.assert_allclose(_torch(tmp_path / "as-torch", 2, steps=9, resume=True), jax_losses, rtol=RTOL)


def test_sigterm_saves_a_step_and_a_dead_process_stops_the_other_in_one_line(tmp_path):
    run_dir = tmp_path / "long"
    proc = _cli(run_dir, "torch", wait=False, steps=100000, save_every=1000)
    for line in proc.stdout:  # the run trains: "step N/100000 ..." from process 0
        if line.startswith("step 2/"):
            break
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    saved = [int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()]
    assert len(saved) == 1 and saved[0] >= 2 and "--devices 2" in err  # the resume command keeps the processes

    # Resumed, then process 1 killed: process 0 ends in one line, the run resumable from its checkpoints.
    proc = _cli(run_dir, "torch", "--resume", wait=False, steps=100000, save_every=1)
    for line in proc.stdout:
        if line.startswith(f"step {saved[0] + 2}/"):
            break
    children = subprocess.run(["pgrep", "-P", str(proc.pid), "-f", "multiprocessing.spawn"], capture_output=True,
                              text=True).stdout.split()
    assert len(children) == 1
    os.kill(int(children[0]), signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1
    lines = [x for x in err.splitlines() if x]  # no resource_tracker warning of the killed process's semaphore
    assert len(lines) == 1 and lines[0].startswith("error: process 0 of 2: another process of the run stopped"), err
    last = max(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert last >= saved[0] + 2
    assert len(_torch(run_dir, 2, steps=last + 1, resume=True)) == last + 1


def test_sigterm_to_torchrun_says_once_a_command_that_continues_as_printed(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", PATH=f"{Path(sys.executable).parent}:{env['PATH']}")
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(["torchrun", "--nproc-per-node", "2", "-m", "train.run", "--backend", "torch",
                             *_argv(run_dir, steps=100000, save_every=1000)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("step 2/"):
            break
    proc.send_signal(signal.SIGTERM)  # torchrun passes it on to both processes
    err = proc.communicate(timeout=300)[1]
    assert err.count("continue with") == 1, err[-3000:]  # process 0 alone says it
    command = err.split("continue with\n", 1)[1].splitlines()[0].strip()
    assert command.startswith("torchrun --nproc-per-node 2 -m train.run "), command
    saved = max(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    resumed = subprocess.run(f"{command} --steps {saved + 1}", shell=True, cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=300)  # as printed; --steps only ends it
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed {run_dir} at step {saved}" in resumed.stdout and len(_losses(run_dir)) == saved + 1


def test_nccl_on_a_cpu_is_one_line(tmp_path, capsys):
    argv = [*_argv(tmp_path / "r"), "--backend", "torch", "--devices", "2", "--dist-backend", "nccl"]
    assert train_run.main(argv) == 1
    assert capsys.readouterr().err == "error: --dist-backend nccl needs CUDA GPUs and this machine has none: use gloo\n"
    assert not (tmp_path / "r").exists()
