"""Sampling: the shared random function, the sampling rule's semantics, torch = JAX token for token,
and sampled first tokens following the model's distribution.

Tolerances: probabilities 1e-6 absolute (float32 softmax of the same log-probabilities); scores as
in test_decode.py, n ulps of |score| for n tokens (each term agrees to ~1e-6, each addition rounds).
"""

import math

import numpy as np
import pytest
import torch

from jax_transformer import sampling as js
from parity.comparison import enable_parity_numerics
from torch_reference import sampling as ts

from .test_decode import pair, source, tuned

enable_parity_numerics()

U32 = 2**32 - 1


def test_threefry_gives_random123s_answers_and_jaxs_in_both_frameworks():
    # Random123's known answers for Threefry-2x32-20 (its kat_vectors), as JAX's own tests use them.
    known = [((0, 0, 0, 0), (0x6B200159, 0x99BA4EFE)), ((U32, U32, U32, U32), (0x1CB996FC, 0xBB002BE7)),
             ((0x13198A2E, 0x03707344, 0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0))]
    for args, expected in known:
        assert tuple(int(w) for w in ts.threefry2x32(*args)) == expected
        assert tuple(int(w) for w in js.threefry2x32(*args)) == expected
    from jax.extend.random import threefry_2x32

    k0, k1, x0, x1 = np.random.default_rng(0).integers(0, 2**32, size=(4, 1000), dtype=np.uint64)
    words_t = ts.threefry2x32(*(torch.from_numpy(v.astype(np.int64)) for v in (k0, k1, x0, x1)))
    words_j = js.threefry2x32(*(v.astype(np.uint32) for v in (k0, k1, x0, x1)))
    for key in range(3):  # JAX's threefry_2x32 takes one key: its counter array is the two words' halves
        ref = np.asarray(threefry_2x32(np.uint32([k0[key], k1[key]]), np.concatenate([x0, x1]).astype(np.uint32)))
        mine = js.threefry2x32(k0[key], k1[key], x0.astype(np.uint32), x1.astype(np.uint32))
        np.testing.assert_array_equal(np.concatenate([np.asarray(w) for w in mine]), ref)
    for t, j in zip(words_t, words_j):
        np.testing.assert_array_equal(t.numpy(), np.asarray(j).astype(np.int64))


def test_uniforms_are_the_same_bits_in_both_frameworks_and_inside_the_open_interval():
    seed, sentence, sample, position = np.meshgrid([0, 1, U32], [0, 7, U32], np.arange(40), np.arange(300))
    u_t = ts.uniform(*(torch.from_numpy(v.astype(np.int64)) for v in (seed, sentence, sample, position))).numpy()
    u_j = np.asarray(js.uniform(seed.astype(np.uint32), sentence.astype(np.uint32), sample.astype(np.uint32),
                                position.astype(np.uint32)))
    np.testing.assert_array_equal(u_t.view(np.uint32), u_j.view(np.uint32))
    assert u_t.dtype == np.float32 and 0 < u_t.min() and u_t.max() < 1
    # 324,000 uniforms: mean 1/2 within 5 standard errors (sqrt(1/12 / n) = 5.1e-4).
    assert abs(u_t.mean() - 0.5) < 5 * math.sqrt(1 / 12 / u_t.size)
    assert ts.uniform(0, 0, 0, 0).item() == (2 * (0x6B200159 >> 9) + 1) / 2**24  # the first word's top 23 bits


def _distribution(framework, logprobs, **settings):
    if framework == "torch":
        return ts.sampling_distribution(torch.from_numpy(logprobs), **settings).numpy()
    return np.asarray(js.sampling_distribution(logprobs, **settings))


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_draw_is_the_inverse_cdf_in_token_id_order(framework):
    # Token 1 (probability 0) is never drawn; token 3 (0.125) lies between 0.625 and 0.75 of the CDF,
    # although the sorted order would put it last; u rounding up to the total gives the last kept token.
    probs = np.float32([[0.5, 0.0, 0.125, 0.125, 0.25, 0.0]] * 7)
    u = np.float32([0.1, 0.5, 0.6, 0.7, 0.74, 0.9, 1 - 2**-24])
    expected = [0, 2, 2, 3, 3, 4, 4]
    if framework == "torch":
        tokens = ts.draw(torch.from_numpy(probs), torch.from_numpy(u)).numpy()
    else:
        tokens = np.asarray(js.draw(probs, u))
    np.testing.assert_array_equal(tokens, expected)


def _equations(jaxpr):
    """Every equation of a jaxpr, those of the jaxprs inside it (jit, custom_jvp) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                yield from _equations(inner)


def test_unfiltered_sampling_sorts_nothing_and_top_p_sorts_values_only():
    import jax

    logprobs = np.zeros((2, 7), np.float32)
    def sorts(**settings):
        jaxpr = jax.make_jaxpr(lambda x: js.draw(js.sampling_distribution(x, **settings), x[:, 0]))(logprobs)
        return [e for e in _equations(jaxpr.jaxpr) if str(e.primitive) in ("sort", "top_k")]
    assert sorts(temperature=0.7) == []
    assert [str(e.primitive) for e in sorts(top_k=3)] == ["top_k"]
    (sort,) = sorts(top_p=0.5)
    assert str(sort.primitive) == "sort" and len(sort.invars) == 1  # the values alone, no token ids


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_top_k_top_p_and_temperature_mean_what_fairseq_and_hf_say(framework):
    # A tie at 0.2; an impossible token (the searches' NEG_INF).
    logprobs = np.log(np.array([[0.1, 0.5, 0.2, 0.2, 1.0]], np.float32)) + np.float32([0, 0, 0, 0, -1e9])
    def dist(**settings):
        return _distribution(framework, logprobs, **settings)[0]

    np.testing.assert_allclose(dist(), [0.1, 0.5, 0.2, 0.2, 0.0], atol=1e-6)
    np.testing.assert_allclose(dist(top_k=1), [0, 1, 0, 0, 0], atol=1e-6)
    np.testing.assert_allclose(dist(top_k=2), [0, 5 / 9, 2 / 9, 2 / 9, 0], atol=1e-6)  # ties with the 2nd kept
    np.testing.assert_allclose(dist(top_k=9), dist(), atol=1e-6)  # k above V: no limit
    np.testing.assert_allclose(dist(top_p=0.5), [0, 1, 0, 0, 0], atol=1e-6)  # {0.5} reaches 0.5
    np.testing.assert_allclose(dist(top_p=0.55), [0, 5 / 7, 2 / 7, 0, 0], atol=1e-6)  # the tie: lower id first
    np.testing.assert_allclose(dist(top_p=0.95), [0.1, 0.5, 0.2, 0.2, 0], atol=1e-6)
    sharp = np.array([0.1, 0.5, 0.2, 0.2, 0.0]) ** 2  # temperature 1/2: p^2, renormalised
    np.testing.assert_allclose(dist(temperature=0.5), sharp / sharp.sum(), atol=1e-6)
    np.testing.assert_allclose(dist(temperature=0.5, top_k=2, top_p=0.7),  # HF's order: temperature, top-k, top-p
                               [0, 1, 0, 0, 0], atol=1e-6)  # after T=0.5 and k=2: 25/33, 4/33, 4/33; 25/33 >= 0.7


@pytest.mark.parametrize("settings", [{"temperature": 0.7}, {"top_k": 5}, {"top_p": 0.6},
                                      {"temperature": 1.3, "top_k": 20, "top_p": 0.9}])
def test_the_distribution_equals_hfs_warpers_in_both_frameworks(settings):
    transformers = pytest.importorskip("transformers")
    logits = torch.randn(64, 53, generator=torch.Generator().manual_seed(0)) * 3
    scores = logits.clone()
    warpers = {"temperature": transformers.TemperatureLogitsWarper, "top_k": transformers.TopKLogitsWarper,
               "top_p": transformers.TopPLogitsWarper}
    for name in ("temperature", "top_k", "top_p"):  # the order of HF's `generate`
        if name in settings:
            scores = warpers[name](settings[name])(None, scores)
    expected = torch.softmax(scores, dim=-1).numpy()
    logprobs = torch.log_softmax(logits, dim=-1).numpy()
    for framework in ("torch", "jax"):
        probs = _distribution(framework, logprobs, **settings)
        np.testing.assert_array_equal(probs > 0, expected > 0, err_msg=framework)  # the same tokens kept
        np.testing.assert_allclose(probs, expected, atol=1e-6, err_msg=framework)


@pytest.mark.parametrize("twin", [ts, js], ids=["torch", "jax"])
@pytest.mark.parametrize("settings, message", [
    ({"top_p": 0.0}, "top_p must be in"), ({"top_p": 1.5}, "top_p must be in"), ({"top_k": -1}, "top_k must be"),
    ({"temperature": 0.0}, "temperature must be"), ({"temperature": float("nan")}, "temperature must be"),
    ({"num_samples": 0}, "num_samples must be"), ({"seed": -1}, "seed must be"), ({"seed": 2**32}, "seed must be"),
    ({"sentence_ids": [0]}, "sentence_ids must be"),
])
def test_bad_settings_are_refused(twin, settings, message):
    torch_model, jax_model = pair()
    model = torch_model if twin is ts else jax_model
    src = source(batch=2)
    with pytest.raises(ValueError, match=message):
        twin.sample(model, torch.from_numpy(src) if twin is ts else src, **{"seed": 0, **settings})


def _compare(src, torch_model, jax_model, seeds, **settings):
    """The same tokens from torch and JAX for every seed; scores to n ulps; -> torch's tokens."""
    outputs = []
    for seed in seeds:
        tokens_t, scores_t = ts.sample(torch_model, torch.from_numpy(src), seed, **settings)
        tokens_j, scores_j = (np.asarray(x) for x in js.sample(jax_model, src, seed, **settings))
        np.testing.assert_array_equal(tokens_j, tokens_t.numpy(), err_msg=f"seed {seed}")
        scores_t = scores_t.numpy()
        bound = np.maximum(1e-5, (tokens_j != 0).sum(-1) * np.spacing(np.abs(scores_t)))
        assert (np.abs(scores_j - scores_t) <= bound).all(), (seed, scores_j - scores_t)
        outputs.append(tokens_t.numpy())
    return outputs


@pytest.mark.parametrize("settings", [{}, {"temperature": 0.7, "top_k": 10, "top_p": 0.9}])
def test_torch_and_jax_sample_the_same_tokens(settings):
    """16 sentences x 4 samples x 3 seeds: 192 translations, about 3,000 draws, token for token."""
    torch_model, jax_model = pair(seed=2, output_bias=True)  # a biased, uneven next-token distribution
    src = source(batch=16, length=9, seed=2)
    src[5] = 0  # a row of padding: no sentence
    outputs = _compare(src, torch_model, jax_model, [0, 1, U32], num_samples=4, **settings)
    tokens = outputs[0]
    assert (tokens[5] == 0).all()
    real = np.delete(np.arange(16), 5)
    assert ((tokens[real] == 2).sum(-1) == 1).all()  # one EOS per sample
    assert not np.isin(tokens[real][..., 0], [0, 1]).any()  # never pad or BOS
    assert (tokens != outputs[1]).any(axis=-1).mean() > 0.9  # another seed, other samples
    assert np.mean([len({tuple(s) for s in sentence}) == 4 for sentence in tokens[real]]) > 0.9  # samples differ


def test_a_tiny_temperature_samples_the_greedy_output_in_both_frameworks():
    """temperature 1e-10: JAX computed logprobs / T and its max in two fusions that rounded apart, so
    exp overflowed to inf / inf = NaN and it sampled token -1; shifted by the max first, it is greedy."""
    from torch_reference.decode import greedy_search

    torch_model, jax_model = pair(seed=2, output_bias=True)
    src = source(batch=6, length=9, seed=2)
    (tokens,) = _compare(src, torch_model, jax_model, [0], num_samples=2, temperature=1e-10)
    greedy = greedy_search(torch_model, torch.from_numpy(src))[0].numpy()
    n = greedy.shape[-1]
    assert (tokens[:, :, :n] == greedy[:, None]).all() and (tokens[:, :, n:] == 0).all()


def test_a_subnormal_temperature_samples_the_greedy_output_in_both_frameworks():
    """1e-38 (float32's smallest normal is 1.18e-38), 1e-40 and 1e-45, subnormal there: on main JAX raised
    OverflowError (its static float) where torch sampled greedily; XLA flushes subnormals to 0 (0/0 = NaN)."""
    from torch_reference.decode import greedy_search

    torch_model, jax_model = pair(seed=2, output_bias=True)
    src = source(batch=4, length=7, seed=2)
    greedy = greedy_search(torch_model, torch.from_numpy(src))[0].numpy()
    n = greedy.shape[-1]
    for temperature in (1e-38, 1e-40, 1e-45):
        (tokens,) = _compare(src, torch_model, jax_model, [5], num_samples=2, temperature=temperature)
        assert (tokens[:, :, :n] == greedy[:, None]).all() and (tokens[:, :, n:] == 0).all(), temperature


def test_torch_and_jax_sample_the_same_tokens_over_the_xla_cpu_loop():
    torch_model, jax_model = pair(seed=3)
    src = source(batch=16, length=9, seed=3)
    _compare(src, torch_model, tuned(jax_model), [5, 6], num_samples=3, top_p=0.95)


def test_samples_are_reproducible_and_keyed_by_sentence_not_by_batch():
    torch_model, _ = pair(seed=4)
    src = torch.from_numpy(source(batch=6, length=9, seed=4))
    tokens, scores = ts.sample(torch_model, src, 11, num_samples=2)
    again, again_scores = ts.sample(torch_model, src, 11, num_samples=2)
    assert torch.equal(tokens, again) and torch.equal(scores, again_scores)
    for row in range(6):  # alone, under its id in the batch: the same samples
        alone, alone_scores = ts.sample(torch_model, src[row: row + 1], 11, num_samples=2, sentence_ids=[row])
        n = alone.shape[-1]
        assert torch.equal(alone[0], tokens[row, :, :n]) and (tokens[row, :, n:] == 0).all()
        # Another batch shape rounds the matmuls otherwise: n ulps of |score| for n tokens, as `_compare`.
        bound = torch.clamp((alone[0] != 0).sum(-1) * torch.abs(scores[row]) * 2.0**-23, min=1e-5)
        assert ((alone_scores[0] - scores[row]).abs() <= bound).all(), alone_scores[0] - scores[row]
    other_id, _ = ts.sample(torch_model, src[:1], 11, num_samples=2, sentence_ids=[7])
    assert not torch.equal(other_id[0], tokens[0, :, : other_id.shape[-1]])


def _chi_square_critical(df: int, alpha: float = 1e-3) -> float:
    """The chi-square critical value: scipy's, else Wilson and Hilferty's approximation (within
    0.6% of it for df >= 10; z = 3.0902 is the standard normal's upper 1e-3 quantile)."""
    try:
        from scipy.stats import chi2
    except ImportError:
        assert alpha == 1e-3
        h = 2 / (9 * df)
        return df * (1 - h + 3.0902 * math.sqrt(h)) ** 3
    return float(chi2.isf(alpha, df))


def _chi_square(counts: np.ndarray, expected: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic over the categories expecting >= 5 draws, the rest pooled into one
    (joined to the smallest category if the pool expects < 5) -> (statistic, degrees of freedom)."""
    big = expected >= 5
    observed, wanted = list(counts[big]), list(expected[big])
    if (~big).any():
        pool_o, pool_e = counts[~big].sum(), expected[~big].sum()
        if pool_e >= 5:
            observed.append(pool_o)
            wanted.append(pool_e)
        else:
            i = int(np.argmin(wanted))
            observed[i] += pool_o
            wanted[i] += pool_e
    observed, wanted = np.array(observed, float), np.array(wanted, float)
    return float(((observed - wanted) ** 2 / wanted).sum()), len(wanted) - 1


def _first_token_probs(torch_model, src, temperature=1.0, top_k=0, top_p=1.0) -> np.ndarray:
    """The model's next-token distribution after BOS, by hand in NumPy (float64): pad and BOS
    never emitted, then temperature, top-k, top-p as HF defines them."""
    with torch.no_grad():
        logits = torch_model(src, torch.tensor([[torch_model.cfg.bos_id]]))[0, 0].double().numpy()
    logits[[0, 1]] = -np.inf
    x = logits / temperature
    if top_k:
        x = np.where(x >= np.sort(x)[::-1][top_k - 1], x, -np.inf)
    p = np.exp(x - x.max())
    p /= p.sum()
    if top_p < 1:
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]
        p[order[before >= top_p]] = 0
        p /= p.sum()
    return p


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_20000_sampled_first_tokens_follow_the_models_distribution(framework):
    """Pearson's chi-square over the first tokens of 20,000 samples of one sentence, against the
    model's softmax (and against its tempered, filtered one), at significance 1e-3: 51 possible
    tokens, 50 degrees of freedom, critical value 86.66 (filtered: 17 tokens, 39.25). The filtered
    draws against the unfiltered distribution must fail it: the test tells distributions apart."""
    torch_model, jax_model = pair(seed=6, output_bias=True)
    src = source(batch=1, length=7, seed=6)
    draws = 20_000
    # Two positions: the first drawn freely, the second EOS (a * 7 + 2 = 2).
    settings = [{}, {"temperature": 0.8, "top_k": 30, "top_p": 0.9}]
    for index, setting in enumerate(settings):
        if framework == "torch":
            tokens, _ = ts.sample(torch_model, torch.from_numpy(src), 3, draws, max_len_a=0.0, max_len_b=2, **setting)
            first = tokens[0, :, 0].numpy()
        else:
            tokens, _ = js.sample(jax_model, src, 3, draws, max_len_a=0.0, max_len_b=2, **setting)
            first = np.asarray(tokens)[0, :, 0]
        counts = np.bincount(first, minlength=53)
        expected = draws * _first_token_probs(torch_model, torch.from_numpy(src), **setting)
        assert counts[expected == 0].sum() == 0  # never a filtered-out token, pad or BOS
        statistic, df = _chi_square(counts, expected)
        assert df >= 10 and statistic < _chi_square_critical(df), (setting, statistic, df)
        if index == 1:  # the filtered draws against the unfiltered distribution: rejected
            plain = draws * _first_token_probs(torch_model, torch.from_numpy(src))
            statistic, df = _chi_square(counts, plain)
            assert statistic > 10 * _chi_square_critical(df), statistic
