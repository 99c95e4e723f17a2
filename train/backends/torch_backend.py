"""The PyTorch backend: `torch_reference.Transformer` with torch.optim, DDP or FSDP on several devices."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import multiprocessing
import os
import socket
import sys
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel
from tqdm.auto import tqdm

import torch_reference
from torch_reference import decode, ensemble, sampling
from torch_reference.config import TransformerConfig, check_beam
from torch_reference.objective import label_smoothed_cross_entropy, noam_learning_rate

from ..checkpoints import TrainingState, check_arrays
from ..checkpoints.torch_store import TorchStore
from ..config import ExperimentConfig, default_dtype, resolve_kernels
from ..data import Batch
from ..runtime import Interrupted, UserError, user_errors
from ..runtime.files import OptionError, error_text
from .interface import Hypotheses, Metrics, StoreMethods, Topology


def _long(device: torch.device, *arrays: np.ndarray) -> tuple[torch.Tensor, ...]:
    """The arrays as int64 tensors on `device`: what embeddings and cross_entropy's targets expect."""
    return tuple(torch.from_numpy(np.asarray(a)).to(device=device, dtype=torch.long) for a in arrays)


def initialize(exp_cfg: ExperimentConfig) -> Topology:
    """Once per process: join the run's processes (torchrun's or `launch`'s) and set torch's threads."""
    if exp_cfg.coordinator_address or exp_cfg.num_processes not in (None, 1):
        raise OptionError("{} and {} are jax's: launch torch with torchrun", "coordinator_address", "num_processes")
    world = int(os.environ.get("WORLD_SIZE", 1))
    if exp_cfg.devices not in (None, world) and world > 1:
        raise OptionError("{} {n}: torchrun started {world} processes", "devices", n=exp_cfg.devices, world=world)
    gpu = torch.cuda.is_available()
    dist_backend = exp_cfg.dist_backend or ("nccl" if gpu else "gloo")
    if dist_backend == "nccl" and not gpu:
        raise OptionError("{} nccl needs CUDA GPUs and this machine has none: use gloo", "dist_backend")
    if gpu and max(world, exp_cfg.devices or 1) > torch.cuda.device_count():
        raise OptionError("{} {n}: {gpus} GPU(s) visible", "devices", n=max(world, exp_cfg.devices or 1),
                          gpus=torch.cuda.device_count())
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    torch.set_num_threads(exp_cfg.threads or max(1, len(os.sched_getaffinity(0)) // local))
    if world == 1:
        return Topology(platform="gpu" if gpu else "cpu")
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        # A peer that never comes (or dies while joining) ends the wait within this limit.
        dist.init_process_group(dist_backend, timeout=datetime.timedelta(minutes=10))
    return Topology(dist.get_rank(), world, world, "gpu" if gpu else "cpu")


@contextlib.contextmanager
def launch(exp_cfg: ExperimentConfig, target, **kwargs):
    """`--devices N` outside torchrun: processes 1..N-1 running `target(exp_cfg, **kwargs)` beside this one (0)."""
    if (exp_cfg.devices or 1) == 1 or "WORLD_SIZE" in os.environ:
        yield
        return
    with user_errors(ValueError):
        initialize(exp_cfg)  # its checks, before any process starts
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    n = exp_cfg.devices
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n)}
    spawn = multiprocessing.get_context("spawn")
    children = [spawn.Process(target=_process, args=({**env, "RANK": str(r), "LOCAL_RANK": str(r)}, target, exp_cfg,
                                                     kwargs), daemon=True) for r in range(1, n)]
    for child in children:
        child.start()
    saved = {k: os.environ.get(k) for k in (*env, "RANK", "LOCAL_RANK")}
    os.environ.update(env, RANK="0", LOCAL_RANK="0")
    try:
        yield
    except BaseException:
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    finally:
        for child in children:
            child.join(timeout=60)
            if child.is_alive():
                child.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def _process(env: dict[str, str], target, exp_cfg: ExperimentConfig, kwargs: dict) -> None:
    """A process `launch` started: `train.commands.run.main`'s endings (process 0 prints the resume command)."""
    os.environ.update(env)
    tqdm.set_lock(threading.RLock())  # not tqdm's multiprocessing lock: killed, this process would leak its semaphore
    try:
        target(exp_cfg, **kwargs)
    except (UserError, OSError) as err:
        print(f"error: {error_text(err)}", file=sys.stderr)
        sys.exit(1)
    except Interrupted as err:
        sys.exit(128 + err.signum)
    except KeyboardInterrupt:
        sys.exit(130)


def _collective(call, *args, **kwargs):
    """A torch.distributed call; a peer gone (killed, crashed) ends this process in one line."""
    try:
        return call(*args, **kwargs)
    except (RuntimeError, dist.DistError) as err:
        if isinstance(err, torch.OutOfMemoryError) or not dist.is_initialized():  # its own failure, not a peer's
            raise
        raise OptionError("process {rank} of {world}: another process of the run stopped ({kind} in {call}); {} "
                          "continues from the last checkpoint", "resume", rank=dist.get_rank(),
                          world=dist.get_world_size(), kind=type(err).__name__,
                          call=getattr(call, "__name__", "a collective")) from None


def leave() -> None:
    """This process's end of the process group, for a run that stops before it trains."""
    if dist.is_initialized():
        dist.destroy_process_group()


def allgather(array: np.ndarray) -> np.ndarray:
    """Every process's `array` (one shape in all), stacked in process order."""
    tensor = torch.from_numpy(array).to("cuda" if dist.get_backend() == "nccl" else "cpu")
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    _collective(dist.all_gather, gathered, tensor)
    return torch.stack(gathered).cpu().numpy()


def _like(param: torch.Tensor, value) -> torch.Tensor:
    """A whole array as a tensor laid out as `param`: sharded as it is under FSDP (each process holds it whole)."""
    value = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.array(value))
    if isinstance(param, DTensor):
        return distribute_tensor(value.to(param.device), param.device_mesh, param.placements)
    return value


def _sum_gradients(state, bucket):  # unannotated: DDP checks the annotations, strings here
    """DDP's hook: gradients summed over the processes (each loss is already over the global batch's tokens)."""
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda fut: fut.value()[0])


class TorchBackend(StoreMethods):
    """`train.backends.Backend` for PyTorch."""

    name = "torch"

    def __init__(self, exp_cfg: ExperimentConfig, model_cfg: TransformerConfig, checkpoint_dir: str | None = None):
        self.exp_cfg, self.model_cfg = exp_cfg, model_cfg
        self.distributed = dist.is_initialized()
        world = dist.get_world_size() if self.distributed else 1
        self.topology = Topology(dist.get_rank() if self.distributed else 0, world, world)
        self.device = torch.device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")
        platform = "gpu" if self.device.type == "cuda" else "cpu"
        self.dtype = exp_cfg.dtype or default_dtype(platform)
        self.kernels = resolve_kernels(exp_cfg.kernels, "torch", platform)
        torch.manual_seed(exp_cfg.seed)
        self.model = torch_reference.Transformer(model_cfg, self.kernels, exp_cfg.remat).to(self.device)
        self.forward = self.trained = self.model  # the module the updates go through, and the one they change
        # FSDP2: each process a shard of every array; self.model, whole, refreshed once per update (`_whole`).
        self.fsdp = exp_cfg.param_sharding == "fsdp" and self.distributed
        self._whole_step = 0
        if self.fsdp:
            self.forward = self.trained = copy.deepcopy(self.model)
            for module in (*self.trained.encoder.layers, *self.trained.decoder.layers, self.trained):
                fully_shard(module)
                module.set_gradient_divide_factor(1.0)  # summed, as `_sum_gradients`
                module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
        elif self.distributed:  # every process starts from process 0's weights (the same seed's anyway)
            self.forward = _collective(DistributedDataParallel, self.model, None if self.device.type == "cpu" else
                                       [self.device], forward_sync_buffers=False)  # its one buffer is a constant table
            self.forward.register_comm_hook(None, _sum_gradients)
        if exp_cfg.compile:
            self.forward = torch.compile(self.forward)
        # lr = 1 times the schedule's factor: LambdaLR multiplies the base lr by lr_lambda(epoch).
        self.optimizer = torch.optim.Adam(self.trained.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
        # LambdaLR counts from 0, the paper from 1: update n runs at lr(step=n), as optax's count + 1.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda epoch: self.learning_rate(epoch + 1))
        self.store = TorchStore(checkpoint_dir, exp_cfg.keep_checkpoints, model_cfg)

    @property
    def step(self) -> int:
        return self.scheduler.last_epoch

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def learning_rate(self, step: int) -> float:
        return noam_learning_rate(step, self.model_cfg.d_model, self.exp_cfg.warmup, self.exp_cfg.lr_factor)

    def autocast(self):
        """bfloat16 autocast for --dtype bfloat16 (parameters stay float32), else nothing."""
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=self.dtype == "bfloat16")

    def _loss_sums(self, model, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        src, tgt_in, tgt_out = _long(self.device, batch.src, batch.tgt_in, batch.tgt_out)
        segments = {}
        if batch.src_segments is not None:  # packed rows
            segments = dict(zip(("src_segments", "tgt_segments"),
                                _long(self.device, batch.src_segments, batch.tgt_segments)))
        with self.autocast():
            logits = model(src, tgt_in, **segments)  # (B, T, V); bfloat16 under autocast, the loss casts to float32
        pad = self.model_cfg.pad_id
        loss_sum = label_smoothed_cross_entropy(logits, tgt_out, pad, self.exp_cfg.label_smoothing, reduction="sum")
        with torch.no_grad():
            nll_sum = label_smoothed_cross_entropy(logits, tgt_out, pad, 0.0, reduction="sum")
        return loss_sum, nll_sum

    def _whole(self) -> torch.nn.Module:
        """The whole model at the current step (under FSDP gathered from the shards, by every process)."""
        if self.fsdp and self._whole_step != self.step:
            with torch.no_grad():
                for shard, whole in zip(self.trained.parameters(), self.model.parameters()):
                    whole.copy_(_collective(shard.full_tensor))
            self._whole_step = self.step
        return self.model

    def _rows(self, batch: Batch) -> Batch:
        """This process's rows of a global batch (`sharding.process_slice`'s); its token counts the global batch's."""
        index, count = self.topology.process_index, self.topology.process_count
        if count == 1 or batch.global_rows is not None:  # one process, or the Batcher gave this one's share
            return batch
        rows = len(batch.src)
        if rows % count:
            raise ValueError(f"a global batch of {rows} rows cannot be split over {count} processes")
        part = slice(index * rows // count, (index + 1) * rows // count)
        arrays = {k: None if getattr(batch, k) is None else getattr(batch, k)[part]
                  for k in ("src", "tgt_in", "tgt_out", "ids", "src_segments", "tgt_segments")}
        return dataclasses.replace(batch, **arrays, global_rows=rows)

    def train_step(self, batches: Sequence[Batch]) -> Metrics:
        self.trained.train()
        self.optimizer.zero_grad(set_to_none=True)
        total_tokens = sum(b.num_tgt_tokens for b in batches)  # of the global batches
        sums = torch.zeros(2, device=self.device)  # the loss's and the nll's, over the micro-batches
        for i, batch in enumerate(batches):
            # DDP sums the gradients over the processes in the last micro-batch's backward pass.
            last = not self.distributed or i == len(batches) - 1
            if self.fsdp:
                self.trained.set_requires_gradient_sync(last)
            with contextlib.nullcontext() if last or self.fsdp else self.forward.no_sync():
                loss_sum, nll_sum = _collective(self._loss_sums, self.forward, self._rows(batch))  # FSDP gathers
                # Sum over micro-batches of (loss sum / the update's tokens): one batch's gradient, as JAX.
                _collective((loss_sum / total_tokens).backward)
            sums = sums + torch.stack([loss_sum.detach(), nll_sum])
        if self.distributed:
            _collective(dist.all_reduce, sums)
        loss_total, nll_total = sums
        grads = [g.to_local() if isinstance(g := p.grad, DTensor) else g  # FSDP: this process's shards
                 for p in self.trained.parameters() if p.grad is not None]
        squares = sum(g.square().sum() for g in grads)
        if self.fsdp:
            _collective(dist.all_reduce, squares)
        grad_norm = torch.sqrt(squares)  # optax.tree.norm, before clipping
        if self.exp_cfg.clip_norm is not None:
            # optax.clip_by_global_norm's (g / ||g||) * max_norm, not clip_grad_norm_'s max_norm / (||g|| + 1e-6).
            max_norm = self.exp_cfg.clip_norm
            keep = grad_norm < max_norm
            with torch.no_grad():
                for g in grads:
                    g.copy_(torch.where(keep, g, (g / grad_norm) * max_norm))
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        return {"loss": loss_total / total_tokens, "nll": nll_total / total_tokens, "grad_norm": grad_norm.detach(),
                "lr": lr, "tokens": total_tokens}

    def fetch(self, metrics: Sequence[Metrics]) -> list[dict[str, float]]:
        return [{k: float(v) for k, v in m.items()} for m in metrics]

    @torch.no_grad()
    def eval_loss(self, batch: Batch):
        self._whole().eval()
        loss_sum, nll_sum = self._loss_sums(self.model, batch)
        return loss_sum, nll_sum, batch.num_tgt_tokens

    def translate(self, src: np.ndarray, beam_size: int = 4, alpha: float = 0.6, cached: bool = True,
                  scoring: str = "gnmt", n_best: int | None = None,
                  prefix: np.ndarray | None = None) -> np.ndarray | Hypotheses:
        self._whole().eval()
        (src_t,) = _long(self.device, src)  # (B, S)
        prefix_t = None if prefix is None else _long(self.device, prefix)[0]
        with self.autocast():
            if beam_size > 1:
                out = decode.beam_search(self.model, src_t, beam_size, alpha, cached=cached, scoring=scoring,
                                         n_best=n_best, prefix=prefix_t)
            else:
                tokens, logprob = out = decode.greedy_search(self.model, src_t, cached=cached, prefix=prefix_t)
                if n_best is not None:  # greedy's one-best list
                    check_beam(1, alpha, scoring, n_best)
                    penalty = decode.length_penalty((tokens != self.model_cfg.pad_id).sum(1).float(), alpha, scoring)
                    out = tokens[:, None], logprob[:, None], (logprob / penalty)[:, None]
        tokens = out[0].cpu().numpy().astype(np.int32)
        if n_best is None:
            return tokens
        return Hypotheses(tokens, out[1].float().cpu().numpy(), out[2].float().cpu().numpy())

    def sample(self, src: np.ndarray, seed: int, num_samples: int = 1, temperature: float = 1.0, top_k: int = 0,
               top_p: float = 1.0, sentence_ids: np.ndarray | None = None) -> Hypotheses:
        self._whole().eval()
        (src_t,) = _long(self.device, src)  # (B, S)
        with self.autocast():
            tokens, logprob = sampling.sample(self.model, src_t, seed, num_samples, temperature, top_k, top_p,
                                              sentence_ids=sentence_ids)  # (B, N, L), (B, N)
        logprob = logprob.float().cpu().numpy()
        return Hypotheses(tokens.cpu().numpy().astype(np.int32), logprob, logprob.copy())

    def ensemble(self, others: Sequence[TorchBackend], average: str = "logprob") -> None:
        self.members = [self.model, *(b.model for b in others)]
        self.model = self.forward = ensemble.Ensemble(self.members, average).eval()

    @torch.no_grad()
    def score(self, src: np.ndarray, tgt: np.ndarray) -> np.ndarray:
        self._whole().eval()
        with self.autocast():
            return decode.score(self.model, *_long(self.device, src, tgt)).float().cpu().numpy()

    @torch.no_grad()
    def cross_attention(self, src: np.ndarray, tgt_in: np.ndarray) -> np.ndarray:
        self._whole().eval()
        src_t, tgt_t = _long(self.device, src, tgt_in)
        with self.autocast():
            _, attention = self.model(src_t, tgt_t, return_attention=True)  # (B, layers, H, T, S)
        return attention.float().cpu().numpy()

    def weights(self) -> dict[str, np.ndarray]:
        return {k: v.detach().cpu().numpy().copy() for k, v in self._whole().state_dict().items()}

    def export_state(self) -> TrainingState:
        names = {p: name for name, p in self.trained.named_parameters()}
        moments = {names[p]: s for p, s in self.optimizer.state.items()}
        whole = lambda t: _collective(t.full_tensor) if isinstance(t, DTensor) else t.detach()  # noqa: E731 (FSDP)
        mu, nu = ({n: whole(s[key]).cpu().numpy().copy() for n, s in moments.items()} or None
                  for key in ("exp_avg", "exp_avg_sq"))
        rng = torch.get_rng_state().numpy().copy()
        state = TrainingState("torch", self.step, self.weights(), mu, nu, rng)
        state.check()
        return state

    def import_state(self, state: TrainingState) -> None:
        state.check("torch")
        check_arrays("PyTorch weights", {k: v.detach().cpu().numpy() for k, v in self.model.state_dict().items()},
                     state.params)
        with torch.no_grad():
            self.model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in state.params.items()}, strict=True)
        # torch.optim.Adam's own layout, by parameter index; `step` as the float tensor it keeps.
        optimizer_state = self.optimizer.state_dict()
        params = list(self.trained.named_parameters())
        adam_step = torch.tensor(float(state.step))
        optimizer_state["state"] = {} if state.mu is None else {
            i: {"step": adam_step.clone(), "exp_avg": _like(p, state.mu[n]), "exp_avg_sq": _like(p, state.nu[n])}
            for i, (n, p) in enumerate(params)}
        if self.fsdp:  # each process its shards of the whole weights just loaded
            with torch.no_grad():
                for (_, shard), whole in zip(params, self.model.parameters()):
                    shard.to_local().copy_(_like(shard, whole.detach()).to_local())
        self._whole_step = state.step
        self.optimizer.load_state_dict(optimizer_state)
        # LambdaLR's position is the number of updates done; the next runs at lr(step + 1).
        self.scheduler.last_epoch = state.step
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate(state.step + 1)
        if state.rng is not None:
            torch.set_rng_state(torch.from_numpy(np.asarray(state.rng, np.uint8)))

    # Checkpoints: export_state in the store, the store's state through import_state
    def save(self, meta: dict[str, Any], metrics: dict[str, float] | None = None) -> None:
        state = self.export_state() if self.fsdp or self.topology.is_main else None  # FSDP: gathered by all
        if self.topology.is_main:  # the same state in every process
            self.store.save(state, meta, metrics)
        if self.distributed:  # none goes on (and may resume) before the checkpoint is complete
            _collective(dist.barrier)

    def agreed_signal(self, signum: int | None) -> int | None:
        """A stop signal that any process of the distributed run received (all stop at the same update), or None."""
        flag = torch.tensor([signum or 0], device=self.device)
        _collective(dist.all_reduce, flag, dist.ReduceOp.MAX)
        return int(flag.item()) or None

    def restore(self, which: str | int = "latest") -> dict[str, Any]:
        return self.store.restore(which, self.import_state)
