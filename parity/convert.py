"""Weights between `torch_reference.Transformer` and `jax_transformer.Transformer`, both ways.

The two models have the same attribute tree, so one table of leaf names is the whole mapping:

    torch                     flax              value
    Linear.weight (out, in)   Linear.kernel     transposed (in, out)
    Linear.bias               Linear.bias       as is
    LayerNorm/RMSNorm.weight  *.scale           as is
    Embedding.weight          Embed.embedding   as is
    logits_bias               logits_bias       as is (the output_bias variant)

Keys are the dotted attribute paths on both sides (`encoder.layers.0.self_attn.q_proj.kernel`).
The expected set of keys and shapes comes from the config (an abstract Flax model, no
allocation); any missing, unexpected or wrongly shaped key raises one `CheckpointMismatchError`
listing every offender with both shapes. Values keep their dtype (bf16 included) bit for bit.

Files: PyTorch weights are safetensors (never pickle) with the config in the file's metadata
(nothing else is written beside it; a `config.json` beside a legacy file is read); JAX weights are an orbax checkpoint directory holding `params/` and
`config.json`.

Training runs: a backend of `train` exports its whole training state (`train.backends.TrainingState`:
weights, Adam's two moments and the update count, NumPy arrays keyed by its own attribute paths);
`convert_state` maps those leaves with the same rules (Adam's moments are parameter-shaped), and
the other backend imports it and saves it as its own checkpoint. `convert_run` does that for the
checkpoints of a run directory, with their meta (data position, validation scores) and ranking
metrics, so `python -m train.run --resume` continues in the other framework as if it had never
changed. Not carried: dropout randomness (its streams differ between frameworks): a JAX run
derives its keys from the seed and the step, a torch run keeps the generator it was seeded with.

Other formats (parity.marian, parity.ctranslate2; the `interop` extra):
a local HF Marian directory (OPUS-MT) becomes a run directory, a run imported from Marian goes back
to an HF directory, and any run becomes a CTranslate2 model.

CLI:
    python -m parity.convert --to jax --src model.safetensors --dst DIR
    python -m parity.convert --to torch --src DIR --dst model.safetensors
    python -m parity.convert --to torch --run-dir RUN_JAX --dst RUN_TORCH   # then train.run --resume
    python -m parity.convert --from marian --src HF_MODEL_DIR --to jax --dst RUN_DIR
    python -m parity.convert --to marian --src RUN_DIR --dst HF_MODEL_DIR
    python -m parity.convert --to ctranslate2 --src RUN_DIR --dst CT2_DIR [--quantization int8]
"""

from __future__ import annotations

import argparse
import functools
import os
import pickle
import re
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch
from flax import nnx

import jax_transformer
import torch_reference
from torch_reference.config import TransformerConfig
from train import files, rundir, store
from train.backends import create_backend
from train.config import ExperimentConfig
from train.store import CheckpointError, CheckpointMismatchError, TrainingState, check_keys  # noqa: F401 (re-exported)

from . import ctranslate2 as ct2_export
from . import marian

# Flax leaf name -> (torch leaf name, transposed?)
LEAF_RULES = {
    "kernel": ("weight", True), "scale": ("weight", False), "embedding": ("weight", False), "bias": ("bias", False),
    "logits_bias": ("logits_bias", False),  # Transformer.logits_bias (V,), a parameter of its own on both sides
}
CONFIG_KEY = store.WEIGHTS_CONFIG_KEY  # safetensors metadata key holding the config JSON
FRAMEWORKS = ("jax", "torch")


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


# ---------------------------------------------------------------------------------------------
# State dicts <-> flat JAX parameter dicts (keys as dotted Flax paths, values NumPy)
# ---------------------------------------------------------------------------------------------


def to_jax_layout(flat: Mapping[str, Any], cfg: TransformerConfig, what: str = "PyTorch weights") -> dict[str, np.ndarray]:
    """{torch key: NumPy array} -> {flax key: array}, strictly checked against `cfg` (a parameter-
    shaped tree: weights or Adam's moments)."""
    expected = expected_jax_params(cfg)
    torch_expected = {}
    for key, shape in expected.items():
        torch_key, transpose = to_torch_key(key)
        torch_expected[torch_key] = shape[::-1] if transpose else shape
    check_keys(what, torch_expected, _shapes(flat))
    out = {}
    for key in expected:
        torch_key, transpose = to_torch_key(key)
        value = np.asarray(flat[torch_key])
        out[key] = np.ascontiguousarray(value.T) if transpose else value.copy()
    return out


def to_torch_layout(flat: Mapping[str, Any], cfg: TransformerConfig, what: str = "JAX weights") -> dict[str, np.ndarray]:
    """{flax key: NumPy array} -> {torch key: array}, strictly checked against `cfg`."""
    check_keys(what, expected_jax_params(cfg), _shapes(flat))
    out = {}
    for key, value in flat.items():
        torch_key, transpose = to_torch_key(key)
        value = np.asarray(value)
        out[torch_key] = np.ascontiguousarray(value.T) if transpose else value.copy()
    return out


def torch_state_to_jax(state_dict: Mapping[str, torch.Tensor], cfg: TransformerConfig) -> dict[str, np.ndarray]:
    """A torch state dict -> {flax key: array}, strictly checked against `cfg`."""
    return to_jax_layout({k: torch_to_numpy(v) for k, v in state_dict.items()}, cfg)


def jax_params_to_torch(params: Mapping[str, Any], cfg: TransformerConfig) -> dict[str, torch.Tensor]:
    """{flax key: array} -> a torch state dict, strictly checked against `cfg`."""
    return {k: numpy_to_torch(v) for k, v in to_torch_layout(params, cfg).items()}


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
    check_keys("JAX weights", expected_jax_params(cfg), _shapes(params))
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
# Training states and run directories
# ---------------------------------------------------------------------------------------------


def convert_state(state: TrainingState, to: str, cfg: TransformerConfig) -> TrainingState:
    """A backend's training state in the `to` framework's layout: weights and both Adam moments by
    the leaf rules (strictly checked against `cfg`), the step as it is. The random state stays
    behind (None) when the framework changes: dropout streams cannot be matched."""
    if to == state.framework:
        return state
    if to not in FRAMEWORKS:
        raise ValueError(f"no framework {to!r}; choose from {', '.join(FRAMEWORKS)}")
    layout = to_jax_layout if to == "jax" else to_torch_layout
    names = ("weights", "Adam first moments (mu / exp_avg)", "Adam second moments (nu / exp_avg_sq)")
    params, mu, nu = (None if tree is None else layout(tree, cfg, f"{state.framework} {what}")
                      for tree, what in zip((state.params, state.mu, state.nu), names))
    return TrainingState(to, state.step, params, mu, nu, rng=None)


def transfer_state(source, target) -> None:
    """Give backend `target` the whole training state of backend `source` (of either framework)."""
    target.import_state(convert_state(source.export_state(), target.name, target.model_cfg))


def convert_checkpoints(
    src_cfg: ExperimentConfig, model_cfg: TransformerConfig, src_dir: str | os.PathLike, dst_dir: str | os.PathLike,
    to: str, which: str | int = "latest",
) -> list[int]:
    """Convert the checkpoints `which` ("latest", "best", "all" or a step) of the `src_cfg.backend`
    backend in `src_dir` into the `to` backend's checkpoints in `dst_dir`; returns the steps.

    Each is restored by the source backend, exported, converted, imported by the target backend
    and saved by it with the same meta (the experiment's backend switched) and ranking metrics.
    """
    if to == src_cfg.backend:
        raise ValueError(f"the checkpoints already belong to the {to} backend")
    source = create_backend(src_cfg, model_cfg, str(src_dir))
    target = create_backend(src_cfg.replace(backend=to), model_cfg, str(dst_dir))
    try:
        available = source.checkpoint_steps()
        if not available:
            raise FileNotFoundError("the run has no checkpoint to convert")
        steps = available if which == "all" else [
            store.choose_checkpoint(available, which, source.checkpoint_metrics, src_dir)
        ]
        for step in steps:
            meta = source.restore(step)
            transfer_state(source, target)
            if isinstance(meta.get("config"), Mapping):
                meta = {**meta, "config": {**meta["config"], "backend": to}}
            target.save(meta, source.checkpoint_metrics(step))
    finally:
        source.close()
        target.close()
    return steps


def convert_run(
    src: str | os.PathLike, dst: str | os.PathLike, to: str | None = None, which: str | int = "latest",
    overwrite: bool = False,
) -> dict:
    """A run directory of one backend (train.run) -> the same run for the other backend.

    `dst` receives config.json (the backend switched), model.json, the tokenizer files (byte
    copies), the TensorBoard events, and the checkpoints `which` ("latest", "best", "all" or a
    step) converted. It is built beside `dst` and renamed into place, so an interrupted
    conversion leaves nothing. `python -m train.run --run-dir DST --resume` continues it.
    """
    src, dst = Path(src), Path(dst)
    try:
        src_cfg, model_cfg = rundir.read_experiment(src), rundir.read_model_config(src)
    except files.UserError as err:
        raise FileNotFoundError(str(err)) from None
    to = to or ("torch" if src_cfg.backend == "jax" else "jax")
    if to == src_cfg.backend:
        raise ValueError(f"{src} is already a {to} run")
    tokenizers = rundir.load_tokenizers(src)
    rebuilt = src_cfg.model_config(tokenizers.src.get_vocab_size(), tokenizers.tgt.get_vocab_size())
    if rebuilt != model_cfg:  # --resume rebuilds the model from config.json and the tokenizer
        raise ValueError(
            f"{src}: {rundir.MODEL_FILE} does not match config.json and the tokenizer:\n  {model_cfg}\n  {rebuilt}"
        )
    if dst.resolve() == src.resolve():
        raise ValueError("--dst must differ from the source run directory")
    rundir.check_destination(dst, overwrite)
    with rundir.building(dst, "converting") as tmp:
        steps = convert_checkpoints(src_cfg, model_cfg, src / rundir.CHECKPOINTS, tmp / rundir.CHECKPOINTS, to, which)
        for name in (*rundir.tokenizer_files(src), rundir.MODEL_FILE, rundir.IMPORTED_FILE):
            if (src / name).is_file():
                shutil.copyfile(src / name, tmp / name)
        if (src / rundir.TENSORBOARD).is_dir():
            shutil.copytree(src / rundir.TENSORBOARD, tmp / rundir.TENSORBOARD)
        provenance = {"from": str(src), "from_backend": src_cfg.backend, "to_backend": to, "steps": steps}
        files.write_json_atomic(tmp / rundir.PROVENANCE_FILE, provenance)
        files.write_json_atomic(tmp / rundir.CONFIG_FILE, src_cfg.replace(backend=to).experiment())
    return {"run_dir": str(dst), "backend": to, "from": str(src), "steps": steps}


def run_weights(run_dir: str | os.PathLike, checkpoint: str | int = "best") -> tuple[dict[str, np.ndarray], TransformerConfig]:
    """(weights in torch's layout as NumPy, config) of a run's checkpoint, whichever backend wrote it."""
    run = rundir.open_run(run_dir, checkpoint)
    try:
        state = convert_state(run.backend.export_state(), "torch", run.model_config)
    finally:
        run.backend.close()
    return state.params, run.model_config


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------


def save_torch_weights(model: torch_reference.Transformer, path: str | os.PathLike) -> Path:
    """`path` (.safetensors) with the config in its metadata; no other file is written (a
    `config.json` beside it may be the user's). Written whole: a temporary file, removed on any
    error, then a rename."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state_dict = {k: v.contiguous() for k, v in model.state_dict().items()}
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        save_file(state_dict, str(tmp), metadata={CONFIG_KEY: model.cfg.to_json()})
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
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
        reason = re.sub(r"\x1b\[[0-9;]*m", "", str(err)).strip().splitlines()[0]  # torch colours it
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
    files.write_text_atomic(directory / "config.json", model.cfg.to_json())
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


def build_parser() -> argparse.ArgumentParser:
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
    parser.add_argument("--to", required=True, choices=["jax", "torch", "marian", "ctranslate2"],
                        help="target: a framework (jax, torch), an HF Marian directory (marian: a run imported with "
                        "--from marian) or a CTranslate2 model directory (ctranslate2)")
    parser.add_argument("--from", dest="source_format", choices=["marian"],
                        help="import a pretrained model: --src is a local HF Marian directory (config.json, "
                        "model.safetensors or pytorch_model.bin, source.spm, target.spm, vocab.json); --dst the run "
                        "directory of the --to backend, which train.translate, train.evaluate and train.run --resume "
                        "(fine-tuning) accept")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--src", help="weights only: a .safetensors file (--to jax; a legacy torch.save state dict "
                        ".pt/.pth/.bin with config.json beside it is read with weights_only=True) or a JAX weights "
                        "directory (--to torch); with --from marian the HF directory; with --to marian or "
                        "ctranslate2 a run directory")
    source.add_argument("--run-dir", help="a whole training run directory of the other backend (train.run --run-dir)")
    parser.add_argument("--dst", required=True, help="a JAX weights directory (--to jax) or a .safetensors file "
                        "(--to torch); with --run-dir or --from the new run directory; with --to marian or "
                        "ctranslate2 the model directory")
    parser.add_argument("--checkpoint", help="with --run-dir: which checkpoints to convert: latest (default), best, "
                        "all, or a step number; with --to marian or ctranslate2: best (default), latest or a step")
    parser.add_argument("--quantization", help="with --to ctranslate2: CTranslate2's weight type, e.g. int8 "
                        "(default: float32)")
    for name in ("train", "valid", "test"):
        parser.add_argument(f"--{name}", metavar="SPEC", help=f"with --from: the {name} data spec recorded in the run "
                            "(train.run's data specs), for fine-tuning with train.run --resume")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing destination")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)

    dst = Path(args.dst)
    if dst.exists() and not args.overwrite:
        parser.exit(2, f"error: {dst} exists; pass --overwrite to replace it\n")
    if args.source_format is not None or args.to in ("marian", "ctranslate2"):
        return _interop_cli(parser, args)
    if args.quantization is not None or any(getattr(args, n) for n in ("train", "valid", "test")):
        parser.error("--quantization goes with --to ctranslate2; --train/--valid/--test with --from")
    if args.src is not None and (problem := _weights_destination_problem(Path(args.src), dst, args.to)):
        parser.exit(2, f"error: {problem}\n")  # checked before any work, so nothing is left half-made
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


def _weights_destination_problem(src: Path, dst: Path, to: str) -> str | None:
    """Why `dst` cannot receive the converted weights of `src` (None: it can): the source itself,
    a destination of the other kind (a directory for a file, a file for a directory), or a
    directory holding files that are not JAX weights (never replaced)."""
    if dst.exists() and src.exists() and dst.resolve() == src.resolve():
        return f"--dst {dst} is the source; write the converted weights elsewhere"
    if to == "torch":
        return f"--dst {dst} is a directory; --to torch writes a .safetensors file" if dst.is_dir() else None
    if dst.exists() and not dst.is_dir():
        return f"--dst {dst} is a file; --to jax writes a weights directory (params/ and config.json)"
    if dst.is_dir():
        others = sorted(p.name for p in dst.iterdir() if p.name not in ("params", "config.json"))
        if others:
            return f"--dst {dst} holds other files ({', '.join(others[:3])}); it is never replaced"
    return None


def _interop_cli(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """--from marian, --to marian, --to ctranslate2."""
    src = args.src or args.run_dir
    if args.source_format is not None and args.to not in FRAMEWORKS:
        parser.error(f"--from {args.source_format} imports into a run of --to jax or --to torch")
    if args.quantization is not None and args.to != "ctranslate2":
        parser.error("--quantization goes with --to ctranslate2")
    if args.source_format is None and any(getattr(args, n) for n in ("train", "valid", "test")):
        parser.error("--train/--valid/--test go with --from")
    try:
        if args.source_format == "marian":
            done = marian.import_marian(
                src, args.dst, to=args.to, train=args.train, valid=args.valid, test=args.test, overwrite=args.overwrite,
                layout=None if args.to == "torch" else functools.partial(to_jax_layout, what="Marian weights"),
            )
            cfg = done["config"]
            print(f"wrote {done['run_dir']}: the {args.to} run of {src} ({cfg.num_encoder_layers}+{cfg.num_decoder_layers} "
                  f"layers, d_model {cfg.d_model}, vocab {cfg.src_vocab_size}/{cfg.tgt_vocab_size}, step 0)")
            print(f"translate with: python -m train.translate --run-dir {done['run_dir']}")
            return 0
        params, cfg = run_weights(src, store.parse_checkpoint(args.checkpoint or "best"))
        if args.to == "marian":
            if Path(args.dst).exists():
                shutil.rmtree(args.dst)
            marian.export_marian(src, params, cfg, args.dst)
        else:
            ct2_export.export_ctranslate2(src, params, cfg, args.dst, quantization=args.quantization,
                                          force=args.overwrite)
    except FileExistsError as err:
        parser.exit(2, f"error: {err}\n")
    except ImportError as err:
        parser.exit(1, f"error: {err}\n")
    except (FileNotFoundError, ValueError, RuntimeError, CheckpointError, files.UserError) as err:
        parser.exit(1, f"error: {err}\n")
    print(f"wrote {args.dst}")
    return 0


def _convert_run_cli(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    which = args.checkpoint or "latest"
    if which not in ("latest", "best", "all") and not which.isdigit():
        parser.error(f"--checkpoint takes latest, best, all or a step number, got {which!r}")
    try:
        done = convert_run(args.run_dir, args.dst, to=args.to, which=which, overwrite=args.overwrite)
    except FileExistsError as err:
        parser.exit(2, f"error: {err}\n")
    except (FileNotFoundError, ValueError, CheckpointError, files.UserError) as err:
        parser.exit(1, f"error: {err}\n")
    steps = ", ".join(map(str, done["steps"]))
    print(f"wrote {done['run_dir']}: the {done['backend']} run of {done['from']} (checkpoint step {steps})")
    print(f"continue it with: python -m train.run --run-dir {done['run_dir']} --resume")
    return 0


if __name__ == "__main__":
    sys.exit(main())
