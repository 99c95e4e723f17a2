"""Kernel sets by name and rematerialisation, in both twins, on the CPU: both registries hold the
config's names in its order; every set's attention (`fused`: jax.nn.dot_product_attention,
F.scaled_dot_product_attention) against the `reference` path, alone and every set in the model,
outputs and gradients, with padding and causal masks and a fully masked row (which only a row of
padding holds: torch's fused kernel gives zeros there, the others the average); attention weights
asked of any set come from the reference path; `remat` gives the same loss and gradients as without,
dropout on. A new kernel set is proven here by its row in KERNELS.

Tolerances: 1e-6 on attention outputs and gradients of order 1 (a K = 8 wide softmax average,
float32: the two paths sum the same products in another order; measured <= 4e-7); 1e-5 on logits
and parameter gradients of the lopsided model, the parity contract's float32 bound for tiny models.
Remat recomputes the same operations: the same values to 1e-6 (XLA may fuse the recomputed forward
pass differently; measured equal).
"""

from typing import get_args

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import jax_transformer as jt
import torch_reference as tr
from parity.comparison import enable_parity_numerics
from torch_reference import objective as torch_objective
from torch_reference.config import KernelSet

from .test_decode import LOPSIDED as CONFIG

enable_parity_numerics()

B, H, T, S, K = 3, 3, 5, 7, 8


def masks():
    """{name: mask (B, 1, T|1, S) bool}: keys padded (row 2 has none left: a fully masked row), and
    causal with padding (T = S positions)."""
    keys = np.arange(S)[None, :] < np.array([S, 4, 0])[:, None]  # (B, S)
    causal = np.tril(np.ones((S, S), bool))[None, None] & (np.arange(S) < np.array([S, 3, 5])[:, None])[:, None, None]
    return {"padding": keys[:, None, None, :], "causal": causal}


def test_both_twins_register_the_config_s_kernel_sets_in_its_order():
    assert tuple(jt.KERNELS) == tuple(tr.KERNELS) == get_args(KernelSet)
    assert [name for name, row in tr.KERNELS.items() if row is None] == ["xla_cpu"]  # the JAX twin's only
    assert None not in jt.KERNELS.values()


@pytest.mark.parametrize("name", ["padding", "causal", "none"])
def test_fused_attention_equals_the_reference_outputs_and_gradients(name):
    rng = np.random.default_rng(0)
    mask = masks().get(name)
    q = rng.normal(size=(B, H, S if name == "causal" else T, K)).astype(np.float32)
    k, v = (rng.normal(size=(B, H, S, K)).astype(np.float32) for _ in range(2))
    g = rng.normal(size=q.shape).astype(np.float32)  # the output's cotangent
    results = {}
    for framework, twin in (("jax", jt), ("torch", tr)):
        for kernel, f in ((kernel, row.attention) for kernel, row in twin.KERNELS.items() if row):
            if framework == "jax":
                m = None if mask is None else jnp.asarray(mask)
                out, vjp = jax.vjp(lambda q, k, v: f(q, k, v, m), *map(jnp.asarray, (q, k, v)))
                results[framework, kernel] = [np.asarray(x) for x in (out, *vjp(jnp.asarray(g)))]
            else:
                qkv = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
                out = f(*qkv, None if mask is None else torch.from_numpy(mask))
                out.backward(torch.from_numpy(g))
                results[framework, kernel] = [out.detach().numpy(), *(x.grad.numpy() for x in qkv)]
    real = slice(None) if name == "none" else slice(0, 2)  # row 2 of the padding mask is fully masked
    for (framework, kernel), arrays in results.items():
        rows = real if framework == "torch" else slice(None)  # JAX: every row alike
        for got, want in zip(arrays, results[framework, "reference"]):
            np.testing.assert_allclose(got[rows], want[rows], atol=1e-6, rtol=0)
    if name == "padding":  # a fully masked row: the values' average in JAX (as both references), zeros in torch
        np.testing.assert_allclose(results["jax", "fused"][0][2], np.broadcast_to(v[2].mean(1, keepdims=True),
                                   (H, T, K)), atol=1e-6)
        for array in results["torch", "fused"]:
            assert not array[2].any()

def batch():
    rng = np.random.default_rng(1)
    src = rng.integers(4, 53, size=(B, 9))
    src[1, 5:] = 0  # padding
    tgt = rng.integers(4, 53, size=(B, 6))
    tgt[2, 3:] = 0
    return src, np.concatenate([np.ones((B, 1), np.int64), tgt[:, :-1]], 1), tgt


def jax_loss_and_grads(model, src, tgt_in, tgt_out, dropout=None):
    """(loss, logits, parameter gradients); `dropout`: the seed of the dropout masks, None for none."""
    def loss(params):
        mode = {} if dropout is None else dict(deterministic=False, rngs=nnx.Rngs(dropout=dropout))
        logits = nnx.merge(graphdef, params)(src, tgt_in, **mode)
        return model.kernels.loss_sums(logits, tgt_out, 0, 0.1)[0] / (tgt_out != 0).sum(), logits  # the set's loss

    graphdef, params = nnx.split(model)
    (value, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)  # jit: eager is slow
    return float(value), np.asarray(logits), [np.asarray(x) for x in jax.tree.leaves(grads)]


def torch_loss_and_grads(model, src, tgt_in, tgt_out):
    model.zero_grad()
    logits = model(*(torch.from_numpy(x) for x in (src, tgt_in)))
    value = torch_objective.label_smoothed_cross_entropy(logits, torch.from_numpy(tgt_out), 0, 0.1)
    value.backward()
    return float(value), logits.detach().numpy(), [p.grad.numpy().copy() for p in model.parameters()]


def assert_close(a, b, atol):
    assert a[0] == pytest.approx(b[0], abs=atol)
    np.testing.assert_allclose(a[1], b[1], atol=atol, rtol=0)
    assert len(a[2]) == len(b[2])
    for x, y in zip(a[2], b[2]):
        np.testing.assert_allclose(x, y, atol=atol, rtol=0)


# Every set but the reference, in each twin: one case a row of KERNELS.
SETS = [(twin, name) for twin, registry in (("jax", jt.KERNELS), ("torch", tr.KERNELS))
        for name, row in registry.items() if row and name != "reference"]


@pytest.mark.parametrize("twin, name", SETS)  # ~10 s a set
def test_every_kernel_set_gives_the_reference_logits_gradients_and_attention_weights(twin, name):
    cfg = jt.TransformerConfig(**CONFIG)
    src, tgt_in, tgt_out = batch()
    if twin == "jax":
        models = [jt.Transformer(cfg, kernels=k, rngs=nnx.Rngs(0)) for k in ("reference", name)]
        assert {m.kernels for _, m in nnx.iter_modules(models[1]) if hasattr(m, "kernels")} == {jt.KERNELS[name]}
        assert_close(*(jax_loss_and_grads(m, src, tgt_in, tgt_out) for m in models), 1e-5)
        weights = [np.asarray(nnx.jit(lambda m: m(src, tgt_in, return_attention=True)[1])(m)) for m in models]
    else:
        torch.manual_seed(0)
        models = [tr.Transformer(cfg, kernels=k) for k in ("reference", name)]
        models[1].load_state_dict(models[0].state_dict())
        assert {m.kernels for m in models[1].modules() if hasattr(m, "kernels")} == {tr.KERNELS[name]}
        assert_close(*(torch_loss_and_grads(m, src, tgt_in, tgt_out) for m in models), 1e-5)
        with torch.no_grad():
            src_t, tgt_t = torch.from_numpy(src), torch.from_numpy(tgt_in)
            weights = [m(src_t, tgt_t, return_attention=True)[1].numpy() for m in models]
    np.testing.assert_allclose(weights[1], weights[0], atol=1e-5, rtol=0)  # the layers below differ by rounding


def test_remat_gives_the_same_loss_and_gradients_with_dropout():
    cfg = jt.TransformerConfig(**{**CONFIG, "dropout": 0.3, "attention_dropout": 0.2})
    src, tgt_in, tgt_out = batch()
    results = []
    for remat in (False, True):
        model = jt.Transformer(cfg, remat=remat, rngs=nnx.Rngs(0))
        assert model.encoder.remat == model.decoder.remat == remat
        results.append(jax_loss_and_grads(model, src, tgt_in, tgt_out, dropout=3))
    assert_close(results[0], results[1], 1e-6)
    results = []
    for remat in (False, True):
        torch.manual_seed(0)
        model = tr.Transformer(cfg, remat=remat).train()
        torch.manual_seed(1)  # the same dropout masks
        results.append(torch_loss_and_grads(model, src, tgt_in, tgt_out))
    assert_close(results[0], results[1], 1e-6)


def test_an_unknown_kernel_set_is_refused_in_both_twins():
    cfg = jt.TransformerConfig(**CONFIG)
    with pytest.raises(ValueError, match="kernels='flash' is not one of reference, xla_cpu, fused"):
        jt.Transformer(cfg, kernels="flash", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="kernels='xla_cpu' is not one of reference, fused"):
        tr.Transformer(cfg, kernels="xla_cpu")
