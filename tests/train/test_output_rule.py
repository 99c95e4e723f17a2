"""One rule for every file a command writes (docs/operations.md#output-files), issue 71 cases 1, 2
and 5: no output inside a run (the one read, or any other), streams written directly, links
followed, a directory refused by name, nothing half-written, a command's own side files never an
input, and what a failed --overwrite, aiayn score and typed special tokens must not lose."""

import os
import threading
from pathlib import Path

import pytest

import train
from parity.commands import check as parity_check
from parity.commands import convert, trajectory, translate_bench
from train.commands import average, bench, curves, evaluate, profile_step, score, translate
from train.commands import run as train_run
from train.runtime.destination import Destination

from .helpers import TINY_ARGV, _exit_status, files_of, one_error_line, run_files


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """An input file of two sentences and a TSV of two pairs, outside any run."""
    where = tmp_path_factory.mktemp("data")
    (where / "in.de").write_text("eins\nzwei\n")
    (where / "pairs.tsv").write_text("source\ttarget\neins\tone\nzwei\ttwo\n")
    return where


# Each writing command's output flag, as (main, argv before the output, the flag); RUN is the run it reads.
def _commands(run: Path, data: Path) -> dict:
    return {
        "translate --output": (translate.main, ["--run-dir", run, "--input", data / "in.de"], "--output"),
        "translate --plot-attention": (translate.main, ["--run-dir", run, "--input", data / "in.de"],
                                       "--plot-attention"),
        "score --output": (score.main, ["--run-dir", run, "--input", data / "pairs.tsv"], "--output"),
        "evaluate --output": (evaluate.main, ["--run-dir", run, "--data", data / "pairs.tsv"], "--output"),
        "curves --out": (curves.main, ["--run-dir", run], "--out"),
        "average --dst": (average.main, ["--run-dir", run, "--last", "1"], "--dst"),
        "convert --dst": (convert.main, ["--to", "jax", "--run-dir", run], "--dst"),
        "run --run-dir": (train_run.main, [*TINY_ARGV, "--steps", "1"], "--run-dir"),
        "bench --json": (bench.main, ["--presets", "tiny"], "--json"),
        "bench --plot": (bench.main, ["--presets", "tiny"], "--plot"),
        "profile_step --json": (profile_step.main, ["--preset", "tiny"], "--json"),
        "aiayn check --json": (parity_check.main, ["--preset", "tiny"], "--json"),
        "aiayn trajectory --json": (trajectory.main, ["--preset", "tiny"], "--json"),
        "aiayn trajectory --plot": (trajectory.main, ["--preset", "tiny"], "--plot"),
        "aiayn translate-bench --json": (translate_bench.main, ["--run-dir", run, "--input", data / "in.de"],
                                          "--json"),
    }


COMMANDS = list(_commands(Path(), Path()))
PARSED = {"bench --json", "bench --plot", "profile_step --json", "aiayn check --json", "aiayn trajectory --json",
          "aiayn trajectory --plot", "aiayn translate-bench --json"}  # refused by argparse: usage, then the line


def _refused(main, argv, capsys, command, *fragments):
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exited:
        code = exited.code
    err = capsys.readouterr().err
    if command in PARSED:
        assert code == 2 and any(f in err for f in fragments), err
    else:
        assert code == 1
        line = one_error_line(err)
        assert any(f in line for f in fragments), line


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("where", ["the run read", "another run"])
def test_no_command_writes_inside_a_run(command, where, tiny_torch_and_jax_runs, data, capsys):
    torch_run, jax_run = tiny_torch_and_jax_runs
    read, other = torch_run, jax_run
    main, argv, flag = _commands(read, data)[command]
    inside = (read if where == "the run read" else other) / "checkpoints" / "2" / "x.json"
    if command in ("average --dst", "convert --dst", "run --run-dir", "translate --plot-attention"):
        inside = inside.parent / "new"
    before = run_files(torch_run), run_files(jax_run)
    _refused(main, [*argv, flag, inside], capsys, command, "lies inside the run", "is inside the source")
    assert (run_files(torch_run), run_files(jax_run)) == before


@pytest.mark.parametrize("command", [c for c in COMMANDS if c not in (
    "average --dst", "convert --dst", "run --run-dir", "translate --plot-attention")])
def test_a_directory_is_refused_by_name(command, tiny_torch_run, data, tmp_path, capsys):
    main, argv, flag = _commands(tiny_torch_run, data)[command]
    _refused(main, [*argv, flag, tmp_path], capsys, command, "is a directory")
    assert not any(tmp_path.iterdir())


def _reading(fifo: Path) -> tuple[threading.Thread, list[bytes]]:
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    return reader, got


@pytest.mark.parametrize("kind", ["fifo", "device", "link", "dangling link"])
def test_every_kind_of_destination_one_way(kind, tmp_path):
    """The function every command opens its output with (the matrix above shows each calls it)."""
    target, path = tmp_path / "target.json", tmp_path / "out.json"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        path = Path(os.devnull)
    else:
        if kind == "link":
            target.write_text("old\n")
        path.symlink_to(target)
    out = Destination(path, "--json")
    reader, got = _reading(path) if kind == "fifo" else (None, [])
    out.update("partial\n")  # an intermediate output goes to a regular file only: a stream is written once
    with out.writing() as image:
        image.write_text("whole\n")
    if kind == "fifo":
        reader.join(10)
        assert got == [b"whole\n"] and path.is_fifo()
    elif kind == "device":
        assert path.is_char_device()
    else:  # followed, as the shell's > follows it: the link stays, its target holds the output
        assert path.is_symlink() and target.read_text() == "whole\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({"out.json", "target.json"} & {
        p.name for p in tmp_path.iterdir()})  # no temporary left


def test_a_failed_write_leaves_the_old_file_whole(tmp_path):
    path = tmp_path / "out.png"
    path.write_text("old")
    with pytest.raises(RuntimeError), Destination(path, "--plot").writing() as image:
        image.write_text("half")
        raise RuntimeError("the plot failed")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["out.png"]


@pytest.mark.parametrize("command", ["evaluate --output", "score --output", "translate --output"])
def test_commands_stream_into_a_fifo_and_follow_a_link(command, tiny_torch_run, data, tmp_path, capsys):
    main, argv, flag = _commands(tiny_torch_run, data)[command]
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader, got = _reading(fifo)
    assert main([str(a) for a in [*argv, flag, fifo]]) == 0
    reader.join(30)
    assert fifo.is_fifo() and got and got[0]
    link, target = tmp_path / "link", tmp_path / "target"
    link.symlink_to(target)
    assert main([str(a) for a in [*argv, flag, link]]) == 0
    assert link.is_symlink() and target.read_bytes() == got[0]
    capsys.readouterr()


def test_an_input_that_is_a_side_file_of_the_output_is_refused(tiny_torch_run, tmp_path, capsys):
    partial = tmp_path / ".out.txt.partial"
    partial.write_text("eins\n")
    code, err = _exit_status(translate.main, ["--run-dir", str(tiny_torch_run), "--input", str(partial),
                                              "--output", str(tmp_path / "out.txt")], capsys)
    assert code == 1 and partial.read_text() == "eins\n"
    one_error_line(err, "is the input")
    plots = tmp_path / "plots"
    plots.mkdir()
    (plots / "0001.png").write_text("eins\n")
    code, err = _exit_status(translate.main, ["--run-dir", str(tiny_torch_run), "--input", str(plots / "0001.png"),
                                              "--plot-attention", str(plots)], capsys)
    assert code == 1 and (plots / "0001.png").read_text() == "eins\n"
    one_error_line(err, "holds the input")


@pytest.mark.parametrize("spelling", ["R/checkpoints/..", ".. from R/checkpoints"])
def test_a_failed_overwrite_by_any_spelling_leaves_the_old_run_whole(spelling, run_copy, tmp_path, monkeypatch,
                                                                     capfd):
    before = files_of(run_copy)
    if spelling.startswith(".."):
        monkeypatch.chdir(run_copy / "checkpoints")
        run_dir = ".."
    else:
        run_dir = str(run_copy / "checkpoints" / "..")
    bad = tmp_path / "bad.tsv"
    bad.write_text("source\ttarget\n")  # no pair: the new run fails after the old one is set aside
    code = train_run.main([*TINY_ARGV, "--run-dir", run_dir, "--overwrite", "--steps", "1", "--train", str(bad),
                            "--valid", str(bad)])
    assert code == 1
    assert {k: v for k, v in files_of(run_copy).items() if not k.endswith(".lock")} == {
        k: v for k, v in before.items() if not k.endswith(".lock")}
    assert not (tmp_path / ".run.run-old").exists() and not list((run_copy / "checkpoints").glob(".*run-old"))


def test_score_gives_every_pair_its_line_or_refuses(tiny_torch_run, tmp_path, capsys):
    pairs = tmp_path / "pairs.tsv"
    pairs.write_text("source\ttarget\neins\tone\n\ttwo\ndrei\tthree\n")
    code, err = _exit_status(score.main, ["--run-dir", str(tiny_torch_run), "--input", str(pairs)], capsys)
    assert code == 1
    one_error_line(err, "1 pairs with an empty side")


def test_typed_special_tokens_are_text(tiny_torch_run):
    run = train.load(tiny_torch_run)
    ids = train.data.encode(run.tokenizers.src, ["x <eos> y", "eins <pad> zwei <bos> <unk>"])
    assert all(i not in (0, 1, 3) for row in ids for i in row)  # no control id from typed text
    assert [row.count(2) for row in ids] == [1, 1] and all(row[-1] == 2 for row in ids)  # <eos> only at the end
    assert train.data.decode(run.tokenizers.src, ids[0]) == "x <eos> y"
