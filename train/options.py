"""The options of the library's jobs (`Search`, `Sampling`, `RunSelection`, ...) as dataclasses that check themselves
when made (`checked`); the API, the server and the commands build these, so a rule lives here alone. Its error names
the parameter; a command's flags come from the fields (`add_flags`), and its `run` words the error with them:

    >>> Sampling(top_p=2)
    Traceback (most recent call last):
    ...
    train.runtime.files.OptionError: top_p must be in (0, 1], got 2
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Optional, get_args, get_origin

from torch_reference.config import (ALPHA, AVERAGES, NON_NEGATIVE, POSITIVE, SAMPLING_RANGES, SCORINGS, SettingError,
                                    check_beam, check_settings, hints, kind_of, setting)

from .config import BATCH, BEAM
from .config import flag_name as flag_of
from .runtime.destination import Destination
from .runtime.files import OptionError, UserError
from .runtime.signals import exit_status

# The type of a field naming a file a command writes: given a path, checked at once and kept as its `Destination`.
Output = Optional[Destination]
ENSEMBLE_AVERAGES = AVERAGES  # the twins' ensemble.AVERAGES


def option(default: Any, help: str, **meta: Any) -> Any:
    """A `setting` with its flag's `help`, and `range` or `choices`, `flag` (--the-name), `metavar`, `group`."""
    return setting(default, help=help, **meta)


def checked(cls: type) -> type:
    """`cls` as a frozen dataclass checking its fields when made (`check_settings`), then its own `check`."""

    def __post_init__(self) -> None:
        check_settings(self, OptionError)
        for name, hint in hints(cls).items():
            if kind_of(hint)[0] is Destination and (value := getattr(self, name)) is not None:
                object.__setattr__(self, name, destination(value, name))
        getattr(self, "check", lambda: None)()

    cls.__post_init__ = __post_init__
    return dataclasses.dataclass(frozen=True)(cls)


def destination(value: Any, name: str) -> Destination:
    """`value` (a path, or a Destination) as the `Destination` of parameter `name` (docs/operations.md#output-files)."""
    return value if isinstance(value, Destination) else Destination(value, name)


def add_flags(parser: argparse.ArgumentParser, cls: type, *, skip: Iterable[str] = (), only: Iterable | None = None,
              group: Any = None, groups: Mapping | None = None, show_defaults: bool = True) -> None:
    """One flag per field of the dataclass `cls` (`only` those, but `skip`) in `parser`, its default SUPPRESSed:
    only the flags given reach `build`, so the class's defaults apply to the rest."""
    for field in dataclasses.fields(cls):
        if field.name in skip or (only is not None and field.name not in only):
            continue
        meta, (kind, _) = field.metadata, kind_of(hints(cls)[field.name])
        many = get_origin(kind) is list
        default = field.default if field.default is not dataclasses.MISSING else None
        shown = show_defaults and default not in (None, "") and kind not in (bool, dict) and not many
        kwargs: dict = {"dest": field.name, "default": argparse.SUPPRESS, "required": bool(meta.get("required")),
                        "help": f"{meta['help']} (default: {default})" if shown else meta["help"]}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif "parse" in meta:  # a repeatable flag of its own syntax (--set FIELD=VALUE)
            kwargs.update(action="append", type=typed(meta["parse"]), metavar=meta.get("metavar"))
        else:  # typed here, checked once by the class (its error worded with the flag: `run`, `recipes.flagged`)
            item = get_args(kind)[0] if many else kind
            kwargs.update(type=meta["range"].kind if "range" in meta else _PARSERS.get(item, str),
                          choices=meta.get("choices"), metavar=meta.get("metavar", {int: "N", float: "X"}.get(kind)),
                          action="append" if many else "store")
        parser.flags[field.name] = flag_of(field)
        target = groups[meta["group"]] if groups and "group" in meta else group or parser
        target.add_argument(parser.flags[field.name], **kwargs)


def typed(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse` as an argparse type: its ValueError's message is the flag's error."""

    def parsed(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err).lstrip()) from None

    return parsed


# An `Output` field's path is refused while the flags are read, not after minutes of work.
_PARSERS = {int: int, float: float, Path: Path, Destination: typed(lambda text: destination(text, ""))}


def build(cls: type, given: Mapping[str, Any]) -> Any:
    """`cls` from the flags `given` (argparse's dict: field name -> value) that are its fields."""
    return cls(**{k: v for k, v in given.items() if k in {f.name for f in dataclasses.fields(cls)}})


def command(prog: str, description: str, *classes: type, **kwargs: Any) -> argparse.ArgumentParser:
    """A command's parser (`kwargs`: ArgumentParser's), a flag per field of each of `classes`; `flags`: name -> flag."""
    parser = argparse.ArgumentParser(prog=prog, description=description, **kwargs)
    parser.flags = {}
    for cls in classes:
        add_flags(parser, cls)
    return parser


def worded(err: Exception, flags: Mapping[str, str]) -> str:
    """`err`'s message, a SettingError's with the `flags` (field name -> flag) for the parameters it names."""
    return err.worded(lambda name: flags.get(name, name)) if isinstance(err, SettingError) else str(err)


def run(parser: argparse.ArgumentParser, argv: list[str] | None, job: Callable[[dict[str, Any]], Any]) -> int:
    """A command's exit status (`runtime.exit_status`) of `job` of the flags given, a SettingError worded with them."""
    given = vars(parser.parse_args(argv))

    def flagged() -> Any:
        try:
            return job(given)
        except SettingError as err:  # an options class's, a model config's, the library's
            raise UserError(worded(err, parser.flags)) from None

    return exit_status(flagged)


@checked
class Search:
    """A beam search (greedy: beam 1; docs/decoding.md); `n_best` K or `alignments`: K (1) `Hypothesis` per sentence."""

    beam: int = option(4, "beam size (1 = greedy search)", range=BEAM)
    alpha: float = option(0.6, "beam search's length penalty exponent: see --scoring", range=ALPHA)
    scoring: str = option(
        "gnmt", "how beam search ranks finished translations: 'gnmt' divides their log-probability by "
        "((5+len)/6)^alpha and lets an <eos> among the 2 x beam best candidates finish; 'hf' divides by len^alpha, "
        "lets only an <eos> among the beam best finish and counts an <eos> forced at the length limit as free, as "
        "HF transformers' generate(num_beams=beam, length_penalty=alpha, early_stopping='never') does",
        choices=SCORINGS)
    n_best: int | None = option(None, "the K best translations of each sentence, best first (K <= --beam; with "
                                "--format tsv or jsonl)", range=BEAM, metavar="K")
    alignments: bool = option(False, "with --format jsonl: one source position per target token (the argmax of "
                              "the last decoder layer's cross-attention averaged over heads), and the source tokens")

    def check(self) -> None:
        try:
            check_beam(self.beam, self.alpha, self.scoring, self.n_best)  # the searches' own rule
        except SettingError as err:  # the searches' beam_size is this beam
            names = ("beam" if n == "beam_size" else n for n in err.names)
            raise OptionError(err.template, *names, **err.values) from None


@checked
class Sampling:
    """Random sampling instead of a search (docs/decoding.md#sampling): the same samples whatever the batch."""

    num_samples: int = option(1, "N samples per sentence (translate: N > 1 with --format tsv or jsonl)",
                              range=BEAM, metavar="N")
    temperature: float = option(1.0, "divide the log-probabilities by T > 0 before drawing (< 1 sharper)",
                                range=SAMPLING_RANGES["temperature"], metavar="T")
    top_k: int = option(0, "draw among the K most probable tokens (0: all)", range=SAMPLING_RANGES["top_k"], metavar="K")
    top_p: float = option(1.0, "draw among the most probable tokens whose probabilities reach P, in (0, 1] (1: all)",
                          range=SAMPLING_RANGES["top_p"], metavar="P")
    seed: int = option(0, "the random numbers' seed, in [0, 2**32): the same seed gives the same samples, in the "
                       "jax and torch backends alike, whatever the batching", range=SAMPLING_RANGES["seed"], metavar="S")

    def check_with(self, search: Search, prefixes: bool = False) -> None:
        """OptionError for the searches' options: n-best lists, forced prefixes, scoring "hf" (samples are unranked)."""
        if search.n_best is not None:
            raise OptionError("{} with {}: sampling gives {} translations, not a ranked list", "sample", "n_best",
                              "num_samples")
        if prefixes:
            raise OptionError("{} with prefixes: forced prefixes are for the searches", "sample")
        if search.scoring != "gnmt":
            raise OptionError("{} with {} " + f"{search.scoring}: scoring ranks a beam's hypotheses, a sample is "
                              "not ranked", "sample", "scoring")


def check_single(ensemble: bool, name: str) -> None:
    """OptionError for `name`, an option drawing attention weights (alignments, heatmaps), with an ensemble."""
    if ensemble:
        raise OptionError("{} with an ensemble: its members' attention weights are not one alignment", name)


def check_format(fmt: str, search: Search, sample: Sampling | None = None) -> None:
    """OptionError for output options that cannot be written: one line per input line, always."""
    for name, many in (("n_best", search.n_best or 1), ("num_samples", sample.num_samples if sample else 1)):
        if fmt == "text" and many > 1:
            raise OptionError("{} " + f"{many} gives several translations per input line: give " + "{} tsv or jsonl",
                              name, "format")
    if search.alignments and fmt != "jsonl":
        raise OptionError("{} are written with {} jsonl", "alignments", "format")


@checked
class RunSelection:
    """Which runs `train.load` loads (several: an ensemble combined by `average`), at `checkpoint`, onto which devices"""

    run_dir: list[Path] = option(
        [], "the run directory (holds config.json, tokenizer, checkpoints/); given again, an ensemble: the runs' "
        "log-probabilities averaged (runs of one framework with the same tokenizers, each at --checkpoint)",
        required=True, metavar="DIR")
    checkpoint: str | int = option("best", "'best' (by validation BLEU), 'latest', or a step number")
    average: str = option(
        "logprob", "how an ensemble combines its runs at each step: 'logprob' (Marian's) the mean of their "
        "log-probabilities, renormalised; 'prob' the log of the mean probability (fairseq's)",
        choices=ENSEMBLE_AVERAGES, flag="--ensemble-average")
    devices: int | None = option(
        None, "jax runs: decode each batch data parallel over the first N devices (default: every visible device, on "
        "a CPU one per core); a torch run translates on one device and refuses N > 1", range=POSITIVE)
    coordinator_address: str | None = option(
        None, "jax multi-process: HOST:PORT of process 0's coordinator, as train.run's: every process reads the "
        "whole input, process 0 writes; default: $JAX_COORDINATOR_ADDRESS, else a single process",
        metavar="HOST:PORT")
    num_processes: int | None = option(None, "jax multi-process: number of processes", range=POSITIVE)
    process_id: int | None = option(None, "jax multi-process: this process's id, 0..N-1", range=NON_NEGATIVE)

    def check(self) -> None:
        one = isinstance(self.run_dir, (str, os.PathLike)) or not isinstance(self.run_dir, Iterable)
        dirs = [self.run_dir] if one else list(self.run_dir)  # a generator too
        if not dirs:
            raise OptionError("{}: an ensemble needs at least one run directory, got []", "run_dir")
        if not all(isinstance(d, (str, os.PathLike)) for d in dirs):
            raise OptionError("{}: give a run directory or a list of them, " + f"got {dirs!r}", "run_dir")
        object.__setattr__(self, "run_dir", [Path(d) for d in dirs])

    @property
    def launch(self) -> dict[str, Any]:
        """The launch options given (`ExperimentConfig`'s fields)."""
        return {k: v for k in ("devices", "coordinator_address", "num_processes", "process_id")
                if (v := getattr(self, k)) is not None}


@checked
class Evaluation:
    """What `Run.evaluate` scores besides the search's translations (`train.translation.evaluate_pairs`)."""

    max_sentences: int | None = option(None, "translate only the first N pairs for BLEU/chrF; default: all",
                                       range=POSITIVE)
    lowercase: bool = option(False, "also score BLEU on lowercased text (13a tokenization), as bleu_lc with its "
                             "signature (always for a run trained with --lowercase)")
    moses: str | None = option(
        None, "also score BLEU on Moses-tokenized text of language LANG (e.g. de, en; sacremoses, no escaping; "
        "sacreBLEU's tokenization off), as papers quoting tokenized BLEU do: bleu_moses, and bleu_moses_lc with "
        "--lowercase", metavar="LANG")
    samples: int = option(0, "include N example translations in the JSON", range=NON_NEGATIVE)


@checked
class EvaluateFiles:
    """What `aiayn evaluate` scores, and where it also writes its JSON (`jobs.evaluate_spec`)."""

    data: str = option(None, "parallel data to score (see below)", required=True, metavar="DATA")
    output: str | Path | None = option(None, "also write the JSON to this file, atomically (a symbolic link's "
                                       "target); a FIFO, device, socket or /dev/fd/N is written directly")


@checked
class Sample:
    """Whether `aiayn translate` samples (how: `Sampling`) instead of searching."""

    sample: bool = option(False, "draw each token at random from the model's distribution instead of searching "
                          "(--beam and --alpha unused; --scoring hf, --n-best and prefixes refused: a sample is not "
                          "ranked); with --format tsv/jsonl each sample's log-probability (its score too)")


@checked
class TranslateFiles:
    """Where `aiayn translate` reads and writes, and how (`translation.translate_file`)."""

    input: Path | None = option(None, "one source sentence per line: a file (plain, or gzip when named .gz), a "
                                "FIFO, /dev/stdin or <(command); default: stdin")
    output: str | Path | None = option(
        None, "write translations here instead of stdout: through .OUTPUT.partial, renamed onto OUTPUT at the end (a "
        "symbolic link's target); an interrupted run (Ctrl-C, SIGTERM, a crash) leaves OUTPUT as it was and the same "
        "command continues after the finished chunks. A FIFO, device, socket or /dev/fd/N (>(command)) is written "
        "directly, as a stream: no partial file, no resume")
    input_format: str | None = option(
        None, "text: one source sentence per line; tsv: a header row naming the columns 'source' and, optionally, "
        "'prefix' (each output's forced start: the search continues after it), then one row per sentence (default: "
        "tsv for an --input named .tsv or .tsv.gz, else text)", choices=("text", "tsv"))
    format: str = option(
        "text", "text: the best translation; tsv: per hypothesis its text, log-probability and length-normalised "
        "score, tab-separated; jsonl: a JSON object with the hypotheses, their scores and target tokens. Always one "
        "line per input line", choices=("text", "tsv", "jsonl"))
    chunk_lines: int = option(4000, "lines read, translated and written at a time; memory grows with this, not with "
                              "the input", range=POSITIVE)
    max_line_bytes: int = option(1 << 20, "refuse a line longer than this, naming it", range=POSITIVE)
    batch_size: int | None = option(None, "at most N sentences per batch; default: as many as the run's "
                                    "--token-budget", range=BATCH)
    plot_attention: Path | None = option(
        None, "also write each sentence's cross-attention heatmaps to DIR (created): NNNN.png for input line N (the "
        "last decoder layer, heads averaged) and NNNN_layers.png (every layer x head)", metavar="DIR")
    progress: bool = option(True, "a progress line on stderr (shown only when stderr is a terminal); the summary "
                            "stays")


@checked
class ScoreFiles:
    """Which pairs `aiayn score` scores, and where and how it writes their log-probabilities (`jobs.score_file`)."""

    input: str = option(None, "the pairs: a data spec as train.run's --valid takes (FILE.tsv with columns source and "
                        "target, SRC:TGT:PREFIX for PREFIX.SRC and PREFIX.TGT, FILE.jsonl)", required=True)
    output: str | Path | None = option(None, "write here instead of stdout")
    format: str = option("text", "text: the log-probability; jsonl: also the target tokens (<eos> last) and each "
                         "one's log-probability", choices=("text", "jsonl"))
    batch_size: int | None = option(None, "at most N pairs per batch (default: the run's token budget)", range=BATCH)


def sampling_of(sample: Sampling | bool | None, settings: Mapping[str, Any]) -> Sampling | None:
    """How to sample: `sample` when a `Sampling`, one of the `settings` (its fields) when True, else None."""
    if not (sample is None or isinstance(sample, (bool, Sampling))):  # booleans only as booleans: not 1 nor "yes"
        raise OptionError("{} must be true or false, got {got!r}", "sample", got=sample)
    if not sample:
        if settings:
            raise OptionError(", ".join(["{}"] * len(settings)) + " without {}: sampling settings, the searches take "
                              "none", *settings, "sample")
        return None
    if isinstance(sample, Sampling) and settings:
        raise OptionError("{}: give a Sampling or its fields as keywords, not both", "sample")
    return sample if isinstance(sample, Sampling) else Sampling(**settings)


SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(Sampling))
