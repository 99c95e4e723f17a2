"""aiayn bench and aiayn profile: the FLOP count, and both tools end to end on a tiny model."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torch_reference.config import TransformerConfig
from train import benchmark
from train.benchmark import step_flops
from train.commands import profile_step

REPO = Path(__file__).resolve().parents[2]


def test_step_flops_counts_every_matmul():
    """Enumerated matmul by matmul (2 FLOPs per multiply-add), forward x 3 for the backward."""
    cfg = TransformerConfig.preset("tiny", src_vocab_size=50, tgt_vocab_size=50)
    B, S, T, D, F, V = 3, 5, 7, cfg.d_model, cfg.d_ff, 50
    linear = lambda rows, d_in, d_out: 2 * rows * d_in * d_out  # noqa: E731
    attend = lambda queries, keys: 2 * 2 * B * queries * keys * D  # noqa: E731  scores and weighted values
    encoder_layer = 4 * linear(B * S, D, D) + attend(S, S) + linear(B * S, D, F) + linear(B * S, F, D)
    decoder_layer = (
        4 * linear(B * T, D, D) + attend(T, T)  # self-attention
        + 2 * linear(B * T, D, D) + 2 * linear(B * S, D, D) + attend(T, S)  # cross-attention: q, out; k, v
        + linear(B * T, D, F) + linear(B * T, F, D)
    )
    forward = cfg.num_encoder_layers * encoder_layer + cfg.num_decoder_layers * decoder_layer + linear(B * T, D, V)
    assert step_flops(cfg, B, S, T) == 3 * forward


def tiny_step_flops(batch: int, length: int, vocab: int) -> int:
    """Model FLOPs of one training step of the tiny preset on `batch` sentences of `length` tokens a
    side, counted by hand from its dimensions (2 FLOPs per multiply-add, forward x 3 for the
    backward) without aiayn bench: what `aiayn bench` must report for the same work."""
    cfg = TransformerConfig.preset("tiny")
    assert (cfg.d_model, cfg.d_ff, cfg.num_encoder_layers, cfg.num_decoder_layers, cfg.activation) == (
        64, 128, 2, 2, "relu"), "the tiny preset changed: count its FLOPs again"
    D, F, N = 64, 128, batch * length  # N: tokens a side
    projection = 2 * N * D * D  # one of q, k, v, out (D x D) over one side's tokens
    feed_forward = 2 * N * D * F + 2 * N * F * D
    attention = 2 * (2 * batch * length * length * D)  # scores q.k and weighted values, all heads together
    encoder_layer = 4 * projection + attention + feed_forward
    decoder_layer = 4 * projection + attention + 4 * projection + attention + feed_forward  # cross: q, out; k, v
    output = 2 * N * D * vocab
    return 3 * (2 * encoder_layer + 2 * decoder_layer + output)


def test_bench_runs_both_backends_on_the_same_work(tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "train.commands.bench", "--presets", "tiny", "--backends", "jax,torch", "--steps", "2",
         "--warmup", "1", "--batch-tokens", "256", "--length", "16", "--vocab-size", "500", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    assert [(r["backend"], r["precision"]) for r in results] == [("jax", "float32"), ("torch", "float32")]
    # --batch-tokens 256 / --length 16: 16 sentences of 16 tokens a side, on both backends.
    flops = tiny_step_flops(16, 16, 500)
    # Worked out once on paper: projection 2,097,152, feed-forward 8,388,608, attention 1,048,576;
    # encoder layer 17,825,792, decoder layer 27,262,976, output 16,384,000; forward 106,561,536.
    assert flops == 3 * 106_561_536
    for r in results:
        assert r["batch"] == [16, 16] and r["tokens_per_step"] == 2 * 16 * 16 and r["step_flops"] == flops
        assert len(r["step_times_s"]) == 2  # the --steps 2 timed steps; the --warmup 1 step is not among them
        assert r["median_step_s"] > 0 and r["matmul_peak_gflops"] > 0 and r["peak_memory_mib"] > 0
        assert_mfu(r, flops)
    # Each framework initialises its own weights (train never converts between frameworks), so the
    # losses are not equal: after 3 updates at the paper's warmup (lr <= 3e-6) both stay near
    # ln(500) = 6.21, the loss of near-uniform predictions (measured 6.81 and 6.72; bound 20%).
    for r in results:
        assert abs(r["final_loss"] - math.log(500)) < 0.2 * math.log(500)
    assert "tiny   jax" in done.stdout and "vs torch" in done.stdout


def test_bench_devices_splits_the_global_batch_over_torch_processes(tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "train.commands.bench", "--presets", "tiny", "--backends", "torch", "--devices", "2",
         "--steps", "1", "--warmup", "1", "--batch-tokens", "256", "--length", "16", "--vocab-size", "500",
         "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    # torch DDP in 2 processes on the global 16 sentences (8 a process); JAX's mesh is the one
    # test_host_devices.py and test_distributed.py train on. Near-uniform predictions after 2 updates, as above.
    assert [(r["backend"], r["devices"], r["batch"]) for r in results] == [("torch", 2, [16, 16])]
    assert abs(results[0]["final_loss"] - math.log(500)) < 0.2 * math.log(500)
    assert "over 2 device(s)" in done.stdout


def assert_mfu(result: dict, flops: int) -> None:
    """MFU is the FLOPs counted here (not the result's own step_flops) per second of the median
    timed step, over the matmul peak. It is below 1: the peak is the best of ten 2048 x 2048
    products in the same process, and a tiny model's step (matmuls at most 500 columns wide, softmaxes,
    layer norms, Adam) does not run its matmuls faster than that (tiny reaches 0.37 at 32 x 32
    tokens in docs/performance.md's CPU table). A FLOP count, unit or time other than these fails."""
    expected = flops / result["median_step_s"] / 1e9 / result["matmul_peak_gflops"]
    assert result["mfu"] == pytest.approx(expected) and 0 < result["mfu"] < 1, result


@pytest.mark.parametrize("precision, jax_setting, torch_setting", [
    ("float32", "highest", "highest"), ("tf32", "tensorfloat32", "high"), ("bfloat16", "default", "highest"),
])
def test_each_precision_sets_both_frameworks_matmuls(precision, jax_setting, torch_setting):
    """float32 is TF32-off in both (JAX on a GPU would otherwise use TF32 by default), tf32 turns it
    on in both, bfloat16 leaves float32 matmuls at the defaults (its matmuls are bfloat16)."""
    import jax
    import torch

    before = jax.config.jax_default_matmul_precision, torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    try:
        benchmark.set_precision("jax", precision)
        benchmark.set_precision("torch", precision)
        assert jax.config.jax_default_matmul_precision == jax_setting
        assert torch.get_float32_matmul_precision() == torch_setting
        assert torch.backends.cudnn.allow_tf32 == (precision == "tf32")
    finally:
        jax.config.update("jax_default_matmul_precision", before[0])
        torch.set_float32_matmul_precision(before[1])
        torch.backends.cudnn.allow_tf32 = before[2]


@pytest.mark.skipif("AVX512" not in torch.backends.cpu.get_cpu_capability(),
                    reason="bfloat16 matmuls on this CPU run on torch's emulated path (no AVX-512): minutes a step")
def test_bench_measures_bfloat16_against_the_bfloat16_matmul_peak(tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "train.commands.bench", "--presets", "tiny", "--backends", "torch", "--precisions",
         "bfloat16", "--steps", "1", "--warmup", "1", "--batch-tokens", "128", "--length", "16", "--vocab-size", "300",
         "--json", str(out), "--plot", str(tmp_path / "bench.png")],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    [r] = json.loads(out.read_text())["results"]
    flops = tiny_step_flops(8, 16, 300)  # --batch-tokens 128 / --length 16: 8 sentences of 16 tokens
    assert r["precision"] == "bfloat16" and r["step_flops"] == flops
    assert_mfu(r, flops)
    assert abs(r["final_loss"] - math.log(300)) < 0.2 * math.log(300)  # near-uniform predictions, as above
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_arguments_are_refused_before_anything_runs():
    """Bench's own checks (status 1, the options' protocol) name the flag; in Python, the parameter."""
    for flags, says in ((["--precisions", "fp8"], "--precisions: unknown precision 'fp8'"),
                        (["--precisions", ","], "--precisions names nothing to measure"),
                        (["--devices", "3"], "--devices 3 does not divide the batch of 32 sentences")):
        done = subprocess.run([sys.executable, "-m", "train.commands.bench", *flags], cwd=REPO, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 1 and done.stderr.startswith(f"error: {says}"), done.stderr
    with pytest.raises(benchmark.OptionError, match="^devices 3 does not divide the batch of 32 sentences"):
        benchmark.Bench(devices=3)
    for where, says in ((str(REPO), "is a directory"), (str(REPO / "missing" / "b.json"), "does not exist")):
        done = subprocess.run([sys.executable, "-m", "train.commands.bench", "--json", where], cwd=REPO,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("command",
                         ["train.commands.profile_step", "parity.commands.check", "parity.commands.trajectory",
                          "parity.commands.translate_bench"])
def test_report_files_are_refused_before_the_work(command, tmp_path, capsys):
    """--json (--plot) a directory or in a missing one: a usage error while the flags are read, as aiayn bench's;
    these commands wrote them after the work (minutes of it), with a traceback."""
    import importlib

    parser = importlib.import_module(command).build_parser()
    runs = command == "parity.commands.translate_bench"  # the one of these that reads a run
    for where, says in ((tmp_path, "is a directory"), (tmp_path / "missing" / "r.json", "does not exist")):
        for flag in [f for f in ("--json", "--plot") if f in parser._option_string_actions]:
            with pytest.raises(SystemExit) as exited:
                parser.parse_args(["--run-dir", "RUN", flag, str(where)][0 if runs else 2:])
            err = capsys.readouterr().err
            assert exited.value.code == 2 and f"argument {flag}: {where}" in err and says in err


def test_profile_step_times_every_part_in_both_frameworks(tmp_path, capsys, monkeypatch):
    measured = {}  # the seconds each framework's timing returned, as profile_step's table must report them
    for name in ("jax_parts", "torch_parts"):
        def record(*args, _real=getattr(profile_step, name), _name=name, **kwargs):
            measured[_name] = _real(*args, **kwargs)
            return measured[_name]

        monkeypatch.setattr(profile_step, name, record)
    out = tmp_path / "parts.json"
    assert profile_step.main(["--preset", "tiny", "--batch", "4", "--length", "8", "--vocab", "300",
                              "--repeats", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["part"] for r in rows] == [
        "self-attention", "causal self-attention", "feed-forward", "encoder layer", "decoder layer",
        "embeddings (src + tgt)", "encoder (all layers)", "decoder (all layers)", "output projection + loss",
        "forward + backward", "adam update", "train step",
    ]
    for r in rows:  # each part's own times, in milliseconds, and JAX over torch (not the reverse)
        jax_s, torch_s = measured["jax_parts"][r["part"]], measured["torch_parts"][r["part"]]
        assert jax_s > 0 and torch_s > 0, r
        assert r["jax_ms"] == pytest.approx(1e3 * jax_s) and r["torch_ms"] == pytest.approx(1e3 * torch_s), r
        assert r["ratio"] == pytest.approx(jax_s / torch_s), r
    assert "JAX/torch" in capsys.readouterr().out


def test_xla_op_split_reports_matmuls_and_the_rest(capsys):
    assert profile_step.main(["--preset", "tiny", "--batch", "4", "--length", "8", "--vocab", "300", "--xla-ops"]) == 0
    out = capsys.readouterr().out
    times = {line[:18].strip(): float(line[18:].split()[0]) for line in out.splitlines()[1:]}
    assert set(times) == {"matmuls", "other operations"} and all(t > 0 for t in times.values())
