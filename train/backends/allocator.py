"""glibc's allocator tuned for XLA:CPU from inside the process, else no-ops (docs/performance.md#the-default-run)."""

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
# Fixed 4 MiB thresholds: faster steps than glibc's initial or sliding ones (docs/performance.md#the-default-run).
THRESHOLD = 4 * 1024 * 1024


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


# Where an untuned process's thresholds settle: mmap at 32 MiB (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit), trim twice it.
SETTLED = (32 * 1024 * 1024, 64 * 1024 * 1024)
_tuned = False


def _set(mmap_threshold: int, trim_threshold: int) -> bool:
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(libc.mallopt(M_TRIM_THRESHOLD, trim_threshold))


def tune() -> None:
    """Fixed mmap and trim thresholds (4 MiB), where glibc takes them (`tuned()`)."""
    global _tuned
    _tuned = _set(THRESHOLD, THRESHOLD) or _tuned


def tuned() -> bool:
    """Whether `tune()` applied its thresholds in this process."""
    return _tuned


@contextlib.contextmanager
def settled():
    """Within: glibc's untuned thresholds (`SETTLED`), for other code timed beside a JAX backend."""
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
    """Re-execute this command with `glibc.malloc.hugetlb=1` where it helps (glibc >= 2.35, THP "madvise")."""
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
