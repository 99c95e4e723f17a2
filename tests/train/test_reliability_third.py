"""Reliability, third round (issue 42): --overwrite replaces only what this project wrote, nothing
outside a run is written, full disks and read-only places end in one line, readers beside a
rotating run never fail, a run's files are checked before use.

Full disks and read-only places are real: a small tmpfs, mounted where this process may (as root;
elsewhere those tests skip and say so), filled or made read-only at the moment of each write.
The CLIs run in-process (`main`, what `python -m` calls; capfd sees every thread's output too),
and in a real process where the end of the process matters (what threads print at exit)."""

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parity import convert
from train import average, curves, evaluate, files, loop, rundir, store, translate
from train import run as train_run
from train.config import ExperimentConfig

REPO = Path(__file__).resolve().parents[2]
TINY = ["--backend", "torch", "--numbers-train", "300", "--numbers-valid", "4", "--numbers-test", "0",
        "--max-len", "16", "--token-budget", "512", "--set", "num_encoder_layers=1", "--set", "num_decoder_layers=1",
        "--no-progress", "--samples", "0", "--eval-sentences", "4", "--beam", "1", "--threads", "1"]


def one_error_line(err: str, *fragments: str) -> str:
    """The one non-empty line of `err`, which starts with 'error: ' and holds every fragment."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, err)
    return lines[0]


def exit_code(main, argv) -> int:
    """`main(argv)`'s exit status, returned or raised (argparse's parser.exit)."""
    try:
        return main([str(a) for a in argv])
    except SystemExit as exited:
        return exited.code


def files_of(directory: Path) -> dict[str, bytes]:
    """Every file under `directory` (links followed) with its bytes."""
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def leftovers(directory: Path) -> list[str]:
    """Temporary files and directories of a write that did not finish."""
    return sorted(p.name for p in directory.rglob("*") if p.name.endswith((".tmp", "-old")) or ".tmp-" in p.name
                  or "orbax-checkpoint-tmp" in p.name or p.name.startswith(".tmp"))


@pytest.fixture
def run_copy(tiny_torch_run, tmp_path):
    """A copy of the shared 2-step torch run (checkpoint 2), free to change."""
    return Path(shutil.copytree(tiny_torch_run, tmp_path / "run"))


# ----------------------------------------------------------------------------------------------
# 1. --overwrite replaces only what this project wrote, of the same kind, and never the source


def test_overwrite_refuses_what_this_project_did_not_write_or_of_another_kind(run_copy, tmp_path, capfd):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "mine.txt").write_text("keep")
    other_run = Path(shutil.copytree(run_copy, tmp_path / "other"))
    before = files_of(tmp_path)
    for argv, message in [
        (["--to", "ctranslate2", "--src", run_copy, "--dst", mine], "is not empty and holds no CTranslate2 model"),
        (["--to", "marian", "--src", run_copy, "--dst", mine], "is not empty and holds no HF Marian directory"),
        (["--to", "ctranslate2", "--src", run_copy, "--dst", other_run], "holds a run, not a CTranslate2 model"),
        (["--to", "marian", "--src", run_copy, "--dst", other_run], "holds a run, not a HF Marian directory"),
        (["--to", "jax", "--run-dir", run_copy, "--dst", mine], "is not empty and holds no run"),
    ]:
        assert exit_code(convert.main, [*argv, "--overwrite"]) == 1
        one_error_line(capfd.readouterr().err, message)
    assert exit_code(train_run.main, ["--run-dir", mine, "--overwrite", *TINY]) == 1
    one_error_line(capfd.readouterr().err, f"{mine} is not empty and holds no run")
    assert files_of(tmp_path) == before


@pytest.mark.parametrize("argv, message", [
    (["parity.convert", "--to", "marian", "--src", "run", "--dst", "run"], "--dst run is the source"),
    (["parity.convert", "--to", "ctranslate2", "--src", "run", "--dst", "run"], "--dst run is the source"),
    (["parity.convert", "--to", "jax", "--run-dir", "run", "--dst", "run/checkpoints"], "is inside the source"),
    (["parity.convert", "--to", "ctranslate2", "--src", "run", "--dst", "run/checkpoints/new"], "is inside the source"),
    (["parity.convert", "--to", "jax", "--run-dir", "run", "--dst", "."], "holds the source"),
    (["train.average", "--run-dir", "run", "--last", "1", "--dst", "run/checkpoints/2"], "is inside the source"),
    (["train.average", "--run-dir", "run", "--last", "1", "--dst", "run"], "is the source"),
])
def test_a_destination_that_is_inside_or_holds_the_source_is_refused_before_any_work(
        run_copy, tmp_path, monkeypatch, capfd, argv, message):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(rundir, "create_backend", lambda *a, **k: pytest.fail("the work started"))
    monkeypatch.setattr(average, "create_backend", lambda *a, **k: pytest.fail("the work started"))
    before = files_of(tmp_path)
    main = {"parity.convert": convert.main, "train.average": average.main}[argv[0]]
    code = exit_code(main, [*argv[1:], "--overwrite"])
    assert code == 1
    one_error_line(capfd.readouterr().err, message)
    assert files_of(tmp_path) == before  # the source whole, nothing left beside it


def test_overwrite_replaces_its_own_kind_atomically(run_copy, tmp_path, capfd):
    pytest.importorskip("ctranslate2")
    ct2 = tmp_path / "ct2"
    assert exit_code(convert.main, ["--to", "ctranslate2", "--src", run_copy, "--dst", ct2]) == 0
    assert json.loads((ct2 / rundir.KIND_FILE).read_text()) == {"kind": "ctranslate2"}
    (ct2 / "model.bin").write_bytes(b"stale")
    assert exit_code(convert.main, ["--to", "ctranslate2", "--src", run_copy, "--dst", ct2, "--overwrite"]) == 0
    assert (ct2 / "model.bin").read_bytes() != b"stale"
    averaged = tmp_path / "averaged"
    for _ in range(2):  # a run over a run
        assert exit_code(average.main, ["--run-dir", run_copy, "--last", "1", "--dst", averaged, "--overwrite"]) == 0
    assert rundir.kind_of(averaged) == "run" and rundir.kind_of(ct2) == "ctranslate2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["averaged", "ct2", "run"]  # nothing left beside them
    link = tmp_path / "link"
    link.symlink_to(averaged)
    assert exit_code(average.main, ["--run-dir", run_copy, "--last", "1", "--dst", link, "--overwrite"]) == 1
    one_error_line(capfd.readouterr().err, f"{link} is a symbolic link; it is never replaced")


def run_files(run_dir: Path) -> dict[str, bytes]:
    """`files_of` but locks (which name the process holding them)."""
    return {name: data for name, data in files_of(run_dir).items() if Path(name).name != rundir.LOCK_FILE}


def fail_at_save(monkeypatch, nth: int) -> None:
    """The run's `nth` checkpoint save meets a full disk (the ones before it are written)."""
    real, saves = loop._save, []

    def save(cfg, *args, **kwargs):
        saves.append(1)
        if len(saves) == nth:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(Path(cfg.run_dir) / "checkpoints" / str(nth)))
        return real(cfg, *args, **kwargs)

    monkeypatch.setattr(loop, "_save", save)


NEW = ["--steps", "2", "--save-every", "1", "--keep-checkpoints", "2", "--seed", "7", *TINY]


@pytest.mark.parametrize("failure", ["bad data", "full disk at the first save", "Ctrl-C before it"])
def test_train_overwrite_ending_without_a_checkpoint_puts_the_old_run_back(run_copy, tmp_path, monkeypatch, capfd,
                                                                           failure):
    before = run_files(run_copy)
    argv = ["--run-dir", run_copy, "--overwrite", *NEW]
    if failure == "bad data":
        argv += ["--train", f"de:en:{tmp_path / 'missing'}", "--valid", f"de:en:{tmp_path / 'missing'}"]
    elif failure == "full disk at the first save":
        fail_at_save(monkeypatch, 1)
    else:
        monkeypatch.setattr(loop, "_save", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    assert exit_code(train_run.main, argv) in (1, 130)
    assert run_files(run_copy) == before  # the old run whole, where it was
    assert sorted(os.listdir(tmp_path)) == ["run"]  # nothing set aside is left
    monkeypatch.undo()
    assert exit_code(train_run.main, ["--run-dir", run_copy, "--resume", "--steps", "3", "--no-progress"]) == 0


def test_train_overwrite_deletes_the_old_run_once_the_new_one_holds_a_checkpoint(run_copy, tmp_path, monkeypatch,
                                                                                 capfd):
    old_config = json.loads((run_copy / "config.json").read_text())
    fail_at_save(monkeypatch, 2)  # checkpoint 1 of the new run is written, then the disk is full
    assert exit_code(train_run.main, ["--run-dir", run_copy, "--overwrite", *NEW]) == 1
    one_error_line(capfd.readouterr().err, f"{run_copy / 'checkpoints' / '2'}: No space left on device")
    assert json.loads((run_copy / "config.json").read_text())["seed"] == 7 != old_config["seed"]
    assert sorted(os.listdir(run_copy / "checkpoints")) == ["1"] and sorted(os.listdir(tmp_path)) == ["run"]
    monkeypatch.undo()
    resume = ["--run-dir", run_copy, "--resume", "--steps", "2", "--save-every", "1", "--no-progress"]
    assert exit_code(train_run.main, resume) == 0  # the new run goes on
    assert sorted(os.listdir(run_copy / "checkpoints")) == ["1", "2"]
    assert exit_code(train_run.main, ["--run-dir", run_copy, "--overwrite", *NEW]) == 0  # and a finished one
    assert sorted(os.listdir(tmp_path)) == ["run"]


def test_an_old_run_left_aside_by_a_killed_overwrite_is_named_not_deleted(run_copy, tmp_path, capfd):
    aside = rundir.set_aside_path(run_copy)
    shutil.copytree(run_copy, aside)
    before = files_of(tmp_path)
    assert exit_code(train_run.main, ["--run-dir", run_copy, "--overwrite", *NEW]) == 1
    one_error_line(capfd.readouterr().err, f"{aside} holds the run an earlier --overwrite of {run_copy} set aside",
                   "move it back")
    assert files_of(tmp_path) == before


def test_a_killed_overwrite_leaves_the_old_run_aside_whole(run_copy, tmp_path):
    """SIGKILL while the new run trains: nothing can put the old one back, so it stays beside, whole."""
    before = run_files(run_copy)
    argv = ["--run-dir", run_copy, "--overwrite", "--steps", "100000", *TINY[:-4], "--threads", "1"]
    process = subprocess.Popen([sys.executable, "-m", "train.run", *map(str, argv)], cwd=REPO,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    aside = rundir.set_aside_path(run_copy)
    deadline = time.monotonic() + 120
    try:
        while not (run_copy / "config.json").exists() or not aside.exists():  # the new run has begun
            assert process.poll() is None and time.monotonic() < deadline, process.stderr and process.stderr.read()
            time.sleep(0.05)
    finally:
        process.kill()
        process.wait()
    assert run_files(aside) == before


# ----------------------------------------------------------------------------------------------
# 2. Nothing outside the run directory is written


def link_every_file(run_dir: Path, victims: Path) -> dict[Path, bytes]:
    """Replace every file under `run_dir` by a symbolic link to a 'victim' file (same bytes) in
    `victims`; returns {victim: its bytes}."""
    victims.mkdir(exist_ok=True)
    kept = {}
    for i, path in enumerate(sorted(p for p in run_dir.rglob("*") if p.is_file() and not p.is_symlink())):
        victim = victims / f"{i}-{path.name}"
        shutil.move(path, victim)
        path.symlink_to(victim)
        kept[victim] = victim.read_bytes()
    (victims / "lock").write_text("the lock's victim")
    (run_dir / rundir.LOCK_FILE).unlink(missing_ok=True)
    (run_dir / rundir.LOCK_FILE).symlink_to(victims / "lock")  # what issue 42 found written with "pid N"
    kept[victims / "lock"] = b"the lock's victim"
    return kept


def test_a_run_whose_every_file_is_a_link_never_writes_where_they_point(run_copy, tmp_path, capfd):
    pytest.importorskip("ctranslate2")
    victims = tmp_path / "victims"
    kept = link_every_file(run_copy, victims)
    other, other2 = (Path(shutil.copytree(run_copy, tmp_path / name, symlinks=True))  # links to the same victims
                     for name in ("other", "other2"))
    ct2 = tmp_path / "ct2"
    assert exit_code(convert.main, ["--to", "ctranslate2", "--src", run_copy, "--dst", ct2]) == 0
    link_every_file(ct2, victims / "ct2")
    kept.update({p: p.read_bytes() for p in (victims / "ct2").iterdir()})
    steps = [
        (train_run.main, ["--run-dir", run_copy, "--resume", "--steps", "4", "--save-every", "1",
                          "--keep-checkpoints", "1", "--no-progress", "--threads", "1"]),
        (average.main, ["--run-dir", run_copy, "--last", "1", "--dst", other, "--overwrite"]),
        (convert.main, ["--to", "jax", "--run-dir", run_copy, "--dst", other2, "--overwrite"]),
        (convert.main, ["--to", "ctranslate2", "--src", run_copy, "--dst", ct2, "--overwrite"]),
        (train_run.main, ["--run-dir", run_copy, "--overwrite", "--steps", "1", *TINY]),
    ]
    for main, argv in steps:
        assert exit_code(main, argv) == 0, capfd.readouterr().err
        assert {p: p.read_bytes() for p in kept} == kept, argv  # every victim as it was
    assert sorted(os.listdir(victims)) == sorted([*(p.name for p in kept if p.parent == victims), "ct2"])
    assert not (run_copy / rundir.LOCK_FILE).is_symlink() and not (run_copy / rundir.CURVES_FILE).is_symlink()


@pytest.mark.parametrize("part", ["checkpoints/2", "checkpoints", "tensorboard"])
def test_a_run_directory_part_that_is_a_link_is_refused(run_copy, tmp_path, capfd, part):
    elsewhere = tmp_path / "elsewhere"
    shutil.move(run_copy / part, elsewhere)
    (run_copy / part).symlink_to(elsewhere)
    before = files_of(elsewhere)
    argv = ["--run-dir", run_copy, "--resume", "--steps", "4", "--save-every", "1", "--keep-checkpoints", "1"]
    assert exit_code(train_run.main, argv) == 1
    one_error_line(capfd.readouterr().err, f"{run_copy / part} is a symbolic link")
    assert files_of(elsewhere) == before


def test_a_write_replaces_a_link_and_a_planted_temporary_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("victim")
    for name in ("out.json", ".out.json.tmp"):  # the file, and the temporary name beside it
        (tmp_path / name).symlink_to(victim)
    files.write_text_atomic(tmp_path / "out.json", "new")
    assert victim.read_text() == "victim" and (tmp_path / "out.json").read_text() == "new"
    assert not (tmp_path / "out.json").is_symlink() and not (tmp_path / ".out.json.tmp").exists()


# ----------------------------------------------------------------------------------------------
# 3. Full disks, read-only places and missing permissions end in one line


class SmallFilesystem:
    """A 16 MiB tmpfs at `root` to fill (`fill`) or make read-only, whole or a directory of it
    (`read_only`: a read-only bind mount, which files open for writing do not prevent)."""

    def __init__(self, root: Path):
        self.root, self.mounts = root, [root]
        root.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(root)], capture_output=True,
                              text=True, check=False)
        if done.returncode:
            pytest.skip(f"a tmpfs cannot be mounted here ({done.stderr.strip()}): the full-disk and read-only "
                        "tests need root; the injected ones below run everywhere")

    def fill(self, leave: int = 0) -> None:
        """Write zeros until the filesystem is full, then free `leave` bytes."""
        if leave:
            (self.root / ".reserve").write_bytes(bytes(leave))
        fd = os.open(self.root / ".filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            for block in (1 << 20, 1 << 12, 1):
                try:
                    while True:
                        os.write(fd, bytes(block))
                except OSError as err:
                    assert err.errno == errno.ENOSPC
        finally:
            os.close(fd)
        (self.root / ".reserve").unlink(missing_ok=True)

    def free(self) -> None:
        (self.root / ".filler").unlink()

    def read_only(self, directory: Path | None = None) -> None:
        directory = directory or self.root
        subprocess.run(["mount", "--bind", str(directory), str(directory)], check=True)
        subprocess.run(["mount", "-o", "remount,bind,ro", str(directory)], check=True)
        self.mounts.append(directory)

    def unmount(self) -> None:
        for directory in reversed(self.mounts):
            subprocess.run(["umount", "-l", str(directory)], check=True)


@pytest.fixture
def small_fs(tmp_path):
    fs = SmallFilesystem(tmp_path / "fs")
    yield fs
    fs.unmount()


# The write sites of a run, each filled up just before it writes (a new 2-step run saving at
# steps 1 and 2, so that the full disk comes after a checkpoint whenever the site allows).
SITES = {  # site: (module, the function filling the disk first, the path the error names)
    "config.json": (rundir, "write_json_atomic", "config.json"),
    "tokenizer": (rundir, "save_tokenizers", "tokenizer.json"),
    "checkpoint": (loop, "_save", "checkpoints/2"),
    "tensorboard": (loop, "summary_writer", "tensorboard"),
    "results.json": (loop, "write_json_atomic", "results.json"),
    "curves.png": (curves, "plot_curves", "curves.png"),
}


@pytest.mark.parametrize("site", SITES)
def test_a_full_disk_at_each_write_of_a_run_is_one_line(small_fs, monkeypatch, capfd, site):
    module, name, named = SITES[site]
    real = getattr(module, name)
    calls = []

    def full_first(*args, **kwargs):
        calls.append(args)
        if site == "checkpoint" and len(calls) == 1:  # checkpoint 1 is written: the disk fills before 2
            return real(*args, **kwargs)
        small_fs.fill()
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, full_first)
    run_dir = small_fs.root / "run"
    argv = ["--run-dir", run_dir, "--steps", "2", "--save-every", "1", "--keep-checkpoints", "2", "--log-every", "1",
            *TINY]
    assert exit_code(train_run.main, argv) == 1
    one_error_line(capfd.readouterr().err, f"error: {run_dir / named}: No space left on device")
    assert leftovers(run_dir) == []
    if (run_dir / "checkpoints" / "1").exists():  # the checkpoint before the full disk is whole
        assert store.verify_checkpoint(run_dir / "checkpoints" / "1")


def test_a_full_disk_ends_a_real_process_in_one_line_and_a_resume_continues(small_fs, tiny_torch_run):
    run_dir = Path(shutil.copytree(tiny_torch_run, small_fs.root / "run"))
    small_fs.fill(leave=200_000)  # room for the small files, none for a checkpoint
    argv = ["--run-dir", run_dir, "--resume", "--steps", "3", "--no-progress", "--threads", "1"]
    done = subprocess.run([sys.executable, "-m", "train.run", *map(str, argv)], cwd=REPO, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 1
    one_error_line(done.stderr, f"{run_dir / 'checkpoints' / '3'}: No space left on device")
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["2"] and leftovers(run_dir) == []
    assert store.verify_checkpoint(run_dir / "checkpoints" / "2")
    small_fs.free()
    assert exit_code(train_run.main, argv) == 0
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["2", "3"]


def test_orbax_on_a_full_disk_is_one_error_naming_the_checkpoint(small_fs, capfd):
    import jax

    from train.store.jax_store import JaxStore

    checkpoints = small_fs.root / "checkpoints"
    saver = JaxStore(checkpoints, keep=2)
    state = {"w": jax.random.normal(jax.random.key(0), (512, 512))}  # 1 MiB that does not compress
    saver.save(1, state, {"step": 1})
    small_fs.fill(leave=100_000)
    with pytest.raises(OSError) as failed:
        saver.save(2, state, {"step": 2})
    saver.close()
    assert (failed.value.errno, failed.value.filename) == (errno.ENOSPC, str(checkpoints.absolute() / "2"))
    assert sorted(os.listdir(checkpoints)) == ["1"] and leftovers(checkpoints) == []
    assert "Traceback" not in capfd.readouterr().err  # TensorStore's callbacks on orbax's closed loop say nothing


def test_read_only_places_are_one_line(small_fs, tiny_torch_run, monkeypatch, capfd):
    small_fs.read_only()
    ro = small_fs.root
    assert exit_code(train_run.main, ["--run-dir", ro / "run", *TINY]) == 1
    one_error_line(capfd.readouterr().err, f"error: {ro / 'run'}: Read-only file system")
    monkeypatch.chdir(ro)  # the default runs/ in a read-only working directory
    assert exit_code(train_run.main, TINY) == 1
    one_error_line(capfd.readouterr().err, "error: runs: Read-only file system")
    for main, argv in [
        (average.main, ["--run-dir", tiny_torch_run, "--last", "1", "--dst", ro / "averaged"]),
        (convert.main, ["--to", "jax", "--run-dir", tiny_torch_run, "--dst", ro / "jax"]),
        (convert.main, ["--to", "ctranslate2", "--src", tiny_torch_run, "--dst", ro / "ct2"]),
    ]:
        assert exit_code(main, argv) == 1
        one_error_line(capfd.readouterr().err, f"error: {argv[-1]}: Read-only file system")


def derived_outputs(run_dir: Path, root: Path) -> list[tuple]:
    """(main, argv, destination) of each writer that builds a new directory from a run."""
    return [
        (average.main, ["--run-dir", run_dir, "--last", "1", "--dst", root / "averaged"], root / "averaged"),
        (convert.main, ["--to", "jax", "--run-dir", run_dir, "--dst", root / "jax"], root / "jax"),
        (convert.main, ["--to", "ctranslate2", "--src", run_dir, "--dst", root / "ct2"], root / "ct2"),
    ]


def test_average_convert_and_export_onto_a_full_disk_are_one_line(small_fs, tiny_torch_run, capfd):
    pytest.importorskip("ctranslate2")
    small_fs.fill()
    for main, argv, dst in derived_outputs(tiny_torch_run, small_fs.root):
        assert exit_code(main, argv) == 1
        one_error_line(capfd.readouterr().err, f"error: {dst}: No space left on device")
        assert sorted(os.listdir(small_fs.root)) == [".filler"]  # nothing half-made left


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EACCES])
def test_an_injected_write_error_in_average_convert_or_export_leaves_the_old_output(tiny_torch_run, tmp_path,
                                                                                   monkeypatch, capfd, code):
    """Where no filesystem can be mounted: the error raised as the replacement built beside the old
    output is swapped in; the old output stays whole and nothing is left beside it."""
    pytest.importorskip("ctranslate2")
    outputs = derived_outputs(tiny_torch_run, tmp_path / "out")
    for main, argv, _ in outputs:
        assert exit_code(main, argv) == 0
    before = run_files(tmp_path / "out")  # (a replacement locks the old output: its .lock may appear)
    real_replace = os.replace

    def failing_replace(src, dst, *args, **kwargs):
        name = Path(src).name  # the new output swapped in (not the old one put back)
        if name.startswith(".") and not name.endswith("-old") and Path(dst).parent == tmp_path / "out":
            raise OSError(code, os.strerror(code), str(src))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", failing_replace)
    for main, argv, dst in outputs:
        assert exit_code(main, [*argv, "--overwrite"]) == 1
        one_error_line(capfd.readouterr().err, f"error: {dst}: {os.strerror(code)}")
    monkeypatch.undo()
    assert run_files(tmp_path / "out") == before and leftovers(tmp_path / "out") == []
    assert sorted(os.listdir(tmp_path / "out")) == ["averaged", "ct2", "jax"]


def test_checkpoints_turned_read_only_mid_run_are_one_line(small_fs, monkeypatch, capfd):
    real, saves = loop._save, []

    def read_only_before_the_second(*args, **kwargs):
        saves.append(1)
        if len(saves) == 2:
            small_fs.read_only(run_dir / "checkpoints")
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "_save", read_only_before_the_second)
    run_dir = small_fs.root / "run"
    argv = ["--run-dir", run_dir, "--steps", "2", "--save-every", "1", "--keep-checkpoints", "2", *TINY]
    assert exit_code(train_run.main, argv) == 1
    one_error_line(capfd.readouterr().err, f"error: {run_dir / 'checkpoints' / '2'}: Read-only file system")
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["1"] and store.verify_checkpoint(run_dir / "checkpoints/1")


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EACCES])
def test_an_injected_write_error_leaves_the_old_file_and_no_temporary_one(tmp_path, monkeypatch, code):
    """Where no filesystem can be mounted: the same errors, raised by the one write the helper makes."""
    target = tmp_path / "results.json"
    target.write_text("old")

    def failing_open(path, flags, mode=0o777):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(files.os, "open", failing_open)
    with pytest.raises(OSError) as failed:
        files.write_text_atomic(target, "new")
    monkeypatch.undo()
    assert files.error_text(failed.value) == f"{target}: {os.strerror(code)}"
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["results.json"]


def test_a_library_error_repeating_a_full_disk_is_an_os_error_naming_the_path(tmp_path):
    """orbax (TensorStore's RESOURCE_EXHAUSTED, a ValueError) and safetensors say it in their own
    types; anything else is not a disk problem and stays what it is."""
    orbax = ValueError('RESOURCE_EXHAUSTED: Error writing "params.w/0" ... Failed to write 476660 bytes to file 21: '
                       "No space left on device [os_error_code='28']")
    safetensors = RuntimeError('Error while serializing: IoError(Os { code: 30, kind: ReadOnlyFilesystem, message: '
                               '"Read-only file system" })')
    assert files.error_text(files.write_error(orbax, tmp_path / "2")) == f"{tmp_path / '2'}: No space left on device"
    assert files.error_text(files.write_error(safetensors, "x")) == "x: Read-only file system"
    assert files.write_error(ValueError("shapes differ"), "x") is None


@pytest.fixture
def weights(tmp_path):
    """A tiny model's weights both ways: (model.safetensors, a JAX weights directory)."""
    import torch_reference
    from parity.runs import save_torch_weights
    from torch_reference.config import TransformerConfig

    cfg = TransformerConfig.preset("tiny", src_vocab_size=64, tgt_vocab_size=64, num_encoder_layers=1,
                                   num_decoder_layers=1)
    torch_weights = save_torch_weights(torch_reference.Transformer(cfg), tmp_path / "w" / "model.safetensors")
    assert convert.main(["--to", "jax", "--src", str(torch_weights), "--dst", str(tmp_path / "w" / "jax")]) == 0
    return torch_weights, tmp_path / "w" / "jax"


def convert_weights_argv(weights, to: str, dst: Path) -> list:
    return ["--to", to, "--src", weights[0] if to == "jax" else weights[1], "--dst", dst]


@pytest.mark.parametrize("to", ["jax", "torch"])
def test_a_weights_conversion_onto_a_full_disk_or_a_read_only_place_is_one_line(small_fs, weights, capfd, to):
    dst = small_fs.root / ("jax" if to == "jax" else "model.safetensors")
    small_fs.fill()
    assert exit_code(convert.main, convert_weights_argv(weights, to, dst)) == 1
    one_error_line(capfd.readouterr().err, f"error: {dst}: No space left on device")
    assert sorted(os.listdir(small_fs.root)) == [".filler"]
    small_fs.free()
    small_fs.read_only()
    assert exit_code(convert.main, convert_weights_argv(weights, to, dst)) == 1
    one_error_line(capfd.readouterr().err, f"error: {dst}: Read-only file system")


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EACCES])
@pytest.mark.parametrize("to", ["jax", "torch"])
def test_an_injected_write_error_in_a_weights_conversion_leaves_the_old_weights(weights, tmp_path, monkeypatch,
                                                                                capfd, to, code):
    """Where no filesystem can be mounted: orbax's and safetensors' own errors for the same causes,
    raised while the --overwrite replacement is written; the old destination stays whole."""
    import orbax.checkpoint as ocp
    import safetensors.torch

    dst = tmp_path / "out" / ("jax" if to == "jax" else "model.safetensors")
    assert exit_code(convert.main, convert_weights_argv(weights, to, dst)) == 0
    before = files_of(tmp_path / "out")
    cause = os.strerror(code)

    def failing(*args, **kwargs):
        if to == "jax":
            raise ValueError(f'RESOURCE_EXHAUSTED: Error writing "params.w/0": {cause} [os_error_code={code}]')
        raise RuntimeError(f'Error while serializing: IoError(Os {{ code: {code}, message: "{cause}" }})')

    monkeypatch.setattr(ocp.Checkpointer, "save", failing)
    monkeypatch.setattr(safetensors.torch, "save_file", failing)
    assert exit_code(convert.main, [*convert_weights_argv(weights, to, dst), "--overwrite"]) == 1
    one_error_line(capfd.readouterr().err, f"error: {dst}: {cause}")
    assert files_of(tmp_path / "out") == before and leftovers(tmp_path / "out") == []
    assert sorted(os.listdir(tmp_path / "out")) == [dst.name]


def plot_attention(run_dir, plots: Path, monkeypatch, capsys) -> tuple[int, str, str]:
    from .cli import run_cli

    return run_cli(translate.main, capsys, "--run-dir", str(run_dir), "--beam", "1", "--plot-attention", str(plots),
                   stdin=b"dreiundvierzig\nsieben\n", monkeypatch=monkeypatch)


def test_attention_plots_onto_a_full_disk_or_a_read_only_place_are_one_line(small_fs, tiny_torch_run, monkeypatch,
                                                                            capsys):
    plots = small_fs.root / "plots"
    small_fs.fill()
    code, out, err = plot_attention(tiny_torch_run, plots, monkeypatch, capsys)
    assert code == 1 and len(out.splitlines()) == 2  # the translations written before the plots
    one_error_line(err, f"error: {plots / '0001.png'}: No space left on device")
    assert leftovers(small_fs.root) == [] and os.listdir(plots) == []
    small_fs.free()
    small_fs.read_only()
    code, out, err = plot_attention(tiny_torch_run, small_fs.root / "plots2", monkeypatch, capsys)
    assert code == 1
    one_error_line(err, f"error: {small_fs.root / 'plots2'}: Read-only file system")


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EACCES])
def test_an_injected_write_error_in_an_attention_plot_is_one_line(tiny_torch_run, tmp_path, monkeypatch, capsys, code):
    """Where no filesystem can be mounted: matplotlib's savefig fails as the OS would make it; an
    older plot of the same name stays as it was."""
    from matplotlib.figure import Figure

    plots = tmp_path / "plots"
    assert plot_attention(tiny_torch_run, plots, monkeypatch, capsys)[0] == 0
    before = files_of(plots)

    def failing(self, fname, **kwargs):
        Path(fname).write_bytes(b"half a png")  # what a write cut short leaves
        raise OSError(code, os.strerror(code), str(fname))

    monkeypatch.setattr(Figure, "savefig", failing)
    code_, _, err = plot_attention(tiny_torch_run, plots, monkeypatch, capsys)
    assert code_ == 1
    one_error_line(err, f"error: {plots / '0001.png'}: {os.strerror(code)}")
    assert files_of(plots) == before and leftovers(plots) == []


# ----------------------------------------------------------------------------------------------
# 4. Readers beside a live run never fail because of rotation


@pytest.fixture(scope="module")
def run_3_4(tmp_path_factory):
    """A torch run keeping checkpoints 3 and 4."""
    run_dir = tmp_path_factory.mktemp("run-3-4") / "run"
    argv = ["--run-dir", run_dir, "--steps", "4", "--save-every", "1", "--keep-checkpoints", "2", *TINY]
    assert exit_code(train_run.main, argv) == 0
    return run_dir


def test_a_step_rotated_away_while_it_is_read_is_read_again_from_the_newest(run_3_4, tmp_path, monkeypatch, capfd):
    run_dir = Path(shutil.copytree(run_3_4, tmp_path / "run"))
    checkpoints = run_dir / "checkpoints"
    shutil.move(checkpoints / "4", tmp_path / "4")  # the reader lists [3]; the writer then saves 4 and drops 3
    real = store.verify_checkpoint

    def rotate_once(directory):
        if Path(directory).name == "3" and (checkpoints / "3").exists():
            shutil.move(tmp_path / "4", checkpoints / "4")
            shutil.rmtree(checkpoints / "3")
        return real(directory)

    monkeypatch.setattr(store, "verify_checkpoint", rotate_once)
    run = rundir.open_run(run_dir, "latest")
    run.backend.close()
    assert run.backend.step == 4
    assert "read step 4, the latest now" in capfd.readouterr().err
    shutil.copytree(checkpoints / "4", checkpoints / "3")
    monkeypatch.setattr(store, "verify_checkpoint", lambda d: shutil.rmtree(d) if Path(d).name == "3" else real(d))
    with pytest.raises(files.UserError, match="checkpoint 3 .* cannot be restored"):  # a step asked for by number
        rundir.open_run(run_dir, 3)


def newest_step(run_dir: Path) -> int:
    return max(map(int, filter(str.isdigit, os.listdir(run_dir / "checkpoints"))))


@pytest.mark.slow  # ~25 s: a real writer saving every step beside 50 reads
def test_fifty_reads_beside_a_writer_rotating_every_step_all_succeed(tmp_path, monkeypatch, capfd):
    run_dir = tmp_path / "run"
    assert exit_code(train_run.main, ["--run-dir", run_dir, "--steps", "1", *TINY]) == 0
    argv = ["--run-dir", run_dir, "--resume", "--steps", "100000", "--save-every", "1", "--keep-checkpoints", "1",
            "--eval-every", "100000", "--no-progress", "--threads", "1"]
    writer = subprocess.Popen([sys.executable, "-m", "train.run", *map(str, argv)], cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while writer.poll() is None and newest_step(run_dir) < 3:
            time.sleep(0.1)
        first, started = newest_step(run_dir), time.perf_counter()
        time.sleep(1)
        interval = (time.perf_counter() - started) / max(1, newest_step(run_dir) - first)  # between two saves
        real = store.verify_checkpoint

        def slow_read(directory):  # a read a third as long as a save: one in three meets a rotation
            time.sleep(interval / 3)
            return real(directory)

        monkeypatch.setattr(store, "verify_checkpoint", slow_read)
        steps = []
        for _ in range(50):
            run = rundir.open_run(run_dir, "latest")
            run.backend.close()
            steps.append(run.backend.step)
    finally:
        writer.terminate()
        writer.wait(timeout=120)
    assert len(steps) == 50 and steps == sorted(steps) and steps[-1] > steps[0] >= 3, steps
    assert capfd.readouterr().err.count("changed while reading") > 0  # rotations did happen mid-read


# ----------------------------------------------------------------------------------------------
# 6. A run's files are checked before use


def edit_json(path: Path, change) -> None:
    record = json.loads(path.read_text())
    change(record)
    path.write_text(json.dumps(record))


def test_an_edited_model_size_is_named_before_anything_is_allocated(run_copy, tmp_path, monkeypatch, capfd):
    monkeypatch.setattr(rundir, "create_backend", lambda *a, **k: pytest.fail("a model was built"))
    monkeypatch.setattr(loop, "create_backend", lambda *a, **k: pytest.fail("a model was built"))
    (tmp_path / "in.txt").write_text("siebenundzwanzig\n")
    huge = 2**20
    edit_json(run_copy / "model.json", lambda m: m.update(d_model=huge, d_ff=huge))
    for main, argv in [(translate.main, ["--run-dir", run_copy, "--input", tmp_path / "in.txt"]),
                       (evaluate.main, ["--run-dir", run_copy, "--data", "numbers:valid"])]:
        assert exit_code(main, argv) == 1
        one_error_line(capfd.readouterr().err, f"{run_copy / 'model.json'} says d_model={huge}, d_ff={huge} but "
                       f"{run_copy / 'config.json'} with the tokenizer gives d_model=64, d_ff=128")
    edit_json(run_copy / "config.json", lambda c: c["model"].update(d_model=huge, d_ff=huge))  # both edited alike
    assert exit_code(evaluate.main, ["--run-dir", run_copy, "--data", "numbers:valid"]) == 1
    one_error_line(capfd.readouterr().err, f"d_ff={huge} but the experiment saved in checkpoint 2 gives d_model=64")
    config = (run_copy / "config.json").read_text()
    assert exit_code(train_run.main, ["--run-dir", run_copy, "--resume", "--steps", "4", "--no-progress"]) == 1
    one_error_line(capfd.readouterr().err, f"{run_copy / 'config.json'} says d_model={huge}")
    assert (run_copy / "config.json").read_text() == config  # refused before the run directory is rewritten


def test_experiment_configs_of_saved_checkpoints_are_read_without_a_framework(tiny_torch_run):
    saved = store.saved_experiments(tiny_torch_run / "checkpoints")
    assert list(saved) == [2] and ExperimentConfig.from_dict(saved[2]).backend == "torch"
