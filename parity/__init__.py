"""The bridge between the PyTorch reference and the Flax mirror: weight conversion and checks."""

__all__ = ["CheckpointMismatchError", "jax_to_torch", "torch_to_jax"]


def __getattr__(name):
    # Lazy (PEP 562): `python -m parity.convert` must not find parity.convert already imported.
    if name in __all__:
        from . import convert

        return getattr(convert, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
