"""Small, fast training set-ups shared by the tests of train/ (2-core CPU budget)."""

import os
import shutil
import stat
from pathlib import Path

import pytest

from train.config import ExperimentConfig

# A run that takes seconds: the numbers corpus cut to a few thousand pairs, sequences of at most
# 16 tokens (two length buckets, so jit compiles two training shapes), a 1+1-layer tiny model.
FAST = dict(
    numbers_train=1500,
    numbers_valid=40,
    numbers_test=40,
    max_len=16,
    token_budget=512,
    model={"num_encoder_layers": 1, "num_decoder_layers": 1},
    progress=False,
    samples=0,
)


@pytest.fixture
def fast_config(tmp_path):
    """fast_config(backend, **changes) -> an ExperimentConfig running in tmp_path/run."""

    def make(backend: str, **changes) -> ExperimentConfig:
        return ExperimentConfig(backend=backend, run_dir=str(tmp_path / "run"), **{**FAST, **changes})

    return make


@pytest.fixture
def torch_run(tiny_torch_run):
    """`tiny_torch_run` under a shorter name: read it, never write into it."""
    return tiny_torch_run


@pytest.fixture
def run_copy(tiny_torch_run, tmp_path):
    """A copy of the shared 2-step torch run (checkpoint 2), free to change."""
    return Path(shutil.copytree(tiny_torch_run, tmp_path / "run"))


@pytest.fixture
def no_replacing_devices(monkeypatch):
    """os.replace/os.rename onto anything but a regular file or a link fail the test: run under it, a
    wrong code path can never turn the real /dev/null into a file."""

    def guard(real):
        def rename(src, dst, *args, **kwargs):
            if os.path.lexists(dst):
                mode = os.lstat(dst).st_mode
                assert stat.S_ISREG(mode) or stat.S_ISLNK(mode), f"renamed over {dst}"
            return real(src, dst, *args, **kwargs)
        return rename

    monkeypatch.setattr(os, "replace", guard(os.replace))
    monkeypatch.setattr(os, "rename", guard(os.rename))
