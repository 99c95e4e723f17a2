"""`--init-from SOURCE` (`train.run`, `train.fit`): a new run takes its source's model, tokenizers and
weights and trains them with a fresh optimizer and schedule: from a run of the same backend, of the
other framework (converted) or a Marian directory (imported), by the library itself
(`train.pretrained.source_run`) for both entry points, refusing flags that would change the
model's shape or vocabulary, resumable, and exported back to HF."""

import contextlib
import json
import tempfile

import numpy as np
import pytest

import train
from train import pretrained, runtime
from train.commands import run
from train.config import ExperimentConfig
from train.interop.runs import convert_run, run_weights

from .marian_fixtures import lines, make_marian_dir

TINY = dict(backend="torch", numbers_train=1500, numbers_valid=40, numbers_test=0, max_len=16, token_budget=512,
            model={"num_encoder_layers": 1, "num_decoder_layers": 1}, progress=False, samples=0, eval_sentences=8,
            beam=1)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("init-source") / "run"
    train.fit(ExperimentConfig(run_dir=str(run_dir), steps=60, eval_every=60, **TINY))
    return run_dir


def test_a_run_starts_from_another_runs_weights_with_a_fresh_optimizer(source, tmp_path):
    low = dict(steps=4, eval_every=4, warmup=400)  # a learning rate that keeps what the source learnt
    tuned = train.fit(dict(run_dir=str(tmp_path / "tuned"), init_from=str(source), **low, **TINY))
    fresh = train.fit(dict(run_dir=str(tmp_path / "fresh"), **low, **TINY))
    for name in ("tokenizer.json", "model.json"):  # the source's, byte for byte
        assert (tmp_path / "tuned" / name).read_bytes() == (source / name).read_bytes()
    trained = json.loads((source / "results.json").read_text())["valid"]["loss"]
    # Four updates on from the source's weights stay near its loss; from random ones the loss is ~2x.
    assert tuned["valid"]["loss"] < trained + 0.3 < fresh["valid"]["loss"] - 1.0
    assert tuned["history"]["train"][0]["lr"] == fresh["history"]["train"][0]["lr"]  # the schedule starts anew
    assert runtime.read_experiment(tmp_path / "tuned").init_from == str(source)
    resumed = train.fit(run_dir=str(tmp_path / "tuned"), resume=True, steps=6, eval_every=6)
    assert resumed["steps"] == 6


def test_flags_that_change_the_model_are_refused_by_name(source, tmp_path, capsys):
    for change, says in [({"vocab_size": 300}, "vocab_size: "), ({"model": {"d_model": 32}}, "model: "),
                         ({"preset": "small"}, "preset: ")]:  # Python names the parameters
        with pytest.raises(runtime.UserError, match=says + f"{source} has "):
            train.fit(dict(run_dir=str(tmp_path / "x"), init_from=str(source), **{**TINY, **change}))
        assert not (tmp_path / "x").exists()
    nowhere = tmp_path / "nowhere"
    says = f"{nowhere}: {nowhere} is neither a run directory nor an HF Marian directory"
    with pytest.raises(runtime.UserError, match=f"^init_from {says}"):  # Python names the parameter
        train.fit(dict(run_dir=str(tmp_path / "x"), init_from=str(nowhere), **TINY))
    flags = ["--backend", "torch", "--run-dir", str(tmp_path / "x"), "--no-progress", "--init-from", str(nowhere)]
    assert run.main(flags) == 1
    assert capsys.readouterr().err == f"error: --init-from {says} (config.json missing)\n"  # the command its flag
    assert not (tmp_path / "x").exists()


def test_a_scratch_directory_is_made_for_an_init_from_source_alone(source, tmp_path, monkeypatch):
    """train.run made a /tmp/aiayn-init-* directory for every launch, which a killed process left behind."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with contextlib.ExitStack() as scratch:
        assert pretrained.source_run(ExperimentConfig(**TINY), scratch) is None and not list(tmp_path.iterdir())
        assert pretrained.source_run(ExperimentConfig(init_from=str(source), **TINY), scratch) == source  # torch's own
        assert len(list(tmp_path.glob("aiayn-init-*"))) == 1
    assert not list(tmp_path.iterdir())


# So small a learning rate that one update leaves every weight within 1e-6 of where it started (Adam's
# step is about the learning rate, here ~1e-12), so the run's weights after it are its source's.
UNMOVED = dict(steps=1, eval_every=1, lr_factor=1e-9)


def assert_same_weights(run_dir, source_dir):
    after, _ = run_weights(run_dir, "latest")
    before, _ = run_weights(source_dir, "best")
    assert after.keys() == before.keys()
    assert max(float(np.max(np.abs(after[k] - before[k]))) for k in after) < 1e-6


def test_fit_starts_from_the_other_frameworks_run(source, tmp_path, monkeypatch):
    """A JAX run (the torch source converted) as fit's source for a torch run: converted back from
    its best checkpoint into a scratch directory, removed after the run."""
    convert_run(source, tmp_path / "jax", to="jax", which="best")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "scratch"))
    (tmp_path / "scratch").mkdir()
    train.fit(dict(run_dir=str(tmp_path / "tuned"), init_from=str(tmp_path / "jax"), **{**TINY, **UNMOVED}))
    assert_same_weights(tmp_path / "tuned", source)
    assert runtime.read_experiment(tmp_path / "tuned").init_from == str(tmp_path / "jax")
    assert not list((tmp_path / "scratch").iterdir())


def test_fit_starts_from_a_marian_directory(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from train.interop import marian

    hf_dir = make_marian_dir(tmp_path / "hf", seed=1)
    for split, (first, n) in {"ft": (1000, 40), "dev": (1300, 4)}.items():
        for lang in ("de", "en"):
            (tmp_path / f"{split}.{lang}").write_text("\n".join(lines(f"train.{lang}.gz", n, skip=first)) + "\n")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "scratch"))
    (tmp_path / "scratch").mkdir()
    train.fit(dict(run_dir=str(tmp_path / "tuned"), init_from=str(hf_dir), backend="torch", eval_sentences=2, beam=1,
                   train=f"de:en:{tmp_path / 'ft'}", valid=f"de:en:{tmp_path / 'dev'}", token_budget=2048,
                   progress=False, samples=0, **UNMOVED))
    marian.import_marian(hf_dir, tmp_path / "imported", to="torch")
    assert_same_weights(tmp_path / "tuned", tmp_path / "imported")
    assert runtime.read_json(tmp_path / "tuned" / runtime.IMPORTED_FILE)["format"] == "marian"  # its numbering kept
    assert not list((tmp_path / "scratch").iterdir())


def test_a_marian_model_fine_tuned_in_one_command_learns_and_exports_to_hf(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from parity.commands import convert
    from train.interop import marian

    hf_dir = make_marian_dir(tmp_path / "hf", seed=1)
    for split, (first, n) in {"ft": (1000, 200), "dev": (1300, 24)}.items():
        for lang in ("de", "en"):
            (tmp_path / f"{split}.{lang}").write_text("\n".join(lines(f"train.{lang}.gz", n, skip=first)) + "\n")
    dev = [(s, t) for s, t in zip(*((tmp_path / f"dev.{lang}").read_text().splitlines() for lang in ("de", "en")))]
    marian.import_marian(hf_dir, tmp_path / "before", to="torch")
    with train.load(tmp_path / "before") as before:
        loss_before = before.evaluate(dev, beam=1, max_sentences=2)["loss"]
    assert run.main(["--init-from", str(hf_dir), "--backend", "torch", "--run-dir", str(tmp_path / "tuned"),
                     "--train", f"de:en:{tmp_path / 'ft'}", "--valid", f"de:en:{tmp_path / 'dev'}", "--steps", "30",
                     "--eval-every", "30", "--eval-sentences", "2", "--beam", "1", "--warmup", "10",
                     "--token-budget", "2048", "--no-progress"]) == 0
    results = json.loads((tmp_path / "tuned" / "results.json").read_text())
    assert results["valid"]["loss"] < loss_before - 0.5, (results["valid"]["loss"], loss_before)
    assert convert.main(["--to", "marian", "--src", str(tmp_path / "tuned"), "--dst", str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "proof.json").read_text())["greedy_agreement"] == 1.0
    model = transformers.MarianMTModel.from_pretrained(str(tmp_path / "out"))
    original = transformers.MarianMTModel.from_pretrained(str(hf_dir))
    changed = [k for k, v in model.state_dict().items() if not (v == original.state_dict()[k]).all()]
    assert "model.encoder.layers.0.fc1.weight" in changed  # trained, and loaded by HF itself
    assert transformers.MarianTokenizer.from_pretrained(str(tmp_path / "out"))("Ein Hund.")["input_ids"]
