"""One training curve in two frameworks in lockstep, compared every update (`aiayn trajectory`, docs/parity.md)."""

from __future__ import annotations

import dataclasses
import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from torch_reference.config import NON_NEGATIVE, POSITIVE, TransformerConfig
from train import data
from train.backends import create_backend, initialize
from train.checkpoints import TrainingState
from train.config import PAPER_WARMUP, ExperimentConfig  # a trajectory: the first updates of the paper's schedule
from train.interop.runs import convert_checkpoints
from train.interop.weights import convert_state
from train.loop import make_batcher
from train.options import OptionError, Output, checked, option

from .comparison import enable_parity_numerics

# A training curve's bounds, far below a formula slip's 1e-3 (docs/parity.md#a-training-curve-in-both-frameworks).
BOUNDS = {"loss_rel": 1e-5, "param_rel_l2": 1e-4}

# Parameters with an analytically zero gradient (softmax ignores a shift of a row): excluded from the bound.
NOISE_ONLY_SUFFIX = ".k_proj.bias"
PER_STEP = ("step", "loss_rel", "param_rel_l2", "param_worst", "k_proj_bias_rel_l2")  # a comparison's per update


def experiment_config(steps: int = 100, preset: str = "tiny", model: dict | None = None, **changes: Any):
    """A trajectory's settings: the paper's schedule, dropout off, float32, one torch thread (two compete with XLA)."""
    settings = dict(backend="torch", preset=preset, model=dict(model or {}), steps=steps, warmup=PAPER_WARMUP,
                    dropout=0.0, numbers_train=4000, numbers_valid=1, numbers_test=0, token_budget=1024, threads=1,
                    progress=False, dtype="float32")
    settings.update({k: v for k, v in changes.items() if v is not None})
    return ExperimentConfig(**settings).resolve()


@checked
class Trajectory:
    """How `parity_report` runs a trajectory of `steps` updates (its training settings: `experiment_config`)."""

    steps: int = option(100, "updates in each framework", range=POSITIVE)
    switch: int | None = option(None, "convert both runs' checkpoints at this update and continue in the other "
                                "framework (default: half of --steps; 0: off)", range=NON_NEGATIVE)
    control: bool = option(False, "also train torch from the initial weights moved by one ulp: float32's own drift "
                           "(not bounded)")
    json: Output = option(None, "write the full report (every update, every parameter) here")
    plot: Output = option(None, "write a PNG of the differences per update here")

    def check(self) -> None:
        object.__setattr__(self, "switch", self.steps // 2 if self.switch is None else self.switch)
        if self.switch >= self.steps:
            raise OptionError("{} " + f"{self.switch} must be below " + "{} " + f"{self.steps}", "switch", "steps")


def prepare(cfg) -> tuple[TransformerConfig, Callable[[], Any]]:
    """(model config, a function making a new batcher of the training data) for `cfg`, as train.loop builds them."""
    if getattr(cfg, "dtype", "float32") != "float32":
        raise ValueError("parity is measured in float32")
    splits = data.load_splits(cfg)
    tokenizers = data.train_tokenizers(splits.train, vocab_size=cfg.vocab_size, joint=cfg.joint_vocab)
    model_cfg = cfg.model_config(tokenizers.src.get_vocab_size(), tokenizers.tgt.get_vocab_size())
    if model_cfg.dropout or model_cfg.attention_dropout or model_cfg.activation_dropout:
        raise ValueError("parity needs dropout off: dropout streams cannot be matched across frameworks")
    return model_cfg, lambda: make_batcher(cfg, tokenizers, splits.train)


def one_ulp_away(state: TrainingState, seed: int = 1) -> TrainingState:
    """`state` with every weight one float32 ulp up or down at random: the size of the frameworks' differences."""
    rng = np.random.default_rng(seed)
    params = {k: np.where(rng.random(v.shape) < 0.5, np.nextafter(v, np.inf), np.nextafter(v, -np.inf)).astype(v.dtype)
              for k, v in state.params.items()}
    return dataclasses.replace(state, params=params)


@dataclasses.dataclass
class TrainingRun:
    """One training run: its backend, its batches, and the loss of each update (by step)."""

    name: str
    backend: Any
    batcher: Any
    losses: dict[int, float] = dataclasses.field(default_factory=dict)
    batch_ids: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)

    def step(self) -> int:
        batch = next(self.batcher)
        metrics = self.backend.fetch([self.backend.train_step([batch])])[0]
        step = self.backend.step
        self.losses[step], self.batch_ids[step] = metrics["loss"], batch.ids
        return step


def _weights(backend) -> dict[str, np.ndarray]:
    """The weights under their torch names (the spec's), as float64 NumPy."""
    state = backend.export_state()
    state = TrainingState(state.framework, state.step, state.params)  # the weights alone
    return {k: v.astype(np.float64) for k, v in convert_state(state, "torch", backend.model_cfg).params.items()}


def compare_weights(actual: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> dict:
    """Per parameter ||a - r|| / ||r||: the worst bounded one, and the excluded k_proj biases apart."""
    rel = {k: float(np.linalg.norm(actual[k] - r) / max(np.linalg.norm(r), 1e-30)) for k, r in reference.items()}
    bounded = {k: v for k, v in rel.items() if not k.endswith(NOISE_ONLY_SUFFIX)}
    worst = max(bounded, key=bounded.get)
    out = {"max_rel_l2": bounded[worst], "worst": worst, "per_parameter": rel}
    noise = [k for k in rel if k.endswith(NOISE_ONLY_SUFFIX)]
    if noise:
        worst_noise = max(noise, key=rel.get)
        out["k_proj_bias"] = {"max_rel_l2": rel[worst_noise], "worst": worst_noise,
                              "max_abs": max(float(np.abs(actual[k] - reference[k]).max()) for k in noise)}
    return out


@dataclasses.dataclass
class Comparison:
    """Run `run` against `reference` after update `start`; `bounded`: held to BOUNDS (the control measures drift)."""

    label: str
    run: str
    reference: str
    start: int = 0
    bounded: bool = True
    per_step: dict[str, list] = dataclasses.field(default_factory=lambda: {key: [] for key in PER_STEP})
    final: dict | None = None

    def record(self, step: int, runs: dict[str, TrainingRun], weights: dict[str, dict]) -> None:
        a, r = runs[self.run], runs[self.reference]
        if not np.array_equal(a.batch_ids[step], r.batch_ids[step]):
            raise AssertionError(f"{self.label}: update {step} trained on different batches")
        diff = self.final = compare_weights(weights[self.run], weights[self.reference])
        values = (step, abs(a.losses[step] - r.losses[step]) / abs(r.losses[step]), diff["max_rel_l2"], diff["worst"],
                  diff.get("k_proj_bias", {}).get("max_rel_l2", 0.0))
        for key, value in zip(PER_STEP, values):
            self.per_step[key].append(value)

    def to_dict(self) -> dict:
        per = self.per_step
        i = int(np.argmax(per["loss_rel"]))
        return {"label": self.label, "run": self.run, "reference": self.reference, "from_step": self.start,
                "bounded": self.bounded, "max_loss_rel": per["loss_rel"][i], "max_loss_rel_step": per["step"][i],
                "final_step": per["step"][-1], "final_param_rel_l2": self.final["max_rel_l2"],
                "final_param_worst": self.final["worst"], "k_proj_bias": self.final.get("k_proj_bias"),
                "per_step": per, "final_per_parameter": self.final["per_parameter"]}


def _switch(run: TrainingRun, cfg, model_cfg, new_batcher: Callable[[], Any],
            workdir: Path) -> tuple[TrainingRun, bool]:
    """`run`'s checkpoint saved, converted and restored in the other framework: (that run, whether bit-exact)."""
    src, other = run.name, "torch" if run.name == "jax" else "jax"
    src_cfg = cfg.replace(backend=src)
    before = convert_state(run.backend.export_state(), other, model_cfg)
    run.backend.save({"step": run.backend.step, "data": run.batcher.state(), "config": src_cfg.experiment()})
    dst_dir = workdir / f"{src}-to-{other}"
    convert_checkpoints(src_cfg, model_cfg, workdir / src, dst_dir, to=other)
    backend = create_backend(cfg.replace(backend=other), model_cfg, str(dst_dir))
    meta = backend.restore("latest")
    batcher = new_batcher()
    batcher.restore(meta["data"])
    exact = not before.differences(backend.export_state())
    return TrainingRun(f"{src}→{other}", backend, batcher), exact


def run_trajectory(cfg, initial: TrainingState, steps: int | None = None, switch: int | None = None,
                   control: bool = False, progress: bool = False, prepared=None) -> dict:
    """The unjudged report of `steps` lockstep updates from `initial`, with the switched runs and the `control`."""
    steps = steps or cfg.steps
    model_cfg, new_batcher = prepared or prepare(cfg)
    comparisons = [Comparison("jax vs torch", "jax", "torch")]
    if control:
        comparisons.append(Comparison("torch (init 1 ulp away) vs torch", "torch+1ulp", "torch", bounded=False))
    conversions_exact = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="trajectory-") as tmp:
        workdir = Path(tmp)
        names = ("torch", "jax", "torch+1ulp") if control else ("torch", "jax")
        for framework in ("torch", "jax"):
            initialize(cfg.replace(backend=framework))  # each framework's process settings (threads, allocator)
        backends = {n: create_backend(cfg.replace(backend=n.split("+")[0]), model_cfg, str(workdir / n)) for n in names}
        for name, backend in backends.items():  # one set of initial weights, moved by the conversion
            state = one_ulp_away(initial) if name == "torch+1ulp" else initial
            backend.import_state(convert_state(state, name.split("+")[0], model_cfg))
        runs = {n: TrainingRun(n, b, new_batcher()) for n, b in backends.items()}
        for step in range(1, steps + 1):
            for run in list(runs.values()):
                assert run.step() == step
            weights = {name: _weights(run.backend) for name, run in runs.items()}
            for c in comparisons:
                c.record(step, runs, weights)
            if switch and step == switch and step < steps:
                for src, other in (("jax", "torch"), ("torch", "jax")):
                    new, exact = _switch(runs[src], cfg, model_cfg, new_batcher, workdir)
                    runs[new.name], conversions_exact[new.name] = new, exact
                    label = f"{src} {switch} + {other} {steps - switch} vs {other} {steps}"
                    comparisons.append(Comparison(label, new.name, other, switch))
            if progress and (step % 10 == 0 or step == steps):
                print(f"  update {step}/{steps}: " + "; ".join(
                    f"[{c.label}] loss {c.per_step['loss_rel'][-1]:.1e} params {c.per_step['param_rel_l2'][-1]:.1e}"
                    for c in comparisons if c.per_step["step"]), flush=True)
        for run in runs.values():
            run.backend.close()
    return {"steps": steps, "switch": switch, "seconds": round(time.perf_counter() - started, 1),
            "experiment": cfg.to_dict(), "model": model_cfg.to_dict(), "bounds": dict(BOUNDS),
            "excluded": f"*{NOISE_ONLY_SUFFIX}: analytically zero gradient (softmax is shift invariant)",
            "conversion_bit_exact": conversions_exact,
            "losses": {name: [run.losses[s] for s in sorted(run.losses)] for name, run in runs.items()},
            "lr": [runs["torch"].backend.learning_rate(s) for s in range(1, steps + 1)],
            "comparisons": [c.to_dict() for c in comparisons]}


def _bound_failures(report: dict) -> tuple[list[str], list[str]]:
    """(the loss bounds, the parameter bounds) that the bounded comparisons of `report` exceed."""
    bounded = [c for c in report["comparisons"] if c["bounded"]]
    loss_bound, param_bound = BOUNDS["loss_rel"], BOUNDS["param_rel_l2"]
    loss = [f"{c['label']}: loss rel {c['max_loss_rel']:.3g} at update {c['max_loss_rel_step']} > {loss_bound:g}"
            for c in bounded if not c["max_loss_rel"] <= loss_bound]
    params = [f"{c['label']}: {c['final_param_worst']} rel L2 {c['final_param_rel_l2']:.3g} > {param_bound:g}"
              for c in bounded if not c["final_param_rel_l2"] <= param_bound]
    return loss, params


def failures(report: dict) -> list[str]:
    """The bounds a report exceeds; a ReLU run's parameter bound on its smooth path where there is one."""
    out, params = _bound_failures(report)
    if params and "smooth_path" in report:
        params = [f"smooth path (GELU): {line}" for part in _bound_failures(report["smooth_path"]) for line in part]
    out += params
    for report_ in (report, report.get("smooth_path", {})):
        out += [f"{name}: the converted checkpoint did not restore bit-exactly"
                for name, exact in report_.get("conversion_bit_exact", {}).items() if not exact]
    return out


def parity_report(cfg, steps: int | None = None, switch: int | None = None, control: bool = False,
                  progress: bool = False) -> dict:
    """`run_trajectory`, judged; a ReLU model out of the parameter bound judged on its smooth path (exact GELU) too."""
    enable_parity_numerics()
    model_cfg, new_batcher = prepare(cfg)
    initial = create_backend(cfg.replace(backend="torch"), model_cfg).export_state()
    report = run_trajectory(cfg, initial, steps, switch, control, progress, (model_cfg, new_batcher))
    if _bound_failures(report)[1] and model_cfg.activation == "relu":
        if progress:
            print("  parameters exceed the bound with ReLU: running the smooth path (same weights, exact GELU)")
        smooth_cfg = cfg.replace(model={**cfg.model, "activation": "gelu"})
        report["smooth_path"] = run_trajectory(smooth_cfg, initial, steps, switch, False, progress)
    report["failures"] = failures(report)
    return report


def growth(comparison: dict, at=(1, 10, 25, 50, 75, 100)) -> list[tuple[int, float, float]]:
    """(update, loss rel, param rel L2) at a few updates that a comparison covers, and its last."""
    per = comparison["per_step"]
    index = {s: i for i, s in enumerate(per["step"])}
    points = sorted({s for s in at if s in index} | {per["step"][-1]})
    return [(s, per["loss_rel"][index[s]], per["param_rel_l2"][index[s]]) for s in points]


def growth_exponent(comparison: dict, start: int = 10) -> float | None:
    """p in param rel L2 ~ update^p between update `start` and the last (log-log slope)."""
    per = comparison["per_step"]
    if start not in per["step"] or per["step"][-1] <= start:
        return None
    a, b = per["param_rel_l2"][per["step"].index(start)], per["param_rel_l2"][-1]
    return math.log(b / a) / math.log(per["step"][-1] / start) if a > 0 and b > 0 else None


def plot(report: dict, path: str | Path) -> Path:
    """Loss and weight differences per update, log scale, one line per comparison; bounds dashed."""
    from matplotlib.figure import Figure  # no pyplot: no display, no global state

    floor = 1e-9  # where a difference of exactly 0 is drawn on the log axes (float32 rounding is ~6e-8)
    fig = Figure(figsize=(13, 4.8), layout="constrained")
    ax_loss, ax_param = fig.subplots(1, 2)
    paths = [("", report)] + ([("smooth path (GELU): ", report["smooth_path"])] if "smooth_path" in report else [])
    for prefix, rep in paths:
        for c in rep["comparisons"]:
            for ax, key in ((ax_loss, "loss_rel"), (ax_param, "param_rel_l2")):
                ax.semilogy(c["per_step"]["step"], np.maximum(c["per_step"][key], floor), "--" if prefix else "-",
                            label=prefix + c["label"], lw=1)
    first = report["comparisons"][0]["per_step"]
    ax_param.semilogy(first["step"], np.maximum(first["k_proj_bias_rel_l2"], floor), ":", color="grey", lw=1,
                      label="k_proj.bias, jax vs torch (excluded: zero gradient)")
    for ax, bound in ((ax_loss, BOUNDS["loss_rel"]), (ax_param, BOUNDS["param_rel_l2"])):
        ax.axhline(bound, ls="-.", color="black", lw=1.2, label="bound")
        if report["switch"]:
            ax.axvline(report["switch"], ls=":", color="grey", lw=1)
        ax.set_ylim(bottom=floor / 2)
    ax_loss.set(xlabel="update", ylabel="|loss_a - loss_b| / loss_b (0 drawn at 1e-9)",
                title="training loss, relative difference")
    ax_param.set(xlabel="update", ylabel="max over parameters of ||a - b|| / ||b||",
                 title="weights, worst relative L2 distance")
    ax_param.legend(fontsize=7)
    exp = report["experiment"]
    fig.suptitle(f"JAX vs PyTorch, preset {exp['preset']}, {report['steps']} updates (warmup {exp['warmup']}), "
                 "float32, dropout off")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path
