"""The PyTorch reference, the specification; `TransformerConfig` imports without torch."""

from .config import TransformerConfig

_MODEL_NAMES = (
    "Transformer", "Encoder", "Decoder", "EncoderLayer", "DecoderLayer", "MultiHeadAttention",
    "FeedForward", "PositionalEncoding", "scaled_dot_product_attention", "sinusoidal_positions",
    "padding_mask", "causal_mask", "target_mask", "shift_right", "KERNELS", "fused_attention", "set_kernels",
)

__all__ = ["TransformerConfig", *_MODEL_NAMES]


def __getattr__(name):
    # Lazy (PEP 562) so that `from torch_reference.config import TransformerConfig` stays torch-free.
    if name in _MODEL_NAMES:
        from . import model

        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
