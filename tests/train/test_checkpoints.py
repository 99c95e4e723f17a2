"""Checkpoints as they are read back. Every file of a checkpoint has a sha256 digest; a damaged
checkpoint (truncated, garbled, bytes flipped) is named in one line by every loader (load,
--resume, evaluate, translate, convert) and the other checkpoints still load; a missing checkpoint
or tokenizer, checkpoints of another configuration or architecture and a pickle torch.load refuses
are clear errors. Each checkpoint also carries the run's history up to its step, so that
results.json and TensorBoard keep every step across any number of resumes. The runs are tiny (1+1
layers, 16 tokens, 4 steps), trained once per backend for the module; loaders that are commands
run as real processes (`python -m ...`) where their exit is the point."""

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import train
from torch_reference.config import TransformerConfig
from train import checkpoints, loop, runtime
from train.config import ExperimentConfig

from .helpers import FAST_IN_PROCESS, REPO, one_error_line, restored_step
from .helpers import TINY_FIELDS as TINY


@pytest.fixture(scope="module", params=["jax", "torch"])
def saved_run(request, tmp_path_factory):
    """A 4-step run with checkpoints at steps 2 and 4: (config, run directory)."""
    from train.config import ExperimentConfig

    run_dir = tmp_path_factory.mktemp(f"saved-{request.param}") / "run"
    cfg = ExperimentConfig(backend=request.param, run_dir=str(run_dir), steps=4, save_every=2, **FAST_IN_PROCESS)
    loop.train(cfg)
    return cfg, run_dir


def copy_run(run_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    return copy


def largest_file(directory: Path) -> Path:
    return max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


# orbax's restore of a damaged array leaves its other reads as coroutines that fail once their
# event loop is closed; pytest reports them as unraisable. They are orbax's, not this test's.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage", ["truncate", "garble"])
def test_a_damaged_checkpoint_is_named_and_the_others_still_load(saved_run, tmp_path, damage):
    cfg, run_dir = saved_run
    run_dir = copy_run(run_dir, tmp_path)
    victim = largest_file(run_dir / "checkpoints" / "4")
    content = victim.read_bytes()
    if damage == "truncate":
        victim.write_bytes(content[: len(content) // 2])
    else:
        victim.write_bytes(bytes(b ^ 0xFF for b in content[:4096]) + content[4096:])
    message = r"checkpoint 4 in .*checkpoints cannot be restored \(.*\); the other checkpoints there are steps \[2\]"
    with pytest.raises(runtime.UserError, match=message):
        train.load(run_dir, "latest")
    with pytest.raises(runtime.UserError, match=message):
        loop.train(cfg.replace(run_dir=str(run_dir), resume=True, steps=6))
    assert restored_step(run_dir, 2) == 2  # the intact checkpoint is still usable


def test_missing_checkpoints_and_tokenizer_are_clear_errors(saved_run, tmp_path):
    cfg, run_dir = saved_run
    run_dir = copy_run(run_dir, tmp_path)
    with pytest.raises(runtime.UserError, match=r"no checkpoint of step 3 in .* \(have \[2, 4\]\)"):
        train.load(run_dir, 3)
    tokenizer = (run_dir / "tokenizer.json").read_text()
    (run_dir / "tokenizer.json").write_text(tokenizer[:100])
    with pytest.raises(runtime.UserError, match=r"tokenizer.json is not a readable tokenizer"):
        train.load(run_dir)
    (run_dir / "tokenizer.json").write_text(tokenizer)
    shutil.rmtree(run_dir / "checkpoints")
    with pytest.raises(runtime.UserError, match=r"no checkpoint in .*checkpoints"):
        train.load(run_dir)
    with pytest.raises(runtime.UserError, match=r"not a run directory \(config.json missing\)"):
        train.load(tmp_path / "nowhere")


def test_a_checkpoint_of_another_configuration_is_refused(saved_run, tmp_path):
    """Checkpoints copied in from a run with another seed: --resume lists the fields that differ."""
    cfg, run_dir = saved_run
    other = tmp_path / "other"
    loop.train(cfg.replace(run_dir=str(other), seed=1, steps=2, save_every=2))
    mine = copy_run(run_dir, tmp_path)
    shutil.rmtree(mine / "checkpoints")
    shutil.copytree(other / "checkpoints", mine / "checkpoints")
    with pytest.raises(runtime.UserError, match=r"written by a run configured differently, so it cannot be resumed "
                                                r"here: seed: checkpoint has 1, run has 0$"):
        loop.train(cfg.replace(run_dir=str(mine), resume=True, steps=6))


def test_weights_of_another_architecture_are_refused(saved_run, tmp_path):
    """model.json says d_ff 64 but the checkpoint holds d_ff 128 (tiny): named before a model is built."""
    cfg, run_dir = saved_run
    run_dir = copy_run(run_dir, tmp_path)
    model = json.loads((run_dir / "model.json").read_text())
    model["d_ff"] //= 2
    (run_dir / "model.json").write_text(json.dumps(model))
    with pytest.raises(runtime.UserError, match=r"model.json says d_ff=64 but .*config.json with the tokenizer gives d_ff=128"):
        train.load(run_dir, "latest")


def test_a_refused_pickle_is_one_line_without_colour_codes(tmp_path):
    import torch

    from train.interop.runs import load_torch_weights

    (tmp_path / "config.json").write_text(TransformerConfig().to_json())
    torch.save({"w": torch.zeros(1), "f": print}, tmp_path / "model.pt")
    with pytest.raises(ValueError) as info:
        load_torch_weights(tmp_path / "model.pt")
    assert "refused by torch.load" in str(info.value) and "\x1b" not in str(info.value) and "\n" not in str(info.value)


# ----------------------------------------------------------------------------------------------
# Digests


def python(*args: str, stdin: bytes = b"", timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env, input=stdin, capture_output=True,
                          timeout=timeout)


@pytest.fixture(scope="module", params=["jax", "torch"])
def run4(request, tmp_path_factory):
    """A 4-step run, evaluated and saved at steps 2 and 4: (config, run directory)."""
    run_dir = tmp_path_factory.mktemp(f"run4-{request.param}") / "run"
    cfg = ExperimentConfig(backend=request.param, run_dir=str(run_dir), steps=4, eval_every=2, save_every=2, **TINY)
    loop.train(cfg)
    return cfg, run_dir


def test_every_checkpoint_file_has_a_digest(run4):
    _, run_dir = run4
    for step in (2, 4):
        directory = run_dir / "checkpoints" / str(step)
        record = json.loads((directory / checkpoints.DIGEST_FILE).read_text())
        files = {p.relative_to(directory).as_posix() for p in directory.rglob("*")
                 if p.is_file() and p.name != checkpoints.DIGEST_FILE}
        assert record["algorithm"] == "sha256" and set(record["files"]) == files and len(files) >= 3
        assert checkpoints.verify_checkpoint(directory) is True


def flip_bytes(run_dir: Path, step: int) -> str:
    """Flip 2 KiB inside the largest file of checkpoint `step` (after its first 4 KiB: inside the
    data, not a header); returns its path relative to the checkpoint directory."""
    directory = run_dir / "checkpoints" / str(step)
    victim = max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    content = bytearray(victim.read_bytes())
    start = min(4096, len(content) // 2)
    content[start : start + 2048] = bytes(b ^ 0x5A for b in content[start : start + 2048])
    victim.write_bytes(bytes(content))
    return victim.relative_to(directory).as_posix()


def test_flipped_bytes_are_named_by_every_loader(run4, tmp_path):
    """Evaluate and translate (real processes), resume and convert: one line naming step and file;
    the intact checkpoint still loads."""
    cfg, run_dir = run4
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    damaged = flip_bytes(copy, 4)
    expected = (f"checkpoint 4 in {copy / 'checkpoints'} cannot be restored", f"{damaged} does not match the sha256 "
                "digest written with it", "the other checkpoints there are steps [2]")
    done = python("train.commands.evaluate", "--run-dir", str(copy), "--data", "numbers:valid", "--checkpoint",
                  "latest")
    assert done.returncode == 1 and not done.stdout
    one_error_line(done.stderr, *expected)
    done = python("train.commands.translate", "--run-dir", str(copy), "--checkpoint", "latest", stdin=b"eins\n")
    assert done.returncode == 1 and not done.stdout
    one_error_line(done.stderr, *expected)
    with pytest.raises(runtime.UserError) as info:
        loop.train(cfg.replace(run_dir=str(copy), resume=True, steps=6))
    assert all(e in str(info.value) for e in expected) and "\n" not in str(info.value)
    from parity.commands.convert import main as convert_main

    code = convert_main(["--to", "torch" if cfg.backend == "jax" else "jax", "--run-dir", str(copy), "--dst",
                         str(tmp_path / "converted")])
    assert code == 1 and not (tmp_path / "converted").exists()
    run = train.load(copy, 2)  # the other checkpoint is intact
    assert run.backend.step == 2
    run.backend.close()


# ----------------------------------------------------------------------------------------------
# History across resumes


def tensorboard_steps(directory: Path, tag: str) -> list[int]:
    """The steps of scalar `tag` in every event file of `directory`, TensorBoard's purge applied:
    a file's events at or after the purge step of a later file's start are dropped."""
    from tensorboardX.proto import event_pb2

    events = []
    for path in sorted(directory.glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime_ns):
        raw, offset, file_events = path.read_bytes(), 0, []
        while offset < len(raw):
            (length,) = struct.unpack_from("<Q", raw, offset)
            event = event_pb2.Event.FromString(raw[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            file_events.append(event)
        events.append(file_events)
    steps: list[int] = []
    for file_events in events:
        for event in file_events:
            if event.HasField("session_log") and event.session_log.status == event.session_log.START:
                steps = [s for s in steps if s < event.step]  # purge_step
            for value in event.summary.value:
                if value.tag == tag:
                    steps.append(event.step)
    return steps


def test_sessions_opened_within_one_second_keep_their_own_event_files(tmp_path):
    """tensorboardX names an event file by the second it was opened: a run resumed within the
    second of its last session overwrote that session's file (steps 5-6 of a tiny run lost)."""
    for first_step in (5, 7):
        writer = loop.summary_writer(tmp_path, purge_step=first_step)
        writer.add_scalar("train/loss", 1.0, first_step)
        writer.close()
    files = sorted(p.name for p in tmp_path.glob("events.out.tfevents.*"))
    assert len(files) == 2 and files[0].split(".")[-2:] == [f"{5:010d}", str(os.getpid())]
    assert tensorboard_steps(tmp_path, "train/loss") == [5, 7]


def test_history_survives_any_number_of_resumes(run4, tmp_path, capsys):
    cfg, run_dir = run4
    run = train.load(run_dir, 4)  # each checkpoint's meta holds the history up to its step
    run.backend.close()
    assert [e["step"] for e in run.meta["history"]["valid"]] == [2, 4]
    assert [e["step"] for e in run.meta["history"]["train"]] == [1, 2, 3, 4]
    if cfg.backend == "jax":  # the resumes below are the loop's, alike for both backends (2-core CI budget)
        return
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    for steps in (6, 8):
        loop.train(cfg.replace(run_dir=str(copy), resume=True, steps=steps))
    results = json.loads((copy / "results.json").read_text())
    assert [e["step"] for e in results["history"]["valid"]] == [2, 4, 6, 8]
    assert [e["step"] for e in results["history"]["train"]] == list(range(1, 9))
    assert results["best"] is not None and results["train"]["loss"] is not None and results["train"]["time_s"] > 0
    assert tensorboard_steps(copy / "tensorboard", "valid/bleu") == [2, 4, 6, 8]
    assert tensorboard_steps(copy / "tensorboard", "train/loss") == list(range(1, 9))

    # --steps at or below the steps done: nothing to train, results.json left byte for byte.
    before = (copy / "results.json").read_bytes()
    capsys.readouterr()
    loop.train(cfg.replace(run_dir=str(copy), resume=True, steps=5))  # (at or below: one rule, steps done >= --steps)
    assert (copy / "results.json").read_bytes() == before
    assert "nothing to do; results.json left as it is" in capsys.readouterr().out
    # The same for a run stopped before its results were written: said so, then evaluated.
    (copy / "results.json").unlink()
    loop.train(cfg.replace(run_dir=str(copy), resume=True, steps=5))
    assert "has trained 8 steps of 5: nothing to train; evaluating" in capsys.readouterr().out
    assert json.loads((copy / "results.json").read_text())["steps"] == 8


def test_load_refuses_a_backend_that_is_not_a_framework(tiny_torch_run):
    """backend="tf" was answered with a conversion command that does not exist (--to tf)."""
    for run_dirs in (tiny_torch_run, [tiny_torch_run, tiny_torch_run]):
        with pytest.raises(runtime.UserError, match=r"^backend must be one of jax, torch \(None: the run's own\), "
                                                    r"got 'tf'$"):
            train.load(run_dirs, backend="tf")


def test_load_takes_a_generator_of_run_directories_and_names_what_is_none():
    """None or a number was a bare TypeError (len() of it), a generator of directories one too."""
    for bad in (None, 5, [None]):
        with pytest.raises(runtime.UserError,
                           match=r"^run_dir: give a run directory or a list of them, got \[(None|5)]$"):
            train.load(bad)
    with pytest.raises(runtime.UserError, match="not a run directory"):  # read as a list: the directory is looked at
        train.load(d for d in ["/nonexistent-run"])


def test_load_refuses_bad_launch_options_with_a_user_error(tiny_torch_run):
    """devices=0 or a torch run on 2 devices raised ValueError, an unknown option TypeError: load
    promises UserError, as aiayn translate and aiayn serve print it."""
    for options, message in (({"devices": 0}, "devices must be >= 1, got 0"),
                             ({"devices": 2}, "^devices 2: a torch run decodes on one device"),
                             ({"process_count": 2}, r"load\(\) takes no parameter process_count")):
        with pytest.raises(runtime.UserError, match=message):
            train.load(tiny_torch_run, **options)


def test_an_ensemble_of_the_other_framework_is_refused_with_the_truth(tiny_torch_run):
    """load([a, a], backend="jax") of torch runs said 'a is a torch run, a a jax one': a is no jax run."""
    with pytest.raises(runtime.UserError, match=r"is a torch run; for jax, convert it first: aiayn convert"):
        train.load([tiny_torch_run, tiny_torch_run], backend="jax")


def test_parse_checkpoint_takes_integer_steps_of_any_integer_type_but_not_a_bool():
    """`checkpoint=True` loaded step 1, and NumPy's integers (a step read from an array) were refused."""
    assert checkpoints.parse_checkpoint(np.int64(60)) == 60 and type(checkpoints.parse_checkpoint(np.int64(60))) is int
    assert checkpoints.parse_checkpoint("60") == 60 and checkpoints.parse_checkpoint("best") == "best"
    for bad in (True, 2.0, "-1", None):
        with pytest.raises(runtime.UserError, match="checkpoint must be 'best', 'latest' or a step number"):
            checkpoints.parse_checkpoint(bad)
