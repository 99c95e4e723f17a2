"""Proofs, comparisons, benchmarks and the conversion commands between the twins (conversions: `train.interop`)."""

__all__ = ["CheckpointMismatchError", "jax_to_torch", "torch_to_jax"]


def __getattr__(name):
    # Lazy (PEP 562): importing parity loads no framework.
    if name in __all__:
        from train.interop import weights

        return getattr(weights, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
