"""n-best lists, output formats, alignments, forced prefixes and scoring through the library
(`Run.translate`, `Run.score`) and the commands (`aiayn translate`, `aiayn score`), on the
session's 2-step torch run and its conversion to JAX. The searches themselves are compared
across frameworks in tests/parity/test_decode.py; here: the plumbing, both backends alike, and
every bad combination as one error line.
"""

from __future__ import annotations

import gc
import json
import math
import re
import weakref

import pytest

import train
from train import data
from train.commands import score, translate
from train.runtime import UserError

from .cli import run_cli

TEXTS = [data.number_words(n)[0] for n in (7, 43, 512, 21)]


def one_error(code, err, *fragments):
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1 and lines[0].startswith("error: "), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, err)


@pytest.fixture
def runs(tiny_torch_and_jax_runs):
    """(torch run dir, the same weights as a JAX run dir)."""
    return tiny_torch_and_jax_runs


def test_n_best_prefix_and_score_are_the_same_through_both_backends(runs):
    """n-best 3 of beam 3 with a prefix on one sentence: the same texts and tokens from the torch and
    the JAX backend, log-probs and scores to 1e-5 (sums of float32 log-probs, as in the parity
    tests); the first hypothesis is the plain translation; `score` of each best output's text
    gives its log-prob back (to 1e-4: the sum is taken in another order), and agrees across backends."""
    prefixes = [None, "seven", None, ""]
    results = {}
    for run_dir in runs:
        with train.load(run_dir) as run:
            hyps = run.translate(TEXTS, beam=3, n_best=3, prefix=prefixes)
            plain = run.translate(TEXTS, beam=3, prefix=prefixes)
            scored = run.score(TEXTS, [h[0].text for h in hyps])
            results[run.config.backend] = hyps, scored
        assert [h[0].text for h in hyps] == plain
        assert all(len(h) == 3 and h[0].score >= h[1].score >= h[2].score for h in hyps)
        assert hyps[1][0].text.startswith("seven") and hyps[1][2].text.startswith("seven")
        for h, s in zip(hyps, scored):
            if [t for t in s["tokens"][:-1]] == h[0].tokens:  # the text re-tokenizes to the same tokens
                assert abs(s["logprob"] - h[0].logprob) <= 1e-4
            assert s["tokens"][-1] == "<eos>" and len(s["token_logprobs"]) == len(s["tokens"])
    (torch_hyps, torch_scored), (jax_hyps, jax_scored) = results["torch"], results["jax"]
    for mine, theirs in zip(torch_hyps, jax_hyps):
        assert [(h.text, h.tokens) for h in mine] == [(h.text, h.tokens) for h in theirs]
        for a, b in zip(mine, theirs):
            assert abs(a.logprob - b.logprob) <= 1e-5 and abs(a.score - b.score) <= 1e-5
    for a, b in zip(torch_scored, jax_scored):
        assert abs(a["logprob"] - b["logprob"]) <= 1e-5


def test_greedy_n_best_one_and_alignments(tiny_torch_run):
    with train.load(tiny_torch_run) as run:
        (best,) = run.translate(TEXTS[:1], beam=1, n_best=1, alignments=True)
        assert best[0].text == run.translate(TEXTS[0], beam=1)
        penalty = ((5 + len(best[0].tokens) + 1) / 6) ** 0.6  # the GNMT penalty of tokens + <eos>
        assert math.isclose(best[0].score, best[0].logprob / penalty, rel_tol=1e-6)
        source_length = len(data.encode(run.tokenizers.src, TEXTS[:1])[0])
        assert len(best[0].alignment) == len(best[0].tokens)
        assert all(0 <= a < source_length for a in best[0].alignment)


def test_jsonl_tsv_and_text_formats_write_one_line_per_input_line(tiny_torch_run, tmp_path, capsys):
    lines = [TEXTS[0], "", TEXTS[1]]
    (tmp_path / "in.txt").write_text("".join(t + "\n" for t in lines))
    base = ["--run-dir", str(tiny_torch_run), "--input", str(tmp_path / "in.txt"), "--beam", "2"]
    code, out, _ = run_cli(translate.main, capsys, *base, "--n-best", "2", "--format", "jsonl", "--alignments")
    records = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and len(records) == 3 and records[1]["hypotheses"] == []
    for record in (records[0], records[2]):
        assert len(record["hypotheses"]) == 2 and record["source_tokens"][-1] == "<eos>"
        for h in record["hypotheses"]:
            assert set(h) == {"text", "logprob", "score", "tokens", "alignment"}
            assert len(h["alignment"]) == len(h["tokens"])
            assert all(0 <= a < len(record["source_tokens"]) for a in h["alignment"])
    code, out, _ = run_cli(translate.main, capsys, *base, "--n-best", "2", "--format", "tsv")
    rows = out.split("\n")[:-1]
    assert code == 0 and len(rows) == 3 and rows[1] == "" and len(rows[0].split("\t")) == 6
    assert rows[0].split("\t")[0] == records[0]["hypotheses"][0]["text"]
    assert float(rows[0].split("\t")[1]) == records[0]["hypotheses"][0]["logprob"]
    code, out, _ = run_cli(translate.main, capsys, *base)
    assert code == 0 and out.split("\n")[:-1] == [rows[0].split("\t")[0], "", rows[2].split("\t")[0]]


def test_a_tsv_input_forces_each_rows_prefix_and_resumes_by_rows(tiny_torch_run, tmp_path, capsys):
    rows = ["source\tprefix", f"{TEXTS[0]}\tfour", f"{TEXTS[1]}\t", f"{TEXTS[2]}\tnine hundred"]
    (tmp_path / "in.tsv").write_text("".join(r + "\n" for r in rows))
    out_file = tmp_path / "out.txt"
    code, _, err = run_cli(translate.main, capsys, "--run-dir", str(tiny_torch_run), "--input", str(tmp_path / "in.tsv"),
                           "--beam", "1", "--output", str(out_file), "--chunk-lines", "2")
    outputs = out_file.read_text().split("\n")[:-1]
    assert code == 0 and len(outputs) == 3, err
    assert outputs[0].startswith("four") and outputs[2].startswith("nine hundred")
    with train.load(tiny_torch_run) as run:
        assert outputs[1] == run.translate(TEXTS[1], beam=1)


@pytest.mark.parametrize("args, fragments", [
    (["--beam", "2", "--n-best", "3"], ["--n-best must be between 1 and --beam (2), got 3"]),
    (["--beam", "2", "--n-best", "2"], ["--n-best 2 gives several translations per input line: give --format tsv"]),
    (["--alignments", "--format", "tsv"], ["--alignments are written with --format jsonl"]),
])
def test_bad_combinations_of_flags_are_one_error_line(tiny_torch_run, tmp_path, capsys, args, fragments):
    (tmp_path / "in.txt").write_text(TEXTS[0] + "\n")
    code, _, err = run_cli(translate.main, capsys, "--run-dir", str(tiny_torch_run), "--input",
                           str(tmp_path / "in.txt"), *args)
    one_error(code, err, *fragments)


@pytest.mark.parametrize("rows, fragments", [
    (["text\tprefix", "eins\t"], ["no column 'source' in the header row"]),
    (["source\tprefix", "eins\tone", "zwei"], ["line 3 has 1 columns, the header (line 1) has 2"]),
    (["source\tprefix", "eins\t" + " ".join(["one"] * 20)], ["prefix of sentence 1 has 20 tokens",
                                                             "its output may have at most"]),
])
def test_bad_tsv_input_and_prefixes_are_one_error_line(tiny_torch_run, tmp_path, capsys, rows, fragments):
    (tmp_path / "in.tsv").write_text("".join(r + "\n" for r in rows))
    code, _, err = run_cli(translate.main, capsys, "--run-dir", str(tiny_torch_run), "--input", str(tmp_path / "in.tsv"))
    one_error(code, err, *fragments)


def test_a_prefix_with_pieces_the_vocabulary_lacks_is_refused():
    """Byte-level BPE has no <unk>; a SentencePiece vocabulary (an imported Marian model) may."""
    from types import SimpleNamespace

    from train.translation import encode_prefixes

    class Pieces:  # unknown words become <unk>
        def encode_batch(self, texts):
            return [SimpleNamespace(ids=[5 if w == "one" else data.UNK_ID for w in t.split()] + [data.EOS_ID])
                    for t in texts]

    assert encode_prefixes(Pieces(), ["one one", None], 2) == [[5, 5], []]
    with pytest.raises(UserError, match="prefix of sentence 2 \\('one \u2603'\\) has pieces the target vocabulary lacks"):
        encode_prefixes(Pieces(), ["one", "one \u2603"], 2)


def test_a_prefix_holding_a_written_special_token_is_text(tiny_torch_run):
    """'<bos> seven' forced <bos> (the twins then scored it 1e9 apart), '<pad> x' left its first position
    free, and '<eos>' was dropped: typed special tokens are now text, encoded as their characters."""
    from train.translation import encode_prefixes

    with train.load(tiny_torch_run) as run:
        prefixes = ["<bos> seven", "<pad> seven", "seven <eos> three"]
        for row, text in zip(encode_prefixes(run.tokenizers.tgt, prefixes, 3), prefixes):
            assert not {data.PAD_ID, data.BOS_ID, data.EOS_ID, data.UNK_ID} & set(row)
            assert data.decode(run.tokenizers.tgt, row) == text


def test_python_api_refuses_bad_combinations(tiny_torch_run):
    with train.load(tiny_torch_run) as run:
        with pytest.raises(UserError, match=r"^n_best must be between 1 and beam \(4\), got 5"):
            run.translate(TEXTS, n_best=5)
        with pytest.raises(UserError, match="1 prefixes for 4 sentences"):
            run.translate(TEXTS, prefix=["one"])
        with pytest.raises(UserError, match="2 sources and 1 targets"):
            run.score(TEXTS[:2], ["one"])
        with pytest.raises(UserError, match="target 1 has 31 tokens with <eos>, more than the model's max_len 16"):
            run.score(TEXTS[:1], [" ".join(["one"] * 30)])


def test_python_api_refuses_bad_search_settings_before_any_work(tiny_torch_run):
    """A beam of 0 was an IndexError deep in the search, -1 a RuntimeError, 2.5 a TypeError; evaluate
    met them only after computing the loss."""
    pairs = list(zip(TEXTS, TEXTS))
    with train.load(tiny_torch_run) as run:
        for options, message in (({"beam": 0}, "beam must be >= 1, got 0"), ({"beam": -1}, "beam must be >= 1"),
                                 ({"beam": 2.5}, "beam must be an integer, got 2.5"),
                                 ({"alpha": -1}, "alpha must be in [0, 10), got -1"),
                                 ({"alpha": "0.6"}, "alpha must be a number, got '0.6'"),
                                 ({"scoring": "best"}, "scoring must be one of gnmt, hf, got 'best'")):
            with pytest.raises(UserError, match=f"^{re.escape(message)}"):
                run.translate(TEXTS, **options)
            with pytest.raises(UserError, match=f"^{re.escape(message)}"):
                run.evaluate(pairs, **options)


def test_python_api_names_a_decoding_number_of_the_wrong_type(tiny_torch_run):
    """n_best=2.5, batch_size=1.5 or "2", temperature="1" were TypeErrors from deep inside (slice
    indices, '>=' not supported); n_best=True was a 1-best list."""
    with train.load(tiny_torch_run) as run:
        for options, error, message in (
                ({"n_best": 2.5}, UserError, "n_best must be an integer, got 2.5"),
                ({"n_best": True}, UserError, "n_best must be an integer, got True"),
                ({"batch_size": 1.5}, ValueError, "batch_size must be an integer, got 1.5"),
                ({"batch_size": "2"}, ValueError, "batch_size must be an integer, got '2'"),
                ({"sample": True, "temperature": "1"}, UserError, "temperature must be a number, got '1'"),
                ({"sample": True, "top_p": None}, UserError, "top_p must be a number, got None"),
                ({"sample": True, "top_p": 2}, UserError, "top_p must be in (0, 1], got 2")):
            with pytest.raises(error, match=f"^{re.escape(message)}$"):
                run.translate(TEXTS, **options)
        with pytest.raises(ValueError, match="^batch_size must be an integer, got 1.5$"):
            run.score(TEXTS, TEXTS, batch_size=1.5)


def test_python_api_names_a_text_that_is_not_a_string(tiny_torch_run):
    """A number or None among the texts was a TypeError from the tokenizer naming neither the text
    nor its position ('TextEncodeInput must be Union[TextInputSequence, ...]')."""
    with train.load(tiny_torch_run) as run:
        for call, message in ((lambda: run.translate([TEXTS[0], None]), "text 2 is None (NoneType), not a string"),
                              (lambda: run.score([7], ["seven"]), "text 1 is 7 (int), not a string"),
                              (lambda: run.evaluate([(TEXTS[0], 7.0)]), "text 1 is 7.0 (float), not a string")):
            with pytest.raises(UserError, match=f"^{re.escape(message)}$"):
                call()


def test_a_closed_run_lets_go_of_its_weights_and_refuses_use(tiny_torch_run):
    """Run.close promised to free the backend's devices, yet the run kept its weights and went on
    translating; an ensemble's members alike."""
    for run in (train.load(tiny_torch_run), train.load([tiny_torch_run, tiny_torch_run])):
        backends = [weakref.ref(r.backend) for r in (run, *run.members)]
        with run:
            assert isinstance(run.translate(TEXTS[0], beam=1), str)
        gc.collect()
        assert [b() for b in backends] == [None] * len(backends)
        for use in (lambda: run.translate(TEXTS), lambda: run.score(TEXTS, TEXTS), lambda: run.step):  # noqa: B023
            with pytest.raises(UserError, match=r"^the run .* is closed \(Run.close\): train.load it again to use it$"):
                use()
        run.close()  # twice: no error


def test_a_run_and_its_tokenizers_print_in_one_short_line(tiny_torch_run):
    # On main print(train.load(RUN)) wrote 12,000-20,000 characters: both tokenizers and the whole history.
    run = train.load(tiny_torch_run)
    m = run.model_config
    assert repr(run) == (f"Run({str(tiny_torch_run)!r}, step 2, torch, d_model {m.d_model} x {m.num_heads} heads, "
                         f"1+1 layers, d_ff {m.d_ff}, vocabulary {m.src_vocab_size}/{m.tgt_vocab_size})")
    src, tgt = run.tokenizers.src.get_vocab_size(), run.tokenizers.tgt.get_vocab_size()
    assert repr(run.tokenizers) == (f"Tokenizers(joint, {src} tokens)" if run.tokenizers.joint else
                                    f"Tokenizers(source {src} tokens, target {tgt} tokens)")
    run.close()
    assert repr(run).startswith(f"Run({str(tiny_torch_run)!r}, closed, torch, ")
    with train.load([tiny_torch_run, tiny_torch_run]) as pair:
        assert repr(pair).endswith(f", an ensemble with {tiny_torch_run})") and len(repr(pair)) < 300


def test_score_command_prints_one_line_per_pair(tiny_torch_run, tmp_path, capsys):
    (tmp_path / "pairs.tsv").write_text("source\ttarget\n" + "".join(f"{t}\tseven\n" for t in TEXTS[:3]))
    args = ["--run-dir", str(tiny_torch_run), "--input", str(tmp_path / "pairs.tsv")]
    code, out, err = run_cli(score.main, capsys, *args)
    sums = [float(x) for x in out.split()]
    assert code == 0 and len(sums) == 3 and all(x < 0 for x in sums) and "scored 3 pairs" in err
    code, out, _ = run_cli(score.main, capsys, *args, "--format", "jsonl")
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["tokens"][-1] for r in records] == ["<eos>"] * 3
    assert all(abs(r["logprob"] - s) <= 1e-4 * abs(s) for r, s in zip(records, sums))
    code, _, err = run_cli(score.main, capsys, "--run-dir", str(tiny_torch_run), "--input", str(tmp_path / "no.tsv"))
    one_error(code, err, "no.tsv")


def test_score_command_writes_a_new_output_file_and_never_over_its_input(tiny_torch_run, tmp_path, capsys):
    pairs = tmp_path / "pairs.tsv"
    pairs.write_text("source\ttarget\n" + "".join(f"{t}\tseven\n" for t in TEXTS[:3]))
    args = ["--run-dir", str(tiny_torch_run), "--input", str(pairs)]
    code, printed, _ = run_cli(score.main, capsys, *args)
    code_file, out, _ = run_cli(score.main, capsys, *args, "--output", str(tmp_path / "scores.txt"))
    assert code == code_file == 0 and out == "" and (tmp_path / "scores.txt").read_text() == printed
    before = pairs.read_text()
    code, _, err = run_cli(score.main, capsys, *args, "--output", str(pairs))
    one_error(code, err, f"is a file of the input {pairs}: writing it would destroy the data (or a file written beside it); give "
                     "another --output")
    assert pairs.read_text() == before
    code, _, err = run_cli(score.main, capsys, *args, "--output", str(tmp_path / "no" / "scores.txt"))
    one_error(code, err, "does not exist")
