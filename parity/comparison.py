"""The parity contract on one batch (`aiayn check`, docs/parity.md)."""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
import torch
from flax import nnx

import torch_reference
from jax_transformer.objective import label_smoothed_cross_entropy as jax_loss
from torch_reference.config import NON_NEGATIVE, POSITIVE, TransformerConfig
from torch_reference.objective import label_smoothed_cross_entropy as torch_loss
from train.interop.weights import jax_key, jax_params_to_torch, torch_to_jax
from train.options import Output, checked, option

# Bounds of the parity contract (float32, dropout off); base and big accumulate rounding over 12 wide layers.
BOUNDS = {"logits_max_abs": {"tiny": 1e-5, "small": 1e-5, "base": 1e-4, "big": 1e-4}, "loss_rel": 1e-6,
          "grad_rel_l2": {"tiny": 1e-5, "small": 1e-5, "base": 1e-4, "big": 1e-4}}

# ReLU inputs this close to 0 may round to either side (docs/parity.md#three-findings-behind-the-gradient-figures).
RELU_KINK_RADIUS = 1e-5

# Variants named in the parity contract, each a set of config overrides.
VARIANTS = {
    "paper": {},
    "pre-norm": {"norm_position": "pre"},
    "gelu": {"activation": "gelu"},
    "swiglu": {"activation": "swiglu"},
    "rmsnorm": {"norm": "rmsnorm"},
    "learned-positions": {"positions": "learned"},
    "untied": {"share_embeddings": False, "tie_output": False},
    "shared-untied-output": {"tie_output": False},
    "separate-vocabularies-tied": {"share_embeddings": False},
    "no-attention-bias": {"attention_bias": False},
    # HF Marian's (OPUS-MT): swish, sines then cosines, a logits bias, torch's eps, the decoder started by pad.
    "marian": {"activation": "silu", "positions": "sinusoidal_halves", "output_bias": True, "layer_norm_eps": 1e-5,
               "bos_id": 0},
}


def enable_parity_numerics() -> None:
    """Full float32 matmuls in both frameworks (accelerators default to TF32/bf16 passes)."""
    jax.config.update("jax_default_matmul_precision", "highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def environment() -> dict:
    """The device and the framework versions a report was measured with."""
    return {"device": jax.devices()[0].device_kind, "versions": {"jax": jax.__version__, "torch": torch.__version__}}


def random_batch(cfg: TransformerConfig, batch_size: int, src_len: int, tgt_len: int, seed: int) -> dict:
    """Token ids (int64) right-padded to random lengths, one row full, special ids only where they belong."""
    rng = np.random.default_rng(seed)
    first = max(cfg.pad_id, cfg.bos_id, cfg.eos_id) + 2  # ids below are special tokens

    def padded(vocab: int, length: int) -> np.ndarray:
        ids = rng.integers(first, vocab, size=(batch_size, length))
        lengths = rng.integers(1, length + 1, size=batch_size)
        lengths[0] = length
        ids[np.arange(length)[None, :] >= lengths[:, None]] = cfg.pad_id
        ids[np.arange(batch_size), lengths - 1] = cfg.eos_id
        return ids

    src, tgt_out = padded(cfg.src_vocab_size, src_len), padded(cfg.tgt_vocab_size, tgt_len)  # in this order
    tgt_in = np.concatenate([np.full((batch_size, 1), cfg.bos_id), tgt_out[:, :-1]], axis=1)
    return {"src": src, "tgt_in": tgt_in, "tgt_out": tgt_out}


def _diff(a: np.ndarray, b: np.ndarray, scale: np.ndarray | None = None) -> dict:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    norm = np.linalg.norm(b if scale is None else np.asarray(scale, np.float64))
    return {"max_abs": float(np.abs(a - b).max()),
            "rel_l2": float(np.linalg.norm(a - b) / norm) if norm > 0 else float(np.linalg.norm(a - b)),
            "ref_norm": float(norm)}


def gradient_scale_key(key: str) -> str:
    """The parameter whose gradient norm scales `key`'s: the k_proj bias's (analytically zero) its weight's."""
    return key.replace(".k_proj.bias", ".k_proj.weight") if key.endswith(".k_proj.bias") else key


def compare(torch_model: torch_reference.Transformer, jax_model, batch: dict) -> dict:
    """Logits, loss (label smoothing 0.1, the paper's) and every parameter's gradient of the two models on one batch."""
    cfg = torch_model.cfg
    t = {k: torch.from_numpy(v) for k, v in batch.items()}
    torch_model.zero_grad()
    torch_logits = torch_model(t["src"], t["tgt_in"])
    loss_t = torch_loss(torch_logits, t["tgt_out"], cfg.pad_id, 0.1)
    loss_t.backward()
    torch_grads = {k: p.grad for k, p in torch_model.named_parameters()}

    j = {k: jax.numpy.asarray(v, jax.numpy.int32) for k, v in batch.items()}

    def loss_fn(model):
        logits = model(j["src"], j["tgt_in"], deterministic=True)
        return jax_loss(logits, j["tgt_out"], cfg.pad_id, 0.1), logits

    (loss_j, jax_logits), grads = nnx.jit(nnx.value_and_grad(loss_fn, has_aux=True))(jax_model)
    flat = {jax_key(p): np.asarray(v[...]) for p, v in nnx.to_flat_state(grads)}
    jax_grads = jax_params_to_torch(flat, cfg)  # torch keys, kernels transposed back

    grad_diffs = {k: _diff(jax_grads[k].numpy(), torch_grads[k].numpy(), torch_grads[gradient_scale_key(k)].numpy())
                  for k in torch_grads}
    worst = max(grad_diffs, key=lambda k: grad_diffs[k]["rel_l2"])
    loss_t, loss_j = loss_t.item(), float(loss_j)
    return {"logits": _diff(np.asarray(jax_logits), torch_logits.detach().numpy()),
            "loss": {"torch": loss_t, "jax": loss_j, "rel": abs(loss_j - loss_t) / abs(loss_t)},
            "grads": {"max_rel_l2": grad_diffs[worst]["rel_l2"], "worst": worst, "per_parameter": grad_diffs}}


def relu_inputs_near_kink(torch_model: torch_reference.Transformer, batch: dict,
                          radius: float = RELU_KINK_RADIUS) -> dict:
    """ReLU inputs within `radius` of 0 in a float64 copy: where the frameworks' subgradients may differ."""
    model64 = copy.deepcopy(torch_model).double()  # its hooks go with it
    inputs = []
    for ff in (m for m in model64.modules() if isinstance(m, torch_reference.FeedForward)):
        ff.linear1.register_forward_hook(lambda mod, inp, out: inputs.append(out.detach().abs()))
    with torch.no_grad():
        model64(torch.from_numpy(batch["src"]), torch.from_numpy(batch["tgt_in"]))
    closest = min(float(x.min()) for x in inputs) if inputs else float("inf")
    return {"radius": radius, "units": int(sum(int((x < radius).sum()) for x in inputs)), "closest": closest}


def run_check(cfg: TransformerConfig, batch_size: int = 8, src_len: int = 23, tgt_len: int = 17, seed: int = 0) -> dict:
    """Logits, loss and gradient differences for one random model; ReLU at the kink: on the smooth path (GELU) too."""
    enable_parity_numerics()
    cfg = cfg.replace(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)  # dropout streams cannot be matched
    torch.manual_seed(seed)
    torch_model = torch_reference.Transformer(cfg)
    batch = random_batch(cfg, batch_size, src_len, tgt_len, seed)
    report = compare(torch_model, torch_to_jax(torch_model), batch)
    report["num_parameters"] = sum(p.numel() for p in torch_model.parameters())
    report["batch"] = {"batch_size": batch_size, "src_len": src_len, "tgt_len": tgt_len, "seed": seed}
    if cfg.activation == "relu":
        report["relu_kink"] = relu_inputs_near_kink(torch_model, batch)
        if report["relu_kink"]["units"]:
            smooth = torch_reference.Transformer(cfg.replace(activation="gelu"))
            smooth.load_state_dict(torch_model.state_dict())
            report["smooth_path_grads"] = compare(smooth, torch_to_jax(smooth), batch)["grads"]
    return report


def bounds_for(preset: str) -> dict:
    size = preset if preset in BOUNDS["logits_max_abs"] else "base"
    return {name: bound[size] if isinstance(bound, dict) else bound for name, bound in BOUNDS.items()}


def failures(report: dict, bounds: dict) -> list[str]:
    """The bounds a `run_check` report exceeds (`not <=`: a NaN exceeds every bound)."""
    grads = report["grads"]
    if not grads["max_rel_l2"] <= bounds["grad_rel_l2"] and "smooth_path_grads" in report:
        grads = report["smooth_path_grads"]  # the ReLU gradients differ by subgradient choices at the kink
    checks = [("logits max abs", report["logits"]["max_abs"], "logits_max_abs"),
              ("loss rel", report["loss"]["rel"], "loss_rel"),
              (f"gradient of {grads['worst']} rel L2", grads["max_rel_l2"], "grad_rel_l2")]
    return [f"{what} {value:.3g} > {bounds[bound]:g}" for what, value, bound in checks if not value <= bounds[bound]]


@checked
class Check:
    """A random `preset` model with `overrides` (or each of `VARIANTS`) on one random padded batch."""

    preset: str = option("tiny", "model size", choices=tuple(TransformerConfig.presets()))
    vocab_size: int = option(8000, "shared vocabulary size", range=POSITIVE)
    overrides: list[tuple[str, Any]] = option([], "override a TransformerConfig field, e.g. --set norm_position=pre",
                                              flag="--set", parse=TransformerConfig.parse_override,
                                              metavar="FIELD=VALUE")
    variants: bool = option(False, f"check every named variant in turn: {', '.join(VARIANTS)}")
    batch_size: int = option(8, "sentences in the batch", range=POSITIVE)
    src_len: int = option(23, "padded source length", range=POSITIVE)
    tgt_len: int = option(17, "padded target length", range=POSITIVE)
    seed: int = option(0, "the random model's and batch's seed", range=NON_NEGATIVE)
    json: Output = option(None, "write the full report (every parameter) to this file")

    def check(self) -> None:
        self.configs()  # a field value the config refuses: refused now, not after the first variant's work

    def configs(self) -> dict[str, TransformerConfig]:
        """The model of each comparison, by name."""
        overrides, configs = dict(self.overrides), {}
        for name, variant in (VARIANTS if self.variants else {"custom" if overrides else "paper": {}}).items():
            fields = {"src_vocab_size": self.vocab_size, "tgt_vocab_size": self.vocab_size, **variant, **overrides}
            if not fields.get("share_embeddings", True) and "tgt_vocab_size" not in overrides:
                fields["tgt_vocab_size"] = self.vocab_size + 7  # separate vocabularies: make them differ
            configs[name] = TransformerConfig.preset(self.preset, **fields)
        return configs


def check(options: Check) -> Iterator[tuple[str, dict]]:
    """(name, `run_check` report with config, bounds, seconds and `failures`) of each comparison in turn."""
    bounds = bounds_for(options.preset)
    for name, cfg in options.configs().items():
        start = time.perf_counter()
        report = run_check(cfg, options.batch_size, options.src_len, options.tgt_len, options.seed)
        report.update(config=cfg.to_dict(), bounds=bounds, seconds=round(time.perf_counter() - start, 2))
        report["failures"] = failures(report, bounds)
        yield name, report
