"""jax_transformer.xla_cpu: each tuned piece gives what the plain path gives, the model built with
`kernels="xla_cpu"` gives the plain model's losses, gradients and searches on the CPU, and the pieces do
what they exist for (no transposed copy of the logits' gradient, fewer arrays kept by the step)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_transformer
from jax_transformer import decode, xla_cpu
from jax_transformer.objective import label_smoothed_cross_entropy
from jax_transformer.xla_cpu import LayerNorm, layer_norm, linear, linear_dot_general, relu_linear, tied_logits
from torch_reference.config import TransformerConfig

RNG = np.random.default_rng(0)


def normal(*shape, dtype=jnp.float32, scale=1.0, shift=0.0):
    return jnp.asarray(RNG.standard_normal(shape) * scale + shift, dtype)


def vjp_both(f, g, *args):
    """(value, gradients) of f and of g at args, pulled back from one random cotangent."""
    out_f, pull_f = jax.vjp(f, *args)
    out_g, pull_g = jax.vjp(g, *args)
    cotangent = normal(*out_f.shape, dtype=out_f.dtype)
    return (out_f, *pull_f(cotangent)), (out_g, *pull_g(cotangent))


@pytest.mark.parametrize("x_shape, w_shape", [((4, 6, 8), (8, 16)), ((4, 6, 16), (16, 8)), ((5, 8), (8, 8))])
def test_linear_equals_matmul(x_shape, w_shape):
    ours, reference = vjp_both(linear, jnp.matmul, normal(*x_shape), normal(*w_shape))
    for a, b in zip(ours, reference):
        # 1e-6: one float32 matmul with another summation order, at O(1)-O(10) magnitudes.
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_tied_logits_equals_matmul_with_the_transpose():
    ours, reference = vjp_both(tied_logits, lambda h, e: h @ e.T, normal(3, 5, 8), normal(40, 8))
    for a, b in zip(ours, reference):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_bfloat16_gradients_keep_their_dtype():
    (y, dx, dw), _ = vjp_both(linear, jnp.matmul, normal(2, 3, 8, dtype=jnp.bfloat16), normal(8, 4, dtype=jnp.bfloat16))
    assert y.dtype == dx.dtype == dw.dtype == jnp.bfloat16


def test_nnx_linear_uses_it_for_its_own_contraction_only():
    layer = nnx.Linear(8, 4, dot_general=linear_dot_general, rngs=nnx.Rngs(0))
    plain = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
    x = normal(2, 3, 8)
    np.testing.assert_allclose(layer(x), plain(x), rtol=1e-6, atol=1e-6)
    assert "custom_vjp_call" in str(jax.make_jaxpr(lambda x: layer(x))(x))
    # Another contraction (a batched one) goes to lax.dot_general unchanged.
    a, b = normal(2, 3, 4), normal(2, 4, 5)
    dims = (((2,), (1,)), ((0,), (0,)))
    np.testing.assert_array_equal(linear_dot_general(a, b, dims), jax.lax.dot_general(a, b, dims))


def test_the_tied_backward_never_transposes_the_logits_gradient():
    """What it is for: left to XLA:CPU, the embedding's gradient under the training loss
    materialises the (N, V) logits gradient as a transposed (V, N) copy; with tied_logits no
    (V, N) array exists."""
    B, T, D, V = 32, 32, 256, 8000  # the small preset's shapes (at tiny sizes XLA keeps a plain dot)
    h, e = jax.ShapeDtypeStruct((B, T, D), jnp.float32), jax.ShapeDtypeStruct((V, D), jnp.float32)
    targets = jax.ShapeDtypeStruct((B, T), jnp.int32)

    def hlo(project):  # compiled only, never run
        loss = lambda h, e, y: label_smoothed_cross_entropy(project(h, e), y, 0, 0.1)  # noqa: E731
        return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(h, e, targets).compile().as_text()

    transposed = re.compile(rf"f32\[{V},{B * T}\]")
    assert transposed.search(hlo(lambda h, e: h @ e.T))  # the copy avoided (should XLA stop making it, revisit)
    assert not transposed.search(hlo(tied_logits))


def flax_layer_norm(x, scale, bias):
    norm = nnx.LayerNorm(x.shape[-1], epsilon=1e-6, use_fast_variance=False, rngs=nnx.Rngs(0))
    norm.scale[...], norm.bias[...] = scale, bias
    return norm(x)


def test_layer_norm_is_flax_layer_norm_forward_and_backward():
    x, scale, bias = normal(4, 6, 32, scale=3.0, shift=1.0), normal(32), normal(32)
    (y, *ours), (y_flax, *theirs) = vjp_both(lambda x, s, b: layer_norm(x, s, b, 1e-6), flax_layer_norm, x, scale, bias)
    np.testing.assert_array_equal(y, y_flax)  # the same operations in the same order
    for a, b in zip(ours, theirs):
        # 2e-6 of the largest entry: the backward's means summed in another order (measured 2.4e-7).
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-6 * float(jnp.abs(b).max()))


def test_the_model_layer_norm_has_flax_parameters_and_falls_back_where_not_float32():
    norm = LayerNorm(8, epsilon=1e-6, use_fast_variance=False, rngs=nnx.Rngs(0))
    assert set(nnx.to_pure_dict(nnx.state(norm, nnx.Param))) == {"scale", "bias"}
    x = normal(2, 3, 8)
    assert "custom_vjp_call" not in str(jax.make_jaxpr(lambda x: norm(x))(x))  # the reference kernel set
    jax_transformer.set_kernels(norm, "xla_cpu")
    assert "custom_vjp_call" in str(jax.make_jaxpr(lambda x: norm(x))(x))
    assert "custom_vjp_call" not in str(jax.make_jaxpr(lambda x: norm(x))(x.astype(jnp.bfloat16)))


def test_relu_linear_is_relu_then_matmul_forward_and_backward():
    h, w = normal(4, 6, 16), normal(16, 8)
    h = h.at[0, 0, :4].set(0.0)  # relu's kink: both give the gradient 0 there
    ours, reference = vjp_both(relu_linear, lambda h, w: jax.nn.relu(h) @ w, h, w)
    for a, b in zip(ours, reference):
        # 1e-6: float32 matmuls with another summation order, at O(1)-O(10) magnitudes.
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert not np.asarray(ours[1][0, 0, :4]).any()


def test_smoothed_sums_are_the_two_losses_forward_and_backward():
    """The tuned loss and NLL sums against two calls of the plain objective, with padding and a
    bfloat16 input: values and gradients (any cotangents) to float32 rounding."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(0, 3, (3, 7, 50)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 50, (3, 7)), jnp.int32).at[1, 4:].set(0)

    def plain(x):
        return tuple(label_smoothed_cross_entropy(x, targets, 0, e, "sum") for e in (0.1, 0.0))

    def tuned(x):
        return xla_cpu.smoothed_sums(x, targets, 0, 0.1)

    # 1e-6: the same sums, lse - x where log_softmax rounds x - lse (measured: equal).
    np.testing.assert_allclose(tuned(logits), plain(logits), rtol=1e-6)
    for weights in ((1.0, 0.0), (0.0, 1.0), (0.3, -2.0)):
        grads = [jax.grad(lambda x, f=f: sum(w * s for w, s in zip(weights, f(x))))(logits) for f in (plain, tuned)]
        # Entries are weighted softmax - target, |x| <= 2.3 here: 2e-6 absolute, about 8 ulps of 2.3
        # (measured: 6.0e-7 at most, softmax rounded as exp(x - lse) against log_softmax's exp).
        np.testing.assert_allclose(grads[1], grads[0], atol=2e-6, err_msg=str(weights))
        assert not np.asarray(grads[1][1, 4:]).any()  # padding: no gradient
    half = jax.grad(lambda x: tuned(x)[0])(logits.astype(jnp.bfloat16))
    assert half.dtype == jnp.bfloat16


def test_the_tuned_loss_keeps_one_logits_array_less():
    """Two autodiff log_softmax keep their log-probabilities; the written-out gradient keeps none."""
    logits = jnp.zeros((16, 32, 2000), jnp.float32)
    targets = jnp.ones((16, 32), jnp.int32)

    def temporaries(loss):
        return jax.jit(jax.grad(lambda x: sum(loss(x)))).lower(logits).compile().memory_analysis().temp_size_in_bytes

    plain = temporaries(lambda x: tuple(label_smoothed_cross_entropy(x, targets, 0, e, "sum") for e in (0.1, 0.0)))
    tuned = temporaries(lambda x: xla_cpu.smoothed_sums(x, targets, 0, 0.1))
    # At least one (B, T, V) float32 array (measured: 8.2 MB against 4 KB, two arrays less).
    assert plain - tuned >= logits.size * 4, (plain, tuned)


@pytest.mark.parametrize("vocab, hyps, n, chunk", [  # 5-7 s each
    (53, 4, 8, 128), (7, 16, 32, 128), (1000, 4, 8, 128), (300, 1, 1, 128), (300, 1, 1, 7), (1001, 3, 6, 16)])
def test_best_candidates_equal_top_k_over_every_extension(vocab, hyps, n, chunk):
    # Integer logits: many exact ties, which must resolve to the lower index as in lax.top_k;
    # vocabularies that chunks do not divide; dead hypotheses (NEG_INF); sentences at their limit.
    cfg = TransformerConfig(src_vocab_size=vocab, tgt_vocab_size=vocab)
    rng = np.random.default_rng(vocab + n)
    logits = jnp.asarray(rng.integers(-3, 4, size=(6, hyps, vocab)), jnp.float32)
    base = rng.integers(-3, 1, size=(6, hyps)).astype(np.float32)
    base[:3, 1:] = decode.NEG_INF
    must_end = jnp.asarray([False, True, False, False, True, False])
    expected = decode.top_candidates(cfg, logits, jnp.asarray(base), must_end, n)
    values, index = xla_cpu.best_candidates(cfg, logits, jnp.asarray(base), must_end, n, decode.NEG_INF, chunk)
    np.testing.assert_array_equal(np.asarray(index), np.asarray(expected[1]))
    np.testing.assert_array_equal(np.asarray(values), np.asarray(expected[0]))


def test_shared_keys_equal_the_keys_repeated_for_each_row():
    """Keys and values of B / g rows serving g consecutive query rows each (the XLA:CPU search's
    cross-attention over a sentence's encoder output, once for its hypotheses) give what the same
    keys repeated g times give: to 1e-6 (values of order 1, 24 wide: float32 rounding of a matmul
    over g * T rows against one over T)."""
    cfg = TransformerConfig(src_vocab_size=53, tgt_vocab_size=53, d_model=24, num_heads=3, d_ff=40, dropout=0.0)
    attn = jax_transformer.Transformer(cfg, kernels="xla_cpu", rngs=nnx.Rngs(0)).decoder.layers[0].cross_attn
    rng = np.random.default_rng(4)
    b, g, T, S = 3, 4, 2, 5
    x = jnp.asarray(rng.normal(size=(b * g, T, 24)), jnp.float32)
    memory = jnp.asarray(rng.normal(size=(b, S, 24)), jnp.float32)
    mask = jnp.asarray(rng.random((b, 1, 1, S)) < 0.8).at[:, :, :, 0].set(True)  # some keys masked
    want = attn(x, jnp.repeat(memory, g, axis=0), jnp.repeat(mask, g, axis=0))
    for kwargs in (dict(context=memory), dict(context=None, kv=attn.project_kv(memory))):
        got = attn(x, mask=mask, **kwargs)
        assert got.shape == want.shape == (b * g, T, 24)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=0)


TINY = TransformerConfig.preset("tiny", src_vocab_size=50, tgt_vocab_size=50, max_len=64, dropout=0.0)


def both_paths(cfg):
    """{False: the plain model, True: the XLA:CPU-tuned one}, from one seed: the same weights."""
    models = {tuned: jax_transformer.Transformer(cfg, kernels="xla_cpu" if tuned else "reference", rngs=nnx.Rngs(0)) for tuned in (False, True)}
    plain, tuned = (jax.tree.leaves(nnx.state(models[t])) for t in (False, True))
    assert len(plain) == len(tuned) and all(np.array_equal(a, b) for a, b in zip(plain, tuned))
    return models


def step_temporaries(model, batch: int, length: int) -> int:
    """Bytes of temporaries in the compiled SGD step (state donated) of the model."""
    graphdef, params = nnx.split(model, nnx.Param)
    src = jnp.full((batch, length), 5, jnp.int32)
    tgt = jnp.full((batch, length), 6, jnp.int32)

    def step(p):
        loss = lambda p: label_smoothed_cross_entropy(nnx.merge(graphdef, p)(src, tgt), tgt, 0, 0.1)  # noqa: E731
        return jax.tree.map(lambda a, g: a - 0.1 * g, p, jax.grad(loss)(p))

    return jax.jit(step, donate_argnums=0).lower(params).compile().memory_analysis().temp_size_in_bytes


def test_the_tuned_train_step_keeps_one_array_less_per_layer_norm_and_feed_forward():
    """And no (V, N) copy of the logits' gradient: the three savings add up."""
    cfg = TransformerConfig.preset("tiny", src_vocab_size=500, tgt_vocab_size=500, max_len=64, dropout=0.0)
    batch, length = 16, 32
    models = both_paths(cfg)
    plain, tuned = (step_temporaries(models[t], batch, length) for t in (False, True))
    layers = cfg.num_encoder_layers + cfg.num_decoder_layers
    norms = 2 * cfg.num_encoder_layers + 3 * cfg.num_decoder_layers
    one_array_each = 4 * batch * length * (layers * cfg.d_ff + norms * cfg.d_model)
    logits_copy = 4 * batch * length * cfg.tgt_vocab_size
    # Measured: 3.24 MiB less, one_array_each 2.25 MiB + logits_copy 0.98 MiB; 10% margin for how
    # XLA packs the rest, less than any one of the three savings (the smallest, the copy, 0.98 MiB).
    assert plain - tuned >= 0.9 * (one_array_each + logits_copy), (plain, tuned, one_array_each, logits_copy)


def sources(sentences: int, length: int, vocab: int, seed: int) -> np.ndarray:
    """Random sources of random lengths ending in EOS, right-padded; two rows of padding only."""
    rng = np.random.default_rng(seed)
    out = np.zeros((sentences, length), np.int32)
    for row, n in enumerate(rng.integers(1, length + 1, sentences)):
        out[row, : n - 1], out[row, n - 1] = rng.integers(4, vocab, n - 1), 2
    out[[3, 8]] = 0
    return out


@pytest.mark.parametrize("overrides, searches", [  # ~35 s each on 2 cores
    ({}, [("greedy_search", {}), ("beam_search", {"beam_size": 3})]),
    ({"norm_position": "pre", "share_embeddings": False, "tie_output": False},
     [("beam_search", {"beam_size": 3, "cached": False})])])
def test_both_paths_give_the_same_losses_gradients_and_searches_on_the_cpu(overrides, searches):
    """The model built with `kernels="xla_cpu"` against the plain one, both run here on the CPU: the same
    loss and gradients to float32 rounding, and searches (greedy, beam 3, cached and not) with
    identical tokens. 40 sentences and 47 positions: the tuned loops shrink the batch to 20
    sentences and grow the self-attention cache (11, 23, 47 positions)."""
    models = both_paths(TINY.replace(**overrides))
    src = sources(40, 25, 50, seed=1)
    tgt = sources(40, 9, 50, seed=2)
    tgt_in = jax_transformer.shift_right(tgt, TINY.bos_id)

    def loss(model):
        return label_smoothed_cross_entropy(model(src, tgt_in), tgt, TINY.pad_id, 0.1)

    loss_and_grads = nnx.jit(nnx.value_and_grad(loss))  # compiled: eagerly, op by op, took 2.4 x as long
    (plain_loss, plain_grads), (tuned_loss, tuned_grads) = (loss_and_grads(models[t]) for t in (False, True))
    assert "custom_vjp_call" in str(jax.make_jaxpr(loss)(models[True]))  # the tuned kernels did run
    assert "custom_vjp_call" not in str(jax.make_jaxpr(loss)(models[False]))
    # 1e-6: the same float32 matmuls with another operand order in the backward pass (measured: equal).
    np.testing.assert_allclose(tuned_loss, plain_loss, rtol=1e-6)
    for (key, a), (_, b) in zip(nnx.to_flat_state(plain_grads), nnx.to_flat_state(tuned_grads)):
        # The same, summed in another order: 1e-5 relative, 1e-6 absolute for entries near 0
        # (measured: 4.5e-8 at most, 3% of this bound).
        np.testing.assert_allclose(b[...], a[...], rtol=1e-5, atol=1e-6, err_msg=str(key))

    for search, kwargs in searches:
        (plain_tokens, plain_scores), (tuned_tokens, tuned_scores) = (
            tuple(np.asarray(x) for x in getattr(decode, search)(models[t], src, **kwargs)) for t in (False, True))
        np.testing.assert_array_equal(tuned_tokens, plain_tokens, err_msg=f"{search} {kwargs}")
        # A score sums one log-probability a token, which best_candidates rounds as (x - max) - lse
        # and log_softmax as x - (max + log(sum)): n tokens, n ulps of |score| (measured: 3 ulps at most).
        emitted = (plain_tokens != 0).sum(axis=1)
        bound = np.maximum(1e-5, emitted * np.spacing(np.abs(plain_scores).astype(np.float32)))
        assert (np.abs(tuned_scores - plain_scores) <= bound).all(), (search, kwargs)
    assert len(set(emitted.tolist())) >= 10  # sentences ended at many steps: the batch did shrink
    # One loop in the plain search; the tuned one: an 11- and a 23-position cache, then 40, 20 and 10 sentences.
    loops = [decode._greedy_search.lower(models[t], jnp.asarray(src), 1.5, 10, True).as_text().count("stablehlo.while")
             for t in (False, True)]
    assert loops == [1, 5]
