"""The training loop of `train.fit` and `python -m train.run`: `setup` -> `fit` -> `finish` (docs/operations.md)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from . import data, plots, pretrained, rundir, runtime
from .averaging import average_states
from .backends import Backend, Topology, check_agreement, create_backend, initialize, launch
from .backends.compiles import Compiles, totals
from .checkpoints import CheckpointError, TrainingState
from .config import ExperimentConfig
from .data.splits import load_splits
from .data.corpus_store import tokenizers_digest
from .options import Search
from .recipes import resume_command
from .runtime import CHECKPOINTS, CONFIG_FILE, CURVES_FILE, RESULTS_FILE, TENSORBOARD, Interrupted, UserError, say
from .runtime.events import NoWriter, summary_writer
from .runtime.files import OptionError, finite_values, read_json, write_json_atomic
from .translation import EvaluationStopped, bands_text, evaluate_pairs


class TrainingDiverged(OptionError):
    """A non-finite loss or gradient norm: training stops before any checkpoint holds the bad update."""


def train(cfg: ExperimentConfig, *, explicit: Iterable[str] | None = None,
          init_dir: str | Path | None = None) -> dict[str, Any]:
    """Train (or resume) the run `cfg` describes, evaluate it, write results.json; returns its content."""
    started = time.perf_counter()
    with launch(cfg, train, explicit=explicit, init_dir=init_dir):  # torch --devices N: its other processes
        return _train(cfg, explicit, init_dir, started)


def _train(cfg: ExperimentConfig, explicit: Iterable[str] | None, init_dir: str | Path | None,
           started: float) -> dict[str, Any]:
    with runtime.user_errors(ValueError):
        topology = initialize(cfg)  # first: jax.distributed.initialize precedes any device use
    compiled_before = totals()  # this run's compilations: those after this point
    if topology.process_count > 1 and cfg.run_dir is None:
        raise OptionError("a multi-process run needs {}: one directory, the same for every process", "run_dir")
    source = (init_dir or cfg.init_from) if cfg.init_from else None
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(sys.stdout if topology.is_main else devnull), \
            rundir.session(cfg, explicit, topology.platform, topology.is_main, source) as cfg:
        run = setup(cfg, topology, init_dir)
        run.compiled_before = compiled_before
        if run.finished is not None:
            run.backend.close()
            return run.finished
        with run:
            fit(run)
            results = finish(run, started)
        if topology.is_main:
            _write_results(results)
        print(_summary_line(results), flush=True)
        return results


@dataclasses.dataclass
class Training:
    """A run set up to train: its data, batches, backend (at its resumed step) and what it logs to."""

    cfg: ExperimentConfig
    topology: Topology
    splits: data.Splits
    tokenizers: data.Tokenizers
    batcher: data.Batcher
    backend: Backend
    log: _Log
    finished: dict[str, Any] | None = None  # a resumed run that had trained --steps: its results
    writer: Any = None
    compiled_before: Compiles = dataclasses.field(default_factory=Compiles)  # the process's, before this run
    averaged: list[int] | None = None  # the steps whose weights the final ones average (--average-last)

    def compiled(self) -> Compiles | None:
        """What this run has compiled so far (JAX's compile events); None for torch, which reports none."""
        return totals() - self.compiled_before if self.cfg.backend == "jax" else None

    def __enter__(self) -> Training:
        events = Path(self.cfg.run_dir) / TENSORBOARD
        self.writer = summary_writer(events, purge_step=self.backend.step + 1) if self.topology.is_main else NoWriter()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        try:  # on an error, that first error is the one reported (a full disk: both fail)
            with contextlib.suppress(*(() if exc_type is None else (OSError,))):
                self.writer.close()
        finally:
            self.backend.close()


def setup(cfg: ExperimentConfig, topology: Topology, init_dir: str | Path | None = None) -> Training:
    """Data, tokenizers, batches, the run's first files and the backend (restored, or with --init-from's weights)."""
    run_dir = Path(cfg.run_dir)
    tokenizers = None  # new, or a resumed run stopped before its tokenizer was saved (FileNotFoundError)
    with runtime.user_errors(ValueError), contextlib.suppress(FileNotFoundError):
        tokenizers = data.load_tokenizers(run_dir, cfg.joint_vocab) if cfg.resume else None
    restored = cfg.resume and rundir.has_checkpoint(run_dir)  # --init-from's weights were the start of the checkpoints'
    initial = pretrained.load(init_dir or cfg.init_from, cfg) if cfg.init_from and not restored else None
    trained_tokenizers = tokenizers is None
    # A --train spec's text is streamed (tokenizer sample, store), never held; numbers' pairs go to train_store.
    splits = load_splits(cfg, train=_numbers(cfg))
    if not splits.valid or not (splits.train or cfg.train):
        raise UserError("the training and validation data must each hold at least one pair")
    if trained_tokenizers and initial is not None:
        tokenizers = initial.tokenizers
    elif trained_tokenizers and not _numbers(cfg):
        tokenizers = data.corpus_tokenizers(cfg)
    elif trained_tokenizers:  # BPE training is deterministic: every process gets the same tokenizer
        tokenizers = data.train_tokenizers(splits.train, vocab_size=cfg.vocab_size, joint=cfg.joint_vocab,
                                           lowercase=cfg.lowercase, sample_size=cfg.tokenizer_sample)
    model_cfg = cfg.model_config(tokenizers.src.get_vocab_size(), tokenizers.tgt.get_vocab_size())
    if initial is not None and model_cfg != initial.model_config.replace(dropout=model_cfg.dropout):
        raise pretrained.refused(cfg.init_from, "its files describe another model than its experiment rebuilds")
    if cfg.resume:
        rundir.check_model(run_dir, cfg, model_cfg, tokenizers, what=CONFIG_FILE)
    stored = data.train_store(cfg, tokenizers, splits.train or None, progress=topology.is_main)
    if topology.process_count > 1:  # one run or none: before a file is written or a step taken
        check_agreement(cfg, {**{k: v for k, v in cfg.to_dict().items() if k not in _OWN},
                              "the training data": stored.digest, "the tokenizers": tokenizers_digest(tokenizers)})
    batcher = make_batcher(cfg, tokenizers, stored, topology.num_devices, topology)
    # Only now that the data has loaded and batched are the run's files written: config.json first.
    if topology.is_main:
        rundir.prepare_run_dir(cfg, model_cfg, tokenizers if trained_tokenizers else None)
        if initial is not None and (initial.source / runtime.IMPORTED_FILE).is_file():  # a Marian model's numbering
            shutil.copyfile(initial.source / runtime.IMPORTED_FILE, run_dir / runtime.IMPORTED_FILE)

    backend = create_backend(cfg, model_cfg, str(run_dir / CHECKPOINTS))
    try:
        log = _resume(cfg, backend, batcher, topology) if cfg.resume else _Log()
        if initial is not None and backend.step == 0:
            backend.import_state(TrainingState(cfg.backend, 0, initial.params))  # a fresh optimizer and schedule
            say(f"starting from the weights of {cfg.init_from}")
        say(f"[{cfg.backend}] {backend.num_params:,} parameters ({cfg.preset}, d_model={model_cfg.d_model}, "
            f"{model_cfg.num_encoder_layers}+{model_cfg.num_decoder_layers} layers), vocab "
            f"{model_cfg.src_vocab_size}/{model_cfg.tgt_vocab_size}, {len(batcher.store):,} training pairs "
            f"({batcher.num_dropped} longer than {cfg.max_len} dropped), {batcher.num_batches} batches/epoch, "
            f"{'packed, ' if cfg.pack else ''}shapes {batcher.shapes}, {batcher.padding_share():.1%} padding, "
            f"{cfg.dtype}, {topology.num_devices} device(s)"
            + (f" in {topology.process_count} processes" if topology.process_count > 1 else "")
            + (", parameters and optimizer state sharded (FSDP)" if cfg.param_sharding == "fsdp" else "")
            + f"; run dir {run_dir}")
        return Training(cfg, topology, splits, tokenizers, batcher, backend, log, _finished(cfg, backend.step))
    except BaseException:
        backend.close()  # its devices and files freed for what the caller does next (a notebook goes on)
        raise


# The settings each process may have its own of: paths seen from its host, its threads, its place in the run.
_OWN = ("recipe", "hf_cache", "run_dir", "threads", "progress", "coordinator_address", "process_id")


def _numbers(cfg: ExperimentConfig) -> bool:
    return cfg.uses_numbers_corpus or cfg.train.startswith("numbers:")


def _resume(cfg: ExperimentConfig, backend: Backend, batcher: data.Batcher, topology: Topology) -> _Log:
    """The backend restored from the last checkpoint and the batches after it; the history so far."""
    if not backend.checkpoint_steps():
        say(f"{cfg.run_dir} has no checkpoint yet: starting at step 0 with its tokenizer")
        return _Log()
    with runtime.user_errors(CheckpointError):
        meta = backend.restore("latest")
    _check_resumed(meta, cfg, batcher, topology)
    batcher.restore(meta["data"])
    say(f"resumed {cfg.run_dir} at step {backend.step}")
    return _Log.restore(meta.get("history"), backend.step)


def _finished(cfg: ExperimentConfig, step: int) -> dict[str, Any] | None:
    """A resumed run that has trained --steps already and written its results: those results."""
    if not (cfg.resume and step >= cfg.steps):
        return None
    done = read_json(Path(cfg.run_dir) / RESULTS_FILE, default=None)
    done = done if isinstance(done, dict) and done.get("steps") == step else None
    say(f"{cfg.run_dir} has trained {step} steps of {cfg.steps}: " + (
        f"nothing to do; {RESULTS_FILE} left as it is" if done else "nothing to train; evaluating its last checkpoint")
        + " (resume with more steps to train on)")
    return done


def _check_resumed(meta: dict[str, Any], cfg: ExperimentConfig, batcher: data.Batcher, topology: Topology) -> None:
    rundir.check_checkpoint_config(meta, cfg)
    if "data_digest" in meta and meta["data_digest"] != batcher.store.digest:  # none in older checkpoints
        raise OptionError(("{} {spec}" if cfg.train else "the numbers corpus") + ": not the data checkpoint {step} "
                          "in {dir} was trained on (changed since?), so the run cannot continue on it: put that data "
                          "back, or train a new run", *["train"][:bool(cfg.train)], spec=cfg.train, step=meta["step"],
                          dir=cfg.run_dir)
    shapes = [list(shape) for shape in batcher.shapes]
    if meta.get("shapes", shapes) != shapes:
        # Each batch size is the most rows of the budget that is a multiple of the device count (make_batcher).
        keep = [n for n in range(1, min(rows for rows, _ in meta["shapes"]) + 1)
                if all(cfg.token_budget // (length * n) * n == rows for rows, length in meta["shapes"])]
        raise OptionError(
            "resuming on {n} device(s) changes the batch shapes from {old} to {new} (batch sizes are multiples of the "
            "device count), so the run would not continue as it started: resume with {} {keep}, which keep them",
            "devices", n=topology.num_devices, old=meta["shapes"], new=shapes,
            keep=" or ".join(map(str, keep[:6])) + (" or ..." if len(keep) > 6 else ""))


def _write_results(results: dict[str, Any]) -> None:
    run_dir = Path(results["run_dir"])
    write_json_atomic(run_dir / RESULTS_FILE, results)
    try:  # a picture that cannot be drawn never fails a finished run; a full disk does
        plots.plot_curves(results["history"], run_dir / CURVES_FILE, plots.run_title(results))
    except OSError:
        raise
    except Exception as err:  # noqa: BLE001 (matplotlib's errors have no common base)
        say(f"warning: {CURVES_FILE} not drawn ({type(err).__name__}: {err})")


def make_batcher(cfg: ExperimentConfig, tokenizers: data.Tokenizers, pairs, num_devices: int = 1,
                 topology: Topology | None = None) -> data.Batcher:
    """The training batches of `pairs` (text pairs or a `data.TokenStore`), sizes a multiple of `num_devices`."""
    if cfg.token_budget < cfg.max_len * num_devices:
        raise OptionError(
            "{} {budget} holds {rows} sequence(s) of {} {max_len}, fewer than the {n} devices each batch is split "
            "over: raise {} to at least {least} or train on fewer devices ({})", "token_budget", "max_len",
            "token_budget", "devices", budget=cfg.token_budget, rows=cfg.token_budget // cfg.max_len,
            max_len=cfg.max_len, n=num_devices, least=cfg.max_len * num_devices)
    examples = pairs if isinstance(pairs, data.TokenStore) else data.encode_pairs(tokenizers, pairs)
    process = (topology.process_index, topology.process_count) if topology is not None else (0, 1)
    batcher = data.Batcher(examples, token_budget=cfg.token_budget, max_len=cfg.max_len, multiple_of=num_devices,
                           seed=cfg.seed, pack=cfg.pack, process=process)
    if not batcher.num_batches:
        raise OptionError("no training pair is left: all {n} are longer than {} {max_len} tokens (<eos> included); "
                          "raise {}", "max_len", "max_len", n=len(batcher.store), max_len=cfg.max_len)
    return batcher


def _eval_summary(result: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in result.items() if k != "samples"}


def _evaluate(cfg, backend, tokenizers, pairs, samples: int, *, validation: bool = True, seen=None,
              stop=None) -> dict[str, Any]:
    """`evaluate_pairs` with lowercased BLEU; --eval-sentences limits validation only; `stop` between batches."""
    return evaluate_pairs(backend, tokenizers, pairs, max_len=cfg.max_len, token_budget=cfg.token_budget,
                          max_sentences=cfg.eval_sentences if validation else None, samples=samples,
                          search=Search(beam=cfg.beam), lowercase=True, moses=cfg.moses, seen=seen, stop=stop,
                          fixed_shapes=cfg.pack)


@dataclasses.dataclass
class _Log:
    """What the loop records across resumes: training windows, evaluations, training time and tokens."""

    train: list[dict[str, float]] = dataclasses.field(default_factory=list)
    valid: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    time_s: float = 0.0
    tokens: int = 0

    @classmethod
    def restore(cls, state: dict[str, Any] | None, step: int) -> _Log:
        """The log saved with the checkpoint of `step` (empty for older checkpoints), up to `step`."""
        if not isinstance(state, dict):
            return cls()
        train, valid = ([e for e in state.get(key) or [] if isinstance(e, dict) and e.get("step", step + 1) <= step]
                        for key in ("train", "valid"))
        return cls(train, valid, float(state.get("time_s") or 0.0), int(state.get("tokens") or 0))


def _log_window(cfg, step: int, values: list[dict[str, float]], tokens: int, elapsed: float, log: _Log, writer, bar,
                compiled: Compiles | None = None):
    """Record the metrics of the steps since the last log (one per step) as one history entry."""
    total = sum(v["tokens"] for v in values)
    log.time_s, log.tokens = log.time_s + elapsed, log.tokens + tokens
    # loss and nll per target token, like the loss; train_time_s: seconds in training steps so far, for curves
    entry = {"step": step, **{key: sum(v[key] * v["tokens"] for v in values) / total for key in ("loss", "nll")},
             "lr": values[-1]["lr"], "grad_norm": values[-1]["grad_norm"],
             "tokens_per_s": tokens / max(elapsed, 1e-9), "train_time_s": log.time_s}
    log.train.append(entry)
    for at, v in enumerate(values, step - len(values) + 1):
        for key in ("loss", "nll", "lr", "grad_norm"):
            writer.add_scalar(f"train/{key}", v[key], at)
    writer.add_scalar("train/tokens_per_s", entry["tokens_per_s"], step)
    bar.update(len(values))
    bar.set_postfix(loss=f"{entry['loss']:.3f}", lr=f"{entry['lr']:.2e}", tok_s=f"{entry['tokens_per_s']:,.0f}",
                    **({"compiled": compiled.programs} if compiled is not None else {}))
    if not cfg.progress:
        say(
            f"step {step}/{cfg.steps} loss {entry['loss']:.4f} lr {entry['lr']:.3e} tok/s {entry['tokens_per_s']:,.0f}"
            + (f", {compiled.text()} so far" if compiled is not None else ""))


def _log_evaluation(step: int, evaluated: dict[str, Any], eval_time: float, log: _Log, writer) -> None:
    # train_time_s: seconds spent training before it (evaluations excluded), for curves; eval_time_s: its own
    log.valid.append({"step": step, "train_time_s": log.time_s, "eval_time_s": eval_time, **_eval_summary(evaluated)})
    _add_scores(writer, "valid", evaluated, step)
    say(
        f"step {step}: valid loss {evaluated['loss']:.4f} ppl {evaluated['ppl']:.3f} "
        f"BLEU {evaluated['bleu']:.2f} chrF {evaluated['chrf']:.2f} exact {evaluated['exact_match']:.1f}% "
        f"({evaluated['sentences']} sentences, {eval_time:.1f} s)" + bands_text(evaluated["bands"]))
    for sample in evaluated["samples"]:
        say(f"  {sample['source']}\n    ref: {sample['reference']}\n    hyp: {sample['hypothesis']}")


def _add_scores(writer, split: str, evaluated: dict[str, Any], step: int) -> None:
    for key in ("loss", "ppl", "bleu", "chrf", "exact_match"):
        writer.add_scalar(f"{split}/{key}", evaluated[key], step)


def _check_finite(backend: Backend, values: list[dict[str, float]], step: int) -> None:
    """TrainingDiverged ('loss nan at step 7') for the first window step whose loss or gradient norm is not finite."""
    for at, v in enumerate(values, step - len(values) + 1):
        for key in ("loss", "grad_norm"):
            if not math.isfinite(v[key]):
                raise _diverged(backend, f"{key.replace('_', ' ')} {v[key]} at step {at}")


def _diverged(backend: Backend, what: str) -> TrainingDiverged:
    saved = backend.checkpoint_steps()
    kept = f"the checkpoints up to step {saved[-1]} are intact" if saved else "no checkpoint was saved"
    return TrainingDiverged("training diverged: {what}; stopped before saving it ({kept}). Lower {}, raise {} or set "
                            "{}, and train again", "lr_factor", "warmup", "clip_norm", what=what, kept=kept)


def _save(cfg: ExperimentConfig, backend: Backend, batcher: data.Batcher, evaluated: dict[str, Any] | None,
          log: _Log) -> None:
    meta = {
        "step": backend.step,
        "data": batcher.state(),  # where the next batch comes from, for --resume
        "shapes": [list(shape) for shape in batcher.shapes],  # checked on --resume
        "data_digest": batcher.store.digest,  # checked on --resume: the same training data
        "config": cfg.experiment(),
        "valid": None if evaluated is None else _eval_summary(evaluated),
        "history": dataclasses.asdict(log),  # results.json's history, restored by --resume
    }
    # Strict JSON in both backends' meta (orbax's JsonSave would write NaN): non-finite -> null.
    backend.save(finite_values(meta), metrics=None if evaluated is None else {"bleu": evaluated["bleu"]})


def _average_last(backend: Backend, last: int) -> list[int]:
    """The weights replaced by the mean of the newest `last` - 1 checkpoints' and its own; the steps averaged."""
    earlier = [step for step in backend.checkpoint_steps() if step < backend.step][-(last - 1):]
    if not earlier:
        return []
    current = backend.export_state()
    states = []
    for step in earlier:
        backend.restore(step)
        states.append(backend.export_state())
    backend.import_state(average_states([*states, current]))
    return [*earlier, current.step]


def fit(run: Training) -> None:
    """The update loop to cfg.steps: train, log, evaluate, checkpoint; a stop signal saves and raises Interrupted."""
    cfg, backend, batcher, writer, log = run.cfg, run.backend, run.batcher, run.writer, run.log
    # Several processes must agree on the update to stop after: those of a backend that can ask the others.
    agreed = getattr(backend, "agreed_signal", None) if run.topology.process_count > 1 else None
    with (runtime.StopSignals(enabled=run.topology.process_count == 1 or agreed is not None) as stop,
          tqdm(total=cfg.steps, initial=backend.step, disable=not (cfg.progress and run.topology.is_main),
               unit="step", dynamic_ncols=True, desc=cfg.backend) as bar):
        agreed = agreed or (lambda signum: signum)
        pending: list = []  # metrics of the steps not yet read from the device
        window_tokens, window_start = 0, time.perf_counter()
        for step in range(backend.step + 1, cfg.steps + 1):
            batches = [next(batcher) for _ in range(cfg.grad_accum)]
            pending.append(backend.train_step(batches))
            window_tokens += sum(b.num_tgt_tokens for b in batches)

            stop.requested = agreed(stop.requested)
            stopping = stop.requested is not None
            evaluate_now = (step % cfg.eval_every == 0 or step == cfg.steps) and not stopping
            save_now = step % cfg.save_every == 0 or step == cfg.steps or stopping
            # Also log before an evaluation or a save, so that tokens/s never counts their time.
            if step % cfg.log_every == 0 or evaluate_now or save_now:
                values = backend.fetch(pending)  # the loop's only host sync between evaluations
                _check_finite(backend, values, step)
                _log_window(cfg, step, values, window_tokens, time.perf_counter() - window_start, log, writer, bar,
                            run.compiled())
                pending, window_tokens = [], 0

            if step == cfg.steps and cfg.average_last > 1:  # the final weights: before their evaluation and save
                run.averaged = _average_last(backend, cfg.average_last)
            evaluated = None
            if evaluate_now:
                eval_start = time.perf_counter()
                try:
                    evaluated = _evaluate(cfg, backend, run.tokenizers, run.splits.valid, cfg.samples,
                                          stop=lambda: run.topology.process_count == 1 and stop.requested is not None)
                    eval_time = time.perf_counter() - eval_start  # compiling included
                except EvaluationStopped:  # a signal came mid-evaluation: save without it
                    stopping = save_now = True
                else:
                    if not math.isfinite(evaluated["loss"]):
                        raise _diverged(backend, f"validation loss {evaluated['loss']} at step {step}")
                    _log_evaluation(step, evaluated, eval_time, log, writer)
                stop.requested = agreed(stop.requested)
                if stop.requested is not None:  # a signal after the evaluation's last look: stop before the next update
                    stopping = save_now = True
            if save_now:
                _save(cfg, backend, batcher, evaluated, log)
            if stopping:
                raise Interrupted(stop.requested, "" if not run.topology.is_main else (  # process 0 says it, once
                    f"{signal.Signals(stop.requested).name}: stopped at step {step} of {cfg.steps} with a checkpoint "
                    f"saved; continue with\n  {resume_command(cfg)}"))
            if not pending:  # just logged: the next window starts now, after any evaluation or save
                window_start = time.perf_counter()


def finish(run: Training, started: float) -> dict[str, Any]:
    """Final validation (unless the last step just ran it) and test evaluation; the results dict."""
    cfg, backend, tokenizers, splits = run.cfg, run.backend, run.tokenizers, run.splits
    writer, log = run.writer, run.log
    if log.valid and log.valid[-1]["step"] == backend.step:
        valid = {k: v for k, v in log.valid[-1].items() if k not in ("train_time_s", "eval_time_s")}  # history's own
    else:  # a resumed run that had nothing left to train
        valid = {"step": backend.step, **_eval_summary(_evaluate(cfg, backend, tokenizers, splits.valid, 0))}
    test = None
    if splits.test:  # scored whole: --eval-sentences limits validation only
        seen = {source for source, _ in splits.train} if cfg.uses_numbers_corpus else None  # for "bands"
        test = {"step": backend.step,
                **_eval_summary(_evaluate(cfg, backend, tokenizers, splits.test, 0, validation=False, seen=seen))}
        _add_scores(writer, "test", test, backend.step)
        for band, scores in (test["bands"] or {}).items():
            writer.add_scalar(f"test/exact_match_{band}_digits", scores["exact_match"], backend.step)
    best = max(log.valid, key=lambda v: (v["bleu"], v["step"]), default=None)
    compiled = run.compiled()
    return {
        "backend": cfg.backend,
        "run_dir": cfg.run_dir,
        "steps": backend.step,
        "num_params": backend.num_params,
        "train": {
            "loss": log.train[-1]["loss"] if log.train else None,
            "time_s": log.time_s,
            "tokens_per_s": log.tokens / log.time_s if log.time_s else None,  # real (non-pad) target tokens
            "padding_share": run.batcher.padding_share(),  # of the source and target positions, epoch 0's batches
            "packed": cfg.pack,
        },
        # This invocation's JAX programs (cache reads included) and compile seconds; null for torch.
        **(compiled.to_dict() if compiled is not None else dict.fromkeys(Compiles().to_dict())),
        "valid": valid,
        "test": test,
        "best": None if best is None else {"step": best["step"], "bleu": best["bleu"]},
        "averaged_steps": run.averaged,
        "wall_time_s": time.perf_counter() - started,
        "config": cfg.to_dict(),
        "model": backend.model_cfg.to_dict(),
        "history": {"train": log.train, "valid": log.valid},  # the whole run's, across resumes
    }


def _summary_line(results: dict[str, Any]) -> str:
    valid, test = results["valid"], results["test"]
    compiled = "" if results.get("compiled_programs") is None else (
        f", {results['compiled_programs']} programs compiled in {results['compile_seconds']:.1f} s")
    parts = [  # wall_time_s is this invocation's; train.time_s adds up every session's training
        f"[{results['backend']}] done: {results['steps']} steps in {results['wall_time_s']:.0f} s "
        f"({results['train']['time_s']:.0f} s of training since step 0{compiled})",
        f"valid loss {valid['loss']:.4f} ppl {valid['ppl']:.3f} BLEU {valid['bleu']:.2f}",
    ]
    if results.get("averaged_steps"):
        parts.insert(1, "weights of steps " + ", ".join(map(str, results["averaged_steps"])) + " averaged")
    if test is not None:
        parts.append(
            f"test ({test['sentences']} sentences) BLEU {test['bleu']:.2f} chrF {test['chrf']:.2f} "
            f"exact {test['exact_match']:.1f}%" + bands_text(test["bands"]))
    parts.append(str(Path(results["run_dir"]) / RESULTS_FILE))
    return " | ".join(parts)
