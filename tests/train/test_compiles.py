"""The compile budget: a run counts the programs JAX compiles (`train.backends.compiles`, from JAX's
own compile events) and reports them with the padding share of its batches."""

import json
import os

import jax
import numpy as np
import pytest

from train import loop
from train.backends import compiles


def test_one_program_counted_per_new_shape():
    compiles.listen()
    compiles.listen()  # once per process: a second call must not count twice
    double = jax.jit(lambda x: x * 2 + 1)
    start = compiles.totals()
    # NumPy inputs: creating them with jnp would compile programs of its own.
    double(np.ones(3, np.float32)).block_until_ready()
    double(np.zeros(3, np.float32)).block_until_ready()  # the same shape: no new program
    double(np.ones((2, 5), np.float32)).block_until_ready()  # a new shape: one more
    counted = compiles.totals() - start
    assert counted.programs == 2
    assert 0 < counted.seconds < 60


def test_a_packed_run_compiles_four_programs_and_reports_them(fast_config):
    cfg = fast_config("jax", steps=3, eval_every=3, log_every=1, pack=True, numbers_test=0)
    compiles.listen()
    counts = []
    original = loop._log_window

    def log_window(*args, **kwargs):  # what the progress line reports after each step
        counts.append(args[-1] if len(args) > 8 else kwargs.get("compiled"))
        return original(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop, "_log_window", log_window)
        results = loop.train(cfg)
    # One shape (packed): the first step compiles the training program, the next two compile nothing.
    assert counts[0].programs >= 1 and counts[1].programs == counts[2].programs == counts[0].programs
    assert results["train"]["packed"] is True
    # The whole run: the initialisation, the training step, the validation loss and one search
    # (every validation sentence is under 64 tokens); no eager operation compiles one of its own.
    assert results["compiled_programs"] == 4
    assert 0 < results["compile_seconds"] < results["wall_time_s"]
    assert 0.0 <= results["train"]["padding_share"] < 0.5
    saved = json.loads((loop.Path(cfg.run_dir) / "results.json").read_text())
    assert saved["compiled_programs"] == results["compiled_programs"]


def test_torch_reports_no_compile_count(tiny_torch_run):
    results = json.loads((tiny_torch_run / "results.json").read_text())  # the shared run's, as it saved them
    assert results["compiled_programs"] is None and results["compile_seconds"] is None
    assert results["train"]["packed"] is False


def test_a_jax_search_compiles_one_program_for_every_alpha_and_each_alpha_counts(tiny_torch_and_jax_runs):
    # On main alpha was a constant of the program: a server compiled one per distinct alpha (11 MB each, kept).
    import train

    texts = ["dreiundvierzig", "neun", "siebenhundertzwölf"]
    compiles.listen()
    with train.load(tiny_torch_and_jax_runs[0]) as spec, train.load(tiny_torch_and_jax_runs[1]) as run:
        for beam in (1, 3):  # the greedy search's scores use alpha too
            run.translate(texts, beam=beam, alpha=0.6, n_best=1)  # compiles this search once
            start = compiles.totals()
            for alpha in (0.0, 1.7, 4.0):
                got = run.translate(texts, beam=beam, alpha=alpha, n_best=1)
                want = spec.translate(texts, beam=beam, alpha=alpha, n_best=1)  # the torch twin's, alpha a float
                assert [h[0].tokens for h in got] == [h[0].tokens for h in want]
                # float32 in both; the penalty's power computed by each framework's own kernel
                np.testing.assert_allclose([h[0].score for h in got], [h[0].score for h in want], rtol=1e-5)
            assert (compiles.totals() - start).programs == 0


def resident_mib() -> float:
    """This process's resident memory (Linux /proc)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_the_jax_sampler_is_one_program_for_every_setting_and_memory_stays_flat(tiny_torch_and_jax_runs):
    # On main each temperature, top_k or top_p was a constant of its program: ~2 s of compiling and ~1.5 MiB kept each.
    import train

    compiles.listen()
    with train.load(tiny_torch_and_jax_runs[0]) as spec, train.load(tiny_torch_and_jax_runs[1]) as run:
        for settings in ({"temperature": 0.7}, {"temperature": 1.3, "top_k": 3, "top_p": 0.8}, {"top_k": 1}):
            got = run.translate(["neun", "achtzehn"], sample=True, seed=4, num_samples=3, **settings)
            want = spec.translate(["neun", "achtzehn"], sample=True, seed=4, num_samples=3, **settings)
            assert [[h.tokens for h in s] for s in got] == [[h.tokens for h in s] for s in want], settings
        run.translate(["neun"], sample=True)  # this shape's program
        programs, start, before = run.backend._sample._cache_size(), compiles.totals(), resident_mib()
        for i in range(200):
            run.translate(["neun"], sample=True, temperature=0.5 + i * 0.001, top_k=i % 7, top_p=1 - i * 0.002)
        assert (compiles.totals() - start).programs == 0
        assert run.backend._sample._cache_size() == programs  # JAX's own count of the programs it holds
        # 300 MiB on main (1.5 MiB a setting); 32 MiB leaves the allocator's own churn
        assert resident_mib() - before < 32
