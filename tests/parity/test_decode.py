"""Cached decoding and search: cached = uncached in each framework, and torch = JAX.

Tolerances: logits 1e-5 max abs (the parity contract's float32 bound for tiny models); scores
are sums of up to L log-probabilities, 1e-5 absolute (each term agrees to ~1e-6).
"""

import functools
import itertools

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import torch_reference as tr
from jax_transformer import decode as jd
from jax_transformer import model as jmodel
from parity.comparison import enable_parity_numerics
from torch_reference import decode as td
from train.interop.weights import torch_to_jax

enable_parity_numerics()

# Lopsided (1 encoder layer, 2 decoder layers: a cache a layer) so that a swapped stack cannot pass.
LOPSIDED = dict(src_vocab_size=53, tgt_vocab_size=53, d_model=24, num_heads=3, d_ff=40,
                num_encoder_layers=1, num_decoder_layers=2, max_len=40, dropout=0.0)


def pair(seed=0, **overrides):
    torch.manual_seed(seed)
    torch_model = tr.Transformer(tr.TransformerConfig(**{**LOPSIDED, **overrides})).eval()
    if torch_model.logits_bias is not None:  # zeros at init: made visible
        with torch.no_grad():
            torch_model.logits_bias.normal_()
    return torch_model, torch_to_jax(torch_model)


def tuned(jax_model):
    """The same weights in a model built with `kernels="xla_cpu"`: its search runs the XLA:CPU loop."""
    model = jmodel.Transformer(jax_model.cfg, kernels="xla_cpu", rngs=nnx.Rngs(0))
    nnx.update(model, nnx.state(jax_model))
    return model


def source(batch=4, length=9, seed=0, vocab=53):
    """Random sources ending in EOS with right padding; row lengths differ."""
    rng = np.random.default_rng(seed)
    out = np.zeros((batch, length), dtype=np.int64)
    for row, n in enumerate(rng.integers(1, length + 1, size=batch)):
        out[row, : n - 1] = rng.integers(4, vocab, size=n - 1)
        out[row, n - 1] = 2
    return out


@pytest.mark.parametrize("overrides", [{}, {"norm_position": "pre", "positions": "learned"}, {"activation": "swiglu"},
    {"activation": "silu", "positions": "sinusoidal_halves", "output_bias": True, "bos_id": 0}])  # ~4 s each
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


@pytest.mark.parametrize("seed", [3, 4])  # 10-30 s each on 2 cores
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


@pytest.mark.parametrize("seed", [0, 1, 2, 3])  # ~6 s each
@pytest.mark.parametrize("search", ["greedy", "beam", "beam-hf"])
def test_torch_and_jax_search_return_identical_tokens_and_scores(search, seed):
    """The JAX search over the plain model and over the XLA:CPU-tuned one."""
    torch_model, jax_model = pair(seed=seed, **{2: {"norm_position": "pre"}, 3: MARIAN}.get(seed, {}))
    src = source(batch=5, length=11, seed=seed)
    if search == "greedy":
        tokens_t, scores_t = td.greedy_search(torch_model, torch.from_numpy(src))
        run = jd.greedy_search
    else:
        scoring = "hf" if search == "beam-hf" else "gnmt"
        tokens_t, scores_t = td.beam_search(torch_model, torch.from_numpy(src), beam_size=4, scoring=scoring)
        run = functools.partial(jd.beam_search, beam_size=4, scoring=scoring)
    for model in (jax_model, tuned(jax_model)):
        tokens_j, scores_j = run(model, src)
        path = f"xla_cpu={model.xla_cpu}"
        np.testing.assert_array_equal(np.asarray(tokens_j), tokens_t.numpy(), err_msg=path)
        np.testing.assert_allclose(np.asarray(scores_j), scores_t.numpy(), atol=1e-5, err_msg=path)
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


@pytest.mark.parametrize("alpha, scoring", [  # ~6 s each
    (0.0, "gnmt"), (0.6, "gnmt"), (1.4, "gnmt"), (0.5, "hf")])
def test_beam_search_stops_once_its_best_cannot_be_beaten(monkeypatch, alpha, scoring):
    """A sentence is done when its best finished hypothesis beats what any live one could still
    reach (`_done`): the same tokens and scores as a search run to the length limit, and as the
    rule before it (the worst of the k kept finished ones must beat it), in fewer steps."""
    torch_model, _ = pair(seed=11, tgt_vocab_size=12, src_vocab_size=12)  # EOS is 1 of 12: ends come early and late
    src = torch.from_numpy(source(batch=16, length=10, seed=11, vocab=12))
    rules = {
        "best": td._done,
        "worst kept": lambda finished, live, penalty, none: (finished[:, -1] >= live[:, 0] / penalty) | none,
        "never": lambda finished, live, penalty, none: none,  # to the length limit
    }
    results, steps = {}, {}
    for name, rule in rules.items():
        monkeypatch.setattr(td, "_done", rule)
        calls = []
        logits = td._Decoder.logits
        monkeypatch.setattr(td._Decoder, "logits", lambda self, *a: calls.append(1) or logits(self, *a))
        results[name] = [  # one sentence at a time: a batch runs until its last sentence is done
            td.beam_search(torch_model, src[row : row + 1], beam_size=3, alpha=alpha, max_len_a=1.0, max_len_b=8,
                           scoring=scoring) for row in range(len(src))]
        steps[name] = len(calls)
        monkeypatch.undo()
    for name in ("worst kept", "never"):
        for (tokens, scores), (best_tokens, best_scores) in zip(results[name], results["best"]):
            n = best_tokens.shape[1]  # the same sums in the same order: equal to the bit
            assert tokens[:, :n].tolist() == best_tokens.tolist() and torch.equal(scores, best_scores)
    assert steps["never"] == 16 * 18  # every position of a source padded to 10: 1.0 * 10 + 8
    assert steps["best"] < steps["worst kept"] <= steps["never"], steps


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


@pytest.mark.parametrize("search", ["greedy", "beam"])  # ~20 s each
def test_search_over_a_shrinking_batch_and_rows_of_padding(search):
    """The XLA:CPU search moves the live sentences into a batch half the size whenever they fit
    (`xla_cpu.shrinking_while`); rows of padding only (a batch's filler) are no sentence: padding,
    score 0, done from the start. Same tokens as torch (which keeps every row) and as the plain
    search's one loop over the whole batch; scores to 1e-5 as above."""
    torch_model, jax_model = pair(seed=5)
    src = source(batch=64, length=12, seed=5)  # lengths 1..12: limits a*len+b differ, so ends differ
    src[[3, 8]] = 0  # filler rows
    lengths = dict(max_len_a=1.0, max_len_b=2)
    kwargs = dict(beam_size=3, **lengths) if search == "beam" else lengths
    tokens_t, scores_t = getattr(td, f"{search}_search")(torch_model, torch.from_numpy(src), **kwargs)
    for model in (tuned(jax_model), jax_model):  # stages of 64, 32, 16 and 8 sentences; one loop
        tokens_j, scores_j = (np.asarray(x) for x in getattr(jd, f"{search}_search")(model, src, **kwargs))
        np.testing.assert_array_equal(tokens_j, tokens_t.numpy())
        np.testing.assert_allclose(scores_j, scores_t.numpy(), atol=1e-5, rtol=0)
    assert (tokens_t[[3, 8]] == 0).all() and (scores_t[[3, 8]] == 0).all()
    real = np.delete(np.arange(64), [3, 8])
    assert (tokens_t[real] == 2).any(dim=1).all()  # every sentence ended with EOS
    ends = sorted({row.index(2) for row in tokens_t[real].tolist()})
    assert len(ends) >= 4  # sentences ended at several steps: the batch did shrink
    fn = jd._beam_search if search == "beam" else jd._greedy_search
    static = (3, 0.6, 1.0, 2, True, "gnmt") if search == "beam" else (1.0, 2, True)
    hlo = fn.lower(tuned(jax_model), jnp.asarray(src, jnp.int32), *static).as_text()
    assert hlo.count("stablehlo.while") == 4  # one loop per stage: 64, 32, 16, 8 sentences (SMALLEST_STAGE 8)


@pytest.mark.parametrize("search", ["greedy", "beam"])  # ~8 s each
def test_search_over_a_growing_cache(search):
    """In the XLA:CPU search the first quarter and the next quarter of the positions attend over a
    cache a quarter and a half as long, grown as the loop passes them: the same tokens as torch
    (whose cache is whole from the start) and as the plain search, scores to 1e-5 against torch
    as above. Searches of fewer than 32 positions, and uncached ones, keep one loop."""
    torch_model, jax_model = pair(seed=7)
    src = source(batch=6, length=16, seed=7)  # limits up to 1.5 * 16 + 10 = 34 positions: parts 8, 17, 34
    kwargs = dict(beam_size=3) if search == "beam" else {}
    tokens_t, scores_t = getattr(td, f"{search}_search")(torch_model, torch.from_numpy(src), **kwargs)
    assert (tokens_t != 0).sum(dim=1).max() > 17  # some sentence is written past both shorter caches
    for model in (tuned(jax_model), jax_model):
        tokens_j, scores_j = (np.asarray(x) for x in getattr(jd, f"{search}_search")(model, src, **kwargs))
        np.testing.assert_array_equal(tokens_j, tokens_t.numpy())
        np.testing.assert_allclose(scores_j, scores_t.numpy(), atol=1e-5, rtol=0)
    fn = jd._beam_search if search == "beam" else jd._greedy_search
    static = (3, 0.6) if search == "beam" else ()
    loops = {(b, cached): fn.lower(tuned(jax_model), jnp.asarray(src, jnp.int32), *static, 1.5, b, cached,
                                   *(("gnmt",) if search == "beam" else ())).as_text().count("stablehlo.while")
             for b, cached in ((10, True), (7, True), (10, False))}  # 34 positions; 31; 34 uncached
    assert loops == {(10, True): 3, (7, True): 1, (10, False): 1}  # 6 rows: one batch stage


def test_source_longer_than_max_len_is_refused_clearly():
    torch_model, jax_model = pair()
    src = np.full((1, 41), 5)
    with pytest.raises(ValueError, match="exceeds the model's max_len=40"):
        td.beam_search(torch_model, torch.from_numpy(src))
    with pytest.raises(ValueError, match="exceeds the model's max_len=40"):
        jd.greedy_search(jax_model, src)


def test_a_length_penalty_that_shrinks_or_an_unknown_scoring_is_refused():
    torch_model, jax_model = pair()
    src = source(batch=1, length=4)
    for search, model, src_ in ((td.beam_search, torch_model, torch.from_numpy(src)), (jd.beam_search, jax_model, src)):
        for alpha in (-0.5, float("nan")):  # the early stop's bound assumes the penalty grows with length
            with pytest.raises(ValueError, match="alpha must be"):
                search(model, src_, alpha=alpha)
        with pytest.raises(ValueError, match="scoring must be one of gnmt, hf, got 'fairseq'"):
            search(model, src_, scoring="fairseq")


def test_output_length_is_bounded_by_max_len():
    assert td.output_length(30, 40, 1.5, 10) == 40
    assert td.output_length(4, 40, 1.5, 10) == 16
    assert jd.output_length(4, 40, 1.5, 10) == 16


def test_search_parity_on_multi30k_with_a_trained_model(multi30k, tmp_path):
    """Real sentences and trained weights: a 2+2-layer model trained 80 steps on Multi30k (torch),
    its weights converted; greedy and beam 4 over 48 validation sentences (one padded batch) give
    identical tokens in both frameworks and scores to float32 rounding."""
    import train
    from train import data, loop
    from train.config import ExperimentConfig

    cfg = ExperimentConfig(
        backend="torch", run_dir=str(tmp_path / "run"), train=f"de:en:{multi30k}/train",
        valid=f"de:en:{multi30k}/val", vocab_size=1000, max_len=64, token_budget=4096, steps=80, warmup=20,
        lr_factor=2.0, eval_every=1000, eval_sentences=4, beam=1, samples=0, progress=False,
        model={"num_encoder_layers": 2, "num_decoder_layers": 2}, hf_cache=str(tmp_path / "hf"),
    )
    loop.train(cfg)
    run = train.load(cfg.run_dir, "latest")
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


@pytest.mark.parametrize("scoring", ["gnmt", "hf"])  # ~7 s each
def test_n_best_is_identical_in_both_frameworks_and_led_by_the_one_best(scoring):
    """n_best=3 of beam 4: the same tokens, log-probs and scores (1e-5: sums as above) in torch,
    JAX and JAX's XLA:CPU search; hypothesis 0 is the 1-best search's; best first; score =
    log-prob / length_penalty; and (gnmt) each log-prob is `score` of its tokens, to 1e-5."""
    torch_model, jax_model = pair(seed=3)
    src = source(batch=5, length=11, seed=3)
    tokens, logprob, scores = td.beam_search(torch_model, torch.from_numpy(src), beam_size=4, n_best=3, scoring=scoring)
    one_tokens, one_scores = td.beam_search(torch_model, torch.from_numpy(src), beam_size=4, scoring=scoring)
    assert torch.equal(tokens[:, 0], one_tokens) and torch.equal(scores[:, 0], one_scores)
    assert (scores[:, :-1] >= scores[:, 1:]).all()
    assert all(len({tuple(h) for h in row}) == 3 for row in tokens.tolist())  # three different hypotheses
    lengths = (tokens != 0).sum(-1).float()
    np.testing.assert_allclose(scores, logprob / td.length_penalty(lengths, 0.6, scoring), rtol=1e-6)
    for model in (jax_model, tuned(jax_model)):
        out = jd.beam_search(model, src, beam_size=4, n_best=3, scoring=scoring)
        np.testing.assert_array_equal(np.asarray(out[0]), tokens.numpy())
        for mine, theirs in zip(out[1:], (logprob, scores)):  # rtol: as in the prefix test below
            np.testing.assert_allclose(np.asarray(mine), theirs.numpy(), atol=1e-5, rtol=1e-6)
    if scoring == "gnmt":  # (hf: an <eos> forced at the limit adds nothing, as HF's)
        for h in range(3):
            np.testing.assert_allclose(td.score(torch_model, torch.from_numpy(src), tokens[:, h]).sum(1), logprob[:, h],
                                       atol=1e-5, rtol=1e-6)


def test_n_best_of_a_beam_holding_every_hypothesis_is_the_brute_force_ranking():
    """As the exact 1-best test above: with every prefix in the beam, the 4 best of beam 16 are
    the 4 best of all sequences, in order, with their log-probs (1e-5)."""
    torch_model, jax_model = pair(seed=5, src_vocab_size=7, tgt_vocab_size=7)
    src = torch.tensor([[4, 5, 6, 2]])
    mask = tr.padding_mask(src, 0)
    with torch.no_grad():
        memory = torch_model.encode(src, mask)
        scored = []
        for n in range(1, 4):
            for body in itertools.product([3, 4, 5, 6], repeat=n - 1):
                seq = [*body, 2]
                logits = torch_model.project(torch_model.decode(torch.tensor([[1, *seq[:-1]]]), memory, mask))
                logp = torch.log_softmax(logits[0], -1)[torch.arange(n), torch.tensor(seq)].sum().item()
                scored.append((logp / td.length_penalty(n, 0.6), logp, seq))
    best = sorted(scored, reverse=True)[:4]
    kwargs = {"beam_size": 16, "n_best": 4, "max_len_a": 0.0, "max_len_b": 3}
    for tokens, logprob, scores in (td.beam_search(torch_model, src, **kwargs), jd.beam_search(jax_model, src.numpy(), **kwargs)):
        for h, (score, logp, seq) in enumerate(best):
            assert np.asarray(tokens)[0, h].tolist()[: len(seq)] == seq
            assert abs(float(scores[0, h]) - score) <= 1e-5 and abs(float(logprob[0, h]) - logp) <= 1e-5


def test_a_sentence_with_fewer_outputs_than_n_best_has_empty_slots():
    """A one-token limit allows one output, <eos>: the other slots are padding with -inf."""
    torch_model, jax_model = pair()
    src = np.array([[2, 0], [0, 0]])
    for tokens, logprob, scores in (td.beam_search(torch_model, torch.from_numpy(src), 3, 0.6, 1.0, 0, n_best=3),
                                    jd.beam_search(jax_model, src, 3, 0.6, 1.0, 0, n_best=3)):
        assert np.asarray(tokens)[:, :, 0].tolist() == [[2, 0, 0], [0, 0, 0]]
        assert np.isfinite(np.asarray(logprob)).tolist() == [[True, False, False], [False] * 3]
        assert np.array_equal(np.isfinite(np.asarray(scores)), np.isfinite(np.asarray(logprob)))


@pytest.mark.parametrize("search", ["greedy", "beam"])  # ~6 s each
def test_a_forced_prefix_is_identical_in_both_frameworks_and_the_search_continues_after_it(search):
    """Rows with a prefix of 2, 1, 0 and 3 tokens (and a row of padding): each output starts with
    its prefix; tokens identical in torch, JAX and the XLA:CPU search, log-probs to 1e-5; the
    log-prob is `score` of the output (the prefix's tokens counted); a row without a prefix is
    the search without one."""
    torch_model, jax_model = pair(seed=3)
    src = source(batch=5, length=11, seed=3)
    src[4] = 0
    prefix = np.array([[5, 6, 0], [7, 0, 0], [0, 0, 0], [8, 9, 10], [0, 0, 0]])
    if search == "greedy":
        tokens, logprob = td.greedy_search(torch_model, torch.from_numpy(src), prefix=torch.from_numpy(prefix))
        plain = td.greedy_search(torch_model, torch.from_numpy(src))[0]
        run = functools.partial(jd.greedy_search, prefix=prefix)
    else:
        tokens, logprob, _ = (x[:, 0] for x in td.beam_search(torch_model, torch.from_numpy(src), beam_size=3, n_best=1,
                                                               prefix=torch.from_numpy(prefix)))
        plain = td.beam_search(torch_model, torch.from_numpy(src), beam_size=3)[0]
        run = lambda model, src: [x[:, 0] for x in jd.beam_search(model, src, beam_size=3, n_best=1, prefix=prefix)]
    for row, p in enumerate(prefix.tolist()[:4]):
        p = [t for t in p if t]
        assert tokens[row, : len(p)].tolist() == p and tokens[row, len(p):].ne(0).any()
    assert tokens[2].tolist() == plain[2].tolist() and (tokens[4] == 0).all()
    assert tokens[0].tolist() != plain[0].tolist()  # the prefix changed the output
    for model in (jax_model, tuned(jax_model)):
        tokens_j, logprob_j = run(model, src)[:2]
        np.testing.assert_array_equal(np.asarray(tokens_j), tokens.numpy())
        # Sums of up to 26 log-probs reaching -60, where a float32 ulp is 3.8e-6: 1e-5 absolute is
        # below their rounding, so also 1e-6 relative (~16 ulps; measured 1.5e-5, 2.5e-7 relative).
        np.testing.assert_allclose(np.asarray(logprob_j), logprob.numpy(), atol=1e-5, rtol=1e-6)
    np.testing.assert_allclose(td.score(torch_model, torch.from_numpy(src), tokens).sum(1)[:4], logprob[:4],
                               atol=1e-5, rtol=1e-6)


def test_score_is_identical_in_both_frameworks_and_zero_at_padding():
    """Per-token log-probs of given targets: torch = JAX to 1e-5 (single log-probs: float32
    rounding of logits that agree to 1e-5 above), 0 at padding, each below 0."""
    torch_model, jax_model = pair(seed=2, norm_position="pre")
    src = source(batch=4, length=9, seed=2)
    tgt = source(batch=4, length=7, seed=8)  # token rows ending in <eos>, padded
    ours = td.score(torch_model, torch.from_numpy(src), torch.from_numpy(tgt)).numpy()
    np.testing.assert_allclose(np.asarray(jd.score(jax_model, src, tgt)), ours, atol=1e-5, rtol=0)
    assert (ours[tgt == 0] == 0).all() and (ours[tgt != 0] < 0).all()


def test_bad_n_best_or_prefix_is_refused_in_both_frameworks():
    torch_model, jax_model = pair()
    src = source(batch=2, length=4)
    too_long = np.full((2, 30), 5)  # limits 1.5 * len + 10 <= 16 tokens
    for beam, model, src_, wrap in ((td.beam_search, torch_model, torch.from_numpy(src), torch.from_numpy),
                                    (jd.beam_search, jax_model, src, np.asarray)):
        for n_best in (5, 0):
            with pytest.raises(ValueError, match=rf"n_best must be between 1 and beam_size \(4\), got {n_best}"):
                beam(model, src_, beam_size=4, n_best=n_best)
        with pytest.raises(ValueError, match="the prefix of sentence 0 has 30 tokens: its length limit of 1[0-9] tokens"):
            beam(model, src_, beam_size=4, prefix=wrap(too_long))


@pytest.mark.parametrize("beam_size", [0, -1, 2.0, True])
def test_a_beam_size_that_is_no_positive_integer_is_refused_in_both_frameworks(beam_size):
    # 0 and -1 failed deep inside (an IndexError, a RuntimeError), 2.0 in a TypeError; JAX searched with True.
    torch_model, jax_model = pair()
    src = source(batch=2, length=4)
    for beam, model, src_ in ((td.beam_search, torch_model, torch.from_numpy(src)), (jd.beam_search, jax_model, src)):
        with pytest.raises(ValueError, match="beam_size must be"):
            beam(model, src_, beam_size=beam_size)
        with pytest.raises(ValueError, match=r"n_best must be between 1 and beam_size \(2\), got 1.0"):
            beam(model, src_, beam_size=2, n_best=1.0)


@pytest.mark.parametrize("bad", ["id 53", "id -1", "float", "1-D"])
def test_source_and_target_ids_outside_the_vocabulary_or_not_integers_are_refused_in_both_frameworks(bad):
    # JAX searched ids >= the vocabulary size (NaN embeddings) and -1 (the last row) and cast float ids, silently;
    # torch failed deep inside (an IndexError, an embedding's RuntimeError). `score` the same for its targets.
    torch_model, jax_model = pair()
    ids = source(batch=2, length=4)
    ids = {"id 53": ids.clip(max=52) + (ids == 2) * 51, "id -1": ids - (ids == 2) * 3, "float": ids.astype(np.float32),
           "1-D": ids[0]}[bad]
    match = "ids outside" if bad.startswith("id") else "integer token ids"
    good = source(batch=2, length=4)
    for model, td_or_jd, wrap in ((torch_model, td, torch.from_numpy), (jax_model, jd, np.asarray)):
        for search in (td_or_jd.greedy_search, functools.partial(td_or_jd.beam_search, beam_size=2)):
            with pytest.raises(ValueError, match=f"src_ids .*{match}|src_ids {match}"):
                search(model, wrap(ids))
        with pytest.raises(ValueError, match=f"tgt_ids .*{match}|tgt_ids {match}"):
            td_or_jd.score(model, wrap(good), wrap(ids))


def test_score_refuses_targets_of_another_batch_in_both_frameworks():
    # Broadcast, it gave torch one row for two sources and JAX two.
    torch_model, jax_model = pair()
    src, tgt = source(batch=2, length=4), source(batch=1, length=4)
    for model, td_or_jd, wrap in ((torch_model, td, torch.from_numpy), (jax_model, jd, np.asarray)):
        with pytest.raises(ValueError, match="tgt_ids has 1 rows, src_ids 2: one target per source"):
            td_or_jd.score(model, wrap(src), wrap(tgt))


@pytest.mark.parametrize("bad", ["one row for two", "1-D", "id 53", "float", "<bos>"])
def test_a_prefix_of_another_batch_or_of_ids_outside_the_vocabulary_is_refused_in_both_frameworks(bad):
    # A (1, P) prefix for 2 sources was broadcast, silently forcing row 0's prefix on row 1, in both; JAX forced
    # ids >= the vocabulary size and floats; torch failed deep inside (a RuntimeError of gather).
    torch_model, jax_model = pair()
    src = source(batch=2, length=4)
    prefix = {"one row for two": np.array([[5, 6]]), "1-D": np.array([5, 6]), "id 53": np.array([[5, 53], [7, 0]]),
              "float": np.array([[5., 6.], [7., 0.]]), "<bos>": np.array([[1, 5], [7, 0]])}[bad]
    # <bos> was forced with torch's masked score (-1e9) and JAX's unmasked one: the twins' scores 1e9 apart
    match = {"id 53": "outside", "<bos>": r"prefix holds <bos> \(id 1\)"}.get(bad, "prefix must be")
    for model, td_or_jd, wrap in ((torch_model, td, torch.from_numpy), (jax_model, jd, np.asarray)):
        for search in (td_or_jd.greedy_search, functools.partial(td_or_jd.beam_search, beam_size=2)):
            with pytest.raises(ValueError, match=match):
                search(model, wrap(src), prefix=wrap(prefix))
