"""Bad input to the command-line tools: each case ends with one `error:` line naming the problem
(no traceback), a non-zero exit status, and nothing on disk changed. Run in-process through each
CLI's `main`, which is what `python -m train.run|translate|evaluate` call. At the end: numbers out
of range (every numeric flag of every CLI; model and experiment configs validate themselves), line
separators other than a newline kept inside a line, TSV rows with another column count."""

import gzip
import io
import json
import math
import random
import string
import sys
from pathlib import Path

import pytest

from torch_reference.config import TransformerConfig
from train import data, runtime
from train.commands import curves, evaluate, run, translate
from train.config import ExperimentConfig
from train.data import corpora

from .cli import run_cli
from .helpers import _exit_status

SMALL = ["--numbers-train", "300", "--max-len", "16", "--token-budget", "512", "--no-progress", "--samples", "0",
         "--eval-sentences", "4", "--beam", "1", "--set", "num_encoder_layers=1", "--set", "num_decoder_layers=1"]


def write(path: Path, content: bytes | str) -> Path:
    raw = content.encode() if isinstance(content, str) else content
    path.write_bytes(gzip.compress(raw) if path.suffix == ".gz" else raw)
    return path


def train_cli(capsys, *args: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `python -m train.run --backend=torch ARGS`."""
    code = run.main(["--backend=torch", *SMALL, *args])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_error(code: int, err: str, *fragments: str) -> None:
    assert code != 0, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, err)


@pytest.fixture
def corpus(tmp_path):
    """A small good corpus: prefix for de:en:PREFIX, 40 pairs."""
    pairs = [data.number_words(n) for n in range(100, 140)]
    write(tmp_path / "good.de", "".join(de + "\n" for de, _ in pairs))
    write(tmp_path / "good.en", "".join(en + "\n" for _, en in pairs))
    return tmp_path / "good"


def data_flags(train: str, valid: str) -> list[str]:
    return ["--train", train, "--valid", valid]


def test_invalid_utf8_names_the_file_and_byte_offset(tmp_path, corpus, capsys):
    for name in ("bad.de", "gz.de.gz"):
        bad = write(tmp_path / name, b"eins\nzwei \xff\xfe drei\nvier\n")
        write(tmp_path / name.replace(".de", ".en"), "one\ntwo\nthree\n")
        prefix = str(tmp_path / name.split(".")[0])
        code, _, err = train_cli(capsys, "--run-dir", str(tmp_path / "run"), *data_flags(f"de:en:{prefix}", f"de:en:{corpus}"))
        # byte 10: "eins\n" is 5 bytes, "zwei " 5 more; the offset counts the decompressed text.
        assert_one_error(code, err, str(bad), "invalid UTF-8 at byte offset 10 (line 2)")
    assert not (tmp_path / "run").exists()  # nothing was created


def test_line_counts_that_differ_name_the_unmatched_lines(tmp_path, corpus, capsys):
    write(tmp_path / "odd.de", "a\nb\nc\nd\n")
    write(tmp_path / "odd.en", "a\nb\n")
    code, _, err = train_cli(capsys, "--run-dir", str(tmp_path / "run"), *data_flags(f"de:en:{tmp_path}/odd", f"de:en:{corpus}"))
    assert_one_error(code, err, "odd.de has 4 lines", "odd.en has 2", "lines 3-4 of", "no counterpart")


def test_missing_unreadable_and_empty_files(tmp_path, corpus, capsys, monkeypatch):
    run_dir = ["--run-dir", str(tmp_path / "run")]
    code, _, err = train_cli(capsys, *run_dir, *data_flags(f"de:en:{tmp_path}/absent", f"de:en:{corpus}"))
    assert_one_error(code, err, "no such file", "absent.de")

    write(tmp_path / "empty.de", "\n \n")
    write(tmp_path / "empty.en", "\n\n")
    code, _, err = train_cli(capsys, *run_dir, *data_flags(f"de:en:{tmp_path}/empty", f"de:en:{corpus}"))
    assert_one_error(code, err, "holds no sentence pairs (2 skipped: a side is empty)")

    real_open = open

    def denied(path, *args, **kwargs):  # the tests run as root, for whom chmod 000 changes nothing
        if str(path).endswith("good.de"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(corpora, "open", denied, raising=False)
    code, _, err = train_cli(capsys, *run_dir, *data_flags(f"de:en:{corpus}", f"de:en:{corpus}"))
    assert_one_error(code, err, "cannot read", "good.de", "Permission denied")
    assert not (tmp_path / "run").exists()


def test_empty_lines_are_skipped_and_counted(tmp_path, corpus, capsys):
    pairs = [data.number_words(n) for n in range(200, 230)]
    write(tmp_path / "gaps.de", "".join(de + "\n" for de, _ in pairs) + "\nnur deutsch\n")
    write(tmp_path / "gaps.en", "".join(en + "\n" for _, en in pairs) + "only english\n\n")
    cfg = ExperimentConfig(train=f"de:en:{tmp_path}/gaps", valid=f"de:en:{corpus}")
    assert len(data.load_split(cfg, cfg.train)) == 30
    assert "skipped 2 of 32 pairs with an empty side" in capsys.readouterr().out


def test_sentences_longer_than_max_len_are_dropped_and_an_empty_result_refused(tmp_path, corpus, capsys):
    rng = random.Random(0)  # random letters: BPE cannot merge them into fewer than 16 tokens
    long = ["".join(rng.choice(string.ascii_lowercase + " ") for _ in range(200)) for _ in range(2)]
    write(tmp_path / "long.de", f"{long[0]}\n{long[1]}\n")
    write(tmp_path / "long.en", "seven\nseven\n")
    code, _, err = train_cli(capsys, "--run-dir", str(tmp_path / "run"), *data_flags(f"de:en:{tmp_path}/long", f"de:en:{corpus}"))
    assert_one_error(code, err, "no training pair is left: all 2 are longer than --max-len 16")
    assert not (tmp_path / "run").exists()


def test_a_failed_overwrite_leaves_the_old_run_alone(tmp_path, corpus, capsys):
    run_dir = tmp_path / "run"
    code, out, err = train_cli(capsys, "--run-dir", str(run_dir), "--steps", "2", "--numbers-valid", "4",
                               "--numbers-test", "0")
    assert code == 0, err
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    write(tmp_path / "bad.de", b"\xc3\n")
    write(tmp_path / "bad.en", "x\n")
    code, _, err = train_cli(capsys, "--run-dir", str(run_dir), "--overwrite", *data_flags(f"de:en:{tmp_path}/bad", f"de:en:{corpus}"))
    assert_one_error(code, err, "invalid UTF-8")
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


def test_unknown_values_and_flags_exit_with_usage(capsys):
    for args, message in [(["--preset", "huge"], "invalid choice: 'huge'"), (["--no-such-flag"], "unrecognized arguments"),
                          (["--set", "colour=red"], "colour")]:
        with pytest.raises(SystemExit) as exit_info:
            run.main(args)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    for main, data in ((translate.main, []), (evaluate.main, ["--data", "numbers:valid"])):  # one check: Search's
        assert main(["--run-dir", "x", *data, "--beam", "0"]) == 1
        assert capsys.readouterr().err == "error: --beam must be >= 1, got 0\n"


@pytest.fixture
def trained(tiny_torch_run):
    """A 2-step torch run to translate and evaluate with (the session's, shared)."""
    return tiny_torch_run


def translate_cli(capsys, monkeypatch, stdin: bytes, *args: str) -> tuple[int, str, str]:
    return run_cli(translate.main, capsys, *args, stdin=stdin, monkeypatch=monkeypatch)


def test_translate_refuses_empty_and_undecodable_input(trained, tmp_path, capsys, monkeypatch):
    code, out, err = translate_cli(capsys, monkeypatch, b"", "--run-dir", str(trained))
    assert_one_error(code, err, "standard input holds no sentence to translate")
    # Whitespace-only lines translate to empty lines, as empty ones do: one output line per input line.
    code, out, err = translate_cli(capsys, monkeypatch, b"\n  \n\t\r\n", "--run-dir", str(trained))
    assert (code, out) == (0, "\n\n\n"), err
    code, out, err = translate_cli(capsys, monkeypatch, b"eins\n\xe2\x82\n", "--run-dir", str(trained))
    assert_one_error(code, err, "standard input: invalid UTF-8 at byte offset 5 (line 2)")
    bad = write(tmp_path / "in.txt.gz", b"eins\nzwei\n\xff")
    output = write(tmp_path / "out.txt", "keep me\n")
    code, out, err = translate_cli(capsys, monkeypatch, b"", "--run-dir", str(trained), "--input", str(bad),
                                   "--output", str(output))
    assert_one_error(code, err, str(bad), "byte offset 10 (line 3)")
    assert output.read_text() == "keep me\n"  # not overwritten


def test_translate_keeps_lines_with_characters_never_seen_in_training(trained, capsys, monkeypatch):
    """Byte-level BPE has no unknown characters: every byte has a token, so such a line is
    translated like any other (here into whatever a 2-step model says), and every input line
    gets exactly one output line."""
    lines = ["dreihundert", "🦀🦀 ∮ ∂ ж", "", "\u0007\u200b"]
    ids = data.encode(data.load_tokenizers(trained).src, lines)
    assert all(data.UNK_ID not in row for row in ids) and all(len(row) > 1 for row, line in zip(ids, lines) if line)
    code, out, err = translate_cli(capsys, monkeypatch, "\n".join(lines).encode() + b"\n", "--run-dir", str(trained))
    assert code == 0, err
    assert len(out.split("\n")) == len(lines) + 1 and out.split("\n")[2] == ""  # the empty line stays empty


def test_evaluate_refuses_empty_data_and_missing_runs(trained, tmp_path, capsys):
    write(tmp_path / "none.de", "")
    write(tmp_path / "none.en", "")
    for args, fragment in [
        (["--run-dir", str(trained), "--data", f"de:en:{tmp_path}/none"], "holds no sentence pairs"),
        (["--run-dir", str(tmp_path / "absent"), "--data", "numbers:valid"], "not a run directory"),
        (["--run-dir", str(trained), "--data", "numbers:train", "--checkpoint", "7"], "no checkpoint of step 7"),
    ]:
        code = evaluate.main(args)
        assert_one_error(code, capsys.readouterr().err, fragment)
    # A good call writes its JSON whole.
    assert evaluate.main(["--run-dir", str(trained), "--data", "numbers:valid", "--output", str(tmp_path / "e.json")]) == 0
    assert json.loads((tmp_path / "e.json").read_text())["sentences"] == 4


def test_evaluate_says_the_hub_is_out_of_reach_in_one_line(trained, capsys, monkeypatch):
    """datasets' ConnectionError (an OSError) for an hf: spec offline: one line, as aiayn score and train.run say it;
    evaluate caught FileNotFoundError alone and printed a traceback."""
    import datasets

    def offline(name, *args, **kwargs):
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    code = evaluate.main(["--run-dir", str(trained), "--data", "hf:org/corpus:test"])
    assert_one_error(code, capsys.readouterr().err, "error: Couldn't reach 'org/corpus' on the Hub")


def test_evaluate_and_curves_into_a_closed_pipe_are_one_line(trained, tmp_path, capsys, monkeypatch):
    """`aiayn evaluate ... | head -1`: the reader gone, one error line as translate says it, not a BrokenPipeError
    traceback from the print."""

    class ClosedPipe(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    code = evaluate.main(["--run-dir", str(trained), "--data", "numbers:valid", "--beam", "1"])
    assert_one_error(code, capsys.readouterr().err, "error: Broken pipe")
    code = curves.main(["--run-dir", str(trained), "--out", str(tmp_path / "c.png")])
    assert_one_error(code, capsys.readouterr().err, "error: Broken pipe")


def test_malformed_json_lines_name_the_file(tmp_path, corpus, capsys):
    bad = write(tmp_path / "pairs.jsonl", '{"source": "eins", "target": "one"}\n{"source": broken\n')
    code, _, err = train_cli(capsys, "--run-dir", str(tmp_path / "run"), *data_flags(str(bad), f"de:en:{corpus}"))
    assert_one_error(code, err, str(bad), "not valid json", "JSON parse error")
    empty = write(tmp_path / "empty.jsonl", "")
    code, _, err = train_cli(capsys, "--run-dir", str(tmp_path / "run"), *data_flags(str(empty), f"de:en:{corpus}"))
    assert_one_error(code, err, "empty.jsonl' holds no sentence pairs")
    spec = f"hf:{tmp_path}:train"  # a local directory as a hub dataset: its data unparsable (a traceback before)
    code, _, err = train_cli(capsys, "--run-dir", str(tmp_path / "run"), *data_flags(spec, f"de:en:{corpus}"))
    assert_one_error(code, err, f"{spec}: not valid data", "JSON parse error")


def test_a_data_file_of_one_huge_line_is_one_short_error_line(tmp_path, corpus, capsys):
    """Issue 58: a 3 MB single-line train file was held whole, and a TSV's header quoted whole in the
    error. Every data reader (text pairs, TSV, JSON lines, plain or gzip; through a recipe as well)
    refuses a line longer than 1 MiB before holding it, in one short line; a data spec that long is
    quoted as a short prefix."""
    line = "wort " * 600_000  # 3,000,000 bytes, no newline
    write(tmp_path / "huge.tsv", line)
    write(tmp_path / "huge.de", line + "\n")
    write(tmp_path / "huge.en", "one\n")
    write(tmp_path / "huge.jsonl", json.dumps({"source": line, "target": "one"}) + "\n")
    write(tmp_path / "late.tsv.gz", "source\ttarget\n" + "eins\tone\n" * 3 + line)
    recipe = tmp_path / "huge.toml"
    recipe.write_text(f"train = '{tmp_path}/huge.tsv'\nvalid = 'de:en:{corpus}'\n")
    for flags, where in (
        (data_flags(f"{tmp_path}/huge.tsv", f"de:en:{corpus}"), "huge.tsv: line 1"),
        (data_flags(f"de:en:{tmp_path}/huge", f"de:en:{corpus}"), "huge.de: line 1"),
        (data_flags(f"{tmp_path}/huge.jsonl", f"de:en:{corpus}"), "huge.jsonl: line 1"),
        (data_flags(f"{tmp_path}/late.tsv.gz", f"de:en:{corpus}"), "late.tsv.gz: line 5"),
        (["--config", str(recipe)], "huge.tsv: line 1"),
    ):
        code, _, err = train_cli(capsys, "--run-dir", str(tmp_path / "run"), *flags)
        assert_one_error(code, err, f"{where} is longer than 1,048,576 bytes")
        assert len(err) < 400, err[:500]
    code, _, err = train_cli(capsys, "--run-dir", str(tmp_path / "run"), *data_flags("de:en:" + "x" * 3_000_000,
                                                                                      f"de:en:{corpus}"))
    assert_one_error(code, err, "error: data spec 'de:en:xxx", "... is 3,000,006 characters long")
    assert len(err) < 400, err[:500]
    assert not (tmp_path / "run").exists()


def test_evaluate_scores_a_lowercased_run_lowercased_and_says_so(run_copy, capsys):
    """Issue 58: a run trained with --lowercase, evaluated without --lowercase, gave cased BLEU alone
    (lowercase output against cased references) with no hint: now bleu_lc too, and one line says so."""
    config = json.loads((run_copy / "config.json").read_text())
    (run_copy / "config.json").write_text(json.dumps({**config, "lowercase": True}))  # as --lowercase writes it
    assert evaluate.main(["--run-dir", str(run_copy), "--data", "numbers:valid"]) == 0
    out, err = capsys.readouterr()
    assert "bleu_lc" in json.loads(out) and "bleu" in json.loads(out)
    assert err.splitlines() == [f"note: {run_copy} was trained with --lowercase, so its translations are lowercase: "
                                "bleu_lc (lowercased references) is scored too"]


# ----------------------------------------------------------------------------------------------
# Numbers out of range, line ends, table rows


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
    (dict(seed=-1), "seed must be in [0, 2147483648), got -1"),
    (dict(steps="10"), "steps must be an integer"),
    (dict(joint_vocab="no"), "joint_vocab must be true or false"),
    (dict(model={"num_heads": 0}), "num_heads must be >= 1"),
])
def test_an_experiment_config_validates_itself(changes, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        ExperimentConfig(**changes)


@pytest.mark.parametrize("module, argv, message", [
    ("train.commands.run", ["--lr-factor", "nan"], "--lr-factor must be finite, got nan"),
    ("train.commands.run", ["--clip-norm", "inf"], "--clip-norm must be finite, got inf"),
    ("train.commands.run", ["--set", "layer_norm_eps=-1"], "layer_norm_eps must be > 0, got -1"),
    ("train.commands.run", ["--set", "num_heads=0"], "num_heads must be >= 1, got 0"),
    ("train.commands.run", ["--steps", "1e3"], "argument --steps: invalid int value: '1e3'"),
    ("train.commands.translate", ["--run-dir", "x", "--alpha", "nan"], "--alpha must be finite, got nan"),
    ("train.commands.translate", ["--run-dir", "x", "--alpha", "-1"], "--alpha must be in [0, 10), got -1"),
    ("train.commands.translate", ["--run-dir", "x", "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    ("train.commands.score", ["--run-dir", "x", "--input", "y", "--batch-size", "-3"],
     "--batch-size must be >= 1, got -3"),
    ("train.commands.evaluate", ["--run-dir", "x", "--data", "d", "--samples", "-1"], "--samples must be >= 0, got -1"),
    ("train.commands.evaluate", ["--run-dir", "x", "--data", "d", "--max-sentences", "inf"],
     "--max-sentences: invalid int"),
    ("train.commands.bench", ["--dropout", "1"], "--dropout must be in [0, 1), got 1"),
    ("train.commands.bench", ["--steps", "0"], "--steps must be >= 1, got 0"),
    ("train.commands.profile_step", ["--repeats", "-2"], "--repeats must be >= 1, got -2"),
    ("parity.commands.check", ["--set", "num_heads=0"], "num_heads must be >= 1, got 0"),
    ("parity.commands.check", ["--src-len", "0"], "--src-len must be >= 1, got 0"),
    ("parity.commands.trajectory", ["--lr-factor", "inf"], "--lr-factor must be finite, got inf"),
    ("parity.commands.trajectory", ["--label-smoothing", "-0.1"],
     "--label-smoothing must be in [0, 1), got -0.1"),
    ("parity.commands.translate_bench", ["--run-dir", "x", "--alpha", "inf"], "--alpha must be finite, got inf"),
])
def test_every_numeric_flag_is_range_checked(module, argv, message, capsys):
    import importlib

    code, err = _exit_status(importlib.import_module(module).main, argv, capsys)
    # The options check themselves (status 1, the one exit protocol; train.run's usage status 2 for its config);
    # argparse refuses what is no number at all (status 2).
    argparse_checked = module == "train.commands.run" or "invalid" in message
    assert code == (2 if argparse_checked else 1) and "Traceback" not in err
    assert message in [line for line in err.splitlines() if "error:" in line][0], err


@pytest.mark.parametrize("rows, message", [
    (["source\ttarget", "eins\tone\textra", "zwei\ttwo"], "line 2 has 3 columns, the header (line 1) has 2"),
    (["source\ttarget", "eins\tone", "zwei\ttwo", "drei"], "line 4 has 1 columns, the header (line 1) has 2"),
])
def test_tsv_rows_with_another_column_count_are_named(tmp_path, rows, message):
    path = tmp_path / "pairs.tsv"
    path.write_text("\n".join(rows) + "\n")
    with pytest.raises(runtime.UserError) as info:
        data.load_split(ExperimentConfig(), str(path))
    assert str(path) in str(info.value) and message in str(info.value) and "\n" not in str(info.value)
