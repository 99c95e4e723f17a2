"""A trained run as StableHLO (`aiayn convert --to stablehlo`): the Flax twin's encoder and one cached decoder step
as `jax.export` programs with symbolic batch and length dimensions, the weights their first argument (weights.npz
beside them); `jax.export.deserialize` alone runs them (train/interop/exported.py, docs/interop.md#deploying)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import export

from torch_reference.config import TransformerConfig
from train.interop.exported import STABLEHLO_FILES
from train.interop.weights import jax_model_from_params, to_jax_layout


def write_stablehlo(params: Mapping[str, np.ndarray], cfg: TransformerConfig, directory: Path) -> None:
    """The two programs of `params` (our torch layout) and their weights into `directory`."""
    model = jax_model_from_params(to_jax_layout({k: np.asarray(v, np.float32) for k, v in params.items()}, cfg), cfg)
    graph, state = nnx.split(model)
    leaves, tree = jax.tree.flatten(state)

    def merged(weights):
        return nnx.merge(graph, jax.tree.unflatten(tree, weights))

    def encode(weights, ids, mask):  # -> each decoder layer's cross-attention keys and values (B, H, S, K)
        m = merged(weights)
        memory = m.encode(ids, (mask != 0)[:, None, None, :])
        return [a for layer in m.decoder.layers for a in layer.cross_attn.project_kv(memory)]

    def step(weights, last, selfs, crosses, position, mask):  # the model's own decode_step over a fixed cache
        cache = [{"self_k": k, "self_v": v, "cross_k": ck, "cross_v": cv}
                 for k, v, ck, cv in zip(selfs[::2], selfs[1::2], crosses[::2], crosses[1::2])]
        logits, cache = merged(weights).decode_step(last, cache, position, (mask != 0)[:, None, None, :])
        return logits, [a for c in cache for a in (c["self_k"], c["self_v"])]

    # Lengths up to max_len: the position table's bound, which the model checks on every input.
    bound = (f"s <= {cfg.max_len}", f"t <= {cfg.max_len}")
    b, s = export.symbolic_shape("b, s", constraints=bound[:1])
    n, ns, t = export.symbolic_shape("b, s, t", constraints=bound)  # a scope of its own: t is no encoder dimension
    H, K, layers = cfg.num_heads, cfg.d_model // cfg.num_heads, cfg.num_decoder_layers
    spec = jax.ShapeDtypeStruct
    weights = [spec(x.shape, x.dtype) for x in leaves]
    ids = spec((b, s), jnp.int32)
    programs = [
        export.export(jax.jit(encode))(weights, ids, ids),
        export.export(jax.jit(step))(weights, spec((n,), jnp.int32), [spec((n, H, t, K), jnp.float32)] * 2 * layers,
                                     [spec((n, H, ns, K), jnp.float32)] * 2 * layers, spec((), jnp.int32),
                                     spec((n, ns), jnp.int32)),
    ]
    for name, program in zip(STABLEHLO_FILES, programs):
        (directory / name).write_bytes(program.serialize())
    np.savez(directory / STABLEHLO_FILES[2], **{f"w{i}": np.asarray(x) for i, x in enumerate(leaves)})

