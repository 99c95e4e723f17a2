"""docs/tour.ipynb runs from top to bottom as committed (nbclient, a fresh kernel in a scratch directory), and
shows what its text says: the tiny model's translations, an n-best list, an attention heatmap inline, and the same
translations from the run converted to the other framework."""

import json
import re
from pathlib import Path

import nbformat
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[1]
TOUR = REPO / "docs" / "tour.ipynb"


def _text(cell) -> str:
    return "".join(o.get("text", "") + o.get("data", {}).get("text/plain", "") for o in cell.outputs)


def test_the_tour_is_committed_without_outputs():  # its outputs are this test's: stale figures never in the repo
    notebook = nbformat.read(TOUR, as_version=4)
    nbformat.validate(notebook)
    code = [c for c in notebook.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)


def test_the_tour_runs(tmp_path, monkeypatch):
    notebook = nbformat.read(TOUR, as_version=4)
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the kernel imports this checkout, whatever is installed
    # A cell's time limit for a loaded machine: the training cell, the longest, is about a minute on 2 quiet cores.
    where = {"metadata": {"path": str(tmp_path)}}  # the kernel's working directory: runs/ lands there
    NotebookClient(notebook, timeout=1800, kernel_name="python3", resources=where).execute()
    cells = {c.source.splitlines()[0]: c for c in notebook.cells if c.cell_type == "code"}
    by_start = lambda start: next(c for first, c in cells.items() if first.startswith(start))  # noqa: E731
    translations = " ".join(_text(by_start("run = train.load")).split())  # IPython may wrap a list's repr
    assert "['forty-three', 'seven hundred and twelve', " in translations, translations
    nbest = _text(by_start("nbest =")).splitlines()
    assert len(nbest) == 3 and nbest[0].endswith("seven hundred and twelve"), nbest
    images = [o for o in by_start("from pathlib").outputs if "image/png" in o.get("data", {})]
    assert len(images) == 1 and (tmp_path / "runs" / "tour-attention" / "0001.png").is_file()
    other = _text(by_start("from parity.conversions"))
    assert "same translations: True" in other and "same n-best texts: True" in other, other
    # The twins agree to float32 rounding: docs/parity.md bounds a search's scores at 1e-4.
    assert float(re.search(r"largest score difference: (\S+)", other)[1]) < 1e-4, other
    assert json.loads((tmp_path / "runs" / "tour" / "results.json").read_text())["steps"] == 300
