"""Cached decoding and search: cached = uncached in each framework, and torch = JAX.

Tolerances: logits 1e-5 max abs (the parity contract's float32 bound for tiny models); scores
are sums of up to L log-probabilities, 1e-5 absolute (each term agrees to ~1e-6).
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torch_reference as tr
from jax_transformer import decode as jd
from jax_transformer import model as jmodel
from parity import torch_to_jax
from parity.check import enable_parity_numerics
from torch_reference import decode as td

enable_parity_numerics()

LOPSIDED = dict(src_vocab_size=53, tgt_vocab_size=53, d_model=24, num_heads=3, d_ff=40,
                num_encoder_layers=2, num_decoder_layers=3, max_len=40, dropout=0.0)


def pair(seed=0, **overrides):
    torch.manual_seed(seed)
    torch_model = tr.Transformer(tr.TransformerConfig(**{**LOPSIDED, **overrides})).eval()
    if torch_model.logits_bias is not None:  # zeros at init: made visible
        with torch.no_grad():
            torch_model.logits_bias.normal_()
    return torch_model, torch_to_jax(torch_model)


def source(batch=4, length=9, seed=0, vocab=53):
    """Random sources ending in EOS with right padding; row lengths differ."""
    rng = np.random.default_rng(seed)
    out = np.zeros((batch, length), dtype=np.int64)
    for row, n in enumerate(rng.integers(1, length + 1, size=batch)):
        out[row, : n - 1] = rng.integers(4, vocab, size=n - 1)
        out[row, n - 1] = 2
    return out


@pytest.mark.parametrize("overrides", [{}, *(pytest.param(o, marks=pytest.mark.slow) for o in (  # ~4 s each
    {"norm_position": "pre", "positions": "learned"}, {"activation": "swiglu"})),
    {"activation": "silu", "positions": "sinusoidal_halves", "output_bias": True, "bos_id": 0}])
def test_cached_steps_equal_the_full_decoder_in_both_frameworks(overrides):
    torch_model, jax_model = pair(**overrides)
    src = source()
    tgt = np.random.default_rng(1).integers(4, 53, size=(4, 8))
    tgt[:, 0] = 1
    src_t, tgt_t = torch.from_numpy(src), torch.from_numpy(tgt)
    mask_t = tr.padding_mask(src_t, 0)
    memory = torch_model.encode(src_t, mask_t)
    full_t = torch_model.project(torch_model.decode(tgt_t, memory, mask_t)).detach().numpy()
    cache = torch_model.init_cache(memory, 8)
    steps_t = []
    for position in range(8):
        logits, cache = torch_model.decode_step(tgt_t[:, position], cache, position, mask_t)
        steps_t.append(logits.detach().numpy())
    np.testing.assert_allclose(np.stack(steps_t, 1), full_t, atol=1e-5)

    src_j, tgt_j = jnp.asarray(src), jnp.asarray(tgt)
    mask_j = jmodel.padding_mask(src_j, 0)
    memory_j = jax_model.encode(src_j, mask_j)
    full_j = np.asarray(jax_model.project(jax_model.decode(tgt_j, memory_j, mask_j)))
    cache_j = jax_model.init_cache(memory_j, 8)
    steps_j = []
    for position in range(8):
        logits, cache_j = jax_model.decode_step(tgt_j[:, position], cache_j, position, mask_j)
        steps_j.append(np.asarray(logits))
    np.testing.assert_allclose(np.stack(steps_j, 1), full_j, atol=1e-5)
    np.testing.assert_allclose(np.stack(steps_j, 1), full_t, atol=1e-5)


@pytest.mark.parametrize("seed", [3, pytest.param(4, marks=pytest.mark.slow)])  # 10-30 s each on 2 cores
@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_cached_search_equals_the_uncached_loop_in_each_framework(search, seed):
    """`cached=False` re-runs the whole decoder over each prefix (the seeds' loop, the benchmark's
    baseline). Same tokens; scores to 1e-5 or, for long sentences, to the float32 rounding of
    their accumulation: a score is a running sum of one log-probability per token (whose logits
    agree to the 1e-5 of the cached-step test above), and each addition rounds to half an ulp of
    the running sum, so n tokens allow n ulps of |score| (a sentence of score -55.7 differed by
    1.1e-5, 3 ulps, on main: 1e-5 alone was below the accumulation's own rounding there)."""
    torch_model, jax_model = pair(seed=seed)
    src = source(batch=6, seed=seed)
    kwargs = {"beam_size": 4} if search == "beam" else {}
    runs = {
        "torch": lambda cached: getattr(td, f"{search}_search")(torch_model, torch.from_numpy(src), cached=cached, **kwargs),
        "jax": lambda cached: getattr(jd, f"{search}_search")(jax_model, src, cached=cached, **kwargs),
    }
    for framework, run in runs.items():
        (cached_tokens, cached_scores), (tokens, scores) = (
            tuple(np.asarray(x) for x in run(cached)) for cached in (True, False)
        )
        np.testing.assert_array_equal(cached_tokens, tokens, err_msg=framework)
        emitted = (tokens != 0).sum(axis=1)  # tokens up to and with EOS
        bound = np.maximum(1e-5, emitted * np.spacing(np.abs(scores).astype(np.float32)))
        assert (np.abs(cached_scores - scores) <= bound).all(), (framework, cached_scores - scores, bound)
        assert (tokens == 2).any(axis=1).all()  # every sentence ended: the whole search was compared


# Marian's variants, its decoder started by the pad id included.
MARIAN = {"activation": "silu", "positions": "sinusoidal_halves", "output_bias": True, "layer_norm_eps": 1e-5, "bos_id": 0}


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow), 3])
@pytest.mark.parametrize("search", ["greedy", "beam", "beam-hf"])
def test_torch_and_jax_search_return_identical_tokens_and_scores(search, seed):
    torch_model, jax_model = pair(seed=seed, **{2: {"norm_position": "pre"}, 3: MARIAN}.get(seed, {}))
    src = source(batch=5, length=11, seed=seed)
    if search == "greedy":
        tokens_t, scores_t = td.greedy_search(torch_model, torch.from_numpy(src))
        tokens_j, scores_j = jd.greedy_search(jax_model, src)
    else:
        scoring = "hf" if search == "beam-hf" else "gnmt"
        tokens_t, scores_t = td.beam_search(torch_model, torch.from_numpy(src), beam_size=4, scoring=scoring)
        tokens_j, scores_j = jd.beam_search(jax_model, src, beam_size=4, scoring=scoring)
    np.testing.assert_array_equal(np.asarray(tokens_j), tokens_t.numpy())
    np.testing.assert_allclose(np.asarray(scores_j), scores_t.numpy(), atol=1e-5)
    assert (tokens_t == 2).sum(dim=1).eq(1).all()  # exactly one EOS per output
    assert not ((tokens_t == 0) | (tokens_t == 1))[:, :1].any()  # never pad or BOS as first token


def test_beam_search_is_exact_when_the_beam_holds_every_hypothesis():
    # Vocabulary of 7: pad, bos, eos and 4 real tokens; at most 3 output tokens. A beam of 16 holds
    # all 4**2 live prefixes, so beam search must find the best of all sequences by brute force.
    torch_model, jax_model = pair(seed=5, src_vocab_size=7, tgt_vocab_size=7)
    src = torch.tensor([[4, 5, 6, 2], [6, 2, 0, 0]])
    mask = tr.padding_mask(src, 0)
    alpha = 0.6
    with torch.no_grad():
        memory = torch_model.encode(src, mask)
        best = []
        for row in range(2):
            scored = []
            for n in range(1, 4):
                for body in itertools.product([3, 4, 5, 6], repeat=n - 1):
                    seq = [*body, 2]
                    logits = torch_model.project(torch_model.decode(torch.tensor([[1, *seq[:-1]]]), memory[row : row + 1], mask[row : row + 1]))
                    logp = torch.log_softmax(logits[0], -1)[torch.arange(n), torch.tensor(seq)].sum().item()
                    scored.append((logp / td.length_penalty(n, alpha), seq))
            best.append(max(scored))
    tokens, scores = td.beam_search(torch_model, src, beam_size=16, alpha=alpha, max_len_a=0.0, max_len_b=3)
    tokens_j, scores_j = jd.beam_search(jax_model, src.numpy(), beam_size=16, alpha=alpha, max_len_a=0.0, max_len_b=3)
    for row in range(2):
        score, seq = best[row]
        assert tokens[row].tolist()[: len(seq)] == seq
        assert np.asarray(tokens_j)[row].tolist()[: len(seq)] == seq
        assert abs(scores[row].item() - score) <= 1e-5 and abs(float(scores_j[row]) - score) <= 1e-5


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_batching_does_not_change_results_and_short_sentences_end_at_step_one(search):
    torch_model, jax_model = pair(seed=4)
    src = source(batch=4, length=10, seed=4)
    src[2] = 0
    src[2, 0] = 2  # an empty source line: EOS only, limit max_len_a * 1 + 0 = 1 token
    run_t = (lambda s: td.greedy_search(torch_model, torch.from_numpy(s), 1.0, 0)) if search == "greedy" else (
        lambda s: td.beam_search(torch_model, torch.from_numpy(s), 3, 0.6, 1.0, 0))
    run_j = (lambda s: jd.greedy_search(jax_model, s, 1.0, 0)) if search == "greedy" else (
        lambda s: jd.beam_search(jax_model, s, 3, 0.6, 1.0, 0))
    tokens_t, scores_t = run_t(src)
    tokens_j, scores_j = run_j(src)
    assert tokens_t[2].tolist() == [2] + [0] * (tokens_t.shape[1] - 1)  # finished at step 1
    np.testing.assert_array_equal(np.asarray(tokens_j), tokens_t.numpy())
    for row in range(4):
        alone_t, alone_score = run_t(src[row : row + 1])
        n = alone_t.shape[1]
        assert tokens_t[row, :n].tolist() == alone_t[0].tolist()
        assert abs(alone_score.item() - scores_t[row].item()) <= 1e-5


@pytest.mark.parametrize("search", [pytest.param("greedy", marks=pytest.mark.slow), "beam"])  # ~20 s each
def test_search_over_a_shrinking_batch_and_rows_of_padding(search, monkeypatch):
    """The JAX search moves the live sentences into a batch half the size whenever they fit
    (`_shrinking_while`); rows of padding only (a batch's filler) are no sentence: padding, score 0,
    done from the start. Same tokens as torch (which keeps every row) and as one loop over the
    whole batch; scores to 1e-5 as above."""
    torch_model, jax_model = pair(seed=5)
    src = source(batch=12, length=12, seed=5)  # lengths 1..12: limits a*len+b differ, so ends differ
    src[[3, 8]] = 0  # filler rows
    lengths = dict(max_len_a=1.0, max_len_b=2)
    kwargs = dict(beam_size=3, **lengths) if search == "beam" else lengths
    tokens_t, scores_t = getattr(td, f"{search}_search")(torch_model, torch.from_numpy(src), **kwargs)
    results = {}
    for smallest in (2, 64):  # stages 12 -> 6 -> 3 sentences; one stage
        monkeypatch.setattr(jd, "SMALLEST_STAGE", smallest)
        tokens_j, scores_j = (np.asarray(x) for x in getattr(jd, f"{search}_search")(jax_model, src, **kwargs))
        np.testing.assert_array_equal(tokens_j, tokens_t.numpy())
        np.testing.assert_allclose(scores_j, scores_t.numpy(), atol=1e-5, rtol=0)
        results[smallest] = tokens_j
    assert (tokens_t[[3, 8]] == 0).all() and (scores_t[[3, 8]] == 0).all()
    real = np.delete(np.arange(12), [3, 8])
    assert (tokens_t[real] == 2).any(dim=1).all()  # every sentence ended with EOS
    ends = sorted({row.index(2) for row in tokens_t[real].tolist()})
    assert len(ends) >= 4  # sentences ended at several steps: the batch did shrink
    fn = jd._beam_search if search == "beam" else jd._greedy_search
    static = (3, 0.6, 1.0, 2, True, "gnmt") if search == "beam" else (1.0, 2, True)
    hlo = fn.lower(jax_model, jnp.asarray(src, jnp.int32), *static, 2).as_text()
    assert hlo.count("stablehlo.while") == 3  # one loop per stage: 12, 6, 3 sentences
    hlo = fn.lower(jax_model, jnp.asarray(src, jnp.int32), *static, 1).as_text()
    assert hlo.count("stablehlo.while") == jd.MAX_STAGES == 3  # 12, 6, 3 and not 1: at most three stages


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_search_over_a_growing_cache(search, monkeypatch):
    """On XLA:CPU the first quarter and the next quarter of the positions attend over a cache a
    quarter and a half as long (`_cache_lengths`), grown as the loop passes them: the same tokens
    as torch (whose cache is whole from the start) and as a search with the whole cache, scores
    to 1e-5 against torch as above and bit for bit against the whole cache."""
    torch_model, jax_model = pair(seed=7)
    src = source(batch=6, length=16, seed=7)  # limits up to 1.5 * 16 + 10 = 34 positions: stages 8, 17, 34
    kwargs = dict(beam_size=3) if search == "beam" else {}
    tokens_t, scores_t = getattr(td, f"{search}_search")(torch_model, torch.from_numpy(src), **kwargs)
    assert jd._cache_lengths(34, jd.SMALLEST_STAGE, True) == (8, 17, 34)
    assert (tokens_t != 0).sum(dim=1).max() > 17  # some sentence is written past both shorter caches
    results = {}
    for staged in (True, False):
        if not staged:
            monkeypatch.setattr(jd, "_cache_lengths", lambda length, *args: (length,))
        tokens_j, scores_j = (np.asarray(x) for x in getattr(jd, f"{search}_search")(jax_model, src, **kwargs))
        np.testing.assert_array_equal(tokens_j, tokens_t.numpy())
        np.testing.assert_allclose(scores_j, scores_t.numpy(), atol=1e-5, rtol=0)
        results[staged] = tokens_j, scores_j
    np.testing.assert_array_equal(results[True][0], results[False][0])
    np.testing.assert_array_equal(results[True][1], results[False][1])
    fn = jd._beam_search if search == "beam" else jd._greedy_search
    static = (3, 0.6, 1.5, 10, True, "gnmt") if search == "beam" else (1.5, 10, True)
    monkeypatch.undo()
    hlo = fn.lower(jax_model, jnp.asarray(src, jnp.int32), *static, jd.SMALLEST_STAGE).as_text()
    assert hlo.count("stablehlo.while") == 3  # two shorter caches, then the whole one (6 rows: one batch stage)


@pytest.mark.parametrize("cached", [True, False])
def test_the_first_beam_step_runs_on_one_hypothesis_a_sentence(cached, monkeypatch):
    """The first step on B rows and fanned out to k gives what k rows a sentence from the start
    give: the same tokens as torch, scores to 1e-5 (as above); the k-row form's tokens, and its
    scores to a relative 1e-6 (8 float32 ulps: a matmul over B rows may round unlike one over B*k)."""
    torch_model, jax_model = pair(seed=3)
    src = source(batch=5, length=8, seed=3)
    tokens_t, scores_t = td.beam_search(torch_model, torch.from_numpy(src), beam_size=4, cached=cached)
    assert jd._first_step_hypotheses(53, 4) == 1 and jd._first_step_hypotheses(10, 4) == 4  # 53 - 3 >= 8 > 10 - 3
    results, programs = [], set()
    for rows in (1, 4):
        monkeypatch.setattr(jd, "_first_step_hypotheses", lambda vocab, k, rows=rows: rows)
        jax.clear_caches()  # read at trace time: compile each form anew
        static = (4, 0.6, 1.5, 10, cached, "gnmt", jd._smallest_stage())
        programs.add(jd._beam_search.lower(jax_model, jnp.asarray(src, jnp.int32), *static).as_text())
        tokens_j, scores_j = (np.asarray(x) for x in jd.beam_search(jax_model, src, beam_size=4, cached=cached))
        np.testing.assert_array_equal(tokens_j, tokens_t.numpy())
        np.testing.assert_allclose(scores_j, scores_t.numpy(), atol=1e-5, rtol=0)
        results.append((tokens_j, scores_j))
    assert len(programs) == 2  # two different programs ran
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_allclose(results[0][1], results[1][1], atol=0, rtol=1e-6)


def test_attention_over_keys_shared_by_groups_of_rows():
    """Keys and values of B / g rows serving g consecutive query rows each (how the JAX beam search
    attends over a sentence's encoder output once for its hypotheses) give what the same keys
    repeated g times give: outputs and weights to 1e-6 (values of order 1, 24 wide: float32
    rounding of a matmul over g * T rows against one over T)."""
    _, jax_model = pair(seed=4)
    attn = jax_model.decoder.layers[0].cross_attn
    rng = np.random.default_rng(4)
    b, g, T, S = 3, 4, 2, 5
    x = jnp.asarray(rng.normal(size=(b * g, T, 24)), jnp.float32)
    memory = jnp.asarray(rng.normal(size=(b, S, 24)), jnp.float32)
    mask = jnp.asarray(rng.random((b, 1, 1, S)) < 0.8).at[:, :, :, 0].set(True)  # some keys masked
    repeated = lambda a: jnp.repeat(a, g, axis=0)  # noqa: E731
    want, want_weights = attn(x, repeated(memory), repeated(mask), return_attention=True)
    for kwargs in (dict(context=memory), dict(context=None, kv=attn.project_kv(memory))):
        got, weights = attn(x, mask=mask, return_attention=True, **kwargs)
        assert got.shape == want.shape and weights.shape == want_weights.shape == (b * g, 3, T, S)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=0)
        np.testing.assert_allclose(np.asarray(weights), np.asarray(want_weights), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="keys and values of 5 rows cannot serve 12 rows"):
        attn(x, jnp.zeros((5, S, 24)))


def test_only_long_cached_searches_on_the_cpu_grow_their_cache():
    assert jd._cache_lengths(31, jd.SMALLEST_STAGE, True) == (31,)  # too short to gain
    assert jd._cache_lengths(100, jd.SMALLEST_STAGE, False) == (100,)  # no cache
    assert jd._cache_lengths(100, 1 << 62, True) == (100,)  # not XLA:CPU (one loop there)
    assert jd._cache_lengths(100, jd.SMALLEST_STAGE, True) == (25, 50, 100)


@pytest.mark.parametrize("vocab, hyps, n, chunk", [(53, 4, 8, 128), *(  # 5-7 s each
    pytest.param(*case, marks=pytest.mark.slow) for case in ((7, 16, 32, 128), (1000, 4, 8, 128), (300, 1, 1, 128),
                                                               (300, 1, 1, 7))),
    (1001, 3, 6, 16)])
def test_best_candidates_equal_top_k_over_every_extension(vocab, hyps, n, chunk):
    # Integer logits: many exact ties, which must resolve to the lower index as in lax.top_k;
    # vocabularies that chunks do not divide; dead hypotheses (NEG_INF); sentences at their limit.
    cfg = tr.TransformerConfig(**{**LOPSIDED, "src_vocab_size": vocab, "tgt_vocab_size": vocab})
    rng = np.random.default_rng(vocab + n)
    logits = jnp.asarray(rng.integers(-3, 4, size=(6, hyps, vocab)), jnp.float32)
    base = rng.integers(-3, 1, size=(6, hyps)).astype(np.float32)
    base[:3, 1:] = jd.NEG_INF
    must_end = jnp.asarray([False, True, False, False, True, False])
    expected = jd.top_candidates(cfg, logits, jnp.asarray(base), must_end, n)
    values, index = jd.best_candidates(cfg, logits, jnp.asarray(base), must_end, n, chunk)
    np.testing.assert_array_equal(np.asarray(index), np.asarray(expected[1]))
    np.testing.assert_array_equal(np.asarray(values), np.asarray(expected[0]))


def test_source_longer_than_max_len_is_refused_clearly():
    torch_model, jax_model = pair()
    src = np.full((1, 41), 5)
    with pytest.raises(ValueError, match="exceeds the model's max_len=40"):
        td.beam_search(torch_model, torch.from_numpy(src))
    with pytest.raises(ValueError, match="exceeds the model's max_len=40"):
        jd.greedy_search(jax_model, src)


def test_output_length_is_bounded_by_max_len():
    assert td.output_length(30, 40, 1.5, 10) == 40
    assert td.output_length(4, 40, 1.5, 10) == 16
    assert jd.output_length(4, 40, 1.5, 10) == 16


@pytest.mark.slow  # ~65 s: trains a model on Multi30k first
def test_search_parity_on_multi30k_with_a_trained_model(multi30k, tmp_path):
    """Real sentences and trained weights: a 2+2-layer model trained 80 steps on Multi30k (torch),
    its weights converted; greedy and beam 4 over 48 validation sentences (one padded batch) give
    identical tokens in both frameworks and scores to float32 rounding."""
    from train import data, loop, rundir
    from train.config import ExperimentConfig

    cfg = ExperimentConfig(
        backend="torch", run_dir=str(tmp_path / "run"), train=f"de:en:{multi30k}/train",
        valid=f"de:en:{multi30k}/val", vocab_size=1000, max_len=64, token_budget=4096, steps=80, warmup=20,
        lr_factor=2.0, eval_every=1000, eval_sentences=4, beam=1, samples=0, progress=False,
        model={"num_encoder_layers": 2, "num_decoder_layers": 2}, hf_cache=str(tmp_path / "hf"),
    )
    loop.train(cfg)
    run = rundir.open_run(cfg.run_dir, "latest")
    torch_model = tr.Transformer(run.model_config).eval()
    torch_model.load_state_dict({k: torch.from_numpy(v) for k, v in run.backend.weights().items()})
    jax_model = torch_to_jax(torch_model)

    lines = data.load_parallel(f"de:en:{multi30k}/val").pairs[:48]
    ids = data.encode(run.tokenizers.src, [de for de, _ in lines])
    src = np.zeros((len(ids), max(map(len, ids))), dtype=np.int64)
    for row, sentence in enumerate(ids):
        src[row, : len(sentence)] = sentence
    for search, kwargs in [("greedy_search", {}), ("beam_search", {"beam_size": 4})]:
        tokens_t, scores_t = getattr(td, search)(torch_model, torch.from_numpy(src), **kwargs)
        tokens_j, scores_j = getattr(jd, search)(jax_model, src, **kwargs)
        np.testing.assert_array_equal(np.asarray(tokens_j), tokens_t.numpy(), err_msg=search)
        # Scores here sum ~100 log-probabilities, up to |180|, where one float32 ulp is 1.5e-5: an
        # absolute 1e-5 is below rounding, so 1e-6 relative (8 ulps) (measured: 8.8e-7 at most).
        np.testing.assert_allclose(np.asarray(scores_j), scores_t.numpy(), rtol=1e-6, atol=1e-5, err_msg=search)
        if search == "greedy_search":  # long outputs: ~100 steps of both caches compared
            assert (tokens_t != 0).sum(dim=1).float().mean() > 3
        # (Beam search finds that this barely trained model's likeliest output is an immediate EOS.)
