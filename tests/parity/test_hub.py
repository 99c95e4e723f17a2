"""Marian models by hub name (`--src hf:ORG/NAME[@REVISION]`) without a network: the tests build a
Hugging Face cache as huggingface_hub lays it out (models--ORG--NAME/refs/main naming a commit,
snapshots/COMMIT/ holding the files) and read it with HF_HUB_OFFLINE set."""

import json
import shutil

import pytest

from parity.commands import convert

from .marian_fixtures import make_marian_dir

pytest.importorskip("transformers")
hub = pytest.importorskip("huggingface_hub")
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_model(cache, repo: str, files_from, commit: str = COMMIT) -> None:
    folder = cache / f"models--{repo.replace('/', '--')}"
    shutil.copytree(files_from, folder / "snapshots" / commit)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", True)
    return cache


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_marian_dir(tmp_path_factory.mktemp("hub-marian") / "hf", seed=0)


def test_a_hub_name_imports_from_the_cache_and_records_its_revision(hf_dir, offline_cache, tmp_path, capsys):
    cache_model(offline_cache, "org/tiny-marian", hf_dir)
    for i, name in enumerate(("hf:org/tiny-marian", f"hf:org/tiny-marian@{COMMIT}")):
        dst = tmp_path / f"run{i}"
        assert convert.main(["--from", "marian", "--src", name, "--to", "torch", "--dst", str(dst)]) == 0
        assert f"at revision {COMMIT}" in capsys.readouterr().out
        record = json.loads((dst / "imported.json").read_text())
        assert (record["from"], record["revision"]) == (name, COMMIT)
    local = tmp_path / "local"
    convert.main(["--from", "marian", "--src", str(hf_dir), "--to", "torch", "--dst", str(local)])
    assert "revision" not in json.loads((local / "imported.json").read_text())
    for name in ("model.json", "config.json"):  # the same model, whichever way it came
        assert (local / name).read_text() == (tmp_path / "run0" / name).read_text()


@pytest.mark.parametrize("name, says", [
    ("hf:org/absent", "hf:org/absent is not in the Hugging Face cache"),
    ("hf:org/tiny-marian@v9", "hf:org/tiny-marian@v9 is not in the Hugging Face cache"),
    ("hf:not a name!", "hf:not a name!: Repo id must"),
    ("hf:org/bert", "model_type='bert' (only model_type 'marian' is read)"),
])
def test_every_hub_failure_is_one_line(hf_dir, offline_cache, tmp_path, capsys, name, says):
    cache_model(offline_cache, "org/tiny-marian", hf_dir)
    bert = tmp_path / "bert"
    shutil.copytree(hf_dir, bert)
    (bert / "config.json").write_text(json.dumps({**json.loads((hf_dir / "config.json").read_text()),
                                                   "model_type": "bert"}))
    cache_model(offline_cache, "org/bert", bert)
    code = convert.main(["--from", "marian", "--src", name, "--to", "torch", "--dst", str(tmp_path / "run")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and says in lines[0], lines
    assert not (tmp_path / "run").exists()
