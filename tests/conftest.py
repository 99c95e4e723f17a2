"""Shared test set-up: the test processes' own caches, the shared corpus path, and the tiny trained runs every
package's tests read."""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"

# JAX's persistent compilation cache is on by default for every CLI (train/backends/jax_cache.py):
# the tests, and the processes they start, keep theirs in a directory of their own, removed at the
# end, never the user's. Set before anything imports jax.
JAX_CACHE = tempfile.mkdtemp(prefix="aiayn-tests-jax-cache-")
os.environ["AIAYN_JAX_CACHE"] = JAX_CACHE
atexit.register(shutil.rmtree, JAX_CACHE, ignore_errors=True)
# Likewise the corpus stores the runs of --train specs build (train/data/corpus_store.py).
DATA_CACHE = tempfile.mkdtemp(prefix="aiayn-tests-data-cache-")
os.environ["AIAYN_DATA_CACHE"] = DATA_CACHE
atexit.register(shutil.rmtree, DATA_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def multi30k() -> Path:
    path = SHARED_DATA / "multi30k"
    if not (path / "train.de.gz").is_file():
        pytest.skip(f"Multi30k not found at {path} (it lives in ../shared beside the repository)")
    return path


@pytest.fixture(scope="session")
def tiny_torch_run(tmp_path_factory):
    """A 2-step torch run (checkpoint at step 2) shared by the tests that only read a run:
    translate, evaluate, copies to damage or edit. Never write into it."""
    from train import loop
    from train.config import ExperimentConfig

    run_dir = tmp_path_factory.mktemp("tiny-torch-run") / "run"
    loop.train(ExperimentConfig(
        backend="torch", run_dir=str(run_dir), steps=2, numbers_train=300, numbers_valid=4, numbers_test=0,
        max_len=16, token_budget=512, model={"num_encoder_layers": 1, "num_decoder_layers": 1}, progress=False,
        samples=0, eval_sentences=4, beam=1,
    ))
    return run_dir


@pytest.fixture(scope="session")
def tiny_torch_and_jax_runs(tiny_torch_run, tmp_path_factory):
    """(`tiny_torch_run`, the same weights converted to a JAX run dir): read them, never write."""
    from parity.commands.convert import main as convert

    jax_dir = tmp_path_factory.mktemp("tiny-jax-run") / "run"
    assert convert(["--to", "jax", "--run-dir", str(tiny_torch_run), "--dst", str(jax_dir)]) == 0
    return tiny_torch_run, jax_dir
