"""Whole training checkpoints across frameworks (backends' export_state / import_state,
train.interop.weights.convert_state, `aiayn convert --run-dir`): the Adam state inside the trainer's
optax chain, strict checks, bit-exact round trips of a real run directory, and `train.run --resume` continuing a converted run in the other framework
with the losses it would have had in its own.

Lopsided model (d_model=24 with 3 heads, 2 encoder layers and 1 decoder layer), so a transposed
moment cannot pass; dropout off, so the two frameworks can be compared update by update.
"""

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from parity.commands.convert import main as convert_main
from train import averaging, checkpoints, data, loop, runtime
from train.backends import create_backend
from train.commands import run as train_run
from train.config import ExperimentConfig
from train.interop.runs import convert_run
from train.interop.weights import CheckpointMismatchError, convert_state, transfer_state

jax.config.update("jax_default_matmul_precision", "highest")  # parity numerics (README, numerics contract)

LOPSIDED = {"d_model": 24, "num_heads": 3, "d_ff": 40, "num_encoder_layers": 2, "num_decoder_layers": 1}
# A run of seconds: a small numbers corpus, sequences of at most 16 tokens (two batch shapes), one
# torch thread (two compete with XLA's pool on a 2-core machine), logs every update.
FAST = dict(
    numbers_train=600, numbers_valid=4, numbers_test=0, max_len=16, token_budget=256, model=LOPSIDED,
    dropout=0.0, warmup=4, log_every=1, eval_every=1000, eval_sentences=4, samples=0, progress=False, threads=1,
)


@pytest.fixture(scope="module")
def corpus():
    splits = data.numbers_corpus(train_size=600, valid_size=4, test_size=0, seed=0)
    return splits, data.train_tokenizers(splits.train, vocab_size=400)


def _backends(corpus, clip_norm=None):
    """(exp config, model config, jax backend, torch backend, batcher): one config, fresh weights."""
    splits, tokenizers = corpus
    cfg = ExperimentConfig(backend="jax", steps=10, clip_norm=clip_norm, **FAST).resolve()
    model_cfg = cfg.model_config(tokenizers.src.get_vocab_size(), tokenizers.tgt.get_vocab_size())
    jax_backend = create_backend(cfg, model_cfg)
    torch_backend = create_backend(cfg.replace(backend="torch"), model_cfg)
    return cfg, model_cfg, jax_backend, torch_backend, loop.make_batcher(cfg, tokenizers, splits.train)


# ---------------------------------------------------------------------------------------------
# The optimizer state, in memory
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("clip_norm", [None, 0.5], ids=["adam", "clip-then-adam"])
def test_jax_state_carries_adam_of_the_trainers_chain(corpus, clip_norm):
    """optax.adam(schedule) = chain(scale_by_adam, scale_by_schedule); clipping puts it second. The
    exported moments are Adam's, keyed like the weights, and every step counter moves with them."""
    _, _, jax_backend, _, batcher = _backends(corpus, clip_norm)
    assert jax_backend.export_state().mu is None  # before the first update, as torch
    jax_backend.train_step([next(batcher)])
    state = jax_backend.export_state()
    adam = optax.tree_utils.tree_get(jax_backend.state["opt_state"], "mu")
    assert state.mu.keys() == state.nu.keys() == state.params.keys()
    key = "encoder.layers.0.ff.linear1.kernel"
    np.testing.assert_array_equal(state.mu[key], np.asarray(adam["encoder"]["layers"][0]["ff"]["linear1"]["kernel"][...]))
    assert state.step == 1 and (state.nu[key] > 0).any()


def test_training_state_round_trips_bit_exactly_and_positions_the_schedule(corpus):
    # With clipping: the Adam state sits inside a nested chain (the run-directory tests cover the
    # plain one); 0.5 clips here (gradient norms ~1-3).
    cfg, model_cfg, jax_backend, torch_backend, batcher = _backends(corpus, clip_norm=0.5)
    for _ in range(3):
        jax_backend.train_step([next(batcher)])
    state = jax_backend.export_state()
    assert state.framework == "jax" and state.step == 3 and state.mu.keys() == state.params.keys()
    transfer_state(jax_backend, torch_backend)
    back = torch_backend.export_state()
    assert back.framework == "torch" and back.rng is not None
    # weights, moments, step: bit for bit (the random state does not cross frameworks)
    assert convert_state(back, "jax", model_cfg).differences(state) == []
    # torch's own view: every parameter's Adam step, the scheduler position, the next lr.
    steps = {float(s["step"]) for s in torch_backend.optimizer.state.values()}
    assert steps == {3.0} and len(torch_backend.optimizer.state) == len(state.params)
    assert torch_backend.scheduler.last_epoch == 3 and torch_backend.step == 3
    assert torch_backend.optimizer.param_groups[0]["lr"] == torch_backend.learning_rate(4)
    q = "encoder.layers.0.self_attn.q_proj"
    moment = {n: p for n, p in torch_backend.model.named_parameters()}[f"{q}.weight"]
    np.testing.assert_array_equal(torch_backend.optimizer.state[moment]["exp_avg"].numpy(), state.mu[f"{q}.kernel"].T)

    again = create_backend(cfg, model_cfg)
    transfer_state(torch_backend, again)
    assert again.export_state().differences(state) == []
    opt_state = again.state["opt_state"]
    counts = [int(c) for _, c in optax.tree_utils.tree_get_all_with_path(opt_state, "count")]
    assert counts == [3, 3] and int(again.state["step"]) == again.step == 3  # Adam's and the schedule's
    assert isinstance(opt_state[0], optax.EmptyState)  # the clipping state, untouched

    # The next updates agree: same weights and the same Adam state and schedule position.
    batches = [next(batcher) for _ in range(3)]
    losses = {name: [b.fetch([b.train_step([x])])[0]["loss"] for x in batches]
              for name, b in (("jax", jax_backend), ("torch", torch_backend))}
    # 1e-5: float32 rounding of two frameworks over three updates (measured <=2.3e-7).
    np.testing.assert_allclose(losses["torch"], losses["jax"], rtol=1e-5)
    # The test can fail: the same weights with a fresh optimizer (moments 0, step 0) take other
    # updates; measured 0.45 and 0.037 apart at the second and third update (100x the 1e-5 above
    # is the bound: far outside rounding).
    fresh = create_backend(cfg.replace(backend="torch"), model_cfg)
    fresh.import_state(convert_state(dataclasses.replace(state, step=0, mu=None, nu=None), "torch", model_cfg))
    fresh_losses = [fresh.fetch([fresh.train_step([x])])[0]["loss"] for x in batches]
    assert fresh_losses[0] == pytest.approx(losses["jax"][0], rel=1e-5)  # same weights: same first loss
    assert all(abs(f - j) > 1e-3 * j for f, j in zip(fresh_losses[1:], losses["jax"][1:]))


def test_mismatched_optimizer_states_are_refused(corpus):
    cfg, model_cfg, jax_backend, torch_backend, _ = _backends(corpus)
    initial = jax_backend.export_state()
    # A well-formed state after one update (values made up: the checks look at keys, shapes, steps).
    squares = {k: v * v for k, v in initial.params.items()}
    good = dataclasses.replace(initial, step=1, mu=dict(initial.params), nu=squares)
    jax_backend.import_state(good)
    torch_good = convert_state(good, "torch", model_cfg)
    torch_backend.import_state(torch_good)
    key, torch_key = "decoder.layers.0.cross_attn.v_proj.kernel", "decoder.layers.0.cross_attn.v_proj.weight"

    missing = dataclasses.replace(good, mu={k: v for k, v in good.mu.items() if k != key})
    with pytest.raises(CheckpointMismatchError, match=f"first moments .*\n  missing     {key}  expected \\(24, 24\\)"):
        jax_backend.import_state(missing)
    with pytest.raises(CheckpointMismatchError, match=f"jax Adam first moments .*\n  missing     {key}"):
        convert_state(missing, "torch", model_cfg)
    wrong = dataclasses.replace(good, nu={**good.nu, key: np.zeros((24, 25), np.float32)})
    with pytest.raises(CheckpointMismatchError, match=f"wrong shape {key}  expected \\(24, 24\\), got \\(24, 25\\)"):
        jax_backend.import_state(wrong)
    wide = dataclasses.replace(torch_good, mu={**torch_good.mu, torch_key: torch_good.mu[torch_key].astype(np.float64)})
    with pytest.raises(ValueError, match=f"than their parameters:\n  {torch_key}: float64, parameter float32"):
        torch_backend.import_state(wide)
    with pytest.raises(ValueError, match="moments are missing"):
        torch_backend.import_state(dataclasses.replace(torch_good, mu=None, nu=None))
    with pytest.raises(ValueError, match="a jax training state: convert it to torch's layout first"):
        torch_backend.import_state(good)
    other_model = model_cfg.replace(d_ff=48)
    with pytest.raises(CheckpointMismatchError, match="wrong shape .*linear1.kernel  expected \\(24, 48\\), got \\(24, 40\\)"):
        convert_state(good, "torch", other_model)

    # Step counters that disagree.
    jax_backend.state = {**jax_backend.state, "step": jnp.asarray(7, jnp.int32)}  # Adam's count stays 1
    with pytest.raises(ValueError, match="step counters disagree: {'trainer step': 7, 'host step': 1"):
        jax_backend.export_state()


# ---------------------------------------------------------------------------------------------
# Run directories and the command line
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def jax_run(tmp_path_factory):
    """A JAX run of 4 updates with checkpoints at 2 and 4 (each with its validation BLEU)."""
    run_dir = tmp_path_factory.mktemp("runs") / "jax"
    cfg = ExperimentConfig(backend="jax", run_dir=str(run_dir), steps=4, **{**FAST, "eval_every": 2})
    loop.train(cfg)
    return run_dir


def _checkpoint_states(run_dir: Path) -> dict:
    """{step: (TrainingState in the JAX layout, meta, metrics)} of every checkpoint of a run directory."""
    cfg, model_cfg = runtime.read_experiment(run_dir), runtime.read_model_config(run_dir)
    backend = create_backend(cfg, model_cfg, str(run_dir / "checkpoints"))
    out = {}
    for step in backend.checkpoint_steps():
        meta = backend.restore(step)
        out[step] = (convert_state(backend.export_state(), "jax", model_cfg), meta, backend.checkpoint_metrics(step))
    backend.close()
    return out


def test_whole_run_round_trip_jax_torch_jax_is_bit_exact(jax_run, tmp_path):
    torch_dir, back_dir = tmp_path / "torch", tmp_path / "jax-again"
    assert convert_run(jax_run, torch_dir, which="all")["steps"] == [2, 4]
    assert convert_run(torch_dir, back_dir, which="all")["backend"] == "jax"

    original, converted, restored = (_checkpoint_states(d) for d in (jax_run, torch_dir, back_dir))
    assert sorted(original) == sorted(converted) == sorted(restored) == [2, 4]
    for step, (state, meta, metrics) in original.items():
        for other, backend in ((converted, "torch"), (restored, "jax")):
            other_state, other_meta, other_metrics = other[step]
            state_ = dataclasses.replace(state, rng=other_state.rng)  # dropout streams do not cross
            assert other_state.differences(state_) == []  # weights, Adam moments, step
            assert other_meta["data"] == meta["data"] and other_meta["step"] == step  # data position
            assert other_meta["config"]["backend"] == backend
            assert other_metrics == metrics and metrics["bleu"] >= 0  # ranking for keep-the-best
    assert restored[4][1] == original[4][1]  # the meta: data position, experiment, validation scores

    for name in ("tokenizer.json", "model.json"):
        assert (back_dir / name).read_bytes() == (torch_dir / name).read_bytes() == (jax_run / name).read_bytes()
    configs = [json.loads((d / "config.json").read_text()) for d in (jax_run, torch_dir, back_dir)]
    assert configs[1] == {**configs[0], "backend": "torch"} and configs[2] == configs[0]
    assert "run_dir" not in configs[0] and "steps" not in configs[0]  # launch options are not saved
    assert json.loads((torch_dir / "converted.json").read_text())["from_backend"] == "jax"
    assert not list(tmp_path.glob(".*converting"))  # built beside, renamed into place


def _resume(run_dir: Path, steps: int) -> list[float]:
    """`python -m train.run --run-dir DIR --resume --steps N` in-process; the resumed updates' losses."""
    # Launch options (steps, logging, threads) are this launch's: given again, not read from the run.
    args = ["--run-dir", str(run_dir), "--resume", "--steps", str(steps), "--log-every", "1", "--threads", "1"]
    assert train_run.main([*args, "--no-progress"]) == 0
    results = json.loads((run_dir / "results.json").read_text())
    return [entry["loss"] for entry in results["history"]["train"]]


@pytest.mark.parametrize("first", ["jax", "torch"])
def test_cli_converts_a_run_and_resume_continues_in_the_other_framework(jax_run, tmp_path, first):
    """Convert a run with the CLI, resume it in the other framework with train.run, and get the
    losses that resuming in its own framework gives."""
    if first == "jax":
        source = tmp_path / "jax"
        shutil.copytree(jax_run, source)
    else:
        source = tmp_path / "torch"
        loop.train(ExperimentConfig(backend="torch", run_dir=str(source), steps=4, **{**FAST, "save_every": 4}))
    other = "torch" if first == "jax" else "jax"
    converted = tmp_path / f"{first}-as-{other}"
    assert convert_main(["--to", other, "--run-dir", str(source), "--dst", str(converted)]) == 0
    assert runtime.read_experiment(converted).backend == other
    proof = json.loads((converted / "proof.json").read_text())  # each run read back by its own backend
    assert proof["kind"] == other and proof["sentences"] == 4 and proof["greedy_agreement"] == 1.0  # FAST: 4 valid pairs
    assert proof["max_abs_logit_diff"] <= proof["bounds"]["max_abs_logit_diff"] == 1e-4

    losses_converted = _resume(converted, 7)
    losses_own = _resume(source, 7)
    assert len(losses_own) == len(losses_converted) == 7  # the whole run's history: updates 1..7
    # 1e-5: float32 rounding of two frameworks over three updates (measured <=2.4e-7). Update 5's
    # loss checks the weights; 6 and 7 check the Adam moments and the schedule position, which
    # the update before them used (a reset optimizer is >=3e-2 off, see the test above).
    np.testing.assert_allclose(losses_converted, losses_own, rtol=1e-5)
    assert json.loads((converted / "results.json").read_text())["backend"] == other


def test_cli_errors(jax_run, tmp_path):
    def cli(*args):
        return convert_main([str(a) for a in args])

    assert cli("--to", "torch", "--run-dir", jax_run, "--dst", jax_run.parent) == 1  # exists, no --overwrite
    assert cli("--to", "jax", "--run-dir", jax_run, "--dst", tmp_path / "x") == 1  # already a jax run
    assert cli("--to", "torch", "--run-dir", tmp_path, "--dst", tmp_path / "y") == 1  # not a run directory
    assert cli("--to", "torch", "--run-dir", jax_run, "--dst", tmp_path / "z", "--checkpoint", "newest") == 1
    assert cli("--to", "torch", "--run-dir", jax_run, "--dst", tmp_path / "z", "--checkpoint", "3") == 1
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    assert cli("--to", "torch", "--run-dir", jax_run, "--dst", tmp_path / "mine", "--overwrite") == 1
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"  # a directory without a run is never deleted
    assert not (tmp_path / "x").exists() and not (tmp_path / "z").exists()


def test_converting_a_tampered_optimizer_file_names_the_problem(jax_run, tmp_path, capsys):
    """A torch checkpoint whose optimizer file lacks one parameter's moments: restoring it fails
    the strict check, and the conversion says so with one line and exit status 1."""
    from safetensors.torch import load_file, save_file

    torch_dir = tmp_path / "torch"
    convert_run(jax_run, torch_dir)
    path = torch_dir / "checkpoints" / "4" / "optimizer.safetensors"
    moments = load_file(str(path))
    del moments["decoder.layers.0.ff.linear1.bias.exp_avg"], moments["decoder.layers.0.ff.linear1.bias.exp_avg_sq"]
    save_file(moments, str(path))
    checkpoints.write_checkpoint_digest(path.parent)  # a consistent but foreign file: the digest cannot tell
    code = convert_main(["--to", "jax", "--run-dir", str(torch_dir), "--dst", str(tmp_path / "back")])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert "checkpoint 4 in" in err and "cannot be restored" in err and "do not match the architecture: missing decoder.layers.0.ff.linear1.bias" in err
    assert not (tmp_path / "back").exists()


def test_best_checkpoint_is_selectable(jax_run, tmp_path):
    original = _checkpoint_states(jax_run)
    best = max(original, key=lambda s: (original[s][2]["bleu"], s))  # ties: the newest, as checkpoints.choose_checkpoint
    done = convert_run(jax_run, tmp_path / "best", which="best")
    assert done["steps"] == [best]
    done = convert_run(jax_run, tmp_path / "two", which="2")
    assert done["steps"] == [2] and sorted(_checkpoint_states(tmp_path / "two")) == [2]


def test_averaging_the_same_checkpoints_in_either_framework_gives_the_same_weights(jax_run, tmp_path):
    """`aiayn average` of checkpoints 2 and 4 of a JAX run, and of the same two converted to torch:
    bit-identical weights (a float64 mean in step order, rounded once), the newest checkpoint's
    moments and step."""
    torch_dir = tmp_path / "torch"
    convert_run(jax_run, torch_dir, which="all")
    for source in (jax_run, torch_dir):
        assert averaging.average_run(source, tmp_path / f"avg-{source.name}", last=2)["averaged_steps"] == [2, 4]
    (jax_avg,), (torch_avg,) = (_checkpoint_states(tmp_path / f"avg-{d.name}").values() for d in (jax_run, torch_dir))
    assert dataclasses.replace(torch_avg[0], rng=jax_avg[0].rng).differences(jax_avg[0]) == []
    original = _checkpoint_states(jax_run)
    for name, value in jax_avg[0].params.items():
        expected = ((original[2][0].params[name].astype(np.float64) + original[4][0].params[name]) / 2).astype(np.float32)
        np.testing.assert_array_equal(value, expected, err_msg=name)
    assert jax_avg[0].step == 4 and all(np.array_equal(jax_avg[0].mu[k], original[4][0].mu[k]) for k in original[4][0].mu)
    assert jax_avg[1]["data"] == original[4][1]["data"]  # the newest checkpoint's data position
