"""One way to declare and check a setting (issue 77): a field's rule (`torch_reference.config.setting`) is
checked wherever the value comes from, once; its error names the parameter in Python and the flag on the
command line, in one line. And the numbers a user can type that passed the checks and failed inside (issue 79,
cases 3 and 7)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

import train
from torch_reference.config import SettingError, TransformerConfig
from train.commands import run as run_command
from train.commands import translate
from train.config import BATCH, MAX_BEAM, ExperimentConfig
from train.options import OptionError, Sampling, Search, TranslateFiles
from train.runtime import UserError
from train.serving.limits import BadRequest, Limits, parse_request

from .cli import run_cli
from .helpers import _exit_status

TEXTS = ["sieben", "dreiundvierzig"]


def _one_line(err: Exception | str) -> str:
    text = str(err)
    assert "\n" not in text.strip() and "Traceback" not in text, text
    return text.strip()


def _flag_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        run_command.parse_config(argv)
    assert exit_.value.code == 2
    return _one_line(capsys.readouterr().err)


@pytest.mark.parametrize("changes, python, flags", [
    (dict(resume=True), "resume needs run_dir", ["--resume"]),
    (dict(overwrite=True), "overwrite needs run_dir", ["--overwrite"]),
    (dict(valid="v.tsv"), "valid/test need train", ["--valid", "v.tsv"]),
    (dict(token_budget=64, max_len=128), "token_budget=64 must hold one sequence of max_len=128",
     ["--token-budget", "64", "--max-len", "128"]),
    (dict(steps=0), "steps must be >= 1, got 0", ["--steps", "0"]),
    (dict(lr_factor=float("nan")), "lr_factor must be finite, got nan", ["--lr-factor", "nan"]),
    (dict(model={"pad_id": 5}), "model: pad_id cannot be set", None),
])
def test_an_experiment_setting_names_the_parameter_in_python_and_the_flag_on_the_command_line(
        changes, python, flags, capsys):
    """Its messages named the flags even in Python (`train.fit(run_dir=None, overwrite=True)`: '--resume and
    --overwrite need --run-dir'); now the parameter there, the flag here, from one rule."""
    with pytest.raises(OptionError) as info:
        train.fit(**changes)
    assert _one_line(info.value).startswith(python)
    if flags is None:  # --set's own parser refuses the special ids before the config sees them
        return
    worded = re.sub(r"\b(resume|overwrite|run_dir|valid|test|train|token_budget|max_len|steps|lr_factor)\b",
                    lambda m: "--" + m.group(1).replace("_", "-"), python)
    assert _flag_error(flags, capsys).startswith(f"error: {worded}")


def test_every_class_checks_its_fields_by_one_rule():
    """The model config, the experiment config and a job's options refuse alike (one `setting_error`)."""
    cases = [(lambda: TransformerConfig(d_model=np.int64(0)), "d_model must be >= 1, got 0"),
             (lambda: ExperimentConfig(grad_accum=np.int64(0)), "grad_accum must be >= 1, got 0"),
             (lambda: Search(beam=np.int64(0)), "beam must be >= 1, got 0"),
             (lambda: TransformerConfig(tie_output=1), "tie_output must be true or false, got 1"),
             (lambda: ExperimentConfig(remat=1), "remat must be true or false, got 1"),
             (lambda: Search(alignments="yes"), "alignments must be true or false, got 'yes'"),
             (lambda: TransformerConfig(norm="batchnorm"), "norm must be one of layernorm, rmsnorm, got 'batchnorm'"),
             (lambda: ExperimentConfig(dtype="int8"), "dtype must be one of float32, bfloat16, got 'int8'"),
             (lambda: Search(scoring="best"), "scoring must be one of gnmt, hf, got 'best'")]
    for make, message in cases:
        with pytest.raises(SettingError) as info:
            make()
        assert _one_line(info.value) == message


def test_n_best_above_the_beam_is_one_rule_for_the_searches_and_the_options():
    from torch_reference.decode import beam_search

    from torch_reference.model import Transformer
    import torch

    model = Transformer(TransformerConfig.preset("tiny", src_vocab_size=20, tgt_vocab_size=20, max_len=8)).eval()
    with pytest.raises(SettingError) as spec:
        beam_search(model, torch.tensor([[5, 6, 2]]), beam_size=2, n_best=3)
    with pytest.raises(OptionError) as options:
        Search(beam=2, n_best=3)
    assert _one_line(spec.value).replace("beam_size", "beam") == _one_line(options.value)


def test_the_seed_is_refused_in_one_line_past_what_both_backends_take(capsys):
    """--seed 2147483648 was a 38-line traceback from JAX (after making a run directory), 2**70 torch's 'Overflow
    when unpacking long long', train.fit(seed=2**70) a raw ValueError."""
    assert _flag_error(["--seed", "2147483648"], capsys) == "error: --seed must be in [0, 2147483648), got 2147483648"
    for seed in (2**31, 2**70, -1):
        with pytest.raises(OptionError, match=rf"^seed must be in \[0, 2147483648\), got {seed}$"):
            train.fit(seed=seed)
    import jax
    import torch

    top = ExperimentConfig(seed=2**31 - 1).seed  # the bound: what the JAX backend traces (an int32) and torch takes
    jax.eval_shape(lambda seed: jax.random.key(seed), top)
    torch.manual_seed(top)
    with pytest.raises(OverflowError):
        jax.eval_shape(lambda seed: jax.random.key(seed), top + 1)


def test_search_sizes_have_an_upper_bound_in_the_library_and_the_server_stays_within_it():
    """run.translate(beam=10**6) asked XLA for 45 GB (RESOURCE_EXHAUSTED): only the server bounded the beam."""
    for make, message in ((lambda: Search(beam=10**6), "beam must be <= 1024, got 1000000"),
                          (lambda: Search(beam=MAX_BEAM, n_best=MAX_BEAM + 1), "n_best must be <= 1024"),
                          (lambda: Sampling(num_samples=10**6), "num_samples must be <= 1024"),
                          (lambda: TranslateFiles(batch_size=10**9), "batch_size must be <= 65536"),
                          (lambda: ExperimentConfig(max_len=10**6), "max_len must be <= 65536"),
                          (lambda: ExperimentConfig(beam=10**6), "beam must be <= 1024"),
                          (lambda: TransformerConfig(max_len=10**6), "max_len must be <= 65536"),
                          (lambda: Limits(max_beam=MAX_BEAM + 1), "max_beam must be <= 1024"),
                          (lambda: Limits(max_batch_sentences=BATCH.high + 1), "max_batch_sentences must be <= 65536")):
        with pytest.raises(SettingError) as info:
            make()
        assert _one_line(info.value).startswith(message)
    assert Search(beam=MAX_BEAM, n_best=MAX_BEAM).n_best == MAX_BEAM


def test_a_refused_number_is_printed_as_given():
    """top_p = 1.0000001 was refused with 'must be in (0, 1], got 1'."""
    for make, message in ((lambda: Sampling(top_p=1.0000001), "top_p must be in (0, 1], got 1.0000001"),
                          (lambda: Sampling(top_p=np.float64(1.0000001)), "top_p must be in (0, 1], got 1.0000001"),
                          (lambda: Sampling(top_p=2), "top_p must be in (0, 1], got 2"),
                          (lambda: ExperimentConfig(label_smoothing=1.0000000001),
                           "label_smoothing must be in [0, 1), got 1.0000000001")):
        with pytest.raises(OptionError if "top_p" in message else SettingError) as info:
            make()
        assert _one_line(info.value) == message


def test_numbers_of_any_integral_or_real_type_are_taken_and_kept_as_python_numbers():
    """np.int64 beam, steps and seed and np.float32 alpha were refused while np.float64 was taken."""
    search = Search(beam=np.int64(3), alpha=np.float32(0.5), n_best=np.int32(2))
    assert (search.beam, search.alpha, search.n_best) == (3, 0.5, 2)
    assert type(search.beam) is int and type(search.alpha) is float and type(search.n_best) is int
    cfg = ExperimentConfig(steps=np.int64(9), seed=np.uint32(3), lr_factor=np.float32(2.0))
    assert (cfg.steps, cfg.seed, cfg.lr_factor) == (9, 3, 2.0) and type(cfg.seed) is int
    assert cfg == ExperimentConfig(steps=9, seed=3, lr_factor=2.0)  # so config.json and a resume compare equal


def test_booleans_are_taken_only_as_booleans_by_the_api_and_the_server_alike():
    """sample=1 and sample="yes" counted as True in the API where the server refused them."""
    from train.options import sampling_of

    for value in (1, "yes", np.bool_(True)):
        with pytest.raises(OptionError) as api:
            sampling_of(value, {})
        with pytest.raises(BadRequest) as server:
            parse_request(f'{{"texts": ["x"], "sample": {value!r}}}'.replace("'", '"').encode()
                          if not isinstance(value, np.bool_) else b'{"texts": ["x"], "sample": 1}', Limits())
        assert _one_line(api.value).startswith("sample must be true or false, got ")
        assert _one_line(server.value).startswith("sample must be true or false, got ")
    assert sampling_of(True, {"top_k": 3}) == Sampling(top_k=3) and sampling_of(False, {}) is None


def test_the_python_api_refuses_wrong_types_in_one_line_naming_the_parameter(tiny_torch_run):
    """translate(None), translate([...], foo=1), evaluate(42), fit(recipe=5), fit(steps=None) were TypeErrors from
    inside (the last without the parameter's name); beam=10**6 ran out of memory."""
    with train.load(tiny_torch_run) as run:
        for call, message in ((lambda: run.translate(None), "texts must be a string or a list of strings, got None"),
                              (lambda: run.translate(TEXTS, foo=1), "translate() takes no parameter foo"),
                              (lambda: run.translate(TEXTS, beam=10**6), "beam must be <= 1024, got 1000000"),
                              (lambda: run.translate(TEXTS, batch_size=0), "batch_size must be >= 1, got 0"),
                              (lambda: run.translate(TEXTS, sample=1), "sample must be true or false, got 1"),
                              (lambda: run.evaluate(42), "pairs: give a data spec or a list of (source, target) "
                                                         "pairs, got 42"),
                              (lambda: run.evaluate(list(zip(TEXTS, TEXTS)), foo=1), "evaluate() takes no parameter foo")):
            with pytest.raises(UserError) as info:
                call()
            assert _one_line(info.value) == message
        beam = run.translate(TEXTS, beam=np.int64(2), alpha=np.float32(0.5), batch_size=np.int64(1))
        assert beam == run.translate(TEXTS, beam=2, alpha=0.5)
    for kwargs, message in ((dict(recipe=5), "recipe must be a path, got 5"),
                            (dict(steps=None), "steps must be an integer, got None"),
                            (dict(run_dir=None, overwrite=True), "overwrite needs run_dir")):
        with pytest.raises(UserError) as info:
            train.fit(**kwargs)
        assert _one_line(info.value) == message


def test_a_command_words_the_same_rules_with_its_flags(tiny_torch_run, capsys):
    code, _, err = run_cli(translate.main, capsys, "--run-dir", str(tiny_torch_run), "--beam", "2000")
    assert code == 1 and err.strip().splitlines() == ["error: --beam must be <= 1024, got 2000"]
    code, err = _exit_status(translate.main, ["--run-dir", str(tiny_torch_run), "--top-p", "1.0000001", "--sample"],
                             capsys)
    assert code == 1 and "--top-p must be in (0, 1], got 1.0000001" in err and len(err.strip().splitlines()) == 1


def _saved_run(tmp_path):
    """A run directory as train.run leaves it for these refusals: its config.json (torch: no JAX start)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps(ExperimentConfig(backend="torch").experiment()))
    return run_dir


@pytest.mark.parametrize("case", ["holds_a_run", "changes_a_resumed_run", "is_a_file", "lies_inside_a_run"])
def test_the_library_names_the_parameter_from_python_and_the_flag_from_the_command_line(case, tmp_path, capsys):
    """About 30 library messages named flags (`pass --resume ... or --overwrite`) from `train.fit` too: each is an
    OptionError now, its parameters rendered by the interface that reports it (`options.run`, `recipes.flagged`)."""
    run_dir = _saved_run(tmp_path)
    (tmp_path / "file").write_text("")
    kwargs, python, argv, flagged = {
        "holds_a_run": (dict(run_dir=run_dir), f"{run_dir} already holds a run; pass resume to continue it or "
                        "overwrite to replace it", [], f"{run_dir} already holds a run; pass --resume to continue it "
                        "or --overwrite to replace it"),
        "changes_a_resumed_run": (dict(run_dir=run_dir, resume=True, seed=1), "resume cannot change how the run "
                                  "trains: seed: run has 0, got 1", ["--resume", "--seed", "1"], "--resume cannot "
                                  "change how the run trains: --seed: run has 0, got 1"),
        "is_a_file": (dict(run_dir=tmp_path / "file"), f"run_dir {tmp_path / 'file'} is a file", [],
                      f"--run-dir {tmp_path / 'file'} is a file"),
        "lies_inside_a_run": (dict(run_dir=run_dir / "inner"), f"run_dir {run_dir / 'inner'} lies inside the run "
                              f"{run_dir}: a command never writes", [], f"--run-dir {run_dir / 'inner'} lies inside "
                              f"the run {run_dir}: a command never writes"),
    }[case]
    with pytest.raises(OptionError) as info:
        train.fit(backend="torch", **{k: str(v) if k == "run_dir" else v for k, v in kwargs.items()})
    assert _one_line(info.value).startswith(python)
    code, err = _exit_status(run_command.main, ["--backend", "torch", "--run-dir", str(kwargs["run_dir"]), *argv],
                             capsys)
    assert code == 1 and _one_line(err).startswith(f"error: {flagged}")


def test_a_template_keeps_the_braces_of_its_values():
    """A path with braces is a value, never a parameter's place: `{key}`s are filled as given."""
    err = OptionError("{} {dir} is a file", "run_dir", dir="runs/{x}")
    assert str(err) == "run_dir runs/{x} is a file"
    assert err.worded(lambda name: "--" + name.replace("_", "-")) == "--run-dir runs/{x} is a file"
