"""JAX's persistent compilation cache, on by default (docs/operations.md#the-compile-cache); jax loads in `enable`."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

ENV = "AIAYN_JAX_CACHE"
OFF = ("", "off", "0", "no", "false", "none")
MAX_BYTES = 4 << 30
# Faster compiles are not kept: a search or step takes seconds; helper programs are not worth a file each.
MIN_COMPILE_SECONDS = 0.2
HELP = (f"JAX keeps compiled programs across processes in ~/.cache/aiayn/jax ($XDG_CACHE_HOME/aiayn/jax): "
        f"{ENV}=DIR moves it, {ENV}=off turns it off")


def cache_dir() -> Path | None:
    """Where compiled programs are kept, or None when the cache is off (see the module docstring)."""
    value = os.environ.get(ENV)
    if value is not None:
        return None if value.strip().lower() in OFF else Path(value).expanduser()
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return Path(os.environ["JAX_COMPILATION_CACHE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "aiayn" / "jax"


def enable() -> Path | None:
    """Point JAX's persistent cache at `cache_dir()`; the directory, or None (off, or unusable: a warning)."""
    import jax

    path = cache_dir()
    if path is None:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()  # JAX would warn at every program of a directory it cannot write
    except OSError as err:
        print(f"warning: no compilation cache: cannot write to {path}: {err.strerror or err}", file=sys.stderr)
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return path
