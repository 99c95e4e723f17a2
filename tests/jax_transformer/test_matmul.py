"""jax_transformer.matmul: the same values and gradients as jnp.matmul, and the backward pass it
exists for (no transposed copy of the logits' gradient)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_transformer.matmul import linear, linear_dot_general, tied_logits
from jax_transformer.objective import label_smoothed_cross_entropy

RNG = np.random.default_rng(0)


def normal(*shape, dtype=jnp.float32):
    return jnp.asarray(RNG.standard_normal(shape), dtype)


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
    """What the module is for: left to XLA:CPU, the embedding's gradient under the training loss
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


@pytest.mark.slow  # ~35 s: compiles the model, its gradient and the searches once more
def test_other_platforms_take_the_plain_paths_with_the_same_results(monkeypatch):
    """Off XLA:CPU (`cpu_tuned()` False) the model uses lax.dot_general and jnp.matmul and the
    search top_k over every extension in one loop: the same logits, gradients and translations."""
    import jax_transformer
    from jax_transformer import decode, matmul
    from torch_reference.config import TransformerConfig

    cfg = TransformerConfig.preset("tiny", src_vocab_size=50, tgt_vocab_size=50, max_len=32, dropout=0.0)
    model = jax_transformer.Transformer(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    src = np.asarray(rng.integers(4, 50, (20, 9)), np.int32)  # 20 sentences: two stages on the CPU path
    src[3, 5:] = cfg.pad_id
    tgt = np.asarray(rng.integers(4, 50, (20, 7)), np.int32)

    def loss(m):
        return label_smoothed_cross_entropy(m(src, tgt), tgt, cfg.pad_id, 0.1)

    def run():
        value, grads = nnx.value_and_grad(loss)(model)
        searches = [decode.greedy_search(model, src), decode.beam_search(model, src, 3)]
        return value, nnx.to_flat_state(grads), [np.asarray(t) for t, _ in searches]

    tuned = run()
    monkeypatch.setattr(matmul, "cpu_tuned", lambda: False)
    monkeypatch.setattr(decode, "cpu_tuned", lambda: False)
    assert decode._smallest_stage() > 20
    plain = run()
    # 1e-6: the same float32 matmuls with another operand order in the backward pass.
    np.testing.assert_allclose(plain[0], tuned[0], rtol=1e-6)
    for (key, a), (_, b) in zip(tuned[1], plain[1]):
        np.testing.assert_allclose(b[...], a[...], rtol=1e-5, atol=1e-6, err_msg=str(key))
    for a, b in zip(tuned[2], plain[2]):
        np.testing.assert_array_equal(a, b)
