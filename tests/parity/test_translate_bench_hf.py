"""`aiayn translate-bench --hf`: HF generate timed beside the other searches on an imported Marian
model (random weights at a small lopsided shape, marian_fixtures), its outputs compared."""

from __future__ import annotations

import json
import shutil

import pytest

from parity.commands import translate_bench
from train.interop import marian

from .marian_fixtures import lines, make_marian_dir


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-hf")
    pytest.importorskip("transformers")
    hf_dir = make_marian_dir(root / "hf", seed=0, eos_bias=4.0)  # sentences end, at various lengths
    marian.import_marian(hf_dir, root / "run", to="torch")
    return root / "run"


def test_hf_generate_is_a_row_and_greedy_agrees(imported, tmp_path, capsys):
    source = tmp_path / "in.de"
    source.write_text("".join(line + "\n" for line in lines("val.de.gz", 6)), encoding="utf-8")
    out = tmp_path / "bench.json"
    assert translate_bench.main(["--run-dir", str(imported), "--input", str(source), "--beam", "2", "--hf",
                                 "--no-uncached", "--scoring", "hf", "--alpha", "1.0", "--json", str(out)]) == 0
    rows = {(r["search"], r["beam"]): r for r in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == sorted((name, beam) for name in ("torch cached", "jax cached", "hf generate") for beam in (1, 2))
    # Greedy: HF's generate is this search (tests/parity/test_marian.py); beam 2 with --scoring hf
    # is HF's rules, but a batch limit where ours limits each sentence: reported, not required.
    assert rows["hf generate", 1]["differ"] == 0 and rows["jax cached", 1]["differ"] == 0
    for r in rows.values():
        assert r["sentences"] == 6 and r["tokens"] >= 6 and r["peak_mib"] >= 0
        assert r["speedup_vs_torch_uncached"] is None  # --no-uncached
    assert "hf generate" in capsys.readouterr().out


def test_hf_needs_a_marian_import(imported, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(imported, run)
    (run / "imported.json").unlink()  # a run like any other
    source = tmp_path / "in.de"
    source.write_text("eins\n")
    code = translate_bench.main(["--run-dir", str(run), "--input", str(source), "--hf"])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("error: --hf: ") and "not imported from a Marian model" in err
