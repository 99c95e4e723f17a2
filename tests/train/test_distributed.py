"""Data parallelism, multi-process training and bf16 mixed precision.

JAX fixes its device count when it starts, so the multi-device checks run in subprocesses with
`XLA_FLAGS=--xla_force_host_platform_device_count=N` set before jax is imported; this file is
also the worker those subprocesses run (`python tests/train/test_distributed.py MODE OUT`).

- 8 devices and 1 device take the same 20 updates from the same global batches (dropout on);
- a checkpoint written on 8 devices restores on 1 and vice versa, and training goes on as if
  uninterrupted;
- two processes with 2 CPU devices each (jax.distributed on 127.0.0.1) train like one process
  with 4 devices, through `python -m train.run`;
- bf16 on the CPU: the loss falls on the numbers corpus with both backends, parameters and
  optimizer state stay float32;
- --devices and token budgets that cannot be split give clear errors.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # when run as the worker script
    sys.path.insert(0, str(REPO))

from train import data, loop, runtime  # noqa: E402
from train.config import ExperimentConfig  # noqa: E402

# Lopsided sizes (d_model=24 with 3 heads, 2+1 layers) so a swapped axis cannot pass; no
# attention biases: the key bias gets a zero gradient plus rounding noise, which Adam turns into
# full-size steps of either sign (see test_backends.assert_weights_close), so it would differ
# between any two reduction orders without meaning anything.
LOPSIDED = {"d_model": 24, "num_heads": 3, "d_ff": 40, "num_encoder_layers": 2, "num_decoder_layers": 1,
            "attention_bias": False}
# max_len 16: buckets of 8 and 16 tokens; a budget of 256 gives batches of 32 and 16 rows, both
# multiples of 8, so the Batcher's batches are the same for 1, 2, 4 and 8 devices.
# lr_factor 0.5 (peak 0.045): at the paper's 1.0 this tiny model's curve is chaotic past update 13, where
# one device against itself with its weights moved by 1 ulp parts as far as 8 devices do (1e-3 by update 16).
SMALL = dict(numbers_train=600, numbers_valid=8, numbers_test=0, max_len=16, token_budget=256, model=LOPSIDED,
             dropout=0.1, warmup=5, lr_factor=0.5, seed=3, progress=False, samples=0)


# ----------------------------------------------------------------------------------------------
# Subprocess helpers


def _env(devices: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") and k != "XLA_FLAGS"}
    env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu",
               PYTHONPATH=str(REPO))
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_worker(mode: str, out: Path, devices: int) -> None:
    # The worker compiles every step shape for 8 and for 1 device: minutes on a slow 2-core machine
    # (over 300 s beside other work), so the limit only catches a hang.
    proc = subprocess.run([sys.executable, __file__, mode, str(out)], env=_env(devices), cwd=REPO,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


# ----------------------------------------------------------------------------------------------
# The worker (runs in a subprocess with 8 forced CPU devices)


def _worker_parity(out: Path) -> None:
    """Uninterrupted 20-step runs on 8 and 1 devices, and 10 + 10 steps across a checkpoint written
    on one device count and restored on the other; losses and final parameters to out (npz)."""
    import jax

    from train.backends import create_backend

    assert jax.device_count() == 8, jax.devices()
    splits = data.numbers_corpus(SMALL["numbers_train"], SMALL["numbers_valid"], 0, seed=SMALL["seed"])
    tokenizers = data.train_tokenizers(splits.train, vocab_size=400)
    base = ExperimentConfig(backend="jax", run_dir=str(out.parent / "unused"), **SMALL).resolve()
    model_cfg = base.model_config(tokenizers.src.get_vocab_size(), tokenizers.tgt.get_vocab_size())

    def make(devices, checkpoint_dir=None):
        cfg = base.replace(devices=devices)
        backend = create_backend(cfg, model_cfg, checkpoint_dir)
        assert backend.topology.num_devices == devices and backend.mesh.devices.size == devices
        return backend, loop.make_batcher(cfg, tokenizers, splits.train, num_devices=devices)

    def train(backend, batcher, steps):
        return [m["loss"] for m in backend.fetch([backend.train_step([next(batcher)]) for _ in range(steps)])]

    def params(backend):
        leaves = jax.tree_util.tree_flatten_with_path(backend.local_params())[0]
        return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}

    results: dict[str, np.ndarray] = {}
    shapes = {}
    for devices in (8, 1):
        backend, batcher = make(devices, str(out.parent / f"ckpt-{devices}"))
        shapes[devices] = batcher.shapes
        losses = train(backend, batcher, 10)
        backend.save({"data": batcher.state()})  # restored below on the other device count
        results[f"loss/{devices}"] = np.array(losses + train(backend, batcher, 10))
        results.update({f"params/{devices}/{k}": v for k, v in params(backend).items()})
        # The state is replicated over the mesh and stays float32.
        leaf = jax.tree.leaves(backend.state["params"])[0]
        assert leaf.sharding.is_fully_replicated and len(leaf.sharding.device_set) == devices
        backend.close()
    assert shapes[8] == shapes[1] and all(b % 8 == 0 for b, _ in shapes[8]), shapes

    for first, second in ((8, 1), (1, 8)):
        backend, batcher = make(second, str(out.parent / f"ckpt-{first}"))
        meta = backend.restore(10)
        batcher.restore(meta["data"])
        leaf = jax.tree.leaves(backend.state["params"])[0]
        assert len(leaf.sharding.device_set) == second  # restored onto the current mesh
        results[f"loss/{first}to{second}"] = np.array(list(results[f"loss/{first}"][:10]) + train(backend, batcher, 10))
        results.update({f"params/{first}to{second}/{k}": v for k, v in params(backend).items()})
        backend.close()

    # Gradient accumulation over the mesh: two micro-batches per update, 8 devices against 1.
    for devices in (8, 1):
        backend, _ = make(devices)
        accum_cfg = base.replace(devices=devices, grad_accum=2)
        batcher = loop.make_batcher(accum_cfg, tokenizers, splits.train, num_devices=devices)
        metrics = [backend.train_step([next(batcher), next(batcher)]) for _ in range(2)]
        results[f"accum/{devices}"] = np.array([m["loss"] for m in backend.fetch(metrics)])
    np.savez(out, **results)


# ----------------------------------------------------------------------------------------------
# Tests


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp") / "parity.npz"
    _run_worker("parity", out, devices=8)
    return dict(np.load(out))


def _params(results, run: str) -> dict[str, np.ndarray]:
    return {k.split("/", 2)[2]: v for k, v in results.items() if k.startswith(f"params/{run}/")}


def assert_params_close(results, run: str, reference: str) -> None:
    """The parameters after `run` against those after `reference`: relative to their norm, and
    tensor by tensor in absolute terms."""
    actual, expected = _params(results, run), _params(results, reference)
    assert actual.keys() == expected.keys() and expected
    flat = [np.concatenate([d[k].ravel() for k in sorted(d)]) for d in (actual, expected)]
    # Measured 5.2e-7 on the old corpus, 4.4e-5 after 12 steps on the corpus spread over every
    # band: float32 rounding of differently ordered gradient sums, amplified as below (see REL).
    assert np.linalg.norm(flat[0] - flat[1]) / np.linalg.norm(flat[1]) < REL
    # Measured up to 8.9e-6, in the query/key kernels: softmax ignores a shift shared by all keys
    # of a query, so some directions of those kernels get a gradient of 0 plus rounding noise,
    # which Adam (dividing by |g|) turns into steps of up to the learning rate (~0.09 here).
    # On the corpus spread over every band: up to 6.6e-4 (a cross-attention key kernel, measured).
    # 2e-3 is still ~1/45 of one such step, far below any real difference.
    for name in expected:
        np.testing.assert_allclose(actual[name], expected[name], rtol=0, atol=2e-3, err_msg=name)


# The losses: 8 devices sum the gradient over 8 partial sums (an all-reduce) where 1 device sums
# over the whole batch at once, so only float32 rounding differs (~1e-7 per reduction) and the
# losses of 20 steps agreed to 3e-7 relative (measured at SMALL's lr_factor 0.5; at 1.0 the curve is
# chaotic, see SMALL, and 1 ulp grows to 1e-3 by update 16). 1e-4 still fails on any real difference (a lost
# device's gradient, an unscaled mean or another dropout mask changes them by >1e-2).
REL = 1e-4


# The 8-device runs take ~2 min on 2 cores (one subprocess for the module, shared by the three tests).
def test_eight_devices_train_like_one(parity):
    np.testing.assert_allclose(parity["loss/8"], parity["loss/1"], rtol=REL)
    assert parity["loss/8"][-5:].mean() < parity["loss/8"][0] - 2.0  # it learns: measured 6.43 -> 3.31
    assert_params_close(parity, "8", "1")


@pytest.mark.parametrize("first,second", [(8, 1), (1, 8)])
def test_checkpoint_moves_between_device_counts(parity, first, second):
    """Saved after 10 steps on `first` devices, restored on `second`, 10 more steps: the same as
    20 uninterrupted steps on `second` (dropout masks from fold_in(rng, step) carry on too)."""
    run = f"{first}to{second}"
    np.testing.assert_allclose(parity[f"loss/{run}"], parity[f"loss/{second}"], rtol=REL)
    assert_params_close(parity, run, second)


def test_gradient_accumulation_over_devices(parity):
    np.testing.assert_allclose(parity["accum/8"], parity["accum/1"], rtol=REL)  # REL: as above


def test_two_processes_train_like_one_with_four_devices(tmp_path):
    """`python -m train.run` on a --train text corpus in two processes (2 CPU devices each, coordinator
    on 127.0.0.1), each reading its half of every batch from the one store, against one process with
    4 devices: the same losses; process 0 alone prints the summary."""
    splits = data.numbers_corpus(SMALL["numbers_train"], SMALL["numbers_valid"], 0, seed=SMALL["seed"])
    for name, pairs in (("train", splits.train), ("valid", splits.valid)):
        for k, lang in enumerate(("de", "en")):
            (tmp_path / f"{name}.{lang}").write_text("".join(pair[k] + "\n" for pair in pairs))
    flags = ["--train", f"de:en:{tmp_path}/train", "--valid", f"de:en:{tmp_path}/valid", "--steps", "6",
             "--eval-every", "6", "--log-every", "1", "--eval-sentences", "4", "--beam", "1", "--vocab-size", "300"]
    for key, value in SMALL.items():
        if key.startswith("numbers_"):
            continue
        elif key == "model":
            flags += [arg for k, v in value.items() for arg in ("--set", f"{k}={v}")]
        elif key == "progress":
            flags.append("--no-progress")
        else:
            flags += [f"--{key.replace('_', '-')}", str(value)]
    command = [sys.executable, "-m", "train.run", *flags]
    cache = {"AIAYN_DATA_CACHE": str(tmp_path / "cache")}
    single = subprocess.Popen([*command, "--run-dir", str(tmp_path / "one")], env={**_env(4), **cache}, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    port = _free_port()
    multi = [
        subprocess.Popen(
            [*command, "--run-dir", str(tmp_path / "two"), "--coordinator-address", f"127.0.0.1:{port}",
             "--num-processes", "2", "--process-id", str(i)],
            env={**_env(2), **cache}, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=1200) for p in (single, *multi)]
    for p, (stdout, stderr) in zip((single, *multi), outputs):
        assert p.returncode == 0, stdout[-3000:] + stderr[-3000:]
    one = json.loads((tmp_path / "one" / "results.json").read_text())
    two = json.loads((tmp_path / "two" / "results.json").read_text())
    losses_one = [t["loss"] for t in one["history"]["train"]]
    losses_two = [t["loss"] for t in two["history"]["train"]]
    assert len(losses_one) == 6
    # Same global batches and update; only the all-reduce's summation order differs (see REL).
    np.testing.assert_allclose(losses_two, losses_one, rtol=REL)
    assert "4 device(s) in 2 processes" in outputs[1][0] and "done:" in outputs[1][0]
    # Process 1 prints nothing (gloo, jax's CPU collectives, announces its connections itself).
    assert [line for line in outputs[2][0].splitlines() if not line.startswith("[Gloo]")] == []
    assert (tmp_path / "two" / "checkpoints" / "6").is_dir()  # written by both processes together
    stores = [p for p in (tmp_path / "cache").iterdir() if p.is_dir() and not p.name.startswith("tokenizers-")]
    assert len(stores) == 1  # one store, read by all three (beside the corpus's tokenizers)


@pytest.mark.parametrize("backend", ["jax", "torch"])  # jax: ~25 s
def test_bfloat16_loss_falls(backend, fast_config):
    """bf16 mixed precision on the CPU learns, with float32 parameters and optimizer state."""
    splits = data.numbers_corpus(600, 8, 0, seed=3)
    tokenizers = data.train_tokenizers(splits.train, vocab_size=400)
    cfg = fast_config(backend, dtype="bfloat16", warmup=10, lr_factor=2.0, numbers_train=600).resolve()
    model_cfg = cfg.model_config(tokenizers.src.get_vocab_size(), tokenizers.tgt.get_vocab_size())
    from train.backends import create_backend

    trainer = create_backend(cfg, model_cfg)
    batcher = loop.make_batcher(cfg, tokenizers, splits.train)
    losses = [m["loss"] for m in trainer.fetch([trainer.train_step([next(batcher)]) for _ in range(40)])]
    # From ~6.8 (about uniform over 400 tokens) to well below: measured 6.87 -> 3.68 (jax),
    # 6.73 -> 3.06 (torch; the two start from different random weights).
    # bf16 rounding (3 significant digits) is far smaller than that fall.
    assert np.mean(losses[-5:]) < losses[0] - 2.0, losses
    if backend == "jax":
        import jax
        import jax.numpy as jnp

        assert {str(x.dtype) for x in jax.tree.leaves(trainer.state)} == {"float32", "int32"}  # int32: step
        model = trainer.ctx.model(trainer.local_params())
        batch = next(batcher)
        assert model.encode(batch.src).dtype == jnp.bfloat16  # activations in bf16
        assert model(batch.src, batch.tgt_in).dtype == jnp.bfloat16
    else:
        import torch

        assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
        assert {s.dtype for st in trainer.optimizer.state.values() for s in st.values() if s.dim()} == {torch.float32}
        batch = next(batcher)
        src, tgt_in = (torch.from_numpy(a).long() for a in (batch.src, batch.tgt_in))
        with trainer.autocast():
            # Matmuls in bf16 (autocast keeps LayerNorm outputs float32 on the CPU).
            assert trainer.model(src, tgt_in).dtype == torch.bfloat16


def test_jax_devices_on_a_cpu_split_the_host_as_torch_starts_processes(tmp_path):
    """`--backend jax --devices 2` without XLA_FLAGS: two CPU devices, made before jax starts."""
    env = {k: v for k, v in _env(1).items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, "-m", "train.run", "--backend", "jax", "--devices", "2", "--preset", "tiny",
                           "--numbers-train", "200", "--numbers-valid", "4", "--numbers-test", "0", "--max-len", "16",
                           "--token-budget", "256", "--vocab-size", "300", "--steps", "1", "--eval-sentences", "2",
                           "--beam", "1", "--samples", "0", "--no-progress", "--run-dir", str(tmp_path / "run")],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=600)  # the limit catches a hang
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 device(s); run dir" in proc.stdout, proc.stdout[-3000:]


def test_devices_errors(fast_config, capsys, monkeypatch):
    from train.commands import run

    base = ["--run-dir", str(fast_config("jax").run_dir), "--no-progress"]
    # One CPU device named in XLA_FLAGS (or jax started already): --devices cannot split the host.
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    assert run.main([*base, "--devices", "2"]) == 1
    assert "--devices 2: 1 device(s) visible" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "3")  # under torchrun --nproc-per-node 3
    assert run.main([*base, "--backend", "torch", "--devices", "2"]) == 1
    assert capsys.readouterr().err == "error: --devices 2: torchrun started 3 processes\n"
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(SystemExit):
        run.parse_config(["--devices", "0"])
    assert "devices must be >= 1" in capsys.readouterr().err
    # A budget that holds fewer max_len sequences than there are devices cannot be split.
    cfg = fast_config("jax", token_budget=64, max_len=16)
    with pytest.raises(runtime.UserError, match="holds 4 sequence.*8 devices.*at least 128"):
        loop.make_batcher(cfg, None, [], num_devices=8)
    # A divisible budget: every bucket's batch size is a multiple of the device count.
    splits = data.numbers_corpus(200, 8, 0, seed=0)
    tokenizers = data.train_tokenizers(splits.train, vocab_size=300)
    cfg = fast_config("jax", token_budget=200, max_len=16)
    shapes = loop.make_batcher(cfg, tokenizers, splits.train, num_devices=8).shapes
    assert shapes and all(b % 8 == 0 and b * length <= 200 for b, length in shapes), shapes


if __name__ == "__main__":
    mode, out = sys.argv[1], Path(sys.argv[2])
    {"parity": _worker_parity}[mode](out)
