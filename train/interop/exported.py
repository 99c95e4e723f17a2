"""Decoding over an export of `aiayn convert --to onnx|stablehlo`, without the model's code: ONNX Runtime sessions or
`jax.export.deserialize`d programs stand in for the model that torch_reference/decode.py's searches call (`encode`,
`init_cache`, `decode_step`), so greedy, beam, n-best, length limits and scoring are the project's own."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from torch_reference import decode
from torch_reference.config import TransformerConfig, check_beam
from torch_reference.objective import label_smoothed_cross_entropy

from .. import runtime
from ..backends.interface import Hypotheses, Topology
from ..data import spm

ONNX_FILES = ("encoder_model.onnx", "decoder_with_past_model.onnx")  # Optimum's names for Marian
STABLEHLO_FILES = ("encoder.stablehlo", "decoder_step.stablehlo", "weights.npz")


def quantized(name: str) -> str:
    return name.replace(".onnx", "_quantized.onnx")


class OnnxPrograms:
    """The encoder and the decoder step (Optimum's `past_key_values.{i}.decoder.key` names) in ONNX Runtime sessions."""

    grows = True  # the self-attention cache is concatenated step by step, from length 0

    def __init__(self, directory: Path, int8: bool = False, threads: int = 0):
        ort = spm.require("onnxruntime", "export")
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.encoder, self.decoder = (ort.InferenceSession(str(directory / (quantized(n) if int8 else n)), options,
                                                           providers=["CPUExecutionProvider"]) for n in ONNX_FILES)
        self.layers = (len(self.encoder.get_outputs()) - 1) // 2

    def encode(self, ids: np.ndarray, mask: np.ndarray) -> list[np.ndarray]:
        return self.encoder.run(None, {"input_ids": ids.astype(np.int64), "attention_mask": mask.astype(np.int64)})[1:]

    def step(self, last, selfs, crosses, position: int, mask) -> tuple[np.ndarray, list[np.ndarray]]:
        feeds = {"input_ids": last[:, None].astype(np.int64), "encoder_attention_mask": mask.astype(np.int64)}
        for i in range(self.layers):
            for j, which in enumerate(("key", "value")):
                feeds[f"past_key_values.{i}.decoder.{which}"] = selfs[2 * i + j]
                feeds[f"past_key_values.{i}.encoder.{which}"] = crosses[2 * i + j]
        logits, *present = self.decoder.run(None, feeds)
        return logits[:, 0], present


class StableHloPrograms:
    """The encoder and one decoder step as `jax.export` programs taking the weights (weights.npz) first."""

    grows = False

    def __init__(self, directory: Path):
        import jax
        from jax import export

        # jitted once: an eager `call` would compile the same way but copy the weights in again at every step
        self.encoder, self.decoder = (jax.jit(export.deserialize(bytearray((directory / n).read_bytes())).call)
                                      for n in STABLEHLO_FILES[:2])
        with np.load(directory / STABLEHLO_FILES[2]) as weights:
            self.weights = jax.device_put([weights[f"w{i}"] for i in range(len(weights.files))])

    def encode(self, ids: np.ndarray, mask: np.ndarray) -> list[np.ndarray]:
        return list(self.encoder(self.weights, ids.astype(np.int32), mask.astype(np.int32)))

    def step(self, last, selfs, crosses, position: int, mask) -> tuple[np.ndarray, list[np.ndarray]]:
        return self.decoder(self.weights, last.astype(np.int32), selfs, crosses, np.int32(position),
                            mask.astype(np.int32))


def _torch(a) -> torch.Tensor:
    """ONNX Runtime's outputs as they are; JAX's copied (read-only)."""
    return torch.from_numpy(a if isinstance(a, np.ndarray) and a.flags.writeable else np.array(a, copy=True))


class ExportedModel:
    """What the searches of torch_reference/decode.py call of a model, over `programs`; tensors cross as NumPy."""

    def __init__(self, programs, cfg: TransformerConfig):
        self.programs, self.cfg = programs, cfg

    def encode(self, src_ids: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        """-> every layer's cross-attention keys and values, flattened into one (B, ...) tensor: the searches copy
        its rows for each hypothesis (repeat_interleave), as they would the memory, then `init_cache` it."""
        crosses = self.programs.encode(src_ids.numpy(), src_mask.reshape(len(src_ids), -1).numpy())
        self.cross_shape = crosses[0].shape[1:]
        return torch.cat([_torch(c).flatten(1) for c in crosses], 1)

    def init_cache(self, memory: torch.Tensor, length: int) -> list[dict[str, torch.Tensor]]:
        # contiguous once a batch: `unbind` gives views, which each step's `.contiguous()` would copy
        crosses = [c.contiguous() for c in memory.reshape(len(memory), -1, *self.cross_shape).unbind(1)]
        H, _, K = self.cross_shape
        empty = torch.zeros(len(memory), H, 0 if self.programs.grows else length, K)
        pairs = zip(crosses[::2], crosses[1::2])
        return [{"self_k": empty, "self_v": empty, "cross_k": k, "cross_v": v} for k, v in pairs]

    def decode_step(self, tgt_ids, cache, position: int, src_mask) -> tuple[torch.Tensor, list[dict]]:
        selfs = [c[n].contiguous().numpy() for c in cache for n in ("self_k", "self_v")]
        crosses = [c[n].contiguous().numpy() for c in cache for n in ("cross_k", "cross_v")]
        mask = src_mask.reshape(len(tgt_ids), -1).numpy()
        logits, selfs = self.programs.step(tgt_ids.numpy(), selfs, crosses, position, mask)
        return _torch(logits), [{**c, "self_k": _torch(k), "self_v": _torch(v)}
                                for c, k, v in zip(cache, selfs[::2], selfs[1::2])]

    def forced_logits(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        """src (B, S), tgt_in (B, T) (<bos> then the target) -> logits (B, T, V), one cached step a position."""
        src_mask = src != self.cfg.pad_id
        cache, steps = self.init_cache(self.encode(src, src_mask), tgt_in.shape[1]), []
        for position in range(tgt_in.shape[1]):
            logits, cache = self.decode_step(tgt_in[:, position], cache, position, src_mask)
            steps.append(logits)
        return torch.stack(steps, 1)


def programs(directory: str | Path, int8: bool | None = None, threads: int = 0):
    """The programs of the export at `directory` (ONNX: its int8 graphs where it has them, unless `int8` is False)."""
    directory = Path(directory)
    runtime.check_export(directory)
    if runtime.kind_of(directory) == "stablehlo":
        return StableHloPrograms(directory)
    return OnnxPrograms(directory, (directory / quantized(ONNX_FILES[0])).is_file() if int8 is None else int8, threads)


class ExportBackend:
    """A `Translator` over an export (what `train.load` of its directory holds): searches and scores."""

    topology, device = Topology(), "cpu"

    def __init__(self, programs, cfg: TransformerConfig, step: int, label_smoothing: float = 0.1):
        self.model, self.model_cfg, self.step = ExportedModel(programs, cfg), cfg, step
        self.label_smoothing = label_smoothing  # the run's, for evaluate's loss

    def translate(self, src: np.ndarray, beam_size: int = 4, alpha: float = 0.6, cached: bool = True,
                  scoring: str = "gnmt", n_best: int | None = None, prefix: np.ndarray | None = None):
        if not cached:
            raise runtime.UserError("an export decodes with its cache only (cached=False needs the run)")
        src_t, prefix_t = torch.as_tensor(src, dtype=torch.long), None if prefix is None else torch.as_tensor(
            prefix, dtype=torch.long)
        if beam_size > 1:
            out = decode.beam_search(self.model, src_t, beam_size, alpha, scoring=scoring, n_best=n_best,
                                     prefix=prefix_t)
        else:
            tokens, logprob = out = decode.greedy_search(self.model, src_t, prefix=prefix_t)
            if n_best is not None:  # greedy's one-best list, as the backends give it
                check_beam(1, alpha, scoring, n_best)
                penalty = decode.length_penalty((tokens != self.model_cfg.pad_id).sum(1).float(), alpha, scoring)
                out = tokens[:, None], logprob[:, None], (logprob / penalty)[:, None]
        tokens = out[0].numpy().astype(np.int32)
        return tokens if n_best is None else Hypotheses(tokens, out[1].float().numpy(), out[2].float().numpy())

    def score(self, src: np.ndarray, tgt: np.ndarray) -> np.ndarray:
        tgt_t = torch.as_tensor(tgt, dtype=torch.long)
        tgt_in = torch.cat([torch.full_like(tgt_t[:, :1], self.model_cfg.bos_id), tgt_t[:, :-1]], 1)
        logits = self.model.forced_logits(torch.as_tensor(src, dtype=torch.long), tgt_in)
        logprobs = torch.log_softmax(logits.float(), -1).gather(2, tgt_t[..., None])[..., 0]
        return torch.where(tgt_t == self.model_cfg.pad_id, 0.0, logprobs).numpy()

    def eval_loss(self, batch) -> tuple[float, float, int]:
        """(label-smoothed loss sum, NLL sum, target tokens) of a padded batch, teacher-forced through the programs."""
        logits = self.model.forced_logits(*(torch.as_tensor(a, dtype=torch.long) for a in (batch.src, batch.tgt_in)))
        tgt = torch.as_tensor(batch.tgt_out, dtype=torch.long)
        sums = (label_smoothed_cross_entropy(logits, tgt, self.model_cfg.pad_id, eps, reduction="sum")
                for eps in (self.label_smoothing, 0.0))
        return *map(float, sums), batch.num_tgt_tokens

    def sample(self, *args, **kwargs):
        raise runtime.UserError("sampling needs the run's model: an export decodes by greedy and beam search only")

    def cross_attention(self, *args, **kwargs):
        raise runtime.UserError("attention weights need the run's model: an export's programs do not return them")

    def close(self) -> None:
        self.model = None
