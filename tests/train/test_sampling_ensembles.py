"""Sampling and ensembles through the library (`Run.translate(sample=True)`, `train.load([a, b])`)
and the command (`aiayn translate --sample`, `--run-dir A --run-dir B`), on the session's 2-step
torch run and its conversion to JAX. The samplers and ensembles themselves are compared across
frameworks in tests/parity; here: the plumbing, both backends alike, and every bad combination as
one error line.
"""

from __future__ import annotations

import json
import shutil

import pytest

import train
from train import data
from train.commands import evaluate, score, translate
from train.options import ENSEMBLE_AVERAGES, Sampling
from train.runtime import UserError

from .cli import run_cli
from .test_decoding_options import TEXTS, one_error

SETTINGS = {"num_samples": 3, "seed": 7, "temperature": 1.5, "top_k": 20, "top_p": 0.95}


@pytest.fixture
def runs(tiny_torch_and_jax_runs):
    """(torch run dir, the same weights as a JAX run dir)."""
    return tiny_torch_and_jax_runs


def _key(hyps):
    return [[(h.text, h.tokens) for h in sentence] for sentence in hyps]


def _samples(run_dir, **changes):
    with train.load(run_dir) as run:
        return run.translate(TEXTS, sample=True, **{**SETTINGS, **changes})


# JAX compiles a program per search, shape and ensemble: ~25 s on 2 shared cores.
@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_samples_are_the_same_in_both_backends_and_follow_the_seed(runs, backend):
    """Three samples of each text: the same tokens from torch and JAX for one seed, log-probs to 1e-5
    (sums of float32 log-probs, as in the parity tests); the same again for the seed, whatever the
    batching (one sentence a batch); other samples for another seed."""
    run_dir = runs[backend == "jax"]
    with train.load(run_dir) as run:
        hyps = run.translate(TEXTS, sample=True, **SETTINGS)
        assert _key(run.translate(TEXTS, sample=True, batch_size=1, **SETTINGS)) == _key(hyps)
        assert _key(run.translate(TEXTS, sample=True, **{**SETTINGS, "seed": 8})) != _key(hyps)
        one = run.translate(TEXTS, sample=True, seed=7)  # one sample: plain strings, as a search gives
        assert isinstance(one, list) and all(isinstance(t, str) for t in one)
        if backend == "torch":  # alignments of samples: one source position per sampled token
            aligned = run.translate(TEXTS, sample=True, seed=7, alignments=True)
            assert [h[0].text for h in aligned] == one
            assert all(len(h[0].alignment) == len(h[0].tokens) for h in aligned)
    assert all(len(h) == 3 and all(x.score == x.logprob < 0 for x in h) for h in hyps)
    if backend == "jax":
        reference = _samples(runs[0])
        assert _key(hyps) == _key(reference)
        for mine, theirs in zip(hyps, reference):
            assert all(abs(a.logprob - b.logprob) <= 1e-5 for a, b in zip(mine, theirs))


def test_sample_command_writes_the_apis_samples(tiny_torch_run, tmp_path, capsys):
    (tmp_path / "in.txt").write_text("".join(t + "\n" for t in TEXTS))
    base = ["--run-dir", str(tiny_torch_run), "--input", str(tmp_path / "in.txt"), "--sample", "--seed", "7",
            "--num-samples", "3", "--temperature", "1.5", "--top-k", "20", "--top-p", "0.95"]
    code, out, _ = run_cli(translate.main, capsys, *base, "--format", "jsonl", "--chunk-lines", "1")
    assert code == 0
    records = [json.loads(line) for line in out.splitlines()]
    with train.load(tiny_torch_run) as run:
        hyps = run.translate(TEXTS, sample=True, **SETTINGS)
    # Chunks of one line: the samples are keyed by input line, not by position in the chunk.
    assert [[h["text"] for h in r["hypotheses"]] for r in records] == [[h.text for h in s] for s in hyps]
    code, out, _ = run_cli(translate.main, capsys, *base[:-8], "--format", "text")
    with train.load(tiny_torch_run) as run:
        assert out.splitlines() == run.translate(TEXTS, sample=True, seed=7)


@pytest.mark.parametrize("args, fragments", [
    (["--sample", "--n-best", "2", "--format", "tsv"], ["--sample with --n-best"]),
    (["--sample", "--scoring", "hf"], ["--sample with --scoring hf"]),
    (["--sample", "--top-p", "0"], ["--top-p must be in (0, 1], got 0"]),
    (["--sample", "--top-p", "1.5"], ["--top-p must be in (0, 1], got 1.5"]),
    (["--sample", "--temperature", "0"], ["--temperature must be > 0, got 0"]),
    (["--sample", "--top-k", "-1"], ["--top-k must be >= 0, got -1"]),
    (["--sample", "--num-samples", "0"], ["--num-samples must be >= 1, got 0"]),
    (["--sample", "--num-samples", "2"], ["--num-samples 2 gives several translations", "tsv or jsonl"]),
    (["--top-k", "5", "--seed", "1"], ["--top-k, --seed without --sample"]),
    (["--temperature", "0.5"], ["--temperature without --sample"]),
    (["--seed", "0", "--top-k", "0"], ["--top-k, --seed without --sample"]),  # zeros are given too
    (["--top-p", "0.5"], ["--top-p without --sample"]),
])
def test_bad_sampling_flags_are_one_error_line(tiny_torch_run, tmp_path, capsys, args, fragments):
    (tmp_path / "in.txt").write_text(TEXTS[0] + "\n")
    code, _, err = run_cli(translate.main, capsys, "--run-dir", str(tiny_torch_run), "--input",
                           str(tmp_path / "in.txt"), *args)
    one_error(code, err, *fragments)


def test_sampling_refuses_a_tsv_prefix_column_and_the_api_its_bad_settings(tiny_torch_run, tmp_path, capsys):
    (tmp_path / "in.tsv").write_text("source\tprefix\n" + TEXTS[0] + "\tseven\n")
    code, _, err = run_cli(translate.main, capsys, "--run-dir", str(tiny_torch_run), "--input",
                           str(tmp_path / "in.tsv"), "--sample")
    one_error(code, err, "--sample with prefixes: forced prefixes are for the searches")
    with train.load(tiny_torch_run) as run:
        for kwargs, fragment in [({"top_k": 3}, "top_k without sample: sampling settings"),
                                 ({"seed": 0, "top_p": 1.0}, "top_p, seed without sample"),  # as the command's
                                 ({"sample": Sampling(), "seed": 1}, "sample: give a Sampling or its fields"),
                                 ({"sample": True, "prefix": ["one"]}, "forced prefixes are for the searches"),
                                 ({"sample": True, "n_best": 2}, "sample with n_best"),
                                 ({"sample": True, "top_p": 2.0}, "top_p must be in (0, 1], got 2"),
                                 ({"sample": True, "seed": 1.5}, "seed must be an integer, got 1.5")]:
            with pytest.raises(UserError, match="^.*$") as info:
                run.translate(TEXTS[:1], **kwargs)
            assert fragment in str(info.value) and "\n" not in str(info.value)


def _ensemble_outputs(run_dirs):
    with train.load(run_dirs) as run:
        return (run.translate(TEXTS, beam=1), run.translate(TEXTS, beam=2, n_best=2), run.score(TEXTS, TEXTS),
                run.evaluate(list(zip(TEXTS, TEXTS)), beam=1)["loss"])


# JAX compiles a program per search, shape and ensemble: ~25 s on 2 shared cores.
@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_an_ensemble_of_a_model_twice_translates_as_the_model(runs, backend):
    """load([A, A]) averages a model's log-probabilities with themselves: greedy and beam tokens as
    load(A)'s, scores and the evaluation loss to 1e-5 (float32 rounding of the mean and the
    renormalisation); samples alike; JAX's ensemble gives torch's tokens."""
    run_dir = runs[backend == "jax"]
    greedy, beams, scored, loss = _ensemble_outputs(run_dir)
    with train.load([run_dir, run_dir]) as pair:
        assert abs(pair.evaluate(list(zip(TEXTS, TEXTS)), beam=1)["loss"] - loss) <= 1e-5
        assert pair.steps == [2, 2] and pair.step == 2
        assert pair.translate(TEXTS, beam=1) == greedy
        pair_beams = pair.translate(TEXTS, beam=2, n_best=2)
        assert _key(pair_beams) == _key(beams)
        for mine, theirs in zip(pair_beams, beams):
            assert all(abs(a.score - b.score) <= 1e-5 for a, b in zip(mine, theirs))
        for mine, theirs in zip(pair.score(TEXTS, TEXTS), scored):
            assert abs(mine["logprob"] - theirs["logprob"]) <= 1e-5
        if backend == "torch":  # sampling's program compiles once more in JAX: torch's alone keeps this fast
            assert _key(pair.translate(TEXTS, sample=True, **SETTINGS)) == _key(_samples(run_dir))
        with pytest.raises(UserError, match="alignments with an ensemble"):
            pair.translate(TEXTS, alignments=True)
    if backend == "jax":
        assert _key(pair_beams) == _key(_ensemble_outputs([runs[0], runs[0]])[1])


def test_ensemble_command_and_refusals(runs, tmp_path, capsys, monkeypatch):
    torch_dir, jax_dir = runs
    (tmp_path / "in.txt").write_text("".join(t + "\n" for t in TEXTS))
    closed = []
    real_close = train.api.Run.close
    monkeypatch.setattr(train.api.Run, "close", lambda self: closed.append(self) or real_close(self))
    code, out, _ = run_cli(translate.main, capsys, "--run-dir", str(torch_dir), "--run-dir", str(torch_dir),
                           "--input", str(tmp_path / "in.txt"), "--beam", "2")
    assert len(closed) == 2  # the ensemble and its second member: every backend the command loaded is freed
    monkeypatch.undo()
    with train.load(torch_dir) as run:
        assert code == 0 and out.splitlines() == run.translate(TEXTS, beam=2)
    (tmp_path / "pairs.tsv").write_text("source\ttarget\n" + "".join(f"{t}\t{t}\n" for t in TEXTS))
    code, out, _ = run_cli(score.main, capsys, "--run-dir", str(torch_dir), "--run-dir", str(torch_dir),
                           "--input", str(tmp_path / "pairs.tsv"))
    code_one, out_one, _ = run_cli(score.main, capsys, "--run-dir", str(torch_dir), "--input", str(tmp_path / "pairs.tsv"))
    assert code == code_one == 0 and len(out.splitlines()) == len(TEXTS)
    for mine, theirs in zip(out.splitlines(), out_one.splitlines()):  # the mean of equal log-probs, to 1e-5
        assert abs(float(mine) - float(theirs)) <= 1e-5
    code, out, _ = run_cli(score.main, capsys, "--run-dir", str(torch_dir), "--run-dir", str(torch_dir),
                           "--ensemble-average", "prob", "--input", str(tmp_path / "pairs.tsv"))
    assert code == 0 and len(out.splitlines()) == len(TEXTS)
    for mine, theirs in zip(out.splitlines(), out_one.splitlines()):  # the log of the mean of equal probs
        assert abs(float(mine) - float(theirs)) <= 1e-5
    with train.load([torch_dir, torch_dir], average="prob") as pair:
        assert pair.backend.model.average == "prob"
    for dirs in ([torch_dir, torch_dir], torch_dir):  # one run too: refused, not ignored
        with pytest.raises(UserError, match="average must be one of logprob, prob, got 'max'"):
            train.load(dirs, average="max")
    pairs = ["--data", str(tmp_path / "pairs.tsv"), "--beam", "2"]
    code, out, _ = run_cli(evaluate.main, capsys, "--run-dir", str(torch_dir), "--run-dir", str(torch_dir), *pairs)
    code_one, out_one, _ = run_cli(evaluate.main, capsys, "--run-dir", str(torch_dir), *pairs)
    pair, one = json.loads(out), json.loads(out_one)
    assert code == code_one == 0 and pair["ensemble"] == [str(torch_dir)] and pair["steps"] == [2, 2]
    assert "ensemble" not in one and abs(pair["loss"] - one["loss"]) <= 1e-5  # the mean of equal log-probs
    assert pair["bleu"] == one["bleu"] and pair["samples"] == one["samples"]  # the same tokens
    code, _, err = run_cli(translate.main, capsys, "--run-dir", str(torch_dir), "--run-dir", str(torch_dir),
                           "--input", str(tmp_path / "in.txt"), "--alignments", "--format", "jsonl")
    one_error(code, err, "--alignments with an ensemble")
    code, _, err = run_cli(translate.main, capsys, "--run-dir", str(torch_dir), "--run-dir", str(jax_dir),
                           "--input", str(tmp_path / "in.txt"))
    one_error(code, err, f"{jax_dir} is a jax run", "aiayn convert --to torch")

    other = shutil.copytree(torch_dir, tmp_path / "other")  # the same model over another vocabulary: 2 ids swapped
    tokenizer = json.loads((other / data.JOINT_TOKENIZER).read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["!"], vocab['"'] = vocab['"'], vocab["!"]
    (other / data.JOINT_TOKENIZER).write_text(json.dumps(tokenizer))
    with pytest.raises(UserError) as info:
        train.load([torch_dir, other])
    assert f"{other} has another vocabulary than {torch_dir}" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(UserError, match="an ensemble needs at least one run directory"):
        train.load([])
    with train.load([torch_dir]) as alone, train.load(torch_dir) as run:  # a list of one: the run, not an ensemble
        assert alone.members == [] and alone.step == 2
        assert alone.translate(TEXTS, beam=2, alignments=True) == run.translate(TEXTS, beam=2, alignments=True)


def test_the_commands_offer_the_twins_averages():
    from jax_transformer import ensemble as jax_ensemble
    from torch_reference import ensemble as torch_ensemble

    assert ENSEMBLE_AVERAGES == torch_ensemble.AVERAGES == jax_ensemble.AVERAGES
