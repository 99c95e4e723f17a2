"""The default run (`python -m train.run --backend=jax`, the README's quick start) gets every number
right: 100% exact in every magnitude band on numbers it never trained on, drawn here with this
test's own seed (issue 71, case 4; docs/results.md#the-numbers-corpus)."""

import os
import subprocess
import sys

import numpy as np
import pytest

import train
from train.data.numbers import NUMBER_BANDS, band_range, number_words, numbers_corpus

from .helpers import REPO

DRAW_SEED, PER_BAND = 7117, 150  # the test's own draw: never the corpus's seed 0


def unseen_draw(train_targets: set[str], seed: int = DRAW_SEED, per_band: int = PER_BAND) -> dict[int, list]:
    """Per band, `per_band` numbers (all of a smaller band) with a random spelling, not in training."""
    rng, draw = np.random.default_rng(seed), {}
    for digits in NUMBER_BANDS:
        pairs = []
        for n in rng.permutation(np.arange(band_range(digits).start, band_range(digits).stop)).tolist():
            pair = number_words(n, drop_ein=bool(rng.integers(2)))
            if digits <= 2 or pair[1] not in train_targets:  # 1 and 2 digits: too few to hold out
                pairs.append(pair)
            if len(pairs) == per_band:
                break
        draw[digits] = pairs
    return draw


def test_the_default_run_gets_every_number_right(tmp_path):
    """About 5 minutes on 2 CPUs: the default command as written, run in a fresh directory."""
    done = subprocess.run([sys.executable, "-m", "train.run", "--backend=jax"], cwd=tmp_path, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=3600)
    assert done.returncode == 0, done.stderr[-2000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    trained = {t for _, t in numbers_corpus(40_000, 500, 1_000, seed=0).train}
    with train.load(run_dir) as run:
        for digits, pairs in unseen_draw(trained).items():
            assert len(pairs) >= min(PER_BAND, len(band_range(digits)))
            wrong = [(s, t, h) for (s, t), h in zip(pairs, run.translate([s for s, _ in pairs])) if h != t]
            assert not wrong, (digits, wrong)


def test_the_draw_holds_only_numbers_the_default_run_never_trained_on():
    """The test above's premise, in a second: its own numbers, 150 a band (all 10 and 90 of the small
    bands, which training holds whole), none of 3+ digits in the default run's training split."""
    trained = {t for _, t in numbers_corpus(40_000, 500, 1_000, seed=0).train}
    draw = unseen_draw(trained)
    assert [len(draw[d]) for d in NUMBER_BANDS] == [10, 90, 150, 150, 150, 150]
    assert not any(t in trained for d in NUMBER_BANDS[2:] for _, t in draw[d])
    assert draw != unseen_draw(trained, seed=0)  # not the corpus's own seed's order
