"""jax_transformer.residuals: Flax's LayerNorm and linear2(relu(h)) with the same values, the same
gradients to float32 rounding, and what they exist for: one array fewer kept for the backward
pass in every LayerNorm and every ReLU feed-forward layer of the compiled train step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_transformer.model as model_module
import jax_transformer.residuals as residuals
from jax_transformer.objective import label_smoothed_sums
from jax_transformer.residuals import LayerNorm, layer_norm, relu_linear
from torch_reference.config import TransformerConfig

RNG = np.random.default_rng(0)


def normal(*shape, scale=1.0, shift=0.0):
    return jnp.asarray(RNG.standard_normal(shape) * scale + shift, jnp.float32)


def flax_layer_norm(x, scale, bias):
    norm = nnx.LayerNorm(x.shape[-1], epsilon=1e-6, use_fast_variance=False, rngs=nnx.Rngs(0))
    norm.scale[...], norm.bias[...] = scale, bias
    return nnx.LayerNorm.__call__(norm, x)


def pullback_both(f, g, *args):
    out_f, pull_f = jax.vjp(f, *args)
    out_g, pull_g = jax.vjp(g, *args)
    cotangent = normal(*out_f.shape)
    return (out_f, *pull_f(cotangent)), (out_g, *pull_g(cotangent))


def test_layer_norm_is_flax_layer_norm_forward_and_backward():
    x, scale, bias = normal(4, 6, 32, scale=3.0, shift=1.0), normal(32), normal(32)
    (y, *ours), (y_flax, *theirs) = pullback_both(
        lambda x, s, b: layer_norm(x, s, b, 1e-6), flax_layer_norm, x, scale, bias
    )
    np.testing.assert_array_equal(y, y_flax)  # the same operations in the same order
    for a, b in zip(ours, theirs):
        # 2e-6 of the largest entry: the backward's means summed in another order (measured 2.4e-7).
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-6 * float(jnp.abs(b).max()))


def test_the_model_layer_norm_has_flax_parameters_and_falls_back_where_not_float32():
    norm = LayerNorm(8, epsilon=1e-6, use_fast_variance=False, rngs=nnx.Rngs(0))
    assert set(nnx.to_pure_dict(nnx.state(norm, nnx.Param))) == {"scale", "bias"}
    x = normal(2, 3, 8)
    assert "custom_vjp_call" in str(jax.make_jaxpr(lambda x: norm(x))(x))
    assert "custom_vjp_call" not in str(jax.make_jaxpr(lambda x: norm(x))(x.astype(jnp.bfloat16)))


def test_relu_linear_is_relu_then_matmul_forward_and_backward():
    h, w = normal(4, 6, 16), normal(16, 8)
    h = h.at[0, 0, :4].set(0.0)  # relu's kink: both give the gradient 0 there
    ours, reference = pullback_both(relu_linear, lambda h, w: jax.nn.relu(h) @ w, h, w)
    for a, b in zip(ours, reference):
        # 1e-6: float32 matmuls with another summation order, at O(1)-O(10) magnitudes.
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert not np.asarray(ours[1][0, 0, :4]).any()


def compiled_step_temporaries(cfg: TransformerConfig, batch: int, length: int) -> int:
    """Bytes of temporaries in the compiled SGD step (state donated) of a model built from cfg."""
    graphdef, params, rest = nnx.split(model_module.Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    src = jnp.full((batch, length), 5, jnp.int32)
    tgt = jnp.full((batch, length), 6, jnp.int32)

    def loss(p):
        return label_smoothed_sums(nnx.merge(graphdef, p, rest)(src, tgt), tgt, cfg.pad_id, 0.1)[0]

    def step(p):
        return jax.tree.map(lambda a, g: a - 0.1 * g, p, jax.grad(loss)(p))

    return jax.jit(step, donate_argnums=0).lower(params).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="measured on XLA:CPU, used there alone")
def test_the_train_step_keeps_one_array_less_per_layer_norm_and_feed_forward(monkeypatch):
    cfg = TransformerConfig.preset("tiny", src_vocab_size=500, tgt_vocab_size=500, max_len=64, dropout=0.0)
    batch, length = 16, 32
    ours = compiled_step_temporaries(cfg, batch, length)
    monkeypatch.setattr(model_module, "cpu_tuned", lambda: False)  # jax.nn.relu in FeedForward
    monkeypatch.setattr(residuals, "cpu_tuned", lambda: False)  # Flax's own LayerNorm
    plain = compiled_step_temporaries(cfg, batch, length)
    layers = cfg.num_encoder_layers + cfg.num_decoder_layers
    norms = 2 * cfg.num_encoder_layers + 3 * cfg.num_decoder_layers
    one_array_each = 4 * batch * length * (layers * cfg.d_ff + norms * cfg.d_model)
    # Measured: 2.26 MiB less, one_array_each 2.25 MiB; 10% margin for how XLA packs the rest.
    assert plain - ours >= 0.9 * one_array_each, (plain, ours, one_array_each)
