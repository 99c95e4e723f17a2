"""Runs that stop before their end, and how they go on: SIGKILL during an update or in the middle
of writing a checkpoint, SIGTERM and Ctrl-C (the update finishes, a checkpoint is saved, the
process says how to resume and exits), a signal during an evaluation, and a training or
validation loss that diverges (stopped before it is saved). Each backend trains 20 steps without
interruption and again through a chain of kills and resumes: the chain must end where the
uninterrupted run ended, bit for bit on JAX, to float32 rounding on torch. Kills and SIGTERM run
real processes (`python -m train.run`); the rest runs the loop in this process on tiny runs."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import train
from train import loop, rundir, runtime
from train.config import ExperimentConfig

from .helpers import FAST_IN_PROCESS, REPO, STEPS, finish, launch, read_until, restored_step
from .helpers import TINY_FIELDS as TINY


def complete_steps(run_dir: Path) -> list[int]:
    """The checkpoint steps on disk whose writing finished (what --resume may load)."""
    names = os.listdir(run_dir / "checkpoints")
    return sorted(int(name) for name in names if name.isdigit())


def partial_checkpoints(run_dir: Path) -> list[str]:
    return sorted(name for name in os.listdir(run_dir / "checkpoints") if "tmp" in name)


def kill_while_saving(proc: subprocess.Popen, run_dir: Path, after: int) -> str:
    """SIGKILL the child as soon as a checkpoint of a step > `after` is being written; returns the
    partial directory's name."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        with os.scandir(run_dir / "checkpoints") as entries:
            for entry in entries:
                step = "".join(c for c in entry.name.split(".orbax")[0] if c.isdigit())
                if "tmp" in entry.name and step and int(step) > after:
                    proc.kill()
                    proc.wait()
                    return entry.name
        time.sleep(0.0005)
    raise AssertionError(f"no checkpoint after step {after} was being written before the run ended")


def final_weights(run_dir: Path) -> dict[str, np.ndarray]:
    run = train.load(run_dir, "latest")
    assert run.backend.step == STEPS
    weights = run.backend.weights()
    run.backend.close()
    return weights


def train_losses(run_dir: Path) -> dict[int, float]:
    """Every logged step's loss in results.json (the whole run's, across resumes)."""
    results = json.loads((run_dir / "results.json").read_text())
    return {entry["step"]: entry["loss"] for entry in results["history"]["train"]}


@pytest.mark.parametrize("backend", ["jax", "torch"])  # jax: ~100 s
def test_killed_and_terminated_runs_resume_exactly(tmp_path, backend):
    straight_dir, run_dir = tmp_path / "straight", tmp_path / "run"
    code, out = finish(launch(backend, straight_dir))
    assert code == 0, out
    straight = train_losses(straight_dir)
    assert sorted(straight) == list(range(1, STEPS + 1))

    # 1. SIGKILL during an update (step 7 has been logged; the last checkpoint is step 5).
    proc = launch(backend, run_dir)
    read_until(proc, f"step 7/{STEPS}")
    proc.kill()
    proc.wait()
    assert complete_steps(run_dir) == [5] and not partial_checkpoints(run_dir)

    # 2. SIGKILL while step 10's checkpoint is being written: the partial checkpoint stays on disk,
    #    unlisted; --resume goes back to step 5. (The kill races the rename that completes the
    #    checkpoint; if it loses, the next save is tried.)
    for after in (5, 10, 15):
        proc = launch(backend, run_dir, "--resume")
        read_until(proc, "resumed")
        partial = kill_while_saving(proc, run_dir, after)
        if partial in partial_checkpoints(run_dir):
            break
    else:
        pytest.fail("three kills all landed after the checkpoint was complete")
    last = complete_steps(run_dir)[-1]
    assert partial in partial_checkpoints(run_dir) and int("".join(filter(str.isdigit, partial))) > last

    # 3. SIGTERM: finish the update, save, say how to resume, exit with 128 + SIGTERM.
    proc = launch(backend, run_dir, "--resume")
    read_until(proc, f"resumed {run_dir} at step {last}")
    read_until(proc, f"step {last + 2}/{STEPS}")
    proc.send_signal(signal.SIGTERM)
    code, out = finish(proc)
    assert code == 128 + signal.SIGTERM, out
    assert "Traceback" not in out and f"python -m train.run --run-dir {run_dir} --resume" in out
    stopped = complete_steps(run_dir)[-1]
    assert stopped > last + 1 and f"SIGTERM: stopped at step {stopped} of {STEPS}" in out

    # 4. Resume to the end: the remaining losses and the final weights equal the uninterrupted run's.
    code, out = finish(launch(backend, run_dir, "--resume"))
    assert code == 0 and f"resumed {run_dir} at step {stopped}" in out, out
    resumed = train_losses(run_dir)
    # results.json's history is the whole run's, kept through the kills and resumes: every step once,
    # each logged by the session that trained it (those after the last checkpoint by the next one).
    assert list(resumed) == list(range(1, STEPS + 1))
    ours, theirs = final_weights(run_dir), final_weights(straight_dir)
    assert ours.keys() == theirs.keys()
    if backend == "jax":  # the same jitted update, the same keys and batches: bit-identical
        assert [resumed[s] for s in resumed] == [straight[s] for s in resumed]
        for name in ours:
            np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    else:
        # Adam's moments, the RNG state and the data position are restored exactly; 1e-6 leaves room
        # for float32 rounding in kernels whose reduction order may vary between processes.
        assert [resumed[s] for s in resumed] == pytest.approx([straight[s] for s in resumed], rel=1e-6)
        for name in ours:
            np.testing.assert_allclose(ours[name], theirs[name], rtol=1e-6, atol=1e-7, err_msg=name)


# ----------------------------------------------------------------------------------------------
# Signals in this process, and during an evaluation


@pytest.mark.parametrize("times", [1, 2])
def test_ctrl_c_saves_then_stops_and_twice_stops_at_once(tmp_path, monkeypatch, times):
    """SIGINT at step 3 (delivered to this very process, as Ctrl-C would be): the loop finishes the
    next update, saves it and raises Interrupted; a second SIGINT raises KeyboardInterrupt at once,
    with nothing new saved. The handlers are removed again afterwards."""
    from train.config import ExperimentConfig

    cfg = ExperimentConfig(
        backend="torch", run_dir=str(tmp_path / "run"), steps=10, save_every=2, log_every=1, **FAST_IN_PROCESS
    )
    log_window = loop._log_window

    def log_then_interrupt(cfg, step, *args):
        log_window(cfg, step, *args)
        if step == 3:
            for _ in range(times):
                os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(loop, "_log_window", log_then_interrupt)
    before = signal.getsignal(signal.SIGINT)
    if times == 1:
        with pytest.raises(loop.Interrupted, match=r"SIGINT: stopped at step 4 of 10 .*\n  python -m train.run "
                           r"--run-dir .* --resume --steps 10 .*--save-every 2") as info:  # not 700 steps
            loop.train(cfg)
        assert info.value.signum == signal.SIGINT and complete_steps(tmp_path / "run") == [2, 4]
    else:
        with pytest.raises(KeyboardInterrupt):
            loop.train(cfg)
        assert complete_steps(tmp_path / "run") == [2]
    assert signal.getsignal(signal.SIGINT) is before


def test_a_signal_during_an_evaluation_that_finishes_stops_before_the_next_update(tmp_path, monkeypatch):
    """SIGTERM while step 2's evaluation runs, after its last look at the signal (here: as it
    returns): the evaluation counts, step 2 is saved with it, and no update follows."""
    from train.config import ExperimentConfig

    cfg = ExperimentConfig(backend="torch", run_dir=str(tmp_path / "run"), steps=10, save_every=5, log_every=1,
                           **{**FAST_IN_PROCESS, "eval_every": 2})
    evaluate = loop._evaluate

    def evaluate_then_signal(*args, **kwargs):
        result = evaluate(*args, **kwargs)
        if kwargs.get("stop") is not None:  # validation during the loop, not the final scoring
            os.kill(os.getpid(), signal.SIGTERM)
        return result

    monkeypatch.setattr(loop, "_evaluate", evaluate_then_signal)
    with pytest.raises(loop.Interrupted, match=r"SIGTERM: stopped at step 2 of 10 ") as info:
        loop.train(cfg)
    assert info.value.signum == signal.SIGTERM and complete_steps(tmp_path / "run") == [2]
    meta = json.loads((tmp_path / "run" / "checkpoints" / "2" / "meta.json").read_text())
    assert meta["step"] == 2 and meta["meta"]["valid"]["bleu"] >= 0.0  # saved with its evaluation


def test_sigterm_during_evaluation_saves_within_one_update(tmp_path):
    """The small preset evaluating 2,000 validation sentences with beam 4 (several seconds; 200
    took 0.7 s once the search stopped each sentence as soon as its best could not be beaten):
    SIGTERM right after step 2's update stops the evaluation, saves step 2 and exits 143, with
    no evaluation result printed."""
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "train.run", "--backend=torch", "--preset", "small", "--run-dir", str(run_dir),
               "--numbers-train", "1500", "--numbers-valid", "2000", "--numbers-test", "0", "--max-len", "16",
               "--token-budget", "512", "--steps", "50", "--eval-every", "2", "--log-every", "1", "--beam", "4",
               "--no-progress", "--samples", "0"]
    proc = subprocess.Popen(command, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("step 2/50"):  # logged just before the evaluation starts
                break
        else:
            pytest.fail("".join(seen))
        time.sleep(0.5)  # inside the evaluation
        sent = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
        elapsed = time.perf_counter() - sent
    finally:
        proc.kill()
        proc.wait()
    out = "".join(seen) + out
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "SIGTERM: stopped at step 2 of 50" in out and "step 2: valid" not in out and "Traceback" not in out
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["2"]
    # The scheduler's grace period (SLURM KillWait, Kubernetes) is 30 s; here it takes about a
    # second (one evaluation batch and the save).
    print(f"SIGTERM mid-evaluation to exit with step 2 saved: {elapsed:.2f} s")
    assert elapsed < 30


# ----------------------------------------------------------------------------------------------
# Divergence


@pytest.mark.parametrize("backend", ["jax", "torch"])  # jax: ~20 s
def test_a_diverging_loss_stops_before_it_is_saved(tmp_path, backend):
    from train.config import ExperimentConfig

    # lr_factor 1e30: the first update (its loss computed before it) is finite, and throws the
    # weights so far that the second loss is not.
    cfg = ExperimentConfig(
        backend=backend, run_dir=str(tmp_path / "run"), steps=6, save_every=1, lr_factor=1e30, **FAST_IN_PROCESS
    )
    with pytest.raises(loop.TrainingDiverged, match=r"loss nan at step 2; .*checkpoints up to step 1 are intact"):
        loop.train(cfg)
    assert complete_steps(tmp_path / "run") == [1]
    assert restored_step(tmp_path / "run", "latest") == 1  # still loads

    # Detected inside a logging window: the message names the step, not the window's end.
    cfg = cfg.replace(run_dir=str(tmp_path / "window"), save_every=4, log_every=4)
    with pytest.raises(loop.TrainingDiverged, match=r"loss nan at step 2; .*no checkpoint was saved"):
        loop.train(cfg)
    assert not (tmp_path / "window" / "checkpoints").exists() or complete_steps(tmp_path / "window") == []


def test_a_non_finite_validation_loss_is_divergence(tmp_path, monkeypatch):
    real = loop._evaluate

    def nan_loss(*args, **kwargs):
        return {**real(*args, **kwargs), "loss": math.nan}

    monkeypatch.setattr(loop, "_evaluate", nan_loss)
    cfg = ExperimentConfig(backend="torch", run_dir=str(tmp_path / "run"), steps=4, eval_every=2, save_every=1, **TINY)
    with pytest.raises(loop.TrainingDiverged, match=r"validation loss nan at step 2; .*checkpoints up to step 1 are"):
        loop.train(cfg)
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["1"]


def test_a_run_saved_before_packing_existed_resumes_on_length_buckets():
    """config.json and checkpoint metas written before --pack existed hold no `pack`: such a run
    trained on length buckets, so it reads back as pack false and its checkpoints stay its own
    (not refused as written by a run configured differently)."""
    saved = ExperimentConfig(backend="jax", run_dir="RUN").resolve().experiment()
    del saved["pack"]
    cfg = runtime.layout.experiment_of(saved).resolve()
    assert cfg.pack is False
    rundir.check_checkpoint_config({"config": saved, "step": 4}, cfg)
    with pytest.raises(runtime.UserError, match=r"\bpack: checkpoint has False, run has True"):
        rundir.check_checkpoint_config({"config": saved, "step": 4}, cfg.replace(pack=True))


def test_a_resume_on_a_device_count_that_changes_the_batch_shapes_names_the_counts_that_keep_them():
    """4 devices packed 168 rows of 24 tokens (budget 4096); 2 devices would pack 170, which the
    message called a count that 'keeps every batch size divisible' (168 is): it names 3, 4, 6... now."""
    cfg = ExperimentConfig(backend="jax", run_dir="RUN", token_budget=4096).resolve()
    meta = {"config": cfg.experiment(), "step": 4, "shapes": [[168, 24]]}
    batcher = SimpleNamespace(shapes=[(170, 24)])
    with pytest.raises(runtime.UserError, match=r"\[\[170, 24\]\] .* resume with devices 3 or 4 or 6 or 7 or 8 "
                                                r"or 12 or \.\.\., which keep them$"):
        loop._check_resumed(meta, cfg, batcher, SimpleNamespace(num_devices=2))
