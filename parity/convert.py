"""Weights between `torch_reference.Transformer` and `jax_transformer.Transformer`, both ways.

The two models have the same attribute tree, so one table of leaf names is the whole mapping:

    torch                     flax              value
    Linear.weight (out, in)   Linear.kernel     transposed (in, out)
    Linear.bias               Linear.bias       as is
    LayerNorm/RMSNorm.weight  *.scale           as is
    Embedding.weight          Embed.embedding   as is

Keys are the dotted attribute paths on both sides (`encoder.layers.0.self_attn.q_proj.kernel`).
The expected set of keys and shapes comes from the config (an abstract Flax model, no
allocation); any missing, unexpected or wrongly shaped key raises one `CheckpointMismatchError`
listing every offender with both shapes. Values keep their dtype (bf16 included) bit for bit.

Files: PyTorch weights are safetensors (never pickle) with the config in the file's metadata and
in `config.json` beside it; JAX weights are an orbax checkpoint directory holding `params/` and
`config.json`.

CLI:
    python -m parity.convert --to jax --src model.safetensors --dst DIR
    python -m parity.convert --to torch --src DIR --dst model.safetensors
    python -m parity.convert --to torch --run-dir RUN_JAX --dst RUN_TORCH   # a whole training run
                                                  # (parity.checkpoint), then train.run --resume
"""

from __future__ import annotations

import argparse
import functools
import os
import pickle
import sys
from pathlib import Path
from typing import Any, Mapping

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch
from flax import nnx

import jax_transformer
import torch_reference
from torch_reference.config import TransformerConfig

# Flax leaf name -> (torch leaf name, transposed?)
LEAF_RULES = {"kernel": ("weight", True), "scale": ("weight", False), "embedding": ("weight", False), "bias": ("bias", False)}
CONFIG_KEY = "transformer_config"  # safetensors metadata key holding the config JSON


class CheckpointMismatchError(ValueError):
    """Weights that do not fit the architecture: lists every offending key with both shapes."""

    def __init__(self, what: str, missing=(), unexpected=(), wrong_shape=()):
        self.missing, self.unexpected, self.wrong_shape = list(missing), list(unexpected), list(wrong_shape)
        lines = [f"{what} do not match the architecture:"]
        lines += [f"  missing     {k}  expected {tuple(s)}" for k, s in self.missing]
        lines += [f"  unexpected  {k}  got {tuple(s)}" for k, s in self.unexpected]
        lines += [f"  wrong shape {k}  expected {tuple(e)}, got {tuple(g)}" for k, e, g in self.wrong_shape]
        super().__init__("\n".join(lines))


# ---------------------------------------------------------------------------------------------
# Key and value rules
# ---------------------------------------------------------------------------------------------


def jax_key(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def _jax_path(key: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in key.split("."))


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


def _check(what: str, expected: Mapping[str, tuple], got: Mapping[str, tuple]) -> None:
    missing = [(k, expected[k]) for k in expected if k not in got]
    unexpected = [(k, got[k]) for k in got if k not in expected]
    wrong = [(k, expected[k], got[k]) for k in expected if k in got and tuple(got[k]) != tuple(expected[k])]
    if missing or unexpected or wrong:
        raise CheckpointMismatchError(what, missing, unexpected, wrong)


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


# ---------------------------------------------------------------------------------------------
# State dicts <-> flat JAX parameter dicts (keys as dotted Flax paths, values NumPy)
# ---------------------------------------------------------------------------------------------


def torch_state_to_jax(state_dict: Mapping[str, torch.Tensor], cfg: TransformerConfig) -> dict[str, np.ndarray]:
    """A torch state dict -> {flax key: array}, strictly checked against `cfg`."""
    expected = expected_jax_params(cfg)
    torch_expected = {}
    for key, shape in expected.items():
        torch_key, transpose = to_torch_key(key)
        torch_expected[torch_key] = shape[::-1] if transpose else shape
    _check("PyTorch weights", torch_expected, {k: tuple(v.shape) for k, v in state_dict.items()})
    out = {}
    for key in expected:
        torch_key, transpose = to_torch_key(key)
        value = torch_to_numpy(state_dict[torch_key])
        out[key] = np.ascontiguousarray(value.T) if transpose else value
    return out


def jax_params_to_torch(params: Mapping[str, Any], cfg: TransformerConfig) -> dict[str, torch.Tensor]:
    """{flax key: array} -> a torch state dict, strictly checked against `cfg`."""
    _check("JAX weights", expected_jax_params(cfg), {k: tuple(np.shape(v)) for k, v in params.items()})
    out = {}
    for key, value in params.items():
        torch_key, transpose = to_torch_key(key)
        value = np.asarray(value)
        out[torch_key] = numpy_to_torch(np.ascontiguousarray(value.T) if transpose else value)
    return out


def jax_params(model: nnx.Module) -> dict[str, np.ndarray]:
    """{flax key: NumPy array} of a Flax model's parameters."""
    return {jax_key(path): np.asarray(v[...]) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _nest(flat: Mapping[str, Any]) -> dict:
    tree: dict = {}
    for key, value in flat.items():
        *parents, leaf = _jax_path(key)
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def jax_model_from_params(params: Mapping[str, Any], cfg: TransformerConfig) -> jax_transformer.Transformer:
    """A Flax Transformer for `cfg` holding `params` (checked strictly; dtypes kept)."""
    _check("JAX weights", expected_jax_params(cfg), {k: tuple(np.shape(v)) for k, v in params.items()})
    abstract = nnx.eval_shape(lambda: jax_transformer.Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    nnx.replace_by_pure_dict(state, _nest({k: jnp.asarray(v) for k, v in params.items()}))
    return nnx.merge(graphdef, state)


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


def torch_to_jax(
    model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor], cfg: TransformerConfig | None = None
) -> jax_transformer.Transformer:
    """A Flax Transformer with the weights of a torch Transformer (or its state dict + `cfg`)."""
    if isinstance(model_or_state_dict, torch.nn.Module):
        cfg = cfg or model_or_state_dict.cfg
        state_dict = model_or_state_dict.state_dict()
    else:
        state_dict = model_or_state_dict
    if cfg is None:
        raise ValueError("torch_to_jax needs `cfg` when given a state dict")
    return jax_model_from_params(torch_state_to_jax(state_dict, cfg), cfg)


def jax_to_torch(model: nnx.Module, cfg: TransformerConfig | None = None) -> torch_reference.Transformer:
    """A torch Transformer with the weights of a Flax Transformer (dtypes kept, e.g. bf16)."""
    cfg = cfg or model.cfg
    torch_model = torch_reference.Transformer(cfg)
    # assign=True adopts the converted tensors themselves, so their dtype survives.
    torch_model.load_state_dict(jax_params_to_torch(jax_params(model), cfg), strict=True, assign=True)
    return torch_model


# ---------------------------------------------------------------------------------------------
# Adam optimizer state: torch.optim.Adam (step, exp_avg, exp_avg_sq per parameter index) <->
# optax's ScaleByAdamState (count, mu, nu as parameter-shaped trees). The moments are
# parameter-shaped, so they follow the weights' rules (kernels transposed) and strict checks.
# ---------------------------------------------------------------------------------------------


def torch_adam_to_jax(optimizer_state: Mapping, param_names: list[str], cfg: TransformerConfig) -> dict:
    """A `torch.optim.Adam.state_dict()` -> {"count": int, "mu": {flax key: array}, "nu": {...}}.

    `param_names` names the optimizer's parameters in order (`[n for n, _ in model.named_parameters()]`).
    """
    state = optimizer_state["state"]
    indices = [i for group in optimizer_state["param_groups"] for i in group["params"]]
    if len(indices) != len(param_names):
        raise CheckpointMismatchError(
            "Adam state", missing=[(f"{len(param_names)} parameters", ())], unexpected=[(f"{len(indices)} in the optimizer", ())]
        )
    names = dict(zip(indices, param_names))
    if not state:  # no step taken yet: zero moments, count 0
        return {"count": 0, "mu": None, "nu": None}
    steps = {int(state[i]["step"]) for i in indices if i in state}
    if len(steps) != 1 or len(state) != len(indices):
        raise ValueError(f"Adam state is not from whole steps: step counts {sorted(steps)} over {len(state)}/{len(indices)} parameters")
    exp_avg = {names[i]: state[i]["exp_avg"] for i in indices}
    exp_avg_sq = {names[i]: state[i]["exp_avg_sq"] for i in indices}
    return {"count": steps.pop(), "mu": torch_state_to_jax(exp_avg, cfg), "nu": torch_state_to_jax(exp_avg_sq, cfg)}


def jax_adam_to_torch(adam: Mapping, param_names: list[str], cfg: TransformerConfig, param_groups: list[dict]) -> dict:
    """{"count", "mu", "nu"} (flax keys) -> a state dict for `torch.optim.Adam.load_state_dict`.

    `param_groups` are the target optimizer's own (`optimizer.state_dict()["param_groups"]`), whose
    hyper-parameters are kept; the parameter indices follow `param_names`.
    """
    if adam["count"] == 0 or adam["mu"] is None:
        return {"state": {}, "param_groups": param_groups}
    exp_avg, exp_avg_sq = jax_params_to_torch(adam["mu"], cfg), jax_params_to_torch(adam["nu"], cfg)
    indices = [i for group in param_groups for i in group["params"]]
    step = torch.tensor(float(adam["count"]))  # torch keeps the step as a float32 tensor
    state = {
        i: {"step": step.clone(), "exp_avg": exp_avg[name], "exp_avg_sq": exp_avg_sq[name]}
        for i, name in zip(indices, param_names, strict=True)
    }
    return {"state": state, "param_groups": param_groups}


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_torch_weights(model: torch_reference.Transformer, path: str | os.PathLike) -> Path:
    """`path` (.safetensors) with the config in its metadata, plus `config.json` beside it."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state_dict = {k: v.contiguous() for k, v in model.state_dict().items()}
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(state_dict, str(tmp), metadata={CONFIG_KEY: model.cfg.to_json()})
    os.replace(tmp, path)
    _write_text_atomic(path.parent / "config.json", model.cfg.to_json())
    return path


LEGACY_SUFFIXES = (".pt", ".pth", ".bin")  # torch.save files: read with weights_only=True


def load_torch_weights(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], TransformerConfig]:
    """(state dict, config) from a safetensors file, or from a legacy `torch.save` state dict
    (.pt, .pth, .bin) with config.json beside it. Legacy files are read with
    `torch.load(weights_only=True)`, whose unpickler admits tensors and containers only, so no
    code in a file ever runs; a pickle named .safetensors is not a safetensors file and is refused."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no weights file at {path}")
    metadata = {}
    if path.suffix not in LEGACY_SUFFIXES:
        try:
            with safe_open(str(path), framework="pt") as f:
                metadata = f.metadata() or {}
        except SafetensorError as err:
            raise ValueError(f"{path} is not a readable safetensors file ({err})") from None
    if CONFIG_KEY in metadata:
        cfg = TransformerConfig.from_json(metadata[CONFIG_KEY])
    elif (path.parent / "config.json").is_file():
        cfg = TransformerConfig.from_json((path.parent / "config.json").read_text())
    else:
        raise FileNotFoundError(f"{path} carries no config and there is no config.json beside it")
    if path.suffix not in LEGACY_SUFFIXES:
        return load_file(str(path)), cfg
    try:
        state_dict = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        reason = str(err).strip().splitlines()[0]
        raise ValueError(f"{path} was refused by torch.load(weights_only=True), which loads no code: {reason}") from None
    if not isinstance(state_dict, Mapping) or not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
        raise ValueError(f"{path} holds no state dict of tensors")
    return dict(state_dict), cfg


def save_jax_weights(model: nnx.Module, directory: str | os.PathLike, overwrite: bool = False) -> Path:
    """An orbax checkpoint of the parameters in `directory/params` plus `directory/config.json`."""
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()  # orbax wants absolute paths
    directory.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(directory / "params", _nest(jax_params(model)), force=overwrite)
    _write_text_atomic(directory / "config.json", model.cfg.to_json())
    return directory


def _flatten(tree: Mapping, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        flat.update(_flatten(v, key + ".") if isinstance(v, Mapping) else {key: v})
    return flat


def load_jax_weights(directory: str | os.PathLike) -> jax_transformer.Transformer:
    """The Flax Transformer saved by `save_jax_weights` (checked strictly against its config)."""
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    if not (directory / "config.json").is_file() or not (directory / "params").is_dir():
        raise FileNotFoundError(f"{directory} is not a JAX weights directory (expected params/ and config.json)")
    cfg = TransformerConfig.from_json((directory / "config.json").read_text())
    with ocp.StandardCheckpointer() as checkpointer:
        tree = checkpointer.restore(directory / "params")
    return jax_model_from_params(_flatten(tree), cfg)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m parity.convert",
        description="Convert Transformer weights between the PyTorch reference (safetensors) and the "
        "Flax mirror (orbax checkpoint directory). The config travels with the weights; every key and "
        "shape is checked strictly. With --run-dir: convert a whole training run of `train.run` (weights, "
        "Adam moments, step and schedule position, data position, tokenizer, config) to the other "
        "backend, so that `python -m train.run --run-dir DST --resume` continues it there.",
        epilog="examples:\n  python -m parity.convert --to jax --src model.safetensors --dst jax_ckpt/\n"
        "  python -m parity.convert --to torch --src jax_ckpt/ --dst model.safetensors\n"
        "  python -m parity.convert --to torch --run-dir runs/jax-numbers --dst runs/torch-numbers\n"
        "  python -m train.run --run-dir runs/torch-numbers --resume --steps 1600",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--to", required=True, choices=["jax", "torch"], help="target framework")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--src", help="weights only: a .safetensors file (--to jax; a legacy torch.save state dict "
                        ".pt/.pth/.bin with config.json beside it is read with weights_only=True) or a JAX weights "
                        "directory (--to torch)")
    source.add_argument("--run-dir", help="a whole training run directory of the other backend (train.run --run-dir)")
    parser.add_argument("--dst", required=True, help="a JAX weights directory (--to jax) or a .safetensors file "
                        "(--to torch); with --run-dir the new run directory")
    parser.add_argument("--checkpoint", help="with --run-dir: which checkpoints to convert: latest (default), best, "
                        "all, or a step number")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing destination")
    args = parser.parse_args(argv)

    dst = Path(args.dst)
    if dst.exists() and not args.overwrite:
        parser.exit(2, f"error: {dst} exists; pass --overwrite to replace it\n")
    if args.run_dir is not None:
        return _convert_run_cli(parser, args)
    if args.checkpoint is not None:
        parser.error("--checkpoint goes with --run-dir")
    try:
        if args.to == "jax":
            state_dict, cfg = load_torch_weights(args.src)
            save_jax_weights(torch_to_jax(state_dict, cfg), dst, overwrite=args.overwrite)
        else:
            save_torch_weights(jax_to_torch(load_jax_weights(args.src)), dst)
    except (FileNotFoundError, ValueError) as err:
        parser.exit(1, f"error: {err}\n")
    print(f"wrote {dst}")
    return 0


def _convert_run_cli(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from .checkpoint import convert_run

    which = args.checkpoint or "latest"
    if which not in ("latest", "best", "all") and not which.isdigit():
        parser.error(f"--checkpoint takes latest, best, all or a step number, got {which!r}")
    try:
        done = convert_run(args.run_dir, args.dst, to=args.to, which=which, overwrite=args.overwrite)
    except FileExistsError as err:
        parser.exit(2, f"error: {err}\n")
    except (FileNotFoundError, ValueError) as err:
        parser.exit(1, f"error: {err}\n")
    steps = ", ".join(map(str, done["steps"]))
    print(f"wrote {done['run_dir']}: the {done['backend']} run of {done['from']} (checkpoint step {steps})")
    print(f"continue it with: python -m train.run --run-dir {done['run_dir']} --resume")
    return 0


if __name__ == "__main__":
    sys.exit(main())
