"""The Python API (docs/python.md): `load` a run to translate and evaluate, `fit` to train one."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from torch_reference.config import TransformerConfig, escaped

from . import data, translation
from .backends import Backend, create_backend, initialize
from .checkpoints import DIGEST_FILE, CheckpointError, parse_checkpoint
from .config import BACKENDS, BATCH, ExperimentConfig
from .options import (SAMPLING_FIELDS, Evaluation, OptionError, RunSelection, Sampling, Search, check_single,
                      sampling_of)
from .rundir import check_set_aside, read_run
from .runtime import (CHECKPOINTS, PROGRAM_KINDS, PROOF_FILE, UserError, kind_of, read_experiment, read_json,
                      user_errors)
from .translation import Hypothesis, score_pairs


@dataclasses.dataclass
class Run(contextlib.AbstractContextManager):
    """A loaded run: settings, tokenizers, a backend at one checkpoint; an ensemble's: the first run's."""

    run_dir: Path
    config: ExperimentConfig
    model_config: TransformerConfig
    tokenizers: data.Tokenizers
    backend: Backend
    meta: dict[str, Any]
    members: list[Run] = dataclasses.field(default_factory=list)  # an ensemble's other runs

    def __repr__(self) -> str:  # one line: the fields hold both tokenizers and the whole history
        m = self.model_config
        step = "closed" if isinstance(self.backend, _Closed) else f"step {self.step}"
        ensemble = f", an ensemble with {', '.join(str(r.run_dir) for r in self.members)}" if self.members else ""
        backend = f"{self.meta['kind']} export" if "kind" in self.meta else self.config.backend  # not the source's
        return (f"Run({str(self.run_dir)!r}, {step}, {backend}, d_model {m.d_model} x {m.num_heads} heads, "
                f"{m.num_encoder_layers}+{m.num_decoder_layers} layers, d_ff {m.d_ff}, vocabulary "
                f"{m.src_vocab_size}/{m.tgt_vocab_size}{ensemble})")

    @property
    def step(self) -> int:
        """The update count of the loaded checkpoint (of the first run's, for an ensemble: `steps`)."""
        return self.backend.step

    @property
    def steps(self) -> list[int]:
        """The update count of each run's checkpoint: one, or an ensemble's in the order loaded."""
        return [self.step, *(m.step for m in self.members)]

    def translate(self, texts: str | Sequence[str], search: Search | None = None, sample: Sampling | bool | None = None,
                  *, prefix: str | Sequence[str | None] | None = None, batch_size: int | None = None,
                  **options: Any) -> str | list[str] | list[Hypothesis] | list[list[Hypothesis]]:
        """The translations of `texts` by `search` (a `Search`, or its fields as keywords): docs/python.md."""
        search = _options(Search, search, options)
        sampling = sampling_of(sample, {k: options.pop(k) for k in SAMPLING_FIELDS if k in options})
        _unknown("translate", options, TRANSLATE_HOOKS)
        check_single(bool(self.members) and search.alignments, "alignments")
        if batch_size is not None:
            BATCH.check("batch_size", batch_size, OptionError)
            batch_size = int(batch_size)
        one = isinstance(texts, str)
        texts = [texts] if one else list(texts) if isinstance(texts, Iterable) else texts
        if not isinstance(texts, list):  # each text's type: `data.encode`, naming it
            raise OptionError("{} must be a string or a list of strings, " + escaped(f"got {texts!r}"[:200]), "texts")
        prefixes = None if prefix is None else [prefix] if isinstance(prefix, str) and one else list(prefix)
        if isinstance(prefix, str) and not one:
            raise OptionError("{}: give one per text (a list), not one string for several texts", "prefix")
        out = translation.translate_texts(  # looked up on its module at each call, where tests spy on it
            self.backend, self.tokenizers, texts, max_len=self.config.max_len,
            token_budget=self.config.token_budget, batch_size=batch_size, search=search, sample=sampling,
            prefixes=prefixes, **options)
        return out[0] if one else out

    def score(self, sources: str | Sequence[str], targets: str | Sequence[str],
              batch_size: int | None = None) -> dict[str, Any] | list[dict[str, Any]]:
        """`aiayn score`'s dicts, one per pair: "logprob", "tokens" and "token_logprobs"."""
        one = isinstance(sources, str)
        if one != isinstance(targets, str):
            raise UserError("sources and targets: give two strings or two lists")
        out = score_pairs(self.backend, self.tokenizers, [sources] if one else list(sources),
                          [targets] if one else list(targets), max_len=self.config.max_len,
                          token_budget=self.config.token_budget, batch_size=batch_size)
        return out[0] if one else out

    def evaluate(self, pairs: str | os.PathLike | Sequence[tuple[str, str]], search: Search | None = None,
                 evaluation: Evaluation | None = None, **options: Any) -> dict[str, Any]:
        """What `aiayn evaluate` prints on `pairs` (a data spec or (source, target) pairs): docs/python.md."""
        search, evaluation = _options(Search, search, options), _options(Evaluation, evaluation, options)
        _unknown("evaluate", options)
        spec = os.fspath(pairs) if isinstance(pairs, (str, os.PathLike)) else None  # a file as a path too
        pairs = data.load_split(self.config, spec) if spec is not None else \
            list(pairs) if isinstance(pairs, Iterable) else pairs
        if not (isinstance(pairs, list) and all(isinstance(p, (tuple, list)) and len(p) == 2 for p in pairs)):
            raise OptionError("{}: give a data spec or a list of (source, target) pairs, " +
                              escaped(f"got {pairs!r}"[:200]), "pairs")
        if not pairs:  # sacreBLEU's scores need a sentence
            raise UserError(f"{spec or 'pairs'} holds no sentence pairs")
        cfg = self.config
        seen = {s for s, _ in data.load_split(cfg, "numbers:train")} if cfg.uses_numbers_corpus else None
        scoring = {**dataclasses.asdict(evaluation), "lowercase": evaluation.lowercase or cfg.lowercase}
        result = translation.evaluate_pairs(self.backend, self.tokenizers, pairs, max_len=cfg.max_len,
                                token_budget=cfg.token_budget, search=search, seen=seen, **scoring)
        ensemble = {"ensemble": [str(m.run_dir) for m in self.members], "steps": self.steps} if self.members else {}
        return {"run_dir": str(self.run_dir), "data": spec, "step": self.step, **ensemble, "beam": search.beam,
                "alpha": search.alpha, "scoring": search.scoring, **result}

    def weights_digest(self) -> str:
        """Which weights this run translates with (an ensemble's, each run's): what a partial output resumes under."""
        return "".join(weights_digest(r.run_dir, r.step) for r in (self, *self.members))

    def close(self) -> None:
        """Free the backend's devices, files and weights (an ensemble's every one); using it then is a UserError."""
        backend, self.backend = self.backend, _Closed(self.run_dir)
        backend.close()
        for member in self.members:
            member.close()

    def __exit__(self, *exc) -> None:
        self.close()


# What `translate_texts` takes besides the options objects: the server's attention recorder (`on_batch`) and others.
TRANSLATE_HOOKS = ("stop", "on_batch", "counts", "fixed_shapes", "first_id", "hypotheses")


def _unknown(method: str, keywords: dict[str, Any], known: tuple[str, ...] = ()) -> None:
    """OptionError naming the first of `keywords` that is none of `known`: a parameter the method does not take."""
    if unknown := sorted(set(keywords) - set(known)):
        raise OptionError(f"{method}() takes no parameter " + "{}", unknown[0])


def _options(cls: type, given: Any, keywords: dict[str, Any]) -> Any:
    """`given` (a `cls`), or one built from the `keywords` that are its fields (taken out); both: OptionError."""
    mine = {f.name: keywords.pop(f.name) for f in dataclasses.fields(cls) if f.name in keywords}
    if given is None:
        return cls(**mine)
    if not isinstance(given, cls) or mine:
        raise OptionError(f"{{}}: give a {cls.__name__} or its fields as keywords, not both", cls.__name__.lower())
    return given


class _Closed:
    """What a closed `Run` holds instead of its backend: any use of it one line saying so."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir

    def __getattr__(self, name: str) -> Any:
        raise UserError(f"the run {self.run_dir} is closed (Run.close): train.load it again to use it")

    def close(self) -> None:  # closing twice is no error
        pass


def load(run_dir: str | os.PathLike | Sequence[str | os.PathLike] | RunSelection, checkpoint: str | int = "best",
         backend: str | None = None, devices: int | None = None, average: str = "logprob", **launch: Any) -> Run:
    """The run in `run_dir` (a list: an ensemble) at `checkpoint` ("best", "latest" or a step): docs/python.md."""
    if isinstance(run_dir, RunSelection):
        selection = run_dir
    else:
        _unknown("load", launch, ("coordinator_address", "num_processes", "process_id"))  # RunSelection's launch
        selection = RunSelection(run_dir, checkpoint, average, devices, **launch)
    if backend not in (None, *BACKENDS):  # not a framework to convert the run to
        raise OptionError("{} " + f"must be one of {', '.join(BACKENDS)} (None: the run's own), got {backend!r}",
                          "backend")
    first, *others = selection.run_dir
    if not others:  # a run alone keeps what an ensemble gives up (attention weights, training)
        return _load_one(first, selection.checkpoint, backend, **selection.launch)
    return _load_ensemble(selection.run_dir, selection.checkpoint, backend, selection.average, **selection.launch)


def _load_ensemble(run_dirs: list[Path], checkpoint: str | int, backend: str | None, average: str,
                   **launch: Any) -> Run:
    first = read_experiment(run_dirs[0]).backend  # a backend= of another framework: refused as for one run
    for run_dir in run_dirs:  # before any weights load
        check_set_aside(run_dir)
        if (kind := kind_of(run_dir)) in PROGRAM_KINDS:
            raise UserError(f"{run_dir} is a {kind} export: an ensemble combines runs' models; give the runs it "
                            "was exported from")
        other = read_experiment(run_dir).backend
        if other != first:
            raise UserError(f"{run_dir} is a {other} run, {run_dirs[0]} a {first} one: an ensemble's runs share one "
                            f"framework; convert it first: aiayn convert --to {first} --run-dir {run_dir} "
                            "--dst DIR")
        if _tokenizer_bytes(run_dir) != _tokenizer_bytes(run_dirs[0]):
            raise UserError(f"{run_dir} has another vocabulary than {run_dirs[0]} (its tokenizer files differ): an "
                            "ensemble's runs must share their tokenizers")
    with contextlib.ExitStack() as loaded:  # on an error every run loaded so far is closed
        head, *rest = (loaded.enter_context(_load_one(run_dir, checkpoint, backend, **launch)) for run_dir in run_dirs)
        try:
            head.backend.ensemble([r.backend for r in rest], average)
        except ValueError as err:  # vocabulary sizes or special ids the tokenizer files did not show
            raise UserError(f"{' + '.join(map(str, run_dirs))}: {err}") from None
        loaded.pop_all()
    return dataclasses.replace(head, members=rest)


def weights_digest(run_dir: str | os.PathLike, step: int) -> str:
    """SHA-256 of checkpoint `step`'s digest.json (else of its every file) and of the run's tokenizer files."""
    run_dir = Path(run_dir)
    checkpoint = run_dir / CHECKPOINTS / str(step)
    files = [checkpoint / DIGEST_FILE] if (checkpoint / DIGEST_FILE).is_file() else sorted(
        p for p in checkpoint.rglob("*") if p.is_file())
    if kind_of(run_dir) in PROGRAM_KINDS:  # an export: its proof holds its files' digests
        files = [run_dir / PROOF_FILE]
    digest = hashlib.sha256()
    for path in [*files, *(run_dir / name for name in data.tokenizer_files(run_dir))]:
        with open(path, "rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()


def _tokenizer_bytes(run_dir: Path) -> dict[str, bytes]:
    return {name: (run_dir / name).read_bytes() for name in data.tokenizer_files(run_dir)}


def _load_one(run_dir: Path, checkpoint: str | int = "best", backend: str | None = None, **launch: Any) -> Run:
    cfg, model_cfg, tokenizers = read_run(run_dir)
    if backend is not None and backend != cfg.backend:
        raise UserError(f"{run_dir} is a {cfg.backend} run; for {backend}, convert it first: "
                        f"aiayn convert --to {backend} --run-dir {run_dir} --dst DIR")
    if (launch.get("devices") or 1) > 1 and cfg.backend == "torch":  # the backend's own refusal speaks of training
        raise OptionError("{} " + f"{launch['devices']}: a torch run decodes on one device", "devices")
    with user_errors(TypeError, ValueError):  # a launch option the config or the backend refuses
        cfg = cfg.replace(**launch)
        initialize(cfg)  # the process's settings for its platform, before any device is touched
    if (kind := kind_of(run_dir)) in PROGRAM_KINDS:  # an export decodes with its own programs
        from .interop.exported import ExportBackend, programs

        with user_errors(ImportError):
            backend = ExportBackend(programs(run_dir), model_cfg, read_json(run_dir / PROOF_FILE, {}).get("step", 0),
                                    cfg.label_smoothing)
            return Run(run_dir, cfg, model_cfg, tokenizers, backend, {"kind": kind})
    checkpoint = parse_checkpoint(checkpoint)
    with contextlib.ExitStack() as on_error, user_errors(FileNotFoundError, CheckpointError):
        model = on_error.enter_context(contextlib.closing(create_backend(cfg, model_cfg, str(run_dir / CHECKPOINTS))))
        meta = model.restore(checkpoint)
        on_error.pop_all()  # restored: the Run closes it
    return Run(run_dir, cfg, model_cfg, tokenizers, model, meta)
