"""Shared test set-up: the test processes' own caches, the shared corpus path, and the tiny trained runs every
package's tests read."""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _pin_xdist_worker() -> None:
    """Under pytest-xdist (`-n 2` in pyproject's addopts) each worker runs on its own share of the cores, so
    torch's threads and XLA's devices, sized to what a process sees, leave the other worker's cores alone.
    Unpinned, two workers on 2 cores ran slower than one process (docs/operations.md)."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker is None or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    share = cores[int(worker.removeprefix("gw")) % count::count]
    if share:  # fewer cores than workers: this one shares them all
        os.sched_setaffinity(0, share)


_pin_xdist_worker()  # before anything imports torch or jax
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


# The costliest test files, costliest first (their seconds: docs/operations.md#the-test-suites-cost), so that the
# two xdist workers, which take whole files (`--dist loadfile`: a module's fixture is built once), end together.
FIRST = (
    "tests/train/test_default_run.py",
    "tests/parity/test_decode.py",
    "tests/train/test_distributed.py",
    "tests/parity/test_check.py",
    "tests/train/test_translate_stream.py",
    "tests/train/test_loop.py",
    "tests/train/test_torch_ddp.py",
    "tests/test_tour.py",
    "tests/jax_transformer/test_xla_cpu.py",
    "tests/test_docs.py",
    "tests/train/test_crash_and_resume.py",
    "tests/parity/test_ensemble.py",
    "tests/parity/test_finetune_page.py",
    "tests/parity/test_marian.py",
    "tests/train/test_backends.py",
    "tests/train/test_fsdp.py",
    "tests/parity/test_checkpoint_conversion.py",
    "tests/train/test_bench.py",
    "tests/parity/test_kernels.py",
    "tests/parity/test_exports.py",
    "tests/train/test_checkpoints.py",
    "tests/parity/test_trajectory.py",
    "tests/parity/test_sampling.py",
    "tests/parity/test_translate_bench_hf.py",
    "tests/parity/test_ctranslate2.py",
    "tests/jax_transformer/test_jax_model.py",
)


def pytest_collection_modifyitems(config, items):
    missing = [path for path in FIRST if not (REPO / path).is_file()]
    if missing:  # a renamed file would silently lose its place
        raise pytest.UsageError(f"tests/conftest.py FIRST names files that do not exist: {', '.join(missing)}")
    rank = {path: i for i, path in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(FIRST)))
