"""docs/finetune.md, run as written: its commands in order (each CLI's `main` in this process) and its
Python block, in a scratch directory holding a Hugging Face cache in which a randomly initialised
small Marian model stands under the page's hub name (HF_HUB_OFFLINE: no network), and the page's
TSV files made of Multi30k pairs. Fine-tuning must lower the validation loss."""

import contextlib
import importlib
import io
import json
import re
import shlex
import shutil
from pathlib import Path

import pytest

from train.commands import COMMANDS

from .marian_fixtures import lines, make_marian_dir

PAGE = Path(__file__).resolve().parents[2] / "docs" / "finetune.md"
hub = pytest.importorskip("huggingface_hub")
pytest.importorskip("ctranslate2")


def blocks(kind: str) -> list[str]:
    return re.findall(rf"^```{kind}\n(.*?)^```", PAGE.read_text(encoding="utf-8"), re.M | re.S)


def write_tsv(path: Path, first: int, n: int) -> None:
    pairs = zip(lines("train.de.gz", n, skip=first), lines("train.en.gz", n, skip=first))
    path.write_text("source\ttarget\n" + "".join(f"{de}\t{en}\n" for de, en in pairs))


def module_and_argv(words: list[str]) -> tuple[str, list[str]]:
    """The command module of `aiayn NAME ARGS` or `python -m train.run ARGS`, and its ARGS."""
    if words[:3] == ["python", "-m", "train.run"]:
        return "train.commands.run", words[3:]
    assert words[0] == "aiayn", words
    return COMMANDS[words[1]][0], words[2:]


def test_the_fine_tuning_page_runs_as_written(tmp_path, monkeypatch):
    commands = [module_and_argv(shlex.split(line)) for block in blocks("bash") for line in block.splitlines()
                if line.strip()]
    assert [c[0] for c in commands] == ["parity.commands.convert", "train.commands.evaluate", "train.commands.run",
                                        "train.commands.evaluate", "parity.commands.convert"]
    repo = "Helsinki-NLP/opus-mt-de-en"
    assert f"hf:{repo}" in commands[0][1] and f"hf:{repo}" in commands[2][1]
    snapshot = tmp_path / "hub" / f"models--{repo.replace('/', '--')}"
    make_marian_dir(snapshot / "snapshots" / ("0" * 40), seed=3)
    (snapshot / "refs").mkdir()
    (snapshot / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my-domain").mkdir()
    write_tsv(tmp_path / "my-domain" / "train.tsv", 2000, 200)
    write_tsv(tmp_path / "my-domain" / "valid.tsv", 2300, 12)

    for module, argv in commands:
        with contextlib.redirect_stdout(io.StringIO()):
            assert importlib.import_module(module).main(argv) == 0, (module, argv)
    before, after = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("before", "after"))
    assert after["loss"] < before["loss"] - 0.5, (before["loss"], after["loss"])
    assert json.loads((tmp_path / "ct2-my-domain" / "proof.json").read_text())["bounds"] is None  # int8: reported
    shutil.rmtree(tmp_path / "hub")  # the Python block needs the export alone

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(blocks("python")[0], {})
    (translation,) = eval(out.getvalue())  # one sentence in, one translation out
    assert isinstance(translation, str)
