"""Float options at their float32 edges (issue 71, case 3): each option, swept over 0, the smallest
subnormal, 1e-300, the largest float32, inf and nan, means the same in both twins, or both refuse
it (`torch_reference.config.float32_error`, the one rule); the training settings share one
validation (`Range`), so every entry point refuses alike."""

import numpy as np
import pytest
import torch

from jax_transformer import decode as jd
from jax_transformer import sampling as js
from parity.comparison import enable_parity_numerics
from torch_reference import decode as td
from torch_reference import sampling as ts
from torch_reference.config import float32_error
from train.config import ExperimentConfig

from .test_decode import pair, source

enable_parity_numerics()

EDGES = [0.0, 5e-324, 1e-300, float(np.finfo(np.float32).max), float("inf"), float("nan")]


def _outcome(call):
    try:
        return np.asarray(call()[0])
    except ValueError:
        return "refused"


@pytest.mark.parametrize("option", ["temperature", "top_p", "alpha"])
def test_each_decoding_option_means_the_same_in_both_twins_at_its_float32_edges(option):
    torch_model, jax_model = pair()
    src = source(batch=2, length=5)
    for value in EDGES:
        if option == "alpha":
            t = _outcome(lambda: td.beam_search(torch_model, torch.from_numpy(src), beam_size=2, alpha=value))
            j = _outcome(lambda: jd.beam_search(jax_model, src, beam_size=2, alpha=value))
        else:
            t = _outcome(lambda: ts.sample(torch_model, torch.from_numpy(src), 3, **{option: value}))
            j = _outcome(lambda: js.sample(jax_model, src, 3, **{option: value}))
        if isinstance(t, str) or isinstance(j, str):
            assert t == j == "refused", (option, value, t, j)
        else:
            np.testing.assert_array_equal(t, j, err_msg=f"{option}={value}")
    # what the issue met: top_p 1e-300 passes (0, 1] but is 0 in float32; 1e-30 keeps the best token
    assert float32_error(1e-300) and float32_error(1e-30) is None


@pytest.mark.parametrize("option", ["lr_factor", "label_smoothing", "dropout", "clip_norm"])
def test_training_float_options_refuse_what_float32_loses(option):
    for value in EDGES:
        try:
            ExperimentConfig(**{option: value})
        except ValueError as err:
            assert option in str(err)
            continue
        assert value == 0.0 or float32_error(value) is None, (option, value)
