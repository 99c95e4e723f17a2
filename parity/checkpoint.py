"""Whole training checkpoints between the JAX and the PyTorch backends of `train`, both ways.

A training checkpoint is more than weights: the Adam moments, the update counter (which is also
the learning-rate schedule's position), the data position, the tokenizer and the config. This
module moves all of them, so a run started with `--backend=jax` can go on with
`--backend=torch` (and back) as if it had never changed framework.

Framework-neutral form (`TrainingState`): flat dicts keyed by the Flax parameter paths of
`parity.convert` (`encoder.layers.0.self_attn.q_proj.kernel`), values NumPy in the Flax layout
(kernels (in, out)), for the weights and Adam's first and second moments alike, plus the step.

    optax (train.backend_jax)                 torch (train.backend_torch)
    state["params"]                           model.state_dict()        (kernels transposed)
    ScaleByAdamState.mu / .nu                 Adam state exp_avg / exp_avg_sq (per parameter)
    ScaleByAdamState.count                    Adam state step (float tensor, per parameter)
    ScaleByScheduleState.count (the lr        LambdaLR.last_epoch, and the param groups' lr =
      schedule's position), state["step"]       schedule(last_epoch + 1)

The Adam state is found inside whatever optax chain the trainer builds (`optax.adam` alone or
after `clip_by_global_norm`): exactly one `ScaleByAdamState`; every `ScaleByScheduleState`
count, Adam's count and the trainer's step must agree; any other optimizer state that holds
arrays is refused (it would be silently dropped). Keys and shapes of the weights and of both
moments are checked strictly against the config (`CheckpointMismatchError`, every offender
listed), dtypes must match the target's, and the step counts must agree on both sides.

Run directories (`convert_run`, behind `python -m parity.convert --run-dir`): the source
backend restores its checkpoint, the state crosses in memory, and the target backend writes it
with its own `save`, so the converted checkpoint is exactly what that backend writes and reads.
The checkpoint's meta (data position, batch shapes, validation scores) and its ranking metrics
go along unchanged; config.json gets the other backend; tokenizer files, model.json and the
TensorBoard events are copied byte for byte.

Dropout randomness cannot cross (DESIGN.md): after a conversion to JAX the dropout keys are those
an uninterrupted JAX run would use (derived from the seed and the step); after a conversion to
torch its generator starts from the state the new backend was seeded with.

The backends have no public accessor for their optimizer state, so `export_training_state` and
`import_training_state` reach into their attributes (JAX: `state`, `_step`; torch: `model`,
`optimizer`, `scheduler`); a pair of Backend methods would be the cleaner hook.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from torch_reference.config import TransformerConfig

from . import convert

# Files of a run directory (train.loop) that the conversion copies byte for byte.
TOKENIZER_FILES = ("tokenizer.json", "src_tokenizer.json", "tgt_tokenizer.json")
CONFIG_FILE, MODEL_FILE, CHECKPOINTS, TENSORBOARD = "config.json", "model.json", "checkpoints", "tensorboard"
PROVENANCE_FILE = "converted.json"
# Where a run trains (train.config): resumable settings that the torch backend refuses beyond one
# device and one process. A conversion runs in one process, and a run going to torch drops them.
PLACEMENT_FIELDS = ("devices", "coordinator_address", "num_processes", "process_id")


@dataclasses.dataclass
class TrainingState:
    """Weights, Adam moments and step of one training checkpoint, framework-neutral.

    `params`, `mu`, `nu`: {flax key: NumPy array} in the Flax layout. `mu`/`nu` are None before
    the first update (torch keeps no Adam state then; optax holds zeros).
    """

    model_cfg: TransformerConfig
    step: int
    params: dict[str, np.ndarray]
    mu: dict[str, np.ndarray] | None
    nu: dict[str, np.ndarray] | None

    def check(self) -> None:
        """Strict keys and shapes of weights and moments against the config."""
        expected = convert.expected_jax_params(self.model_cfg)
        convert._check("weights", expected, _shapes(self.params))
        if (self.mu is None) != (self.nu is None):
            raise ValueError("Adam state holds only one of its two moments")
        if self.mu is not None:
            convert._check("Adam first moments (mu / exp_avg)", expected, _shapes(self.mu))
            convert._check("Adam second moments (nu / exp_avg_sq)", expected, _shapes(self.nu))
            # Both optimizers keep the moments in the parameters' dtype (optax mu_dtype=None).
            wrong = [f"{name}.{k}: {np.dtype(m[k].dtype)}, parameter {np.dtype(v.dtype)}"
                     for name, m in (("mu", self.mu), ("nu", self.nu)) for k, v in self.params.items()
                     if m[k].dtype != v.dtype]
            if wrong:
                raise ValueError("Adam moments have other dtypes than their parameters:\n  " + "\n  ".join(wrong))
        elif self.step != 0:
            raise ValueError(f"Adam state is empty but the step is {self.step}: the moments are missing")


def _shapes(flat: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(np.shape(v)) for k, v in flat.items()}


def _copy(x: Any) -> np.ndarray:
    # A copy, never a view: the JAX backend donates its state's buffers to the next update.
    return np.array(jax.device_get(x), copy=True)


# ---------------------------------------------------------------------------------------------
# optax: find the Adam state and the schedule counts inside a chain
# ---------------------------------------------------------------------------------------------


def _path_str(path: tuple) -> str:
    return "opt_state" + "".join(f"[{p}]" for p in path)


def optax_parts(opt_state: Any) -> tuple[tuple, optax.ScaleByAdamState, list[tuple[tuple, Any]]]:
    """(path of the one ScaleByAdamState, that state, [(path, count) of each ScaleByScheduleState]).

    Walks tuples (chains), named tuples and dicts. States without arrays (EmptyState of
    `clip_by_global_norm`, `scale`, ...) are skipped; any other state holding arrays raises, since
    a conversion would drop it.
    """
    adams, schedules, unknown = [], [], []

    def walk(node, path):
        if isinstance(node, optax.ScaleByAdamState):
            adams.append((path, node))
        elif isinstance(node, optax.ScaleByScheduleState):
            schedules.append((path, node.count))
        elif isinstance(node, tuple) and not hasattr(node, "_fields"):  # a chain's tuple of states
            for i, child in enumerate(node):
                walk(child, (*path, i))
        elif isinstance(node, dict):
            for key, child in node.items():
                walk(child, (*path, key))
        elif jax.tree.leaves(node):
            unknown.append(f"{_path_str(path)}: {type(node).__name__}")

    walk(opt_state, ())
    if unknown:
        raise ValueError("optimizer state holds parts this conversion does not carry: " + ", ".join(unknown))
    if len(adams) != 1:
        where = ", ".join(_path_str(p) for p, _ in adams) or "none"
        raise ValueError(
            f"expected exactly one optax ScaleByAdamState in the optimizer state, found {len(adams)} ({where})"
        )
    (adam_path, adam), = adams
    return adam_path, adam, schedules


def _replace_at(node: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    head, *rest = path
    if isinstance(node, dict):
        return {**node, head: _replace_at(node[head], tuple(rest), value)}
    items = list(node)
    items[head] = _replace_at(items[head], tuple(rest), value)
    return type(node)(items)


def _path_key(path: tuple) -> str:
    """A jax tree path inside an nnx.State -> the flax key `a.b.0.kernel` (Variable `.value` dropped)."""
    parts = []
    for p in path:
        if isinstance(p, jax.tree_util.DictKey):
            parts.append(str(p.key))
        elif isinstance(p, jax.tree_util.SequenceKey):
            parts.append(str(p.idx))
        elif isinstance(p, jax.tree_util.GetAttrKey):
            if p.name != "value":
                parts.append(p.name)
        else:  # FlattenedIndexKey
            parts.append(str(p.key))
    return ".".join(parts)


def tree_to_flat(tree: Any) -> dict[str, np.ndarray]:
    """A parameter-shaped tree (nnx.State of the params, or Adam's mu/nu) -> {flax key: NumPy copy}."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    flat = {_path_key(path): _copy(leaf) for path, leaf in leaves}
    if len(flat) != len(leaves):
        raise ValueError("two leaves of the tree map to one key")
    return flat


def flat_like(template: Any, flat: Mapping[str, Any], cfg: TransformerConfig, what: str) -> Any:
    """{flax key: array} -> a tree shaped like `template` (dtypes and device placement kept).

    Strict: keys and shapes against the config, and every dtype equal to the template's.
    """
    convert._check(what, convert.expected_jax_params(cfg), _shapes(flat))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
    new_leaves, wrong_dtype = [], []
    for path, leaf in leaves:
        key = _path_key(path)
        value = np.asarray(flat[key])
        if value.dtype != leaf.dtype:
            wrong_dtype.append(f"{key}: expected {leaf.dtype}, got {value.dtype}")
        sharding = getattr(leaf, "sharding", None)
        new_leaves.append(jax.device_put(value, sharding) if sharding is not None else jnp.asarray(value))
    if wrong_dtype:
        raise ValueError(f"{what} have other dtypes than the target:\n  " + "\n  ".join(wrong_dtype))
    return jax.tree_util.tree_unflatten(treedef, new_leaves)


def optax_adam_to_flat(opt_state: Any, cfg: TransformerConfig) -> dict:
    """The Adam part of an optax state -> {"count", "mu", "nu", "schedule_counts"} (flax keys)."""
    _, adam, schedules = optax_parts(opt_state)
    mu, nu = tree_to_flat(adam.mu), tree_to_flat(adam.nu)
    expected = convert.expected_jax_params(cfg)
    convert._check("optax Adam mu", expected, _shapes(mu))
    convert._check("optax Adam nu", expected, _shapes(nu))
    return {"count": int(adam.count), "mu": mu, "nu": nu, "schedule_counts": [int(c) for _, c in schedules]}


def optax_state_with_adam(
    template: Any, count: int, mu: Mapping | None, nu: Mapping | None, cfg: TransformerConfig
) -> Any:
    """`template` (an optax state of the same chain) with Adam's count, mu and nu replaced and every
    schedule count set to `count`. mu/nu None: zeros, as `optax.adam().init` makes them."""
    adam_path, adam, schedules = optax_parts(template)
    if mu is None:
        mu, nu = jax.tree.map(jnp.zeros_like, adam.mu), jax.tree.map(jnp.zeros_like, adam.nu)
    else:
        mu = flat_like(adam.mu, mu, cfg, "Adam first moments (mu / exp_avg)")
        nu = flat_like(adam.nu, nu, cfg, "Adam second moments (nu / exp_avg_sq)")
    state = _replace_at(template, adam_path, adam._replace(count=jnp.asarray(count, adam.count.dtype), mu=mu, nu=nu))
    for path, old in schedules:
        state = _replace_at(state, path, optax.ScaleByScheduleState(count=jnp.asarray(count, old.dtype)))
    return state


# ---------------------------------------------------------------------------------------------
# Backends (train.backend_jax.JaxBackend, train.backend_torch.TorchBackend): read and set the
# whole training state. These reach into the backends' attributes (JAX: state, _step; torch:
# model, optimizer, scheduler); a pair of backend methods would be the cleaner hook.
# ---------------------------------------------------------------------------------------------


def export_training_state(backend) -> TrainingState:
    """The backend's weights, Adam moments and step, checked strictly."""
    if backend.name == "jax":
        state = _export_jax(backend)
    elif backend.name == "torch":
        state = _export_torch(backend)
    else:
        raise ValueError(f"no training-state conversion for backend {backend.name!r}")
    state.check()
    return state


def import_training_state(backend, state: TrainingState) -> None:
    """Set the backend's weights, Adam moments, step and schedule position from `state`."""
    if state.model_cfg != backend.model_cfg:
        raise ValueError(f"the state is of another model:\n  state   {state.model_cfg}\n  backend {backend.model_cfg}")
    state.check()
    if backend.name == "jax":
        _import_jax(backend, state)
    elif backend.name == "torch":
        _import_torch(backend, state)
    else:
        raise ValueError(f"no training-state conversion for backend {backend.name!r}")


def _export_jax(backend) -> TrainingState:
    cfg, st = backend.model_cfg, backend.state
    adam = optax_adam_to_flat(st["opt_state"], cfg)
    step = int(st["step"])
    counts = {"trainer step": step, "Adam count": adam["count"]}
    counts.update({f"schedule count {i}": c for i, c in enumerate(adam["schedule_counts"])})
    if len(set(counts.values())) != 1:
        raise ValueError(f"the JAX state's step counters disagree: {counts}")
    mu, nu = (adam["mu"], adam["nu"]) if step else (None, None)  # torch keeps no moments before step 1
    return TrainingState(cfg, step, tree_to_flat(st["params"]), mu, nu)


def _import_jax(backend, state: TrainingState) -> None:
    cfg, old = backend.model_cfg, backend.state
    params = flat_like(old["params"], state.params, cfg, "weights")
    opt_state = optax_state_with_adam(old["opt_state"], state.step, state.mu, state.nu, cfg)
    step = jnp.asarray(state.step, old["step"].dtype)
    backend.state = {**old, "params": params, "opt_state": opt_state, "step": step}
    backend._step = state.step  # the backend's host copy of state["step"]


def _param_names(backend) -> list[str]:
    return [name for name, _ in backend.model.named_parameters()]


def _export_torch(backend) -> TrainingState:
    cfg = backend.model_cfg
    params = convert.torch_state_to_jax(backend.model.state_dict(), cfg)
    adam = convert.torch_adam_to_jax(backend.optimizer.state_dict(), _param_names(backend), cfg)
    step = backend.scheduler.last_epoch
    if adam["mu"] is not None and adam["count"] != step:
        raise ValueError(f"torch Adam step {adam['count']} disagrees with the scheduler's last_epoch {step}")
    return TrainingState(cfg, step, params, adam["mu"], adam["nu"])


def _import_torch(backend, state: TrainingState) -> None:
    import torch

    cfg = backend.model_cfg
    weights = convert.jax_params_to_torch(state.params, cfg)
    current = backend.model.state_dict()
    wrong = [f"{k}: expected {current[k].dtype}, got {v.dtype}" for k, v in weights.items()
             if v.dtype != current[k].dtype]
    if wrong:
        raise ValueError("weights have other dtypes than the target:\n  " + "\n  ".join(wrong))
    with torch.no_grad():
        backend.model.load_state_dict(weights, strict=True)
    groups = backend.optimizer.state_dict()["param_groups"]
    adam = {"count": state.step, "mu": state.mu, "nu": state.nu}
    backend.optimizer.load_state_dict(convert.jax_adam_to_torch(adam, _param_names(backend), cfg, groups))
    # LambdaLR's position is the number of updates done; the next update runs at lr(step + 1)
    # (paper numbering from 1), as TorchBackend.restore sets it.
    backend.scheduler.last_epoch = state.step
    for group in backend.optimizer.param_groups:
        group["lr"] = backend.learning_rate(state.step + 1)
    backend.scheduler._last_lr = [group["lr"] for group in backend.optimizer.param_groups]


def states_equal(a: TrainingState, b: TrainingState) -> list[str]:
    """What differs between two states, bit for bit (empty: identical)."""
    out = []
    if a.model_cfg != b.model_cfg:
        out.append("model config")
    if a.step != b.step:
        out.append(f"step {a.step} != {b.step}")
    for name in ("params", "mu", "nu"):
        x, y = getattr(a, name), getattr(b, name)
        if (x is None) != (y is None):
            out.append(f"{name}: one side empty")
        elif x is not None:
            if x.keys() != y.keys():
                out.append(f"{name}: keys differ")
                continue
            out += [f"{name}.{k}" for k in x if x[k].dtype != y[k].dtype or not np.array_equal(x[k], y[k])]
    return out


# ---------------------------------------------------------------------------------------------
# Checkpoint directories and run directories
# ---------------------------------------------------------------------------------------------


def checkpoint_metrics(backend, step: int) -> dict | None:
    """The ranking metrics (e.g. {"bleu": ...}) a checkpoint was saved with, or None."""
    if backend.name == "jax":
        metrics = backend.manager.metrics(step)
        return None if metrics is None else dict(metrics)
    record = json.loads((Path(backend._checkpoint_dir) / str(step) / "meta.json").read_text())
    return record.get("metrics")


def select_steps(available: list[int], which: str | int, backend) -> list[int]:
    """The checkpoint steps to convert: "latest", "best", "all" or one step number."""
    if not available:
        raise FileNotFoundError("the run has no checkpoint to convert")
    if which == "all":
        return list(available)
    if which == "latest":
        return [available[-1]]
    if which == "best":
        from train.backend import best_of

        return [best_of({s: checkpoint_metrics(backend, s) for s in available}) or available[-1]]
    step = int(which)
    if step not in available:
        raise FileNotFoundError(f"no checkpoint of step {step} (have {available})")
    return [step]


def _placement_reset(config: Mapping[str, Any]) -> dict:
    return {name: None for name in PLACEMENT_FIELDS if name in config}


def _switch_config(config: Mapping[str, Any], backend: str, run_dir: str | None) -> dict:
    """A run's config dict for `backend`: the backend field switched, run_dir replaced when given,
    and for torch the multi-device/-process settings reset."""
    out = {**config, "backend": backend}
    if run_dir is not None and "run_dir" in out:
        out["run_dir"] = run_dir
    if backend == "torch":
        out.update(_placement_reset(config))
    return out


def _in_this_process(cfg):
    """`cfg` for a backend that only reads or writes checkpoints here: one process, local devices."""
    return cfg.replace(**_placement_reset(cfg.to_dict()))


def convert_checkpoints(
    src_cfg, model_cfg: TransformerConfig, src_dir: str | os.PathLike, dst_dir: str | os.PathLike,
    to: str, which: str | int = "latest", dst_run_dir: str | None = None,
) -> list[int]:
    """Convert the checkpoints `which` of the `src_cfg.backend` backend in `src_dir` into the `to`
    backend's checkpoints in `dst_dir`; returns the steps converted.

    Each checkpoint is restored by the source backend, its state moved across, and saved by the
    target backend with the same meta (data position; the embedded config with `backend`, and
    `run_dir` when given, switched) and the same ranking metrics.
    """
    from train.backend import create_backend

    if to == src_cfg.backend:
        raise ValueError(f"the checkpoints already belong to the {to} backend")
    source = create_backend(_in_this_process(src_cfg), model_cfg, str(src_dir))
    target = create_backend(_in_this_process(src_cfg.replace(backend=to)), model_cfg, str(dst_dir))
    try:
        steps = select_steps(source.checkpoint_steps(), which, source)
        for step in steps:
            meta = source.restore(step)
            metrics = checkpoint_metrics(source, step)
            import_training_state(target, export_training_state(source))
            if isinstance(meta.get("config"), Mapping):
                meta = {**meta, "config": _switch_config(meta["config"], to, dst_run_dir)}
            target.save(meta, metrics)
    finally:
        source.close()
        target.close()
    return steps


def convert_run(
    src: str | os.PathLike, dst: str | os.PathLike, to: str | None = None, which: str | int = "latest",
    overwrite: bool = False,
) -> dict:
    """A run directory of one backend (train.loop) -> the same run for the other backend.

    `dst` receives config.json (the backend switched, run_dir = dst), model.json, the tokenizer
    files (byte copies), the TensorBoard events, and the checkpoints `which` ("latest", "best",
    "all" or a step) converted. It is built beside `dst` and renamed into place, so an interrupted
    conversion leaves nothing. `python -m train.run --run-dir DST --resume` continues it.
    """
    from train.config import ExperimentConfig
    from train.data import load_tokenizers

    src, dst = Path(src), Path(dst)
    if not (src / CONFIG_FILE).is_file() or not (src / MODEL_FILE).is_file():
        raise FileNotFoundError(f"{src} is not a run directory ({CONFIG_FILE} and {MODEL_FILE} expected)")
    src_cfg = ExperimentConfig.from_json((src / CONFIG_FILE).read_text())
    to = to or ("torch" if src_cfg.backend == "jax" else "jax")
    if to == src_cfg.backend:
        raise ValueError(f"{src} is already a {to} run")
    model_cfg = TransformerConfig.from_json((src / MODEL_FILE).read_text())
    tokenizers = load_tokenizers(src)
    rebuilt = src_cfg.model_config(tokenizers.src.get_vocab_size(), tokenizers.tgt.get_vocab_size())
    if rebuilt != model_cfg:  # --resume rebuilds the model from config.json and the tokenizer
        raise ValueError(
            f"{src}: {MODEL_FILE} does not match config.json and the tokenizer:\n  {model_cfg}\n  {rebuilt}"
        )
    if dst.resolve() == src.resolve():
        raise ValueError("--dst must differ from the source run directory")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        if not overwrite:
            raise FileExistsError(f"{dst} exists; pass --overwrite to replace it")
        if dst.is_dir() and not (dst / CONFIG_FILE).is_file():
            raise FileExistsError(f"{dst} is not empty and holds no run; it is never deleted")

    tmp = dst.with_name(f".{dst.name}.converting")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        dst_cfg = ExperimentConfig.from_dict(_switch_config(src_cfg.to_dict(), to, str(dst)))
        steps = convert_checkpoints(src_cfg, model_cfg, src / CHECKPOINTS, tmp / CHECKPOINTS, to, which, str(dst))
        for name in (*TOKENIZER_FILES, MODEL_FILE):
            if (src / name).is_file():
                shutil.copyfile(src / name, tmp / name)
        if (src / TENSORBOARD).is_dir():
            shutil.copytree(src / TENSORBOARD, tmp / TENSORBOARD)
        provenance = {"from": str(src), "from_backend": src_cfg.backend, "to_backend": to, "steps": steps}
        (tmp / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
        # Like train.loop.write_json_atomic; the same content a run of this backend writes.
        (tmp / CONFIG_FILE).write_text(json.dumps(dst_cfg.to_dict(), indent=2, ensure_ascii=False) + "\n")
        if dst.exists():
            shutil.rmtree(dst)
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"run_dir": str(dst), "backend": to, "from": str(src), "steps": steps}
