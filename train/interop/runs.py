"""Training runs and weights files between the frameworks (docs/interop.md)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import torch
from flax import nnx, traverse_util
from safetensors import safe_open

import jax_transformer
import torch_reference
from torch_reference.config import TransformerConfig

from .. import checkpoints, data, rundir, runtime
from ..backends import create_backend
from ..checkpoints.jax_store import quiet_orbax
from ..config import ExperimentConfig
from .marian import import_marian
from .weights import (LEGACY_SUFFIXES, convert_state, jax_key, jax_model_from_params, jax_params, nest,
                      read_state_dict, transfer_state)


def convert_checkpoints(src_cfg: ExperimentConfig, model_cfg: TransformerConfig, src_dir: str | os.PathLike,
                        dst_dir: str | os.PathLike, to: str, which: str | int = "latest") -> list[int]:
    """The steps of the checkpoints `which` in `src_dir` made the `to` backend's in `dst_dir`, meta and metrics kept."""
    with (contextlib.closing(create_backend(src_cfg, model_cfg, str(src_dir))) as source,
          contextlib.closing(create_backend(src_cfg.replace(backend=to), model_cfg, str(dst_dir))) as target):
        available = source.checkpoint_steps()
        if not available:
            raise FileNotFoundError("the run has no checkpoint to convert")
        steps = (available if which == "all"
                 else [checkpoints.choose_checkpoint(available, which, source.checkpoint_metrics, src_dir)])
        for step in steps:
            meta = source.restore(step)
            transfer_state(source, target)
            if isinstance(meta.get("config"), Mapping):
                meta = {**meta, "config": {**meta["config"], "backend": to}}
            target.save(meta, source.checkpoint_metrics(step))
    return steps


def convert_run(src: str | os.PathLike, dst: str | os.PathLike, to: str | None = None, which: str | int = "latest",
                overwrite: bool = False, check: Callable[[Path], object] | None = None) -> dict:
    """A run -> the same run for the other backend (checkpoints `which`), at `dst` once `check` accepts it."""
    src, dst = Path(src), Path(dst)
    rundir.check_set_aside(src)  # an --overwrite killed or still running: named, not half a run converted
    try:
        src_cfg, model_cfg = runtime.read_experiment(src), runtime.read_model_config(src)
    except runtime.UserError as err:
        raise FileNotFoundError(str(err)) from None
    to = to or ("torch" if src_cfg.backend == "jax" else "jax")
    if to == src_cfg.backend:
        raise ValueError(f"{src} is already a {to} run")
    rundir.check_model(src, src_cfg, model_cfg, data.load_tokenizers(src))  # as --resume rebuilds it
    copy = (*data.tokenizer_files(src), runtime.MODEL_FILE, runtime.IMPORTED_FILE, runtime.TENSORBOARD)
    with runtime.derive(src, dst, "run", overwrite, copy, check) as tmp:
        steps = convert_checkpoints(src_cfg, model_cfg, src / runtime.CHECKPOINTS, tmp / runtime.CHECKPOINTS, to, which)
        provenance = {"from": str(src), "from_backend": src_cfg.backend, "to_backend": to, "steps": steps}
        runtime.write_json_atomic(tmp / runtime.PROVENANCE_FILE, provenance)
        runtime.write_json_atomic(tmp / runtime.CONFIG_FILE, src_cfg.replace(backend=to).experiment())
    return {"run_dir": str(dst), "backend": to, "from": str(src), "steps": steps}


def init_source(source: str, backend: str, dst: str | os.PathLike) -> Path:
    """A run directory of `backend` for `--init-from SOURCE`: SOURCE, or at `dst` a converted or imported run."""
    path, dst = Path(source), Path(dst)
    if not source.startswith("hf:") and not (path / runtime.CONFIG_FILE).is_file():  # both kinds hold one
        raise FileNotFoundError(f"{path} is neither a run directory nor an HF Marian directory "
                                f"({runtime.CONFIG_FILE} missing)")
    if not source.startswith("hf:") and runtime.kind_of(path) == "run":
        if runtime.read_experiment(path).backend == backend:
            return path
        convert_run(path, dst, to=backend, which="best")
        return dst
    import_marian(source, dst, to=backend)
    return dst


def run_weights(run_dir: str | os.PathLike, checkpoint: str | int = "best") -> tuple[dict[str, np.ndarray], TransformerConfig]:
    """(weights in torch's layout as NumPy, config) of a run's checkpoint, whichever backend wrote it."""
    # Not through train.load: the library's setup imports this module (--init-from), so it stays below train.api.
    run_dir = Path(run_dir)
    cfg, model_cfg, _ = rundir.read_run(run_dir)
    with contextlib.closing(create_backend(cfg, model_cfg, str(run_dir / runtime.CHECKPOINTS))) as backend:
        backend.restore(checkpoints.parse_checkpoint(checkpoint))
        state = convert_state(backend.export_state(), "torch", model_cfg)
    return state.params, model_cfg


def save_torch_weights(model: torch_reference.Transformer, path: str | os.PathLike) -> Path:
    """`path` (.safetensors) with the config in its metadata, written whole (an OSError naming `path`)."""
    from safetensors.torch import save_file

    path = Path(path)
    state_dict = {k: v.contiguous() for k, v in model.state_dict().items()}
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(state_dict, str(tmp), metadata={checkpoints.WEIGHTS_CONFIG_KEY: model.cfg.to_json()})
        os.replace(tmp, path)
    except Exception as err:
        raise runtime.write_error(err, path) or err from None
    finally:
        if tmp.exists():  # (unlink of a missing file on a read-only place fails, and would hide the cause)
            tmp.unlink()
    return path


def load_torch_weights(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], TransformerConfig]:
    """(state dict, config) of a safetensors file, or of a legacy `torch.save` file with config.json beside it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no weights file at {path}")
    state_dict, metadata = read_state_dict(path), {}  # a file that is no safetensors file: its ValueError
    if path.suffix not in LEGACY_SUFFIXES:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
    if checkpoints.WEIGHTS_CONFIG_KEY in metadata:
        cfg = TransformerConfig.from_json(metadata[checkpoints.WEIGHTS_CONFIG_KEY])
    elif (path.parent / "config.json").is_file():
        cfg = TransformerConfig.from_json((path.parent / "config.json").read_text())
    else:
        raise FileNotFoundError(f"{path} carries no config and there is no config.json beside it")
    return state_dict, cfg


def save_jax_weights(model: nnx.Module, directory: str | os.PathLike, overwrite: bool = False) -> Path:
    """`directory/params` (orbax) and `directory/config.json`, built beside it and swapped in whole."""
    directory = Path(directory).absolute()  # orbax wants absolute paths
    tmp, old = (directory.with_name(f".{directory.name}.{suffix}") for suffix in ("tmp", "old"))
    try:
        runtime.remove(tmp)
        tmp.mkdir(parents=True)
        with quiet_orbax(), ocp.Checkpointer(ocp.StandardCheckpointHandler()) as checkpointer:  # synchronous
            checkpointer.save(tmp / "params", args=ocp.args.StandardSave(nest(jax_params(model))))
        runtime.write_text_atomic(tmp / "config.json", model.cfg.to_json())
        if not overwrite and directory.exists() and any(directory.iterdir()):
            raise FileExistsError(f"{directory} exists; pass overwrite=True to replace it")
        runtime.swap_in(tmp, directory, old)
    except Exception as err:
        raise runtime.write_error(err, directory) or err from None
    finally:
        with contextlib.suppress(OSError):  # (a place that cannot be written holds nothing of ours)
            runtime.remove(tmp)
    runtime.remove(old)
    return directory


def load_jax_weights(directory: str | os.PathLike) -> jax_transformer.Transformer:
    """The Flax Transformer saved by `save_jax_weights` (checked strictly against its config)."""
    directory = Path(directory).absolute()
    if not (directory / "config.json").is_file() or not (directory / "params").is_dir():
        raise FileNotFoundError(f"{directory} is not a JAX weights directory (expected params/ and config.json)")
    cfg = TransformerConfig.from_json((directory / "config.json").read_text())
    with ocp.StandardCheckpointer() as checkpointer:
        tree = checkpointer.restore(directory / "params")
    return jax_model_from_params({jax_key(path): v for path, v in traverse_util.flatten_dict(tree).items()}, cfg)
