"""One JAX device per CPU core for searching: `translate`, `evaluate` and `aiayn translate-bench`
ask XLA for them before jax is imported, and decode each batch data parallel over every device.

XLA:CPU runs a beam search's small matmuls on one core; split into one device per core, each core
searches its share of the batch, faster with the same outputs (docs/performance.md#against-ctranslate2).
Training splits the host into its --devices (`aiayn train`); a GPU or TPU machine uses its accelerators.
This module imports no framework.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import MutableMapping

ENV = "AIAYN_HOST_DEVICES"
FLAG = "--xla_force_host_platform_device_count"
# Each XLA CPU device costs memory and start-up time (docs/operations.md#translating): a mistyped
# count fails with one line instead.
MAX_DEVICES = 256
HELP = (f"On a CPU, jax runs decode over one device per core ({ENV}=N sets the count, {ENV}=1 turns this off; "
        f"a count in XLA_FLAGS is kept)")


def cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def check_xla_flags(environ: MutableMapping[str, str] | None = None) -> None:
    """ValueError for a device count in $XLA_FLAGS that is not a whole number from 1: XLA would abort
    the process printing its whole flag list (94 lines) instead. Called before jax reads them."""
    flags = (os.environ if environ is None else environ).get("XLA_FLAGS", "")
    for value in re.findall(rf"{FLAG}(\S*)", flags):
        if not re.fullmatch(r"=0*[1-9]\d*", value):
            value = value.removeprefix("=")[:20]
            raise ValueError(f"$XLA_FLAGS: {FLAG}={value!r}: expected a number of devices from 1")


def split_host(environ: MutableMapping[str, str] | None = None, count: int | None = None) -> int | None:
    """Add `FLAG=N` to XLA_FLAGS, N = `count` (training's --devices), else $AIAYN_HOST_DEVICES or the cores (at
    most MAX_DEVICES; a --devices beyond them is refused by the mesh), unless jax is already imported or XLA_FLAGS
    names a count; the count added, or None. ValueError for a $AIAYN_HOST_DEVICES not from 1 to MAX_DEVICES, or a
    bad XLA_FLAGS count."""
    environ = os.environ if environ is None else environ
    check_xla_flags(environ)
    flags = environ.get("XLA_FLAGS", "")
    if "jax" in sys.modules or FLAG in flags:
        return None
    value = environ.get(ENV, "").strip()
    if value and count is None:
        if not (value.isascii() and value.isdigit() and 1 <= int(value) <= MAX_DEVICES):
            raise ValueError(f"${ENV}={value!r}: expected a number of devices from 1 to {MAX_DEVICES}")
        count = int(value)
    count = count or min(cores(), MAX_DEVICES)
    if count == 1:
        return None
    environ["XLA_FLAGS"] = f"{flags} {FLAG}={count}".strip()
    return count
