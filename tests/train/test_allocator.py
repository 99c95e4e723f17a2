"""glibc tuning for XLA:CPU (train/backends/allocator.py): the huge-page re-execution of the CLIs."""

import os
import subprocess
import sys

import pytest

from train.backends import allocator

PRINT_TUNABLES = "import os; from train.backends import allocator; allocator.use_huge_pages(); print(os.environ.get('GLIBC_TUNABLES'))"


def _tunables_after(env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-c", PRINT_TUNABLES], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


@pytest.mark.parametrize("before, after", [
    (None, "glibc.malloc.hugetlb=1"),
    ("glibc.malloc.arena_max=2", "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"),  # kept, and appended
    ("glibc.malloc.hugetlb=0", "glibc.malloc.hugetlb=0"),  # a user's opt-out is left alone
])
def test_the_command_runs_again_once_with_huge_pages(before, after):
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if before is not None:
        env["GLIBC_TUNABLES"] = before
    # Where the C library is not glibc >= 2.35 or the kernel's THP mode is not "madvise", nothing
    # changes: the process goes on with its environment as it was.
    expected = after if allocator._asks_for_huge_pages() else str(before)
    assert _tunables_after(env) == expected


def test_huge_pages_are_asked_for_only_in_madvise_mode(monkeypatch, tmp_path):
    mode = tmp_path / "enabled"
    monkeypatch.setattr(allocator, "THP_MODE", mode)
    monkeypatch.setattr(allocator.platform, "libc_ver", lambda: ("glibc", "2.36"))
    monkeypatch.setattr(allocator.sys, "platform", "linux")
    for text, asks in (("always [madvise] never\n", True), ("[always] madvise never\n", False),
                       ("always madvise [never]\n", False)):
        mode.write_text(text)
        assert allocator._asks_for_huge_pages() is asks, text
    mode.unlink()
    assert allocator._asks_for_huge_pages() is False  # no THP at all
    mode.write_text("always [madvise] never\n")
    monkeypatch.setattr(allocator.platform, "libc_ver", lambda: ("glibc", "2.34"))  # no hugetlb tunable yet
    assert allocator._asks_for_huge_pages() is False


MAPPED_WHERE = """
import ctypes, json
from train.backends import allocator

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = allocator._glibc()
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2

def mapped(size=11 << 20):  # the cached beam search's logits on the small model: 11 MB
    before = libc.mallinfo2().hblks  # blocks served by a mapping of their own
    block = libc.malloc(size)
    count = libc.mallinfo2().hblks - before
    libc.free(block)
    return count

seen = {}
allocator.tune()
seen["tuned"] = mapped()
with allocator.settled():
    seen["settled"] = mapped()
allocator.release()  # the heap's top still holds the block freed under settled(): hand it back
seen["tuned again"] = mapped()
print(json.dumps(seen))
"""


@pytest.mark.skipif(allocator._glibc() is None or not hasattr(allocator._glibc(), "mallinfo2"), reason="glibc >= 2.33 only")
def test_settled_thresholds_serve_a_large_buffer_from_the_heap_and_tune_again_after():
    """Under the JAX backend's 4 MiB thresholds an 11 MB buffer gets a mapping of its own (faulted
    in afresh each time); under `settled()` (where an untuned process settles) it comes from the
    heap, and on leaving the backend's thresholds apply again. In a subprocess: thresholds are
    process-wide."""
    import json

    out = subprocess.run([sys.executable, "-c", MAPPED_WHERE], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == {"tuned": 1, "settled": 0, "tuned again": 1}
