"""Marian directories in and out (issue 42): a damaged file of an HF Marian directory is named by
`aiayn convert --from marian` in one line (a truncated model.safetensors, an invalid config.json
or vocab.json, a SentencePiece model that is not one); `--to marian --overwrite` replaces only a
Marian directory it wrote, never a run and never its source."""

import shutil

import pytest

from parity.commands import convert
from train import runtime

from .marian_fixtures import make_marian_dir

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_marian_dir(tmp_path_factory.mktemp("marian-files") / "hf", seed=0)


@pytest.mark.parametrize("name, damage, says", [
    ("model.safetensors", lambda b: b[: len(b) // 2], "is not a readable safetensors file"),
    ("config.json", lambda b: b"{not json", "is not valid JSON"),
    ("vocab.json", lambda b: b"[1, 2", "is not valid JSON"),
    ("source.spm", lambda b: b"garbage" * 10, "is not a SentencePiece model"),
    ("target.spm", lambda b: b"garbage" * 10, "is not a SentencePiece model"),
])
def test_a_damaged_file_of_a_marian_directory_is_named(hf_dir, tmp_path, capsys, name, damage, says):
    broken = shutil.copytree(hf_dir, tmp_path / "hf")
    (broken / name).write_bytes(damage((broken / name).read_bytes()))
    code = convert.main(["--from", "marian", "--src", str(broken), "--to", "torch", "--dst",
                         str(tmp_path / "run")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith(f"error: {broken / name}"), lines
    assert says in lines[0] and not (tmp_path / "run").exists()


def test_marian_export_overwrites_only_its_own_kind_and_never_the_source(hf_dir, tmp_path, capsys):
    run, other, exported = tmp_path / "run", tmp_path / "other", tmp_path / "exported"
    for dst in (run, other):
        assert convert.main(["--from", "marian", "--src", str(hf_dir), "--to", "torch", "--dst", str(dst)]) == 0
    assert convert.main(["--to", "marian", "--src", str(run), "--dst", str(exported)]) == 0
    assert runtime.kind_of(exported) == "marian"
    capsys.readouterr()
    before = {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file() and p.name != runtime.LOCK_FILE}
    for dst, says in [(other, "holds a run, not a HF Marian directory"), (run, "is the source")]:
        code = convert.main(["--to", "marian", "--src", str(run), "--dst", str(dst), "--overwrite"])
        err = capsys.readouterr().err
        assert code == 1 and says in err and len(err.strip().splitlines()) == 1, err
    assert {p: p.read_bytes() for p in before} == before  # both runs whole
    assert convert.main(["--to", "marian", "--src", str(run), "--dst", str(exported), "--overwrite"]) == 0
