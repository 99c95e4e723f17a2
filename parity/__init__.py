"""The bridge between the PyTorch reference and the Flax mirror: weight conversion and checks."""

from .convert import CheckpointMismatchError, jax_to_torch, torch_to_jax

__all__ = ["CheckpointMismatchError", "jax_to_torch", "torch_to_jax"]
