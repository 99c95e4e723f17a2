"""Property tests (Hypothesis): random bytes, encodings, line endings and column counts fed to every
data format and to translate's input; random `--set` values and hand-edited configs. Each input
either works or ends with the project's one error type (UserError; `error:` and exit status 1 or
2 at the command line) in one line: never a traceback, never a changed file.

Kept cheap for the 2-core CI budget: few examples each, no training inside a property (translate
uses one 2-step run made once), `deadline=None` (the machine is shared; a slow example is no bug).
"""

import io
import json
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torch_reference.config import TransformerConfig
from train import data, runtime
from train.commands import run, translate
from train.config import ExperimentConfig

FEW = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
MANY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# Text that is hard on line splitting and column splitting: every line-ish character Python's
# splitlines knows, tabs, quotes, NUL, BOM, surrogate-free non-ASCII.
TRICKY = "\n\r\t\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029\ufeff\x00\"'\\ aé€🦀"
texts = st.text(alphabet=st.sampled_from(TRICKY) | st.characters(codec="utf-8"), max_size=40)
line_ends = st.sampled_from(["\n", "\r\n", "\r", "\u2028", ""])
encodings = st.sampled_from(["utf-8", "utf-8-sig", "utf-16", "latin-1", "cp1252"])


@st.composite
def file_bytes(draw) -> bytes:
    """Random bytes, or random lines joined by random line ends in a random encoding."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=200))
    lines = draw(st.lists(texts, max_size=6))
    end = draw(line_ends)
    text = "".join(line + (end if draw(st.booleans()) else "\n") for line in lines)
    return text.encode(draw(encodings), errors="replace")


@st.composite
def tsv_bytes(draw) -> bytes:
    """A header and rows of random column counts."""
    header = draw(st.sampled_from(["source\ttarget", "target\tx\tsource", "source", "src\ttgt"]))
    rows = draw(st.lists(st.lists(texts.map(lambda t: t.replace("\n", " ")), min_size=0, max_size=4), max_size=5))
    end = draw(st.sampled_from(["\n", "\r\n"]))
    return (header + end + "".join("\t".join(row) + end for row in rows)).encode("utf-8")


def loads_or_one_line(spec: str, watched: list[Path]) -> list[data.Pair] | None:
    """data.load_split on `spec`: its pairs, or None after a one-line UserError; the files in
    `watched` are unchanged either way."""
    before = [p.read_bytes() for p in watched]
    try:
        pairs = data.load_split(ExperimentConfig(), spec)
    except runtime.UserError as err:
        assert "\n" not in str(err) and str(err), repr(str(err))
        pairs = None
    assert [p.read_bytes() for p in watched] == before
    return pairs


@FEW
@given(src=file_bytes(), tgt=file_bytes())
def test_text_pairs_load_or_refuse_in_one_line(tmp_path_factory, src, tgt):
    directory = tmp_path_factory.mktemp("pairs")
    files = [directory / "p.de", directory / "p.en"]
    files[0].write_bytes(src)
    files[1].write_bytes(tgt)
    pairs = loads_or_one_line(f"de:en:{directory}/p", files)
    if pairs is not None:  # one pair per line, by the one rule: split at \n (and \r\n) only
        lines = data.split_lines(src.decode("utf-8"))
        assert len(lines) == len(data.split_lines(tgt.decode("utf-8")))
        assert all(s == s.strip() and s and t for s, t in pairs) and len(pairs) <= len(lines)


@FEW
@given(content=tsv_bytes() | file_bytes())
def test_tsv_loads_or_refuses_in_one_line(tmp_path_factory, content):
    path = tmp_path_factory.mktemp("tsv") / "pairs.tsv"
    path.write_bytes(content)
    pairs = loads_or_one_line(str(path), [path])
    if pairs is not None:
        header = data.split_lines(content.decode("utf-8"))[0].split("\t")
        assert {"source", "target"} <= set(header)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=file_bytes())
def test_json_lines_load_or_refuse_in_one_line(tmp_path_factory, content):
    path = tmp_path_factory.mktemp("jsonl") / "pairs.jsonl"
    path.write_bytes(content)
    loads_or_one_line(str(path), [path])


@pytest.fixture
def tiny_run(tiny_torch_run):
    return tiny_torch_run


@FEW
@given(content=file_bytes())
def test_translate_gives_one_line_per_input_line_or_one_error(tiny_run, tmp_path_factory, content):
    directory = tmp_path_factory.mktemp("translate")
    output = directory / "out.txt"
    output.write_text("keep\n")
    stdin, stdout, stderr = sys.stdin, sys.stdout, sys.stderr
    sys.stdin = io.TextIOWrapper(io.BytesIO(content))
    sys.stdout, sys.stderr = io.StringIO(), io.StringIO()
    try:
        try:
            code = translate.main(["--run-dir", str(tiny_run), "--beam", "1", "--output", str(output)])
        except SystemExit as exit_info:
            code = exit_info.code
        err = sys.stderr.getvalue()
    finally:
        sys.stdin, sys.stdout, sys.stderr = stdin, stdout, stderr
    try:
        lines = data.split_lines(content.decode("utf-8"))
    except UnicodeDecodeError:
        lines = None
    if lines:
        assert code == 0, err
        assert output.read_text(encoding="utf-8").count("\n") == len(lines)
    else:
        assert code == 1 and [line for line in err.splitlines() if line] == [err.strip()] and err.startswith("error: ")
        assert output.read_text() == "keep\n"
    assert sorted(p.name for p in directory.iterdir()) == ["out.txt"]  # no temporary file left


FIELDS = sorted(f for f in TransformerConfig.__dataclass_fields__)
values = st.one_of(
    st.integers(-3, 3000).map(str), st.sampled_from(["nan", "inf", "-inf", "1e-9", "0.0", "-0.5", "0.99", "1", "true",
                                                    "false", "", "relu", "pre", "1_000", " 8", "0x10"]),
    st.floats(allow_nan=True, allow_infinity=True).map(repr), st.text(max_size=8),
)


@MANY
@given(field=st.sampled_from(FIELDS), value=values)
def test_random_set_values_make_a_valid_config_or_one_error(field, value, capsys):
    try:
        cfg, _ = run.parse_config(["--set", f"{field}={value}"])
    except SystemExit as exit_info:
        err = capsys.readouterr().err
        assert exit_info.code == 2 and "Traceback" not in err
        assert [line for line in err.splitlines() if "error:" in line] == [err.strip().splitlines()[-1]]
        return
    model = cfg.model_config(400, 400)  # what the run would build: valid, or parse_config had refused
    assert isinstance(model, TransformerConfig)


@MANY
@given(field=st.sampled_from(sorted(ExperimentConfig.__dataclass_fields__) + ["unknown_field"]),
       value=st.none() | st.booleans() | st.integers(-5, 10**6) | st.floats() | st.text(max_size=6)
       | st.lists(st.integers(), max_size=2) | st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
def test_a_hand_edited_config_json_loads_or_is_named(tmp_path_factory, field, value):
    run_dir = tmp_path_factory.mktemp("edited")
    saved = ExperimentConfig().resolve().experiment()
    saved[field] = value
    (run_dir / "config.json").write_text(json.dumps(saved))  # NaN as Python writes it, as an editor might
    before = (run_dir / "config.json").read_bytes()
    try:
        runtime.read_experiment(run_dir)
    except runtime.UserError as err:
        assert str(err).startswith(str(run_dir / "config.json")) and "\n" not in str(err)
    assert (run_dir / "config.json").read_bytes() == before
