"""The JAX backend: `jax_transformer.Transformer` trained with optax under one `jax.jit`."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jax_transformer
from jax_transformer import decode, ensemble, sampling, sharding
from jax_transformer.objective import noam_learning_rate, smoothed_sums
from torch_reference.config import TransformerConfig, check_beam

from ..checkpoints import TrainingState, check_arrays
from ..checkpoints.jax_store import JaxStore
from ..config import ExperimentConfig, default_dtype, resolve_kernels
from ..data import Batch
from . import allocator, compiles, jax_cache
from .interface import Hypotheses, Metrics, StoreMethods, Topology


def make_optimizer(exp_cfg: ExperimentConfig, d_model: int) -> optax.GradientTransformation:
    """Optional global-norm clipping, then Adam(0.9, 0.98, 1e-9) (paper §5.3) on the Noam schedule from step 1."""

    def schedule(count):
        return noam_learning_rate(count + 1, d_model, exp_cfg.warmup, exp_cfg.lr_factor)

    adam = optax.adam(schedule, b1=0.9, b2=0.98, eps=1e-9)
    if exp_cfg.clip_norm is None:
        return adam
    # g * max_norm / ||g|| when ||g|| >= max_norm, no epsilon; the torch backend writes the same.
    return optax.chain(optax.clip_by_global_norm(exp_cfg.clip_norm), adam)


def _as_arrays(batch: Batch, rows: slice = slice(None)) -> dict[str, np.ndarray]:
    arrays = {"src": batch.src[rows], "tgt_in": batch.tgt_in[rows], "tgt_out": batch.tgt_out[rows]}
    if batch.src_segments is not None:  # packed rows
        arrays.update(src_segments=batch.src_segments[rows], tgt_segments=batch.tgt_segments[rows])
    return arrays


COMPUTE_DTYPES = {"float32": None, "bfloat16": jnp.bfloat16}  # None: the parameters' float32


def initialize(exp_cfg: ExperimentConfig) -> Topology:
    """Once per process: the compile cache, `jax.distributed`, the platform's settings; where the run trains."""
    compiles.listen()
    jax_cache.enable()
    sharding.initialize_distributed(exp_cfg.coordinator_address, exp_cfg.num_processes, exp_cfg.process_id)
    mesh = sharding.make_mesh(exp_cfg.devices)
    platform = mesh.devices.flat[0].platform
    if platform == "cpu":
        allocator.tune()
    full_float32_matmuls(exp_cfg.dtype or default_dtype(platform), platform)
    return Topology(jax.process_index(), jax.process_count(), mesh.devices.size, platform)


def allgather(array: np.ndarray) -> np.ndarray:
    """Every process's `array` (one shape in all), stacked in process order."""
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(array))


def full_float32_matmuls(dtype: str, platform: str) -> bool:
    """Float32 off the CPU: JAX's matmul precision "highest" unless the user set one; True when it did."""
    if dtype != "float32" or platform == "cpu" or jax.config.jax_default_matmul_precision is not None:
        return False
    jax.config.update("jax_default_matmul_precision", "highest")
    return True


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What the pure step functions read besides their arguments, fixed for a run (closed over by `jax.jit`)."""

    graphdef: Any
    rest: Any  # non-parameter state of the model (none today): constant through training
    tx: optax.GradientTransformation
    model_cfg: TransformerConfig
    exp_cfg: ExperimentConfig
    gather: Any = None  # FSDP: the replicated sharding, the parameters gathered to it for the passes
    scatter: Any = None  # FSDP: the parameters' shardings, the gradients scattered back to them

    def model(self, params) -> jax_transformer.Transformer:
        return nnx.merge(self.graphdef, params, self.rest)


def loss_sums(ctx: StepContext, params, batch, key, total_tokens, deterministic):
    """(loss sum / total_tokens, (loss sum, nll sum)): the objective and its parts."""
    rngs = nnx.Rngs(dropout=key)
    model = ctx.model(params)
    segments = {k: batch[k] for k in ("src_segments", "tgt_segments") if k in batch}  # packed rows
    if isinstance(model, ensemble.Ensemble):  # evaluation only: its log-probabilities (B, T, V), their own logits
        logits, sums = model(batch["src"], batch["tgt_in"]), smoothed_sums
    else:  # (B, T, V), and the objective of the model's kernel set
        logits = model(batch["src"], batch["tgt_in"], **segments, deterministic=deterministic, rngs=rngs)
        sums = model.kernels.loss_sums
    loss_sum, nll_sum = sums(logits, batch["tgt_out"], ctx.model_cfg.pad_id, ctx.exp_cfg.label_smoothing)
    return loss_sum / total_tokens, (loss_sum, nll_sum)


def micro_grads(ctx: StepContext, params, batch, total_tokens, rng, step, index):
    """(gradients, loss sum, nll sum) of one micro-batch; one dropout key per (update, micro-batch)."""
    key = jax.random.fold_in(jax.random.fold_in(rng, step), index)

    def objective(params):
        if ctx.gather is not None:
            # ZeRO-3: each parameter gathered whole, each device its own rows (not a split contraction: another sum).
            params = jax.lax.with_sharding_constraint(params, ctx.gather)
        return loss_sums(ctx, params, batch, key, total_tokens, False)

    grads, (loss_sum, nll_sum) = jax.grad(objective, has_aux=True)(params)
    if ctx.scatter is not None:  # each device keeps only its shard of the summed gradients
        grads = jax.lax.with_sharding_constraint(grads, ctx.scatter)
    return grads, loss_sum, nll_sum


def apply_gradients(ctx: StepContext, state, acc, total_tokens):
    """Apply accumulated (grads, loss sum, nll sum) to the state: clip, Adam, step + 1."""
    grads, loss_sum, nll_sum = acc
    updates, opt_state = ctx.tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    step, cfg = state["step"], ctx.exp_cfg
    metrics = {
        "loss": loss_sum / total_tokens,
        "nll": nll_sum / total_tokens,
        "grad_norm": optax.tree.norm(grads),  # before clipping
        "lr": noam_learning_rate(step + 1, ctx.model_cfg.d_model, cfg.warmup, cfg.lr_factor),
        "tokens": total_tokens,
    }
    return {"params": params, "opt_state": opt_state, "step": step + 1}, metrics


def train_step(ctx: StepContext, state, batch, rng):
    """The whole update from one batch: (state, batch, rng) -> (new state, metrics)."""
    total_tokens = (batch["tgt_out"] != ctx.model_cfg.pad_id).sum().astype(jnp.float32)
    acc = micro_grads(ctx, state["params"], batch, total_tokens, rng, state["step"], 0)
    return apply_gradients(ctx, state, acc, total_tokens)


def accumulate(ctx: StepContext, acc, state, batch, total_tokens, rng, index):
    """acc + the gradients of one micro-batch (gradient accumulation; `apply_gradients` ends it)."""
    grads, loss_sum, nll_sum = micro_grads(ctx, state["params"], batch, total_tokens, rng, state["step"], index)
    acc_grads, acc_loss, acc_nll = acc
    return jax.tree.map(jnp.add, acc_grads, grads), acc_loss + loss_sum, acc_nll + nll_sum


def eval_sums(ctx: StepContext, params, batch):
    """(smoothed loss sum, nll sum, target tokens) of one batch, dropout off."""
    total = (batch["tgt_out"] != ctx.model_cfg.pad_id).sum()
    _, (loss_sum, nll_sum) = loss_sums(ctx, params, batch, jax.random.key(0), total, True)
    return loss_sum, nll_sum, total


def search(ctx: StepContext, params, src, prefix, beam_size: int, alpha: float, cached: bool, scoring: str,
           n_best: int | None):
    """Greedy (beam_size 1) or beam search over src (B, S) from `prefix` (B, P): tokens (B, L), or `n_best`'s three."""
    model = ctx.model(params)
    if beam_size == 1:
        tokens, logprob = decode.greedy_search(model, src, cached=cached, prefix=prefix)
        if n_best is None:
            return tokens
        penalty = decode.length_penalty((tokens != ctx.model_cfg.pad_id).sum(1).astype(jnp.float32), alpha, scoring)
        return tokens[:, None], logprob[:, None], (logprob / penalty)[:, None]
    out = decode.beam_search(model, src, beam_size, alpha, cached=cached, scoring=scoring, n_best=n_best, prefix=prefix)
    return out[0] if n_best is None else out


def sharded_search(ctx: StepContext, mesh, params, src, prefix, beam_size: int, alpha, *options):
    """`search` data parallel over `mesh` (`shard_map`, no collective inside): each device its own rows."""
    whole, rows = jax.sharding.PartitionSpec(), jax.sharding.PartitionSpec(sharding.DATA_AXIS)
    arrays = (src,) if prefix is None else (src, prefix)
    per_device = jax.shard_map(lambda p, a, s, x=None: search(ctx, p, s, x, beam_size, a, *options), mesh=mesh,
                               in_specs=(whole, whole, *(rows,) * len(arrays)), out_specs=rows, check_vma=False)
    return per_device(params, alpha, *arrays)


def draw_samples(ctx: StepContext, params, src, seed, sentence_ids, num_samples: int, temperature, top_k, top_p):
    """(tokens (B, N, L), log-probs (B, N)) of `sampling.sample_loop` over src (B, S), the settings traced."""
    model = ctx.model(params)
    return sampling.sample_loop(model, src, seed, sentence_ids, num_samples, temperature, top_k, top_p, 1.5, 10)


def _host(out) -> np.ndarray | Hypotheses:
    """A search's output as NumPy: tokens (B, L), or `Hypotheses` from (tokens, log-probs, scores)."""
    if not isinstance(out, tuple):
        return np.asarray(out, np.int32)
    tokens, logprob, score = jax.device_get(out)
    return Hypotheses(np.asarray(tokens, np.int32), np.asarray(logprob, np.float32), np.asarray(score, np.float32))


class JaxBackend(StoreMethods):
    """`train.backends.Backend` for JAX."""

    name = "jax"

    def __init__(self, exp_cfg: ExperimentConfig, model_cfg: TransformerConfig, checkpoint_dir: str | None = None):
        self.exp_cfg, self.model_cfg = exp_cfg, model_cfg
        self.mesh = sharding.make_mesh(exp_cfg.devices)
        self.topology = Topology(jax.process_index(), jax.process_count(), self.mesh.devices.size)
        # XLA:CPU's buffers are host memory from glibc (tuned by `initialize`): `train_step` hands it back.
        self._host_buffers = allocator.tuned()
        self._compiled_shapes: set[tuple] = set()
        platform = self.mesh.devices.flat[0].platform
        dtype = COMPUTE_DTYPES[exp_cfg.dtype or default_dtype(platform)]
        # The kernel set, chosen here once: the model's layers, its searches and `loss_sums` read it from the model.
        self.kernels = resolve_kernels(exp_cfg.kernels, "jax", platform)
        self.tx = make_optimizer(exp_cfg, model_cfg.d_model)
        self.layout = exp_cfg.param_sharding

        def init(seed):
            # Every process computes the same weights from the seed, each device only its shards.
            init_key, rng = jax.random.split(jax.random.key(seed))
            model = jax_transformer.Transformer(model_cfg, dtype=dtype, kernels=self.kernels, remat=exp_cfg.remat,
                                                rngs=nnx.Rngs(params=init_key))
            graphdef, params, rest = nnx.split(model, nnx.Param, ...)
            state = {"params": params, "opt_state": self.tx.init(params), "step": jnp.zeros((), jnp.int32)}
            return graphdef, state, rest, rng

        # One compiled program, not one per eager operation of the initialisers.
        self.graphdef, abstract, _, _ = jax.eval_shape(init, exp_cfg.seed)
        # One sharding per array of the state: replicated, or split over `data` (FSDP).
        self.state_sharding = sharding.state_shardings(abstract, self.mesh, self.layout)
        whole = sharding.replicated(self.mesh)
        initialized = jax.jit(init, out_shardings=(None, self.state_sharding, whole, whole))
        _, self.state, self.rest, self.rng = initialized(exp_cfg.seed)
        self._whole_params: tuple[int, Any] | None = None  # (step, gathered params) under FSDP
        self._step = 0  # host copy of state["step"], so reading it never syncs
        self.store = JaxStore(checkpoint_dir, exp_cfg.keep_checkpoints)

        # The state and the gradient accumulator in its layout, batches along `data`, the rest replicated (a prefix).
        rows = sharding.batch_sharded(self.mesh)
        state_s = self.state_sharding
        fsdp = self.layout == "fsdp"
        self.ctx = StepContext(self.graphdef, self.rest, self.tx, model_cfg, exp_cfg,
                               gather=whole if fsdp else None, scatter=state_s["params"] if fsdp else None)
        acc_s = (state_s["params"], whole, whole)
        bound = functools.partial
        self._train_step = jax.jit(bound(train_step, self.ctx), in_shardings=(state_s, rows, whole),
                                   out_shardings=(state_s, whole), donate_argnums=0)
        self._accumulate = jax.jit(bound(accumulate, self.ctx), out_shardings=acc_s, donate_argnums=0,
                                   in_shardings=(acc_s, state_s, rows, whole, whole, whole))
        self._apply = jax.jit(bound(apply_gradients, self.ctx), in_shardings=(state_s, acc_s, whole),
                              out_shardings=(state_s, whole), donate_argnums=0)
        self._zeros = jax.jit(lambda tree: jax.tree.map(jnp.zeros_like, tree), out_shardings=acc_s)
        self._compile_decoders()

    def _compile_decoders(self) -> None:
        # Jitted over the parameters alone, no nnx.jit graph walk (docs/performance.md#what-made-the-jax-search-fast).
        bound, ctx = functools.partial, self.ctx
        self._eval = jax.jit(bound(eval_sums, ctx))  # on one device, over local_copy(params)
        # alpha (argument 4) is data: one program for every alpha (a server's requests each gave their own)
        self._search = jax.jit(bound(search, ctx), static_argnums=(3, 5, 6, 7))
        self._sharded_search = jax.jit(bound(sharded_search, ctx, self.mesh), static_argnums=(3, 5, 6, 7))
        self._score = jax.jit(lambda params, src, tgt: decode.score(ctx.model(params), src, tgt))
        self._sample = jax.jit(bound(draw_samples, ctx), static_argnums=4)  # temperature, top-k, top-p are data
        self._cross_attention = jax.jit(lambda params, s, t: ctx.model(params)(s, t, return_attention=True)[1])

    def ensemble(self, others: Sequence[JaxBackend], average: str = "logprob") -> None:
        members = [b.ctx.model(b.mesh_params()) for b in (self, *others)]  # whole on this mesh's devices
        graphdef, params, rest = nnx.split(ensemble.Ensemble(members, average), nnx.Param, ...)
        self.ctx = dataclasses.replace(self.ctx, graphdef=graphdef, rest=rest, gather=None, scatter=None)
        self.state = {**self.state, "params": params}
        self.layout, self._whole_params, self.members = "replicated", None, others
        self._compile_decoders()

    @property
    def step(self) -> int:
        return self._step

    @property
    def num_params(self) -> int:
        return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.state["params"]))

    def global_batch(self, batch: Batch) -> dict[str, jax.Array]:
        """The loop's global batch as arrays sharded over the mesh, this process supplying its own rows."""
        rows = slice(None) if batch.global_rows is not None else sharding.process_slice(len(batch.src))
        return sharding.shard_batch(_as_arrays(batch, rows), self.mesh)

    def train_step(self, batches: Sequence[Batch]) -> Metrics:
        shapes = tuple(b.src.shape + b.tgt_in.shape for b in batches)
        compiles = self._host_buffers and shapes not in self._compiled_shapes
        self._compiled_shapes.add(shapes)
        if len(batches) == 1:
            self.state, metrics = self._train_step(self.state, self.global_batch(batches[0]), self.rng)
        else:
            total_tokens = np.float32(sum(b.num_tgt_tokens for b in batches))
            acc = self._zeros((self.state["params"], np.float32(0), np.float32(0)))
            for index, batch in enumerate(batches):
                acc = self._accumulate(acc, self.state, self.global_batch(batch), total_tokens, self.rng, index)
            self.state, metrics = self._apply(self.state, acc, total_tokens)
        self._step += 1
        self._whole_params = None
        if compiles:  # a new shape compiled: hand back what compilation freed once the step has run
            jax.block_until_ready(metrics)
            allocator.release()
        return metrics

    def fetch(self, metrics: Sequence[Metrics]) -> list[dict[str, float]]:
        return [{k: float(v) for k, v in m.items()} for m in jax.device_get(list(metrics))]

    def mesh_params(self):
        """The parameters whole on every device: under FSDP gathered once per step (by every process)."""
        if self.layout == "replicated":
            return self.state["params"]
        if self._whole_params is None or self._whole_params[0] != self._step:
            self._whole_params = (self._step, sharding.gather(self.state["params"], self.mesh))
        return self._whole_params[1]

    def local_params(self):
        """This process's own single-device copy of the parameters (no data moves)."""
        return sharding.local_copy(self.mesh_params())

    def eval_loss(self, batch: Batch):
        return self._eval(self.local_params(), _as_arrays(batch))

    def translate(self, src: np.ndarray, beam_size: int = 4, alpha: float = 0.6, cached: bool = True,
                  scoring: str = "gnmt", n_best: int | None = None,
                  prefix: np.ndarray | None = None) -> np.ndarray | Hypotheses:
        src = np.asarray(src, np.int32)
        if prefix is not None:  # checked here: inside the compiled search its values are not known
            prefix = np.asarray(prefix, np.int32)
            decode.check_prefix(src, prefix, self.model_cfg, 1.5, 10)
        if beam_size == 1 and n_best is not None:  # greedy's one-best list
            check_beam(1, alpha, scoring, n_best)
        options = (beam_size, np.float32(alpha), cached, scoring, n_best)
        devices = self.mesh.devices.size
        if devices == 1:
            return _host(self._search(self.local_params(), src, prefix, *options))
        # Data parallel: padding rows (done at once) up to a multiple of the devices, the output gathered.
        rows = len(src)
        arrays = {"src": src} if prefix is None else {"src": src, "prefix": prefix}
        arrays = {k: np.pad(v, ((0, -rows % devices), (0, 0)), constant_values=self.model_cfg.pad_id)
                  for k, v in arrays.items()}
        batch = sharding.shard_batch({k: v[sharding.process_slice(len(v))] for k, v in arrays.items()}, self.mesh)
        out = self._sharded_search(self.mesh_params(), batch["src"], batch.get("prefix"), *options)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            out = multihost_utils.process_allgather(out, tiled=True)
        return _host(jax.tree.map(lambda x: x[:rows], out))

    def sample(self, src: np.ndarray, seed: int, num_samples: int = 1, temperature: float = 1.0, top_k: int = 0,
               top_p: float = 1.0, sentence_ids: np.ndarray | None = None) -> Hypotheses:
        src = np.asarray(src, np.int32)
        sampling.check_sampling(seed, num_samples, temperature, top_k, top_p)
        ids = np.arange(len(src), dtype=np.uint32) if sentence_ids is None else np.asarray(sentence_ids, np.uint32)
        settings = sampling.settings(temperature, top_k, top_p)
        # On one device: sampling is not data parallel over the mesh.
        tokens, logprob = jax.device_get(self._sample(self.local_params(), src, np.uint32(seed), ids, num_samples,
                                                      *settings))
        logprob = np.asarray(logprob, np.float32)
        return Hypotheses(np.asarray(tokens, np.int32), logprob, logprob.copy())

    def score(self, src: np.ndarray, tgt: np.ndarray) -> np.ndarray:
        return np.asarray(self._score(self.local_params(), np.asarray(src, np.int32), np.asarray(tgt, np.int32)),
                          np.float32)

    def cross_attention(self, src: np.ndarray, tgt_in: np.ndarray) -> np.ndarray:
        attention = self._cross_attention(self.local_params(), np.asarray(src, np.int32), np.asarray(tgt_in, np.int32))
        return np.asarray(attention, np.float32)  # (B, layers, H, T, S)

    def learning_rate(self, step: int) -> float:
        return float(noam_learning_rate(step, self.model_cfg.d_model, self.exp_cfg.warmup, self.exp_cfg.lr_factor))

    def save(self, meta: dict[str, Any], metrics: dict[str, float] | None = None) -> None:
        self.store.save(self._step, self.state, meta, metrics)

    def restore(self, which: str | int = "latest") -> dict[str, Any]:
        # Onto this mesh and layout whatever the checkpoint's (orbax reshards: 8 devices -> 1, replicated -> FSDP).
        abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                self.state, self.state_sharding)
        self.state, meta = self.store.restore(which, abstract)
        self._step = int(self.state["step"])
        self._whole_params = None
        return meta

    # State: flat {Flax path: NumPy array}, kernels (in, out)
    def weights(self) -> dict[str, np.ndarray]:
        return _to_flat(self.local_params())

    def export_state(self) -> TrainingState:
        local = sharding.local_copy(sharding.gather({k: self.state[k] for k in ("step", "opt_state")}, self.mesh))
        opt = local["opt_state"]
        counts = {"trainer step": int(local["step"]), "host step": self._step,
                  **{_key(path): int(c) for path, c in optax.tree_utils.tree_get_all_with_path(opt, "count")}}
        if len(set(counts.values())) != 1:
            raise ValueError(f"the JAX state's step counters disagree: {counts}")
        # torch keeps no moments before the first update; optax holds zeros
        mu, nu = (None if self._step == 0 else _to_flat(optax.tree_utils.tree_get(opt, name)) for name in ("mu", "nu"))
        rng = np.array(jax.random.key_data(sharding.local_copy(self.rng)), copy=True)
        state = TrainingState("jax", self._step, self.weights(), mu, nu, rng)
        state.check()
        return state

    def import_state(self, state: TrainingState) -> None:
        state.check("jax")
        old = self.state
        params = _from_flat(old["params"], state.params, "weights")
        template = optax.tree_utils.tree_get(old["opt_state"], "mu")
        moments = {} if state.mu is None else {
            "mu": _from_flat(template, state.mu, "Adam first moments (mu / exp_avg)"),
            "nu": _from_flat(template, state.nu, "Adam second moments (nu / exp_avg_sq)")}
        # Host values: one device array at every `count` would be donated twice by the first update (a segfault).
        opt_state = optax.tree_utils.tree_set(self.tx.init(params), count=np.asarray(state.step, np.int32), **moments)
        step = np.asarray(state.step, old["step"].dtype)
        self.state = sharding.place({"params": params, "opt_state": opt_state, "step": step}, self.state_sharding)
        self._step = state.step
        self._whole_params = None
        if state.rng is not None:
            self.rng = sharding.place(jax.random.wrap_key_data(np.asarray(state.rng, np.uint32)),
                                      sharding.replicated(self.mesh))


def _key(path: tuple) -> str:
    """A JAX tree path -> the dotted attribute path `encoder.layers.0.self_attn.q_proj.kernel`."""
    return ".".join(str(getattr(p, "key", getattr(p, "idx", getattr(p, "name", p)))) for p in path
                    if not (isinstance(p, jax.tree_util.GetAttrKey) and p.name == "value"))  # an nnx.Variable's value


def _to_flat(tree: Any) -> dict[str, np.ndarray]:
    """{attribute path: NumPy copy} of a parameter-shaped tree (the state's buffers are donated)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {_key(path): np.array(jax.device_get(leaf), copy=True) for path, leaf in leaves}


def _from_flat(template: Any, flat: Mapping[str, np.ndarray], what: str) -> Any:
    """`flat` as a tree of NumPy arrays shaped like `template`; keys, shapes and dtypes checked."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
    check_arrays(what, {_key(p): leaf for p, leaf in leaves}, flat)
    return jax.tree_util.tree_unflatten(treedef, [np.asarray(flat[_key(p)]) for p, _ in leaves])
