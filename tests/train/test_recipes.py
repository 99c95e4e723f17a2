"""recipes/*.toml and `python -m train.run --config FILE`: keys, overrides, errors, the run's record."""

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from train import recipes
from train.commands import run
from train.config import ExperimentConfig

REPO = Path(__file__).resolve().parents[2]
M30K = "../shared/data/multi30k/"

# Each recipe's measured settings (README.md): backend, preset, data direction, steps, warmup,
# checkpoints kept, --set overrides, token budget.
RECIPES = {
    "numbers.toml": ("jax", "tiny", None, 700, None, 2, {}, 4096),
    "multi30k-de-en.toml": ("jax", "small", "de:en:", 4000, 400, 6, {}, 4096),
    "multi30k-en-de.toml": ("jax", "small", "en:de:", 3500, 400, 4, {}, 4096),
    "multi30k-en-de-base-pre.toml": ("jax", "base", "en:de:", 1300, 400, 10, {"norm_position": "pre"}, 2048),
    "multi30k-de-en-h200.toml": ("torch", "small", "de:en:", 4000, 400, 6, {}, 4096),
    "multi30k-en-de-anchor.toml": ("jax", "small", "en:de:", 8000, 2000, 10, {
        "d_model": 128, "d_ff": 256, "num_heads": 4, "num_encoder_layers": 4, "num_decoder_layers": 4}, 4096),
    "multi30k-en-de-anchor-pre.toml": ("jax", "small", "en:de:", 8000, 2000, 10, {
        "d_model": 128, "d_ff": 256, "num_heads": 4, "num_encoder_layers": 4, "num_decoder_layers": 4,
        "norm_position": "pre"}, 4096),
    "wmt14-en-de-base.toml": ("jax", "base", None, 100_000, 4000, 5, {}, 25000),
    "multi30k-de-en-anchor-pre.toml": ("jax", "small", "de:en:", 8000, 2000, 10, {
        "d_model": 128, "d_ff": 256, "num_heads": 4, "num_encoder_layers": 4, "num_decoder_layers": 4,
        "norm_position": "pre"}, 4096),
}
DROPOUT = {"multi30k-en-de-anchor.toml": 0.3, "multi30k-en-de-anchor-pre.toml": 0.3,
           "multi30k-de-en-anchor-pre.toml": 0.3}  # the anchor's; the others keep 0.1 (base: the preset's)


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # recipes name their data relative to the repository root


def test_every_recipe_parses_to_its_measured_config():
    assert sorted(p.name for p in (REPO / "recipes").glob("*.toml")) == sorted(RECIPES)
    for name, (backend, preset, pair, steps, warmup, keep, model, budget) in RECIPES.items():
        cfg, given = run.parse_config(["--config", f"recipes/{name}"])
        assert (cfg.backend, cfg.preset, cfg.steps, cfg.warmup, cfg.keep_checkpoints, cfg.model, cfg.token_budget) == (
            backend, preset, steps, warmup, keep, model, budget), name
        assert cfg.recipe == f"recipes/{name}" and {"recipe", "backend", "steps"} <= given
        if pair:
            assert (cfg.train, cfg.valid, cfg.test) == (
                f"{pair}{M30K}train", f"{pair}{M30K}val", f"{pair}{M30K}test_2016_flickr"), name
            dropout = DROPOUT.get(name, None if preset == "base" else 0.1)
            assert (cfg.dropout, cfg.resolve().vocab_size, cfg.moses) == (dropout, 8000, pair[3:5]), name


def test_numbers_recipe_is_the_default_run():
    assert run.parse_config(["--config", "recipes/numbers.toml"])[0] == ExperimentConfig(recipe="recipes/numbers.toml")


def test_command_line_overrides_the_file():
    cfg, given = run.parse_config(
        ["--steps", "5", "--config", "recipes/multi30k-en-de-base-pre.toml", "--backend=torch", "--set",
         "d_model=64", "--set", "norm_position=post", "--no-joint-vocab"])
    assert (cfg.steps, cfg.backend, cfg.joint_vocab, cfg.lr_factor) == (5, "torch", False, 0.35)
    assert cfg.model == {"norm_position": "post", "d_model": 64}  # --set adds to the file's list; the last wins
    assert {"steps", "backend", "model", "joint_vocab", "lr_factor"} <= given


def test_a_resume_reads_the_recipe_the_run_was_started_from(tmp_path, capsys):
    recipe = {"path": "recipes/mine.toml", "toml": 'steps = 8000\nsave_every = 100\nwarmup = 2000\nset = ["d_model=128"]\n'}
    (tmp_path / "recipe.json").write_text(json.dumps(recipe))
    cfg, given = run.parse_config(["--run-dir", str(tmp_path), "--resume"])
    assert (cfg.steps, cfg.save_every, cfg.recipe) == (8000, 100, None)  # the launch flags
    assert (cfg.warmup, cfg.model) == (None, {}) and given == {"run_dir", "resume", "steps", "save_every"}  # config.json's
    assert "recipes/mine.toml" in capsys.readouterr().err
    assert run.parse_config(["--run-dir", str(tmp_path), "--resume", "--steps", "9000"])[0].steps == 9000  # the command line wins
    assert run.parse_config(["--run-dir", str(tmp_path)])[0].steps == 700  # not a resume: the default
    (tmp_path / "recipe.json").write_text(json.dumps({**recipe, "toml": "steps = 50\noverwrite = true\n"}))
    cfg = run.parse_config(["--run-dir", str(tmp_path), "--resume"])[0]  # a recipe's overwrite is for the first start
    assert (cfg.steps, cfg.resume, cfg.overwrite) == (50, True, False)
    for record, message in (("{not json", "is not valid JSON"), ("[1]", "expected {"),
                            (json.dumps({**recipe, "toml": "stpes = 3"}), "recipe.json (the recipe recipes/mine.toml): key 'stpes'")):
        (tmp_path / "recipe.json").write_text(record)  # a damaged record: one line naming it, not the defaults
        with pytest.raises(SystemExit) as exit_:
            run.parse_config(["--run-dir", str(tmp_path), "--resume"])
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert exit_.value.code == 2 and message in err and str(tmp_path / "recipe.json") in err, err
    (tmp_path / "recipe.json").unlink()
    assert run.parse_config(["--run-dir", str(tmp_path), "--resume"])[0].steps == 700  # no record: the default


def test_the_resume_command_a_signal_prints_continues_the_launch(tmp_path, capsys):
    """Parsed again, the printed command gives the stopped launch's steps, intervals and devices
    (`--resume` alone trained to the default 700 steps), from a recipe or without one."""
    launch = ["--steps", "60", "--eval-every", "30", "--save-every", "10", "--devices", "2", "--no-progress",
              "--beam", "2"]
    for recorded in (None, 'steps = 8000\neval_every = 30\nbeam = 3\n'):
        if recorded:
            (tmp_path / "recipe.json").write_text(json.dumps({"path": "recipes/mine.toml", "toml": recorded}))
        cfg = run.parse_config(["--run-dir", str(tmp_path), *launch])[0].resolve()
        command = shlex.split(recipes.resume_command(cfg))
        assert command[:5] == ["python", "-m", "train.run", "--run-dir", str(tmp_path)] and "--resume" in command
        again = run.parse_config(command[3:])[0].resolve()
        assert [getattr(again, name) for name in ExperimentConfig.launch_fields() if name != "resume"] == \
            [getattr(cfg, name) for name in ExperimentConfig.launch_fields() if name != "resume"]
    assert "--eval-every" not in command and "--beam" in command  # only what the recipe does not give


@pytest.mark.parametrize("body, message", [
    ("stpes = 3", "key 'stpes': unknown (did you mean 'steps'?)"),
    ("eval-every = 3", "key 'eval-every': unknown (did you mean 'eval_every'?)"),
    ("steps = '3'", "key 'steps' must be an integer, got '3'"),
    ("steps = true", "key 'steps' must be an integer, got True"),
    ("set = 'norm_position=pre'", "key 'set' must be a list of strings, got 'norm_position=pre'"),
    ("joint_vocab = 1", "key 'joint_vocab' must be true or false, got 1"),
    ("steps = 0", "key 'steps' must be >= 1, got 0"),
    ("preset = 'huge'", "key 'preset' must be one of tiny, small, base, big, got 'huge'"),
    ("set = ['d_model=wide']", "key 'set': d_model takes an integer, got 'wide'"),
    ("steps = 3\nwarmup = = 2", "invalid TOML: Invalid value (at line 2, column 10)"),
    # Issue 58: which launch this is never comes from a shared file (a confirmation).
    ("overwrite = true", "key 'overwrite': a launch decision, not a recipe key; give --overwrite on the command line"),
    ("resume = true", "key 'resume': a launch decision, not a recipe key; give --resume on the command line"),
    ("run_dir = 'runs/x'", "key 'run_dir': a launch decision, not a recipe key; give --run-dir on the command line"),
])
def test_a_bad_recipe_is_one_error_line(tmp_path, capsys, body, message):
    path = tmp_path / "x.toml"
    path.write_text(body + "\n")
    with pytest.raises(SystemExit) as exit_:
        run.parse_config(["--config", str(path), "--steps", "2"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.splitlines() == [f"error: {path}: {message}"]


def _refused(capsys, path) -> str:
    """The one error line `--config path` ends with (exit status 2)."""
    with pytest.raises(SystemExit) as exit_:
        run.parse_config(["--config", str(path)])
    lines = capsys.readouterr().err.splitlines()
    assert exit_.value.code == 2 and len(lines) == 1, lines
    return lines[0]


def test_a_recipe_that_is_not_text_is_one_line(tmp_path, capsys):
    """Issue 58: bytes that are not UTF-8 (a traceback before), a FIFO with no writer (which blocked
    forever), a directory or a device: one line naming the file. A UTF-8 byte order mark is accepted."""
    import contextlib
    import os
    import threading

    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"steps = 3\n# caf\xe9\n")
    assert _refused(capsys, binary) == f"error: {binary}: not UTF-8 text: byte 15 (b'\\xe9') invalid continuation byte"
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)

    def unblock():  # the old code waits for a writer: give it one, so that this test fails instead of hanging
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))

    timer = threading.Timer(10, unblock)
    timer.start()
    try:
        message = "not a regular file (a directory, FIFO or device); a recipe is a TOML file"
        assert _refused(capsys, fifo) == f"error: {fifo}: {message}"
    finally:
        timer.cancel()
    assert _refused(capsys, tmp_path) == f"error: {tmp_path}: {message}"
    assert _refused(capsys, "/dev/zero") == f"error: /dev/zero: {message}"
    bom = tmp_path / "bom.toml"
    bom.write_bytes("\ufeffsteps = 3\n".encode())
    assert run.parse_config(["--config", str(bom)])[0].steps == 3
    # The text a run keeps in recipe.json has the mark too: a resume reads it as well.
    assert run.recipes.read_recipe("recipe.json", "\ufeffsteps = 3\n") == {"steps": 3}


def test_a_huge_recipe_value_or_key_is_quoted_short(tmp_path, capsys):
    """Issue 58: a message quotes at most a short escaped prefix of what a recipe holds (a 3 MB value
    was quoted whole); a file bigger than a recipe is refused by its size, unread."""
    huge, path = "x" * 900_000, tmp_path / "huge.toml"  # under a recipe's 1 MiB
    for body, message in ((f"steps = '{huge}'", "key 'steps' must be an integer, got 'xxx"),
                          (f"preset = '{huge}'", "key 'preset' must be one of tiny, small, base, big, got 'xxx"),
                          (f"{huge} = 1", "key 'xxx")):
        path.write_text(body + "\n")
        line = _refused(capsys, path)
        assert line.startswith(f"error: {path}: {message}") and len(line) < 400, line[:500]
    path.write_text(f"train = '{'x' * 3_000_000}'\n")
    assert _refused(capsys, path) == f"error: {path}: 3,000,011 bytes, more than a recipe's 1,048,576"


def test_recipe_trains_and_the_run_records_it(tmp_path):
    run_dir = tmp_path / "run"
    flags = ["--run-dir", str(run_dir), "--numbers-train", "300", "--numbers-valid", "4", "--numbers-test", "0",
             "--max-len", "16", "--token-budget", "512", "--set", "num_encoder_layers=1", "--set",
             "num_decoder_layers=1", "--no-progress", "--samples", "0", "--eval-sentences", "4", "--beam", "1"]
    result = subprocess.run([sys.executable, "-m", "train.run", "--config", "recipes/numbers.toml", "--steps", "2",
                             "--backend", "torch", *flags], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    record = json.loads((run_dir / "recipe.json").read_text())
    assert record == {"path": "recipes/numbers.toml", "toml": (REPO / "recipes/numbers.toml").read_text()}
    saved = json.loads((run_dir / "config.json").read_text())
    assert "recipe" not in saved and (saved["backend"], saved["preset"], saved["numbers_train"]) == ("torch", "tiny", 300)
    # A resume without --config: the run's own config (torch, 300 pairs, not the recipe's jax and
    # 40,000), the recipe's launch flags where none are given (eval_every), the command line's steps.
    result = subprocess.run([sys.executable, "-m", "train.run", "--run-dir", str(run_dir), "--resume", "--steps", "3",
                             "--no-progress"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert json.loads((run_dir / "results.json").read_text())["steps"] == 3


def test_fit_reads_a_recipe_given_as_a_field(tmp_path, monkeypatch):
    """train.fit(recipe=FILE) or fit({"recipe": FILE}) recorded the recipe with the run but trained
    with the defaults: the file's keys were never read, as train.fit(FILE) and --config read them."""
    import train

    monkeypatch.setattr("train.training.start", lambda cfg, explicit: (cfg, explicit))
    (tmp_path / "mine.toml").write_text("steps = 30\npreset = 'small'\n")
    recipe = str(tmp_path / "mine.toml")
    for cfg, explicit in (train.fit(recipe, preset="tiny"), train.fit(recipe=recipe, preset="tiny"),
                          train.fit({"recipe": recipe}, preset="tiny"),
                          train.fit(tmp_path / "mine.toml", preset="tiny")):
        assert (cfg.recipe, cfg.steps, cfg.preset, explicit) == (recipe, 30, "tiny", {"recipe", "steps", "preset"})
    assert train.fit(steps=5)[0] == ExperimentConfig(steps=5)  # no recipe: the defaults


def test_fit_resume_reads_the_recipe_the_run_was_started_from(tmp_path, monkeypatch, capsys):
    """train.fit(run_dir=RUN, resume=True) took steps 700 and the default intervals where
    train.run --resume takes the recipe's (kept in recipe.json): a run of 8000 steps stopped at 700."""
    import train

    monkeypatch.setattr("train.training.start", lambda cfg, explicit: (cfg, explicit))
    recipe = {"path": "recipes/mine.toml", "toml": 'steps = 8000\nsave_every = 100\nwarmup = 2000\n'}
    (tmp_path / "recipe.json").write_text(json.dumps(recipe))
    cfg, explicit = train.fit(run_dir=str(tmp_path), resume=True)
    assert (cfg.steps, cfg.save_every, cfg.warmup) == (8000, 100, None)  # the launch flags, not how it trains
    assert explicit == {"run_dir", "resume", "steps", "save_every"} and "recipes/mine.toml" in capsys.readouterr().err
    assert train.fit(run_dir=str(tmp_path), resume=True, steps=9000)[0].steps == 9000  # given now: it wins
    assert train.fit(run_dir=str(tmp_path))[0].steps == 700  # not a resume: the default
    (tmp_path / "recipe.json").write_text("[1]")
    with pytest.raises(train.runtime.UserError, match=r"recipe.json: expected \{"):
        train.fit(run_dir=str(tmp_path), resume=True)
