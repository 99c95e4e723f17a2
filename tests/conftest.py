"""Shared test set-up: parity numerics (float32 matmuls everywhere) and the shared corpus path."""

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(scope="session")
def multi30k() -> Path:
    path = SHARED_DATA / "multi30k"
    if not (path / "train.de.gz").is_file():
        pytest.skip(f"Multi30k not found at {path} (it lives in ../shared beside the repository)")
    return path
