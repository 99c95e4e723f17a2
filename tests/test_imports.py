"""Importing one framework's package must never import the other (STYLE.md, principle 3).

Each check runs in a fresh interpreter: in this pytest process torch and jax are long imported.
The child prints the top-level names in `sys.modules` as JSON; the assertions are made here, so a
failure lists the offending modules.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
JAX_MODULES = {"jax", "jaxlib", "flax", "optax", "orbax"}


def loaded_after(code: str) -> set[str]:
    """Top-level module names in sys.modules after running `code` in a new interpreter."""
    script = textwrap.dedent(code) + textwrap.dedent(
        """
        import json as _json, sys as _sys
        print(_json.dumps(sorted({name.split(".")[0] for name in _sys.modules})))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return set(json.loads(result.stdout.strip().splitlines()[-1]))


def test_config_imports_neither_framework():
    loaded = loaded_after(
        """
        import torch_reference
        from torch_reference import TransformerConfig
        cfg = TransformerConfig.preset("tiny")
        assert cfg.d_model == 64
        """
    )
    assert "torch_reference" in loaded  # the import did happen
    assert not loaded & JAX_MODULES
    # The package loads torch lazily (PEP 562), so the config alone is framework-free.
    assert "torch" not in loaded


def test_torch_model_does_not_import_jax():
    loaded = loaded_after(
        """
        import torch_reference.model
        from torch_reference import Transformer
        """
    )
    assert "torch" in loaded  # the model did load its framework
    assert not loaded & JAX_MODULES


def _jax_package_missing() -> bool:
    # The editable install maps `jax_transformer` to its folder, so find_spec alone is not None
    # even for an empty folder (a namespace package, origin None): treat that as missing too.
    spec = importlib.util.find_spec("jax_transformer")
    return spec is None or spec.origin is None


@pytest.mark.skipif(_jax_package_missing(), reason="jax_transformer is not written yet (no jax_transformer/__init__.py)")
def test_jax_package_does_not_import_torch_and_shares_the_config():
    loaded = loaded_after(
        """
        import sys
        import jax_transformer
        import torch_reference.config
        assert "torch" not in sys.modules, "torch imported before the identity check"
        assert jax_transformer.TransformerConfig is torch_reference.config.TransformerConfig
        """
    )
    assert "jax" in loaded  # the JAX package did load its framework
    assert "torch" not in loaded
