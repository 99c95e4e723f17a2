"""Reliability, second round (issue 19): checksummed checkpoints, history across resumes, one line
rule, bad numbers refused, destinations checked first, edited files named, SIGTERM mid-evaluation.

Corruption and SIGTERM run real processes (`python -m ...`); the rest runs each CLI's `main`
in-process, which is what `python -m` calls. Runs are tiny (1+1 layers, 16 tokens, 4 steps)."""

import io
import json
import math
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torch_reference.config import TransformerConfig
from train import data, evaluate, files, loop, rundir, store, translate
from train.config import ExperimentConfig

REPO = Path(__file__).resolve().parents[2]
TINY = dict(
    numbers_train=1500, numbers_valid=4, numbers_test=0, max_len=16, token_budget=512, warmup=2,
    model={"num_encoder_layers": 1, "num_decoder_layers": 1}, progress=False, samples=0,
    eval_sentences=4, beam=1, log_every=1,
)


def python(*args: str, stdin: bytes = b"", timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env, input=stdin, capture_output=True,
                          timeout=timeout)


def one_error_line(stderr: str | bytes, *fragments: str) -> str:
    """The one non-empty stderr line, which starts with 'error: ' and holds every fragment."""
    text = stderr.decode(errors="replace") if isinstance(stderr, bytes) else stderr
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), text
    for fragment in fragments:
        assert fragment in lines[0], (fragment, text)
    return lines[0]


def files_of(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module", params=["jax", "torch"])
def run4(request, tmp_path_factory):
    """A 4-step run, evaluated and saved at steps 2 and 4: (config, run directory)."""
    run_dir = tmp_path_factory.mktemp(f"run4-{request.param}") / "run"
    cfg = ExperimentConfig(backend=request.param, run_dir=str(run_dir), steps=4, eval_every=2, save_every=2, **TINY)
    loop.train(cfg)
    return cfg, run_dir


@pytest.fixture
def torch_run(tiny_torch_run):
    return tiny_torch_run


# ----------------------------------------------------------------------------------------------
# 2. Checkpoint digests


def test_every_checkpoint_file_has_a_digest(run4):
    _, run_dir = run4
    for step in (2, 4):
        directory = run_dir / "checkpoints" / str(step)
        record = json.loads((directory / store.DIGEST_FILE).read_text())
        files = {p.relative_to(directory).as_posix() for p in directory.rglob("*")
                 if p.is_file() and p.name != store.DIGEST_FILE}
        assert record["algorithm"] == "sha256" and set(record["files"]) == files and len(files) >= 3
        assert store.verify_checkpoint(directory) is True


def flip_bytes(run_dir: Path, step: int) -> str:
    """Flip 2 KiB inside the largest file of checkpoint `step` (after its first 4 KiB: inside the
    data, not a header); returns its path relative to the checkpoint directory."""
    directory = run_dir / "checkpoints" / str(step)
    victim = max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    content = bytearray(victim.read_bytes())
    start = min(4096, len(content) // 2)
    content[start : start + 2048] = bytes(b ^ 0x5A for b in content[start : start + 2048])
    victim.write_bytes(bytes(content))
    return victim.relative_to(directory).as_posix()


def test_flipped_bytes_are_named_by_every_loader(run4, tmp_path):
    """Evaluate and translate (real processes), resume and convert: one line naming step and file;
    the intact checkpoint still loads."""
    cfg, run_dir = run4
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    damaged = flip_bytes(copy, 4)
    expected = (f"checkpoint 4 in {copy / 'checkpoints'} cannot be restored", f"{damaged} does not match the sha256 "
                "digest written with it", "the other checkpoints there are steps [2]")
    done = python("train.evaluate", "--run-dir", str(copy), "--data", "numbers:valid", "--checkpoint", "latest")
    assert done.returncode == 1 and not done.stdout
    one_error_line(done.stderr, *expected)
    done = python("train.translate", "--run-dir", str(copy), "--checkpoint", "latest", stdin=b"eins\n")
    assert done.returncode == 1 and not done.stdout
    one_error_line(done.stderr, *expected)
    with pytest.raises(files.UserError) as info:
        loop.train(cfg.replace(run_dir=str(copy), resume=True, steps=6))
    assert all(e in str(info.value) for e in expected) and "\n" not in str(info.value)
    from parity.convert import main as convert_main

    with pytest.raises(SystemExit) as exit_info:
        convert_main(["--to", "torch" if cfg.backend == "jax" else "jax", "--run-dir", str(copy), "--dst",
                      str(tmp_path / "converted")])
    assert exit_info.value.code == 1 and not (tmp_path / "converted").exists()
    run = rundir.open_run(copy, 2)  # the other checkpoint is intact
    assert run.backend.step == 2
    run.backend.close()


def test_json_never_holds_nan_or_infinity(tmp_path):
    obj = {"loss": math.nan, "ppl": math.inf, "bands": [{"x": -math.inf}], "ok": 1.5}
    text = files.json_text(obj)
    assert json.loads(text) == {"loss": None, "ppl": None, "bands": [{"x": None}], "ok": 1.5}
    assert "NaN" not in text and "Infinity" not in text
    files.write_json_atomic(tmp_path / "r.json", obj)
    json.loads((tmp_path / "r.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} in JSON"))


# ----------------------------------------------------------------------------------------------
# 3. History across resumes


def tensorboard_steps(directory: Path, tag: str) -> list[int]:
    """The steps of scalar `tag` in every event file of `directory`, TensorBoard's purge applied:
    a file's events at or after the purge step of a later file's start are dropped."""
    from tensorboardX.proto import event_pb2

    events = []
    for path in sorted(directory.glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime_ns):
        raw, offset, file_events = path.read_bytes(), 0, []
        while offset < len(raw):
            (length,) = struct.unpack_from("<Q", raw, offset)
            event = event_pb2.Event.FromString(raw[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            file_events.append(event)
        events.append(file_events)
    steps: list[int] = []
    for file_events in events:
        for event in file_events:
            if event.HasField("session_log") and event.session_log.status == event.session_log.START:
                steps = [s for s in steps if s < event.step]  # purge_step
            for value in event.summary.value:
                if value.tag == tag:
                    steps.append(event.step)
    return steps


def test_sessions_opened_within_one_second_keep_their_own_event_files(tmp_path):
    """tensorboardX names an event file by the second it was opened: a run resumed within the
    second of its last session overwrote that session's file (steps 5-6 of a tiny run lost)."""
    for first_step in (5, 7):
        writer = loop.summary_writer(tmp_path, purge_step=first_step)
        writer.add_scalar("train/loss", 1.0, first_step)
        writer.close()
    files = sorted(p.name for p in tmp_path.glob("events.out.tfevents.*"))
    assert len(files) == 2 and files[0].split(".")[-2:] == [f"{5:010d}", str(os.getpid())]
    assert tensorboard_steps(tmp_path, "train/loss") == [5, 7]


def test_history_survives_any_number_of_resumes(run4, tmp_path, capsys):
    cfg, run_dir = run4
    run = rundir.open_run(run_dir, 4)  # each checkpoint's meta holds the history up to its step
    run.backend.close()
    assert [e["step"] for e in run.meta["history"]["valid"]] == [2, 4]
    assert [e["step"] for e in run.meta["history"]["train"]] == [1, 2, 3, 4]
    if cfg.backend == "jax":  # the resumes below are the loop's, alike for both backends (2-core CI budget)
        return
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    for steps in (6, 8):
        loop.train(cfg.replace(run_dir=str(copy), resume=True, steps=steps))
    results = json.loads((copy / "results.json").read_text())
    assert [e["step"] for e in results["history"]["valid"]] == [2, 4, 6, 8]
    assert [e["step"] for e in results["history"]["train"]] == list(range(1, 9))
    assert results["best"] is not None and results["train"]["loss"] is not None and results["train"]["time_s"] > 0
    assert tensorboard_steps(copy / "tensorboard", "valid/bleu") == [2, 4, 6, 8]
    assert tensorboard_steps(copy / "tensorboard", "train/loss") == list(range(1, 9))

    # --steps at or below the steps done: nothing to train, results.json left byte for byte.
    before = (copy / "results.json").read_bytes()
    capsys.readouterr()
    loop.train(cfg.replace(run_dir=str(copy), resume=True, steps=5))  # (at or below: one rule, steps done >= --steps)
    assert (copy / "results.json").read_bytes() == before
    assert "nothing to do; results.json left as it is" in capsys.readouterr().out
    # The same for a run stopped before its results were written: said so, then evaluated.
    (copy / "results.json").unlink()
    loop.train(cfg.replace(run_dir=str(copy), resume=True, steps=5))
    assert "has trained 8 steps (--steps 5): nothing to train; evaluating" in capsys.readouterr().out
    assert json.loads((copy / "results.json").read_text())["steps"] == 8


# ----------------------------------------------------------------------------------------------
# 4. One line rule


def test_only_newlines_end_lines_in_translate_and_training_data(torch_run, tmp_path, capsys, monkeypatch):
    odd = "eins\u2028zwei\x85drei\x0cvier\rfünf\x1csechs\x1d\x1e\u2029"
    assert data.split_lines(f"{odd}\nzwei\r\n\n  \nlast") == [odd, "zwei", "", "  ", "last"]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(f"{odd}\n \n\nacht\r\n".encode())))
    assert translate.main(["--run-dir", str(torch_run), "--beam", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 4 and out.split("\n")[1:3] == ["", ""]  # whitespace-only -> empty line
    (tmp_path / "p.de").write_text(f"{odd}\nzwei\n", encoding="utf-8")
    (tmp_path / "p.en").write_text("one two\r\ntwo\n", encoding="utf-8")
    assert data.load_parallel(f"de:en:{tmp_path}/p").pairs == [(odd.strip(), "one two"), ("zwei", "two")]


# ----------------------------------------------------------------------------------------------
# 5. Bad numbers


@pytest.mark.parametrize("changes, message", [
    (dict(num_heads=0), "num_heads must be >= 1, got 0"),
    (dict(layer_norm_eps=-1.0), "layer_norm_eps must be > 0, got -1"),
    (dict(layer_norm_eps=math.nan), "layer_norm_eps must be finite"),
    (dict(dropout=math.inf), "dropout must be finite"),
    (dict(attention_dropout=1.0), "attention_dropout must be in [0, 1), got 1"),
    (dict(d_model=512.0), "d_model must be an integer"),
    (dict(d_ff=True), "d_ff must be an integer"),
    (dict(pad_id=2), "eos_id must differ from pad_id and bos_id (bos_id may equal pad_id), got pad_id=2"),
    (dict(bos_id=2), "eos_id must differ from pad_id and bos_id"),
    (dict(src_vocab_size=2, tgt_vocab_size=2), "eos_id=2 must be below the vocabulary sizes"),
    (dict(tie_output="yes"), "tie_output must be true or false"),
])
def test_a_model_config_validates_itself(changes, message):
    with pytest.raises(ValueError) as info:
        TransformerConfig(**changes)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("changes, message", [
    (dict(lr_factor=math.nan), "lr_factor must be finite"),
    (dict(clip_norm=math.inf), "clip_norm must be finite"),
    (dict(label_smoothing=1.0), "label_smoothing must be in [0, 1)"),
    (dict(seed=-1), "seed must be >= 0"),
    (dict(steps="10"), "steps must be an integer"),
    (dict(joint_vocab="no"), "joint_vocab must be bool"),
    (dict(model={"num_heads": 0}), "num_heads must be >= 1"),
])
def test_an_experiment_config_validates_itself(changes, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        ExperimentConfig(**changes)


def _exit_status(main, argv, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as info:
        main(argv)
    return info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("module, argv, message", [
    ("train.run", ["--lr-factor", "nan"], "--lr-factor: lr_factor must be finite, got nan"),
    ("train.run", ["--clip-norm", "inf"], "--clip-norm: clip_norm must be finite, got inf"),
    ("train.run", ["--set", "layer_norm_eps=-1"], "layer_norm_eps must be > 0, got -1"),
    ("train.run", ["--set", "num_heads=0"], "num_heads must be >= 1, got 0"),
    ("train.run", ["--steps", "1e3"], "--steps: steps must be an integer, got '1e3'"),
    ("train.translate", ["--run-dir", "x", "--alpha", "nan"], "--alpha: must be finite, got nan"),
    ("train.translate", ["--run-dir", "x", "--alpha", "-1"], "--alpha: must be >= 0, got -1"),
    ("train.translate", ["--run-dir", "x", "--batch-size", "0"], "--batch-size: must be >= 1, got 0"),
    ("train.evaluate", ["--run-dir", "x", "--data", "d", "--samples", "-1"], "--samples: must be >= 0, got -1"),
    ("train.evaluate", ["--run-dir", "x", "--data", "d", "--max-sentences", "inf"], "--max-sentences: must be an integer"),
    ("train.bench", ["--dropout", "1"], "--dropout: must be in [0, 1), got 1"),
    ("train.bench", ["--steps", "0"], "--steps: must be >= 1, got 0"),
    ("train.profile_step", ["--repeats", "-2"], "--repeats: must be >= 1, got -2"),
    ("parity.check", ["--set", "num_heads=0"], "num_heads must be >= 1, got 0"),
    ("parity.check", ["--src-len", "0"], "--src-len: must be >= 1, got 0"),
    ("parity.trajectory", ["--lr-factor", "inf"], "--lr-factor: must be finite, got inf"),
    ("parity.trajectory", ["--label-smoothing", "-0.1"], "--label-smoothing: must be in [0, 1), got -0.1"),
    ("parity.translate_bench", ["--run-dir", "x", "--alpha", "inf"], "--alpha: must be finite, got inf"),
])
def test_every_numeric_flag_is_range_checked(module, argv, message, capsys):
    import importlib

    code, err = _exit_status(importlib.import_module(module).main, argv, capsys)
    assert code == 2 and "Traceback" not in err
    assert message in [line for line in err.splitlines() if "error:" in line][0], err


def test_a_non_finite_validation_loss_is_divergence(tmp_path, monkeypatch):
    real = loop._evaluate

    def nan_loss(*args, **kwargs):
        return {**real(*args, **kwargs), "loss": math.nan}

    monkeypatch.setattr(loop, "_evaluate", nan_loss)
    cfg = ExperimentConfig(backend="torch", run_dir=str(tmp_path / "run"), steps=4, eval_every=2, save_every=1, **TINY)
    with pytest.raises(loop.TrainingDiverged, match=r"validation loss nan at step 2; .*checkpoints up to step 1 are"):
        loop.train(cfg)
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["1"]


# ----------------------------------------------------------------------------------------------
# 6. Destinations checked first, nothing half-made, nothing unasked


def test_convert_never_overwrites_unasked_or_leaves_temporary_files(tmp_path, capsys):
    import torch_reference
    from parity.convert import main as convert_main
    from parity.runs import save_torch_weights

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
    monkeypatch.setattr(rundir, "open_run", lambda *a, **k: pytest.fail("the work started"))
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"eins\n")))
    for output, message in [(tmp_path, "is a directory"), (tmp_path / "absent" / "out.txt", "does not exist")]:
        for main, extra in [(translate.main, []), (evaluate.main, ["--data", "numbers:valid"])]:
            code, err = _exit_status(main, ["--run-dir", str(torch_run), "--output", str(output), *extra], capsys)
            assert code == 1
            one_error_line(err, "--output", message)
    assert not (tmp_path / "absent").exists()


def test_a_path_with_a_non_utf8_byte_works(tmp_path):
    """A run directory and data path holding byte 0xFF (not UTF-8): trained, written as JSON
    (escaped), read back, translated."""
    base = os.fsdecode(bytes(tmp_path) + b"/d\xffta")
    os.makedirs(base)
    pairs = [data.number_words(n) for n in range(100, 160)]
    Path(base, "p.de").write_text("".join(de + "\n" for de, _ in pairs), encoding="utf-8")
    Path(base, "p.en").write_text("".join(en + "\n" for _, en in pairs), encoding="utf-8")
    run_dir = os.path.join(base, "run")
    fields = {k: v for k, v in TINY.items() if not k.startswith("numbers_")}
    cfg = ExperimentConfig(backend="torch", run_dir=run_dir, steps=2, train=f"de:en:{base}/p", valid=f"de:en:{base}/p",
                           **fields)
    loop.train(cfg)
    assert rundir.read_experiment(run_dir).train == f"de:en:{base}/p"
    assert json.loads(Path(run_dir, "results.json").read_text())["run_dir"] == run_dir
    assert not [p for p in Path(run_dir).iterdir() if p.name.endswith(".tmp")]
    loop.train(cfg.replace(overwrite=True))  # and replaced again


# ----------------------------------------------------------------------------------------------
# 7. Edited or foreign files


@pytest.mark.parametrize("file, edit, fragments", [
    ("config.json", lambda text: text[:-5], ["config.json is not valid JSON", "line"]),
    ("config.json", lambda text: text.replace('"seed": 0', '"sead": 0'), ["config.json", "unknown", "sead"]),
    ("config.json", lambda text: text.replace('"seed": 0', '"seed": "zero"'), ["config.json", "seed must be an integer"]),
    ("config.json", lambda text: "[1, 2]", ["config.json holds no JSON object"]),
    ("model.json", lambda text: text.replace('"d_model": 64', '"d_model": "64"'), ["model.json", "d_model must be an integer"]),
    ("model.json", lambda text: text.replace('"d_model": 64', '"d_modell": 64'), ["model.json", "unknown", "d_modell"]),
])
def test_hand_edited_run_files_are_named_with_the_field(torch_run, tmp_path, capsys, monkeypatch, file, edit, fragments):
    copy = tmp_path / "copy"
    shutil.copytree(torch_run, copy)
    (copy / file).write_text(edit((copy / file).read_text()))
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"eins\n")))
    code, err = _exit_status(translate.main, ["--run-dir", str(copy)], capsys)
    assert code == 1
    one_error_line(err, str(copy / file), *fragments)
    if file == "config.json":  # what --resume reads (it rebuilds model.json from it)
        with pytest.raises(files.UserError) as info:
            loop.train(ExperimentConfig(backend="torch", run_dir=str(copy), resume=True, steps=3, progress=False))
        assert str(copy / file) in str(info.value) and "\n" not in str(info.value)


def test_a_deleted_tokenizer_is_named(torch_run, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(torch_run, copy)
    (copy / "tokenizer.json").unlink()
    with pytest.raises(files.UserError, match=r"no such file: .*copy/tokenizer\.json$"):
        rundir.open_run(copy)


@pytest.mark.parametrize("rows, message", [
    (["source\ttarget", "eins\tone\textra", "zwei\ttwo"], "line 2 has 3 columns, the header (line 1) has 2"),
    (["source\ttarget", "eins\tone", "zwei\ttwo", "drei"], "line 4 has 1 columns, the header (line 1) has 2"),
])
def test_tsv_rows_with_another_column_count_are_named(tmp_path, rows, message):
    path = tmp_path / "pairs.tsv"
    path.write_text("\n".join(rows) + "\n")
    with pytest.raises(files.UserError) as info:
        rundir.load_split(ExperimentConfig(), str(path))
    assert str(path) in str(info.value) and message in str(info.value) and "\n" not in str(info.value)


def test_a_refused_pickle_is_one_line_without_colour_codes(tmp_path):
    import torch

    from parity.runs import load_torch_weights

    (tmp_path / "config.json").write_text(TransformerConfig().to_json())
    torch.save({"w": torch.zeros(1), "f": print}, tmp_path / "model.pt")
    with pytest.raises(ValueError) as info:
        load_torch_weights(tmp_path / "model.pt")
    assert "refused by torch.load" in str(info.value) and "\x1b" not in str(info.value) and "\n" not in str(info.value)


# ----------------------------------------------------------------------------------------------
# 8. SIGTERM during evaluation


def test_sigterm_during_evaluation_saves_within_one_update(tmp_path):
    """The small preset evaluating 2,000 validation sentences with beam 4 (several seconds; 200
    took 0.7 s once the search stopped each sentence as soon as its best could not be beaten):
    SIGTERM right after step 2's update stops the evaluation, saves step 2 and exits 143, with
    no evaluation result printed."""
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "train.run", "--backend=torch", "--preset", "small", "--run-dir", str(run_dir),
               "--numbers-train", "1500", "--numbers-valid", "2000", "--numbers-test", "0", "--max-len", "16",
               "--token-budget", "512", "--steps", "50", "--eval-every", "2", "--log-every", "1", "--beam", "4",
               "--no-progress", "--samples", "0"]
    proc = subprocess.Popen(command, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("step 2/50"):  # logged just before the evaluation starts
                break
        else:
            pytest.fail("".join(seen))
        time.sleep(0.5)  # inside the evaluation
        sent = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
        elapsed = time.perf_counter() - sent
    finally:
        proc.kill()
        proc.wait()
    out = "".join(seen) + out
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "SIGTERM: stopped at step 2 of 50" in out and "step 2: valid" not in out and "Traceback" not in out
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["2"]
    # The scheduler's grace period (SLURM KillWait, Kubernetes) is 30 s; here it takes about a
    # second (one evaluation batch and the save).
    print(f"SIGTERM mid-evaluation to exit with step 2 saved: {elapsed:.2f} s")
    assert elapsed < 30
