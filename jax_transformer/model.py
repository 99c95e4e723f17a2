"""The Transformer of "Attention Is All You Need" in Flax NNX: a line-by-line translation of
`torch_reference/model.py` (same names, same order: attribute paths are the checkpoint keys). Idioms differ:
`deterministic` and `rngs` are call arguments; a Linear's `kernel` is (in, out), a norm's `weight` is `scale`, an
Embedding's `embedding`; `dtype` (mixed precision) and the kernel set `xla_cpu` are this twin's own."""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from torch_reference.config import KernelSet, TransformerConfig

from . import objective
from . import xla_cpu as tuned

# Xavier-uniform matrices and zero biases, as tensor2tensor (and torch_reference) initialise them.
xavier_uniform = nnx.initializers.xavier_uniform()

# Each `activation`'s function (swiglu: silu times the gate); GELU the exact erf form (jax defaults to tanh).
ACTIVATIONS = {"relu": jax.nn.relu, "gelu": functools.partial(jax.nn.gelu, approximate=False), "silu": jax.nn.silu,
               "swiglu": jax.nn.silu}

# Pure functions -------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _sinusoid_table(length: int, d_model: int, halves: bool) -> np.ndarray:
    position = np.arange(length, dtype=np.float64)[:, None]  # (L, 1); float64 rounded once: twins bit-identical
    inv_freq = np.exp(np.arange(0, d_model, 2, dtype=np.float64) * (-math.log(10000.0) / d_model))
    angles = position * inv_freq  # (L, ceil(D/2))
    sines, cosines = np.sin(angles), np.cos(angles)
    if halves:
        return np.concatenate([sines, cosines[:, : d_model // 2]], axis=1).astype(np.float32)
    return np.stack([sines, cosines], axis=-1).reshape(length, -1)[:, :d_model].astype(np.float32)  # interleaved


def sinusoidal_positions(length: int, d_model: int, halves: bool = False) -> jax.Array:
    """(L, D) float32 sinusoid table (§3.5) as torch's twin (`halves`: Marian's layout); under jit a constant."""
    return jnp.asarray(_sinusoid_table(length, d_model, halves))


def padding_mask(ids: jax.Array, pad_id: int) -> jax.Array:
    """(B, L) token ids -> (B, 1, 1, L) bool, True at real tokens: which keys may be attended."""
    return (ids != pad_id)[:, None, None, :]


def causal_mask(length: int) -> jax.Array:
    """(1, 1, L, L) bool, True on and below the diagonal: position t sees positions <= t (§3.2.3)."""
    return jnp.tril(jnp.ones((length, length), dtype=jnp.bool_))[None, None]


def target_mask(tgt_in_ids: jax.Array, pad_id: int, bos_id: int) -> jax.Array:
    """(B, T) decoder inputs -> (B, 1, T, T) bool, as torch's twin (position 0 attended when bos_id == pad_id)."""
    T = tgt_in_ids.shape[1]
    real = tgt_in_ids != pad_id  # (B, T)
    if bos_id == pad_id:
        real = real | (jnp.arange(T) == 0)
    return causal_mask(T) & real[:, None, None, :]


def segment_mask(q_segments: jax.Array, kv_segments: jax.Array) -> jax.Array:
    """Segment ids (B, T) queries, (B, S) keys -> (B, 1, T, S) bool: True within a segment (torch's twin)."""
    return q_segments[:, None, :, None] == kv_segments[:, None, None, :]


def segment_positions(segments: jax.Array) -> jax.Array:
    """(B, L) segment ids -> (B, L) positions counted from 0 at the start of each segment."""
    index = jnp.broadcast_to(jnp.arange(segments.shape[1]), segments.shape)  # (B, L)
    starts = jnp.concatenate([jnp.ones_like(segments[:, :1], jnp.bool_), segments[:, 1:] != segments[:, :-1]], axis=1)
    return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)  # (B, L)


def shift_right(ids: jax.Array, bos_id: int) -> jax.Array:
    """Decoder inputs from targets: prepend BOS and drop the last token, (B, T) -> (B, T)."""
    return jnp.concatenate([jnp.full_like(ids[:, :1], bos_id), ids[:, :-1]], axis=1)


def scaled_dot_product_attention(q, k, v, mask=None, dropout=None, return_attention: bool = False):
    """softmax(q kᵀ / √K) v (§3.2.1), (B, H, T, K) as torch's twin (masks, float32 softmax); `dropout` a callable."""
    scores = jnp.matmul(q, jnp.swapaxes(k, -2, -1)) * (q.shape[-1] ** -0.5)  # (B, H, T, S)
    scores = scores.astype(jnp.promote_types(scores.dtype, jnp.float32))  # bf16/fp16 -> float32
    if mask is not None:
        scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(q.dtype)  # (B, H, T, S)
    out = jnp.matmul(weights if dropout is None else dropout(weights), v)  # (B, H, T, K)
    return (out, weights) if return_attention else out  # the weights before dropout


def fused_attention(q, k, v, mask=None):
    """`scaled_dot_product_attention` without dropout or weights in one `jax.nn.dot_product_attention` (cuDNN on a
    GPU in bfloat16/float16, else XLA's); its softmax float32, a fully masked row averaging too."""
    gpu_half = jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))  # (B, L, H, K): the layout it takes
    mask = None if mask is None else jnp.broadcast_to(mask, (mask.shape[0], 1, q.shape[1], k.shape[1]))
    out = jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="cudnn" if gpu_half else None)
    return jnp.swapaxes(out, 1, 2)  # (B, H, T, K)


class Kernels(NamedTuple):
    """A kernel set: the function each kind of computation runs; by default the reference path's."""
    attention: Callable = scaled_dot_product_attention  # (q, k, v, mask) -> (B, H, T, K), no dropout, no weights
    shared_keys: Callable | None = None  # cross-attention over one copy of a sentence's keys (xla_cpu.shared_keys)
    dot_general: Callable = jax.lax.dot_general  # every nnx.Linear's
    layer_norm: Callable | None = None  # xla_cpu.LayerNorm's in float32 without a mask (None: Flax's)
    relu_linear: Callable | None = None  # FeedForward's linear2(relu(h)) in float32 without activation dropout
    logits: Callable = nnx.Embed.attend  # the tied output projection, (embedding, hidden) -> logits
    loss_sums: Callable = objective.smoothed_sums  # (logits, targets, pad_id, smoothing) -> (loss sum, NLL sum)
    search: bool = False  # the searches take xla_cpu.shrinking_while's loop and best_candidates


# How the layers compute, by name (`set_kernels`; names: config.KernelSet, in order): `reference` torch's; `xla_cpu`
# xla_cpu.py's, faster on XLA:CPU; `fused` jax.nn.dot_product_attention (cuDNN on a GPU); all equal to float32 rounding.
KERNELS = {
    "reference": Kernels(),
    "xla_cpu": Kernels(shared_keys=tuned.shared_keys, dot_general=tuned.linear_dot_general, layer_norm=tuned.layer_norm,
                       relu_linear=tuned.relu_linear, logits=tuned.attend, loss_sums=tuned.smoothed_sums, search=True),
    "fused": Kernels(attention=fused_attention),
}


def set_kernels(module: nnx.Module, kernels: KernelSet = "reference", remat: bool = False) -> None:
    """Every layer's kernel set `kernels` (a KERNELS row) and `remat` (`nnx.remat`); Transformer calls it."""
    if KERNELS.get(kernels) is None:
        raise ValueError(f"kernels={kernels!r} is not one of {', '.join(k for k, row in KERNELS.items() if row)}")
    for _, m in nnx.iter_modules(module):
        if isinstance(m, nnx.Linear):
            m.dot_general = KERNELS[kernels].dot_general
        if isinstance(m, tuned.LayerNorm):
            m.layer_norm = KERNELS[kernels].layer_norm
        if hasattr(m, "kernels"):
            m.kernels = KERNELS[kernels]
        if hasattr(m, "remat"):
            m.remat = remat


def make_norm(cfg: TransformerConfig, rngs: nnx.Rngs, dtype=None) -> nnx.Module:
    """LayerNorm (paper) or RMSNorm, the config's epsilon, torch's variance E[(x-μ)²], statistics at least float32."""
    kwargs = dict(epsilon=cfg.layer_norm_eps, use_fast_variance=False, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
    if cfg.norm == "rmsnorm":
        return nnx.RMSNorm(cfg.d_model, **kwargs)
    return tuned.LayerNorm(cfg.d_model, **kwargs)  # nnx.LayerNorm, xla_cpu's backward pass under that set


# `dtype`: the computation's (None: float32); parameters are float32 whatever it is (Micikevicius et al. 2018).
def _linear(d_in: int, d_out: int, rngs: nnx.Rngs, bias: bool = True, dtype=None) -> nnx.Linear:
    return nnx.Linear(d_in, d_out, use_bias=bias, kernel_init=xavier_uniform, dtype=dtype, param_dtype=jnp.float32,
                      rngs=rngs)


def _embedding(num: int, d_model: int, std: float, rngs: nnx.Rngs, dtype=None) -> nnx.Embed:
    init = nnx.initializers.normal(stddev=std)
    return nnx.Embed(num, d_model, embedding_init=init, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)


# Modules, in paper order ----------------------------------------------------------------------------------------------


class PositionalEncoding(nnx.Module):
    """Adds position information to embeddings: the fixed sinusoid table (§3.5) or a learned one."""

    def __init__(self, cfg: TransformerConfig, *, dtype=None, rngs: nnx.Rngs):
        self.max_len = cfg.max_len
        self.d_model = cfg.d_model
        self.halves = cfg.positions == "sinusoidal_halves"
        # Learned tables ~ normal(0, 0.02) as torch's reset_parameters; the sinusoid table is a constant, no key.
        self.embedding = _embedding(cfg.max_len, cfg.d_model, 0.02, rngs, dtype) if cfg.positions == "learned" else None

    def __call__(self, x: jax.Array, offset: int | jax.Array = 0, positions: jax.Array | None = None) -> jax.Array:
        """x (B, L, D) -> x + positions[offset : offset + L] (`offset` may be traced), or + the rows at `positions`."""
        length = x.shape[1]
        if isinstance(offset, int) and offset + length > self.max_len:
            raise ValueError(f"sequence of {offset + length} positions exceeds max_len={self.max_len}")
        table = (sinusoidal_positions(self.max_len, self.d_model, self.halves) if self.embedding is None
                 else self.embedding.embedding[...])
        if positions is not None:
            return x + table[positions].astype(x.dtype)  # (B, L, D)
        return x + jax.lax.dynamic_slice_in_dim(table, offset, length).astype(x.dtype)  # (B, L, D)


class MultiHeadAttention(nnx.Module):
    """Multi-head attention (§3.2.2): project, split into H heads, attend, merge, project."""

    kernels = KERNELS["reference"]  # set_kernels

    def __init__(self, cfg: TransformerConfig, *, dtype=None, rngs: nnx.Rngs):
        self.num_heads = cfg.num_heads
        linear = functools.partial(_linear, rngs=rngs, dtype=dtype)
        self.q_proj = linear(cfg.d_model, cfg.d_model, bias=cfg.attention_bias)
        self.k_proj = linear(cfg.d_model, cfg.d_model, bias=cfg.attention_bias)
        self.v_proj = linear(cfg.d_model, cfg.d_model, bias=cfg.attention_bias)
        self.out_proj = linear(cfg.d_model, cfg.d_model, bias=cfg.attention_bias)
        self.dropout = nnx.Dropout(cfg.attention_dropout)

    def split_heads(self, x: jax.Array) -> jax.Array:
        B, L, D = x.shape
        return x.reshape(B, L, self.num_heads, D // self.num_heads).transpose(0, 2, 1, 3)  # (B, H, L, K)

    def project_kv(self, context: jax.Array) -> tuple[jax.Array, jax.Array]:
        """context (B, S, D) -> keys and values (B, H, S, K), as a decoding cache stores them."""
        return self.split_heads(self.k_proj(context)), self.split_heads(self.v_proj(context))

    def __call__(
        self, x, context, mask=None, kv=None, return_attention: bool = False, *, deterministic: bool = True,
        rngs: nnx.Rngs | None = None,
    ):
        """Queries from x (B, T, D), keys/values from context (B, S, D) or cached `kv` -> (B, T, D) [, (B, H, T, S)]."""
        # a sentence's hypotheses may share its keys (xla_cpu.shared_keys)
        if (shared := self.kernels.shared_keys and self.kernels.shared_keys(x, context, kv)) is not None:
            out = self(shared, context, mask, kv, return_attention, deterministic=deterministic, rngs=rngs)
            return out.reshape(x.shape)
        q = self.split_heads(self.q_proj(x))  # (B, H, T, K)
        k, v = self.project_kv(context) if kv is None else kv  # (B, H, S, K) each
        dropout = functools.partial(self.dropout, deterministic=deterministic, rngs=rngs)
        if return_attention or (not deterministic and self.dropout.rate > 0):  # what only the reference path gives
            out = scaled_dot_product_attention(q, k, v, mask, dropout, return_attention)  # (B, H, T, K)
        else:
            out = self.kernels.attention(q, k, v, mask)  # (B, H, T, K)
        out, attention = out if return_attention else (out, None)
        B, H, T, K = out.shape
        out = self.out_proj(out.transpose(0, 2, 1, 3).reshape(B, T, H * K))  # (B, T, D)
        return (out, attention) if return_attention else out


class FeedForward(nnx.Module):
    """Position-wise feed-forward network (§3.3): ReLU, GELU, SiLU or SwiGLU, as torch's twin."""

    kernels = KERNELS["reference"]  # set_kernels

    def __init__(self, cfg: TransformerConfig, *, dtype=None, rngs: nnx.Rngs):
        self.activation = cfg.activation
        linear = functools.partial(_linear, rngs=rngs, dtype=dtype)
        self.linear1 = linear(cfg.d_model, cfg.d_ff)
        self.linear_gate = linear(cfg.d_model, cfg.d_ff) if cfg.activation == "swiglu" else None
        self.linear2 = linear(cfg.d_ff, cfg.d_model)
        self.dropout = nnx.Dropout(cfg.activation_dropout)

    def __call__(self, x: jax.Array, *, deterministic: bool = True, rngs: nnx.Rngs | None = None) -> jax.Array:
        h = self.linear1(x)  # (B, L, F)
        dropping = not deterministic and self.dropout.rate > 0
        if self.kernels.relu_linear and self.activation == "relu" and h.dtype == jnp.float32 and not dropping:
            return self.kernels.relu_linear(h, self.linear2.kernel[...]) + self.linear2.bias[...]  # linear2(relu(h))
        h = ACTIVATIONS[self.activation](h)
        if self.linear_gate is not None:
            h = h * self.linear_gate(x)
        return self.linear2(self.dropout(h, deterministic=deterministic, rngs=rngs))  # (B, L, D)


class EncoderLayer(nnx.Module):
    """Self-attention then feed-forward, each in a residual block (§3.1), post- or pre-norm, as torch's twin."""

    def __init__(self, cfg: TransformerConfig, *, dtype=None, rngs: nnx.Rngs):
        self.pre_norm = cfg.norm_position == "pre"
        self.self_attn = MultiHeadAttention(cfg, dtype=dtype, rngs=rngs)
        self.self_attn_norm = make_norm(cfg, rngs, dtype)
        self.ff = FeedForward(cfg, dtype=dtype, rngs=rngs)
        self.ff_norm = make_norm(cfg, rngs, dtype)
        self.dropout = nnx.Dropout(cfg.dropout)

    def residual(self, x, norm, sublayer, deterministic=True, rngs=None):
        if self.pre_norm:
            return x + self.dropout(sublayer(norm(x)), deterministic=deterministic, rngs=rngs)
        return norm(x + self.dropout(sublayer(x), deterministic=deterministic, rngs=rngs))

    def __call__(self, x, mask=None, *, deterministic: bool = True, rngs: nnx.Rngs | None = None):
        """x (B, S, D), mask broadcastable to (B, H, S, S) -> (B, S, D)."""
        mode = dict(deterministic=deterministic, rngs=rngs)
        x = self.residual(x, self.self_attn_norm, lambda h: self.self_attn(h, h, mask, **mode), **mode)
        return self.residual(x, self.ff_norm, lambda h: self.ff(h, **mode), **mode)


class DecoderLayer(EncoderLayer):
    """An EncoderLayer with attention over the encoder output between its two sublayers (§3.1)."""

    def __init__(self, cfg: TransformerConfig, *, dtype=None, rngs: nnx.Rngs):
        super().__init__(cfg, dtype=dtype, rngs=rngs)
        self.cross_attn = MultiHeadAttention(cfg, dtype=dtype, rngs=rngs)
        self.cross_attn_norm = make_norm(cfg, rngs, dtype)

    def __call__(self, x, memory, src_mask=None, tgt_mask=None, return_attention=False, *, deterministic=True,
                 rngs=None):
        """x (B, T, D), memory (B, S, D) -> (B, T, D) [, cross-attention (B, H, T, S)]."""
        mode = dict(deterministic=deterministic, rngs=rngs)
        attention = []  # filled by the cross-attention sublayer when asked for

        def cross_attn(h):
            if not return_attention:
                return self.cross_attn(h, memory, src_mask, **mode)
            out, weights = self.cross_attn(h, memory, src_mask, return_attention=True, **mode)
            attention.append(weights)
            return out

        x = self.residual(x, self.self_attn_norm, lambda h: self.self_attn(h, h, tgt_mask, **mode), **mode)
        x = self.residual(x, self.cross_attn_norm, cross_attn, **mode)
        x = self.residual(x, self.ff_norm, lambda h: self.ff(h, **mode), **mode)
        return (x, attention[0]) if return_attention else x

    def init_cache(self, memory: jax.Array, max_len: int) -> dict[str, jax.Array]:
        """Cross-attention keys/values of memory (B, S, D), room for max_len self-attention ones (torch's twin)."""
        cross_k, cross_v = self.cross_attn.project_kv(memory)
        B, H, S, K = cross_k.shape
        empty = jnp.zeros((B, H, max_len, K), cross_k.dtype)
        return {"self_k": empty, "self_v": empty, "cross_k": cross_k, "cross_v": cross_v}

    def step(self, x, cache: dict[str, jax.Array], position, src_mask=None) -> tuple[jax.Array, dict[str, jax.Array]]:
        """`__call__` at `position` alone (may be traced): x (B, 1, D), `cache` -> ((B, 1, D), the updated cache)."""
        cache = dict(cache)

        def cached_self_attn(h):
            k, v = self.self_attn.project_kv(h)  # (B, H, 1, K) each
            cache["self_k"] = jax.lax.dynamic_update_slice_in_dim(cache["self_k"], k, position, axis=2)
            cache["self_v"] = jax.lax.dynamic_update_slice_in_dim(cache["self_v"], v, position, axis=2)
            length = cache["self_k"].shape[2]
            seen = (jnp.arange(length) <= position)[None, None, None, :]  # (1, 1, 1, L)
            return self.self_attn(h, None, seen, kv=(cache["self_k"], cache["self_v"]))

        cross = (cache["cross_k"], cache["cross_v"])
        x = self.residual(x, self.self_attn_norm, cached_self_attn)  # deterministic: decoding drops nothing
        x = self.residual(x, self.cross_attn_norm, lambda h: self.cross_attn(h, None, src_mask, kv=cross))
        return self.residual(x, self.ff_norm, self.ff), cache


class Encoder(nnx.Module):
    """Positions and dropout on the embedded input, `num_layers` layers, a final norm if pre-norm."""

    layer_type = EncoderLayer
    remat = False  # set_kernels

    def __init__(self, cfg: TransformerConfig, num_layers: int, *, dtype=None, rngs: nnx.Rngs):
        self.positions = PositionalEncoding(cfg, dtype=dtype, rngs=rngs)
        self.dropout = nnx.Dropout(cfg.dropout)
        layer = functools.partial(self.layer_type, cfg, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([layer() for _ in range(num_layers)])
        self.norm = make_norm(cfg, rngs, dtype) if cfg.norm_position == "pre" else None

    def run_layer(self, layer, x, *args, deterministic, rngs, **static):
        """layer(x, *args, ...); with `remat` its activations are recomputed for the backward pass."""
        def run(layer, x, args, rngs):
            return layer(x, *args, deterministic=deterministic, rngs=rngs, **static)

        return (nnx.remat(run) if self.remat else run)(layer, x, args, rngs)

    def __call__(self, x, mask=None, *, positions=None, deterministic: bool = True, rngs: nnx.Rngs | None = None):
        """Embedded source x (B, S, D) -> memory (B, S, D); `positions` (B, S): see PositionalEncoding."""
        x = self.dropout(self.positions(x, positions=positions), deterministic=deterministic, rngs=rngs)
        for layer in self.layers:
            x = self.run_layer(layer, x, mask, deterministic=deterministic, rngs=rngs)
        return x if self.norm is None else self.norm(x)


class Decoder(Encoder):
    """The Encoder's stack with DecoderLayers, which also attend to the encoder output."""

    layer_type = DecoderLayer

    def __call__(
        self, x, memory, src_mask=None, tgt_mask=None, return_attention=False, *, positions=None, deterministic=True,
        rngs=None,
    ):
        """Embedded target x (B, T, D), memory (B, S, D) -> (B, T, D) [, cross-attention (B, layers, H, T, S)]."""
        x = self.dropout(self.positions(x, positions=positions), deterministic=deterministic, rngs=rngs)
        attention = []
        for layer in self.layers:
            x = self.run_layer(layer, x, memory, src_mask, tgt_mask, return_attention=return_attention,
                               deterministic=deterministic, rngs=rngs)
            if return_attention:
                x, weights = x
                attention.append(weights)
        x = x if self.norm is None else self.norm(x)
        return (x, jnp.stack(attention, axis=1)) if return_attention else x

    def step(self, x, cache: list[dict[str, jax.Array]], position, src_mask=None):
        """Embedded target token x (B, 1, D) at `position` -> (hidden (B, 1, D), cache)."""
        x = self.positions(x, offset=position)  # no dropout: decoding is deterministic
        new_cache = []
        for layer, layer_cache in zip(self.layers, cache):
            x, layer_cache = layer.step(x, layer_cache, position, src_mask)
            new_cache.append(layer_cache)
        return (x if self.norm is None else self.norm(x)), new_cache


class Transformer(nnx.Module):
    """The encoder-decoder model as torch's twin: `Transformer(cfg, rngs=nnx.Rngs(0))(src_ids, tgt_in_ids) -> logits
    (B, T, V)`; training passes `deterministic=False`, `rngs=nnx.Rngs(dropout=key)`. `dtype`: None (float32) or
    jnp.bfloat16 (parameters, softmax, norm statistics, loss: float32). `kernels`, `remat`: `set_kernels`."""

    kernels = KERNELS["reference"]  # set_kernels

    def __init__(self, cfg: TransformerConfig, *, dtype=None, kernels: KernelSet = "reference", remat: bool = False,
                 rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed_scale = math.sqrt(cfg.d_model) if cfg.scale_embeddings else 1.0
        # Embeddings ~ normal(0, d_model^-0.5): unit variance once scaled by sqrt(d_model).
        std = cfg.d_model**-0.5
        self.src_embed = _embedding(cfg.src_vocab_size, cfg.d_model, std, rngs, dtype)
        # With shared embeddings the target side reads src_embed: one parameter, one checkpoint key.
        self.tgt_embed = (None if cfg.share_embeddings
                          else _embedding(cfg.tgt_vocab_size, cfg.d_model, std, rngs, dtype))
        self.encoder = Encoder(cfg, cfg.num_encoder_layers, dtype=dtype, rngs=rngs)
        self.decoder = Decoder(cfg, cfg.num_decoder_layers, dtype=dtype, rngs=rngs)
        # Tied output: logits = h Eᵀ with the target embedding E (§3.4); no separate matrix.
        self.out_proj = None if cfg.tie_output else _linear(cfg.d_model, cfg.tgt_vocab_size, rngs, False, dtype)
        # `output_bias`: a bias on the logits, tied output or not (Marian's final_logits_bias); zeros.
        self.logits_bias = nnx.Param(jnp.zeros((cfg.tgt_vocab_size,), jnp.float32)) if cfg.output_bias else None
        set_kernels(self, kernels, remat)

    @property
    def xla_cpu(self) -> bool:
        """Whether the searches take xla_cpu.py's loop (the kernel set's `search`)."""
        return self.kernels.search

    @property
    def target_embedding(self) -> nnx.Embed:
        return self.src_embed if self.tgt_embed is None else self.tgt_embed

    def encode(self, src_ids, src_mask=None, *, positions=None, deterministic: bool = True,
               rngs: nnx.Rngs | None = None):
        """src_ids (B, S) -> memory (B, S, D), as torch's twin."""
        if src_mask is None:
            src_mask = padding_mask(src_ids, self.cfg.pad_id)
        x = self.src_embed(src_ids) * self.embed_scale  # (B, S, D)
        return self.encoder(x, src_mask, positions=positions, deterministic=deterministic, rngs=rngs)

    def decode(
        self, tgt_in_ids, memory, src_mask=None, tgt_mask=None, return_attention=False, *, positions=None,
        deterministic=True, rngs=None,
    ):
        """tgt_in_ids (B, T), memory (B, S, D) -> (B, T, D) [, cross-attention (B, layers, H, T, S)] as torch's twin."""
        if tgt_mask is None:
            tgt_mask = target_mask(tgt_in_ids, self.cfg.pad_id, self.cfg.bos_id)
        x = self.target_embedding(tgt_in_ids) * self.embed_scale  # (B, T, D)
        mode = {"positions": positions, "deterministic": deterministic, "rngs": rngs}
        return self.decoder(x, memory, src_mask, tgt_mask, return_attention, **mode)

    def init_cache(self, memory: jax.Array, max_len: int) -> list[dict[str, jax.Array]]:
        """A decoding cache for `max_len` target positions over memory (B, S, D), one dict per layer."""
        return [layer.init_cache(memory, max_len) for layer in self.decoder.layers]

    def decode_step(self, tgt_ids, cache, position, src_mask=None):
        """tgt_ids (B,) at `position` -> (logits (B, V) for position + 1, cache), as torch's twin."""
        x = self.target_embedding(tgt_ids[:, None]) * self.embed_scale  # (B, 1, D)
        hidden, cache = self.decoder.step(x, cache, position, src_mask)
        return self.project(hidden)[:, 0], cache

    def project(self, hidden: jax.Array) -> jax.Array:
        """hidden (B, T, D) -> logits (B, T, V)."""
        if self.out_proj is None:
            logits = self.kernels.logits(self.target_embedding, hidden)
        else:
            logits = self.out_proj(hidden)
        return logits if self.logits_bias is None else logits + self.logits_bias[...].astype(logits.dtype)

    def __call__(
        self, src_ids, tgt_in_ids, return_attention: bool = False, *, src_segments=None, tgt_segments=None,
        deterministic: bool = True, rngs: nnx.Rngs | None = None,
    ):
        """src_ids (B, S), tgt_in_ids (B, T) -> logits (B, T, V), as torch's twin (`return_attention`, packed rows)."""
        if (src_segments is None) != (tgt_segments is None):
            raise ValueError("packed rows need both src_segments and tgt_segments, got only one")
        src_mask = padding_mask(src_ids, self.cfg.pad_id)
        cross_mask, tgt_mask, src_positions, tgt_positions = src_mask, None, None, None
        if src_segments is not None:
            cross_mask = src_mask & segment_mask(tgt_segments, src_segments)  # (B, 1, T, S)
            src_mask = src_mask & segment_mask(src_segments, src_segments)  # (B, 1, S, S)
            tgt_mask = target_mask(tgt_in_ids, self.cfg.pad_id, self.cfg.bos_id)
            tgt_mask = tgt_mask & segment_mask(tgt_segments, tgt_segments)  # (B, 1, T, T)
            src_positions, tgt_positions = segment_positions(src_segments), segment_positions(tgt_segments)
        mode = dict(deterministic=deterministic, rngs=rngs)
        memory = self.encode(src_ids, src_mask, positions=src_positions, **mode)
        decoded = self.decode(tgt_in_ids, memory, cross_mask, tgt_mask, return_attention, positions=tgt_positions,
                              **mode)
        return (self.project(decoded[0]), decoded[1]) if return_attention else self.project(decoded)
