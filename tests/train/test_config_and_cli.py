"""ExperimentConfig (validation, automatic fields, JSON) and the train.run command line."""

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from train.commands import run
from train.config import ExperimentConfig, parse_model_override
from train.runtime.files import json_text

REPO = Path(__file__).resolve().parents[2]


def _round_trip(cfg: ExperimentConfig) -> ExperimentConfig:
    """`cfg` through JSON text, as a run directory's config.json keeps it."""
    return ExperimentConfig.from_dict(json.loads(json_text(cfg.to_dict())))


def test_json_round_trip_and_resolve():
    cfg = ExperimentConfig(backend="torch", steps=300, model={"d_model": 32, "norm_position": "pre"}, clip_norm=1.0)
    assert _round_trip(cfg) == cfg
    resolved = cfg.resolve()
    # Automatic fields: vocabulary per corpus, warmup a quarter of the steps, save at each eval.
    assert (resolved.vocab_size, resolved.warmup, resolved.save_every) == (400, 75, cfg.eval_every)
    assert resolved.run_dir is None and resolved.dtype is None  # chosen where the run is claimed (runtime.session)
    assert [cfg.resolve(platform).dtype for platform in ("cpu", "gpu")] == ["float32", "bfloat16"]
    assert cfg.replace(dtype="float32").resolve("gpu").dtype == "float32"
    assert ExperimentConfig(steps=100_000).resolve().warmup == 4000  # the paper's, as a cap
    assert ExperimentConfig(train="a.tsv", valid="b.tsv").resolve().vocab_size == 8000
    # The numbers corpus's run ends with the mean of its last two checkpoints; other data with its last.
    assert (resolved.average_last, ExperimentConfig(train="a.tsv", valid="b.tsv").resolve().average_last) == (2, 1)
    assert ExperimentConfig(keep_checkpoints=1).resolve().average_last == 1  # no more than the run keeps
    assert _round_trip(resolved) == resolved
    with pytest.raises(ValueError, match="unknown ExperimentConfig fields: 'nope'"):
        ExperimentConfig.from_dict({"nope": 1})


def test_resolve_resumes_the_saved_experiment_and_adopts_a_source():
    saved = ExperimentConfig(backend="torch", seed=3, steps=10, dtype=None).resolve()
    launch = ExperimentConfig(run_dir="R", resume=True, steps=20)
    resumed = launch.resolve("gpu", given={"run_dir", "resume", "steps"}, saved=saved)
    # The run's own experiment (a resume keeps its dtype, even unset) with this launch's options.
    assert (resumed.backend, resumed.seed, resumed.dtype, resumed.steps, resumed.resume) == ("torch", 3, None, 20, True)
    with pytest.raises(ValueError, match="^resume cannot change how the run trains: seed: run has 3, got 4$"):
        launch.replace(seed=4).resolve(given={"seed"}, saved=saved)
    with pytest.raises(ValueError, match="backend: run has 'torch', got 'jax'"):
        launch.resolve(saved=saved)  # None given: every field set counts, the default backend too
    source = ExperimentConfig(preset="small", vocab_size=500, max_len=64)
    tuned = ExperimentConfig(init_from="SRC", steps=5, lr_factor=0.5).resolve(source=source)
    assert (tuned.preset, tuned.vocab_size, tuned.max_len, tuned.lr_factor) == ("small", 500, 64, 0.5)
    with pytest.raises(ValueError, match="^init_from takes the model's shape and vocabulary from its source: "
                                         "max_len: SRC has 64, got 32$"):
        ExperimentConfig(init_from="SRC", max_len=32).resolve(source=source)


def test_model_config_from_experiment():
    cfg = ExperimentConfig(preset="tiny", model={"d_model": 24, "num_heads": 3}, dropout=0.0, max_len=40)
    model = cfg.model_config(300, 300)
    assert (model.d_model, model.num_heads, model.d_ff, model.dropout, model.max_len) == (24, 3, 128, 0.0, 40)
    assert model.share_embeddings and model.src_vocab_size == 300
    separate = cfg.replace(joint_vocab=False).model_config(300, 320)
    assert not separate.share_embeddings and (separate.src_vocab_size, separate.tgt_vocab_size) == (300, 320)
    assert ExperimentConfig().model_config(400, 400).dropout == 0.1  # the preset's


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(backend="mxnet"), "backend must be one of jax, torch, got 'mxnet'"),
        (dict(preset="huge"), "preset must be one of tiny, small, base, big, got 'huge'"),
        (dict(steps=0), "steps must be >= 1"),
        (dict(model={"max_len": 10}), "model: max_len cannot be set"),
        (dict(model={"d_model": 30, "num_heads": 4}), "not divisible"),
        (dict(model={"width": 3}), "unknown model field"),
        (dict(valid="x.tsv"), "valid/test need train"),
        (dict(train="x.tsv"), "train needs valid"),
        (dict(resume=True), "resume needs run_dir"),
        (dict(resume=True, overwrite=True, run_dir="r"), "exclude each other"),
        (dict(token_budget=64, max_len=128), "must hold one sequence"),
        (dict(vocab_size=100), "vocab_size must be >= 260"),
        (dict(dropout=1.0), "dropout must be in"),
    ],
)
def test_invalid_values(changes, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ExperimentConfig(**changes)


def test_path_fields_take_a_path_as_train_load_does(tmp_path):
    """train.fit(run_dir=tmp_path / "run") was refused: 'run_dir must be str, got PosixPath(...)'."""
    cfg = ExperimentConfig(run_dir=tmp_path / "run", train=tmp_path / "t.tsv", valid=str(tmp_path / "v.tsv"))
    assert (cfg.run_dir, cfg.train, cfg.valid) == tuple(str(tmp_path / name) for name in ("run", "t.tsv", "v.tsv"))
    assert _round_trip(cfg) == cfg


def test_parse_model_override():
    assert parse_model_override("d_model=128") == ("d_model", 128)
    assert parse_model_override("attention_bias=false") == ("attention_bias", False)
    assert parse_model_override("layer_norm_eps=1e-5") == ("layer_norm_eps", 1e-5)
    bad_values = [("d_model", "FIELD=VALUE"), ("d_model=big", "d_model takes an integer, got 'big'"),
                  ("layer_norm_eps=tiny", "layer_norm_eps takes a number"), ("tie_output=maybe", "true or false")]
    for bad, message in bad_values:
        with pytest.raises(ValueError, match=message):
            parse_model_override(bad)
    with pytest.raises(ValueError, match="FIELD=VALUE"):
        parse_model_override("src_vocab_size=10")  # derived from the tokenizer


@pytest.mark.parametrize("field", ["pad_id", "bos_id", "eos_id"])
def test_special_token_ids_cannot_be_overridden(field):
    """Batches pad with 0 and start with 1 whatever the model is told: an override would train a
    model that masks and ignores another id than the data uses. Refused, naming the fixed ids."""
    with pytest.raises(ValueError, match=f"{field} cannot be set: the special token ids are fixed: <pad>=0, <bos>=1"):
        parse_model_override(f"{field}=5")
    with pytest.raises(ValueError, match=f"model: {field} cannot be set: the special token ids are fixed"):
        ExperimentConfig(model={field: 5})


def test_help_documents_every_field():
    text = run.build_parser().format_help()
    for field in dataclasses.fields(ExperimentConfig):
        flag = field.metadata.get("flag", "--" + field.name.replace("_", "-"))
        assert flag in text, flag
        assert field.metadata["help"].split(";")[0][:30] in " ".join(text.split()), field.name
    assert "SRC:TGT:PREFIX" in text and "hf:NAME" in text  # the data spec formats


def test_parse_config_keeps_only_given_flags():
    cfg, given = run.parse_config(["--backend=torch", "--steps", "7", "--set", "d_model=32", "--no-joint-vocab"])
    assert given == {"backend", "steps", "model", "joint_vocab"}
    assert (cfg.backend, cfg.steps, cfg.model, cfg.joint_vocab) == ("torch", 7, {"d_model": 32}, False)
    assert cfg.preset == ExperimentConfig().preset


def _cli(*args, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "train.run", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def test_cli_help_and_clean_errors(tmp_path):
    result = _cli("--help")
    assert result.returncode == 0 and "--token-budget" in result.stdout and "--backend {jax,torch}" in result.stdout
    for args, message in [
        (["--steps", "-3"], "steps must be >= 1"),
        (["--backend", "tf"], "invalid choice: 'tf'"),
        (["--set", "d_model=wide"], "d_model takes an integer"),
        (["--set", "pad_id=5"], "pad_id cannot be set: the special token ids are fixed: <pad>=0, <bos>=1, <eos>=2"),
        (["--train", "de:en:/nonexistent/x", "--valid", "de:en:/nonexistent/y", "--run-dir", str(tmp_path / "r")],
         "no such file"),
    ]:
        result = _cli(*args)
        assert result.returncode in (1, 2), args
        assert message in result.stderr and "Traceback" not in result.stderr, result.stderr
    # A run that failed on its data leaves no run behind: the same --run-dir works next time.
    assert not (tmp_path / "r").exists() or not any((tmp_path / "r").iterdir())


def test_resume_without_backend_takes_the_process_settings_of_the_runs_own(run_copy, monkeypatch, capsys):
    """A torch run resumed without --backend: --backend's default (jax) re-executed the process for JAX's allocator
    (huge pages), so everything before it ran and printed twice."""
    from train.backends import allocator

    asked = []
    monkeypatch.setattr(allocator, "use_huge_pages", lambda: asked.append(True))
    argv = ["--run-dir", str(run_copy), "--resume", "--steps", "2", "--no-progress"]
    assert run.main(argv, process_settings=True) == 0
    assert asked == [] and "nothing to do" in capsys.readouterr().out


def test_ctrl_c_ends_every_command_in_one_line(monkeypatch, capsys):
    """Ctrl-C where a command does not handle it (evaluating, averaging): one line and status 130, as translate
    and train.run end, not a traceback; by `python -m` (runpy, as Python runs it) and by `aiayn`."""
    import runpy

    import train.commands
    from train import api, averaging

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(api, "load", ctrl_c)
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # evaluate adds a device count before jax loads
    monkeypatch.setattr(averaging, "average_run", ctrl_c)
    monkeypatch.setattr(sys, "argv", ["aiayn average", "--run-dir", "r", "--dst", "d"])
    for command in (lambda: runpy.run_module("train.commands.average", run_name="__main__"),
                    lambda: train.commands.main(["evaluate", "--run-dir", "r", "--data", "numbers:test"])):
        try:  # a KeyboardInterrupt out of here would be Python's traceback
            code = command()
        except SystemExit as exited:
            code = exited.code
        assert (code, capsys.readouterr().err) == (130, "interrupted (SIGINT)\n")
    for module, *_ in train.commands.COMMANDS.values():  # every command goes through the one protocol (runtime.exit_status)
        source = importlib.util.find_spec(module).loader.get_source(module)
        assert "exit_status(" in source or "run(build_parser(), argv" in source, module
