"""The model configuration of both frameworks (one class, so a config saved in one builds the same model in the
other), how any setting is declared and checked (`setting`), and the rules the twins' searches, sampling and
ensembles check. It imports neither torch nor jax."""

from __future__ import annotations

import array
import dataclasses
import functools
import json
import math
import numbers
import operator
import os
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

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

# The special tokens, by id (list position == id): the tokenizers', batches', masks', loss's and searches' one.
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(len(SPECIAL_TOKENS))


# How a beam search scores and finishes hypotheses (`decode.beam_search` of either framework): GNMT's
# rules (Wu et al., 2016) or HF `generate(num_beams=k, early_stopping="never")`'s (docs/interop.md#hf-scoring).
SCORINGS = ("gnmt", "hf")


def _g(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)  # 2**32 in full, not 4.29497e+09


def float32_error(value: float) -> str | None:
    """Why a float setting means another value in float32, the twins' dtype (0, or infinite, there), or None."""
    as32 = array.array("f", [value])[0]
    if (value != 0 and as32 == 0) or (math.isfinite(value) and not math.isfinite(as32)):
        return f"must keep its value in float32, the dtype it is computed in: {value:g} is {as32:g} there"
    return None


class SettingError(ValueError):
    """A refused setting, one line: `template`'s `{}`s the `names` (`beam`, `worded`: `--beam`), `{key}`s `values`."""

    def __init__(self, template: str, *names: str, **values: Any):
        self.template, self.names, self.values = template, names, values
        super().__init__(self.worded(str))

    def worded(self, name_of) -> str:
        return self.template.format(*map(name_of, self.names), **self.values)


def escaped(text: str) -> str:
    """`text` inside a SettingError template: its braces are no parameter's place."""
    return text.replace("{", "{{").replace("}", "}}")


@dataclasses.dataclass(frozen=True)
class Range:
    """A numeric setting's values: `kind` int or float (finite), in `low`/`above` .. `below`/`high` (closed/open)."""

    kind: type = int
    low: float | None = None
    above: float | None = None
    below: float | None = None
    high: float | None = None

    def error(self, value: Any) -> str | None:
        """Why `value` is not allowed ('must be >= 1, got 0'), or None when it is."""
        kind = numbers.Real if self.kind is float else numbers.Integral
        if isinstance(value, bool) or not isinstance(value, kind):
            return f"must be {'an integer' if self.kind is int else 'a number'}, got {value!r}"
        shown = repr(value if type(value) in (int, float) else self.kind(value))  # as given: 1.0000001, not 1
        value = self.kind(value)
        if self.kind is float and not math.isfinite(value):
            return f"must be finite, got {value}"
        if self.kind is float and (problem := float32_error(value)):
            return problem
        if self.low is not None and self.below is not None and not self.low <= value < self.below:
            return f"must be in [{_g(self.low)}, {_g(self.below)}), got {shown}"
        if self.above is not None and self.high is not None and not self.above < value <= self.high:
            return f"must be in ({_g(self.above)}, {_g(self.high)}], got {shown}"
        for bound, sign, holds in ((self.low, ">=", operator.ge), (self.above, ">", operator.gt),
                                   (self.below, "<", operator.lt), (self.high, "<=", operator.le)):
            if bound is not None and not holds(value, bound):
                return f"must be {sign} {_g(bound)}, got {shown}"
        return None

    def check(self, name: str, value: Any, error: type[SettingError] | None = None) -> None:
        """`error` (a SettingError) naming `name` unless `value` is allowed."""
        if (problem := self.error(value)) is not None:
            raise (error or SettingError)("{} " + escaped(problem), name)


def setting(default: Any, *, range: Range | None = None, choices: tuple | None = None, **meta: Any) -> Any:
    """A dataclass field with its rule (`range`, `choices`) and its flag's `meta` (help, flag, metavar, ...)."""
    meta = {**meta, **({"range": range} if range else {}), **({"choices": choices} if choices else {})}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@functools.cache
def hints(cls: type) -> dict[str, Any]:
    """The annotations of dataclass `cls` as objects (`from __future__ import annotations` leaves them text)."""
    return typing.get_type_hints(cls)


def kind_of(hint: Any) -> tuple[Any, bool]:
    """(annotation `hint` without None: one type, or the Union of the rest; whether it allows None)."""
    args = get_args(hint) if get_origin(hint) in (Union, types.UnionType) else (hint,)
    rest = tuple(arg for arg in args if arg is not type(None))
    return rest[0] if len(rest) == 1 else Union[rest], len(rest) < len(args)


def setting_error(field: dataclasses.Field, value: Any, hint: Any) -> tuple[str | None, Any]:
    """(why `value` breaks `field`'s `range`, `choices` or type `hint`, or None; the value as kept: int, float...)."""
    kind, optional = kind_of(hint)
    if value is None and optional:
        return None, value
    if (allowed := field.metadata.get("range")) is not None:
        problem = allowed.error(value)
        return problem, value if problem else allowed.kind(value)
    if kind is str and isinstance(value, os.PathLike):  # run_dir=Path(...)
        value = os.fspath(value)
    expected = {bool: "true or false", str: "a string", dict: "a dict"}.get(kind)
    if expected and not isinstance(value, kind):  # booleans only as booleans: 1 and "yes" are not True
        return f"must be {expected}, got {value!r}", value
    if (choices := field.metadata.get("choices")) is not None and value not in choices:
        return f"must be one of {', '.join(map(str, choices))}, got {value!r}", value
    return None, value


def check_settings(obj: Any, error: type[SettingError] = SettingError) -> None:
    """`error` naming the first field of the dataclass `obj` that `setting_error` refuses; each kept as it says."""
    for field in dataclasses.fields(obj):
        problem, value = setting_error(field, getattr(obj, field.name), hints(type(obj))[field.name])
        if problem is not None:
            raise error("{} " + escaped(problem), field.name)
        object.__setattr__(obj, field.name, value)


class Settings:
    """A dataclass of `setting`s: replaced, made into and from a dict (its unknown keys refused)."""

    def replace(self, **changes: Any) -> typing.Self:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> typing.Self:
        if unknown := sorted(set(data) - set(hints(cls))):
            raise ValueError(f"unknown {cls.__name__} fields: {', '.join(map(repr, unknown))}")
        return cls(**data)


POSITIVE, NON_NEGATIVE = Range(int, low=1), Range(int, low=0)
LENGTH = Range(int, low=1, high=1 << 16)  # tokens of a sequence: a position table, a search's steps
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
    """SettingError naming the first of a beam search's settings out of range (`train.options.Search`'s too)."""
    if scoring not in SCORINGS:
        raise SettingError("{} " + f"must be one of {', '.join(SCORINGS)}, got {scoring!r}", "scoring")
    ALPHA.check("alpha", alpha)  # the early stop's bound needs a penalty that grows with length
    POSITIVE.check("beam_size", beam_size)
    if n_best is not None and (POSITIVE.error(n_best) or n_best > beam_size):
        raise SettingError("{} must be between 1 and {} " + f"({beam_size}), got {n_best!r}: a beam search keeps beam "
                           "hypotheses", "n_best", "beam_size")


def check_prefix_rows(src_ids, prefix, cfg: TransformerConfig, max_len_a: float, max_len_b: int) -> None:
    """ValueError unless `prefix` (B, P) has a row per source (B, S), no <bos>, and room for <eos> in each sentence."""
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
    """ValueError unless `configs`, an ensemble's members, are some sharing `SHARED_FIELDS`, `average` an AVERAGES."""
    if not configs:
        raise ValueError("an ensemble needs at least one model, got none")
    if average not in AVERAGES:
        raise ValueError(f"average must be one of {', '.join(AVERAGES)}, got {average!r}")
    for i, cfg in enumerate(configs[1:], 1):
        for name in SHARED_FIELDS:
            if getattr(cfg, name) != getattr(configs[0], name):
                raise ValueError(f"ensemble members differ in {name}: model 0 has {getattr(configs[0], name)}, "
                                 f"model {i} has {getattr(cfg, name)}")

# Sizes per preset. `base` and `big` are the paper's Table 3 rows; `small` and `tiny` are for CPUs.
_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(d_model=64, num_heads=4, d_ff=128, num_encoder_layers=2, num_decoder_layers=2, dropout=0.1),
    "small": dict(d_model=256, num_heads=4, d_ff=1024, num_encoder_layers=3, num_decoder_layers=3, dropout=0.1),
    "base": dict(d_model=512, num_heads=8, d_ff=2048, num_encoder_layers=6, num_decoder_layers=6, dropout=0.1),
    "big": dict(d_model=1024, num_heads=16, d_ff=4096, num_encoder_layers=6, num_decoder_layers=6, dropout=0.3),
}


@dataclasses.dataclass(frozen=True)
class TransformerConfig(Settings):
    """The Transformer's architecture; the defaults are the paper's (post-norm, ReLU, sinusoidal positions, scaled and
    shared embeddings, §3.4), each departure a field; the special ids SPECIAL_TOKENS' (the tokenizers')."""

    src_vocab_size: int = setting(8000, range=POSITIVE)
    tgt_vocab_size: int = setting(8000, range=POSITIVE)
    d_model: int = setting(512, range=POSITIVE)
    num_heads: int = setting(8, range=POSITIVE)
    d_ff: int = setting(2048, range=POSITIVE)
    num_encoder_layers: int = setting(6, range=NON_NEGATIVE)
    num_decoder_layers: int = setting(6, range=NON_NEGATIVE)
    # Residual dropout on every sublayer output and on the embedding sums (paper §5.4).
    dropout: float = setting(0.1, range=PROBABILITY)
    # Dropout on attention weights; the paper's base model does not use it.
    attention_dropout: float = setting(0.0, range=PROBABILITY)
    # Dropout between the feed-forward activation and linear2 (fairseq's --activation-dropout); not the paper's.
    activation_dropout: float = setting(0.0, range=PROBABILITY)
    max_len: int = setting(512, range=LENGTH)
    pad_id: int = setting(PAD_ID, range=NON_NEGATIVE)
    # The decoder's start token; may be the pad id (Marian's), `target_mask` still attending the start position.
    bos_id: int = setting(BOS_ID, range=NON_NEGATIVE)
    eos_id: int = setting(EOS_ID, range=NON_NEGATIVE)
    # tensor2tensor (the paper's code) uses 1e-6, torch 1e-5: both models read this field, never a library default.
    layer_norm_eps: float = setting(1e-6, range=Range(float, above=0.0))
    norm_position: NormPosition = setting("post", choices=get_args(NormPosition))
    activation: Activation = setting("relu", choices=get_args(Activation))
    norm: Norm = setting("layernorm", choices=get_args(Norm))
    positions: Positions = setting("sinusoidal", choices=get_args(Positions))
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
        check_settings(self)  # whatever built it (CLI, JSON, Python)
        if self.d_model % self.num_heads:
            raise SettingError("{}={d} is not divisible by {}={h}", "d_model", "num_heads", d=self.d_model,
                               h=self.num_heads)
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
        512"""
        if name not in _PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(_PRESETS)}")
        return cls(**{**_PRESETS[name], **overrides})

    @classmethod
    def parse_override(cls, text: str, exclude: tuple[str, ...] = ()) -> tuple[str, Any]:
        """'FIELD=VALUE' -> (field, its typed value) for `--set`; ValueError naming the fields (not `exclude`)."""
        (key, sep, value), fields = text.partition("="), sorted(set(hints(cls)) - set(exclude))
        if not sep or key not in fields:
            raise ValueError(f"expected FIELD=VALUE with FIELD one of {', '.join(fields)}; got {text!r}")
        kind, booleans = type(getattr(cls(), key)), {"true": True, "false": False, "1": True, "0": False}
        try:
            return key, booleans[value.lower()] if kind is bool else kind(value)
        except (KeyError, ValueError):
            said = {bool: "true or false", int: "an integer"}.get(kind, "a number")
            raise ValueError(f"{key} takes {said}, got {value!r}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "TransformerConfig":
        return cls.from_dict(json.loads(text))
