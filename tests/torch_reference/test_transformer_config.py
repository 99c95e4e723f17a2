"""Tests of `torch_reference/config.py`: the framework-free model config both models are built from.

The basename is unique on purpose (the test folders have no `__init__.py`, so pytest imports test
files by basename, and `train` has a config of its own).
"""

from __future__ import annotations

import dataclasses

import pytest

from torch_reference.config import TransformerConfig


def test_base_and_big_presets_are_the_papers_table_3_rows():
    base = TransformerConfig.preset("base")
    assert (base.d_model, base.num_heads, base.d_ff, base.num_encoder_layers, base.num_decoder_layers) == (
        512, 8, 2048, 6, 6,
    )
    assert base.dropout == 0.1
    big = TransformerConfig.preset("big")
    assert (big.d_model, big.num_heads, big.d_ff, big.num_encoder_layers, big.num_decoder_layers) == (
        1024, 16, 4096, 6, 6,
    )
    assert big.dropout == 0.3
    assert base.d_model // base.num_heads == big.d_model // big.num_heads == 64  # d_k = d_v = 64 in both rows


def test_defaults_are_the_papers_architecture():
    cfg = TransformerConfig()
    assert (cfg.norm_position, cfg.activation, cfg.norm, cfg.positions) == ("post", "relu", "layernorm", "sinusoidal")
    assert cfg.share_embeddings and cfg.tie_output and cfg.scale_embeddings
    assert cfg.attention_dropout == 0.0
    assert (cfg.pad_id, cfg.bos_id, cfg.eos_id) == (0, 1, 2)


def test_presets_list_and_overrides():
    assert TransformerConfig.presets() == ("tiny", "small", "base", "big")
    cfg = TransformerConfig.preset("base", d_model=256, src_vocab_size=100, tgt_vocab_size=100)
    assert (cfg.d_model, cfg.num_heads, cfg.src_vocab_size) == (256, 8, 100)
    with pytest.raises(ValueError, match="divisible"):
        TransformerConfig.preset("base", d_model=100)  # overrides are validated too


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError) as excinfo:
        TransformerConfig.preset("huge")
    message = str(excinfo.value)
    assert "huge" in message
    assert all(name in message for name in ("tiny", "small", "base", "big"))


@pytest.mark.parametrize(
    "field,value",
    [("norm_position", "middle"), ("activation", "tanh"), ("norm", "batchnorm"), ("positions", "rotary")],
)
def test_invalid_choice_raises(field, value):
    with pytest.raises(ValueError, match=field) as excinfo:
        TransformerConfig(**{field: value})
    assert value in str(excinfo.value)


@pytest.mark.parametrize(
    "fields,match",
    [
        (dict(d_model=30, num_heads=4), "divisible"),
        (dict(d_ff=0), "d_ff"),
        (dict(max_len=-1), "max_len"),
        (dict(num_encoder_layers=-1), "num_encoder_layers"),
        (dict(dropout=1.0), "dropout"),
        (dict(attention_dropout=-0.1), "attention_dropout"),
        (dict(activation_dropout=1.0), "activation_dropout"),
    ],
)
def test_invalid_sizes_raise(fields, match):
    with pytest.raises(ValueError, match=match):
        TransformerConfig(**fields)


def test_share_embeddings_needs_one_vocabulary():
    with pytest.raises(ValueError, match="share_embeddings"):
        TransformerConfig(src_vocab_size=100, tgt_vocab_size=90, share_embeddings=True)
    cfg = TransformerConfig(src_vocab_size=100, tgt_vocab_size=90, share_embeddings=False)
    assert (cfg.src_vocab_size, cfg.tgt_vocab_size) == (100, 90)


def test_json_round_trip():
    cfg = TransformerConfig.preset(
        "tiny", src_vocab_size=123, tgt_vocab_size=77, share_embeddings=False, tie_output=False,
        norm_position="pre", activation="swiglu", norm="rmsnorm", positions="learned", layer_norm_eps=1e-5,
    )
    restored = TransformerConfig.from_json(cfg.to_json())
    assert restored == cfg
    assert restored.to_dict() == dataclasses.asdict(cfg)


def test_from_dict_rejects_unknown_fields():
    data = TransformerConfig().to_dict() | {"d_modle": 512}
    with pytest.raises(ValueError, match="d_modle"):
        TransformerConfig.from_dict(data)


def test_config_is_frozen_and_replace_validates():
    cfg = TransformerConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.d_model = 256
    assert cfg.replace(d_model=256).d_model == 256 and cfg.d_model == 512
    with pytest.raises(ValueError, match="activation"):
        cfg.replace(activation="tanh")


@pytest.mark.parametrize("field", ["attention_bias", "share_embeddings", "tie_output", "scale_embeddings",
                                   "output_bias"])
@pytest.mark.parametrize("value", [1, "false"])
def test_switches_must_be_true_or_false(field, value):
    # output_bias="false" (a JSON string, a typo) built a model with a logits bias, silently.
    with pytest.raises(ValueError, match=f"{field} must be true or false"):
        TransformerConfig(**{field: value})
