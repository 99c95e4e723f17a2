"""Full disks, read-only places and missing permissions. Every write of a run (config, tokenizer,
checkpoint, TensorBoard, results.json, curves.png), of average, convert and export, of a weights
conversion and of attention plots ends in one `error:` line naming the path; the old file or
output stays whole, nothing half-written is left beside it, and a resume continues once there is
room. Full disks and read-only places are real: a small tmpfs, mounted where this process may (as
root; elsewhere those tests skip and say so), filled or made read-only at the moment of each
write; the same errors are also injected, as the OS, orbax, safetensors and matplotlib raise them,
in tests that run everywhere. The CLIs run in this process (`main`, what `python -m` calls; capfd
sees every thread's output too), and in a real process where the end of the process matters."""

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from parity.commands import convert
from train import checkpoints, data, loop, plots, rundir, runtime
from train.commands import average, translate
from train.commands import run as train_run

from .helpers import REPO, exit_code, files_of, one_error_line, run_files
from .helpers import TINY_ARGV as TINY


def leftovers(directory: Path) -> list[str]:
    """Temporary files and directories of a write that did not finish."""
    return sorted(p.name for p in directory.rglob("*") if p.name.endswith((".tmp", "-old")) or ".tmp-" in p.name
                  or "orbax-checkpoint-tmp" in p.name or p.name.startswith(".tmp"))


def test_a_write_that_dies_halfway_leaves_the_old_file(tmp_path, monkeypatch):
    """config.json, model.json, tokenizers, results.json and --output files go through
    write_text_atomic: a write that fails halfway (a crash, a full disk) leaves the old content."""
    target = tmp_path / "config.json"
    target.write_text('{"old": true}\n')
    real_open = open

    class HalfThenFail:  # the temporary file: half of the text written, then a full disk
        def __init__(self, *args):
            self.file = real_open(*args)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def write(self, data):
            self.file.write(data[: len(data) // 2])
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(runtime.files, "open", HalfThenFail, raising=False)
    with pytest.raises(OSError, match="No space left"):
        runtime.write_text_atomic(target, '{"new": true, "padding": "' + "x" * 1000 + '"}\n')
    monkeypatch.undo()
    assert json.loads(target.read_text()) == {"old": True}
    runtime.write_text_atomic(target, '{"new": true}\n')
    assert json.loads(target.read_text()) == {"new": True}
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]  # the failed write's temporary file is removed


# ----------------------------------------------------------------------------------------------
# A real full disk or read-only place


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
    "tokenizer": (data, "save_tokenizers", "tokenizer.json"),
    "checkpoint": (loop, "_save", "checkpoints/2"),
    "tensorboard": (loop, "summary_writer", "tensorboard"),
    "results.json": (loop, "write_json_atomic", "results.json"),
    "curves.png": (plots, "plot_curves", "curves.png"),
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
        assert checkpoints.verify_checkpoint(run_dir / "checkpoints" / "1")


def test_a_full_disk_ends_a_real_process_in_one_line_and_a_resume_continues(small_fs, tiny_torch_run):
    run_dir = Path(shutil.copytree(tiny_torch_run, small_fs.root / "run"))
    small_fs.fill(leave=200_000)  # room for the small files, none for a checkpoint
    argv = ["--run-dir", run_dir, "--resume", "--steps", "3", "--no-progress", "--threads", "1"]
    done = subprocess.run([sys.executable, "-m", "train.run", *map(str, argv)], cwd=REPO, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 1
    one_error_line(done.stderr, f"{run_dir / 'checkpoints' / '3'}: No space left on device")
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["2"] and leftovers(run_dir) == []
    assert checkpoints.verify_checkpoint(run_dir / "checkpoints" / "2")
    small_fs.free()
    assert exit_code(train_run.main, argv) == 0
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["2", "3"]


def test_orbax_on_a_full_disk_is_one_error_naming_the_checkpoint(small_fs, capfd):
    import jax

    from train.checkpoints.jax_store import JaxStore

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


# ~6 s each (three commands run twice); the error code changes only the message.
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
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["1"] and checkpoints.verify_checkpoint(run_dir / "checkpoints/1")


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EACCES])
def test_an_injected_write_error_leaves_the_old_file_and_no_temporary_one(tmp_path, monkeypatch, code):
    """Where no filesystem can be mounted: the same errors, raised by the one write the helper makes."""
    target = tmp_path / "results.json"
    target.write_text("old")

    def failing_open(path, flags, mode=0o777):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(runtime.files.os, "open", failing_open)
    with pytest.raises(OSError) as failed:
        runtime.write_text_atomic(target, "new")
    monkeypatch.undo()
    assert runtime.error_text(failed.value) == f"{target}: {os.strerror(code)}"
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["results.json"]


def test_a_library_error_repeating_a_full_disk_is_an_os_error_naming_the_path(tmp_path):
    """orbax (TensorStore's RESOURCE_EXHAUSTED, a ValueError) and safetensors say it in their own
    types; anything else is not a disk problem and stays what it is."""
    orbax = ValueError('RESOURCE_EXHAUSTED: Error writing "params.w/0" ... Failed to write 476660 bytes to file 21: '
                       "No space left on device [os_error_code='28']")
    safetensors = RuntimeError('Error while serializing: IoError(Os { code: 30, kind: ReadOnlyFilesystem, message: '
                               '"Read-only file system" })')
    assert runtime.error_text(runtime.write_error(orbax, tmp_path / "2")) == f"{tmp_path / '2'}: No space left on device"
    assert runtime.error_text(runtime.write_error(safetensors, "x")) == "x: Read-only file system"
    assert runtime.write_error(ValueError("shapes differ"), "x") is None


# ----------------------------------------------------------------------------------------------
# Weights conversions and attention plots


@pytest.fixture
def weights(tmp_path):
    """A tiny model's weights both ways: (model.safetensors, a JAX weights directory)."""
    import torch_reference
    from torch_reference.config import TransformerConfig
    from train.interop.runs import save_torch_weights

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
    """Where no filesystem can be mounted: a plot's file, written beside the older plot of the same name,
    fails as the OS would make it when swapped in; the older plot stays as it was."""
    plots = tmp_path / "plots"
    assert plot_attention(tiny_torch_run, plots, monkeypatch, capsys)[0] == 0
    before = files_of(plots)
    real_replace = os.replace

    def failing(src, dst, *args, **kwargs):
        if Path(dst).parent == plots:
            raise OSError(code, os.strerror(code), str(src))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", failing)
    code_, _, err = plot_attention(tiny_torch_run, plots, monkeypatch, capsys)
    assert code_ == 1
    one_error_line(err, f"error: {plots / '0001.png'}: {os.strerror(code)}")
    assert files_of(plots) == before and leftovers(plots) == []
