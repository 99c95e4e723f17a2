"""Processes sharing a run directory. One process writes a run at a time: a second --resume or
--overwrite is refused with the holder's pid while the first trains, and a killed process's lock
never blocks a later one. Readers beside a writer that rotates its checkpoints never fail: a step
rotated away while it is read is read again from the newest. Writers are real processes
(`python -m train.run`); readers run in this one."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import train
from train import checkpoints, runtime
from train.commands import run as train_run

from .helpers import REPO, exit_code, finish, launch, read_until
from .helpers import TINY_ARGV as TINY


def test_one_process_writes_a_run_and_a_dead_ones_lock_never_blocks(tmp_path):
    """While a run trains, a second `--resume` and an `--overwrite` of its directory are refused
    with the holder's pid (the OS lock, not a file's presence, decides); once the first process
    is killed (SIGKILL: no clean-up), the same resume proceeds."""
    run_dir = tmp_path / "run"
    first = launch("torch", run_dir, "--steps", "100000", "--save-every", "100000")
    try:
        read_until(first, "step 1/")  # training: config written, lock held
        for extra in (["--resume"], ["--overwrite", "--steps", "2"]):
            code, out = finish(launch("torch", run_dir, *extra), timeout=120)
            assert code == 1, out
            assert f"is in use by pid {first.pid} on " in out and "Traceback" not in out
        assert (run_dir / "config.json").is_file()  # the live run was not replaced
    finally:
        first.kill()
        first.wait()
    code, out = finish(launch("torch", run_dir, "--resume", "--steps", "2"), timeout=300)
    assert code == 0, out  # a dead process's lock file is no lock


# ----------------------------------------------------------------------------------------------
# Readers beside a live run never fail because of rotation


@pytest.fixture(scope="module")
def run_3_4(tmp_path_factory):
    """A torch run keeping checkpoints 3 and 4."""
    run_dir = tmp_path_factory.mktemp("run-3-4") / "run"
    argv = ["--run-dir", run_dir, "--steps", "4", "--save-every", "1", "--keep-checkpoints", "2", *TINY]
    assert exit_code(train_run.main, argv) == 0
    return run_dir


def test_a_step_rotated_away_while_it_is_read_is_read_again_from_the_newest(run_3_4, tmp_path, monkeypatch, capfd):
    run_dir = Path(shutil.copytree(run_3_4, tmp_path / "run"))
    saved = run_dir / "checkpoints"
    shutil.move(saved / "4", tmp_path / "4")  # the reader lists [3]; the writer then saves 4 and drops 3
    real = checkpoints.verify_checkpoint

    def rotate_once(directory):
        if Path(directory).name == "3" and (saved / "3").exists():
            shutil.move(tmp_path / "4", saved / "4")
            shutil.rmtree(saved / "3")
        return real(directory)

    monkeypatch.setattr(checkpoints, "verify_checkpoint", rotate_once)
    run = train.load(run_dir, "latest")
    run.backend.close()
    assert run.backend.step == 4
    assert "read step 4, the latest now" in capfd.readouterr().err
    shutil.copytree(saved / "4", saved / "3")
    monkeypatch.setattr(checkpoints, "verify_checkpoint", lambda d: shutil.rmtree(d) if Path(d).name == "3" else real(d))
    with pytest.raises(runtime.UserError, match="checkpoint 3 .* cannot be restored"):  # a step asked for by number
        train.load(run_dir, 3)


def newest_step(run_dir: Path) -> int:
    return max(map(int, filter(str.isdigit, os.listdir(run_dir / "checkpoints"))))


def test_fifty_reads_beside_a_writer_rotating_every_step_all_succeed(tmp_path, monkeypatch, capfd):
    run_dir = tmp_path / "run"
    assert exit_code(train_run.main, ["--run-dir", run_dir, "--steps", "1", *TINY]) == 0
    argv = ["--run-dir", run_dir, "--resume", "--steps", "100000", "--save-every", "1", "--keep-checkpoints", "1",
            "--eval-every", "100000", "--no-progress", "--threads", "1"]
    writer = subprocess.Popen([sys.executable, "-m", "train.run", *map(str, argv)], cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while writer.poll() is None and newest_step(run_dir) < 3:
            time.sleep(0.1)
        first, started = newest_step(run_dir), time.perf_counter()
        time.sleep(1)
        interval = (time.perf_counter() - started) / max(1, newest_step(run_dir) - first)  # between two saves
        real = checkpoints.verify_checkpoint

        def slow_read(directory):  # a read a third as long as a save: one in three meets a rotation
            time.sleep(interval / 3)
            return real(directory)

        monkeypatch.setattr(checkpoints, "verify_checkpoint", slow_read)
        steps = []
        for _ in range(50):
            run = train.load(run_dir, "latest")
            run.backend.close()
            steps.append(run.backend.step)
    finally:
        writer.terminate()
        writer.wait(timeout=120)
    assert len(steps) == 50 and steps == sorted(steps) and steps[-1] > steps[0] >= 3, steps
    assert capfd.readouterr().err.count("changed while reading") > 0  # rotations did happen mid-read
