"""The Flax mirror against the PyTorch specification: pure functions, each layer, the full model.

Tolerances: float32 with `jax_default_matmul_precision="highest"`. Different summation orders in
the two libraries' matmuls and reductions give differences of a few float32 ulps per operation;
1e-6 absolute is ~10 ulps at the O(1) magnitudes of these activations, 1e-5 for whole models
(the bound of the parity contract).
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import jax_transformer as jt
import torch_reference as tr
from jax_transformer import objective as jobj
from parity.comparison import enable_parity_numerics
from torch_reference import objective as tobj
from train.interop.weights import torch_to_jax

enable_parity_numerics()

LOPSIDED = dict(
    src_vocab_size=53, tgt_vocab_size=53, d_model=24, num_heads=3, d_ff=40,
    num_encoder_layers=2, num_decoder_layers=1, dropout=0.0, max_len=64, layer_norm_eps=1e-6,
)
VARIANTS = [
    {},
    {"norm_position": "pre"},
    {"activation": "gelu"},
    {"activation": "swiglu"},
    {"norm": "rmsnorm"},
    {"positions": "learned"},
    {"share_embeddings": False, "tie_output": False, "tgt_vocab_size": 61},
    {"share_embeddings": False, "tgt_vocab_size": 61},
    {"tie_output": False},
    {"attention_bias": False, "scale_embeddings": False},
    # Marian's (HF MarianMTModel): swish, sines-then-cosines positions, a bias on the logits, torch's
    # eps, the decoder started by the pad id.
    {"activation": "silu", "positions": "sinusoidal_halves", "output_bias": True, "layer_norm_eps": 1e-5, "bos_id": 0},
]


def variant_id(v):
    return ",".join(f"{k}={val}" for k, val in v.items() if k != "tgt_vocab_size") or "paper"


def make_pair(seed=0, **overrides):
    cfg = tr.TransformerConfig(**{**LOPSIDED, **overrides})
    torch.manual_seed(seed)
    torch_model = tr.Transformer(cfg).eval()
    if torch_model.logits_bias is not None:  # zeros at init: made visible
        with torch.no_grad():
            torch_model.logits_bias.normal_()
    return cfg, torch_model, torch_to_jax(torch_model)


def ids(cfg, batch, length, seed, vocab=None):
    """Random ids in [4, V) with right padding: row 0 full length, others random lengths >= 1."""
    rng = np.random.default_rng(seed)
    out = rng.integers(4, vocab or cfg.src_vocab_size, size=(batch, length))
    lengths = rng.integers(1, length + 1, size=batch)
    lengths[0] = length
    out[np.arange(length)[None] >= lengths[:, None]] = cfg.pad_id
    return out


def t2j(x):
    return jnp.asarray(x.detach().numpy() if isinstance(x, torch.Tensor) else x)


# ------------------------------------------------------------------ pure functions


@pytest.mark.parametrize("halves", [False, True])
@pytest.mark.parametrize("length,d_model", [(50, 24), (7, 9), (512, 512)])
def test_sinusoidal_positions_bit_identical(length, d_model, halves):
    np.testing.assert_array_equal(
        np.asarray(jt.sinusoidal_positions(length, d_model, halves)),
        tr.sinusoidal_positions(length, d_model, halves).numpy(),
    )


def test_sinusoid_halves_hold_the_interleaved_columns_reordered():
    for d_model in (24, 9):
        interleaved, halves = tr.sinusoidal_positions(20, d_model), tr.sinusoidal_positions(20, d_model, halves=True)
        order = list(range(0, d_model, 2)) + list(range(1, d_model, 2))  # sines, then cosines
        assert torch.equal(halves, interleaved[:, order])


def test_masks_and_shift_right_identical():
    x = ids(tr.TransformerConfig(**LOPSIDED), 4, 9, seed=1)
    np.testing.assert_array_equal(np.asarray(jt.padding_mask(jnp.asarray(x), 0)), tr.padding_mask(torch.from_numpy(x), 0).numpy())
    np.testing.assert_array_equal(np.asarray(jt.causal_mask(9)), tr.causal_mask(9).numpy())
    np.testing.assert_array_equal(np.asarray(jt.shift_right(jnp.asarray(x), 1)), tr.shift_right(torch.from_numpy(x), 1).numpy())
    x[1, 0] = 0  # a pad id at the start: attended when it is the start token (Marian), masked otherwise
    old = (tr.causal_mask(9) & tr.padding_mask(torch.from_numpy(x), 0)).numpy()
    for bos_id in (0, 1):
        mask = tr.target_mask(torch.from_numpy(x), 0, bos_id)
        np.testing.assert_array_equal(np.asarray(jt.target_mask(jnp.asarray(x), 0, bos_id)), mask.numpy())
        np.testing.assert_array_equal(mask[:, :, :, 1:].numpy(), old[:, :, :, 1:])
        np.testing.assert_array_equal(mask[:, 0, :, 0].numpy(), np.ones((4, 9), bool) if bos_id == 0 else old[:, 0, :, 0])
    assert jt.causal_mask(9).shape == (1, 1, 9, 9) and jt.padding_mask(jnp.asarray(x), 0).shape == (4, 1, 1, 9)


def test_attention_matches_including_fully_masked_rows():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, s, 8, generator=g) for s in (5, 7, 7))
    mask = torch.rand(2, 1, 5, 7, generator=g) > 0.4
    mask[1, 0, 2] = False  # one query row sees nothing
    out_t = tr.scaled_dot_product_attention(q, k, v, mask)
    out_j = jt.scaled_dot_product_attention(t2j(q), t2j(k), t2j(v), t2j(mask))
    np.testing.assert_allclose(np.asarray(out_j), out_t.numpy(), atol=1e-6)  # float32 ulps, see module doc
    # The fully masked row is the uniform average of the values on both sides, never NaN.
    np.testing.assert_allclose(out_t[1, :, 2].numpy(), v[1].mean(dim=1).numpy(), atol=1e-6)
    assert np.isfinite(np.asarray(out_j)).all()


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.3])
def test_smoothed_loss_equals_torch_cross_entropy(smoothing):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, 41, generator=g) * 3
    targets = torch.randint(1, 41, (3, 6), generator=g)
    targets[1, 3:] = 0
    reference = torch.nn.CrossEntropyLoss(label_smoothing=smoothing, ignore_index=0)(logits.view(-1, 41), targets.view(-1))
    torch_side = tobj.label_smoothed_cross_entropy(logits, targets, pad_id=0, smoothing=smoothing)
    jax_side = jobj.label_smoothed_cross_entropy(t2j(logits), t2j(targets), pad_id=0, smoothing=smoothing)
    assert torch_side.item() == reference.item()  # the torch side is that very call
    assert abs(float(jax_side) - reference.item()) <= 1e-6 * reference.item()  # loss rel bound of the contract
    summed = jobj.label_smoothed_cross_entropy(t2j(logits), t2j(targets), 0, smoothing, reduction="sum")
    assert abs(float(summed) / int((targets != 0).sum()) - float(jax_side)) <= 1e-6 * float(jax_side)


def test_noam_schedule_identical_and_shaped_like_the_paper():
    steps = [0, 1, 2, 100, 3999, 4000, 4001, 10_000, 100_000]
    for s in steps:
        torch_lr = tobj.noam_learning_rate(s, 512, 4000)
        jax_lr = float(jobj.noam_learning_rate(s, 512, 4000))
        assert abs(jax_lr - torch_lr) <= 1e-6 * torch_lr  # float32 (jax) vs float64 (python) rounding
    peak = tobj.noam_learning_rate(4000, 512, 4000)
    assert peak == pytest.approx(512**-0.5 * 4000**-0.5, rel=1e-12)
    assert tobj.noam_learning_rate(2000, 512, 4000) == pytest.approx(peak / 2, rel=1e-12)  # linear warmup
    assert tobj.noam_learning_rate(16000, 512, 4000) == pytest.approx(peak / 2, rel=1e-12)  # inverse sqrt decay


# ------------------------------------------------------------------ layers


@pytest.mark.parametrize("variant", VARIANTS[:6], ids=variant_id)
def test_each_layer_matches(variant):
    cfg, tm, jm = make_pair(**variant)
    g = torch.Generator().manual_seed(1)
    x, mem = torch.randn(3, 6, cfg.d_model, generator=g), torch.randn(3, 9, cfg.d_model, generator=g)
    src_mask = tr.padding_mask(torch.from_numpy(ids(cfg, 3, 9, seed=2)), 0)
    tgt_mask = tr.causal_mask(6)
    pairs = [
        (tm.encoder.layers[0].self_attn(x, mem, src_mask), jm.encoder.layers[0].self_attn(t2j(x), t2j(mem), t2j(src_mask))),
        (tm.encoder.layers[1].ff(x), jm.encoder.layers[1].ff(t2j(x))),
        (tm.encoder.layers[1](mem, src_mask), jm.encoder.layers[1](t2j(mem), t2j(src_mask))),
        (tm.decoder.layers[0](x, mem, src_mask, tgt_mask), jm.decoder.layers[0](t2j(x), t2j(mem), t2j(src_mask), t2j(tgt_mask))),
        (tm.encoder.positions(x), jm.encoder.positions(t2j(x))),
        (tm.decoder.positions(x, offset=5), jm.decoder.positions(t2j(x), offset=5)),
    ]
    for i, (a, b) in enumerate(pairs):
        assert a.shape == b.shape, i
        np.testing.assert_allclose(np.asarray(b), a.detach().numpy(), atol=1e-6, err_msg=f"pair {i}")  # see module doc


# ------------------------------------------------------------------ full model


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_full_model_logits_encode_decode(variant):
    cfg, tm, jm = make_pair(**variant)
    src, tgt = ids(cfg, 4, 11, seed=3), ids(cfg, 4, 7, seed=4, vocab=cfg.tgt_vocab_size)
    tgt[:, 0] = cfg.bos_id  # decoder inputs start with the start token, which may be the pad id
    logits_t = tm(torch.from_numpy(src), torch.from_numpy(tgt)).detach().numpy()
    logits_j = np.asarray(jm(jnp.asarray(src), jnp.asarray(tgt), deterministic=True))
    assert logits_j.shape == (4, 7, cfg.tgt_vocab_size)
    np.testing.assert_allclose(logits_j, logits_t, atol=1e-5)  # tiny-model bound of the contract
    memory_t = tm.encode(torch.from_numpy(src)).detach().numpy()
    memory_j = np.asarray(jm.encode(jnp.asarray(src)))
    np.testing.assert_allclose(memory_j, memory_t, atol=1e-5)



@pytest.mark.parametrize("given", ["src_segments", "tgt_segments"])
def test_segments_of_one_side_only_are_refused_in_both_twins(given):
    # src_segments alone failed deep inside ('NoneType' object is not subscriptable); tgt_segments alone was
    # ignored, silently: every attention crossed the packed pairs.
    cfg, tm, jm = make_pair()
    src, tgt = ids(cfg, 2, 5, seed=0), ids(cfg, 2, 4, seed=1)
    segments = {"src_segments": np.ones_like(src), "tgt_segments": np.ones_like(tgt)}[given]
    with pytest.raises(ValueError, match="both src_segments and tgt_segments"):
        tm(torch.from_numpy(src), torch.from_numpy(tgt), **{given: torch.from_numpy(segments)})
    with pytest.raises(ValueError, match="both src_segments and tgt_segments"):
        jm(jnp.asarray(src), jnp.asarray(tgt), **{given: jnp.asarray(segments)})

def test_fully_padded_source_is_finite_in_jax():
    cfg, tm, jm = make_pair()
    src = np.zeros((2, 5), dtype=np.int64)
    src[1, :3] = [7, 8, 9]
    logits = np.asarray(jm(jnp.asarray(src), jnp.asarray(ids(cfg, 2, 4, seed=0))))
    assert np.isfinite(logits).all()


def test_dropout_is_explicit_and_seeded():
    cfg, _, jm = make_pair(dropout=0.3)
    src, tgt = jnp.asarray(ids(cfg, 2, 6, seed=0)), jnp.asarray(ids(cfg, 2, 5, seed=1))
    a = jm(src, tgt, deterministic=False, rngs=nnx.Rngs(dropout=0))
    b = jm(src, tgt, deterministic=False, rngs=nnx.Rngs(dropout=0))
    c = jm(src, tgt, deterministic=False, rngs=nnx.Rngs(dropout=1))
    d = jm(src, tgt, deterministic=True)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # same key, same masks
    assert float(jnp.abs(a - c).max()) > 1e-3 and float(jnp.abs(a - d).max()) > 1e-3


def test_activation_dropout_is_explicit_and_seeded():
    cfg, torch_model, jm = make_pair(activation_dropout=0.3)
    src, tgt = jnp.asarray(ids(cfg, 2, 6, seed=0)), jnp.asarray(ids(cfg, 2, 5, seed=1))
    a = jm(src, tgt, deterministic=False, rngs=nnx.Rngs(dropout=0))
    b = jm(src, tgt, deterministic=False, rngs=nnx.Rngs(dropout=0))
    d = jm(src, tgt, deterministic=True)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(jnp.abs(a - d).max()) > 1e-3  # the only dropout of this model is active
    expected = torch_model(torch.from_numpy(np.array(src)), torch.from_numpy(np.array(tgt)))  # eval mode
    np.testing.assert_allclose(np.asarray(d), expected.detach().numpy(), atol=1e-5, rtol=0)  # model tolerance


@pytest.mark.parametrize("kernels", jt.model.KERNELS)
def test_activation_dropout_drops_the_activations_before_linear2(kernels):
    """With linear2 the identity plus 0.5, each output entry is 0.5 or relu(linear1(x)) / (1 - p) + 0.5
    in both twins (dropout after linear2 would give 0 or (relu + 0.5) / (1 - p)); about a fraction p
    of the positive activations dropped."""
    p, width = 0.25, 64
    cfg = tr.TransformerConfig(**{**LOPSIDED, "d_model": width, "d_ff": width, "num_heads": 4, "activation_dropout": p})
    torch.manual_seed(0)
    tff = tr.model.FeedForward(cfg).train()
    with torch.no_grad():
        tff.linear2.weight.copy_(torch.eye(width))
        tff.linear2.bias.fill_(0.5)
    jff = jt.model.FeedForward(cfg, rngs=nnx.Rngs(0))
    jt.model.set_kernels(jff, kernels)
    jff.linear1.kernel[...] = t2j(tff.linear1.weight.T)
    jff.linear1.bias[...] = t2j(tff.linear1.bias)
    jff.linear2.kernel[...] = jnp.eye(width)
    jff.linear2.bias[...] = jnp.full(width, 0.5)
    x = torch.randn(4, 16, width)
    active = torch.relu(tff.linear1(x)).detach().numpy()
    outputs = {
        "torch": tff(x).detach().numpy() - 0.5,
        "jax": np.asarray(jff(t2j(x), deterministic=False, rngs=nnx.Rngs(dropout=0))) - 0.5,
    }
    positive = active > 0
    for name, out in outputs.items():
        kept = out != 0
        assert not (kept & ~positive).any(), name
        # 1e-6: one rounding of the scale 1 / (1 - p) plus the matmul's at these O(1) values
        np.testing.assert_allclose(out[kept], active[kept] / (1 - p), rtol=1e-6, atol=1e-6, err_msg=name)
        dropped = 1 - kept[positive].mean()  # ~2,000 positive entries: one standard deviation ~0.01
        assert abs(dropped - p) < 0.05, (name, dropped)
    np.testing.assert_allclose(np.asarray(jff(t2j(x))) - 0.5, active, rtol=1e-6, atol=1e-6)  # deterministic: nothing dropped


def test_jit_compiles_once_per_shape():
    cfg, _, jm = make_pair()
    traces = []

    @nnx.jit
    def forward(model, src, tgt):
        traces.append(1)
        return model(src, tgt)

    for seed in range(3):
        forward(jm, jnp.asarray(ids(cfg, 2, 6, seed)), jnp.asarray(ids(cfg, 2, 5, seed + 9)))
    assert len(traces) == 1
