"""Shared test set-up: parity numerics (float32 matmuls everywhere) and the shared corpus path."""

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
