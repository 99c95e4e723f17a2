"""A run directory's own files, as written and as edited by hand: JSON without NaN or Infinity; a
run directory and data path that are not UTF-8; hand-edited config.json and model.json named in one
line with the field (a model size edited to something huge refused before anything is allocated);
a deleted tokenizer named; the experiment configs saved in checkpoints read without a framework.
The CLIs run in this process (`main`, what `python -m` calls) on copies of a tiny torch run."""

import io
import json
import math
import os
import shutil
import sys
from pathlib import Path

import pytest

import train
from train import checkpoints, data, loop, runtime
from train.commands import evaluate, translate
from train.commands import run as train_run
from train.config import ExperimentConfig

from .helpers import TINY_FIELDS as TINY
from .helpers import _exit_status, exit_code, one_error_line


def test_json_never_holds_nan_or_infinity(tmp_path):
    obj = {"loss": math.nan, "ppl": math.inf, "bands": [{"x": -math.inf}], "ok": 1.5}
    text = runtime.json_text(obj)
    assert json.loads(text) == {"loss": None, "ppl": None, "bands": [{"x": None}], "ok": 1.5}
    assert "NaN" not in text and "Infinity" not in text
    runtime.write_json_atomic(tmp_path / "r.json", obj)
    json.loads((tmp_path / "r.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} in JSON"))


def test_a_path_with_a_non_utf8_byte_works(tmp_path):
    """A run directory and data path holding byte 0xFF (not UTF-8): trained, written as JSON
    (escaped), read back, translated."""
    base = os.fsdecode(bytes(tmp_path) + b"/d\xffta")
    os.makedirs(base)
    pairs = [data.number_words(n) for n in range(100, 160)]
    Path(base, "p.de").write_text("".join(de + "\n" for de, _ in pairs), encoding="utf-8")
    Path(base, "p.en").write_text("".join(en + "\n" for _, en in pairs), encoding="utf-8")
    run_dir = os.path.join(base, "run")
    fields = {k: v for k, v in TINY.items() if not k.startswith("numbers_")}
    cfg = ExperimentConfig(backend="torch", run_dir=run_dir, steps=2, train=f"de:en:{base}/p", valid=f"de:en:{base}/p",
                           **fields)
    loop.train(cfg)
    assert runtime.read_experiment(run_dir).train == f"de:en:{base}/p"
    assert json.loads(Path(run_dir, "results.json").read_text())["run_dir"] == run_dir
    assert not [p for p in Path(run_dir).iterdir() if p.name.endswith(".tmp")]
    loop.train(cfg.replace(overwrite=True))  # and replaced again


@pytest.mark.parametrize("file, edit, fragments", [
    ("config.json", lambda text: text[:-5], ["config.json is not valid JSON", "line"]),
    ("config.json", lambda text: text.replace('"seed": 0', '"sead": 0'), ["config.json", "unknown", "sead"]),
    ("config.json", lambda text: text.replace('"seed": 0', '"seed": "zero"'), ["config.json", "seed must be an integer"]),
    ("config.json", lambda text: "[1, 2]", ["config.json holds no JSON object"]),
    ("model.json", lambda text: text.replace('"d_model": 64', '"d_model": "64"'), ["model.json", "d_model must be an integer"]),
    ("model.json", lambda text: text.replace('"d_model": 64', '"d_modell": 64'), ["model.json", "unknown", "d_modell"]),
])
def test_hand_edited_run_files_are_named_with_the_field(torch_run, tmp_path, capsys, monkeypatch, file, edit, fragments):
    copy = tmp_path / "copy"
    shutil.copytree(torch_run, copy)
    (copy / file).write_text(edit((copy / file).read_text()))
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"eins\n")))
    code, err = _exit_status(translate.main, ["--run-dir", str(copy)], capsys)
    assert code == 1
    one_error_line(err, str(copy / file), *fragments)
    if file == "config.json":  # what --resume reads (it rebuilds model.json from it)
        with pytest.raises(runtime.UserError) as info:
            loop.train(ExperimentConfig(backend="torch", run_dir=str(copy), resume=True, steps=3, progress=False))
        assert str(copy / file) in str(info.value) and "\n" not in str(info.value)


def test_a_deleted_tokenizer_is_named(torch_run, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(torch_run, copy)
    (copy / "tokenizer.json").unlink()
    with pytest.raises(runtime.UserError, match=r"no such file: .*copy/tokenizer\.json$"):
        train.load(copy)


def edit_json(path: Path, change) -> None:
    record = json.loads(path.read_text())
    change(record)
    path.write_text(json.dumps(record))


def test_an_edited_model_size_is_named_before_anything_is_allocated(run_copy, tmp_path, monkeypatch, capfd):
    monkeypatch.setattr(train.api, "create_backend", lambda *a, **k: pytest.fail("a model was built"))
    monkeypatch.setattr(loop, "create_backend", lambda *a, **k: pytest.fail("a model was built"))
    (tmp_path / "in.txt").write_text("siebenundzwanzig\n")
    huge = 2**20
    edit_json(run_copy / "model.json", lambda m: m.update(d_model=huge, d_ff=huge))
    for main, argv in [(translate.main, ["--run-dir", run_copy, "--input", tmp_path / "in.txt"]),
                       (evaluate.main, ["--run-dir", run_copy, "--data", "numbers:valid"])]:
        assert exit_code(main, argv) == 1
        one_error_line(capfd.readouterr().err, f"{run_copy / 'model.json'} says d_model={huge}, d_ff={huge} but "
                       f"{run_copy / 'config.json'} with the tokenizer gives d_model=64, d_ff=128")
    edit_json(run_copy / "config.json", lambda c: c["model"].update(d_model=huge, d_ff=huge))  # both edited alike
    assert exit_code(evaluate.main, ["--run-dir", run_copy, "--data", "numbers:valid"]) == 1
    one_error_line(capfd.readouterr().err, f"d_ff={huge} but the experiment saved in checkpoint 2 gives d_model=64")
    config = (run_copy / "config.json").read_text()
    assert exit_code(train_run.main, ["--run-dir", run_copy, "--resume", "--steps", "4", "--no-progress"]) == 1
    one_error_line(capfd.readouterr().err, f"{run_copy / 'config.json'} says d_model={huge}")
    assert (run_copy / "config.json").read_text() == config  # refused before the run directory is rewritten


def test_experiment_configs_of_saved_checkpoints_are_read_without_a_framework(tiny_torch_run):
    saved = checkpoints.saved_experiments(tiny_torch_run / "checkpoints")
    assert list(saved) == [2] and ExperimentConfig.from_dict(saved[2]).backend == "torch"
