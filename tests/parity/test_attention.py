"""Cross-attention weights returned by the models (`return_attention=True`): torch = JAX, rows
that are distributions, padding that gets nothing, and the same logits as without the flag.

Tolerances:
- torch vs JAX, 1e-5 max abs, the parity contract's float32 logits bound for tiny models: a
  weight p_i = softmax(s)_i moves by at most 2 p_i max_j |Δs_j| <= 2 max|Δs| when the scores s
  move by Δs, and the scores are float32 dot products of the same depth as the logits (measured
  on this configuration: <= 5.7e-7; on the tiny and small presets <= 4.8e-7 and 9.2e-7);
- a row's sum, S float32 epsilons for S source positions: each of the S weights and each partial
  sum is rounded once (relative 2^-24), so |Σ - 1| <= S * 2^-23 (measured 2.4e-7 = two ulps).
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torch_reference as tr
from parity.comparison import enable_parity_numerics
from train.interop.weights import torch_to_jax

enable_parity_numerics()

CONFIG = dict(src_vocab_size=53, tgt_vocab_size=53, d_model=24, num_heads=3, d_ff=40,
              num_encoder_layers=2, num_decoder_layers=3, max_len=40, dropout=0.0)
B, S, T = 5, 11, 9


def batch(seed=0):
    """Right-padded sources (rows of lengths 11, 3, and others; each ending in EOS) and decoder
    inputs (BOS then tokens, right-padded)."""
    rng = np.random.default_rng(seed)
    src = np.zeros((B, S), np.int64)
    for row, n in enumerate([S, 3, *rng.integers(2, S, size=B - 2)]):
        src[row, : n - 1] = rng.integers(4, 53, size=n - 1)
        src[row, n - 1] = 2
    tgt_in = rng.integers(4, 53, size=(B, T))
    tgt_in[:, 0] = 1
    tgt_in[1, 4:] = 0
    return src, tgt_in


@pytest.mark.parametrize("overrides", [{}, {"norm_position": "pre", "positions": "learned"}])
def test_cross_attention_agrees_sums_to_one_and_ignores_padding(overrides):
    torch.manual_seed(0)
    torch_model = tr.Transformer(tr.TransformerConfig(**{**CONFIG, **overrides})).eval()
    jax_model = torch_to_jax(torch_model)
    src, tgt_in = batch()

    with torch.no_grad():
        logits_t, attention_t = torch_model(torch.from_numpy(src), torch.from_numpy(tgt_in), return_attention=True)
        plain_t = torch_model(torch.from_numpy(src), torch.from_numpy(tgt_in))
    logits_j, attention_j = jax_model(jnp.asarray(src), jnp.asarray(tgt_in), return_attention=True)
    plain_j = jax_model(jnp.asarray(src), jnp.asarray(tgt_in))
    attention_t, attention_j = attention_t.numpy(), np.asarray(attention_j)

    # Asking for the weights changes nothing else: the same operations, bit for bit.
    np.testing.assert_array_equal(logits_t.numpy(), plain_t.numpy())
    np.testing.assert_array_equal(np.asarray(logits_j), np.asarray(plain_j))

    assert attention_t.shape == attention_j.shape == (B, CONFIG["num_decoder_layers"], CONFIG["num_heads"], T, S)
    assert attention_t.dtype == attention_j.dtype == np.float32
    np.testing.assert_allclose(attention_j, attention_t, rtol=0, atol=1e-5)

    padded = np.broadcast_to((src == 0)[:, None, None, None, :], attention_t.shape)
    for attention in (attention_t, attention_j):
        np.testing.assert_allclose(attention.sum(-1), 1.0, rtol=0, atol=S * 2.0**-23)
        # exp(finfo.min - max) underflows to exactly 0: padding gets no weight at all.
        assert padded.any() and (attention[padded] == 0).all()
        assert (attention[~padded] > 0).all()
    # The layers differ (a stacking mistake would repeat one layer).
    assert not np.allclose(attention_t[:, 0], attention_t[:, -1])


def test_each_layer_is_its_own_cross_attention():
    """Layer l's weights are softmax(q kᵀ/√K) of that layer's cross_attn, computed here by hand
    from the layer's projections of its input, captured with a forward hook (torch)."""
    torch.manual_seed(1)
    model = tr.Transformer(tr.TransformerConfig(**CONFIG)).eval()
    src, tgt_in = (torch.from_numpy(a) for a in batch(1))
    inputs = {}
    hooks = [
        layer.cross_attn.register_forward_hook(lambda m, args, out, i=i: inputs.__setitem__(i, args[:2]))
        for i, layer in enumerate(model.decoder.layers)
    ]
    with torch.no_grad():
        _, attention = model(src, tgt_in, return_attention=True)
    for hook in hooks:
        hook.remove()
    for i, layer in enumerate(model.decoder.layers):
        x, memory = inputs[i]
        attn = layer.cross_attn
        q, k = attn.split_heads(attn.q_proj(x)), attn.split_heads(attn.k_proj(memory))  # (B, H, T|S, K)
        scores = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
        expected = torch.softmax(scores.masked_fill(~tr.padding_mask(src, 0), float("-inf")), dim=-1)
        # The same formula written apart (division by √K, -inf masking): float32 rounding only.
        torch.testing.assert_close(attention[:, i], expected, rtol=0, atol=1e-6)
