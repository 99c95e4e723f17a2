"""glibc's allocator tuned for XLA:CPU, from inside the process (no environment variables).

On the CPU, XLA's buffers (the compiled step's temporaries, the new state) come from glibc's
malloc. glibc serves requests above its mmap threshold with their own mappings, returned to the
system on free; below it, from its heaps, which keep freed memory resident. The threshold starts
at 128 KiB but rises to the size of every mmapped block freed (up to 32 MiB), so after the first
steps most of XLA's multi-MiB buffers come from the heaps, and the memory they held stays
resident between steps; compilation leaves a few hundred MiB the same way.

`tune()` fixes both thresholds at 4 MiB with `mallopt` (what `MALLOC_MMAP_THRESHOLD_=4194304
MALLOC_TRIM_THRESHOLD_=4194304` would do, but those are read only when the process starts), and
`release()` hands freed heap memory back with `malloc_trim(0)`, for after a compilation. Both
are no-ops where the C library is not glibc. Measured effects: README, Benchmarks.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
# Fixed thresholds. 128 KiB (glibc's initial value) gave the same peaks but mapped and faulted in
# every buffer above it afresh at each step: the default numbers run took 184 s for 300 steps
# against 153 s at 4 MiB and 162 s untuned (README, Benchmarks).
THRESHOLD = 4 * 1024 * 1024


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def tune() -> bool:
    """Fixed mmap and trim thresholds (4 MiB); True where applied."""
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, THRESHOLD)) and bool(libc.mallopt(M_TRIM_THRESHOLD, THRESHOLD))


def release() -> bool:
    """Return freed heap memory to the system (`malloc_trim(0)`); True where glibc released some."""
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False
