"""`ExperimentConfig`: every training setting, its fields' metadata train.run's flags, None automatic."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, get_args

from torch_reference.config import (LENGTH, NON_NEGATIVE, POSITIVE, PROBABILITY, SPECIAL_TOKENS, KernelSet, Range,
                                    SettingError, Settings, TransformerConfig, check_settings, escaped,
                                    hints, setting)

BACKENDS = ("jax", "torch")  # each field's choices (its metadata) are its values
KERNEL_CHOICES = ("auto", *get_args(KernelSet))  # the models' kernel sets (the keys of their KERNELS), and auto

# Vocabulary sizes when --vocab-size is not given: at 400 BPE keeps the numbers corpus' German compounds in
# pieces ("drei|undsechzig|tausend"), which makes the task need attention; 8000 would learn whole numbers.
NUMBERS_VOCAB_SIZE = 400
NUMBERS_AVERAGE_LAST = 2  # the last two checkpoints (steps 600 and 700): docs/results.md#the-numbers-corpus
DEFAULT_VOCAB_SIZE = 8000
# Pairs the tokenizers train on at most: Marian's --sentencepiece-max-lines default (2 million sentences).
DEFAULT_TOKENIZER_SAMPLE = 1_000_000
# The experiment fields that decide the model's shape and vocabulary: --init-from takes its source's.
SOURCE_FIELDS = ("preset", "model", "vocab_size", "tokenizer_sample", "joint_vocab", "max_len", "lowercase")
RECIPE_FILE = "recipe.json"  # in a run directory: train.run --config's recipe, {"path", "toml"}; a resume reads it

# Warmup when --warmup is not given: a quarter of the steps (short runs need more than the paper's 4%: a small
# model's peak lr is high), capped at the paper's 4000 (§5.3; docs/results.md#the-numbers-corpus).
PAPER_WARMUP = 4000
WARMUP_FRACTION = 0.25

# Fields derived from the data and the experiment, so `--set` may not change them.
DERIVED_MODEL_FIELDS = ("src_vocab_size", "tgt_vocab_size", "max_len", "dropout", "share_embeddings")
# The special token ids are the tokenizers', shared by data, model, loss and search: not for `--set` either.
SPECIAL_ID_FIELDS = ("pad_id", "bos_id", "eos_id")
SPECIAL_IDS_FIXED = ("the special token ids are fixed: " + ", ".join(f"{t}={i}" for i, t in enumerate(SPECIAL_TOKENS))
                     + " (the tokenizers', used alike by batches, model, loss and search)")

# The upper bounds a user's number meets in the library (the server's limits stay within them): far past any
# use, short of the memory a search of that size would take (a beam of 10**6 asked for 45 GB).
MAX_BEAM = 1024  # beam, n-best and samples per sentence
BEAM = Range(int, low=1, high=MAX_BEAM)
BATCH = Range(int, low=1, high=1 << 16)  # sentences per batch
# Seeds both backends take: JAX traces the seed as an int32 (2**31 overflows), torch.manual_seed stops at 2**64.
SEEDS = Range(int, low=0, below=2**31)


def default_dtype(platform: str) -> str:
    """--dtype's default on a JAX platform: bfloat16 mixed precision on an accelerator, float32 on the CPU."""
    return "float32" if platform == "cpu" else "bfloat16"


def resolve_kernels(choice: str, backend: str, platform: str) -> str:
    """`choice`, or for auto xla_cpu (JAX on a CPU), fused (a GPU) or reference; ValueError where the model lacks it."""
    if choice == "auto":
        return "fused" if platform == "gpu" else "xla_cpu" if (backend, platform) == ("jax", "cpu") else "reference"
    if choice == "xla_cpu" and backend != "jax":
        raise SettingError("{} xla_cpu is the JAX model's (the torch model has reference and fused)", "kernels")
    return choice


def flag_name(field: dataclasses.Field) -> str:
    """The train.run flag of an `ExperimentConfig` field: its metadata's "flag", else --the-name."""
    return field.metadata.get("flag", "--" + field.name.replace("_", "-"))


def parse_model_override(text: str) -> tuple[str, Any]:
    """'FIELD=VALUE' -> (field, typed value) for `--set`; the fields the data decides and the special ids refused."""
    if text.partition("=")[0] in SPECIAL_ID_FIELDS:
        raise ValueError(f"{text.partition('=')[0]} cannot be set: {SPECIAL_IDS_FIXED}")
    return TransformerConfig.parse_override(text, exclude=DERIVED_MODEL_FIELDS)


def _field(default: Any, group: str, help: str, launch: bool = False, **meta: Any) -> Any:
    """A `setting` with its flag's help and group; `launch`: how this launch runs, never saved with the run."""
    return setting(default, help=help, group=group, launch=launch, **meta)


@dataclasses.dataclass(frozen=True)
class ExperimentConfig(Settings):
    """Training, data, evaluation and checkpoint settings of one run; its model is `model_config()`."""

    backend: str = _field(
        "jax", "run", "framework that trains the model: jax (Flax NNX, jit) or torch (the reference)", choices=BACKENDS)
    recipe: str | None = _field(
        None, "run", "read flags from a TOML recipe (recipes/*.toml): a key per long flag, with _ for - (set = "
        "[\"norm_position=pre\"]); the command line's flags override it, --set adds to its list; the run keeps it",
        flag="--config", metavar="FILE", launch=True)

    preset: str = _field("tiny", "model", "model size preset: " + ", ".join(TransformerConfig.presets()),
                         choices=TransformerConfig.presets())
    model: dict = _field(
        {}, "model", "override a TransformerConfig field of the preset, e.g. --set d_model=128 "
        "--set norm_position=pre (repeatable)", flag="--set", metavar="FIELD=VALUE", parse=parse_model_override)
    dropout: float | None = _field(None, "model", "residual dropout rate (paper: 0.1); default: the preset's",
                                   range=PROBABILITY)
    init_from: str | None = _field(
        None, "model", "start from a pretrained model (a run directory, an HF Marian directory or "
        "hf:ORG/NAME[@REVISION]): its model, tokenizers and weights, trained on --train with a fresh optimizer and "
        "schedule; flags that would change the model's shape or vocabulary are refused", metavar="SOURCE")

    train: str | None = _field(
        None, "data", "training data spec ('data specs' below); default: the embedded numbers corpus", metavar="SPEC")
    valid: str | None = _field(None, "data", "validation data spec; required with --train", metavar="SPEC")
    test: str | None = _field(None, "data", "test data spec, evaluated at the end; default with --train: no test set",
                              metavar="SPEC")
    numbers_train: int = _field(
        40_000, "data", "numbers corpus: training pairs, an even share for numbers of each length (1 to 6 digits)",
        range=POSITIVE)
    numbers_valid: int = _field(500, "data", "numbers corpus: validation pairs, spread like the test pairs",
                                range=POSITIVE)
    numbers_test: int = _field(
        1000, "data", "numbers corpus: test pairs, even over numbers of 1 to 6 digits (3 or more never trained on)",
        range=NON_NEGATIVE)
    vocab_size: int | None = _field(
        None, "data", f"BPE vocabulary size; default {NUMBERS_VOCAB_SIZE} for the numbers corpus, "
        f"{DEFAULT_VOCAB_SIZE} otherwise", range=Range(int, low=260))
    tokenizer_sample: int = _field(
        DEFAULT_TOKENIZER_SAMPLE, "data", "train the tokenizers on at most N training pairs (a seeded sample of more)",
        range=POSITIVE)
    joint_vocab: bool = _field(
        True, "data", "one BPE vocabulary for source and target, shared embeddings (--no-joint-vocab: one per side)")
    lowercase: bool = _field(
        False, "data", "lowercase all text: every pair, and every input of the tokenizer (translate lowercases too)")
    max_len: int = _field(128, "data", "longest sequence in tokens (with <eos>); longer training pairs are dropped",
                          range=LENGTH)
    token_budget: int = _field(4096, "data", "padded tokens per batch (B x L <= budget, per length bucket)",
                               range=POSITIVE)
    pack: bool | None = _field(
        None, "data", "pack several pairs into each batch row (attention within each pair) and search in a few fixed "
        "shapes: few programs for JAX to compile, little padding (--no-pack: length buckets); default: on for jax, "
        "off for torch (docs/performance.md#sequence-packing)")
    hf_cache: str | None = _field(None, "data", "HF datasets cache directory; default: HF's own", metavar="DIR", launch=True)

    steps: int = _field(700, "optim", "optimizer updates to train for", launch=True, range=POSITIVE)
    warmup: int | None = _field(
        None, "optim", f"warmup steps of the schedule (§5.3); default {WARMUP_FRACTION:g} x steps, "
        f"at most {PAPER_WARMUP}", range=POSITIVE)
    lr_factor: float = _field(1.0, "optim",
                              "factor on the paper's schedule d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)",
                              range=Range(float, above=0.0))
    label_smoothing: float = _field(0.1, "optim", "label smoothing epsilon (§5.4), padding ignored", range=PROBABILITY)
    clip_norm: float | None = _field(
        None, "optim", "clip gradients to this global norm (optax clip_by_global_norm formula); default: no clipping",
        range=Range(float, above=0.0))
    grad_accum: int = _field(
        1, "optim", "micro-batches per update; the loss is summed over them and divided by their total target tokens",
        range=POSITIVE)

    eval_every: int = _field(
        200, "eval", "validate (loss, perplexity, BLEU, chrF, samples) every N steps and at the end", launch=True,
        range=POSITIVE)
    log_every: int = _field(20, "eval", "read metrics from the device and log them every N steps", launch=True,
                            range=POSITIVE)
    eval_sentences: int | None = _field(
        None, "eval", "translate at most this many validation sentences for BLEU/chrF/exact match; default: all "
        "(the test set is always translated whole)", launch=True, range=POSITIVE)
    samples: int = _field(3, "eval", "sample translations printed at each evaluation", launch=True, range=NON_NEGATIVE)
    beam: int = _field(4, "eval", "beam size of the translations scored by BLEU/chrF (1 = greedy search)", launch=True,
                       range=BEAM)
    moses: str | None = _field(
        None, "eval", "also score BLEU on Moses-tokenized text of this target language (e.g. de), as bleu_moses and "
        "bleu_moses_lc (aiayn evaluate --moses)", launch=True, metavar="LANG")

    save_every: int | None = _field(None, "ckpt", "checkpoint every N steps and at the end; default: --eval-every",
                                    launch=True, range=POSITIVE)
    keep_checkpoints: int = _field(2, "ckpt", "keep the newest N checkpoints, plus the best by validation BLEU",
                                   launch=True, range=POSITIVE)
    average_last: int | None = _field(
        None, "ckpt", "end the run with the mean of the weights of its last N checkpoints, this final step's "
        "included (the paper's checkpoint averaging, §6.1; train.average does it after a run): the final "
        "evaluation, the test set and the last checkpoint use them; fewer when fewer are kept. "
        f"Default {NUMBERS_AVERAGE_LAST} (at most --keep-checkpoints) for the numbers corpus "
        "(docs/results.md#the-numbers-corpus), 1 (no averaging) otherwise", metavar="N", range=POSITIVE)

    seed: int = _field(0, "run", "seed of the initial weights, dropout, batch order and the numbers corpus, in "
                       "[0, 2**31)", range=SEEDS)
    run_dir: str | None = _field(
        None, "run", "directory for config, tokenizer, checkpoints, TensorBoard events and results.json; "
        "default runs/BACKEND-TIMESTAMP", metavar="DIR", launch=True)
    resume: bool = _field(
        False, "run", "continue the run in --run-dir from its newest complete checkpoint; --steps and the eval and "
        "checkpoint flags are not stored: give them again, or they come from the run's recipe (--config)", launch=True)
    overwrite: bool = _field(
        False, "run", "replace the run in --run-dir (the old one kept beside it, .NAME.run-old, until the new one "
        "holds a checkpoint)", launch=True)
    compile: bool = _field(False, "run", "torch backend: wrap the model with torch.compile", launch=True)
    threads: int | None = _field(
        None, "run", "torch backend: intra-op CPU threads; default: the CPUs this process may use", launch=True,
        range=POSITIVE)
    progress: bool = _field(True, "run", "show a progress bar (--no-progress for logs)", launch=True)

    devices: int | None = _field(
        None, "dist", "train data parallel over N devices: jax the first N (default: every visible one); torch N "
        "processes (DistributedDataParallel; default 1, or torchrun's --nproc-per-node)", launch=True, range=POSITIVE)
    param_sharding: str = _field(
        "replicated", "dist", "parameters and Adam's moments: replicated (a whole copy on every device) or fsdp (each "
        "array split over the devices, ZeRO-3 style)", choices=("replicated", "fsdp"), launch=True)
    dtype: str | None = _field(
        None, "dist", "compute dtype: float32, or bfloat16 mixed precision (parameters, optimizer state, softmax and "
        "loss in float32); default: bfloat16 on a GPU or TPU, float32 on the CPU (docs/parity.md#bfloat16)",
        choices=("float32", "bfloat16"))
    kernels: str = _field(
        "auto", "dist", "how the model computes the same function: reference (torch_reference line by line), xla_cpu "
        "(jax, tuned for XLA:CPU), fused (one fused attention kernel); auto: xla_cpu for jax on the CPU, fused on a "
        "GPU, reference otherwise", choices=KERNEL_CHOICES, launch=True)
    remat: bool = _field(
        False, "dist", "recompute each layer's activations in the backward pass instead of keeping them: less memory, "
        "more time (docs/performance.md#remat)", launch=True)
    coordinator_address: str | None = _field(
        None, "dist", "jax multi-process run: HOST:PORT of process 0's coordinator, for jax.distributed.initialize; "
        "default: $JAX_COORDINATOR_ADDRESS, else a single process", metavar="HOST:PORT", launch=True)
    num_processes: int | None = _field(
        None, "dist", "jax multi-process run: number of processes; default: $JAX_NUM_PROCESSES, else 1", launch=True,
        range=POSITIVE)
    process_id: int | None = _field(
        None, "dist", "jax multi-process run: this process's id, 0..N-1 (0 writes logs and results); "
        "default: $JAX_PROCESS_ID", launch=True, range=NON_NEGATIVE)
    dist_backend: str | None = _field(
        None, "dist", "torch run on several devices: torch.distributed's backend; default: nccl on GPUs, gloo on "
        "CPUs", choices=("gloo", "nccl"), launch=True)

    def __post_init__(self):
        check_settings(self)  # whatever built it
        if not all(isinstance(key, str) for key in self.model):
            raise SettingError("{} must map field names to values, " + escaped(f"got {self.model!r}"), "model")
        if fixed := sorted(set(self.model) & set(SPECIAL_ID_FIELDS)):
            raise SettingError("{}: " + f"{fixed[0]} cannot be set: {SPECIAL_IDS_FIXED}", "model")
        if bad := sorted(set(self.model) & set(DERIVED_MODEL_FIELDS)):
            raise SettingError("{}: " + f"{bad[0]} cannot be set: {', '.join(DERIVED_MODEL_FIELDS)} come from the data "
                               "and from {}, {}, {}, {}", "model", "vocab_size", "max_len", "dropout", "joint_vocab")
        if unknown := sorted(set(self.model) - set(known := hints(TransformerConfig))):
            raise SettingError("{}: unknown model field {name!r}; choose from {known}", "model", name=unknown[0],
                               known=", ".join(sorted(known)))
        resolve_kernels(self.kernels, self.backend, "cpu")  # a set the backend's model has
        if self.token_budget < self.max_len:
            raise SettingError("{}=" + f"{self.token_budget} must hold one sequence of " + "{}=" + f"{self.max_len}",
                               "token_budget", "max_len")
        if self.train is None and (self.valid or self.test):
            raise SettingError("{}/{} need {} (the numbers corpus brings its own splits)", "valid", "test", "train")
        if self.train is not None and self.valid is None:
            raise SettingError("{} needs {} (validation data for loss, BLEU and the best checkpoint)", "train", "valid")
        if self.resume and self.overwrite:
            raise SettingError("{} and {} exclude each other", "resume", "overwrite")
        if (self.resume or self.overwrite) and self.run_dir is None:
            raise SettingError("{} needs {}", "resume" if self.resume else "overwrite", "run_dir")
        self.model_config(100, 100)  # the model overrides must make a valid TransformerConfig

    @property
    def uses_numbers_corpus(self) -> bool:
        return self.train is None

    def resolve(self, platform: str | None = None, *, given: Iterable[str] | None = None,
                saved: ExperimentConfig | None = None, source: ExperimentConfig | None = None) -> ExperimentConfig:
        """The config a run trains with, automatic fields filled: `saved`'s (--resume) with this launch's options, or
        `source`'s (--init-from) SOURCE_FIELDS; ValueError for a field `given` otherwise (None: every one set)."""
        cfg = self
        if saved is not None:
            cfg = saved.replace(**{name: getattr(self, name) for name in self.launch_fields()})
            set_fields = [name for name, value in self.to_dict().items() if value is not None]
            self._refuse_changes(saved, "run", "{} cannot change how the run trains", "resume", self.experiment(),
                                 set_fields if given is None else given)
        elif source is not None:
            cfg = self.replace(**{name: getattr(source, name) for name in SOURCE_FIELDS})
            defaults = ExperimentConfig()
            off_default = [name for name in SOURCE_FIELDS if getattr(self, name) != getattr(defaults, name)]
            self._refuse_changes(source, str(self.init_from), "{} takes the model's shape and vocabulary from its "
                                 "source", "init_from", SOURCE_FIELDS, off_default if given is None else given)
        automatic = {"vocab_size": NUMBERS_VOCAB_SIZE if cfg.uses_numbers_corpus else DEFAULT_VOCAB_SIZE,
                     "average_last": min(NUMBERS_AVERAGE_LAST, cfg.keep_checkpoints) if cfg.uses_numbers_corpus else 1,
                     "warmup": max(1, min(PAPER_WARMUP, round(WARMUP_FRACTION * cfg.steps))),
                     "save_every": cfg.eval_every, "pack": cfg.backend == "jax",
                     "dtype": default_dtype(platform) if platform and saved is None else None}  # a resume keeps its own
        return cfg.replace(**{name: value for name, value in automatic.items() if getattr(cfg, name) is None})

    def _refuse_changes(self, other: ExperimentConfig, whose: str, why: str, option: str, names: Iterable[str],
                        given: Iterable[str]) -> None:
        """SettingError naming `option` (the `why`), then each of `names` `given` with another value than `other`'s."""
        if differ := [n for n in names if n in set(given) and getattr(self, n) != getattr(other, n)]:
            raise SettingError(why + ": " + "; ".join("{}" + escaped(f": {whose} has {getattr(other, n)!r}, got "
                                                                     f"{getattr(self, n)!r}") for n in differ),
                               option, *differ)

    def model_config(self, src_vocab_size: int, tgt_vocab_size: int) -> TransformerConfig:
        """The preset with `--set` overrides, the vocabulary sizes, max_len, dropout, shared embeddings if joint."""
        derived = dict(src_vocab_size=src_vocab_size, tgt_vocab_size=tgt_vocab_size, max_len=self.max_len,
                       share_embeddings=self.joint_vocab)
        if self.dropout is not None:
            derived["dropout"] = self.dropout
        return TransformerConfig.preset(self.preset, **{**self.model, **derived})

    @classmethod
    def launch_fields(cls) -> tuple[str, ...]:
        """The launch options (where, how long, how this launch runs): a resume may change them, never saved."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata["launch"])

    def experiment(self) -> dict[str, Any]:
        """The fields that define how the run trains: what config.json and checkpoints save, a resume must match."""
        launch = self.launch_fields()
        return {k: v for k, v in self.to_dict().items() if k not in launch}
