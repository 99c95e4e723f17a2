"""The measurements of `aiayn profile`: each part of a training step, JAX vs PyTorch; XLA:CPU A/B and op split."""

from __future__ import annotations

import functools
import json
import statistics
from collections.abc import Callable

import numpy as np

from torch_reference.config import POSITIVE, TransformerConfig

from .benchmark import timings
from .options import Output, checked, option


@checked
class Profile:
    """What `aiayn profile` times: a training step's parts, or the XLA op split, or the xla_cpu A/B."""

    preset: str = option("base", "model preset", choices=tuple(TransformerConfig.presets()))
    batch: int = option(32, "sentences per batch", range=POSITIVE)
    length: int = option(32, "tokens per sentence, source and target", range=POSITIVE)
    vocab: int = option(8000, "shared vocabulary size", range=POSITIVE)
    repeats: int = option(10, "timed runs per part", range=POSITIVE)
    json: Output = option(None, "also write the figures to this JSON file")
    xla_ops: bool = option(False, "instead: split JAX's forward + backward time into matmuls and other operations")
    xla_cpu_ab: bool = option(False, "instead: time JAX's train step and a beam-4 search with and without "
                              "xla_cpu's pieces")
    sentences: int = option(64, "sources of the --xla-cpu-ab search", range=POSITIVE)


def median_time(fn: Callable[[], object], repeats: int) -> float:
    return statistics.median(timings(fn, repeats, warmup=2))


def _parts(model, loss: Callable, causal, src, tgt, projection: tuple) -> dict[str, tuple]:
    """{part: (module, fn(module, x, memory))} of either twin's `model`; `loss(logits)`, the smoothed loss."""
    layer_e, layer_d = model.encoder.layers[0], model.decoder.layers[0]
    embeddings = ((model.src_embed, lambda m, x, mem: m(src) + m(tgt)) if model.cfg.share_embeddings
                  else (model, lambda m, x, mem: m.src_embed(src) + m.target_embedding(tgt)))
    return {
        "self-attention": (layer_e.self_attn, lambda m, x, mem: m(x, x)),
        "causal self-attention": (layer_d.self_attn, lambda m, x, mem: m(x, x, causal)),
        "feed-forward": (layer_e.ff, lambda m, x, mem: m(x)),
        "encoder layer": (layer_e, lambda m, x, mem: m(x)),
        "decoder layer": (layer_d, lambda m, x, mem: m(x, mem, None, causal)),
        "embeddings (src + tgt)": embeddings,
        "encoder (all layers)": (model.encoder, lambda m, x, mem: m(x)),
        "decoder (all layers)": (model.decoder, lambda m, x, mem: m(x, mem, None, causal)),
        "output projection + loss": projection,
        "forward + backward": (model, lambda m, x, mem: loss(m(src, tgt))),
    }


def torch_parts(cfg: TransformerConfig, batch: int, length: int, repeats: int, seed: int = 0) -> dict:
    """{part: seconds} for the torch reference."""
    import torch

    import torch_reference
    from torch_reference.objective import label_smoothed_cross_entropy

    torch.manual_seed(seed)
    model = torch_reference.Transformer(cfg)
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.standard_normal((batch, length, cfg.d_model), dtype=np.float32)).requires_grad_()
    memory = torch.from_numpy(rng.standard_normal((batch, length, cfg.d_model), dtype=np.float32)).requires_grad_()
    ids = torch.from_numpy(rng.integers(4, cfg.tgt_vocab_size, (batch, length)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)

    def loss(logits):
        return label_smoothed_cross_entropy(logits, ids, cfg.pad_id, 0.1)

    def backward(module, fn):
        def run():
            model.zero_grad(set_to_none=True)
            x.grad = memory.grad = None
            fn(module, x, memory).sum().backward()

        return run

    src, tgt = ids, torch.roll(ids, 1, dims=1)
    causal = torch_reference.model.causal_mask(length)
    parts = _parts(model, loss, causal, src, tgt, (model, lambda m, x, mem: loss(m.project(x))))
    times = {name: median_time(backward(*part), repeats) for name, part in parts.items()}
    backward(*parts["forward + backward"])()  # gradients for Adam to apply
    times["adam update"] = median_time(optimizer.step, repeats)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss(model(src, tgt)).backward()
        optimizer.step()

    times["train step"] = median_time(step, repeats)
    return times


def jax_parts(cfg: TransformerConfig, batch: int, length: int, repeats: int, seed: int = 0) -> dict:
    """{part: seconds} for the Flax twin (the XLA:CPU kernels on a CPU)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import jax_transformer
    from jax_transformer.model import causal_mask
    from jax_transformer.objective import label_smoothed_cross_entropy

    kernels = "xla_cpu" if jax.devices()[0].platform == "cpu" else "reference"
    model = jax_transformer.Transformer(cfg, kernels=kernels, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((batch, length, cfg.d_model), dtype=np.float32))
    memory = jnp.asarray(rng.standard_normal((batch, length, cfg.d_model), dtype=np.float32))
    ids = jnp.asarray(rng.integers(4, cfg.tgt_vocab_size, (batch, length)))

    def loss(logits):
        return label_smoothed_cross_entropy(logits, ids, cfg.pad_id, 0.1)

    def timed_grad(module, fn):
        graphdef, params = nnx.split(module)

        def total(params, x, memory):
            return fn(nnx.merge(graphdef, params), x, memory).sum()

        grads = jax.jit(jax.grad(total, argnums=(0, 1, 2)))
        return median_time(lambda: jax.block_until_ready(grads(params, x, memory)), repeats)

    # Each part differentiated by its own parameters: over the whole model JAX also writes zeros for the others.
    def projection_loss(m, x, memory):
        return loss(model.kernels.logits(m, x) if cfg.tie_output else m(x))

    projection = (model.target_embedding if cfg.tie_output else model.out_proj, projection_loss)
    parts = _parts(model, loss, causal_mask(length), ids, jnp.roll(ids, 1, axis=1), projection)
    times = {name: timed_grad(*part) for name, part in parts.items()}
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optax.adam(1e-4, b1=0.9, b2=0.98, eps=1e-9)
    state = [(params, tx.init(params))]  # donated to each update and replaced by its result, as the backend's step

    def timed_update(grads_of: Callable, *args) -> float:
        @functools.partial(jax.jit, donate_argnums=0)
        def update(state, *args):
            params, opt_state = state
            updates, opt_state = tx.update(grads_of(params, *args), opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        def run():
            state[0] = jax.block_until_ready(update(state[0], *args))

        return median_time(run, repeats)

    times["adam update"] = timed_update(lambda params, grads: grads, jax.tree.map(jnp.ones_like, params))
    forward = parts["forward + backward"][1]
    times["train step"] = timed_update(jax.grad(lambda params: forward(nnx.merge(graphdef, params), None, None)))
    return times


def xla_op_split(cfg: TransformerConfig, batch: int, length: int, repeats: int = 3, seed: int = 0) -> dict[str, float]:
    """Milliseconds per JAX forward + backward spent in matmuls and in other operations, from jax.profiler.trace."""
    import glob
    import gzip
    import tempfile

    import jax
    import jax.numpy as jnp
    from flax import nnx

    import jax_transformer
    from jax_transformer.objective import label_smoothed_cross_entropy

    kernels = "xla_cpu" if jax.devices()[0].platform == "cpu" else "reference"
    model = jax_transformer.Transformer(cfg, kernels=kernels, rngs=nnx.Rngs(seed))
    graphdef, params = nnx.split(model, nnx.Param)
    ids = jnp.asarray(np.random.default_rng(seed).integers(4, cfg.tgt_vocab_size, (batch, length)))

    def loss(params, src, tgt):
        return label_smoothed_cross_entropy(nnx.merge(graphdef, params)(src, tgt), src, cfg.pad_id, 0.1)

    grads = jax.jit(jax.grad(loss))
    args = (params, ids, jnp.roll(ids, 1, axis=1))
    jax.block_until_ready(grads(*args))
    with tempfile.TemporaryDirectory() as logdir:
        with jax.profiler.trace(logdir, create_perfetto_trace=True):
            for _ in range(repeats):
                jax.block_until_ready(grads(*args))
        (path,) = glob.glob(f"{logdir}/**/*.trace.json.gz", recursive=True)
        with gzip.open(path) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    split = {"matmuls": 0.0, "other operations": 0.0}
    for event in events:
        name = event.get("name", "")
        if event.get("ph") != "X" or name.startswith(("$", "ThunkExecutor", "PjitFunction", "ParseArguments", "Common")):
            continue  # Python frames and the executor's own spans, not operations
        split["matmuls" if name.startswith(("ynn_fusion", "dot")) else "other operations"] += event.get("dur", 0) / 1e3
    return {key: value / repeats for key, value in split.items()}


def xla_cpu_ab(cfg: TransformerConfig, batch: int, length: int, repeats: int, sentences: int, seed: int = 0) -> dict:
    """Seconds of a train step and a beam-4 search, kernels "reference" (plain) and "xla_cpu" (tuned) alternated."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import jax_transformer
    from jax_transformer import decode
    from jax_transformer.objective import label_smoothed_cross_entropy

    rng = np.random.default_rng(seed)
    src, tgt = (jnp.asarray(rng.integers(4, cfg.src_vocab_size, (batch, length)), jnp.int32) for _ in range(2))
    sources = np.zeros((sentences, length), np.int32)
    for row, n in enumerate(rng.integers(2, length + 1, sentences)):
        sources[row, : n - 1], sources[row, n - 1] = rng.integers(4, cfg.src_vocab_size, n - 1), cfg.eos_id
    tx, eps = optax.adam(1e-4, b1=0.9, b2=0.98, eps=1e-9), (0.1, 0.0)
    runs, temporaries = {}, {}
    for name, kernels in (("plain", "reference"), ("tuned", "xla_cpu")):
        graphdef, params = nnx.split(jax_transformer.Transformer(cfg, kernels=kernels, rngs=nnx.Rngs(seed)))

        def step(state, graphdef=graphdef):
            def loss(p):  # the smoothed loss's sum over the tokens, and the NLL's
                logits = nnx.merge(graphdef, p)(src, jnp.roll(tgt, 1, axis=1))
                return tuple(label_smoothed_cross_entropy(logits, tgt, cfg.pad_id, e, "sum") / tgt.size for e in eps)

            updates, opt_state = tx.update(jax.grad(loss, has_aux=True)(state[0])[0], state[1], state[0])
            return optax.apply_updates(state[0], updates), opt_state

        step = jax.jit(step, donate_argnums=0).lower((params, tx.init(params))).compile()
        temporaries[name] = step.memory_analysis().temp_size_in_bytes / 2**20
        search = jax.jit(lambda p, s, graphdef=graphdef: decode.beam_search(nnx.merge(graphdef, p), s, 4)[0])

        def train(step=step, state=[(jax.tree.map(jnp.copy, params), tx.init(params))]):  # noqa: B006 (state kept)
            state[0] = jax.block_until_ready(step(state[0]))

        beam = lambda s=search, p=params: jax.block_until_ready(s(p, sources))  # noqa: E731
        runs[name] = {"train step": train, "beam-4 search": beam}
    times = {part: {name: [] for name in runs} for part in runs["plain"]}
    for part in times:
        for name in runs:  # warm-up: compiles the search
            runs[name][part]()
        for _ in range(repeats):
            for name in runs:
                times[part][name] += timings(runs[name][part], 1)
    return {**times, "temporaries MiB": temporaries}
