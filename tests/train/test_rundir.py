"""`rundir.session` claims a run directory for training; `runtime.derive`: a directory built
from a run appears whole or not at all."""

import os
from pathlib import Path

import pytest

from train import data, rundir, runtime
from train.config import ExperimentConfig
from train.runtime.files import json_text

RUN_CONFIG = json_text(ExperimentConfig().experiment())  # what makes a directory a run (runtime.kind_of)


def old_run(root):
    """A run directory `root/dst` with a config and a checkpoint file, and a source run `root/src`."""
    dst, src = root / "dst", root / "src"
    (dst / "checkpoints").mkdir(parents=True)
    (dst / runtime.CONFIG_FILE).write_text(RUN_CONFIG)
    (dst / "checkpoints" / "weights").write_text("old weights")
    (src / runtime.TENSORBOARD).mkdir(parents=True)
    for name, text in [(runtime.CONFIG_FILE, "src config"), (data.JOINT_TOKENIZER, "tokenizer"),
                       (runtime.MODEL_FILE, "model"), (runtime.TENSORBOARD + "/events", "events")]:
        (src / name).write_text(text)
    return src, dst


def contents(directory):
    return {p.relative_to(directory).as_posix(): p.read_text() for p in sorted(directory.rglob("*"))
            if p.is_file() and p.name != runtime.LOCK_FILE}


def test_session_locks_a_new_run_dir_and_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with rundir.session(ExperimentConfig(backend="torch", steps=10), platform="cpu") as cfg:
        run_dir = Path(cfg.run_dir)
        assert cfg.run_dir.startswith("runs/torch-") and (cfg.dtype, cfg.vocab_size) == ("float32", 400)
        assert [p.name for p in run_dir.iterdir()] == [runtime.LOCK_FILE]
        with pytest.raises(runtime.UserError, match="is in use by pid"):
            runtime.RunLock(run_dir).acquire()
    assert not run_dir.exists()  # made for the lock and left empty: removed
    with pytest.raises(runtime.UserError, match="^init_from nowhere: not a run directory$"):
        with rundir.session(ExperimentConfig(run_dir="new", init_from="nowhere"), source="nowhere"):
            pass
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("existed", [False, True])
def test_a_run_failing_before_its_first_checkpoint_leaves_nothing_blocking_a_retry(tmp_path, fast_config, monkeypatch,
                                                                                   existed):
    from train import loop

    def fails(*args):  # as a seed the framework refuses inside, after the run's first files are written
        raise ValueError("Python int 2147483648 too large to convert to int32")

    cfg = fast_config("torch", steps=1, numbers_train=200, eval_sentences=2, beam=1, numbers_test=0)
    if existed:
        Path(cfg.run_dir).mkdir()
    monkeypatch.setattr(loop, "create_backend", fails)
    with pytest.raises(ValueError, match="too large"):
        loop.train(cfg)
    assert Path(cfg.run_dir).exists() == existed
    assert not existed or [p.name for p in Path(cfg.run_dir).iterdir()] == [runtime.LOCK_FILE]
    monkeypatch.undo()
    assert loop.train(cfg)["steps"] == 1  # the retry, without --overwrite


def test_derive_replaces_the_destination_with_the_new_files_and_the_copies(tmp_path):
    src, dst = old_run(tmp_path)
    copy = (data.JOINT_TOKENIZER, runtime.MODEL_FILE, runtime.TENSORBOARD, "absent")
    with runtime.derive(src, dst, "run", overwrite=True, copy=copy) as tmp:
        assert tmp.parent == tmp_path and tmp.name == ".dst.run" and list(tmp.iterdir()) == []
        (tmp / runtime.CONFIG_FILE).write_text("new config")
        assert contents(dst)[runtime.CONFIG_FILE] == RUN_CONFIG  # nothing changes before the block ends
    assert contents(dst) == {runtime.CONFIG_FILE: "new config", data.JOINT_TOKENIZER: "tokenizer",
                             runtime.MODEL_FILE: "model", "tensorboard/events": "events"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]  # no temporary or old directory left


@pytest.mark.parametrize("where", ["in the block", "in the swap"])
def test_a_failed_derive_leaves_the_old_destination_whole_and_no_temporary_directory(tmp_path, monkeypatch, where):
    src, dst = old_run(tmp_path)
    before = contents(dst)
    real_replace = os.replace

    def replace(a, b):
        if str(a).endswith(".dst.run"):  # the new directory's rename into place
            raise OSError(28, "No space left on device")
        real_replace(a, b)

    with pytest.raises(OSError, match="No space left"):
        with runtime.derive(src, dst, "run", overwrite=True, copy=(runtime.MODEL_FILE,)) as tmp:
            (tmp / runtime.CONFIG_FILE).write_text("new config")
            if where == "in the block":
                raise OSError(28, "No space left on device")
            monkeypatch.setattr(os, "replace", replace)
    monkeypatch.undo()
    assert contents(dst) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]


def test_derive_refuses_before_building(tmp_path):
    src, dst = old_run(tmp_path)
    with pytest.raises(FileExistsError, match="pass overwrite"):
        with runtime.derive(src, dst, "run"):
            pytest.fail("the block ran")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="holds no run; it is never deleted"):
        with runtime.derive(src, tmp_path / "mine", "run", overwrite=True):
            pytest.fail("the block ran")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "mine", "src"]
