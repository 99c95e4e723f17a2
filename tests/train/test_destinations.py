"""Where the commands write. Destinations are checked before any work: an --output or --dst that
is a directory, is missing, is the source, lies inside it or holds it is refused in one line with
nothing written. --overwrite replaces only what this project wrote, of the same kind, atomically:
a `train.run --overwrite` that ends without a checkpoint puts the old run back, one that is
killed leaves the old run aside, whole and named. Nothing outside a run directory is written
through a symbolic link: a run's files, parts of it, a planted temporary name. The CLIs run in this
process (`main`, what `python -m` calls), and in a real process where a kill is the point."""

import errno
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import train
from parity.commands import convert
from torch_reference.config import TransformerConfig
from train import averaging, loop, rundir, runtime
from train.commands import average, evaluate, translate
from train.commands import run as train_run

from .helpers import REPO, _exit_status, exit_code, files_of, one_error_line, run_files
from .helpers import TINY_ARGV as TINY

# ----------------------------------------------------------------------------------------------
# Destinations checked before the work


def test_convert_never_overwrites_unasked_or_leaves_temporary_files(tmp_path, capsys):
    import torch_reference
    from parity.commands.convert import main as convert_main
    from train.interop.runs import save_torch_weights

    cfg = TransformerConfig.preset("tiny", src_vocab_size=64, tgt_vocab_size=64, num_encoder_layers=1,
                                   num_decoder_layers=1)
    weights = save_torch_weights(torch_reference.Transformer(cfg), tmp_path / "w" / "model.safetensors")
    assert convert_main(["--to", "jax", "--src", str(weights), "--dst", str(tmp_path / "jax")]) == 0
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text('{"mine": true}\n')
    assert convert_main(["--to", "torch", "--src", str(tmp_path / "jax"), "--dst", str(mine / "model.safetensors")]) == 0
    assert (mine / "config.json").read_text() == '{"mine": true}\n'  # an unrelated file is left alone
    capsys.readouterr()
    (tmp_path / "a_file").write_text("x")
    for argv, message in [
        (["--to", "jax", "--src", str(weights), "--dst", str(weights), "--overwrite"], "is the source"),
        (["--to", "torch", "--src", str(tmp_path / "jax"), "--dst", str(tmp_path / "jax"), "--overwrite"], "is the source"),
        (["--to", "torch", "--src", str(tmp_path / "jax"), "--dst", str(mine), "--overwrite"], "is a directory"),
        (["--to", "jax", "--src", str(weights), "--dst", str(tmp_path / "a_file"), "--overwrite"], "is a file"),
        (["--to", "jax", "--src", str(weights), "--dst", str(mine), "--overwrite"], "holds other files"),
    ]:
        before = files_of(tmp_path)
        code, err = _exit_status(convert_main, argv, capsys)
        assert code == 1
        one_error_line(err, message)
        assert files_of(tmp_path) == before  # nothing written, nothing left behind


def test_output_destinations_are_checked_before_the_work(torch_run, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(train.api, "load", lambda *a, **k: pytest.fail("the work started"))  # what the jobs call
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"eins\n")))
    for output, message in [(tmp_path, "is a directory"), (tmp_path / "absent" / "out.txt", "does not exist")]:
        for main, extra in [(translate.main, []), (evaluate.main, ["--data", "numbers:valid"])]:
            code, err = _exit_status(main, ["--run-dir", str(torch_run), "--output", str(output), *extra], capsys)
            assert code == 1
            one_error_line(err, "--output", message)
    assert not (tmp_path / "absent").exists()


@pytest.mark.parametrize("argv, message", [
    (["parity.commands.convert", "--to", "marian", "--src", "run", "--dst", "run"], "--dst run is the source"),
    (["parity.commands.convert", "--to", "ctranslate2", "--src", "run", "--dst", "run"], "--dst run is the source"),
    (["parity.commands.convert", "--to", "jax", "--run-dir", "run", "--dst", "run/checkpoints"],
     "is inside the source"),
    (["parity.commands.convert", "--to", "ctranslate2", "--src", "run", "--dst", "run/checkpoints/new"],
     "is inside the source"),
    (["parity.commands.convert", "--to", "jax", "--run-dir", "run", "--dst", "."], "holds the source"),
    (["train.commands.average", "--run-dir", "run", "--last", "1", "--dst", "run/checkpoints/2"],
     "is inside the source"),
    (["train.commands.average", "--run-dir", "run", "--last", "1", "--dst", "run"], "is the source"),
])
def test_a_destination_that_is_inside_or_holds_the_source_is_refused_before_any_work(
        run_copy, tmp_path, monkeypatch, capfd, argv, message):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(train.api, "create_backend", lambda *a, **k: pytest.fail("the work started"))
    monkeypatch.setattr(averaging, "create_backend", lambda *a, **k: pytest.fail("the work started"))
    before = files_of(tmp_path)
    main = {"parity.commands.convert": convert.main, "train.commands.average": average.main}[argv[0]]
    code = exit_code(main, [*argv[1:], "--overwrite"])
    assert code == 1
    one_error_line(capfd.readouterr().err, message)
    assert files_of(tmp_path) == before  # the source whole, nothing left beside it


def test_an_output_that_is_the_input_is_refused_and_the_input_kept(torch_run, tmp_path, capsys, monkeypatch):
    """Issue 58: `--input same.de --output same.de` replaced the input. By any name (relative, absolute,
    a symbolic or hard link, standard input redirected from it) an --output that is the input of
    translate, or a file of evaluate's --data (translate-bench's --json: its --input), is refused in one line
    before the work."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(train.api, "load", lambda *a, **k: pytest.fail("the work started"))  # what the jobs call
    same = tmp_path / "same.de"
    same.write_text("eins\nzwei\n")
    (tmp_path / "same.en").write_text("one\ntwo\n")
    (tmp_path / "pairs.tsv").write_text("source\ttarget\neins\tone\n")
    (tmp_path / "link.de").symlink_to(same)
    os.link(same, tmp_path / "hard.de")
    before = files_of(tmp_path)
    run = ["--run-dir", str(torch_run)]
    for output in ("same.de", "./same.de", str(same), "link.de", "hard.de"):
        code, err = _exit_status(translate.main, [*run, "--input", "same.de", "--output", output], capsys)
        assert code == 1
        one_error_line(err, f"--output {output} is the input same.de: writing it would destroy the input")
    with open(same, encoding="utf-8") as redirected:  # < same.de
        monkeypatch.setattr(sys, "stdin", redirected)
        code, err = _exit_status(translate.main, [*run, "--output", "hard.de"], capsys)
    assert code == 1
    one_error_line(err, "--output hard.de is the input standard input")
    for spec, output in (("de:en:same", "same.en"), ("de:en:same", "link.de"), ("pairs.tsv", "./pairs.tsv")):
        code, err = _exit_status(evaluate.main, [*run, "--data", spec, "--output", output], capsys)
        assert code == 1
        one_error_line(err, f"--output {output} is a file of the data {spec}: writing it would destroy the data")
    from parity import search_speed
    from parity.commands import translate_bench

    monkeypatch.setattr(search_speed, "load", lambda *a, **k: pytest.fail("the work started"))
    for output in ("same.de", "link.de", "hard.de"):  # translate-bench reads the input first, writes its JSON last
        code, err = _exit_status(translate_bench.main, [*run, "--input", "same.de", "--json", output], capsys)
        assert code == 1
        one_error_line(err, f"--json {output} is a file of --input same.de: writing it would destroy the data")
    assert files_of(tmp_path) == before and (tmp_path / "link.de").is_symlink()


def test_evaluate_writes_a_device_or_fifo_output_directly(torch_run, tmp_path, capsys, no_replacing_devices):
    """Issue 58: `evaluate --output /dev/null` renamed a file over /dev/null; a device or FIFO is now
    written directly, and a symbolic link's target atomically (the link kept)."""
    import stat
    import threading

    fifo, target, link = tmp_path / "out.fifo", tmp_path / "target.json", tmp_path / "link.json"
    os.mkfifo(fifo)
    link.symlink_to(target)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_text()), daemon=True)
    reader.start()
    run = ["--run-dir", str(torch_run), "--data", "numbers:valid", "--beam", "1", "--output"]
    for output in (os.devnull, fifo, link):
        assert evaluate.main([*run, str(output)]) == 0
        printed = capsys.readouterr().out
    reader.join(timeout=60)
    assert json.loads(received[0])["sentences"] == json.loads(target.read_text())["sentences"] == 4
    assert json.loads(printed) == json.loads(target.read_text()) and link.is_symlink()
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode) and stat.S_ISFIFO(os.lstat(fifo).st_mode)


@pytest.mark.parametrize("main, flags", [(average.main, ["--last", "1"]), (convert.main, ["--to", "jax"])])
def test_average_and_convert_refuse_the_source_by_any_name(run_copy, tmp_path, monkeypatch, capfd, main, flags):
    """Issue 58 (a confirmation): --dst naming --run-dir (relative, absolute, through a symbolic link)
    is refused before any work, the run whole."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(train.api, "create_backend", lambda *a, **k: pytest.fail("the work started"))
    monkeypatch.setattr(averaging, "create_backend", lambda *a, **k: pytest.fail("the work started"))
    (tmp_path / "link").symlink_to(run_copy)
    before = run_files(run_copy)
    for dst in ("./run", str(run_copy), "link", "../" + tmp_path.name + "/run"):
        assert exit_code(main, ["--run-dir", "run", *flags, "--dst", dst, "--overwrite"]) == 1
        one_error_line(capfd.readouterr().err, f"--dst {Path(dst)} is the source run")
    assert run_files(run_copy) == before and sorted(os.listdir(tmp_path)) == ["link", "run"]


# ----------------------------------------------------------------------------------------------
# --overwrite replaces only what this project wrote, of the same kind


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


def test_overwrite_replaces_its_own_kind_atomically(run_copy, tmp_path, capfd):
    pytest.importorskip("ctranslate2")
    ct2 = tmp_path / "ct2"
    assert exit_code(convert.main, ["--to", "ctranslate2", "--src", run_copy, "--dst", ct2]) == 0
    assert json.loads((ct2 / runtime.KIND_FILE).read_text()) == {"kind": "ctranslate2"}
    (ct2 / "model.bin").write_bytes(b"stale")
    assert exit_code(convert.main, ["--to", "ctranslate2", "--src", run_copy, "--dst", ct2, "--overwrite"]) == 0
    assert (ct2 / "model.bin").read_bytes() != b"stale"
    averaged = tmp_path / "averaged"
    for _ in range(2):  # a run over a run
        assert exit_code(average.main, ["--run-dir", run_copy, "--last", "1", "--dst", averaged, "--overwrite"]) == 0
    assert runtime.kind_of(averaged) == "run" and runtime.kind_of(ct2) == "ctranslate2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["averaged", "ct2", "run"]  # nothing left beside them
    link = tmp_path / "link"
    link.symlink_to(averaged)
    assert exit_code(average.main, ["--run-dir", run_copy, "--last", "1", "--dst", link, "--overwrite"]) == 1
    one_error_line(capfd.readouterr().err, f"{link} is a symbolic link; it is never replaced")


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
    one_error_line(capfd.readouterr().err, f"{aside} holds the run an earlier overwrite of {run_copy} set aside",
                   "move it back")
    assert files_of(tmp_path) == before


def test_an_old_run_left_aside_is_named_by_every_command_that_opens_the_run(run_copy, tmp_path, capfd, monkeypatch):
    """Issue 58: after a killed --overwrite, `.RUN.run-old` beside RUN: translate, evaluate, --resume,
    --overwrite, average, aiayn convert and train.load each refuse in one line naming it and what to do; while a
    live --overwrite holds RUN's lock, they say to wait for it."""
    aside = rundir.set_aside_path(run_copy)
    shutil.copytree(run_copy, aside)
    before = files_of(tmp_path)
    message = (f"{aside} holds the run an earlier overwrite of {run_copy} set aside and was stopped before it could "
               f"put back or delete it: move it back to {run_copy}, or delete it, first")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"eins\n")))
    commands = [
        (translate.main, ["--run-dir", run_copy]),
        (evaluate.main, ["--run-dir", run_copy, "--data", "numbers:valid"]),
        (train_run.main, ["--run-dir", run_copy, "--resume", "--steps", "3", "--no-progress"]),
        (train_run.main, ["--run-dir", run_copy, "--overwrite", *NEW]),
        (average.main, ["--run-dir", run_copy, "--last", "1", "--dst", tmp_path / "averaged"]),
        (convert.main, ["--to", "jax", "--run-dir", run_copy, "--dst", tmp_path / "converted"]),
    ]
    for main, argv in commands:
        assert exit_code(main, argv) == 1
        one_error_line(capfd.readouterr().err, message)
    with pytest.raises(runtime.UserError) as refused:
        train.load(run_copy)
    assert str(refused.value) == message
    assert files_of(tmp_path) == before
    with runtime.RunLock(run_copy):  # as the --overwrite that set it aside holds it while it trains
        assert exit_code(translate.main, ["--run-dir", run_copy]) == 1
    one_error_line(capfd.readouterr().err, f"{run_copy} is being replaced by a running overwrite, the old run kept "
                   f"in {aside} meanwhile: wait for it to end")


def test_train_overwrite_says_where_the_old_run_is_kept(run_copy, capfd):
    """Issue 58 (a confirmation): `train.run --overwrite` of a run prints where the old run is kept."""
    assert exit_code(train_run.main, ["--run-dir", run_copy, "--overwrite", *NEW]) == 0
    assert (f"overwrite: the run in {run_copy} is kept in {rundir.set_aside_path(run_copy)} until this one holds a "
            "checkpoint, then deleted") in capfd.readouterr().out.splitlines()
    assert not rundir.set_aside_path(run_copy).exists()


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
# Nothing outside the run directory is written


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
    (run_dir / runtime.LOCK_FILE).unlink(missing_ok=True)
    (run_dir / runtime.LOCK_FILE).symlink_to(victims / "lock")  # what issue 42 found written with "pid N"
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
    assert not (run_copy / runtime.LOCK_FILE).is_symlink() and not (run_copy / runtime.CURVES_FILE).is_symlink()


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
    runtime.write_text_atomic(tmp_path / "out.json", "new")
    assert victim.read_text() == "victim" and (tmp_path / "out.json").read_text() == "new"
    assert not (tmp_path / "out.json").is_symlink() and not (tmp_path / ".out.json.tmp").exists()
