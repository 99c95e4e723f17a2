"""One JAX device per CPU core for searching: `translate`, `evaluate` and `parity.translate_bench`
ask XLA for them before jax is imported, and decode each batch data parallel over every device.

XLA:CPU runs a beam search's small matmuls on one core; split into one device per core, each core
searches its share of the batch, faster with the same outputs (docs/performance.md#against-ctranslate2).
$AIAYN_HOST_DEVICES=N sets the count (1: one device, XLA's own default); a count already in
$XLA_FLAGS is kept. Training is left as it is: there the count is the run's own choice (--devices).
A GPU or TPU machine searches on its accelerators as before; the CPU devices are there unused.
This module imports no framework.
"""

from __future__ import annotations

import os
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


def split_host(at_least: int = 1, environ: MutableMapping[str, str] | None = None) -> int | None:
    """Add `FLAG=N` to XLA_FLAGS, N = $AIAYN_HOST_DEVICES or the cores (or `at_least` where larger: a
    --devices N asked for; at most MAX_DEVICES), unless jax is already imported or XLA_FLAGS names a
    count. The count added, or None. Raises ValueError for a $AIAYN_HOST_DEVICES that is not a whole
    number from 1 to MAX_DEVICES."""
    environ = os.environ if environ is None else environ
    flags = environ.get("XLA_FLAGS", "")
    if "jax" in sys.modules or FLAG in flags:
        return None
    value = environ.get(ENV, "").strip()
    if value:
        if not (value.isascii() and value.isdigit() and 1 <= int(value) <= MAX_DEVICES):
            raise ValueError(f"${ENV}={value!r}: expected a number of devices from 1 to {MAX_DEVICES}")
        count = int(value)
    else:
        count = min(cores(), MAX_DEVICES)
    count = min(max(count, at_least), MAX_DEVICES)  # more than that: the mesh names what is missing
    if count == 1:
        return None
    environ["XLA_FLAGS"] = f"{flags} {FLAG}={count}".strip()
    return count
