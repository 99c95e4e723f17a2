"""The two backends against each other: same weights, same batches, dropout off -> same training.

The central test is `test_jax_and_torch_train_alike`: a torch model's initial state is
converted into the JAX backend (train.interop.weights.transfer_state) and both take the same updates; the per-step
losses must agree to 1e-5 relative. Lopsided model sizes (d_model=24 with 3 heads, 2 encoder
layers and 1 decoder layer) so a swapped axis cannot pass.
"""

import jax
import numpy as np
import pytest
import torch

import jax_transformer
import torch_reference
from torch_reference.objective import noam_learning_rate
from train import data, loop
from train.backends import Backend, create_backend
from train.interop.weights import convert_state, transfer_state

# Parity is asserted at full float32 matmul precision (the README's numerics contract).
jax.config.update("jax_default_matmul_precision", "highest")

LOPSIDED = {"d_model": 24, "num_heads": 3, "d_ff": 40, "num_encoder_layers": 2, "num_decoder_layers": 1}


def torch_weights(backend) -> dict[str, np.ndarray]:
    """The backend's weights in torch's layout (the spec's names)."""
    return convert_state(backend.export_state(), "torch", backend.model_cfg).params


def assert_weights_close(actual: Backend, expected: Backend, atol: float) -> None:
    """Equal weights up to `atol`, except the key projections' biases: adding b to every key
    adds q.b to all scores of a query, which softmax ignores, so their gradient is 0 plus float32
    noise of either sign, and Adam, which divides by |g|, turns that noise into full +-lr steps.
    They never change the model's function (the losses are compared separately)."""
    actual, expected = torch_weights(actual), torch_weights(expected)
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        if not name.endswith("k_proj.bias"):
            np.testing.assert_allclose(actual[name], value, atol=atol, err_msg=name)


@pytest.fixture(scope="module")
def corpus():
    splits = data.numbers_corpus(train_size=600, valid_size=16, test_size=0, seed=3)
    return splits, data.train_tokenizers(splits.train, vocab_size=400)


def _pair(fast_config, corpus, **changes):
    """(torch backend, jax backend holding the torch weights, batcher) for one config."""
    splits, tokenizers = corpus
    changes = {"dropout": 0.0, "warmup": 4, "lr_factor": 1.0, "model": LOPSIDED, **changes}
    cfg_torch = fast_config("torch", **changes).resolve()
    cfg_jax = cfg_torch.replace(backend="jax")
    model_cfg = cfg_torch.model_config(tokenizers.src.get_vocab_size(), tokenizers.tgt.get_vocab_size())
    torch_backend = create_backend(cfg_torch, model_cfg)
    jax_backend = create_backend(cfg_jax, model_cfg)
    transfer_state(torch_backend, jax_backend)
    assert isinstance(torch_backend, Backend) and isinstance(jax_backend, Backend)  # the one interface
    assert torch_backend.num_params == jax_backend.num_params
    batchers = [loop.make_batcher(c, tokenizers, splits.train) for c in (cfg_torch, cfg_jax)]
    return torch_backend, jax_backend, batchers


@pytest.mark.parametrize(
    "changes",
    [
        {},  # ~14 s; the case below covers the same code and more
        # Both accumulation paths (two micro-batches per update) and clipping that triggers
        # (gradient norms here are ~1-3): the same formulas on both sides.
        {"grad_accum": 2, "clip_norm": 0.5},
        # Packed rows (segment ids): the same masks and positions on both sides. lr_factor 0.2: at 0.3, on a
        # CPU without AVX-512 (torch's AVX2 kernels), the grad norms parted at update 5 (2.9e-4 after 1.5e-5
        # at update 4, the losses still within 1e-5): the chaos described below, reached sooner.
        {"pack": True, "lr_factor": 0.2},
        # The fused attention kernels and remat in both frameworks: the same training to the same bounds.
        {"kernels": "fused", "remat": True, "dropout": 0.0},
    ],
    ids=["plain", "accumulate-and-clip", "packed", "fused-remat"],
)
def test_jax_and_torch_train_alike(fast_config, corpus, changes):
    # lr_factor 0.3: five updates at lr 0.008-0.03. At lr_factor 1 (0.026-0.1) the run is chaotic at
    # the weights' 1e-4 level: torch against itself with the initial weights scaled by 1 + 1e-7
    # noise differs by 3.8e-4 after five updates (decoder ff weights), as JAX against torch did
    # (one source-embedding row, 4.8e-4), so the comparison below would measure the chaos, not
    # the frameworks.
    changes = {"lr_factor": 0.3, **changes}
    torch_backend, jax_backend, (batcher_t, batcher_j) = _pair(fast_config, corpus, **changes)
    accum = changes.get("grad_accum", 1)
    steps = 5
    history = {"torch": [], "jax": []}
    for _ in range(steps):
        batches = [next(batcher_t) for _ in range(accum)]
        same = [next(batcher_j) for _ in range(accum)]
        # The loop builds the batches without looking at the backend: identical for one seed.
        assert all(np.array_equal(a.src, b.src) and np.array_equal(a.tgt_out, b.tgt_out) for a, b in zip(batches, same))
        assert all((b.src_segments is not None) == bool(changes.get("pack")) for b in batches)
        history["torch"] += torch_backend.fetch([torch_backend.train_step(batches)])
        history["jax"] += jax_backend.fetch([jax_backend.train_step(batches)])
    loss_t = np.array([m["loss"] for m in history["torch"]])
    loss_j = np.array([m["loss"] for m in history["jax"]])
    # 1e-5: float32 rounding of two frameworks (summation orders, fused kernels) through five Adam
    # updates (measured: at most 4e-7 here; with lr ~0.1 the runs part after ~10 steps, chaos);
    # updates; a wrong formula (schedule off by one step, clipping epsilon, accumulation
    # weights) moves the loss by 1e-3 or more after the first update.
    np.testing.assert_allclose(loss_j, loss_t, rtol=1e-5)
    assert loss_t[-1] < loss_t[0] - 0.1  # the updates did something (lr ~0.02 here)
    for name in ("nll", "grad_norm", "tokens"):
        # 1e-4 for the gradient norm: a sum of squares over every parameter, more rounding.
        np.testing.assert_allclose([m[name] for m in history["jax"]], [m[name] for m in history["torch"]], rtol=1e-4)
    # Both number updates from 1: update n runs at the paper's lr(step=n).
    expected_lr = [noam_learning_rate(n, 24, 4, changes["lr_factor"]) for n in range(1, steps + 1)]
    np.testing.assert_allclose([m["lr"] for m in history["torch"]], expected_lr, rtol=1e-12)  # Python floats
    np.testing.assert_allclose([m["lr"] for m in history["jax"]], expected_lr, rtol=1e-6)  # float32
    assert torch_backend.step == jax_backend.step == steps
    # The weights themselves: 1e-4 absolute after five Adam steps of lr ~0.01-0.03 each (under 1%
    # of one step): Adam divides by |g| + 1e-9, so the rounding of tiny gradients reaches the
    # updates at that scale.
    assert_weights_close(jax_backend, torch_backend, atol=1e-4)


def test_accumulation_equals_one_big_batch(fast_config, corpus):
    """Two micro-batches of one update = one batch holding both: the loss is summed over all their
    tokens and divided by the total, not averaged per micro-batch."""
    splits, tokenizers = corpus
    cfg = fast_config("torch", dropout=0.0, warmup=4, model=LOPSIDED).resolve()
    batcher = data.Batcher(data.encode_pairs(tokenizers, splits.train), token_budget=256, max_len=16, shuffle=False)
    first, second = list(batcher.epoch_batches())[-2:]  # the same bucket, different token counts
    assert first.src.shape == second.src.shape and first.num_tgt_tokens != second.num_tgt_tokens
    union = data.Batch(
        *(np.concatenate([getattr(first, k), getattr(second, k)]) for k in ("src", "tgt_in", "tgt_out", "ids")),
        first.num_src_tokens + second.num_src_tokens, first.num_tgt_tokens + second.num_tgt_tokens,
    )
    model_cfg = cfg.model_config(tokenizers.src.get_vocab_size(), tokenizers.tgt.get_vocab_size())
    for backend_name in ("torch", "jax"):
        split, whole = (create_backend(cfg.replace(backend=backend_name, grad_accum=g), model_cfg) for g in (2, 1))
        initial = create_backend(cfg, model_cfg)
        transfer_state(initial, split)
        transfer_state(initial, whole)
        m_split = split.fetch([split.train_step([first, second])])[0]
        m_whole = whole.fetch([whole.train_step([union])])[0]
        # 1e-6: the same sums in another order (float32).
        assert m_split["loss"] == pytest.approx(m_whole["loss"], rel=1e-6), backend_name
        assert m_split["tokens"] == m_whole["tokens"] == union.num_tgt_tokens
        # 2e-5 absolute after one Adam step of ~lr = 0.026 (under 0.1% of the step): Adam divides by
        # |g| + 1e-9, so the float32 rounding of a tiny gradient (rare tokens' embedding rows)
        # reaches the update at that scale.
        assert_weights_close(split, whole, atol=2e-5)


def test_translations_agree(fast_config, corpus):
    splits, tokenizers = corpus
    torch_backend, jax_backend, (batcher, _) = _pair(fast_config, corpus, warmup=20, lr_factor=2.0)
    for _ in range(30):  # some training, so the argmax is not a near-tie everywhere
        torch_backend.train_step([next(batcher)])
    # Search on identical weights (training in two frameworks drifts apart by rounding; that is
    # the previous test's subject).
    transfer_state(torch_backend, jax_backend)
    src = next(batcher).src
    src[-1] = data.PAD_ID  # an all-pad filler row, as the Batcher adds them
    for beam in (4,):
        np.testing.assert_array_equal(jax_backend.translate(src, beam), torch_backend.translate(src, beam))
    out_t = torch_backend.translate(src, 1)
    out_j = jax_backend.translate(src, 1)
    length = min(torch_backend.model_cfg.max_len, int(1.5 * src.shape[1]) + 10)  # decode.output_length
    assert out_t.shape == out_j.shape == (src.shape[0], length) and out_t.dtype == out_j.dtype == np.int32
    # Same weights to ~1e-6: the same greedy choices (a flip needs two logits within ~1e-6).
    np.testing.assert_array_equal(out_j, out_t)
    assert not np.isin(out_t, [data.BOS_ID]).any()
    assert (out_t[-1] == data.PAD_ID).all()  # a row of padding only is no sentence: no output
    for row in out_t[(src != data.PAD_ID).any(axis=1)]:  # the sentences (the Batcher may add filler rows too)
        ids = row.tolist()
        if data.EOS_ID in ids:  # after <eos> only <pad>
            assert not any(ids[ids.index(data.EOS_ID) + 1 :])
        assert data.PAD_ID not in ids[: ids.index(data.EOS_ID) if data.EOS_ID in ids else len(ids)]


@pytest.mark.parametrize("backend_name", ["torch", "jax"])  # jax: ~25 s
def test_checkpoints_keep_newest_and_best(tmp_path, fast_config, corpus, backend_name):
    splits, tokenizers = corpus
    cfg = fast_config(backend_name, keep_checkpoints=2, model=LOPSIDED).resolve()
    model_cfg = cfg.model_config(tokenizers.src.get_vocab_size(), tokenizers.tgt.get_vocab_size())
    backend = create_backend(cfg, model_cfg, str(tmp_path / "ckpt"))
    batcher = loop.make_batcher(cfg, tokenizers, splits.train)
    bleus = {1: 5.0, 2: 30.0, 3: None, 4: 10.0, 5: None}
    weights = {}
    for step, bleu in bleus.items():
        backend.train_step([next(batcher)])
        weights[step] = backend.weights()
        backend.save({"step": step, "data": batcher.state()}, None if bleu is None else {"bleu": bleu})
    assert backend.checkpoint_steps() == [2, 4, 5]  # newest two, plus the best BLEU (step 2)
    assert backend.restore("best") == {"step": 2, "data": {"epoch": 0, "index": 2}}
    assert backend.step == 2
    for name, value in backend.weights().items():
        np.testing.assert_array_equal(value, weights[2][name])  # bit-exact
    assert backend.restore("latest")["step"] == 5 and backend.step == 5
    assert backend.restore(4)["step"] == 4
    with pytest.raises(FileNotFoundError, match="step 3"):
        backend.restore(3)
    backend.close()
    empty = create_backend(cfg, model_cfg, str(tmp_path / "none"))
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        empty.restore()


def test_torch_checkpoint_files(tmp_path, fast_config, corpus):
    """safetensors only (no pickle), the config in the weights' metadata as aiayn convert reads it."""
    from safetensors import safe_open

    from train.interop import runs

    splits, tokenizers = corpus
    cfg = fast_config("torch", model=LOPSIDED).resolve()
    model_cfg = cfg.model_config(tokenizers.src.get_vocab_size(), tokenizers.tgt.get_vocab_size())
    backend = create_backend(cfg, model_cfg, str(tmp_path))
    backend.train_step([next(loop.make_batcher(cfg, tokenizers, splits.train))])
    backend.save({"step": 1})
    files = sorted(p.name for p in (tmp_path / "1").iterdir())
    assert files == ["digest.json", "meta.json", "model.safetensors", "optimizer.safetensors"]
    state_dict, loaded_cfg = runs.load_torch_weights(tmp_path / "1" / "model.safetensors")
    assert loaded_cfg == model_cfg and state_dict.keys() == backend.weights().keys()
    with safe_open(str(tmp_path / "1" / "optimizer.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    names = [n for n, _ in backend.model.named_parameters()]
    assert keys == {f"{n}.{m}" for n in names for m in ("exp_avg", "exp_avg_sq")} | {"__torch_cpu_rng_state__"}
    assert torch.is_tensor(state_dict[names[0]])


@pytest.mark.parametrize("dtype, platform, preset, expected", [
    ("float32", "gpu", None, "highest"),  # GPUs default to TF32 matmuls: float32 is asked for
    ("float32", "tpu", None, "highest"),
    ("float32", "cpu", None, None),  # float32 already; the setting is left alone
    ("bfloat16", "gpu", None, None),  # the matmuls are bfloat16 anyway
    ("float32", "gpu", "tensorfloat32", "tensorfloat32"),  # the user's own choice stays
])
def test_float32_means_float32_matmuls_off_the_cpu(dtype, platform, preset, expected):
    import jax

    from train.backends.jax_backend import full_float32_matmuls

    before = jax.config.jax_default_matmul_precision
    try:
        jax.config.update("jax_default_matmul_precision", preset)
        assert full_float32_matmuls(dtype, platform) == (expected == "highest" and preset is None)
        assert jax.config.jax_default_matmul_precision == expected
    finally:
        jax.config.update("jax_default_matmul_precision", before)


@pytest.mark.parametrize("choice, backend, platform, expected", [
    ("auto", "jax", "cpu", "xla_cpu"), ("auto", "jax", "gpu", "fused"), ("auto", "jax", "tpu", "reference"),
    ("auto", "torch", "cpu", "reference"), ("auto", "torch", "gpu", "fused"), ("reference", "jax", "cpu", "reference"),
    ("fused", "torch", "cpu", "fused"), ("xla_cpu", "jax", "gpu", "xla_cpu"),
])
def test_the_kernel_set_is_resolved_from_the_platform(choice, backend, platform, expected):
    from train.config import resolve_kernels

    assert resolve_kernels(choice, backend, platform) == expected


def test_dtype_defaults_to_bfloat16_off_the_cpu_and_a_torch_xla_cpu_choice_is_refused(fast_config):
    from train.config import default_dtype

    assert [default_dtype(p) for p in ("cpu", "gpu", "tpu")] == ["float32", "bfloat16", "bfloat16"]
    assert fast_config("jax").dtype is None  # automatic: resolved where the platform is known
    with pytest.raises(ValueError, match="^kernels xla_cpu is the JAX model's"):
        fast_config("torch", kernels="xla_cpu")


def test_backends_build_their_models_with_the_kernel_set_and_remat(fast_config, corpus):
    """On the CPU, auto gives JAX xla_cpu and torch reference, in float32; the model holds the choice
    and every module that reads it has it; --kernels and --remat reach the models."""
    _, tokenizers = corpus
    cfg = fast_config("jax", model=LOPSIDED).resolve()
    model_cfg = cfg.model_config(tokenizers.src.get_vocab_size(), tokenizers.tgt.get_vocab_size())
    jax_backend = create_backend(cfg, model_cfg)
    model = jax_backend.ctx.model(jax_backend.state["params"])
    assert jax_backend.kernels == "xla_cpu" and model.kernels is jax_transformer.KERNELS["xla_cpu"] and model.xla_cpu
    assert not model.encoder.remat
    assert model.encoder.layers[0].ff.linear1.dot_general.__name__ == "linear_dot_general"
    torch_backend = create_backend(cfg.replace(backend="torch"), model_cfg)
    assert torch_backend.kernels == "reference" and torch_backend.dtype == "float32"
    assert torch_backend.model.kernels is torch_reference.KERNELS["reference"]
    for backend in ("jax", "torch"):
        chosen = create_backend(cfg.replace(backend=backend, kernels="fused", remat=True), model_cfg)
        model = chosen.ctx.model(chosen.state["params"]) if backend == "jax" else chosen.model
        twin = jax_transformer if backend == "jax" else torch_reference
        assert model.kernels is model.decoder.layers[0].cross_attn.kernels is twin.KERNELS["fused"], backend
        assert model.encoder.remat and model.decoder.remat, backend
