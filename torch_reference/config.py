"""The model configuration shared by both frameworks, and the rules both twins' searches, sampling
and ensembles check (one definition for the two).

This module imports neither torch nor jax: `torch_reference.TransformerConfig` and
`jax_transformer.TransformerConfig` are this one class, so a config saved next to a checkpoint
in one framework builds the identical model in the other.
"""

from __future__ import annotations

import array
import dataclasses
import json
import math
import operator
from typing import Any, Literal, get_args

NormPosition = Literal["post", "pre"]
# "silu" is SiLU/swish, x * sigmoid(x) (Marian's "swish").
Activation = Literal["relu", "gelu", "silu", "swiglu"]
Norm = Literal["layernorm", "rmsnorm"]
# "sinusoidal": the paper's table, sines and cosines interleaved (PE[p, 2i], PE[p, 2i+1]);
# "sinusoidal_halves": the same frequencies with every sine first and every cosine after them
# (Marian, HF's MarianSinusoidalPositionalEmbedding); "learned": a trained table.
Positions = Literal["sinusoidal", "sinusoidal_halves", "learned"]
# The kernel sets (how the same function is computed): the keys of both twins' KERNELS, in this order.
KernelSet = Literal["reference", "xla_cpu", "fused"]

_CHOICES = {"norm_position": NormPosition, "activation": Activation, "norm": Norm, "positions": Positions}

# The special tokens, by id (list position == id): the one definition that the tokenizers, the
# batches, the model's masks, the loss and the search all read.
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(len(SPECIAL_TOKENS))


# How a beam search scores and finishes hypotheses (`decode.beam_search` of either framework): GNMT's
# rules (Wu et al., 2016) or HF `generate(num_beams=k, early_stopping="never")`'s (docs/interop.md#hf-scoring).
SCORINGS = ("gnmt", "hf")


def _g(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)  # 2**32 in full, not 4.29497e+09


def float32_error(value: float) -> str | None:
    """Why a float setting means something else in float32, the dtype both twins compute in (a nonzero
    value that rounds to 0 there, a finite one beyond its range), or None: the one edge rule."""
    as32 = array.array("f", [value])[0]
    if (value != 0 and as32 == 0) or (math.isfinite(value) and not math.isfinite(as32)):
        return f"must keep its value in float32, the dtype it is computed in: {value:g} is {as32:g} there"
    return None


@dataclasses.dataclass(frozen=True)
class Range:
    """The values a numeric setting may take: `kind` int (bool refused) or float (finite; an int
    is accepted), at least `low`, above `above` (open), below `below` (open), at most `high`. The
    one rule both a config's validation and its command-line flag (`parser`, an argparse type) apply."""

    kind: type = int
    low: float | None = None
    above: float | None = None
    below: float | None = None
    high: float | None = None

    def error(self, value: Any) -> str | None:
        """Why `value` is not allowed ('must be >= 1, got 0'), or None when it is."""
        if isinstance(value, bool) or not isinstance(value, (int, float) if self.kind is float else int):
            return f"must be {'an integer' if self.kind is int else 'a number'}, got {value!r}"
        if self.kind is float and not math.isfinite(value):
            return f"must be finite, got {value}"
        if self.kind is float and (problem := float32_error(value)):
            return problem
        if self.low is not None and self.below is not None and not self.low <= value < self.below:
            return f"must be in [{_g(self.low)}, {_g(self.below)}), got {_g(value)}"
        if self.above is not None and self.high is not None and not self.above < value <= self.high:
            return f"must be in ({_g(self.above)}, {_g(self.high)}], got {_g(value)}"
        for bound, sign, holds in ((self.low, ">=", operator.ge), (self.above, ">", operator.gt),
                                   (self.below, "<", operator.lt), (self.high, "<=", operator.le)):
            if bound is not None and not holds(value, bound):
                return f"must be {sign} {_g(bound)}, got {_g(value)}"
        return None

    def check(self, name: str, value: Any) -> None:
        """ValueError naming `name` unless `value` is allowed."""
        if (problem := self.error(value)) is not None:
            raise ValueError(f"{name} {problem}")

    def parser(self, name: str | None = None):
        """An argparse `type=`: the value of its text, or ArgumentTypeError saying why not, `name` leading the
        message ('steps must be >= 1, got 0')."""
        import argparse

        def parse(text: str) -> int | float:
            try:
                value = self.kind(text)
            except ValueError:
                value = text
            if (problem := self.error(value)) is not None:
                raise argparse.ArgumentTypeError(f"{name} {problem}" if name else problem)
            return value

        return parse


POSITIVE, NON_NEGATIVE = Range(int, low=1), Range(int, low=0)
PROBABILITY = Range(float, low=0.0, below=1.0)  # dropout rates, label smoothing: [0, 1)
ALPHA = Range(float, low=0.0, below=10.0)  # a length penalty's: growing with length, finite in float32 up to 4096 tokens
# `sampling.sample`'s settings (either twin); the seed keys a uint32 function.
SAMPLING_RANGES = {"seed": Range(int, low=0, below=2**32), "num_samples": POSITIVE,
                   "temperature": Range(float, above=0.0), "top_k": NON_NEGATIVE,
                   "top_p": Range(float, above=0.0, high=1.0)}
# How an `ensemble.Ensemble` (either twin) averages its members, and what they must share: the searches
# read those fields from one `cfg` (and decode one vocabulary).
AVERAGES = ("logprob", "prob")
SHARED_FIELDS = ("src_vocab_size", "tgt_vocab_size", "pad_id", "bos_id", "eos_id")


def length_penalty(length, alpha: float, scoring: str = "gnmt"):
    """The divisor of a finished hypothesis's log-probability (`SCORINGS` says which), of a number or an array."""
    return ((5.0 + length) / 6.0) ** alpha if scoring == "gnmt" else length ** alpha


def output_length(src_len: int, max_len: int, max_len_a: float, max_len_b: int) -> int:
    """The padded output length of a search for a padded source length (a static shape on the JAX side)."""
    return max(1, min(max_len, math.floor(max_len_a * src_len + max_len_b)))


def check_beam(beam_size, alpha, scoring: str, n_best) -> None:
    """ValueError naming the first of a beam search's settings that is out of its range."""
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {', '.join(SCORINGS)}, got {scoring!r}")
    ALPHA.check("alpha", alpha)  # the early stop's bound needs a penalty that grows with length
    POSITIVE.check("beam_size", beam_size)
    if n_best is not None and (POSITIVE.error(n_best) or n_best > beam_size):
        raise ValueError(f"n_best must be between 1 and the beam size {beam_size}, got {n_best}")


def check_prefix_rows(src_ids, prefix, cfg: TransformerConfig, max_len_a: float, max_len_b: int) -> None:
    """`decode.check_prefix` of either twin past the ids' type and range, over tensors or arrays: ValueError
    unless prefix (B, P) has a row for each source (B, S), no <bos>, and each row leaves its sentence
    room for <eos> (fewer tokens than its length limit)."""
    if prefix.shape[0] != src_ids.shape[0]:
        raise ValueError(f"prefix must be (batch, length) with the batch of src_ids, {src_ids.shape[0]} rows; "
                         f"got shape {tuple(prefix.shape)}")
    if bool((prefix == cfg.bos_id).any()):  # every search masks it
        raise ValueError(f"prefix holds <bos> (id {cfg.bos_id}), which no output holds")
    src_len = (src_ids != cfg.pad_id).sum(1).tolist()
    for row, (n, used) in enumerate(zip(src_len, (prefix != cfg.pad_id).sum(1).tolist())):
        limit = output_length(n, cfg.max_len, max_len_a, max_len_b)
        if used and (used >= limit or n == 0):
            raise ValueError(f"the prefix of sentence {row} has {used} tokens: its length limit of {limit} tokens "
                             "leaves no room after it")


def check_sampling(seed, num_samples, temperature, top_k, top_p) -> None:
    """ValueError naming the first sampling setting out of its range (`SAMPLING_RANGES`)."""
    for (name, allowed), value in zip(SAMPLING_RANGES.items(), (seed, num_samples, temperature, top_k, top_p)):
        allowed.check(name, value)


def check_ensemble(configs, average: str) -> None:
    """ValueError unless `configs`, an ensemble's members', are some that share `SHARED_FIELDS`, and
    `average` is one of AVERAGES."""
    if not configs:
        raise ValueError("an ensemble needs at least one model, got none")
    if average not in AVERAGES:
        raise ValueError(f"average must be one of {', '.join(AVERAGES)}, got {average!r}")
    for i, cfg in enumerate(configs[1:], 1):
        for name in SHARED_FIELDS:
            if getattr(cfg, name) != getattr(configs[0], name):
                raise ValueError(f"ensemble members differ in {name}: model 0 has {getattr(configs[0], name)}, "
                                 f"model {i} has {getattr(cfg, name)}")
# Each numeric TransformerConfig field's range (checked by __post_init__, so by every entry point).
FIELD_RANGES = {
    "src_vocab_size": POSITIVE, "tgt_vocab_size": POSITIVE, "d_model": POSITIVE, "num_heads": POSITIVE,
    "d_ff": POSITIVE, "num_encoder_layers": NON_NEGATIVE, "num_decoder_layers": NON_NEGATIVE,
    "dropout": PROBABILITY, "attention_dropout": PROBABILITY, "activation_dropout": PROBABILITY, "max_len": POSITIVE,
    "pad_id": NON_NEGATIVE, "bos_id": NON_NEGATIVE, "eos_id": NON_NEGATIVE,
    "layer_norm_eps": Range(float, above=0.0),
}

# Sizes per preset. `base` and `big` are the paper's Table 3 rows; `small` and `tiny` are for CPUs.
_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(d_model=64, num_heads=4, d_ff=128, num_encoder_layers=2, num_decoder_layers=2, dropout=0.1),
    "small": dict(d_model=256, num_heads=4, d_ff=1024, num_encoder_layers=3, num_decoder_layers=3, dropout=0.1),
    "base": dict(d_model=512, num_heads=8, d_ff=2048, num_encoder_layers=6, num_decoder_layers=6, dropout=0.1),
    "big": dict(d_model=1024, num_heads=16, d_ff=4096, num_encoder_layers=6, num_decoder_layers=6, dropout=0.3),
}


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Architecture of the encoder-decoder Transformer ("Attention Is All You Need").

    The defaults are the paper's: post-norm residual blocks, ReLU feed-forward, sinusoidal
    positions, embeddings scaled by sqrt(d_model), source/target embeddings and the pre-softmax
    projection sharing one matrix (§3.4). Every departure is a field, so a variant is a config.

    Special token ids default to SPECIAL_TOKENS' (pad 0, bos 1, eos 2, unk 3), which the
    tokenizers of `train` use.
    """

    src_vocab_size: int = 8000
    tgt_vocab_size: int = 8000
    d_model: int = 512
    num_heads: int = 8
    d_ff: int = 2048
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    # Residual dropout on every sublayer output and on the embedding sums (paper §5.4).
    dropout: float = 0.1
    # Dropout on attention weights; the paper's base model does not use it.
    attention_dropout: float = 0.0
    # Dropout on the feed-forward activations, between the activation and linear2 (fairseq's
    # --activation-dropout); the paper's base model does not use it.
    activation_dropout: float = 0.0
    max_len: int = 512
    pad_id: int = PAD_ID
    # The decoder's start token. It may be the pad id (Marian starts its decoder with pad): then
    # `target_mask` still attends the start position; a search never emits either token.
    bos_id: int = BOS_ID
    eos_id: int = EOS_ID
    # tensor2tensor (the paper's public code) uses 1e-6; torch.nn.LayerNorm defaults to 1e-5 and
    # flax to 1e-6. Both models read this field, never a library default.
    layer_norm_eps: float = 1e-6
    norm_position: NormPosition = "post"
    activation: Activation = "relu"
    norm: Norm = "layernorm"
    positions: Positions = "sinusoidal"
    # Biases on the attention projections (torch.nn.MultiheadAttention has them; t2t does not).
    attention_bias: bool = True
    # One embedding matrix for source and target (needs one joint vocabulary).
    share_embeddings: bool = True
    # The pre-softmax projection reuses the target embedding matrix (paper §3.4).
    tie_output: bool = True
    # Multiply embeddings by sqrt(d_model) before adding positions (paper §3.4).
    scale_embeddings: bool = True
    # A bias added to the logits (Marian's `final_logits_bias`): the parameter `logits_bias` (V,).
    output_bias: bool = False

    def __post_init__(self):
        """Every field checked once, whatever built the config (CLI, JSON, Python): ValueError naming it."""
        for name, kind in _CHOICES.items():
            value, allowed = getattr(self, name), get_args(kind)
            if value not in allowed:
                raise ValueError(f"{name}={value!r} is not one of {', '.join(map(repr, allowed))}")
        for name, allowed in FIELD_RANGES.items():
            allowed.check(name, getattr(self, name))
        for name in ("attention_bias", "share_embeddings", "tie_output", "scale_embeddings", "output_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}")
        if self.share_embeddings and self.src_vocab_size != self.tgt_vocab_size:
            raise ValueError(f"share_embeddings needs one joint vocabulary, got src_vocab_size={self.src_vocab_size} "
                             f"and tgt_vocab_size={self.tgt_vocab_size}; set share_embeddings=False")
        ids = {"pad_id": self.pad_id, "bos_id": self.bos_id, "eos_id": self.eos_id}
        if self.eos_id in (self.pad_id, self.bos_id):
            raise ValueError("eos_id must differ from pad_id and bos_id (bos_id may equal pad_id), got "
                             + ", ".join(f"{k}={v}" for k, v in ids.items()))
        for name, value in ids.items():
            if value >= min(self.src_vocab_size, self.tgt_vocab_size):
                raise ValueError(f"{name}={value} must be below the vocabulary sizes "
                                 f"({self.src_vocab_size}, {self.tgt_vocab_size})")

    @classmethod
    def presets(cls) -> tuple[str, ...]:
        return tuple(_PRESETS)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "TransformerConfig":
        """A named size (`tiny`, `small`, `base`, `big`) with any field overridden.

        >>> TransformerConfig.preset("base", src_vocab_size=8000, tgt_vocab_size=8000).d_model
        512
        """
        if name not in _PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(_PRESETS)}")
        return cls(**{**_PRESETS[name], **overrides})

    @classmethod
    def parse_override(cls, text: str, exclude: tuple[str, ...] = ()) -> tuple[str, Any]:
        """'FIELD=VALUE' -> (field, value typed like the field), for `--set` flags of the CLIs.

        Fields in `exclude` are refused. Raises ValueError naming the choices.
        """
        key, sep, value = text.partition("=")
        fields = sorted({f.name for f in dataclasses.fields(cls)} - set(exclude))
        if not sep or key not in fields:
            raise ValueError(f"expected FIELD=VALUE with FIELD one of {', '.join(fields)}; got {text!r}")
        kind = type(getattr(cls(), key))
        if kind is bool:
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"{key} takes true or false, got {value!r}")
            return key, value.lower() in ("true", "1")
        try:
            return key, kind(value)
        except ValueError:
            raise ValueError(f"{key} takes {'an integer' if kind is int else 'a number'}, got {value!r}") from None

    def replace(self, **changes: Any) -> "TransformerConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TransformerConfig":
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"unknown TransformerConfig fields: {', '.join(map(repr, unknown))}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "TransformerConfig":
        return cls.from_dict(json.loads(text))
