"""Missing permissions met by a user who lacks them. Root reads and writes anything, so these run
the commands in a subprocess as the unprivileged user `nobody` (util-linux's setpriv), where this
machine allows it, and skip saying why where it does not."""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def place():
    """A directory `nobody` may enter and write (pytest's own are root's alone)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run a command as an unprivileged user")
    path = Path(tempfile.mkdtemp(prefix="aiayn-perm-"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def as_nobody(place: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HOME": str(place), "PYTHONPATH": str(REPO), "MPLCONFIGDIR": str(place)}
    done = subprocess.run([*NOBODY, sys.executable, "-m", *args], cwd=place, env=env, capture_output=True,
                          text=True, timeout=300)
    if "Permission denied" in done.stderr and "python" in done.stderr.splitlines()[0].lower():
        pytest.skip(f"`nobody` cannot run this Python: {done.stderr.strip()[:200]}")
    return done


def one_line(done: subprocess.CompletedProcess, *says: str) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and all(s in lines[0] for s in says), done.stderr


def test_an_unreadable_input_and_an_unwritable_output_are_one_line_each(tiny_torch_run, place):
    run = shutil.copytree(tiny_torch_run, place / "run")
    for path in [run, *run.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    locked = place / "locked.de"
    locked.write_text("eins\n")
    locked.chmod(0)
    one_line(as_nobody(place, "train.commands.translate", "--run-dir", str(run), "--input", str(locked)),
             f"cannot read {locked}", "Permission denied")
    (place / "in.de").write_text("eins\n")
    (place / "in.de").chmod(0o644)
    shut = place / "shut"
    shut.mkdir(mode=0o555)
    shut.chmod(0o555)
    one_line(as_nobody(place, "train.commands.translate", "--run-dir", str(run), "--input", str(place / "in.de"),
                       "--output", str(shut / "out.en")), f"directory {shut} is not writable")
    one_line(as_nobody(place, "train.run", "--backend", "torch", "--run-dir", str(shut / "run"), "--steps", "1"),
             str(shut), "Permission denied")
    assert list(shut.iterdir()) == []
