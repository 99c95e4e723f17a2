"""The bfloat16 budget (docs/parity.md#bfloat16): mixed precision against float32, the same weights, on
the CPU, in both twins (JAX `Transformer(dtype=bfloat16)`, torch under `torch.autocast`).

Budget, from bfloat16's 8-bit significand (relative rounding 2^-9 = 0.2% per operation, compounded
over the layers): the logits within 2% of the largest logit's magnitude (measured on this batch,
tiny preset: 0.76% torch, 0.88% JAX; small preset 0.72%, 0.78%), and the label-smoothed loss, a
mean over tokens where roundings partly cancel, within 2e-3 of float32's (measured 5.6e-4 torch,
5.1e-4 JAX; small 2.3e-4, 7.4e-4, at a loss of about 6.4).
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import jax_transformer as jt
import torch_reference as tr
from jax_transformer import objective as jax_objective
from parity.comparison import enable_parity_numerics
from torch_reference import objective as torch_objective
from train.interop.weights import torch_to_jax

enable_parity_numerics()

LOGITS_BUDGET = 0.02  # of max |logit|
LOSS_BUDGET = 2e-3  # absolute, at a loss of about 6.4


def batch():
    rng = np.random.default_rng(0)
    src = rng.integers(4, 400, size=(8, 20))
    src[3, 12:] = 0
    tgt_out = rng.integers(4, 400, size=(8, 18))
    tgt_out[5, 10:] = 0
    return src, np.concatenate([np.ones((8, 1), np.int64), tgt_out[:, :-1]], 1), tgt_out


def test_bfloat16_logits_and_loss_stay_within_the_budget_in_both_twins():
    cfg = tr.TransformerConfig.preset("tiny", src_vocab_size=400, tgt_vocab_size=400, max_len=64, dropout=0.0)
    src, tgt_in, tgt_out = batch()
    torch.manual_seed(0)
    torch_model = tr.Transformer(cfg).eval()
    results = {}
    with torch.no_grad():
        for dtype in ("float32", "bfloat16"):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
                logits = torch_model(torch.from_numpy(src), torch.from_numpy(tgt_in))
            loss = torch_objective.label_smoothed_cross_entropy(logits, torch.from_numpy(tgt_out), 0, 0.1)
            results["torch", dtype] = logits.float().numpy(), float(loss)
    float32 = torch_to_jax(torch_model)
    bfloat16 = jt.Transformer(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    nnx.update(bfloat16, nnx.state(float32))  # the same float32 parameters, cast at use
    for dtype, model in (("float32", float32), ("bfloat16", bfloat16)):
        logits = nnx.jit(lambda m, s, t: m(s, t))(model, jnp.asarray(src), jnp.asarray(tgt_in))  # jit: eager is slow
        loss = jax_objective.label_smoothed_cross_entropy(logits, jnp.asarray(tgt_out), 0, 0.1)
        results["jax", dtype] = np.asarray(logits, np.float32), float(loss)
    assert results["jax", "bfloat16"][0].dtype == np.float32
    for framework in ("torch", "jax"):
        (logits32, loss32), (logits16, loss16) = results[framework, "float32"], results[framework, "bfloat16"]
        error = np.abs(logits16 - logits32).max()
        assert 0 < error <= LOGITS_BUDGET * np.abs(logits32).max(), framework  # > 0: bfloat16 did run
        assert loss16 == pytest.approx(loss32, abs=LOSS_BUDGET), framework
