"""aiayn trajectory: one training curve in both frameworks, and one run across them.

100 updates of the product's training code (train.backends.jax_backend / train.backends.torch_backend: Adam, the
paper's schedule, label smoothing 0.1) from the same initial weights on identical batches,
dropout off, float32; at update 50 each run's checkpoint is converted and continued in the other
framework. Lopsided model (d_model=24 with 3 heads, 2 encoder layers and 1 decoder layer) and a
small batch, so that it runs in seconds on 2 cores.
"""

import json

import numpy as np
import pytest

from parity import trajectories
from parity.commands import trajectory
from torch_reference.objective import noam_learning_rate

LOPSIDED = {"d_model": 24, "num_heads": 3, "d_ff": 40, "num_encoder_layers": 2, "num_decoder_layers": 1}
STEPS, SWITCH = 100, 50


@pytest.fixture(scope="module")
def report():
    cfg = trajectories.experiment_config(STEPS, model=LOPSIDED, numbers_train=600, token_budget=256, max_len=16)
    return trajectories.parity_report(cfg, STEPS, SWITCH)


def _comparison(report, label):
    (found,) = [c for c in report["comparisons"] if c["label"] == label]
    return found


def _assert_parameter_bound(report, label):
    """The parameter bound, judged as `aiayn trajectory` judges it: on the ReLU run itself, or,
    where one of its units flipped (a ReLU input within rounding of 0 lands on either side, Adam
    makes that a full-size step; CI's CPU did so once: 1.67e-4 in every comparison, a flip in one
    framework before update 50), on the smooth path -- the same initial weights with exact GELU."""
    c = _comparison(report, label)
    if c["final_param_rel_l2"] <= 1e-4:
        return
    assert "smooth_path" in report, f"{label}: {c['final_param_worst']} rel L2 {c['final_param_rel_l2']:.3g}"
    smooth = _comparison(report["smooth_path"], label)
    assert max(smooth["per_step"]["loss_rel"]) <= 1e-5 and smooth["final_param_rel_l2"] <= 1e-4


def test_one_curve_in_both_frameworks(report):
    c = _comparison(report, "jax vs torch")
    assert c["per_step"]["step"] == list(range(1, STEPS + 1)) and c["bounded"]
    # 1e-5 at every update: float32 rounding of two libraries (summation orders, fused kernels)
    # through 100 Adam updates; measured <=2.3e-7 here (<=1.3e-6 on the tiny preset). A formula
    # slip (schedule one update off, epsilon placement, smoothing mass) is >=1e-3 within a few.
    assert max(c["per_step"]["loss_rel"]) <= trajectories.BOUNDS["loss_rel"] == 1e-5
    # 1e-4 per parameter after 100 updates (measured <=4.3e-7 here): the biases start at 0, so
    # their relative error is the relative error of their accumulated updates.
    params = c["final_per_parameter"]
    bounded = {k: v for k, v in params.items() if not k.endswith(".k_proj.bias")}
    assert max(bounded.values()) == c["final_param_rel_l2"] and trajectories.BOUNDS["param_rel_l2"] == 1e-4
    _assert_parameter_bound(report, "jax vs torch")
    # Excluded, with their figure reported: the key biases' gradient is analytically 0 (softmax
    # is shift invariant), so Adam turns rounding noise into independent +-lr steps per run.
    # Measured rel L2 ~1.6: noise against noise, which is why they cannot be bounded.
    noise = sorted(k for k in params if k.endswith(".k_proj.bias"))
    assert len(noise) == 4  # encoder: 2 self-attention; decoder: 1 self- and 1 cross-attention
    assert c["k_proj_bias"]["worst"] in noise and c["k_proj_bias"]["max_rel_l2"] > 1e-2
    # The run trains: the loss falls (measured 6.67 -> 6.16) on the paper's schedule.
    losses = report["losses"]
    assert losses["torch"][-1] < losses["torch"][0] - 0.3 and len(losses["jax"]) == STEPS
    np.testing.assert_allclose(report["lr"], [noam_learning_rate(n, 24, 4000) for n in range(1, STEPS + 1)])
    assert report["failures"] == []


@pytest.mark.parametrize("first,then", [("jax", "torch"), ("torch", "jax")])
def test_a_run_continued_in_the_other_framework(report, first, then):
    """50 updates in one framework, its checkpoint converted, 50 in the other = 100 in the other."""
    assert report["conversion_bit_exact"][f"{first}→{then}"] is True  # save, convert, restore: bit for bit
    c = _comparison(report, f"{first} {SWITCH} + {then} {STEPS - SWITCH} vs {then} {STEPS}")
    assert c["from_step"] == SWITCH and c["per_step"]["step"] == list(range(SWITCH + 1, STEPS + 1))
    # The same bounds as one curve in both frameworks, for the same reasons (measured <=2.2e-7
    # for the losses, <=2.3e-7 for the parameters). A lost Adam state or schedule position would
    # be >=3e-2 off within two updates (test_checkpoint_conversion).
    assert max(c["per_step"]["loss_rel"]) <= 1e-5
    _assert_parameter_bound(report, c["label"])
    # Both runs started from the same checkpoint: update 51's loss is computed from identical
    # weights in one framework against the other's continuation, so it is at rounding level.
    assert c["per_step"]["loss_rel"][0] <= 1e-6


def test_the_report_can_be_read(report, tmp_path, capsys):
    trajectory.print_report(report)
    out = capsys.readouterr().out
    assert "jax vs torch" in out and "bit-exact" in out and "bounds: loss rel <= 1e-05" in out and ": met" in out
    assert json.loads(json.dumps(report))["steps"] == STEPS  # JSON-able as written by --json
    png = trajectories.plot(report, tmp_path / "curve.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    growth = trajectories.growth(report["comparisons"][0])
    assert [s for s, _, _ in growth] == [1, 10, 25, 50, 75, 100]


def _synthetic(loss, param, label="jax vs torch"):
    per = {"step": [1], "loss_rel": [loss], "param_rel_l2": [param]}
    return {"label": label, "bounded": True, "max_loss_rel": loss, "max_loss_rel_step": 1,
            "final_param_rel_l2": param, "final_param_worst": "w", "per_step": per}


def test_relu_parameters_are_excused_only_by_a_smooth_path_that_meets_the_bound():
    """As aiayn check does for gradients: a flipped ReLU unit (an input within rounding of 0)
    gets a gradient in one framework only, and Adam makes that a full step for that unit; the
    same weights with GELU (continuous derivative) must then meet the bound. The loss bound is
    never excused."""
    over = {"comparisons": [_synthetic(1e-6, 8e-4)], "conversion_bit_exact": {}}
    assert trajectories.failures(over) == ["jax vs torch: w rel L2 0.0008 > 0.0001"]
    smooth_ok = {"comparisons": [_synthetic(2e-7, 5e-7)], "conversion_bit_exact": {}}
    assert trajectories.failures({**over, "smooth_path": smooth_ok}) == []
    smooth_bad = {"comparisons": [_synthetic(2e-7, 3e-4)], "conversion_bit_exact": {}}
    assert trajectories.failures({**over, "smooth_path": smooth_bad}) == [
        "smooth path (GELU): jax vs torch: w rel L2 0.0003 > 0.0001"
    ]
    loss_over = {"comparisons": [_synthetic(3e-5, 5e-7)], "conversion_bit_exact": {"jax→torch": False}}
    assert trajectories.failures({**loss_over, "smooth_path": smooth_ok}) == [
        "jax vs torch: loss rel 3e-05 at update 1 > 1e-05",
        "jax→torch: the converted checkpoint did not restore bit-exactly",
    ]


def test_weights_comparison_names_the_worst_and_keeps_the_key_biases_apart():
    ref = {"a.k_proj.bias": np.ones(4), "a.k_proj.weight": np.ones((4, 4)), "b.bias": np.ones(3)}
    got = {"a.k_proj.bias": -np.ones(4), "a.k_proj.weight": np.ones((4, 4)) * (1 + 1e-5), "b.bias": np.ones(3)}
    diff = trajectories.compare_weights(got, ref)
    assert diff["worst"] == "a.k_proj.weight" and diff["max_rel_l2"] == pytest.approx(1e-5)
    assert diff["k_proj_bias"] == {"max_rel_l2": pytest.approx(2.0), "worst": "a.k_proj.bias", "max_abs": 2.0}


def test_one_ulp_away_moves_every_weight_by_one_rounding_error():
    from train.checkpoints import TrainingState

    w = np.linspace(-1, 1, 1001, dtype=np.float32)
    moved = trajectories.one_ulp_away(TrainingState("torch", 0, {"w": w})).params["w"]
    assert moved.dtype == np.float32 and not np.any(moved == w)
    np.testing.assert_array_equal(np.nextafter(moved, w), w)  # neighbours: nothing representable between
    assert 0.4 < np.mean(moved > w) < 0.6  # up or down at random


def test_cli(tmp_path):
    """A few updates through the command line: JSON and plot written, exit status 0."""
    args = ["--steps", "2", "--switch", "1", "--numbers-train", "300", "--token-budget", "256", "--max-len", "16",
            "--set", "d_model=24", "--set", "num_heads=3", "--set", "d_ff=40", "--set", "num_decoder_layers=1",
            "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png")]
    assert trajectory.main(args) == 0
    written = json.loads((tmp_path / "r.json").read_text())
    assert written["steps"] == 2 and written["failures"] == [] and written["command"].startswith("aiayn trajectory")
    assert len(written["comparisons"]) == 3 and (tmp_path / "r.png").is_file()
