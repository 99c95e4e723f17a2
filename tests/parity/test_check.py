"""`aiayn check`: figures within the contract's bounds, and a check that can fail."""

import json

import pytest

from parity import comparison
from parity.commands import check
from torch_reference.config import TransformerConfig

# Lopsided (1 encoder layer, 2 decoder layers) so that a swapped stack cannot pass; each layer costs compile time.
LOPSIDED = dict(src_vocab_size=97, tgt_vocab_size=97, d_model=24, num_heads=3, d_ff=40,
                num_encoder_layers=1, num_decoder_layers=2, max_len=64)


@pytest.mark.parametrize("variant", list(comparison.VARIANTS), ids=str)  # 5-15 s each on one core
def test_gradients_match_for_every_variant(variant):
    overrides = dict(comparison.VARIANTS[variant])
    if not overrides.get("share_embeddings", True):
        overrides["tgt_vocab_size"] = 101
    cfg = TransformerConfig(**{**LOPSIDED, **overrides})
    report = comparison.run_check(cfg, batch_size=5, src_len=13, tgt_len=9, seed=1)
    bounds = comparison.bounds_for("tiny")
    assert report["logits"]["max_abs"] <= bounds["logits_max_abs"]
    assert report["loss"]["rel"] <= bounds["loss_rel"]
    if report.get("relu_kink", {"units": 0})["units"] == 0:
        assert report["grads"]["max_rel_l2"] <= bounds["grad_rel_l2"]
    else:  # a ReLU input within float32 rounding of 0: the smooth path carries the bound
        assert report["smooth_path_grads"]["max_rel_l2"] <= bounds["grad_rel_l2"]
    assert set(report["grads"]["per_parameter"]) == set(
        k for k, _ in __import__("torch_reference").Transformer(cfg).named_parameters()
    )
    assert comparison.failures(report, bounds) == []


def test_key_bias_gradient_is_measured_against_its_weight():
    assert (comparison.gradient_scale_key("decoder.layers.0.cross_attn.k_proj.bias")
            == "decoder.layers.0.cross_attn.k_proj.weight")
    assert (comparison.gradient_scale_key("decoder.layers.0.cross_attn.q_proj.bias")
            == "decoder.layers.0.cross_attn.q_proj.bias")


def test_relu_kink_detection_counts_inputs_near_zero():
    import torch
    import torch_reference

    cfg = TransformerConfig(**LOPSIDED, dropout=0.0)
    torch.manual_seed(0)
    model = torch_reference.Transformer(cfg)
    batch = comparison.random_batch(cfg, 5, 13, 9, seed=1)
    tight = comparison.relu_inputs_near_kink(model, batch, radius=1e-12)
    loose = comparison.relu_inputs_near_kink(model, batch, radius=10.0)
    assert tight["units"] == 0
    total = 5 * 13 * 40 * 1 + 5 * 9 * 40 * 2  # every FeedForward input: encoder and decoder tokens x d_ff
    assert loose["units"] == total and loose["closest"] < 1.0


def test_cli_writes_json_and_exits_zero(tmp_path):
    out = tmp_path / "report.json"
    code = check.main(["--preset", "tiny", "--vocab-size", "101", "--batch-size", "3", "--src-len", "9",
                       "--tgt-len", "7", "--set", "norm_position=pre", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["passed"] is True
    result = report["results"]["custom"]
    assert result["config"]["norm_position"] == "pre"
    assert result["logits"]["max_abs"] <= 1e-5 and result["failures"] == []


def test_cli_exits_nonzero_when_a_bound_is_exceeded(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(comparison.BOUNDS, "loss_rel", 0.0)
    monkeypatch.setitem(comparison.BOUNDS["logits_max_abs"], "tiny", 1e-12)
    code = check.main(["--preset", "tiny", "--vocab-size", "101", "--batch-size", "3", "--src-len", "9", "--tgt-len", "7"])
    assert code == 1
    assert "bound exceeded: logits max abs" in capsys.readouterr().out


def test_cli_rejects_bad_overrides(capsys):
    """A value the config refuses: one line and status 1 before any work; a field it lacks: argparse's usage error."""
    assert check.main(["--set", "activation=tanh"]) == 1
    assert "activation must be one of relu, gelu, silu, swiglu, got 'tanh'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        check.main(["--set", "no_such_field=1"])
    assert exit_.value.code == 2
