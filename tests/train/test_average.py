"""Checkpoint averaging (`aiayn average`): the mean of a run's newest N checkpoints as a new run
that translate, evaluate and resume accept. Parity across frameworks: tests/parity/test_checkpoint_conversion.py."""

import json

import numpy as np
import pytest

from train import averaging, loop
from train.backends import create_backend
from train.checkpoints import TrainingState
from train.commands import average, evaluate, translate
from train.commands import run as train_run
from train.config import ExperimentConfig
from train.runtime import read_experiment, read_model_config


def _state(step: int, value: float) -> TrainingState:
    weights = {"w": np.full((2, 3), value, np.float32)}
    return TrainingState("torch", step, weights, {"w": np.full((2, 3), step, np.float32)}, {"w": np.ones((2, 3), np.float32)}, None)


def test_average_states_is_the_float64_mean_rounded_once():
    # A float32 running sum loses the ones (2^24 + 1 rounds to 2^24) and gives 2^22; the mean is
    # 2^22 + 0.5, a float32.
    states = [_state(1, 2.0**24), _state(2, 1.0), _state(3, 1.0), _state(4, 0.0)]
    averaged = averaging.average_states(states)
    assert averaged.params["w"].dtype == np.float32
    np.testing.assert_array_equal(averaged.params["w"], np.float32(2**22 + 0.5))
    assert averaged.step == 4 and averaged.mu["w"][0, 0] == 4  # the newest state's moments and step
    with pytest.raises(ValueError):
        averaging.average_states([])


def _config(run_dir, **changes) -> ExperimentConfig:
    return ExperimentConfig(
        backend="torch", run_dir=str(run_dir), steps=6, eval_every=2, keep_checkpoints=3, threads=1,
        numbers_train=1500, numbers_valid=20, numbers_test=20, max_len=16, token_budget=512, eval_sentences=10,
        model={"num_encoder_layers": 1, "num_decoder_layers": 1}, progress=False, samples=0, **changes,
    )


@pytest.fixture(scope="module")
def run_with_checkpoints(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("avg") / "run"
    loop.train(_config(run_dir))
    return run_dir


def test_a_run_ends_with_the_mean_of_its_last_checkpoints(run_with_checkpoints, tmp_path):
    """--average-last (2 for the numbers corpus): the final checkpoint holds the mean of the
    weights of the step before it and the final step's own, as a run without averaging has them."""
    results = json.loads((run_with_checkpoints / "results.json").read_text())
    assert results["config"]["average_last"] == 2 and results["averaged_steps"] == [4, 6]
    plain_dir = tmp_path / "plain"
    assert loop.train(_config(plain_dir, average_last=1))["averaged_steps"] is None
    plain = [_weights(plain_dir, step) for step in (4, 6)]
    before = _weights(run_with_checkpoints, 4)
    for name, value in plain[0].items():  # torch on one thread: the same updates up to the end, bit for bit
        np.testing.assert_array_equal(before[name], value, err_msg=name)
    for name, value in _weights(run_with_checkpoints, 6).items():
        expected = ((plain[0][name].astype(np.float64) + plain[1][name]) / 2).astype(np.float32)
        np.testing.assert_array_equal(value, expected, err_msg=name)
    assert ExperimentConfig(average_last=3).average_last == 3  # more than are kept: the kept ones (see _average_last)


def _weights(run_dir, step):
    backend = create_backend(read_experiment(run_dir), read_model_config(run_dir), str(run_dir / "checkpoints"))
    backend.restore(step)
    return backend.weights()


def test_cli_averages_the_newest_checkpoints_into_a_run_that_translates_evaluates_and_resumes(
    run_with_checkpoints, tmp_path, capsys
):
    dst = tmp_path / "averaged"
    assert average.main(["--run-dir", str(run_with_checkpoints), "--last", "3", "--dst", str(dst)]) == 0
    assert "averaged steps 2, 4, 6" in capsys.readouterr().out
    assert json.loads((dst / "averaged.json").read_text())["averaged_steps"] == [2, 4, 6]
    kept = [_weights(run_with_checkpoints, s) for s in (2, 4, 6)]
    mean = _weights(dst, 6)
    for name, value in mean.items():
        expected = (sum(w[name].astype(np.float64) for w in kept) / 3).astype(np.float32)
        np.testing.assert_array_equal(value, expected, err_msg=name)
    assert not np.array_equal(mean["encoder.layers.0.ff.linear1.weight"], kept[-1]["encoder.layers.0.ff.linear1.weight"])

    # Translate and evaluate read it like any run; training resumes from the averaged weights.
    (tmp_path / "in.txt").write_text("siebenundzwanzig\n\nhundertzwei\n")
    assert translate.main(["--run-dir", str(dst), "--input", str(tmp_path / "in.txt")]) == 0
    assert len(capsys.readouterr().out.split("\n")) == 4  # three lines out for three in
    assert evaluate.main(["--run-dir", str(dst), "--data", "numbers:valid", "--beam", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 6
    assert train_run.main(["--run-dir", str(dst), "--resume", "--steps", "8", "--no-progress", "--threads", "1"]) == 0
    assert json.loads((dst / "results.json").read_text())["steps"] == 8


def test_cli_errors(run_with_checkpoints, tmp_path, capsys):
    src = str(run_with_checkpoints)
    code = average.main(["--run-dir", src, "--last", "5", "--dst", str(tmp_path / "x")])
    assert code == 1
    assert "keeps 3 checkpoint(s) (steps 2, 4, 6), fewer than --last 5" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    for args, message in (
        (["--dst", src], "--dst must differ"),
        (["--dst", str(tmp_path)], "is not empty and holds no run"),
    ):
        (tmp_path / "stray").write_text("x")
        code = average.main(["--run-dir", src, "--last", "2", *args, "--overwrite"])
        assert code == 1 and message in capsys.readouterr().err
    assert average.main(["--run-dir", src, "--last", "0", "--dst", str(tmp_path / "y")]) == 1  # Averaging's check
    assert capsys.readouterr().err == "error: --last must be >= 1, got 0\n"
    for last in (0, -1):  # from Python too: 0 averaged every checkpoint, -1 all but the oldest
        with pytest.raises(ValueError, match=f"last must be >= 1, got {last}"):
            averaging.average_run(src, tmp_path / "y", last=last)
    assert not (tmp_path / "y").exists()
