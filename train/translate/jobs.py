"""The jobs of `aiayn translate`, `aiayn evaluate` and `aiayn score`, callable from Python with the options
objects of `train.options`: `translate_file`, `evaluate_spec`, `score_file`."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import os
import sys
from typing import Any

from torch_reference.config import escaped

from .. import api
from ..backends.host_devices import split_host
from ..data import load_parallel
from ..data.corpora import spec_files
from ..data.streams import LineReader
from ..options import Evaluation, RunSelection, Sampling, ScoreFiles, Search, TranslateFiles, check_format, check_single
from ..runtime import Interrupted, interruptible
from ..runtime.destination import Destination, open_stream
from ..runtime.files import OptionError, UserError, error_text, json_text
from .output import OtherInput, PartialOutput, Progress, StreamOutput
from .stream import TsvColumns, translate_stream


def translate_file(selection: RunSelection, search: Search = Search(), sample: Sampling | None = None,
                   files: TranslateFiles = TranslateFiles()) -> None:
    """Translate `files.input` (stdin) into `files.output` (stdout), one record per line, chunk by
    chunk, resumably (docs/decoding.md); a summary on stderr. Raises UserError, OSError, and
    Interrupted naming what was kept."""
    check_format(files.format, search, sample)
    ensemble = len(selection.run_dir) > 1
    check_single(ensemble and search.alignments, "alignments")
    check_single(ensemble and files.plot_attention is not None, "plot_attention")
    split_host()  # before jax is imported
    reader = LineReader(files.input, files.max_line_bytes)
    first = next(reader, None)  # read before the run loads: bad input fails fast
    columns = None
    tsv = files.input is not None and files.input.name.endswith((".tsv", ".tsv.gz"))
    if (files.input_format or ("tsv" if tsv else "text")) == "tsv":
        if first is None:
            raise UserError(f"{reader.name} is empty: TSV input needs a header row")
        columns, first = TsvColumns(first, reader.name), next(reader, None)
    prefixed = columns is not None and columns.prefix is not None  # the prefix column of TSV input: forced prefixes
    if sample is not None:
        sample.check_with(search, prefixes=prefixed)
    if files.plot_attention is not None:
        from .attention import check_plot_directory

        check_plot_directory(files.plot_attention, files.input)
    # What else shapes the output, recorded where it departs from plain text (earlier partial outputs stay valid).
    decoding = {k: v for k, v in {"n_best": search.n_best, "format": files.format, "alignments": search.alignments,
                                  "prefix": prefixed, "sample": sample and dataclasses.asdict(sample),
                                  "ensemble": ensemble and [str(d.absolute()) for d in selection.run_dir[1:]]}.items()
                if v not in (None, "text", False)}
    # Checked before the work, not after it; target None: a stream, written directly.
    output = None if files.output is None else Destination(files.output, "output")
    target = output and output.target
    if output is not None and any(reader.same_file(f) for f in output.side_files):
        raise OptionError("{} {path} is the input {input}: writing it would destroy the input (or a file written "
                          "beside it); give another {}", "output", "output", path=files.output, input=reader.name)
    with api.load(selection) as run:
        if first is None:
            raise UserError(f"{reader.name} holds no sentence to translate")
        topology = run.backend.topology
        if not topology.is_main:  # every process translates alike; process 0 alone writes
            out = StreamOutput(open(os.devnull, "w"))  # noqa: SIM115 (closed at the end)
        elif target is None:  # standard output, or a stream written directly
            out = StreamOutput(files.output and open_stream(files.output))
        else:
            out = PartialOutput(target, {"run_dir": str(selection.run_dir[0].absolute()), "step": run.backend.step,
                                         "weights": run.weights_digest(), "beam": search.beam, "alpha": search.alpha,
                                         "scoring": search.scoring, **decoding})
        if out.note:
            print(out.note, file=sys.stderr)
        progress = Progress(files.progress and topology.is_main and sys.stderr.isatty(), reader.fraction)
        counts: collections.Counter = collections.Counter()
        try:
            with interruptible():
                skipped = translate_stream(
                    run, itertools.chain([first], reader), out, chunk_lines=files.chunk_lines, progress=progress,
                    counts=counts, plot_attention=files.plot_attention, fmt=files.format, columns=columns,
                    batch_size=files.batch_size, search=search, sample=sample,
                    hypotheses=sample is not None and files.format != "text")
            out.finish()
        except (Interrupted, KeyboardInterrupt) as stop:
            signum = getattr(stop, "signum", 2)
            kept = f"; {out.kept()}" if out.done and isinstance(out, PartialOutput) else ""
            raise Interrupted(signum, f"interrupted ({Interrupted(signum)}) after {out.done:,} input lines{kept}")
        except (UserError, OSError) as err:  # bad input further on, a full disk: the chunks before it are kept
            resumable = out.done and isinstance(out, PartialOutput) and not isinstance(err, OtherInput)
            kept = f" ({out.kept()})" if resumable else ""
            if isinstance(err, OptionError):  # still naming its parameters
                raise OptionError(err.template + escaped(kept), *err.names, **err.values) from None
            raise UserError(error_text(err) + kept) from None
        finally:
            progress.clear()
            reader.close()
            out.close()
    if topology.is_main:
        cut = f"; {counts['cut']:,} cut to the model's {run.config.max_len} tokens" if counts["cut"] else ""
        resumed = f"; continued after line {skipped:,}" if skipped else ""
        devices = f" on {topology.num_devices} devices" if topology.num_devices > 1 else ""
        print(progress.summary() + devices + cut + resumed, file=sys.stderr)


def evaluate_spec(selection: RunSelection, data: str, search: Search = Search(),
                  evaluation: Evaluation = Evaluation(), output: os.PathLike | None = None) -> dict[str, Any]:
    """`Run.evaluate` of the runs `selection` on the data spec `data`, printed as JSON (and written to
    `output`, atomically); returns the result."""
    split_host()  # before jax is imported
    destined = None if output is None else Destination(output, "output", spec_files(data), f"the data {data}")
    with api.load(selection) as run:
        if run.config.lowercase and not evaluation.lowercase:  # lowercase output: cased BLEU alone would mislead
            print(f"note: {selection.run_dir[0]} was trained with --lowercase, so its translations are lowercase: "
                  "bleu_lc (lowercased references) is scored too", file=sys.stderr)
        result = run.evaluate(data, search, evaluation)
    text = json_text(result)  # strict JSON: a non-finite score is null, never NaN
    print(text, flush=True)
    if destined is not None:
        destined.write(text + "\n")
    return result


def score_file(selection: RunSelection, files: ScoreFiles) -> None:
    """Per pair of the data spec `files.input`, the target's log-probability under the runs `selection`
    (`Run.score`), one line each to `files.output` (stdout): the number, or (format "jsonl") with its tokens."""
    split_host()  # before jax is imported
    input, output = files.input, files.output
    destined = None if output is None else Destination(output, "output", spec_files(input), f"the input {input}")
    loaded = load_parallel(input)
    if loaded.skipped_empty:  # skipped, line N would no longer be pair N's score
        raise OptionError("{} {input}: {n:,} pairs with an empty side; every pair gets its line, so remove them or "
                          "give them text", "input", input=input, n=loaded.skipped_empty)
    if not loaded.pairs:
        raise UserError(f"{input} holds no pair to score")
    with api.load(selection) as run:
        scores = run.score([s for s, _ in loaded.pairs], [t for _, t in loaded.pairs], batch_size=files.batch_size)
    text = "".join((json.dumps(s, ensure_ascii=False) if files.format == "jsonl" else f"{s['logprob']:.7g}") + "\n"
                   for s in scores)
    if destined is None:
        print(text, end="", flush=True)
    else:
        destined.write(text)
    print(f"scored {len(scores):,} pairs", file=sys.stderr)
