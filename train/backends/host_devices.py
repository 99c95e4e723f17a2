"""One JAX device per CPU core for searching, asked before jax loads (docs/performance.md#against-ctranslate2)."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import MutableMapping

ENV = "AIAYN_HOST_DEVICES"
FLAG = "--xla_force_host_platform_device_count"
# Each XLA CPU device costs memory and start-up time (docs/operations.md#translating): a bound, in one line.
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
    """ValueError for a device count in $XLA_FLAGS that is not a whole number from 1 (XLA would abort)."""
    flags = (os.environ if environ is None else environ).get("XLA_FLAGS", "")
    for value in re.findall(rf"{FLAG}(\S*)", flags):
        if not re.fullmatch(r"=0*[1-9]\d*", value):
            value = value.removeprefix("=")[:20]
            raise ValueError(f"$XLA_FLAGS: {FLAG}={value!r}: expected a number of devices from 1")


def split_host(environ: MutableMapping[str, str] | None = None, count: int | None = None) -> int | None:
    """Add `FLAG=N` (`count`, else $AIAYN_HOST_DEVICES or the cores) to XLA_FLAGS before jax loads; N, or None."""
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
