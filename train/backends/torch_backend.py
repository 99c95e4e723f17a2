"""The PyTorch backend: `torch_reference.Transformer` with torch.optim, the same semantics as JAX, on
one device (CUDA when available, else the CPU). `--dtype bfloat16` runs the forward passes under
`torch.autocast`; checkpoints are `train.store.torch_store.TorchStore`'s (safetensors).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

import torch_reference
from torch_reference import decode, ensemble, sampling
from torch_reference.config import TransformerConfig
from torch_reference.objective import label_smoothed_cross_entropy, noam_learning_rate

from ..config import ExperimentConfig, default_dtype, resolve_kernels
from ..data import Batch
from ..store import TrainingState, check_keys
from ..store.torch_store import TorchStore
from .interface import Hypotheses, Metrics, StoreMethods, Topology, check_greedy_n_best


def _long(device: torch.device, *arrays: np.ndarray) -> tuple[torch.Tensor, ...]:
    """The arrays as int64 tensors on `device`: what embeddings and cross_entropy's targets expect."""
    return tuple(torch.from_numpy(np.asarray(a)).to(device=device, dtype=torch.long) for a in arrays)


def initialize(exp_cfg: ExperimentConfig) -> Topology:
    """Once per process, where a CLI starts: refuse the JAX backend's --devices and multi-process
    settings (one process, one device), and set torch's intra-op threads (--threads)."""
    if exp_cfg.devices not in (None, 1):
        raise ValueError(f"--devices {exp_cfg.devices}: the torch backend trains on one device (use --backend jax)")
    if exp_cfg.param_sharding != "replicated":
        raise ValueError(f"--param-sharding {exp_cfg.param_sharding}: the torch backend trains on one device "
                         "(use --backend jax)")
    if exp_cfg.coordinator_address or exp_cfg.num_processes not in (None, 1):
        raise ValueError("multi-process training (--coordinator-address, --num-processes) needs --backend jax")
    torch.set_num_threads(exp_cfg.threads or len(os.sched_getaffinity(0)))
    return Topology(platform="gpu" if torch.cuda.is_available() else "cpu")


class TorchBackend(StoreMethods):
    """`train.backends.Backend` for PyTorch."""

    name = "torch"

    def __init__(self, exp_cfg: ExperimentConfig, model_cfg: TransformerConfig, checkpoint_dir: str | None = None):
        self.exp_cfg, self.model_cfg = exp_cfg, model_cfg
        self.topology = Topology()
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        platform = "gpu" if self.device.type == "cuda" else "cpu"
        self.dtype = exp_cfg.dtype or default_dtype(platform)
        self.kernels = resolve_kernels(exp_cfg.kernels, "torch", platform)
        torch.manual_seed(exp_cfg.seed)
        self.model = torch_reference.Transformer(model_cfg, self.kernels, exp_cfg.remat).to(self.device)
        self.forward = torch.compile(self.model) if exp_cfg.compile else self.model
        # lr = 1 times the schedule's factor: LambdaLR multiplies the base lr by lr_lambda(epoch).
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
        # LambdaLR counts from 0 and sets lr_lambda(0) at construction; the paper counts from 1,
        # so update n (from 1) runs at lr(step=n), as optax's count + 1 on the JAX side.
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
        if self.dtype == "bfloat16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

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

    def train_step(self, batches: Sequence[Batch]) -> Metrics:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total_tokens = sum(b.num_tgt_tokens for b in batches)
        loss_total = nll_total = torch.zeros((), device=self.device)
        for batch in batches:
            loss_sum, nll_sum = self._loss_sums(self.forward, batch)
            # Sum over micro-batches of (loss sum / the update's tokens): the gradient of one
            # batch holding all of them, as on the JAX side.
            (loss_sum / total_tokens).backward()
            loss_total, nll_total = loss_total + loss_sum.detach(), nll_total + nll_sum
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        grad_norm = torch.sqrt(sum(g.square().sum() for g in grads))  # optax.tree.norm, before clipping
        if self.exp_cfg.clip_norm is not None:
            # optax.clip_by_global_norm: g unchanged when ||g|| < max_norm, else (g / ||g||) * max_norm.
            # Not torch.nn.utils.clip_grad_norm_, which scales by max_norm / (||g|| + 1e-6).
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
        self.model.eval()
        loss_sum, nll_sum = self._loss_sums(self.model, batch)
        return loss_sum, nll_sum, batch.num_tgt_tokens

    def translate(self, src: np.ndarray, beam_size: int = 4, alpha: float = 0.6, cached: bool = True,
                  scoring: str = "gnmt", n_best: int | None = None,
                  prefix: np.ndarray | None = None) -> np.ndarray | Hypotheses:
        self.model.eval()
        (src_t,) = _long(self.device, src)  # (B, S)
        prefix_t = None if prefix is None else _long(self.device, prefix)[0]
        with self.autocast():
            if beam_size == 1:
                tokens, logprob = decode.greedy_search(self.model, src_t, cached=cached, prefix=prefix_t)
                if n_best is not None:
                    check_greedy_n_best(n_best)
                    penalty = decode.length_penalty((tokens != self.model_cfg.pad_id).sum(1).float(), alpha, scoring)
                    tokens, logprob, score = tokens[:, None], logprob[:, None], (logprob / penalty)[:, None]
            elif n_best is None:
                tokens, _ = decode.beam_search(self.model, src_t, beam_size, alpha, cached=cached, scoring=scoring,
                                               prefix=prefix_t)
            else:
                tokens, logprob, score = decode.beam_search(self.model, src_t, beam_size, alpha, cached=cached,
                                                            scoring=scoring, n_best=n_best, prefix=prefix_t)
        tokens = tokens.cpu().numpy().astype(np.int32)
        if n_best is None:
            return tokens
        return Hypotheses(tokens, logprob.float().cpu().numpy(), score.float().cpu().numpy())

    def sample(self, src: np.ndarray, seed: int, num_samples: int = 1, temperature: float = 1.0, top_k: int = 0,
               top_p: float = 1.0, sentence_ids: np.ndarray | None = None) -> Hypotheses:
        self.model.eval()
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
        self.model.eval()
        with self.autocast():
            return decode.score(self.model, *_long(self.device, src, tgt)).float().cpu().numpy()

    @torch.no_grad()
    def cross_attention(self, src: np.ndarray, tgt_in: np.ndarray) -> np.ndarray:
        self.model.eval()
        src_t, tgt_t = _long(self.device, src, tgt_in)
        with self.autocast():
            _, attention = self.model(src_t, tgt_t, return_attention=True)  # (B, layers, H, T, S)
        return attention.float().cpu().numpy()

    def weights(self) -> dict[str, np.ndarray]:
        return {k: v.detach().cpu().numpy().copy() for k, v in self.model.state_dict().items()}

    def export_state(self) -> TrainingState:
        names = {p: name for name, p in self.model.named_parameters()}
        moments = {names[p]: s for p, s in self.optimizer.state.items()}
        mu = {n: s["exp_avg"].detach().cpu().numpy().copy() for n, s in moments.items()} or None
        nu = {n: s["exp_avg_sq"].detach().cpu().numpy().copy() for n, s in moments.items()} or None
        rng = torch.get_rng_state().numpy().copy()
        state = TrainingState("torch", self.step, self.weights(), mu, nu, rng)
        state.check()
        return state

    def import_state(self, state: TrainingState) -> None:
        if state.framework != "torch":
            raise ValueError(f"a {state.framework} training state: convert it to torch's layout first (parity.convert)")
        state.check()
        current = self.model.state_dict()
        check_keys("PyTorch weights", {k: tuple(v.shape) for k, v in current.items()}, {k: np.shape(v) for k, v in state.params.items()})
        wrong = [f"{k}: expected {current[k].dtype}, got {v.dtype}" for k, v in state.params.items()
                 if v.dtype != current[k].detach().cpu().numpy().dtype]
        if wrong:
            raise ValueError("weights have other dtypes than the target:\n  " + "\n  ".join(wrong))
        with torch.no_grad():
            self.model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in state.params.items()}, strict=True)
        # torch.optim.Adam's own layout, by parameter index; `step` as the float tensor it keeps.
        optimizer_state = self.optimizer.state_dict()
        names = [name for name, _ in self.model.named_parameters()]
        adam_step = torch.tensor(float(state.step))
        optimizer_state["state"] = {} if state.mu is None else {
            i: {"step": adam_step.clone(), "exp_avg": torch.from_numpy(np.array(state.mu[n])),
                "exp_avg_sq": torch.from_numpy(np.array(state.nu[n]))}
            for i, n in enumerate(names)}
        self.optimizer.load_state_dict(optimizer_state)
        # LambdaLR's position is the number of updates done; the next runs at lr(step + 1).
        self.scheduler.last_epoch = state.step
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate(state.step + 1)
        if state.rng is not None:
            torch.set_rng_state(torch.from_numpy(np.asarray(state.rng, np.uint8)))

    # Checkpoints: export_state in the store, the store's state through import_state
    def save(self, meta: dict[str, Any], metrics: dict[str, float] | None = None) -> None:
        self.store.save(self.export_state(), meta, metrics)

    def restore(self, which: str | int = "latest") -> dict[str, Any]:
        return self.store.restore(which, self.import_state)
