"""The PyTorch backend: `torch_reference.Transformer` with torch.optim, the same semantics as JAX.

Adam(0.9, 0.98, 1e-9) with `LambdaLR` on the paper's schedule; gradient accumulation by summed
per-token losses over the update's total target tokens; optional clipping written out with
optax's formula; optional `torch.compile` of the training forward pass. One device (CUDA when
available, else the CPU); data parallelism is the JAX backend's. `--dtype bfloat16` runs the
forward passes under `torch.autocast` (bfloat16 matmuls and activations, float32 parameters, Adam
state and gradients; the loss casts the logits to float32), the counterpart of the JAX model's
compute dtype.

Checkpoints are directories `checkpoints/<step>/` holding `model.safetensors` (weights, config in
the metadata), `optimizer.safetensors` (Adam's exp_avg and exp_avg_sq per parameter name, and the
CPU random generator state) and `meta.json` (step, scheduler position, data position, metrics).
Never pickle. A checkpoint is written to a temporary directory and renamed into place, so an
interrupted save leaves no directory that `restore` would pick.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

import torch_reference
from torch_reference import decode
from torch_reference.config import TransformerConfig
from torch_reference.objective import label_smoothed_cross_entropy, noam_learning_rate

from .backend import Metrics, Topology, best_of, choose_checkpoint, unreadable
from .config import ExperimentConfig
from .data import Batch

RNG_KEY = "__torch_cpu_rng_state__"
# The safetensors metadata key that parity.convert.load_torch_weights reads the config from
# (parity.convert.CONFIG_KEY; not imported, as parity.convert loads jax).
CONFIG_KEY = "transformer_config"


def _tensors(batch: Batch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # int64: what embeddings and cross_entropy's targets expect.
    arrays = (batch.src, batch.tgt_in, batch.tgt_out)
    return tuple(torch.from_numpy(a).to(device=device, dtype=torch.long) for a in arrays)


def initialize(exp_cfg: ExperimentConfig) -> Topology:
    """One process on one device: refuse the JAX backend's --devices and multi-process settings."""
    if exp_cfg.devices not in (None, 1):
        raise ValueError(f"--devices {exp_cfg.devices}: the torch backend trains on one device (use --backend jax)")
    if exp_cfg.coordinator_address or exp_cfg.num_processes not in (None, 1):
        raise ValueError("multi-process training (--coordinator-address, --num-processes) needs --backend jax")
    return Topology()


class TorchBackend:
    """`train.backend.Backend` for PyTorch; see the module docstring."""

    name = "torch"

    def __init__(self, exp_cfg: ExperimentConfig, model_cfg: TransformerConfig, checkpoint_dir: str | None = None):
        self.exp_cfg, self.model_cfg = exp_cfg, model_cfg
        self.topology = initialize(exp_cfg)
        torch.set_num_threads(exp_cfg.threads or len(os.sched_getaffinity(0)))
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        torch.manual_seed(exp_cfg.seed)
        self.model = torch_reference.Transformer(model_cfg).to(self.device)
        self.forward = torch.compile(self.model) if exp_cfg.compile else self.model
        # lr = 1 times the schedule's factor: LambdaLR multiplies the base lr by lr_lambda(epoch).
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
        # LambdaLR counts from 0 and sets lr_lambda(0) at construction; the paper counts from 1,
        # so update n (from 1) runs at lr(step=n), as optax's count + 1 on the JAX side.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda epoch: self.learning_rate(epoch + 1))
        self._checkpoint_dir = None if checkpoint_dir is None else Path(checkpoint_dir)

    # ------------------------------------------------------------------------------------------
    # Training and evaluation

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
        if self.exp_cfg.dtype == "bfloat16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _loss_sums(self, model, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        src, tgt_in, tgt_out = _tensors(batch, self.device)
        with self.autocast():
            logits = model(src, tgt_in)  # (B, T, V); bfloat16 under autocast, the loss casts to float32
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
        return {
            "loss": loss_total / total_tokens,
            "nll": nll_total / total_tokens,
            "grad_norm": grad_norm.detach(),
            "lr": lr,
            "tokens": total_tokens,
        }

    def fetch(self, metrics: Sequence[Metrics]) -> list[dict[str, float]]:
        return [{k: float(v) for k, v in m.items()} for m in metrics]

    @torch.no_grad()
    def eval_loss(self, batch: Batch):
        self.model.eval()
        loss_sum, nll_sum = self._loss_sums(self.model, batch)
        return loss_sum, nll_sum, batch.num_tgt_tokens

    def translate(self, src: np.ndarray, beam_size: int = 4, alpha: float = 0.6, cached: bool = True) -> np.ndarray:
        self.model.eval()
        src_t = torch.from_numpy(np.asarray(src)).to(device=self.device, dtype=torch.long)  # (B, S)
        with self.autocast():
            if beam_size == 1:
                tokens, _ = decode.greedy_search(self.model, src_t, cached=cached)
            else:
                tokens, _ = decode.beam_search(self.model, src_t, beam_size, alpha, cached=cached)
        return tokens.cpu().numpy().astype(np.int32)

    # ------------------------------------------------------------------------------------------
    # Checkpoints

    def _require_dir(self) -> Path:
        if self._checkpoint_dir is None:
            raise ValueError("this backend was created without a checkpoint directory")
        return self._checkpoint_dir

    def checkpoint_steps(self) -> list[int]:
        root = self._checkpoint_dir
        if root is None or not root.is_dir():
            return []
        return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit() and (p / "meta.json").is_file())

    def _read_meta(self, step: int) -> dict[str, Any]:
        return json.loads((self._require_dir() / str(step) / "meta.json").read_text())

    def save(self, meta: dict[str, Any], metrics: dict[str, float] | None = None) -> None:
        root = self._require_dir()
        root.mkdir(parents=True, exist_ok=True)
        step = self.step
        tmp = root / f".tmp-{step}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        weights = {k: v.detach().contiguous().cpu() for k, v in self.model.state_dict().items()}
        save_file(weights, str(tmp / "model.safetensors"), metadata={CONFIG_KEY: self.model_cfg.to_json()})
        names = {p: name for name, p in self.model.named_parameters()}
        moments = {RNG_KEY: torch.get_rng_state()}
        for p, state in self.optimizer.state.items():
            moments[f"{names[p]}.exp_avg"] = state["exp_avg"].detach().contiguous().cpu()
            moments[f"{names[p]}.exp_avg_sq"] = state["exp_avg_sq"].detach().contiguous().cpu()
        save_file(moments, str(tmp / "optimizer.safetensors"))
        record = {"step": step, "scheduler_last_epoch": self.scheduler.last_epoch, "metrics": metrics, "meta": meta}
        (tmp / "meta.json").write_text(json.dumps(record, indent=2))
        final = root / str(step)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)  # the checkpoint appears complete or not at all
        self._prune()

    def _prune(self) -> None:
        """Keep the newest `keep_checkpoints` and the best by BLEU; delete the others."""
        for stale in self._require_dir().glob(".tmp-*"):  # saves interrupted earlier
            shutil.rmtree(stale, ignore_errors=True)
        steps = self.checkpoint_steps()
        keep = set(steps[-self.exp_cfg.keep_checkpoints :])
        best = self._best(steps)
        if best is not None:
            keep.add(best)
        for s in steps:
            if s not in keep:
                shutil.rmtree(self._require_dir() / str(s))

    def restore(self, which: str | int = "latest") -> dict[str, Any]:
        steps = self.checkpoint_steps()
        step = choose_checkpoint(steps, which, self._best, self._checkpoint_dir)
        try:
            return self._restore(step)
        except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as err:
            raise unreadable(self._checkpoint_dir, step, steps, err) from err

    def _best(self, steps: list[int]) -> int | None:
        metrics = {}
        for s in steps:
            try:
                metrics[s] = self._read_meta(s)["metrics"]
            except (OSError, ValueError, KeyError) as err:
                raise unreadable(self._checkpoint_dir, s, steps, err) from err
        return best_of(metrics)

    def _restore(self, step: int) -> dict[str, Any]:
        directory = self._require_dir() / str(step)
        record = json.loads((directory / "meta.json").read_text())
        weights = load_file(str(directory / "model.safetensors"), device=str(self.device))
        self.model.load_state_dict(weights, strict=True)
        moments = load_file(str(directory / "optimizer.safetensors"))
        torch.set_rng_state(moments.pop(RNG_KEY))
        state = self.optimizer.state_dict()
        # torch.optim.Adam's own state layout, by parameter index; `step` as the float tensor it keeps.
        names = [name for name, _ in self.model.named_parameters()]
        adam_step = torch.tensor(float(record["step"]))
        state["state"] = {
            i: {"step": adam_step.clone(), "exp_avg": moments[f"{n}.exp_avg"], "exp_avg_sq": moments[f"{n}.exp_avg_sq"]}
            for i, n in enumerate(names)
            if f"{n}.exp_avg" in moments
        }
        self.optimizer.load_state_dict(state)
        self.scheduler.last_epoch = record["scheduler_last_epoch"]
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate(self.scheduler.last_epoch + 1)
        return record["meta"]

    def close(self) -> None:
        pass

    # ------------------------------------------------------------------------------------------
    # Weights

    def torch_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def load_torch_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.model.load_state_dict(dict(state_dict), strict=True)


def create(exp_cfg: ExperimentConfig, model_cfg: TransformerConfig, checkpoint_dir: str | None = None) -> TorchBackend:
    return TorchBackend(exp_cfg, model_cfg, checkpoint_dir)
