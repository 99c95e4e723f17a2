"""glibc's allocator tuned for XLA:CPU, from inside the process (no environment variables); why:
docs/performance.md#the-default-run.

glibc's mmap threshold rises to the size of every mmapped block freed (up to 32 MiB), so XLA's
multi-MiB buffers end up in heaps that keep freed memory resident: `tune()` fixes the mmap and trim
thresholds at 4 MiB with `mallopt`, and `release()` hands freed heap memory back (`malloc_trim(0)`)
after a compilation; both are no-ops off glibc. A step's temporaries are one block too large for a
heap, so glibc maps it afresh at every step and the kernel faults it in page by page:
`use_huge_pages()` re-executes the command once with `glibc.malloc.hugetlb=1` in `GLIBC_TUNABLES`
(read only at process start); the training and benchmark CLIs call it first thing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import platform
import sys
from pathlib import Path

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
# Fixed 4 MiB thresholds: faster steps than glibc's initial 128 KiB, which maps and faults in every larger
# buffer afresh at each step, and than its sliding ones (docs/performance.md#the-default-run).
THRESHOLD = 4 * 1024 * 1024


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


# Where an untuned process's thresholds settle: glibc raises its mmap threshold to the size of
# each mmapped block freed, up to 32 MiB on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX), and its trim
# threshold to twice that.
SETTLED = (32 * 1024 * 1024, 64 * 1024 * 1024)
_tuned = False


def _set(mmap_threshold: int, trim_threshold: int) -> bool:
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(libc.mallopt(M_TRIM_THRESHOLD, trim_threshold))


def tune() -> bool:
    """Fixed mmap and trim thresholds (4 MiB); True where applied."""
    global _tuned
    _tuned = _set(THRESHOLD, THRESHOLD) or _tuned
    return _tuned


def tuned() -> bool:
    """Whether `tune()` applied its thresholds in this process."""
    return _tuned


@contextlib.contextmanager
def settled():
    """glibc's thresholds where an untuned process settles (`SETTLED`), then `tune()`'s again if
    it was applied: for other code timed in a process that also holds a JAX backend (torch's and
    CTranslate2's searches in `parity.translate_bench`), whose buffers above 4 MiB (the beam's logits)
    would be mapped and faulted in afresh at every step (docs/performance.md#translation-speed)."""
    _set(*SETTLED)
    try:
        yield
    finally:
        if _tuned:
            _set(THRESHOLD, THRESHOLD)


def release() -> bool:
    """Return freed heap memory to the system (`malloc_trim(0)`); True where glibc released some."""
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


HUGE_PAGES = "glibc.malloc.hugetlb"
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def use_huge_pages() -> None:
    """Re-execute this process's command with `GLIBC_TUNABLES` holding `glibc.malloc.hugetlb=1`
    (malloc asks for transparent huge pages), where that helps: glibc >= 2.35 on Linux with
    transparent huge pages in "madvise" mode ("always" needs no asking). Returns where it does
    nothing: elsewhere, or when `GLIBC_TUNABLES` already names the tunable, as after the
    re-execution (so it happens once) or when a user sets `glibc.malloc.hugetlb=0` to opt out.
    Call it before anything else (the process is replaced; output not yet flushed is flushed).
    """
    if HUGE_PAGES in os.environ.get("GLIBC_TUNABLES", "") or not _asks_for_huge_pages():
        return
    tunables = ":".join(filter(None, [os.environ.get("GLIBC_TUNABLES"), f"{HUGE_PAGES}=1"]))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, {**os.environ, "GLIBC_TUNABLES": tunables})


def _asks_for_huge_pages() -> bool:
    name, version = platform.libc_ver()
    if sys.platform != "linux" or name != "glibc" or tuple(map(int, version.split(".")[:2])) < (2, 35):
        return False
    try:
        return "[madvise]" in THP_MODE.read_text()
    except OSError:
        return False
