"""The encoder-decoder Transformer of "Attention Is All You Need" (Vaswani et al., 2017) in PyTorch: the project's
specification. `jax_transformer/model.py` holds the same names in the same order (attribute paths: checkpoint keys).
Shape letters (both files): B batch, S source length, T target length, L any length, H heads, D model width, K head
width, F feed-forward width, V vocabulary. Masks are bool, True where attention is allowed. Architecture only."""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

from .config import KernelSet, TransformerConfig

# Each `activation`'s function (swiglu: silu times the gate); GELU the exact erf form in both twins.
ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu, "swiglu": F.silu}

# Pure functions -------------------------------------------------------------------------------------------------------


def sinusoidal_positions(length: int, d_model: int, halves: bool = False) -> Tensor:
    """(L, D) float32 PE[p, 2i] = sin(p / 10000^(2i/D)), PE[p, 2i+1] = cos(same) (§3.5); `halves`: Marian's layout."""
    position = torch.arange(length, dtype=torch.float64)[:, None]  # (L, 1); float64 rounded once: twins bit-identical
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model))
    angles = position * inv_freq  # (L, ceil(D/2))
    sines, cosines = torch.sin(angles), torch.cos(angles)
    if halves:
        return torch.cat([sines, cosines[:, : d_model // 2]], dim=1).to(torch.float32)
    return torch.stack([sines, cosines], dim=-1).reshape(length, -1)[:, :d_model].to(torch.float32)  # interleaved


def padding_mask(ids: Tensor, pad_id: int) -> Tensor:
    """(B, L) token ids -> (B, 1, 1, L) bool, True at real tokens: which keys may be attended."""
    return (ids != pad_id)[:, None, None, :]


def causal_mask(length: int, device: torch.device | None = None) -> Tensor:
    """(1, 1, L, L) bool, True on and below the diagonal: position t sees positions <= t (§3.2.3)."""
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()[None, None]


def target_mask(tgt_in_ids: Tensor, pad_id: int, bos_id: int) -> Tensor:
    """(B, T) decoder inputs -> (B, 1, T, T) bool: causal & padding masks, position 0 seen if bos_id == pad_id."""
    T = tgt_in_ids.shape[1]
    real = tgt_in_ids != pad_id  # (B, T)
    if bos_id == pad_id:
        real = real | (torch.arange(T, device=tgt_in_ids.device) == 0)
    return causal_mask(T, tgt_in_ids.device) & real[:, None, None, :]


def segment_mask(q_segments: Tensor, kv_segments: Tensor) -> Tensor:
    """(B, T) query and (B, S) key segment ids of packed rows -> (B, 1, T, S) bool, True within one segment."""
    return q_segments[:, None, :, None] == kv_segments[:, None, None, :]


def segment_positions(segments: Tensor) -> Tensor:
    """(B, L) segment ids -> (B, L) positions counted from 0 at the start of each segment."""
    index = torch.arange(segments.shape[1], device=segments.device).expand_as(segments)  # (B, L)
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    return index - torch.where(starts, index, 0).cummax(dim=1).values  # (B, L)


def shift_right(ids: Tensor, bos_id: int) -> Tensor:
    """Decoder inputs from targets: prepend BOS and drop the last token, (B, T) -> (B, T)."""
    return torch.cat([torch.full_like(ids[:, :1], bos_id), ids[:, :-1]], dim=1)


def scaled_dot_product_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, dropout: nn.Module | None = None,
    return_attention: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """softmax(q kᵀ / √K) v (§3.2.1), q (B, H, T, K), k and v (B, H, S, K) -> (B, H, T, K), softmax in float32; masked
    scores the lowest finite value, not -inf (no NaN rows); `return_attention`: also the weights before `dropout`."""
    scores = torch.matmul(q, k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)  # (B, H, T, S)
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))  # bf16/fp16 -> float32
    if mask is not None:
        scores = torch.where(mask, scores, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1).to(q.dtype)  # (B, H, T, S)
    out = torch.matmul(weights if dropout is None else dropout(weights), v)  # (B, H, T, K)
    return (out, weights) if return_attention else out  # the weights before dropout


def fused_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
    """`scaled_dot_product_attention` in one F.scaled_dot_product_attention (fused on a GPU), no dropout or weights; a
    fully masked (padding) row gives zeros and no gradient. The mask stays boolean: as a large negative score it gives
    garbage gradients on the CPU."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, T, K)


class Kernels(NamedTuple):
    """A kernel set: the function each kind of computation runs; by default the reference path's."""
    attention: Callable = scaled_dot_product_attention  # (q, k, v, mask) -> (B, H, T, K), no dropout, no weights


# How the layers compute, by name (`set_kernels`; names: config.KernelSet, in order): `reference` this file's plain
# path; `fused` F.scaled_dot_product_attention (fused on a GPU), equal to float32 rounding; `xla_cpu` the JAX twin's.
KERNELS = {"reference": Kernels(), "xla_cpu": None, "fused": Kernels(attention=fused_attention)}


def set_kernels(module: nn.Module, kernels: KernelSet = "reference", remat: bool = False) -> None:
    """Every layer's kernel set `kernels` (a KERNELS row) and `remat` (torch.utils.checkpoint); Transformer calls it."""
    if KERNELS.get(kernels) is None:
        raise ValueError(f"kernels={kernels!r} is not one of {', '.join(k for k, row in KERNELS.items() if row)}")
    for m in module.modules():
        if hasattr(m, "kernels"):
            m.kernels = KERNELS[kernels]
        if hasattr(m, "remat"):
            m.remat = remat


def make_norm(cfg: TransformerConfig) -> nn.Module:
    """LayerNorm (paper) or RMSNorm, both with the config's epsilon (never a library default)."""
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.d_model, eps=cfg.layer_norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)


# Modules, in paper order ----------------------------------------------------------------------------------------------


class PositionalEncoding(nn.Module):
    """Adds position information to embeddings: the fixed sinusoid table (§3.5) or a learned one."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.max_len = cfg.max_len
        if cfg.positions == "learned":
            self.embedding = nn.Embedding(cfg.max_len, cfg.d_model)
        else:
            # A buffer, not a parameter, and not persistent: it is recomputed, never checkpointed.
            self.embedding = None
            table = sinusoidal_positions(cfg.max_len, cfg.d_model, halves=cfg.positions == "sinusoidal_halves")
            self.register_buffer("table", table, persistent=False)

    def forward(self, x: Tensor, offset: int = 0, positions: Tensor | None = None) -> Tensor:
        """x (B, L, D) -> x + positions[offset : offset + L], or + the table's rows at `positions` (B, L) if given."""
        length = x.shape[1]
        if offset + length > self.max_len:
            raise ValueError(f"sequence of {offset + length} positions exceeds max_len={self.max_len}")
        table = self.table if self.embedding is None else self.embedding.weight
        if positions is not None:
            return x + table[positions].to(x.dtype)  # (B, L, D)
        return x + table[offset : offset + length].to(x.dtype)  # (B, L, D)


class MultiHeadAttention(nn.Module):
    """Multi-head attention (§3.2.2): project, split into H heads, attend, merge, project."""

    kernels = KERNELS["reference"]  # set_kernels

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.attention_bias)
        self.out_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.attention_bias)
        self.dropout = nn.Dropout(cfg.attention_dropout)

    def split_heads(self, x: Tensor) -> Tensor:
        B, L, D = x.shape
        return x.view(B, L, self.num_heads, D // self.num_heads).transpose(1, 2)  # (B, H, L, K)

    def project_kv(self, context: Tensor) -> tuple[Tensor, Tensor]:
        """context (B, S, D) -> keys and values (B, H, S, K), as a decoding cache stores them."""
        return self.split_heads(self.k_proj(context)), self.split_heads(self.v_proj(context))

    def forward(
        self, x: Tensor, context: Tensor | None, mask: Tensor | None = None, kv: tuple[Tensor, Tensor] | None = None,
        return_attention: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Queries from x (B, T, D), keys/values from context (B, S, D) or cached `kv` -> (B, T, D) [, (B, H, T, S)]."""
        q = self.split_heads(self.q_proj(x))  # (B, H, T, K)
        k, v = self.project_kv(context) if kv is None else kv  # (B, H, S, K) each
        if return_attention or (self.training and self.dropout.p > 0):  # what only the reference path gives
            out = scaled_dot_product_attention(q, k, v, mask, self.dropout, return_attention)  # (B, H, T, K)
        else:
            out = self.kernels.attention(q, k, v, mask)  # (B, H, T, K)
        out, attention = out if return_attention else (out, None)
        B, H, T, K = out.shape
        out = self.out_proj(out.transpose(1, 2).reshape(B, T, H * K))  # (B, T, D)
        return (out, attention) if return_attention else out


class FeedForward(nn.Module):
    """Position-wise feed-forward (§3.3): linear2(act(linear1(x))); swiglu multiplies act(...) by linear_gate(x)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.activation = cfg.activation
        self.linear1 = nn.Linear(cfg.d_model, cfg.d_ff)
        self.linear_gate = nn.Linear(cfg.d_model, cfg.d_ff) if cfg.activation == "swiglu" else None
        self.linear2 = nn.Linear(cfg.d_ff, cfg.d_model)
        self.dropout = nn.Dropout(cfg.activation_dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = ACTIVATIONS[self.activation](self.linear1(x))  # (B, L, F)
        if self.linear_gate is not None:
            h = h * self.linear_gate(x)
        return self.linear2(self.dropout(h))  # (B, L, D)


class EncoderLayer(nn.Module):
    """Self-attention then feed-forward, each a residual block (§3.1): post-norm (the paper) x = Norm(x +
    Dropout(sublayer(x))), or pre-norm x = x + Dropout(sublayer(Norm(x))) with a final norm in the Encoder/Decoder."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.pre_norm = cfg.norm_position == "pre"
        self.self_attn = MultiHeadAttention(cfg)
        self.self_attn_norm = make_norm(cfg)
        self.ff = FeedForward(cfg)
        self.ff_norm = make_norm(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def residual(self, x: Tensor, norm: nn.Module, sublayer) -> Tensor:
        if self.pre_norm:
            return x + self.dropout(sublayer(norm(x)))
        return norm(x + self.dropout(sublayer(x)))

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """x (B, S, D), mask broadcastable to (B, H, S, S) -> (B, S, D)."""
        x = self.residual(x, self.self_attn_norm, lambda h: self.self_attn(h, h, mask))
        return self.residual(x, self.ff_norm, self.ff)


class DecoderLayer(EncoderLayer):
    """An EncoderLayer with attention over the encoder output between its two sublayers (§3.1)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__(cfg)
        self.cross_attn = MultiHeadAttention(cfg)
        self.cross_attn_norm = make_norm(cfg)

    def forward(
        self, x: Tensor, memory: Tensor, src_mask: Tensor | None = None, tgt_mask: Tensor | None = None,
        return_attention: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """x (B, T, D), memory (B, S, D) -> (B, T, D) [, cross-attention (B, H, T, S)]."""
        attention = []  # filled by the cross-attention sublayer when asked for

        def cross_attn(h: Tensor) -> Tensor:
            if not return_attention:
                return self.cross_attn(h, memory, src_mask)
            out, weights = self.cross_attn(h, memory, src_mask, return_attention=True)
            attention.append(weights)
            return out

        x = self.residual(x, self.self_attn_norm, lambda h: self.self_attn(h, h, tgt_mask))
        x = self.residual(x, self.cross_attn_norm, cross_attn)
        x = self.residual(x, self.ff_norm, self.ff)
        return (x, attention[0]) if return_attention else x

    def init_cache(self, memory: Tensor, max_len: int) -> dict[str, Tensor]:
        """A cache: self_k, self_v zeros (B, H, max_len, K); cross_k, cross_v (B, H, S, K) of memory (B, S, D)."""
        cross_k, cross_v = self.cross_attn.project_kv(memory)
        B, H, S, K = cross_k.shape
        empty = cross_k.new_zeros(B, H, max_len, K)
        return {"self_k": empty, "self_v": empty.clone(), "cross_k": cross_k, "cross_v": cross_v}

    def step(self, x: Tensor, cache: dict[str, Tensor], position: int,
             src_mask: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """`forward` at `position` alone: x (B, 1, D), `cache` updated in place -> ((B, 1, D), cache)."""

        def cached_self_attn(h: Tensor) -> Tensor:
            k, v = self.self_attn.project_kv(h)  # (B, H, 1, K) each
            cache["self_k"][:, :, position] = k[:, :, 0]
            cache["self_v"][:, :, position] = v[:, :, 0]
            length = cache["self_k"].shape[2]
            seen = (torch.arange(length, device=h.device) <= position)[None, None, None, :]  # (1, 1, 1, L)
            return self.self_attn(h, None, seen, kv=(cache["self_k"], cache["self_v"]))

        cross = (cache["cross_k"], cache["cross_v"])
        x = self.residual(x, self.self_attn_norm, cached_self_attn)
        x = self.residual(x, self.cross_attn_norm, lambda h: self.cross_attn(h, None, src_mask, kv=cross))
        return self.residual(x, self.ff_norm, self.ff), cache


class Encoder(nn.Module):
    """Positions and dropout on the embedded input, `num_layers` layers, a final norm if pre-norm."""

    layer_type = EncoderLayer
    remat = False  # set_kernels

    def __init__(self, cfg: TransformerConfig, num_layers: int):
        super().__init__()
        self.positions = PositionalEncoding(cfg)
        self.dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(self.layer_type(cfg) for _ in range(num_layers))
        self.norm = make_norm(cfg) if cfg.norm_position == "pre" else None

    def run_layer(self, layer: nn.Module, x: Tensor, *args, **static):
        """layer(x, *args); with `remat` its activations are recomputed for the backward pass."""
        if self.remat and torch.is_grad_enabled():
            # Non-reentrant, and the RNG state restored: the recomputation draws the same dropout masks.
            return torch.utils.checkpoint.checkpoint(layer, x, *args, use_reentrant=False, **static)
        return layer(x, *args, **static)

    def forward(self, x: Tensor, mask: Tensor | None = None, *, positions: Tensor | None = None) -> Tensor:
        """Embedded source x (B, S, D) -> memory (B, S, D); `positions` (B, S): see PositionalEncoding."""
        x = self.dropout(self.positions(x, positions=positions))
        for layer in self.layers:
            x = self.run_layer(layer, x, mask)
        return x if self.norm is None else self.norm(x)


class Decoder(Encoder):
    """The Encoder's stack with DecoderLayers, which also attend to the encoder output."""

    layer_type = DecoderLayer

    def forward(
        self, x: Tensor, memory: Tensor, src_mask: Tensor | None = None, tgt_mask: Tensor | None = None,
        return_attention: bool = False, *, positions: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Embedded target x (B, T, D), memory (B, S, D) -> (B, T, D) [, cross-attention (B, layers, H, T, S)]."""
        x = self.dropout(self.positions(x, positions=positions))
        attention = []
        for layer in self.layers:
            x = self.run_layer(layer, x, memory, src_mask, tgt_mask, return_attention=return_attention)
            if return_attention:
                x, weights = x
                attention.append(weights)
        x = x if self.norm is None else self.norm(x)
        return (x, torch.stack(attention, dim=1)) if return_attention else x

    def step(self, x: Tensor, cache: list[dict[str, Tensor]], position: int,
             src_mask: Tensor | None = None) -> tuple[Tensor, list[dict[str, Tensor]]]:
        """Embedded target token x (B, 1, D) at `position` -> (hidden (B, 1, D), cache)."""
        x = self.positions(x, offset=position)  # no dropout: decoding is deterministic
        new_cache = []
        for layer, layer_cache in zip(self.layers, cache):
            x, layer_cache = layer.step(x, layer_cache, position, src_mask)
            new_cache.append(layer_cache)
        return (x if self.norm is None else self.norm(x)), new_cache


class Transformer(nn.Module):
    """The encoder-decoder model: `Transformer(cfg)(src_ids, tgt_in_ids) -> logits (B, T, V)`; `encode`, `decode` and
    `project` run apart in search (decode.py). `kernels`, `remat`: `set_kernels` (the same checkpoint keys for all)."""

    kernels = KERNELS["reference"]  # set_kernels

    def __init__(self, cfg: TransformerConfig, kernels: KernelSet = "reference", remat: bool = False):
        super().__init__()
        self.cfg = cfg
        self.embed_scale = math.sqrt(cfg.d_model) if cfg.scale_embeddings else 1.0
        self.src_embed = nn.Embedding(cfg.src_vocab_size, cfg.d_model)
        # With shared embeddings the target side reads src_embed: one parameter, one checkpoint key.
        self.tgt_embed = None if cfg.share_embeddings else nn.Embedding(cfg.tgt_vocab_size, cfg.d_model)
        self.encoder = Encoder(cfg, cfg.num_encoder_layers)
        self.decoder = Decoder(cfg, cfg.num_decoder_layers)
        # Tied output: logits = h Eᵀ with the target embedding E (§3.4); no separate matrix.
        self.out_proj = None if cfg.tie_output else nn.Linear(cfg.d_model, cfg.tgt_vocab_size, bias=False)
        # `output_bias`: a bias on the logits, tied output or not (Marian's final_logits_bias).
        self.logits_bias = nn.Parameter(torch.zeros(cfg.tgt_vocab_size)) if cfg.output_bias else None
        self.reset_parameters()
        set_kernels(self, kernels, remat)

    def reset_parameters(self) -> None:
        """tensor2tensor's: Xavier-uniform matrices, zero biases, unit norm scales, embeddings ~ normal(0, d_model^-0.5)
        (unit variance scaled by sqrt(d_model)); learned position tables ~ normal(0, 0.02), as BERT and GPT-2."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        for embedding in (self.src_embed, self.tgt_embed):
            if embedding is not None:
                nn.init.normal_(embedding.weight, std=self.cfg.d_model**-0.5)
        for stack in (self.encoder, self.decoder):
            if stack.positions.embedding is not None:
                nn.init.normal_(stack.positions.embedding.weight, std=0.02)
        if self.logits_bias is not None:
            nn.init.zeros_(self.logits_bias)

    @property
    def target_embedding(self) -> nn.Embedding:
        return self.src_embed if self.tgt_embed is None else self.tgt_embed

    def encode(self, src_ids: Tensor, src_mask: Tensor | None = None, *, positions: Tensor | None = None) -> Tensor:
        """src_ids (B, S) -> memory (B, S, D); `src_mask` defaults to padding_mask(src_ids), `positions` to 0, 1, ..."""
        if src_mask is None:
            src_mask = padding_mask(src_ids, self.cfg.pad_id)
        return self.encoder(self.src_embed(src_ids) * self.embed_scale, src_mask, positions=positions)

    def decode(
        self, tgt_in_ids: Tensor, memory: Tensor, src_mask: Tensor | None = None, tgt_mask: Tensor | None = None,
        return_attention: bool = False, *, positions: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """tgt_in_ids (B, T), memory (B, S, D) -> (B, T, D) [, cross-attention (B, layers, H, T, S)]; `src_mask`:
        (B, 1, 1, S), packed (B, 1, T, S) or None; `tgt_mask` defaults to target_mask's, `positions` to 0, 1, ..."""
        if tgt_mask is None:
            tgt_mask = target_mask(tgt_in_ids, self.cfg.pad_id, self.cfg.bos_id)
        x = self.target_embedding(tgt_in_ids) * self.embed_scale  # (B, T, D)
        return self.decoder(x, memory, src_mask, tgt_mask, return_attention, positions=positions)

    def init_cache(self, memory: Tensor, max_len: int) -> list[dict[str, Tensor]]:
        """A decoding cache for `max_len` target positions over memory (B, S, D), one dict per layer."""
        return [layer.init_cache(memory, max_len) for layer in self.decoder.layers]

    def decode_step(self, tgt_ids: Tensor, cache: list[dict[str, Tensor]], position: int,
                    src_mask: Tensor | None = None) -> tuple[Tensor, list[dict[str, Tensor]]]:
        """tgt_ids (B,) at `position` -> (logits (B, V), cache): project(decode(prefix))[:, position] via the cache."""
        x = self.target_embedding(tgt_ids[:, None]) * self.embed_scale  # (B, 1, D)
        hidden, cache = self.decoder.step(x, cache, position, src_mask)
        return self.project(hidden)[:, 0], cache

    def project(self, hidden: Tensor) -> Tensor:
        """hidden (B, T, D) -> logits (B, T, V)."""
        if self.out_proj is None:
            logits = F.linear(hidden, self.target_embedding.weight)
        else:
            logits = self.out_proj(hidden)
        return logits if self.logits_bias is None else logits + self.logits_bias.to(logits.dtype)

    def forward(
        self, src_ids: Tensor, tgt_in_ids: Tensor, return_attention: bool = False, *,
        src_segments: Tensor | None = None, tgt_segments: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """src_ids (B, S), tgt_in_ids (B, T) -> logits (B, T, V) [, cross-attention (B, layers, H, T, S)]. Packed rows
        (as google/flax examples/wmt): `src_segments` (B, S), `tgt_segments` (B, T) number a row's pairs 1, 2, ...
        (0: padding); attention stays within a segment, positions restart at each segment's start."""
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
        memory = self.encode(src_ids, src_mask, positions=src_positions)
        decoded = self.decode(tgt_in_ids, memory, cross_mask, tgt_mask, return_attention, positions=tgt_positions)
        return (self.project(decoded[0]), decoded[1]) if return_attention else self.project(decoded)
