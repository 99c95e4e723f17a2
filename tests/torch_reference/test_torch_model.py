"""Tests of the PyTorch reference model (`torch_reference/model.py`), the project's specification.

Smallest first: the pure functions, the initialisation, then the encoder and decoder stacks against
an outside implementation (`torch.nn.Transformer`), then properties every variant of the model must
have (causality, padding, shapes), then `torch.compile`.

Sizes are lopsided on purpose (d_model=24 with 3 heads, d_ff=40, 2 encoder and 3 decoder layers,
source length 7, target length 5, batch 3, different source and target vocabularies where the
config allows it) so that a swapped axis or a swapped stack cannot pass.

The basename is `test_torch_model.py`, not `test_model.py`: the test folders have no `__init__.py`,
so under pytest's default import mode two `test_model.py` (torch and jax) would clash. (That mode
also puts `tests/` on sys.path, where the folder `tests/torch_reference/` shadows the package as a
namespace package; the project runs pytest with `--import-mode=importlib`, see pyproject.toml.)
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torch_reference import TransformerConfig
from torch_reference.model import (
    Decoder,
    Encoder,
    Transformer,
    causal_mask,
    padding_mask,
    scaled_dot_product_attention,
    shift_right,
    sinusoidal_positions,
)

B, S, T = 3, 7, 5  # batch, source length, target length: all different
SRC_VOCAB, TGT_VOCAB = 37, 29  # different where share_embeddings=False allows it
PAD, BOS = 0, 1
FIRST_REAL_ID = 4  # ids 0-3 are pad, bos, eos, unk


@pytest.fixture(autouse=True, scope="module")
def one_cpu_thread():
    """Run this module's tiny tensors on one thread. Fanning a 3x7x24 matmul out to OpenMP workers
    costs more than it saves, and on a busy 2-core machine every parallel op can stall ~10 ms
    waiting for a descheduled worker (measured: 0.8 s instead of 2 ms per forward)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def small_config(**overrides) -> TransformerConfig:
    """The lopsided test size; vocabularies differ unless embeddings are shared."""
    fields = dict(
        src_vocab_size=SRC_VOCAB,
        tgt_vocab_size=TGT_VOCAB,
        d_model=24,
        num_heads=3,
        d_ff=40,
        num_encoder_layers=2,
        num_decoder_layers=3,
        max_len=16,
        share_embeddings=False,
    )
    fields.update(overrides)
    if fields["share_embeddings"]:
        fields["tgt_vocab_size"] = fields["src_vocab_size"]
    return TransformerConfig(**fields)


def lengths_to_real(lengths: list[int], length: int) -> torch.Tensor:
    """(B,) lengths -> (B, L) bool, True at real (non-pad) positions."""
    return torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]


def random_ids(lengths: list[int], length: int, vocab: int, bos: bool = False) -> torch.Tensor:
    """(B, L) ids in [FIRST_REAL_ID, vocab), PAD after each row's length, BOS first if asked."""
    ids = torch.randint(FIRST_REAL_ID, vocab, (len(lengths), length))
    if bos:
        ids[:, 0] = BOS
    return torch.where(lengths_to_real(lengths, length), ids, PAD)


# ------------------------------------------------------------------------------------------------
# Pure functions
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("length,d_model", [(1, 1), (4, 2), (6, 7), (5, 8), (50, 13), (64, 16)])
def test_sinusoidal_positions_match_the_paper_formula(length, d_model):
    # §3.5: PE[p, 2i] = sin(p / 10000^(2i/D)), PE[p, 2i+1] = cos(p / 10000^(2i/D)), written with
    # math.pow in a loop (the implementation uses exp/log on tensors). Odd D ends on a sin column.
    expected = torch.empty(length, d_model, dtype=torch.float64)
    for p in range(length):
        for j in range(d_model):
            angle = p / math.pow(10000.0, (j - j % 2) / d_model)
            expected[p, j] = math.sin(angle) if j % 2 == 0 else math.cos(angle)
    table = sinusoidal_positions(length, d_model)
    assert table.shape == (length, d_model) and table.dtype == torch.float32
    # Both sides are float64 rounded once to float32; exp(log) vs pow differ by ~1e-16, which can
    # flip one float32 rounding: one ulp is 6e-8 for values in [0.5, 1].
    torch.testing.assert_close(table, expected.float(), atol=6e-8, rtol=0)


def test_causal_mask_is_lower_triangular():
    mask = causal_mask(4)
    expected = torch.tensor([[q >= k for k in range(4)] for q in range(4)])  # query q sees keys k <= q
    assert mask.shape == (1, 1, 4, 4) and mask.dtype == torch.bool
    assert torch.equal(mask[0, 0], expected)


@pytest.mark.parametrize("pad_id", [0, 5])
def test_padding_mask_marks_real_tokens(pad_id):
    ids = torch.tensor([[7, 8, pad_id, pad_id], [pad_id, 9, 10, 11]])
    mask = padding_mask(ids, pad_id)
    assert mask.shape == (2, 1, 1, 4) and mask.dtype == torch.bool
    assert torch.equal(mask[:, 0, 0], torch.tensor([[True, True, False, False], [False, True, True, True]]))


def test_shift_right_prepends_bos_and_drops_last():
    ids = torch.tensor([[5, 6, 7, 2], [8, 2, 0, 0]])
    shifted = shift_right(ids, bos_id=1)
    assert shifted.dtype == ids.dtype
    assert torch.equal(shifted, torch.tensor([[1, 5, 6, 7], [1, 8, 2, 0]]))


def _attention_inputs(t_len=5, s_len=7, heads=3, k_dim=8):
    torch.manual_seed(0)
    q = torch.randn(2, heads, t_len, k_dim)
    k = torch.randn(2, heads, s_len, k_dim)
    v = torch.randn(2, heads, s_len, k_dim)
    return q, k, v


@pytest.mark.parametrize("mask_kind", ["none", "padding", "padding_and_causal", "per_head"])
def test_scaled_dot_product_attention_matches_torch(mask_kind):
    # Self-attention shapes (T == S) for the causal case, cross-attention shapes (T != S) otherwise.
    q, k, v = _attention_inputs(6, 6) if mask_kind == "padding_and_causal" else _attention_inputs(5, 7)
    S_ = k.shape[2]
    real = lengths_to_real([S_, 3], S_)  # no row fully masked: each keeps key 0
    mask = {
        "none": None,
        "padding": real[:, None, None, :],  # (B, 1, 1, S)
        "padding_and_causal": real[:, None, None, :] & causal_mask(S_),  # (B, 1, T, S)
        "per_head": torch.rand(2, 3, q.shape[2], S_) > 0.5,  # (B, H, T, S), key 0 forced on below
    }[mask_kind]
    if mask_kind == "per_head":
        mask[..., 0] = True
    ours = scaled_dot_product_attention(q, k, v, mask)
    # F.scaled_dot_product_attention's bool mask also means True = attend.
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert ours.shape == q.shape
    # float32, O(1) values; the two compute the same sums in a different order (fused kernel).
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)


def test_fully_masked_attention_row_is_uniform_average_not_nan():
    q, k, v = _attention_inputs()
    mask = torch.ones(2, 1, q.shape[2], k.shape[2], dtype=torch.bool)
    mask[0, :, 2, :] = False  # batch 0, query 2 may see nothing
    out = scaled_dot_product_attention(q, k, v, mask)
    assert torch.isfinite(out).all()
    # Every masked score is finfo.min, so the softmax is uniform: the mean of the values. The
    # float32 mean over 7 values rounds differently from a weighted sum with weights 1/7.
    torch.testing.assert_close(out[0, :, 2], v[0].mean(dim=1), atol=1e-6, rtol=0)


def test_attention_keeps_low_precision_dtype():
    q, k, v = (x.bfloat16() for x in _attention_inputs())
    out = scaled_dot_product_attention(q, k, v)
    assert out.dtype == torch.bfloat16
    # bfloat16 keeps 8 significant bits (rounding 2^-9 = 0.002 relative per value); through q·kᵀ,
    # softmax and the weighted sum of O(1) values the error reaches 0.019 on these inputs.
    torch.testing.assert_close(out.float(), scaled_dot_product_attention(*_attention_inputs()), atol=0.03, rtol=0)


def test_positional_encoding_offset_and_max_len():
    cfg = small_config()
    model = Transformer(cfg)
    x = torch.zeros(2, 3, cfg.d_model)
    table = sinusoidal_positions(cfg.max_len, cfg.d_model)
    assert torch.equal(model.encoder.positions(x, offset=4), table[4:7].expand(2, 3, cfg.d_model))
    with pytest.raises(ValueError, match="max_len"):
        model.encoder.positions(x, offset=cfg.max_len - 2)
    # The sinusoid table is recomputed, never checkpointed.
    assert not any("table" in key for key in model.state_dict())


# ------------------------------------------------------------------------------------------------
# Initialisation
# ------------------------------------------------------------------------------------------------


def test_initialisation_follows_tensor2tensor():
    # Large enough that sample statistics are tight: the smallest matrix has 128*128 = 16384 entries.
    cfg = TransformerConfig(
        src_vocab_size=1000, tgt_vocab_size=900, d_model=128, num_heads=4, d_ff=512,
        num_encoder_layers=1, num_decoder_layers=1, max_len=512, positions="learned",
        share_embeddings=False, tie_output=False, attention_bias=True,
    )
    torch.manual_seed(0)
    model = Transformer(cfg)
    checked = set()
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            w = module.weight.detach()
            fan_out, fan_in = w.shape
            bound = math.sqrt(6.0 / (fan_in + fan_out))  # Xavier/Glorot uniform
            assert w.abs().max() <= bound, name
            # P(max < 0.98 bound) = 0.98^16384: a narrower init (e.g. torch's default) fails here.
            assert w.abs().max() >= 0.98 * bound, name
            # U(-a, a) has std a/sqrt(3); the sample std's relative error is ~sqrt(0.8/N)/2 <= 0.35%
            # for N >= 16384, so 3% is more than 8 standard errors.
            assert w.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.03), name
            checked.add(f"{name}.weight")
            if module.bias is not None:
                assert torch.equal(module.bias, torch.zeros_like(module.bias)), name
                checked.add(f"{name}.bias")
        elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            assert torch.equal(module.weight, torch.ones_like(module.weight)), name
            checked.add(f"{name}.weight")
            if getattr(module, "bias", None) is not None:
                assert torch.equal(module.bias, torch.zeros_like(module.bias)), name
                checked.add(f"{name}.bias")
    for name, std in [
        ("src_embed", cfg.d_model**-0.5),
        ("tgt_embed", cfg.d_model**-0.5),
        ("encoder.positions.embedding", 0.02),
        ("decoder.positions.embedding", 0.02),
    ]:
        w = model.get_submodule(name).weight.detach()
        # N >= 512*128 = 65536 normal samples: the std's relative standard error is
        # 1/sqrt(2N) <= 0.28%, so 2% is 7 standard errors; the mean's is std/sqrt(N) <= 0.4% of std.
        assert w.std().item() == pytest.approx(std, rel=0.02), name
        assert abs(w.mean().item()) < 0.02 * std, name
        checked.add(f"{name}.weight")
    # Every parameter was covered above: none is left at a library default.
    assert checked == {name for name, _ in model.named_parameters()}


def test_tied_and_shared_embeddings_are_one_tensor():
    torch.manual_seed(0)
    model = Transformer(small_config(share_embeddings=True, tie_output=True))
    assert model.tgt_embed is None and model.out_proj is None
    assert model.target_embedding is model.src_embed
    assert model.target_embedding.weight.data_ptr() == model.src_embed.weight.data_ptr()
    state = model.state_dict()
    assert [key for key in state if "embed" in key] == ["src_embed.weight"]
    assert "out_proj.weight" not in state  # only the attention layers' out_proj keys exist
    # One (V, D) matrix in the whole model, used three times.
    vocab_shaped = [p for p in model.parameters() if p.shape == (SRC_VOCAB, 24)]
    assert len(vocab_shaped) == 1
    hidden = torch.randn(B, T, 24)
    # project is exactly hidden @ Eᵀ with the shared matrix (same op, so the same bits).
    assert torch.equal(model.project(hidden), F.linear(hidden, model.src_embed.weight))
    model.project(hidden).sum().backward()
    assert model.src_embed.weight.grad is not None and model.src_embed.weight.grad.abs().sum() > 0


def test_tied_output_without_shared_embeddings_uses_target_embedding():
    torch.manual_seed(0)
    model = Transformer(small_config(share_embeddings=False, tie_output=True))
    assert model.out_proj is None and model.target_embedding is model.tgt_embed
    assert model.tgt_embed.weight.data_ptr() != model.src_embed.weight.data_ptr()
    assert model.src_embed.weight.shape == (SRC_VOCAB, 24) and model.tgt_embed.weight.shape == (TGT_VOCAB, 24)
    hidden = torch.randn(B, T, 24)
    assert torch.equal(model.project(hidden), F.linear(hidden, model.tgt_embed.weight))
    state = model.state_dict()
    assert sorted(key for key in state if "embed" in key) == ["src_embed.weight", "tgt_embed.weight"]


def test_untied_output_has_its_own_matrix():
    torch.manual_seed(0)
    model = Transformer(small_config(share_embeddings=True, tie_output=False))
    assert model.tgt_embed is None and model.out_proj is not None
    assert model.out_proj.weight.data_ptr() != model.src_embed.weight.data_ptr()
    assert model.out_proj.bias is None
    assert "out_proj.weight" in model.state_dict()


# ------------------------------------------------------------------------------------------------
# Equivalence with torch.nn.Transformer
# ------------------------------------------------------------------------------------------------
#
# torch.nn.Transformer has the same layers as the paper but a different layout, handled here:
# - nn.MultiheadAttention holds one in_proj_weight (3D, D) and in_proj_bias (3D,): its three row
#   blocks are the q, k and v projections, in that order. out_proj is an ordinary Linear.
# - Norm names: encoder layer norm1 (self-attention), norm2 (feed-forward); decoder layer norm1
#   (self-attention), norm2 (cross-attention), norm3 (feed-forward). The decoder's cross-attention
#   is `multihead_attn`; the feed-forward Linears are `linear1`/`linear2` on the layer itself.
# - nn.Transformer ALWAYS gives its encoder and decoder a final LayerNorm, even when post-norm
#   (norm_first=False). The paper's post-norm model has none (each layer already ends in a norm),
#   and neither does ours, so for post-norm that final norm is removed (`encoder.norm = None`,
#   which nn.TransformerEncoder/Decoder support). For pre-norm it is our Encoder/Decoder `norm`.
# - Key padding masks are bool with True = IGNORE, the opposite of ours (True = attend); the causal
#   mask likewise (True above the diagonal = not allowed).
# - nn.Transformer has no embeddings or positions: it is fed the embedded inputs with the
#   positions already added (our Encoder/Decoder add `sinusoidal_positions` themselves).
# - In eval mode, nn.TransformerEncoder takes a "fast path" that packs padded batches into nested
#   tensors and returns zeros at padded positions. The fast path is disabled for these tests and
#   the module is kept in train mode with dropout 0.0 (either alone would suffice), so padded
#   positions are computed like any other and can be compared too.


def copy_attention(theirs: nn.MultiheadAttention) -> dict[str, torch.Tensor]:
    """Our attention parameters from an nn.MultiheadAttention (one packed q/k/v projection)."""
    q_w, k_w, v_w = theirs.in_proj_weight.chunk(3, dim=0)  # (3D, D) -> 3 x (D, D), q k v order
    q_b, k_b, v_b = theirs.in_proj_bias.chunk(3, dim=0)  # (3D,) -> 3 x (D,)
    return {
        "q_proj.weight": q_w, "q_proj.bias": q_b,
        "k_proj.weight": k_w, "k_proj.bias": k_b,
        "v_proj.weight": v_w, "v_proj.bias": v_b,
        "out_proj.weight": theirs.out_proj.weight, "out_proj.bias": theirs.out_proj.bias,
    }


def nn_transformer_to_ours(theirs: nn.Transformer, ours: Transformer) -> None:
    """Load nn.Transformer's encoder and decoder stacks into ours, strictly (every key, every shape)."""
    def prefixed(prefix, params):
        return {f"{prefix}.{key}": value for key, value in params.items()}

    def linear_and_norm(layer, norms: dict[str, str]):
        params = {
            "ff.linear1.weight": layer.linear1.weight, "ff.linear1.bias": layer.linear1.bias,
            "ff.linear2.weight": layer.linear2.weight, "ff.linear2.bias": layer.linear2.bias,
        }
        for our_name, their_name in norms.items():
            norm = getattr(layer, their_name)
            params[f"{our_name}.weight"], params[f"{our_name}.bias"] = norm.weight, norm.bias
        return params

    encoder_state, decoder_state = {}, {}
    for i, layer in enumerate(theirs.encoder.layers):
        encoder_state |= prefixed(f"layers.{i}.self_attn", copy_attention(layer.self_attn))
        encoder_state |= prefixed(f"layers.{i}", linear_and_norm(layer, {"self_attn_norm": "norm1", "ff_norm": "norm2"}))
    for i, layer in enumerate(theirs.decoder.layers):
        decoder_state |= prefixed(f"layers.{i}.self_attn", copy_attention(layer.self_attn))
        decoder_state |= prefixed(f"layers.{i}.cross_attn", copy_attention(layer.multihead_attn))
        decoder_state |= prefixed(
            f"layers.{i}", linear_and_norm(layer, {"self_attn_norm": "norm1", "cross_attn_norm": "norm2", "ff_norm": "norm3"})
        )
    for state, their_norm in ((encoder_state, theirs.encoder.norm), (decoder_state, theirs.decoder.norm)):
        if their_norm is not None:  # pre-norm only; removed for post-norm (see above)
            state["norm.weight"], state["norm.bias"] = their_norm.weight, their_norm.bias
    # strict=True: every parameter of our stacks is set, with its exact shape, and nothing else.
    ours.encoder.load_state_dict(encoder_state, strict=True)
    ours.decoder.load_state_dict(decoder_state, strict=True)
    # ...and every parameter of theirs was used (the mapping is one-to-one).
    assert sum(p.numel() for p in theirs.parameters()) == sum(
        p.numel() for p in [*ours.encoder.parameters(), *ours.decoder.parameters()]
    )


@pytest.fixture
def no_mha_fastpath():
    previous = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    yield
    torch.backends.mha.set_fastpath_enabled(previous)


# nn.Transformer warns at construction that it will not use nested tensors (odd head count,
# norm_first): exactly what this test wants.
@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("norm_position", ["post", "pre"])
def test_stacks_match_torch_nn_transformer(norm_position, activation, no_mha_fastpath):
    cfg = small_config(
        norm_position=norm_position, activation=activation, layer_norm_eps=1e-5, attention_bias=True,
        dropout=0.0, attention_dropout=0.0, positions="sinusoidal",
    )
    torch.manual_seed(0)
    theirs = nn.Transformer(
        d_model=cfg.d_model, nhead=cfg.num_heads, num_encoder_layers=cfg.num_encoder_layers,
        num_decoder_layers=cfg.num_decoder_layers, dim_feedforward=cfg.d_ff, dropout=0.0,
        activation=activation, layer_norm_eps=cfg.layer_norm_eps, batch_first=True,
        norm_first=norm_position == "pre",
    )
    if norm_position == "post":
        theirs.encoder.norm = None  # the paper has no final norm after post-norm layers
        theirs.decoder.norm = None
    with torch.no_grad():
        # Random values everywhere, norm scales and biases included, so a swapped norm or bias
        # changes the result (nn.Transformer initialises norms to 1/0 and in_proj_bias to 0).
        for name, p in theirs.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name and name.endswith("weight") else 0.0))
    theirs.train()  # dropout is 0.0; train mode also rules out the nested-tensor fast path
    ours = Transformer(cfg).eval()
    nn_transformer_to_ours(theirs, ours)

    src_real = lengths_to_real([S, 4, 2], S)  # (B, S) some rows padded, none fully
    tgt_real = lengths_to_real([T, 2, 4], T)  # (B, T)
    x = torch.randn(B, S, cfg.d_model)  # embedded source, before positions
    y = torch.randn(B, T, cfg.d_model)  # embedded target, before positions
    x_pos = x + sinusoidal_positions(S, cfg.d_model)  # what our Encoder adds itself
    y_pos = y + sinusoidal_positions(T, cfg.d_model)
    src_mask = src_real[:, None, None, :]  # (B, 1, 1, S), True = attend
    tgt_mask = causal_mask(T) & tgt_real[:, None, None, :]  # (B, 1, T, T), True = attend
    their_causal = ~causal_mask(T)[0, 0]  # (T, T), True = NOT allowed

    with torch.no_grad():
        their_memory = theirs.encoder(x_pos, src_key_padding_mask=~src_real)
        our_memory = ours.encoder(x, src_mask)
        # Same memory into both decoders, so the decoder is compared on its own.
        their_hidden = theirs.decoder(
            y_pos, their_memory, tgt_mask=their_causal,
            tgt_key_padding_mask=~tgt_real, memory_key_padding_mask=~src_real,
        )
        our_hidden = ours.decoder(y, their_memory, src_mask, tgt_mask)
        # End to end through nn.Transformer.forward: encoder then decoder.
        their_full = theirs(
            x_pos, y_pos, tgt_mask=their_causal, src_key_padding_mask=~src_real,
            tgt_key_padding_mask=~tgt_real, memory_key_padding_mask=~src_real,
        )
        our_full = ours.decoder(y, our_memory, src_mask, tgt_mask)

    assert our_memory.shape == (B, S, cfg.d_model) and our_hidden.shape == (B, T, cfg.d_model)
    # Padded positions are compared too: neither side zeroes them (fast path off).
    # float32 with O(1) activations through 2-3 layers; the two sides differ only in the order of
    # sums (packed q/k/v matmul, scaling q before or after q·k): measured <= 1.4e-6, so 1e-5.
    tol = dict(atol=1e-5, rtol=0)
    torch.testing.assert_close(our_memory, their_memory, **tol)
    torch.testing.assert_close(our_hidden, their_hidden, **tol)
    torch.testing.assert_close(our_full, their_full, **tol)


# ------------------------------------------------------------------------------------------------
# Properties of every variant
# ------------------------------------------------------------------------------------------------

EMBEDDING_COMBOS = [  # (share_embeddings, tie_output); unshared means different vocabularies
    (True, True), (False, True), (False, False), (True, False),
]
VARIANTS = [
    dict(norm_position=p, activation=a, norm=n, positions=pos, share_embeddings=share, tie_output=tie)
    for p, a, n, pos, (share, tie) in itertools.product(
        ("post", "pre"), ("relu", "gelu", "swiglu"), ("layernorm", "rmsnorm"), ("sinusoidal", "learned"),
        EMBEDDING_COMBOS,
    )
]


def variant_id(v: dict) -> str:
    embeddings = ("shared" if v["share_embeddings"] else "separate") + ("-tied" if v["tie_output"] else "-untied")
    return "-".join([v["norm_position"], v["activation"], v["norm"], v["positions"], embeddings])


@pytest.fixture(params=VARIANTS, ids=variant_id)
def model(request) -> Transformer:
    """A small lopsided model of one variant, in eval mode (dropout 0.1 in the config, off here)."""
    torch.manual_seed(0)
    return Transformer(small_config(**request.param)).eval()


def make_batch(cfg: TransformerConfig):
    torch.manual_seed(1)
    src = random_ids([S, 4, 2], S, cfg.src_vocab_size)  # some rows padded, none fully
    tgt_in = random_ids([T, 3, 4], T, cfg.tgt_vocab_size, bos=True)
    return src, tgt_in


# Same shapes on both sides of a comparison, so the same kernels: the masked keys get weight
# exactly 0.0 and the result is bit-identical in practice. 1e-6 only absorbs a reduction order
# that may vary between calls (threaded or GPU kernels); the changes that must show are > 1e-3.
SAME_SHAPE_TOL = dict(atol=1e-6, rtol=0)
MUST_CHANGE = 1e-3  # the smallest change that counts as "the input reached this output"


@torch.no_grad()
def test_shapes(model):
    cfg = model.cfg
    src, tgt_in = make_batch(cfg)
    memory = model.encode(src)
    hidden = model.decode(tgt_in, memory, padding_mask(src, cfg.pad_id))
    logits = model(src, tgt_in)
    assert memory.shape == (B, S, cfg.d_model)
    assert hidden.shape == (B, T, cfg.d_model)
    assert logits.shape == (B, T, cfg.tgt_vocab_size)
    assert torch.isfinite(logits).all()
    # forward is exactly encode -> decode -> project (same ops, same bits).
    assert torch.equal(logits, model.project(hidden))


@torch.no_grad()
def test_future_target_tokens_do_not_change_earlier_outputs(model):
    cfg = model.cfg
    src, tgt_in = make_batch(cfg)
    logits = model(src, tgt_in)
    for t in range(1, T):
        changed = tgt_in.clone()
        # A different real token at position t in every row (in padded rows this un-pads t).
        changed[:, t] = (tgt_in[:, t] - FIRST_REAL_ID + 1) % (cfg.tgt_vocab_size - FIRST_REAL_ID) + FIRST_REAL_ID
        new_logits = model(src, changed)
        torch.testing.assert_close(new_logits[:, :t], logits[:, :t], **SAME_SHAPE_TOL)
        # Not vacuous: the output at position t itself does see the change, in every row.
        assert ((new_logits[:, t] - logits[:, t]).abs().amax(dim=-1) > MUST_CHANGE).all()


@torch.no_grad()
def test_tokens_under_source_padding_do_not_change_outputs(model):
    """Replace the ids at padded source positions, keeping the original mask (an explicit
    `src_mask`, since a new id would otherwise un-pad them). Precisely:
    - memory (encoder output) at every non-padded source position is unchanged;
    - memory at the padded positions themselves does change (they are queries too), which is
      allowed: nothing downstream attends to them;
    - decoder hidden states and logits at EVERY target position (padded or not) are unchanged,
      because cross-attention masks padded source keys for all queries.
    """
    cfg = model.cfg
    src, tgt_in = make_batch(cfg)
    src_mask = padding_mask(src, cfg.pad_id)  # (B, 1, 1, S)
    real = src_mask[:, 0, 0]  # (B, S)
    noise = torch.randint(FIRST_REAL_ID, cfg.src_vocab_size, src.shape)
    changed = torch.where(real, src, noise)
    assert not torch.equal(changed, src)

    memory = model.encode(src, src_mask)
    new_memory = model.encode(changed, src_mask)
    torch.testing.assert_close(new_memory[real], memory[real], **SAME_SHAPE_TOL)
    assert ((new_memory[~real] - memory[~real]).abs().amax(dim=-1) > MUST_CHANGE).all()

    logits = model.project(model.decode(tgt_in, memory, src_mask))
    new_logits = model.project(model.decode(tgt_in, new_memory, src_mask))
    torch.testing.assert_close(new_logits, logits, **SAME_SHAPE_TOL)
    # The explicit-mask path is the forward path.
    assert torch.equal(logits, model(src, tgt_in))


@torch.no_grad()
def test_extra_source_padding_does_not_change_outputs(model):
    cfg = model.cfg
    src, tgt_in = make_batch(cfg)
    longer = torch.cat([src, torch.full((B, 3), cfg.pad_id)], dim=1)  # (B, S + 3), 3 more pads
    logits = model(src, tgt_in)
    new_logits = model(longer, tgt_in)
    # Different source lengths run different matmul shapes (other blocking, other summation
    # order): a few float32 ulps of O(1) logits, so 1e-5 rather than the same-shape 1e-6.
    torch.testing.assert_close(new_logits, logits, atol=1e-5, rtol=0)


@torch.no_grad()
def test_fully_padded_source_row_is_finite_and_isolated(model):
    cfg = model.cfg
    src, tgt_in = make_batch(cfg)
    empty = src.clone()
    empty[1] = cfg.pad_id  # row 1: every source position is padding
    memory = model.encode(empty)
    logits = model(empty, tgt_in)
    assert torch.isfinite(memory).all()
    assert torch.isfinite(logits).all()
    # The other rows are computed as if row 1 were normal (rows never interact).
    torch.testing.assert_close(logits[[0, 2]], model(src, tgt_in)[[0, 2]], **SAME_SHAPE_TOL)


@torch.no_grad()
def test_a_pad_start_token_is_attended_like_any_start():
    """bos_id == pad_id (Marian starts its decoder with its pad id): the start position is not
    masked, so the model equals one with a separate start token whose embedding row is pad's (the
    row copy `train.interop.marian` imports with), at every real position, logits over the shared ids."""
    cfg = TransformerConfig(src_vocab_size=SRC_VOCAB, tgt_vocab_size=SRC_VOCAB, d_model=16, num_heads=2, d_ff=24,
                            num_encoder_layers=1, num_decoder_layers=2, dropout=0.0, bos_id=0)
    torch.manual_seed(0)
    at_pad = Transformer(cfg).eval()
    apart = Transformer(cfg.replace(bos_id=1)).eval()
    apart.load_state_dict(at_pad.state_dict())
    apart.target_embedding.weight[1] = at_pad.target_embedding.weight[0]  # shared and tied: one matrix
    src = random_ids([S, 4, 2], S, cfg.src_vocab_size)
    tgt_out = random_ids([T, 3, 4], T, cfg.tgt_vocab_size)  # real ids from FIRST_REAL_ID, right-padded
    real = tgt_out != cfg.pad_id
    ours, theirs = at_pad(src, shift_right(tgt_out, 0)), apart(src, shift_right(tgt_out, 1))
    keep = torch.arange(cfg.tgt_vocab_size) != 1  # id 1 is a different token in the two models
    torch.testing.assert_close(ours[real][:, keep], theirs[real][:, keep], **SAME_SHAPE_TOL)
    # Not vacuous: the old mask (padding hides position 0) gives other outputs.
    hidden = at_pad.decode(shift_right(tgt_out, 0), at_pad.encode(src), padding_mask(src, 0),
                           causal_mask(T) & padding_mask(shift_right(tgt_out, 0), 0))
    assert (at_pad.project(hidden)[real] - ours[real]).abs().max() > MUST_CHANGE


@pytest.mark.parametrize("rates", [dict(dropout=0.1, attention_dropout=0.1), dict(dropout=0.0, activation_dropout=0.1)])
def test_dropout_is_active_in_train_mode_only(rates):
    torch.manual_seed(0)
    model = Transformer(small_config(**rates))
    src, tgt_in = make_batch(model.cfg)
    model.train()
    assert not torch.equal(model(src, tgt_in), model(src, tgt_in))  # two dropout draws
    model.eval()
    assert torch.equal(model(src, tgt_in), model(src, tgt_in))


def test_state_dict_round_trip_gives_the_same_function():
    cfg = small_config(positions="learned", tie_output=False)
    torch.manual_seed(0)
    first = Transformer(cfg).eval()
    torch.manual_seed(1)
    second = Transformer(cfg).eval()
    src, tgt_in = make_batch(cfg)
    assert not torch.equal(first(src, tgt_in), second(src, tgt_in))
    second.load_state_dict(first.state_dict(), strict=True)
    assert torch.equal(first(src, tgt_in), second(src, tgt_in))


def test_encoder_and_decoder_depths_are_separate():
    model = Transformer(small_config())
    assert isinstance(model.encoder, Encoder) and isinstance(model.decoder, Decoder)
    assert len(model.encoder.layers) == 2 and len(model.decoder.layers) == 3
    assert not hasattr(model.encoder.layers[0], "cross_attn")
    assert all(hasattr(layer, "cross_attn") for layer in model.decoder.layers)


# ------------------------------------------------------------------------------------------------
# torch.compile
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "variant",
    [VARIANTS[0], dict(norm_position="pre", activation="swiglu", norm="rmsnorm", positions="learned",
                       share_embeddings=False, tie_output=False)],
    ids=variant_id,
)
def test_forward_compiles_without_graph_breaks(variant):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Transformer(small_config(**variant)).eval()
    src, tgt_in = make_batch(model.cfg)
    explanation = torch._dynamo.explain(model)(src, tgt_in)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    # fullgraph=True raises on any graph break; the "eager" backend runs the captured graph with
    # the ordinary kernels, so this checks tracing (not inductor codegen) and stays fast on CPU.
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with torch.no_grad():
        # Same kernels on the same inputs; only op fusion order could differ, which "eager" does not do.
        torch.testing.assert_close(compiled(src, tgt_in), model(src, tgt_in), atol=1e-6, rtol=0)
    torch._dynamo.reset()
