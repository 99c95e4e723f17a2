"""`aiayn translate` streams: chunks in input order, bounded memory, an interrupted
--output resumed, progress and summary, any readable stream as input, every device, the
compilation cache.

Most tests run `translate.main` in-process on the session's 2-step torch run (`tiny_torch_run`);
the interruption, process substitution and the JAX ones run real processes. The 8-device check
runs in a subprocess with `XLA_FLAGS=--xla_force_host_platform_device_count=8` set before jax is
imported; this file is also that worker (`python tests/train/test_translate_stream.py RUN OUT`).
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # when run as the worker script
    sys.path.insert(0, str(REPO))

from train import api, data, translation  # noqa: E402
from train.backends import host_devices, jax_cache  # noqa: E402
from train.commands import translate  # noqa: E402
from train.translate import jobs  # noqa: E402
from train.translate import output as run_output  # noqa: E402

# Numbers of varied lengths (1 to 6 words), an empty and a whitespace-only line among them.
LINES = [data.number_words(n)[0] for n in (7, 43, 512, 999_999, 21, 3_004, 80_000, 16, 123_456, 5)]
LINES[3:3] = ["", "  "]


def write_lines(path: Path, lines) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def run_main(capsys, *args: str, stdin: bytes | None = None, monkeypatch=None) -> tuple[int, str, str]:
    from .cli import run_cli  # here: this file also runs as a worker script, outside the package

    return run_cli(translate.main, capsys, *args, stdin=stdin, monkeypatch=monkeypatch)


def one_error(code: int, err: str, *fragments: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1 and lines[0].startswith("error: "), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, err)


@pytest.fixture(scope="module")
def reference(tiny_torch_run, tmp_path_factory):
    """LINES translated in one go (`translate_texts`, no streaming), beam 4: the expected output."""
    from train import load as open_run

    run = open_run(tiny_torch_run, "best")
    try:
        return translation.translate_texts(run.backend, run.tokenizers, LINES, max_len=run.config.max_len,
                                         token_budget=run.config.token_budget)
    finally:
        run.backend.close()


# ----------------------------------------------------------------------------------------------
# Streaming


def test_chunks_smaller_than_the_input_keep_its_order_and_never_hold_more(tiny_torch_run, reference, tmp_path,
                                                                          capsys, monkeypatch):
    readers, calls = [], []

    class Recorded(jobs.LineReader):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            readers.append(self)

    real = translation.translate_texts

    def spy(backend, tokenizers, texts, **kwargs):
        calls.append((len(texts), readers[0].lines))  # lines read from the input so far
        return real(backend, tokenizers, texts, **kwargs)

    monkeypatch.setattr(jobs, "LineReader", Recorded)
    monkeypatch.setattr(translation, "translate_texts", spy)
    source = write_lines(tmp_path / "in.txt", LINES)
    code, out, err = run_main(capsys, "--run-dir", str(tiny_torch_run), "--input", str(source), "--chunk-lines", "5")
    assert code == 0, err
    assert out.splitlines() == reference and out.count("\n") == len(LINES) == 12
    # Three chunks of at most 5 lines; when chunk k is translated exactly its lines and those
    # before it have been read: the input is never read ahead, let alone whole.
    assert calls == [(5, 5), (5, 10), (2, 12)]


def test_output_file_and_summary(tiny_torch_run, reference, tmp_path, capsys):
    source, output = write_lines(tmp_path / "in.txt", LINES), tmp_path / "out.txt"
    code, out, err = run_main(capsys, "--run-dir", str(tiny_torch_run), "--input", str(source), "--output",
                              str(output), "--chunk-lines", "4", "--beam", "4")
    assert code == 0 and out == "", err
    assert output.read_text(encoding="utf-8").splitlines() == reference
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out.txt"]  # no partial file left
    # Not a terminal: no progress line, only the summary.
    assert "\r" not in err and len(err.splitlines()) == 1
    assert err.startswith(f"translated {len(LINES)} lines in ") and "lines/s" in err and "target tokens/s" in err


def test_progress_on_a_terminal_and_no_progress(tiny_torch_run, tmp_path, capsys, monkeypatch):
    source = write_lines(tmp_path / "in.txt", LINES)
    monkeypatch.setattr(run_output.Progress, "INTERVAL", 0.0)  # a line after every batch
    for flags, shown in (([], True), (["--no-progress"], False)):
        terminal = Terminal()
        monkeypatch.setattr(sys, "stderr", terminal)
        code, out, _ = run_main(capsys, "--run-dir", str(tiny_torch_run), "--input", str(source), "--chunk-lines", "3",
                                "--beam", "1", *flags)
        err = terminal.getvalue()
        assert code == 0 and len(out.splitlines()) == len(LINES)
        parts = [part.replace("\x1b[K", "") for part in err.split("\r")]  # \x1b[K: clear to the line's end
        updates = [part for part in parts if "lines/s" in part and not part.startswith("translated")]
        assert bool(updates) is shown, err
        for update in updates:  # a regular file: how much is read and an ETA
            assert "target tokens/s" in update and "% read, ETA " in update
        assert parts[-1].startswith(f"translated {len(LINES)} lines in "), err


def test_cut_lines_are_counted(tiny_torch_run, capsys, monkeypatch):
    long = " ".join(data.number_words(n)[0] for n in range(900_001, 900_011))  # 41 tokens: over max_len=16
    code, out, err = run_main(capsys, "--run-dir", str(tiny_torch_run), "--beam", "1",
                              stdin=f"{long}\nsieben\n{long}\n".encode(), monkeypatch=monkeypatch)
    assert code == 0 and len(out.splitlines()) == 3, err
    assert "; 2 cut to the model's 16 tokens" in err.splitlines()[-1]


# ----------------------------------------------------------------------------------------------
# Interrupted and continued (real processes)


def _process(args, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "train.commands.translate", *args], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)


def test_sigterm_keeps_finished_chunks_and_the_same_command_continues(tiny_torch_run, reference, tmp_path):
    fifo, output = tmp_path / "in.fifo", tmp_path / "out.txt"
    os.mkfifo(fifo)
    output.write_text("the old output\n")
    record = tmp_path / ".out.txt.partial.json"
    command = ["--run-dir", str(tiny_torch_run), "--input", str(fifo), "--output", str(output), "--chunk-lines", "4"]

    first = _process(command)
    with open(fifo, "w", encoding="utf-8") as writer:  # opens once the process reads
        writer.write("".join(line + "\n" for line in LINES[:6]))  # one chunk and a half, then no more input yet
        writer.flush()
        deadline = time.monotonic() + 120
        while not record.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert record.exists(), "the first chunk was never recorded"
        first.send_signal(signal.SIGTERM)  # while it waits for more input
        _, err = first.communicate(timeout=60)
    assert first.returncode == 128 + signal.SIGTERM, err
    assert output.read_text() == "the old output\n"  # untouched
    assert json.loads(record.read_text())["lines"] == 4
    assert (tmp_path / ".out.txt.partial").read_text(encoding="utf-8").splitlines() == reference[:4]
    assert err.strip().splitlines()[-1] == (
        f"interrupted (SIGTERM) after 4 input lines; the translations of lines 1-4 are kept in "
        f"{tmp_path / '.out.txt.partial'}: the same command continues after them"
    )

    again = _process(command)
    with open(fifo, "w", encoding="utf-8") as writer:
        writer.write("".join(line + "\n" for line in LINES))
    _, err = again.communicate(timeout=120)
    assert again.returncode == 0, err
    assert output.read_text(encoding="utf-8").splitlines() == reference  # as if never interrupted
    assert err.strip().splitlines()[-1].endswith("; continued after line 4")
    assert "translated 8 lines" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.fifo", "out.txt"]


def test_a_partial_output_of_other_settings_is_discarded_and_of_other_input_refused(tiny_torch_run, reference,
                                                                                   tmp_path, capsys):
    source, output = write_lines(tmp_path / "in.txt", LINES), tmp_path / "out.txt"
    partial, record = tmp_path / ".out.txt.partial", tmp_path / ".out.txt.partial.json"
    args = ["--run-dir", str(tiny_torch_run), "--input", str(source), "--output", str(output), "--chunk-lines", "4"]
    run_output.PartialOutput(output, {"beam": 1}).write(["x"] * 4, "a digest")  # as a run with other settings leaves it
    code, _, err = run_main(capsys, *args)
    assert code == 0 and err.splitlines()[0] == (f"note: {partial} was translated with other settings (run_dir, step, "
                                                 "weights, beam, alpha, scoring); starting afresh")
    assert output.read_text(encoding="utf-8").splitlines() == reference
    assert not partial.exists() and not record.exists()
    # The same settings over other input lines: refused, the partial output kept.
    settings = {"run_dir": str(tiny_torch_run.absolute()), "step": 2, "beam": 4, "alpha": 0.6, "scoring": "gnmt",
                "weights": api.weights_digest(tiny_torch_run, 2)}
    run_output.PartialOutput(output, settings).write(["x"] * 4, "0" * 64)
    code, _, err = run_main(capsys, *args)
    one_error(code, err, f"{partial} holds the translations of other input (its first 4 lines differ from these): "
              "delete it to start afresh")
    assert partial.read_text() == "x\n" * 4


def test_process_substitution_and_dev_stdin(tiny_torch_run, reference, tmp_path):
    source = write_lines(tmp_path / "in.txt", LINES)
    for command in (f"--input <(cat {source})", f"--input /dev/stdin < {source}"):
        result = subprocess.run(
            ["bash", "-c",
             f"{sys.executable} -m train.commands.translate --run-dir {tiny_torch_run} --no-progress {command}"],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120,
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines() == reference


# ----------------------------------------------------------------------------------------------
# Where --output writes: streams, links, one writer, the weights of a partial output (issue 58)


def test_an_output_that_is_not_a_regular_file_is_written_directly(tiny_torch_run, reference, tmp_path, capsys,
                                                                   monkeypatch, no_replacing_devices):
    """A FIFO, /dev/fd/N (`>(cmd)`), a socket and /dev/null are written as streams (no partial file,
    nothing renamed over them); a symbolic link's target is written atomically and the link kept."""
    import socket
    import stat

    monkeypatch.chdir(tmp_path)  # a short socket path
    source = write_lines(tmp_path / "in.txt", LINES)
    run = ["--run-dir", str(tiny_torch_run), "--input", str(source), "--chunk-lines", "5", "--output"]
    os.mkfifo("out.fifo")
    server = socket.socket(socket.AF_UNIX)
    server.bind("out.sock")
    server.listen(1)
    server.settimeout(60)
    received = {}

    def read_fifo():
        with open("out.fifo", encoding="utf-8") as fifo:
            received["fifo"] = fifo.read()

    def read_socket():
        connection, _ = server.accept()
        with connection:
            received["socket"] = b"".join(iter(lambda: connection.recv(1 << 16), b"")).decode()

    for name, reader in (("out.fifo", read_fifo), ("out.sock", read_socket)):
        thread = threading.Thread(target=reader, daemon=True)
        thread.start()
        code, out, err = run_main(capsys, *run, name)
        thread.join(timeout=60)
        assert code == 0 and out == "", err
    assert received["fifo"].splitlines() == received["socket"].splitlines() == reference
    assert stat.S_ISFIFO(os.lstat("out.fifo").st_mode) and stat.S_ISSOCK(os.lstat("out.sock").st_mode)
    read_end, write_end = os.pipe()  # what bash's >(cmd) hands over as /dev/fd/N
    code, _, err = run_main(capsys, *run, f"/dev/fd/{write_end}")
    os.close(write_end)
    with os.fdopen(read_end, encoding="utf-8") as pipe:
        assert code == 0 and pipe.read().splitlines() == reference, err
    try:
        code, _, err = run_main(capsys, *run, os.devnull)
        assert code == 0 and err.startswith(f"translated {len(LINES)} lines"), err
    finally:
        leftovers = [p for p in (Path(os.devnull).with_name(".null.partial"), Path(os.devnull).with_name(
            ".null.partial.json")) if p.exists()]  # what the path of a file (the old code) leaves in /dev
        for leftover in leftovers:
            leftover.unlink()
        assert stat.S_ISCHR(os.stat(os.devnull).st_mode) and not leftovers
    target = tmp_path / "target.txt"
    target.write_text("old\n")
    Path("link.txt").symlink_to(target)
    code, _, err = run_main(capsys, *run, "link.txt")
    assert code == 0, err
    assert Path("link.txt").is_symlink() and target.read_text(encoding="utf-8").splitlines() == reference
    assert sorted(os.listdir(tmp_path)) == ["in.txt", "link.txt", "out.fifo", "out.sock", "target.txt"]
    assert "A FIFO, device, socket or /dev/fd/N (>(command)) is written directly, as a stream: no partial file, " \
           "no resume" in " ".join(translate.build_parser().format_help().split())


def _other_weights(checkpoint: Path) -> None:
    """Checkpoint `checkpoint`'s weights replaced by others (its digest rewritten): the same run, step
    and settings, another model."""
    import numpy as np
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    from train.checkpoints import write_checkpoint_digest

    weights = checkpoint / "model.safetensors"
    with safe_open(str(weights), "np") as f:
        metadata = f.metadata()
    rng = np.random.default_rng(0)
    params = {k: (v + rng.normal(0, 1, v.shape)).astype(v.dtype) for k, v in load_file(str(weights)).items()}
    save_file(params, str(weights), metadata=metadata)
    write_checkpoint_digest(checkpoint)


def test_a_partial_output_of_other_weights_is_started_afresh(run_copy, tmp_path, capsys, monkeypatch):
    """A translation stopped after its first chunk, the run's checkpoint replaced by other weights,
    the same command again: it starts afresh (said in one line), never stitches two models' lines."""
    source, output = write_lines(tmp_path / "in.txt", LINES), tmp_path / "out.txt"
    args = ["--run-dir", str(run_copy), "--input", str(source), "--output", str(output), "--chunk-lines", "4"]
    real_write = run_output.PartialOutput.write

    def write_then_stop(self, texts, digest):  # as SIGTERM after the first chunk leaves it
        real_write(self, texts, digest)
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(run_output.PartialOutput, "write", write_then_stop)
        code, _, err = run_main(capsys, *args)
    assert code == 130 and "are kept in" in err, err
    first = (tmp_path / ".out.txt.partial").read_text(encoding="utf-8").splitlines()
    _other_weights(run_copy / "checkpoints" / "2")
    code, expected, err = run_main(capsys, "--run-dir", str(run_copy), "--input", str(source))
    assert code == 0 and expected.splitlines()[:4] != first, err  # the other model translates otherwise
    code, _, err = run_main(capsys, *args)
    assert code == 0 and err.splitlines()[0] == (f"note: {tmp_path / '.out.txt.partial'} was translated with other "
                                                 "settings (weights); starting afresh"), err
    assert output.read_text(encoding="utf-8") == expected and "continued after" not in err
    digest = api.weights_digest(run_copy, 2)  # the key: the checkpoint's digest and the tokenizer's
    _other_weights(run_copy / "checkpoints" / "2")
    assert api.weights_digest(run_copy, 2) != digest
    digest, tokenizer = api.weights_digest(run_copy, 2), run_copy / "tokenizer.json"
    tokenizer.write_text(json.dumps(json.loads(tokenizer.read_text(encoding="utf-8"))), encoding="utf-8")
    assert api.weights_digest(run_copy, 2) != digest  # the same vocabulary, other bytes


def test_a_second_translation_into_one_output_is_refused(tiny_torch_run, tmp_path, capsys):
    """While one translation holds --output OUT (its flock on .OUT.partial), a second is refused in one
    line and changes nothing; once it ends, OUT is free again."""
    source, output = write_lines(tmp_path / "in.txt", LINES), tmp_path / "out.txt"
    args = ["--run-dir", str(tiny_torch_run), "--input", str(source), "--output", str(output)]
    first = run_output.PartialOutput(output, {"run_dir": "another"})
    first.write(["x"], "0" * 64)
    code, _, err = run_main(capsys, *args)
    one_error(code, err, f"{output} is being written by another translation (it holds {tmp_path / '.out.txt.partial'})")
    assert not output.exists() and (tmp_path / ".out.txt.partial").read_text() == "x\n"
    first.finish()
    assert output.read_text() == "x\n"
    code, _, err = run_main(capsys, *args)
    assert code == 0 and output.read_text(encoding="utf-8").count("\n") == len(LINES), err
    assert sorted(os.listdir(tmp_path)) == ["in.txt", "out.txt"]


# ----------------------------------------------------------------------------------------------
# Input that cannot be read


def test_a_fifo_is_input(tiny_torch_run, reference, tmp_path, capsys):
    fifo = tmp_path / "in.fifo"
    os.mkfifo(fifo)

    def feed():
        with open(fifo, "w", encoding="utf-8") as writer:
            for line in LINES:  # line by line: the reader sees a stream, not a file
                writer.write(line + "\n")
                writer.flush()

    feeder = threading.Thread(target=feed)
    feeder.start()
    code, out, err = run_main(capsys, "--run-dir", str(tiny_torch_run), "--input", str(fifo), "--chunk-lines", "5")
    feeder.join(timeout=60)
    assert code == 0, err
    assert out.splitlines() == reference


def test_unreadable_inputs_end_in_one_error_line(tiny_torch_run, tmp_path, capsys, monkeypatch):
    run = ["--run-dir", str(tiny_torch_run)]
    code, _, err = run_main(capsys, *run, "--input", str(tmp_path))
    one_error(code, err, f"--input {tmp_path} is a directory")
    code, _, err = run_main(capsys, *run, "--input", str(tmp_path / "absent.txt"))
    one_error(code, err, f"no such file: {tmp_path / 'absent.txt'}")
    code, _, err = run_main(capsys, *run, "--input", "/dev/zero")  # an endless line of NUL bytes
    one_error(code, err, "/dev/zero: line 1 is longer than 1,048,576 bytes (--max-line-bytes)")
    bad_gz = tmp_path / "in.txt.gz"
    bad_gz.write_bytes(b"not gzip at all\n")
    code, _, err = run_main(capsys, *run, "--input", str(bad_gz))
    one_error(code, err, f"cannot read {bad_gz}", "Not a gzipped file")
    if os.geteuid() != 0:  # root reads any file
        locked = write_lines(tmp_path / "locked.txt", ["eins"])
        locked.chmod(0)
        code, _, err = run_main(capsys, *run, "--input", str(locked))
        one_error(code, err, f"cannot read {locked}: Permission denied")


def test_training_data_that_is_a_directory_or_a_fifo_is_named_as_such(tmp_path):
    (tmp_path / "d.de").mkdir()
    (tmp_path / "d.en").write_text("one\n")
    os.mkfifo(tmp_path / "f.de")
    (tmp_path / "f.en").write_text("one\n")
    with pytest.raises(ValueError, match=f"^{tmp_path / 'd.de'} is a directory, not a data file$"):
        data.load_parallel(f"de:en:{tmp_path}/d")
    with pytest.raises(ValueError, match="f.de is not a regular file"):  # never opened: it would block
        data.load_parallel(f"de:en:{tmp_path}/f")


def test_an_over_long_line_is_refused_with_its_number(tiny_torch_run, tmp_path, capsys, monkeypatch):
    output = tmp_path / "out.txt"
    lines = ["eins"] * 5 + ["x" * 40] + ["zwei"]
    code, _, err = run_main(capsys, "--run-dir", str(tiny_torch_run), "--max-line-bytes", "40", "--output",
                            str(output), "--chunk-lines", "2", stdin="".join(f"{x}\n" for x in lines).encode(),
                            monkeypatch=monkeypatch)
    assert code == 0, err  # 40 bytes is the limit itself
    lines[5] += "x"
    code, _, err = run_main(capsys, "--run-dir", str(tiny_torch_run), "--max-line-bytes", "40", "--output",
                            str(output), "--chunk-lines", "2", stdin="".join(f"{x}\n" for x in lines).encode(),
                            monkeypatch=monkeypatch)
    # Found in the third chunk: the two before it are kept for a continuation.
    one_error(code, err, "standard input: line 6 is longer than 40 bytes (--max-line-bytes)",
              "the translations of lines 1-4 are kept")
    assert output.read_text().count("\n") == 7  # the earlier, finished output is untouched


def test_torch_refuses_devices(tiny_torch_run, capsys, monkeypatch):
    code, _, err = run_main(capsys, "--run-dir", str(tiny_torch_run), "--devices", "2", stdin=b"eins\n",
                            monkeypatch=monkeypatch)
    one_error(code, err, "--devices 2: a torch run decodes on one device")
    assert "a torch run translates on one device and refuses N > 1" in " ".join(translate.build_parser().format_help().split())


# ----------------------------------------------------------------------------------------------
# The compilation cache


def test_cache_directory_rules(monkeypatch, tmp_path):
    for name in (jax_cache.ENV, "JAX_COMPILATION_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert jax_cache.cache_dir() == tmp_path / ".cache" / "aiayn" / "jax"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert jax_cache.cache_dir() == tmp_path / "xdg" / "aiayn" / "jax"
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax's"))
    assert jax_cache.cache_dir() == tmp_path / "jax's"
    monkeypatch.setenv(jax_cache.ENV, str(tmp_path / "ours"))
    assert jax_cache.cache_dir() == tmp_path / "ours"
    for off in ("off", "", "0"):
        monkeypatch.setenv(jax_cache.ENV, off)
        assert jax_cache.cache_dir() is None
    assert "AIAYN_JAX_CACHE=off" in " ".join(translate.build_parser().format_help().split())


def test_a_cache_directory_that_cannot_be_written_is_one_warning(monkeypatch, capsys):
    import jax

    monkeypatch.setattr(jax.config, "update", lambda *args: pytest.fail(f"cache configured: {args}"))
    monkeypatch.setenv(jax_cache.ENV, "/proc/self")  # a directory no one may create files in, root included
    assert jax_cache.enable() is None  # JAX would warn twice at every program it compiles
    assert capsys.readouterr().err.startswith("warning: no compilation cache: cannot write to /proc/self: ")


@pytest.fixture
def jax_run(tiny_torch_and_jax_runs):
    """The shared tiny run converted to JAX (a JAX run directory: its translate compiles); read only."""
    return tiny_torch_and_jax_runs[1]


def test_a_second_process_loads_what_the_first_compiled(jax_run, tmp_path):
    cache, source = tmp_path / "cache", write_lines(tmp_path / "in.txt", LINES)
    env = {**os.environ, "PYTHONPATH": str(REPO), jax_cache.ENV: str(cache)}
    command = [sys.executable, "-m", "train.commands.translate", "--run-dir", str(jax_run), "--input", str(source)]
    first = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    entries = {p.name: p.read_bytes() for p in cache.iterdir() if p.name.endswith("-atime")}
    assert entries  # compiled programs were kept (each beside its last-access time)
    second = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0 and second.stdout == first.stdout, second.stderr
    after = {p.name: p.read_bytes() for p in cache.iterdir() if p.name.endswith("-atime")}
    assert after.keys() == entries.keys()  # nothing compiled anew
    assert all(after[name] != entries[name] for name in entries)  # and every entry was read again


# ----------------------------------------------------------------------------------------------
# Every device


def test_eight_devices_translate_as_one(jax_run, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") and k != "XLA_FLAGS"}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    out = tmp_path / "outputs.json"
    proc = subprocess.run([sys.executable, __file__, str(jax_run), str(out)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    outputs = json.loads(out.read_text())
    for beam in ("1", "4"):
        assert outputs[f"8/{beam}"] == outputs[f"1/{beam}"]
        assert len(outputs[f"8/{beam}"]) == len(LINES)


# ~11 s: two fresh processes compiling for 2 devices.
def test_a_cpu_translates_on_one_device_per_core(jax_run, tmp_path, capsys):
    """No XLA_FLAGS: `aiayn translate` splits the CPU into devices ($AIAYN_HOST_DEVICES=2
    here, as on a 2-core machine), says so, and writes what one device writes."""
    source = write_lines(tmp_path / "in.txt", LINES)
    code, expected, err = run_main(capsys, "--run-dir", str(jax_run), "--input", str(source), "--batch-size", "3",
                                   "--devices", "1")  # one device, whatever an earlier test split this process into
    assert code == 0 and " devices" not in err, err
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") and k != "XLA_FLAGS"}
    env.update({"JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO), jax_cache.ENV: "off", host_devices.ENV: "2"})
    command = [sys.executable, "-m", "train.commands.translate", "--run-dir", str(jax_run), "--input", str(source),
               "--batch-size", "3"]
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == expected
    assert proc.stderr.splitlines()[-1].endswith(" target tokens/s on 2 devices"), proc.stderr
    env[host_devices.ENV] = "none"
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert (proc.returncode, proc.stdout) == (1, "")
    assert proc.stderr == "error: $AIAYN_HOST_DEVICES='none': expected a number of devices from 1 to 256\n"


def test_more_devices_than_the_cpu_has_are_refused(jax_run):
    """Issue 58: `--devices N` beyond the cores is refused as train.run refuses it, not met by making N
    XLA devices (the split is one device per core, whatever --devices asks)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") and k not in ("XLA_FLAGS", host_devices.ENV)}
    env.update({"JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO), jax_cache.ENV: "off"})
    asked = host_devices.cores() + 1
    proc = subprocess.run([sys.executable, "-m", "train.commands.translate", "--run-dir", str(jax_run), "--devices",
                           str(asked)], input="eins\n", cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert (proc.returncode, proc.stdout) == (1, "")
    assert proc.stderr == f"error: --devices {asked}: {host_devices.cores()} device(s) visible (cpu)\n"


def test_two_processes_translate_as_one(jax_run, tmp_path, capsys):
    """Two processes with 2 CPU devices each (jax.distributed on 127.0.0.1): process 0 writes the
    one-device output; process 1 writes nothing."""
    import socket

    source, output = write_lines(tmp_path / "in.txt", LINES), tmp_path / "out.txt"
    code, expected, err = run_main(capsys, "--run-dir", str(jax_run), "--input", str(source), "--batch-size", "3")
    assert code == 0, err
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") and k != "XLA_FLAGS"}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    command = [sys.executable, "-m", "train.commands.translate", "--run-dir", str(jax_run), "--input", str(source),
               "--output", str(output), "--batch-size", "3", "--coordinator-address", f"127.0.0.1:{port}",
               "--num-processes", "2"]
    processes = [subprocess.Popen([*command, "--process-id", str(i)], env=env, cwd=REPO, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(2)]
    results = [p.communicate(timeout=600) for p in processes]
    for p, (stdout, stderr) in zip(processes, results):
        assert p.returncode == 0, stderr[-3000:]
    assert output.read_text(encoding="utf-8") == expected
    assert results[0][1].splitlines()[-1].startswith(f"translated {len(LINES)} lines in ")
    # Process 1 writes nothing: its stdout holds only gloo's (jax's CPU collectives) announcements,
    # which the two processes' gloo threads may interleave mid-line.
    gloo = set("[Gloo] Rank is connected to peer ranks. Expected number of connected peer ranks is :".split())
    words = results[1][0].replace("[Gloo]", " [Gloo] ").split()  # "3[Gloo]": one line cut into by the other
    assert all(word in gloo or word.isdigit() for word in words), results[1][0]
    assert "translated" not in results[1][1]


def _worker(run_dir: str, out: str) -> None:
    """Translate LINES on 8 devices and on 1 (greedy and beam 4; batches of 5 rows, so padded to
    8 on 8 devices), through `train.commands.translate.main`; the outputs to `out` as JSON."""
    import contextlib

    import jax

    assert jax.device_count() == 8
    source = write_lines(Path(out).with_suffix(".in"), LINES)
    outputs = {}
    for devices in (8, 1):
        for beam in (1, 4):
            text = io.StringIO()
            with contextlib.redirect_stdout(text):
                code = translate.main(["--run-dir", run_dir, "--input", str(source), "--devices", str(devices),
                                       "--beam", str(beam), "--batch-size", "5", "--no-progress"])
            assert code == 0
            outputs[f"{devices}/{beam}"] = text.getvalue().splitlines()
    Path(out).write_text(json.dumps(outputs))


if __name__ == "__main__":
    _worker(*sys.argv[1:3])
