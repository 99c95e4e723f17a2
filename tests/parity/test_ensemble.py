"""Ensembles: refused members, one member = the model, torch = JAX over the searches and sampling,
and each step's log-probabilities the average of the members'.

Members differ in width, heads, depth and variant (a d_model=24, 3-head post-norm model with a
d_model=16, 2-head, 1-decoder-layer pre-norm one), so a swapped slice or cache run cannot pass.
Tolerances: scores 1e-5 as in test_decode.py (sums of log-probabilities agreeing to ~1e-6 a term).
"""

import functools

import jax
import numpy as np
import pytest
import torch
from flax import nnx

import torch_reference as tr
from jax_transformer import decode as jd
from jax_transformer import ensemble as je
from jax_transformer import model as jmodel
from jax_transformer import sampling as js
from parity.comparison import enable_parity_numerics
from torch_reference import decode as td
from torch_reference import ensemble as te
from torch_reference import sampling as ts

from .test_decode import LOPSIDED, pair, source, tuned

enable_parity_numerics()

OTHER = {"d_model": 16, "num_heads": 2, "num_decoder_layers": 1, "norm_position": "pre"}


def members():
    """Two unlike models in both frameworks: ([torch a, torch b], [jax a, jax b])."""
    (ta, ja), (tb, jb) = pair(seed=0), pair(seed=1, **OTHER)
    return [ta, tb], [ja, jb]


def _model(twin, **overrides):
    """A model of LOPSIDED's config with `overrides` in `twin`'s framework; JAX's abstract (shapes
    only, built without computing): the checks read configs and layers alone."""
    cfg = tr.TransformerConfig(**{**LOPSIDED, **overrides})
    if twin is te:
        return tr.Transformer(cfg)
    return nnx.eval_shape(lambda: jmodel.Transformer(cfg, rngs=nnx.Rngs(0)))


@pytest.mark.parametrize("twin", [te, je], ids=["torch", "jax"])
def test_members_that_do_not_share_a_vocabulary_are_refused_by_name(twin):
    with pytest.raises(ValueError, match="at least one model"):
        twin.Ensemble([])
    with pytest.raises(ValueError, match="average must be one of logprob, prob"):
        twin.Ensemble([_model(twin)], average="mean")
    for field, value in [("tgt_vocab_size", 60), ("eos_id", 3)]:
        other = _model(twin, **{field: value, "share_embeddings": False})
        with pytest.raises(ValueError, match=f"ensemble members differ in {field}: model 0 has .*, model 1 has {value}"):
            twin.Ensemble([_model(twin), other])
    ensemble = twin.Ensemble([_model(twin), _model(twin, **OTHER), _model(twin, max_len=30)])
    assert ensemble.cfg.max_len == 30  # the searches' limit: every member's
    assert ensemble.widths == type(ensemble.widths)([24, 16, 24])
    assert sum(ensemble.depths) == 2 * LOPSIDED["num_decoder_layers"] + OTHER["num_decoder_layers"]


@pytest.mark.parametrize("search", ["greedy", "beam"])  # ~5 s each
def test_an_ensemble_of_one_is_the_model(search):
    torch_model, jax_model = pair(seed=3)
    src = source(batch=5, length=9, seed=3)
    kwargs = {"beam_size": 3} if search == "beam" else {}
    run_t, run_j = getattr(td, f"{search}_search"), getattr(jd, f"{search}_search")
    for model, ensemble, run, x in [(torch_model, te.Ensemble([torch_model]), run_t, torch.from_numpy(src)),
                                    (jax_model, je.Ensemble([jax_model]), run_j, src)]:
        (tokens, scores), (ens_tokens, ens_scores) = ([np.asarray(v) for v in run(m, x, **kwargs)]
                                                      for m in (model, ensemble))
        np.testing.assert_array_equal(ens_tokens, tokens)
        np.testing.assert_allclose(ens_scores, scores, atol=1e-5, rtol=0)  # log_softmax twice: a rounding apart


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_torch_and_jax_ensembles_decode_identically(search):
    """Two members in each framework: the same tokens; scores to 1e-5; torch cached = uncached."""
    (ta, tb), (ja, jb) = members()
    src = source(batch=5, length=11, seed=4)
    ensemble_t = te.Ensemble([ta, tb])
    run_t = functools.partial(td.beam_search, beam_size=4) if search == "beam" else td.greedy_search
    run_j = functools.partial(jd.beam_search, beam_size=4) if search == "beam" else jd.greedy_search
    tokens_t, scores_t = run_t(ensemble_t, torch.from_numpy(src))
    tokens_j, scores_j = (np.asarray(x) for x in run_j(je.Ensemble([ja, jb]), src))
    np.testing.assert_array_equal(tokens_j, tokens_t.numpy())
    np.testing.assert_allclose(scores_j, scores_t.numpy(), atol=1e-5, rtol=0)
    uncached, _ = run_t(ensemble_t, torch.from_numpy(src), cached=False)  # through `decode` and `project`
    assert torch.equal(uncached, tokens_t)
    single, _ = run_t(ta, torch.from_numpy(src))
    assert not torch.equal(single, tokens_t)  # the second member changes the outputs
    assert ((tokens_t == 2).sum(dim=1) == 1).all()


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_torch_and_jax_ensembles_decode_identically_over_the_xla_cpu_loop(search):
    (ta, tb), (ja, jb) = members()
    src = source(batch=16, length=11, seed=5)
    kwargs = {"beam_size": 3} if search == "beam" else {}
    tokens_t, scores_t = getattr(td, f"{search}_search")(te.Ensemble([ta, tb]), torch.from_numpy(src), **kwargs)
    ensemble = je.Ensemble([tuned(ja), tuned(jb)])
    assert ensemble.xla_cpu
    tokens_j, scores_j = (np.asarray(x) for x in getattr(jd, f"{search}_search")(ensemble, src, **kwargs))
    np.testing.assert_array_equal(tokens_j, tokens_t.numpy())
    np.testing.assert_allclose(scores_j, scores_t.numpy(), atol=1e-5, rtol=0)


def test_torch_and_jax_ensembles_sample_the_same_tokens():
    (ta, tb), (ja, jb) = members()
    src = source(batch=6, length=9, seed=6)
    tokens_t, scores_t = ts.sample(te.Ensemble([ta, tb], average="prob"), torch.from_numpy(src), 9, num_samples=3)
    tokens_j, scores_j = js.sample(je.Ensemble([ja, jb], average="prob"), src, 9, num_samples=3)
    np.testing.assert_array_equal(np.asarray(tokens_j), tokens_t.numpy())
    np.testing.assert_allclose(np.asarray(scores_j), scores_t.numpy(), atol=2e-5, rtol=0)  # ~25 terms of ~4


def _teacher_forced(models, src, tokens):
    """Each member's log-probabilities (M, B, L, V) of every position of `tokens` (B, L), BOS first."""
    tgt_in = torch.cat([torch.full((len(tokens), 1), 1), tokens[:, :-1]], dim=1)
    with torch.no_grad():
        return torch.stack([torch.log_softmax(m(src, tgt_in), dim=-1) for m in models])


@pytest.mark.parametrize("average", ["logprob", "prob"])
def test_each_greedy_step_takes_the_average_of_the_members_log_probabilities(average):
    """The ensemble's greedy output, rescored by hand from each member's log-probabilities:
    "logprob" the mean log-probability renormalised, "prob" the log of the mean probability.
    Each token is the argmax of that average and the score is the sum of its values, to 1e-5."""
    (ta, tb), (ja, jb) = members()
    src = torch.from_numpy(source(batch=5, length=9, seed=7))
    tokens, scores = td.greedy_search(te.Ensemble([ta, tb], average=average), src)
    logprobs = _teacher_forced([ta, tb], src, tokens)  # (2, B, L, V)
    if average == "prob":
        expected = torch.log(logprobs.exp().mean(dim=0))
    else:
        expected = torch.log_softmax(logprobs.mean(dim=0), dim=-1)
    expected[..., [0, 1]] = -1e9  # pad and BOS: never emitted
    written = tokens != 0
    limits = td.sentence_limits(src, 0, tokens.shape[1], 1.5, 10)
    free = written & (torch.arange(tokens.shape[1]) + 1 < limits[:, None])  # not the EOS forced at the limit
    assert torch.equal(expected.argmax(dim=-1)[free], tokens[free])
    chosen = expected.gather(2, tokens[..., None])[..., 0]
    by_hand = torch.where(written, chosen, 0).sum(1).numpy()
    bound = np.maximum(1e-5, written.sum(1).numpy() * np.spacing(np.abs(by_hand)))  # n terms: n ulps (test_decode.py)
    assert (np.abs(by_hand - scores.numpy()) <= bound).all(), (by_hand - scores.numpy(), bound)
    # JAX's decode_step gives the same first-step average (eager: no search compiled).
    src_j = src.numpy()
    ensemble_j = je.Ensemble([ja, jb], average=average)
    mask = jd.padding_mask(src_j, 0)
    step, _ = ensemble_j.decode_step(np.ones(5, np.int32), ensemble_j.init_cache(ensemble_j.encode(src_j, mask), 4), 0,
                                     mask)
    np.testing.assert_allclose(np.asarray(jax.nn.log_softmax(step))[:, 2:], expected[:, 0, 2:].numpy(), atol=1e-5)
