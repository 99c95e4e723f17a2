"""A run loads one framework: the loop, the CLIs' imports and each backend stay apart (the twins' one-way house).

Each check runs in a fresh interpreter (torch and jax are long imported in the pytest process);
the child prints the loaded top-level modules and the assertions are made here.
"""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
JAX = {"jax", "jaxlib", "flax", "optax", "orbax"}


def loaded_after(code: str) -> set[str]:
    report = "\nimport json, sys\nprint(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n"
    script = textwrap.dedent(code) + report
    result = subprocess.run([sys.executable, "-c", script], check=False, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return set(json.loads(result.stdout.strip().splitlines()[-1]))


def test_loop_and_clis_import_no_framework():
    loaded = loaded_after(
        """
        import tempfile, pathlib
        import train.loop, train.commands.run, train.commands.evaluate, train.commands.translate, train.backends
        writer = train.loop.summary_writer(pathlib.Path(tempfile.mkdtemp()))
        writer.add_scalar("x", 1.0, 1)
        writer.close()
        """
    )
    assert {"tensorboardX", "tokenizers"} <= loaded  # sacrebleu loads where scores are computed, not at import
    assert "torch" not in loaded and not loaded & JAX


def test_each_backend_loads_only_its_framework():
    torch_side = loaded_after("import train.backends.torch_backend")
    assert "torch" in torch_side and not torch_side & JAX
    jax_side = loaded_after("import train.backends.jax_backend")
    assert {"jax", "flax", "optax", "orbax"} <= jax_side and "torch" not in jax_side


def test_text_pairs_load_without_hf_datasets(tmp_path):
    """Text pairs and TSV are read directly: HF `datasets` (about 1 s to import, and a dependency a
    bare GPU image may lack) is imported for JSON and hub specs only."""
    for lang, text in (("de", "ein Hund\n"), ("en", "a dog\n")):
        (tmp_path / f"p.{lang}").write_text(text)
    (tmp_path / "p.tsv").write_text("source\ttarget\nein Hund\ta dog\n")
    (tmp_path / "p.jsonl").write_text('{"source": "ein Hund", "target": "a dog"}\n')
    loaded = loaded_after(
        f"""
        from train.data.corpora import load_parallel
        assert load_parallel("de:en:{tmp_path}/p").pairs == [("ein Hund", "a dog")]
        assert load_parallel("{tmp_path}/p.tsv").pairs == [("ein Hund", "a dog")]
        """
    )
    assert "datasets" not in loaded
    assert "datasets" in loaded_after(
        f"""
        from train.data.corpora import load_parallel
        assert load_parallel("{tmp_path}/p.jsonl").pairs == [("ein Hund", "a dog")]
        """
    )
