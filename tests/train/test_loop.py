"""The training loop end to end: short runs on both backends, resume, run directories, Multi30k,
and the translate/evaluate commands on a trained run."""

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

import train
from train import data, loop, runtime, training, translation
from train.commands import evaluate, translate
from train.config import ExperimentConfig
from train.data.batches import fixed_lengths

REPO = Path(__file__).resolve().parents[2]
RESULT_KEYS = {"backend", "run_dir", "steps", "num_params", "train", "valid", "test", "best", "averaged_steps",
               "wall_time_s", "config", "model", "history", "compiled_programs", "compile_seconds", "compile_cache_hits"}
EVAL_KEYS = {"step", "loss", "nll", "ppl", "bleu", "bleu_signature", "chrf", "chrf_signature", "bleu_lc",
             "bleu_lc_signature", "exact_match", "tokens", "sentences", "bands"}


@pytest.fixture(scope="module", params=["jax", "torch"])
def short_run(request, tmp_path_factory):
    """A 60-step run on a small numbers corpus: (config, results)."""
    run_dir = tmp_path_factory.mktemp(f"short-{request.param}") / "run"
    cfg = ExperimentConfig(
        backend=request.param, run_dir=str(run_dir), numbers_train=1500, numbers_valid=40, numbers_test=40,
        max_len=16, token_budget=512, model={"num_encoder_layers": 1, "num_decoder_layers": 1},
        steps=60, warmup=15, eval_every=10, log_every=10, eval_sentences=20, samples=2, progress=False,
    )
    return cfg, loop.train(cfg)


BOTH = ["torch", "jax"]  # the JAX run: ~45 s, mostly compiling


@pytest.mark.parametrize("short_run", BOTH, indirect=True)
def test_short_run_learns_and_writes_results(short_run, capsys):
    cfg, results = short_run
    run_dir = Path(cfg.run_dir)
    on_disk = json.loads((run_dir / "results.json").read_text())
    assert on_disk == json.loads(json.dumps(results))  # what train() returned is what it wrote
    assert set(results) == RESULT_KEYS
    compiles = (results["compiled_programs"], results["compile_seconds"], results["compile_cache_hits"])
    if cfg.backend == "torch":  # torch compiles nothing
        assert compiles == (None, None, None)
    else:
        assert compiles[0] >= 1 and compiles[1] > 0 and compiles[2] >= 0, compiles
    assert set(results["valid"]) == EVAL_KEYS and set(results["test"]) == EVAL_KEYS
    assert (results["backend"], results["steps"], results["test"]["sentences"]) == (cfg.backend, 60, 40)
    # --eval-sentences 20 limits validation only: the test set is scored whole.
    assert results["valid"]["sentences"] == 20 and results["test"]["sentences"] == cfg.numbers_test
    test, corpus = results["test"], data.load_splits(cfg)
    assert {b: v["sentences"] for b, v in test["bands"].items()} == {str(d): 6 + (d > 2) for d in range(1, 7)}
    train_sources = {s for s, _ in corpus.train}
    for band, scores in test["bands"].items():  # seen: the test numbers below 100 (all are training numbers)
        in_band = [s for s, e in corpus.test if loop.data.number_band(loop.data.number_from_english(e)) == int(band)]
        assert scores["seen"] == sum(s in train_sources for s in in_band) == (len(in_band) if int(band) <= 2 else 0)
    total = sum(v["exact_match"] * v["sentences"] for v in test["bands"].values()) / test["sentences"]
    assert test["exact_match"] == pytest.approx(total)
    assert "case:mixed" in test["bleu_signature"] and "case:lc" in test["bleu_lc_signature"]
    line = loop._summary_line(results)
    assert f"test (40 sentences) BLEU {test['bleu']:.2f}" in line and f"exact {test['exact_match']:.1f}% by digits 1:" in line
    valid = results["history"]["valid"]
    assert [v["step"] for v in valid] == [10, 20, 30, 40, 50, 60]
    # Learning: the validation loss falls well below where it stood after 10 steps and far below a
    # uniform guess over the 400-token vocabulary (ln 400 = 6.0). Measured on the corpus spread over
    # every band: 3.7 -> 2.2 (torch; at --lr-factor 2 the loss stalled at 3.7); the two backends
    # start from different random weights.
    assert valid[-1]["loss"] < valid[0]["loss"] - 0.8 and valid[-1]["loss"] < math.log(400) - 2.5
    assert results["valid"]["ppl"] == pytest.approx(math.exp(results["valid"]["nll"]))
    assert results["valid"]["nll"] < results["valid"]["loss"]  # smoothing adds ε·mean(-log p)
    train = results["history"]["train"]
    assert [t["step"] for t in train] == [10, 20, 30, 40, 50, 60] and train[-1]["loss"] < train[0]["loss"]
    assert results["train"]["tokens_per_s"] > 0 and results["best"]["step"] in [v["step"] for v in valid]
    # Run directory contents; checkpoints: the newest two plus the best by BLEU.
    names = {p.name for p in run_dir.iterdir()}
    assert {"config.json", "model.json", "tokenizer.json", "checkpoints", "tensorboard", "results.json"} <= names
    assert any(p.name.startswith("events.out.tfevents") for p in (run_dir / "tensorboard").iterdir())
    assert results["averaged_steps"] == [50, 60]  # the numbers corpus's run ends with the mean of its last two
    kept = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert kept == sorted({50, 60, results["best"]["step"]})
    # config.json holds the experiment; the launch options (run dir, steps, intervals) are not saved.
    saved = json.loads((run_dir / "config.json").read_text())
    resolved = cfg.resolve().replace(dtype="float32")  # the run fills --dtype in from the platform: the CPU's
    assert saved == resolved.experiment() and not set(saved) & set(ExperimentConfig.launch_fields())
    assert runtime.read_experiment(run_dir) == resolved.replace(**{
        name: getattr(ExperimentConfig(), name) for name in ExperimentConfig.launch_fields()
    })


def test_curves_never_draws_over_the_results_it_reads(run_copy, capsys):
    """aiayn curves --out RUN/results.json (or a link to it) is refused: it wrote the PNG over the run's results."""
    from train.commands import curves

    results = (run_copy / runtime.RESULTS_FILE).read_bytes()
    (run_copy / "link.json").symlink_to(runtime.RESULTS_FILE)
    for out in (runtime.RESULTS_FILE, "link.json"):
        code = curves.main(["--run-dir", str(run_copy), "--out", str(run_copy / out)])
        assert code == 1
        assert f"lies inside the run {run_copy}: a command never writes into a run" in capsys.readouterr().err
    assert (run_copy / runtime.RESULTS_FILE).read_bytes() == results


def test_curves_writes_the_format_its_name_says(tiny_torch_run, tmp_path, capsys):
    """--out c.svg is an SVG, c.pdf a PDF, a name without a suffix a PNG; c.txt is refused (it got PNG bytes)."""
    from train.commands import curves

    for name, magic in (("c.svg", b"<?xml"), ("c.pdf", b"%PDF"), ("c", b"\x89PNG")):
        assert curves.main(["--run-dir", str(tiny_torch_run), "--out", str(tmp_path / name)]) == 0
        assert (tmp_path / name).read_bytes().startswith(magic), name
    capsys.readouterr()
    code = curves.main(["--run-dir", str(tiny_torch_run), "--out", str(tmp_path / "c.txt")])
    assert code == 1 and f"error: --out {tmp_path / 'c.txt'}: .txt is no image format; end the name in " \
        ".avif, " in capsys.readouterr().err
    assert not (tmp_path / "c.txt").exists()


@pytest.mark.parametrize("short_run", BOTH, indirect=True)
def test_learning_curves(short_run, tmp_path, capsys):
    """Every run draws curves.png; aiayn curves redraws it from results.json."""
    from matplotlib.image import imread

    from train.commands import curves

    cfg, results = short_run
    drawn = imread(Path(cfg.run_dir) / runtime.CURVES_FILE)
    assert drawn.shape == (700, 1100, 4)  # figsize 11 x 7 inches at 100 dpi
    # Training time per entry: cumulative, increasing, and ending at the run's total.
    for entries in (results["history"]["train"], results["history"]["valid"]):
        times = [e["train_time_s"] for e in entries]
        assert times == sorted(times) and times[0] > 0
    assert results["history"]["train"][-1]["train_time_s"] == pytest.approx(results["train"]["time_s"])
    # Each validation's own wall time (compiling included) is recorded beside it.
    assert all(0 < e["eval_time_s"] < results["wall_time_s"] for e in results["history"]["valid"])
    capsys.readouterr()
    assert curves.main(["--run-dir", cfg.run_dir, "--out", str(tmp_path / "c.png")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["train_points"], report["valid_points"]) == (6, 6)
    assert (imread(tmp_path / "c.png") == drawn).all()  # the same history draws the same picture
    code = curves.main(["--run-dir", str(tmp_path)])
    assert code == 1 and "no finished run" in capsys.readouterr().err
    code = curves.main(["--run-dir", cfg.run_dir, "--out", str(tmp_path)])  # a directory where the PNG would go
    assert code == 1 and "is a directory; give a file name" in capsys.readouterr().err


@pytest.mark.parametrize("short_run", BOTH, indirect=True)
def test_translate_and_evaluate_a_run(short_run, capsys):
    cfg, results = short_run
    run = train.load(cfg.run_dir, "latest")
    assert run.backend.step == run.meta["step"] == 60 and set(run.meta["data"]) == {"epoch", "index"}
    test_pairs = data.load_split(run.config, "numbers:test")
    scored = translation.evaluate_pairs(
        run.backend, run.tokenizers, test_pairs, max_len=cfg.max_len, token_budget=cfg.token_budget
    )
    # The final test evaluation in results.json is this model on this data.
    assert scored["bleu"] == pytest.approx(results["test"]["bleu"], abs=1e-9)
    assert scored["loss"] == pytest.approx(results["test"]["loss"], rel=1e-6)  # summation order on device

    capsys.readouterr()
    assert evaluate.main(["--run-dir", cfg.run_dir, "--data", "numbers:test", "--checkpoint", "latest"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["step"] == 60 and report["bleu"] == pytest.approx(results["test"]["bleu"], abs=1e-9)
    assert (report["beam"], report["alpha"], report["scoring"]) == (4, 0.6, "gnmt")  # the search it scored
    assert report["exact_match"] == pytest.approx(results["test"]["exact_match"]) and "bleu_lc" not in report
    assert report["bands"] == results["test"]["bands"] and report["sentences"] == 40

    # --scoring hf: HF's beam rules (tested against HF generate in tests/parity/test_marian.py), recorded.
    assert evaluate.main(["--run-dir", cfg.run_dir, "--data", "numbers:test", "--checkpoint", "latest",
                          "--scoring", "hf", "--alpha", "1.0"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["scoring"], report["alpha"], report["sentences"]) == ("hf", 1.0, 40)
    with pytest.raises(SystemExit) as exited:  # argparse's usage error
        evaluate.main(["--run-dir", cfg.run_dir, "--data", "numbers:test", "--scoring", "fairseq"])
    assert exited.value.code == 2 and "invalid choice: 'fairseq'" in capsys.readouterr().err

    # numbers:FIRST-LAST scores every number of a range; --lowercase adds lowercased BLEU.
    assert evaluate.main(["--run-dir", cfg.run_dir, "--data", "numbers:95-104", "--lowercase",
                          "--checkpoint", "latest", "--samples", "10"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [s["source"] for s in report["samples"]] == [loop.data.number_words(n)[0] for n in range(95, 105)]
    assert report["sentences"] == 10 and report["bleu_lc_signature"].startswith("nrefs:1|case:lc|")
    right = [s["hypothesis"] == s["reference"] for s in report["samples"]]
    assert report["exact_match"] == pytest.approx(100 * sum(right) / 10)
    assert report["bands"]["2"]["seen"] == 5 and report["bands"]["3"]["seen"] == sum(
        loop.data.number_words(n)[0] in {s for s, _ in data.load_split(run.config, "numbers:train")} for n in range(100, 105)
    )
    capsys.readouterr()
    code = evaluate.main(["--run-dir", cfg.run_dir, "--data", "numbers:9-1000000"])
    assert code == 1 and "error: numbers:9-1000000: expected 0 <= first <= last" in capsys.readouterr().err

    sources = [s for s, _ in test_pairs[:5]] + [""]
    expected = translation.translate_texts(
        run.backend, run.tokenizers, sources, max_len=cfg.max_len, token_budget=cfg.token_budget
    )
    assert expected[-1] == "" and all(expected[:-1])
    assert translate.main(["--run-dir", cfg.run_dir, "--checkpoint", "latest", "--batch-size", "2",
                           "--input", _write_lines(Path(cfg.run_dir).parent / "in.txt", sources)]) == 0
    assert capsys.readouterr().out.splitlines() == expected


def _write_lines(path: Path, lines) -> str:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("short_run", ["torch"], indirect=True)  # one subprocess is enough
def test_translate_cli_reads_stdin(short_run):
    cfg, _ = short_run
    result = subprocess.run(
        [sys.executable, "-m", "train.commands.translate", "--run-dir", cfg.run_dir],
        input="dreiundvierzig\nsiebenhundert\n", cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 2
    bad = subprocess.run(
        [sys.executable, "-m", "train.commands.translate", "--run-dir", str(Path(cfg.run_dir).parent)],
        input="", cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert bad.returncode == 1 and "not a run directory" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("short_run", ["torch"], indirect=True)  # the benchmark runs both frameworks anyway
def test_translate_benchmark_times_every_search_and_checks_their_outputs(short_run, capsys):
    from parity.commands import translate_bench

    cfg, _ = short_run
    sources = ["dreiundvierzig", "siebenhundertzwölf", "", "neun", "tausendeins"]
    out_json = Path(cfg.run_dir).parent / "bench.json"
    assert translate_bench.main(["--run-dir", cfg.run_dir, "--input", _write_lines(Path(cfg.run_dir).parent / "b.txt", sources),
                                 "--beam", "3", "--json", str(out_json), "--sample", "--num-samples", "3",
                                 "--seed", "1"]) == 0
    captured = capsys.readouterr()
    stdout = captured.out
    rows = json.loads(out_json.read_text())["rows"]
    # One line on stderr as each search starts: its untimed first pass can be minutes of compiling.
    assert captured.err.splitlines() == [f"{r['search']} / beam {r['beam']} ..." for r in rows]
    assert [(r["search"], r["beam"]) for r in rows] == [
        (name, beam) for name in ("torch cached", "jax cached", "torch uncached") for beam in (1, 3)
    ] + [("torch sample", 1), ("jax sample", 1)]
    by = {(r["search"], r["beam"]): r for r in rows}
    for r in rows:
        # The empty line is not timed; the same outputs everywhere (samples: JAX's the same as torch's); each
        # reference is not compared with itself.
        assert r["sentences"] == 4 and r["differ"] == (None if r["search"] in ("torch cached", "torch sample") else 0)
        assert r["outputs"] == 4 * (3 if r["search"].endswith("sample") else 1)
        assert r["outputs_per_s"] == pytest.approx(r["outputs"] / r["seconds"])
        assert r["tokens"] >= 4 and r["seconds"] > 0  # at least <eos> per sentence
        assert r["sentences_per_s"] == pytest.approx(4 / r["seconds"])
        for baseline in ("torch cached", "torch uncached"):
            ratio = by[baseline, r["beam"]]["seconds"] / r["seconds"]
            assert r[f"speedup_vs_{baseline.replace(' ', '_')}"] == pytest.approx(ratio)
    assert by["torch cached", 3]["tokens"] == by["jax cached", 3]["tokens"] == by["torch uncached", 3]["tokens"]
    assert by["torch sample", 1]["tokens"] == by["jax sample", 1]["tokens"] >= 12
    assert stdout.startswith("4 sentences, ") and len(stdout.splitlines()) == 2 + len(rows)
    # Both frameworks were timed in float32 (a GPU's JAX default, TF32, would change outputs).
    import jax
    import torch

    precisions = jax.config.jax_default_matmul_precision, torch.get_float32_matmul_precision()
    jax.config.update("jax_default_matmul_precision", None)  # undone before asserting: no leak into other tests
    assert precisions == ("highest", "highest")


def test_translate_bench_in_python_times_sampling_for_a_sampling_or_sample_true(short_run, monkeypatch):
    """`bench_file`'s sampling rows: for a `Sampling`, or `SpeedBench(sample=True)` (default settings); none else."""
    from parity import search_speed
    from train.options import RunSelection, Sampling, Search

    cfg, _ = short_run
    asked = []
    monkeypatch.setattr(search_speed, "benchmark", lambda *a, sampling, **k: asked.append(sampling) or [])
    source = _write_lines(Path(cfg.run_dir).parent / "one.txt", ["neun"])
    bench = search_speed.SpeedBench(input=Path(source))
    for sampling, sample in ((None, False), (None, True), (Sampling(seed=3), False)):
        search_speed.bench_file(RunSelection(cfg.run_dir), Search(), dataclasses.replace(bench, sample=sample),
                                sampling)
    assert asked == [None, Sampling(), Sampling(seed=3)]


def test_summary_line_gives_a_resumed_run_its_whole_training_time():
    """wall_time_s is this invocation's; train.time_s adds up every session's training. The final
    line names both, so a resumed run's "2700 steps in 3231 s" does not read as the whole run's time."""
    results = {"backend": "jax", "steps": 2700, "wall_time_s": 3230.9, "train": {"time_s": 5226.4},
               "valid": {"loss": 3.2, "ppl": 8.3, "bleu": 35.0}, "test": None, "run_dir": "run"}
    line = loop._summary_line(results)
    assert line.startswith("[jax] done: 2700 steps in 3231 s (5226 s of training since step 0) | valid loss 3.2000")
    fresh = loop._summary_line({**results, "train": {"time_s": 3100.0}})  # a run in one invocation
    assert fresh.startswith("[jax] done: 2700 steps in 3231 s (3100 s of training since step 0) | valid loss")


# JAX's resume, bit for bit with dropout on, is test_crash_and_resume.test_killed_and_terminated_runs_resume_exactly[jax]
# (the same loop through real processes, 20 steps and three interruptions); here it would only compile its own programs.
@pytest.mark.parametrize("backend", ["torch"])
def test_resume_continues_with_the_same_losses(fast_config, backend):
    """Train 6 steps straight; train 3, stop, resume to 6: steps 4-6 have the same losses.
    Dropout stays on (0.1): the resumed run must also restore the dropout randomness."""
    common = dict(
        steps=6, warmup=2, log_every=1, eval_every=100, save_every=3, eval_sentences=4, numbers_valid=4, numbers_test=0
    )
    straight = loop.train(fast_config(backend, **common).replace(run_dir=fast_config(backend).run_dir + "-straight"))
    first = loop.train(fast_config(backend, **{**common, "steps": 3}))
    resumed = loop.train(fast_config(backend, **common, resume=True))
    straight_losses, first_losses, resumed_losses = (
        [t["loss"] for t in r["history"]["train"]] for r in (straight, first, resumed)
    )
    assert first_losses == straight_losses[:3]  # bit-exact: the same computation
    # The resumed run's history is the whole run's: the first session's steps, then its own.
    assert resumed["steps"] == 6 and len(resumed_losses) == 6 and resumed_losses[:3] == first_losses
    if backend == "jax":
        assert resumed_losses[3:] == straight_losses[3:]  # bit-exact: same jitted step, same keys
    else:
        # 1e-6: restored Adam moments and RNG state are exact; allow for kernel nondeterminism.
        assert resumed_losses[3:] == pytest.approx(straight_losses[3:], rel=1e-6)


def test_run_dir_refused_without_resume_or_overwrite(fast_config, tmp_path):
    cfg = fast_config("torch", steps=2, eval_every=2, eval_sentences=2, numbers_valid=2, numbers_test=0)
    loop.train(cfg)
    with pytest.raises(runtime.UserError, match="already holds a run; pass resume to continue it or overwrite to replace it$"):
        loop.train(cfg)
    with pytest.raises(runtime.UserError, match="^resume cannot change how the run trains: seed: run has 0, got 1$"):
        loop.train(cfg.replace(resume=True, seed=1))
    marker = Path(cfg.run_dir) / "checkpoints" / "2"
    assert marker.is_dir()
    results = loop.train(cfg.replace(overwrite=True, steps=1))
    assert results["steps"] == 1 and not marker.exists()  # the old run is gone
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    for flags in ({}, {"overwrite": True}):
        with pytest.raises(runtime.UserError, match="holds no run"):
            loop.train(cfg.replace(run_dir=str(tmp_path / "other"), **flags))
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"
    with pytest.raises(runtime.UserError, match="nothing to resume"):
        loop.train(cfg.replace(run_dir=str(tmp_path / "fresh"), resume=True))


def test_a_resume_that_fails_to_restore_closes_its_backend(fast_config, monkeypatch):
    """Whatever ends the set-up after the backend is built (here a disk error reading the checkpoint),
    the backend is closed: a notebook that catches the error goes on without its devices held."""
    from train.backends.torch_backend import TorchBackend

    cfg = fast_config("torch", steps=2, eval_every=2, eval_sentences=2, numbers_valid=2, numbers_test=0)
    loop.train(cfg)
    closed, close = [], TorchBackend.close

    def unreadable(self, which):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(TorchBackend, "restore", unreadable)
    monkeypatch.setattr(TorchBackend, "close", lambda self: (closed.append(self), close(self)))
    with pytest.raises(OSError, match="Input/output error"):
        loop.train(cfg.replace(resume=True, steps=4))
    assert len(closed) == 1


def test_resume_from_the_command_line_reads_the_saved_flags(fast_config):
    """`--resume --run-dir X --steps N` needs no other flag: the run's own config is used."""
    cfg = fast_config("torch", steps=2, eval_every=2, eval_sentences=2, numbers_valid=2, numbers_test=0, seed=5)
    loop.train(cfg)
    again = ExperimentConfig(run_dir=cfg.run_dir, resume=True, steps=3)  # defaults elsewhere (seed 0, jax)
    results = training.start(again, explicit={"run_dir", "resume", "steps"})  # as train.run launches it
    assert results["steps"] == 3 and results["config"]["seed"] == 5 and results["backend"] == "torch"


def test_multi30k_loads_and_trains(multi30k, fast_config, tmp_path):
    cfg = fast_config(
        "torch",
        train=f"de:en:{multi30k}/train", valid=f"de:en:{multi30k}/val",
        vocab_size=1000, max_len=64, token_budget=2048, steps=4, log_every=1, eval_every=4, eval_sentences=8,
        warmup=2, hf_cache=str(tmp_path / "hf"),
    )
    results = loop.train(cfg)
    losses = [t["loss"] for t in results["history"]["train"]]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert results["valid"]["tokens"] > 10_000  # the whole of val (1,014 sentences) scored for loss
    # No test set here: it is translated whole (1,000 sentences), which the short runs above test.
    assert results["valid"]["sentences"] == 8 and 0 <= results["valid"]["bleu"] <= 100 and results["test"] is None
    tokenizers = data.load_tokenizers(cfg.run_dir)
    assert tokenizers.joint and tokenizers.src.get_vocab_size() == 1000
    sentence = "Zwei junge weiße Männer sind im Freien."
    assert loop.data.decode(tokenizers.src, loop.data.encode(tokenizers.src, [sentence])[0]) == sentence


def test_jsonl_and_tsv_data_specs(fast_config, tmp_path):
    """Local parallel data in other formats goes through the same loop (hf: specs use the same
    loader and are tested in test_data.py with a local dataset directory)."""
    pairs = loop.data.numbers_corpus(train_size=300, valid_size=20, test_size=0, seed=9)
    train_file = tmp_path / "train.jsonl"
    train_file.write_text("".join(json.dumps({"de": s, "en": t}) + "\n" for s, t in pairs.train), encoding="utf-8")
    valid_file = tmp_path / "valid.tsv"
    valid_file.write_text("source\ttarget\n" + "".join(f"{s}\t{t}\n" for s, t in pairs.valid), encoding="utf-8")
    cfg = fast_config(
        "torch", train=f"{train_file}#src=de,tgt=en", valid=str(valid_file), vocab_size=400, steps=2, eval_every=2,
        eval_sentences=4, hf_cache=str(tmp_path / "hf"),
    )
    results = loop.train(cfg)
    assert results["steps"] == 2 and results["test"] is None and results["valid"]["sentences"] == 4
    assert data.load_split(cfg, str(valid_file)) == pairs.valid


def test_source_batches_bucket_pad_and_keep_every_sentence():
    src_ids = [[5] * n + [2] for n in (3, 9, 1, 20, 7, 12, 40)]  # lengths with <eos>: 4..41
    batches = list(data.source_batches(src_ids, max_len=32, token_budget=64, batch_size=2))
    seen = {}
    for index, src in batches:
        size, length = src.shape
        assert length in (8, 16, 24, 32) and size <= 2 and size * length <= 64
        for row, i in enumerate(index):
            if i < 0:
                assert not src[row].any()  # filler rows are all padding
                continue
            seen[int(i)] = src[row][src[row] != 0].tolist()
    assert sorted(seen) == list(range(len(src_ids)))  # every sentence once
    assert seen[3] == src_ids[3] and seen[6] == [5] * 31 + [2]  # too long: cut to max_len, <eos> kept
    # One shape per bucket; rows: the least of the budget's, --batch-size and the bucket's
    # sentence count rounded up to a power of two (a lone long sentence runs as one row).
    assert {src.shape for _, src in batches} == {(2, 8), (2, 16), (1, 24), (1, 32)}
    for bad in (0, -3):  # the Python API's batch_size: never silently the default or one sentence
        with pytest.raises(ValueError, match=f"batch_size must be >= 1, got {bad}"):
            list(data.source_batches(src_ids, max_len=32, token_budget=64, batch_size=bad))


def test_fixed_source_batches_search_any_sentences_in_one_shape_below_64_tokens():
    assert fixed_lengths(128) == (64, 128) and fixed_lengths(32) == (32,) and fixed_lengths(300) == (64, 128, 256, 300)
    src_ids = [[5] * n + [2] for n in (3, 9, 1, 20, 63, 64)]  # with <eos>: 4..65 tokens
    batches = list(data.source_batches(src_ids, max_len=128, token_budget=256, fixed=True))
    # Every source of up to 64 tokens in (256 // 64) rows of 64, the 65-token one in 2 rows of 128:
    # the rows the budget allows whatever the number of sentences, so any set compiles these two.
    assert [src.shape for _, src in batches] == [(4, 64), (4, 64), (2, 128)]
    assert sorted(int(i) for index, _ in batches for i in index if i >= 0) == list(range(6))
