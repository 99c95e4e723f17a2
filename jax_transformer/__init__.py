"""The Flax NNX mirror of `torch_reference`: same classes, same parameter names, jit-compiled."""

from torch_reference.config import TransformerConfig

from .model import (KERNELS, Decoder, DecoderLayer, Encoder, EncoderLayer, FeedForward, MultiHeadAttention,
                    PositionalEncoding, Transformer, causal_mask, fused_attention, padding_mask,
                    scaled_dot_product_attention, set_kernels, shift_right, sinusoidal_positions, target_mask)

__all__ = [
    "TransformerConfig", "Transformer", "Encoder", "Decoder", "EncoderLayer", "DecoderLayer",
    "MultiHeadAttention", "FeedForward", "PositionalEncoding", "scaled_dot_product_attention",
    "sinusoidal_positions", "padding_mask", "causal_mask", "target_mask", "shift_right", "KERNELS",
    "fused_attention", "set_kernels",
]
