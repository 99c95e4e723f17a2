"""Weights between the twins, both ways, by `LEAF_RULES`, checked strictly, bit for bit (docs/interop.md)."""

from __future__ import annotations

import functools
import pickle
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch
from flax import nnx, traverse_util
from safetensors import SafetensorError
from safetensors.torch import load_file

import jax_transformer
import torch_reference
from torch_reference.config import TransformerConfig

from ..checkpoints import CheckpointMismatchError, TrainingState, check_keys  # noqa: F401 (re-exported)

# Flax leaf name -> (torch leaf name, transposed?)
LEAF_RULES = {
    "kernel": ("weight", True), "scale": ("weight", False), "embedding": ("weight", False), "bias": ("bias", False),
    "logits_bias": ("logits_bias", False),  # Transformer.logits_bias (V,), a parameter of its own on both sides
}
FRAMEWORKS = ("jax", "torch")


def jax_key(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def to_torch_key(key: str) -> tuple[str, bool]:
    """`a.b.kernel` -> (`a.b.weight`, True): the torch key and whether the value is transposed."""
    *prefix, leaf = key.split(".")
    torch_leaf, transpose = LEAF_RULES[leaf]
    return ".".join([*prefix, torch_leaf]), transpose


@functools.lru_cache(maxsize=32)
def expected_jax_params(cfg: TransformerConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter key of the Flax model for `cfg` with its shape, without allocating it."""
    abstract = nnx.eval_shape(lambda: jax_transformer.Transformer(cfg, rngs=nnx.Rngs(0)))
    return {jax_key(path): tuple(v.shape) for path, v in nnx.to_flat_state(nnx.state(abstract, nnx.Param))}


def _shapes(flat: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(np.shape(v)) for k, v in flat.items()}


def torch_to_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU copy of `t` as NumPy, bf16 as `ml_dtypes.bfloat16` (bit-exact; NumPy has no bf16)."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
    return t.numpy().copy()


def numpy_to_torch(a: Any) -> torch.Tensor:
    a = np.asarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.array(a, copy=True))


def _moved(value: Any, transpose: bool) -> np.ndarray:
    value = np.asarray(value)
    return np.ascontiguousarray(value.T) if transpose else value.copy()


def to_jax_layout(flat: Mapping[str, Any], cfg: TransformerConfig, what: str = "PyTorch weights") -> dict[str, np.ndarray]:
    """{torch key: array} -> {flax key: array} of weights or Adam's moments, strictly checked against `cfg`."""
    expected = expected_jax_params(cfg)
    rules = {key: to_torch_key(key) for key in expected}  # flax key -> (torch key, transposed?)
    torch_expected = {torch_key: expected[key][::-1] if transpose else expected[key]
                      for key, (torch_key, transpose) in rules.items()}
    check_keys(what, torch_expected, _shapes(flat))
    return {key: _moved(flat[torch_key], transpose) for key, (torch_key, transpose) in rules.items()}


def to_torch_layout(flat: Mapping[str, Any], cfg: TransformerConfig, what: str = "JAX weights") -> dict[str, np.ndarray]:
    """{flax key: NumPy array} -> {torch key: array}, strictly checked against `cfg`."""
    check_keys(what, expected_jax_params(cfg), _shapes(flat))
    rules = {key: to_torch_key(key) for key in flat}  # flax key -> (torch key, transposed?)
    return {torch_key: _moved(flat[key], transpose) for key, (torch_key, transpose) in rules.items()}


def jax_params_to_torch(params: Mapping[str, Any], cfg: TransformerConfig) -> dict[str, torch.Tensor]:
    """{flax key: array} -> a torch state dict, strictly checked against `cfg`."""
    return {k: numpy_to_torch(v) for k, v in to_torch_layout(params, cfg).items()}


def jax_params(model: nnx.Module) -> dict[str, np.ndarray]:
    """{flax key: NumPy array} of a Flax model's parameters."""
    return {jax_key(path): np.asarray(v[...]) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def nest(flat: Mapping[str, Any]) -> dict:
    """{"a.0.b": v} -> {"a": {0: {"b": v}}}, layer indices as ints (nnx's pure dicts)."""
    return traverse_util.unflatten_dict({tuple(int(p) if p.isdigit() else p for p in key.split(".")): value
                                         for key, value in flat.items()})


def jax_model_from_params(params: Mapping[str, Any], cfg: TransformerConfig) -> jax_transformer.Transformer:
    """A Flax Transformer for `cfg` holding `params` (checked strictly; dtypes kept)."""
    check_keys("JAX weights", expected_jax_params(cfg), _shapes(params))
    graphdef, state = nnx.split(nnx.eval_shape(lambda: jax_transformer.Transformer(cfg, rngs=nnx.Rngs(0))))
    nnx.replace_by_pure_dict(state, nest({k: jnp.asarray(v) for k, v in params.items()}))
    return nnx.merge(graphdef, state)


def torch_to_jax(model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor],
                 cfg: TransformerConfig | None = None) -> jax_transformer.Transformer:
    """A Flax Transformer with the weights of a torch Transformer (or its state dict + `cfg`)."""
    state_dict = model_or_state_dict
    if isinstance(model_or_state_dict, torch.nn.Module):
        cfg, state_dict = cfg or model_or_state_dict.cfg, model_or_state_dict.state_dict()
    if cfg is None:
        raise ValueError("torch_to_jax needs `cfg` when given a state dict")
    return jax_model_from_params(to_jax_layout({k: torch_to_numpy(v) for k, v in state_dict.items()}, cfg), cfg)


def jax_to_torch(model: nnx.Module, cfg: TransformerConfig | None = None) -> torch_reference.Transformer:
    """A torch Transformer with the weights of a Flax Transformer (dtypes kept, e.g. bf16)."""
    cfg = cfg or model.cfg
    torch_model = torch_reference.Transformer(cfg)
    # assign=True adopts the converted tensors themselves, so their dtype survives.
    torch_model.load_state_dict(jax_params_to_torch(jax_params(model), cfg), strict=True, assign=True)
    return torch_model


def convert_state(state: TrainingState, to: str, cfg: TransformerConfig) -> TrainingState:
    """A training state in the `to` framework's layout, checked against `cfg`; the random state stays behind."""
    if to == state.framework:
        return state
    layout = to_jax_layout if to == "jax" else to_torch_layout
    names = ("weights", "Adam first moments (mu / exp_avg)", "Adam second moments (nu / exp_avg_sq)")
    params, mu, nu = (None if tree is None else layout(tree, cfg, f"{state.framework} {what}")
                      for tree, what in zip((state.params, state.mu, state.nu), names))
    return TrainingState(to, state.step, params, mu, nu, rng=None)


def transfer_state(source, target) -> None:
    """Give backend `target` the whole training state of backend `source` (of either framework)."""
    target.import_state(convert_state(source.export_state(), target.name, target.model_cfg))


LEGACY_SUFFIXES = (".pt", ".pth", ".bin")  # torch.save files: read with weights_only=True


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, or of a legacy `torch.save` file read with weights_only=True."""
    if path.suffix not in LEGACY_SUFFIXES:
        try:
            return load_file(str(path))
        except (SafetensorError, OSError) as err:  # truncated, garbled
            raise ValueError(f"{path} is not a readable safetensors file ({err})") from None
    try:
        state_dict = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        reason = re.sub(r"\x1b\[[0-9;]*m", "", str(err)).strip().splitlines()[0]  # torch colours it
        raise ValueError(f"{path} was refused by torch.load(weights_only=True), which loads no code: {reason}") from None
    if not isinstance(state_dict, Mapping) or not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
        raise ValueError(f"{path} holds no state dict of tensors")
    return dict(state_dict)
