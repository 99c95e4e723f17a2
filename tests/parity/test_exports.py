"""ONNX and StableHLO exports (parity.onnx_export, parity.stablehlo_export) and the decoding over them
(train.interop.exported): a random model's searches through the exported programs give the reference's tokens
and scores; `aiayn convert` writes each from a run of either framework with its proof, and `train.load` of the
export translates as the run does."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import train
from torch_reference import decode
from torch_reference.config import TransformerConfig
from torch_reference.model import Transformer
from train import runtime

pytest.importorskip("onnxruntime")

from parity.onnx_export import write_onnx  # noqa: E402 (after the skip: the module needs the extra)
from parity.stablehlo_export import write_stablehlo  # noqa: E402
from train.interop.exported import ExportBackend, ExportedModel, OnnxPrograms, StableHloPrograms  # noqa: E402

# float32 graphs computing the reference's function with other kernels: summation order only (issue 78's bound).
LOGIT_TOL = 1e-5
CFG = TransformerConfig(src_vocab_size=48, tgt_vocab_size=48, d_model=32, num_heads=4, d_ff=64, num_encoder_layers=2,
                        num_decoder_layers=2, max_len=24)


@pytest.fixture(scope="module")
def random_exports(tmp_path_factory):
    """(reference model, {format: programs}) of one random 2+2-layer model: its outputs run to the length limit
    and vary from token to token, unlike a briefly trained model's."""
    torch.manual_seed(0)
    model = Transformer(CFG).eval()
    params = {k: v.numpy() for k, v in model.state_dict().items()}
    root = tmp_path_factory.mktemp("random-exports")
    (root / "onnx").mkdir()
    (root / "stablehlo").mkdir()
    write_onnx(params, CFG, root / "onnx", "int8")
    write_stablehlo(params, CFG, root / "stablehlo")
    return model, root, {"onnx": OnnxPrograms(root / "onnx"), "stablehlo": StableHloPrograms(root / "stablehlo")}


SRC = torch.tensor([[5, 6, 7, 8, 9, 3, 0, 0], [10, 11, 12, 13, 14, 15, 16, 3], [17, 3, 0, 0, 0, 0, 0, 0]])
TGT_IN = torch.tensor([[CFG.bos_id, 20, 21, 22, 23], [CFG.bos_id, 30, 3, 31, 32], [CFG.bos_id, 40, 41, 42, 3]])


@pytest.mark.parametrize("kind", ["onnx", "stablehlo"])
def test_exported_logits_and_searches_are_the_reference(random_exports, kind):
    model, _, programs = random_exports
    exported = ExportedModel(programs[kind], CFG)
    with torch.no_grad():
        assert (exported.forced_logits(SRC, TGT_IN) - model(SRC, TGT_IN)).abs().max() < LOGIT_TOL
    greedy, theirs = decode.greedy_search(model, SRC), decode.greedy_search(exported, SRC)
    assert torch.equal(greedy[0], theirs[0]) and (greedy[0] != CFG.pad_id).sum() > 20  # long, varied outputs
    torch.testing.assert_close(greedy[1], theirs[1], rtol=0, atol=1e-4)  # a sum of ~30 log-probs, each within 1e-5
    ours = decode.beam_search(model, SRC, 4, n_best=4)
    theirs = decode.beam_search(exported, SRC, 4, n_best=4)
    assert torch.equal(ours[0], theirs[0])
    torch.testing.assert_close(ours[2], theirs[2], rtol=0, atol=1e-4)


def test_int8_graphs_decode_close_to_float32(random_exports):
    model, root, _ = random_exports
    int8 = ExportedModel(OnnxPrograms(root / "onnx", int8=True), CFG)
    # threads spinning between runs would take the cores from the search's torch operations
    options = int8.programs.decoder.get_session_options()
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    with torch.no_grad():
        diff = (int8.forced_logits(SRC, TGT_IN) - model(SRC, TGT_IN)).abs().max()
    assert 0 < diff < 0.5  # quantized weights: not the same numbers, near them (logits here are about +-5)


def test_stablehlo_runs_with_jax_export_alone(random_exports, tmp_path):
    """The programs load and run in a process that imports jax and numpy only, never the model's code."""
    model, root, programs = random_exports
    script = f"""
import sys, numpy as np
from jax import export
d = {str(root / "stablehlo")!r}
encoder, step = (export.deserialize(bytearray(open(f"{{d}}/{{n}}", "rb").read())) for n in ("encoder.stablehlo",
                                                                                       "decoder_step.stablehlo"))
w = np.load(f"{{d}}/weights.npz"); weights = [w[f"w{{i}}"] for i in range(len(w.files))]
src = np.array({SRC.tolist()}, np.int32)
crosses = encoder.call(weights, src, (src != 0).astype(np.int32))
selfs = [np.zeros((3, {CFG.num_heads}, 4, {CFG.d_model // CFG.num_heads}), np.float32)] * 4
logits, _ = step.call(weights, np.full(3, {CFG.bos_id}, np.int32), selfs, crosses, np.int32(0),
                      (src != 0).astype(np.int32))
assert not [m for m in sys.modules if m.split(".")[0] in ("jax_transformer", "flax", "torch", "train")]
np.save({str(tmp_path / "logits.npy")!r}, np.asarray(logits))
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=600)
    with torch.no_grad():
        ours = model(SRC, torch.full((3, 1), CFG.bos_id))[:, 0].numpy()
    np.testing.assert_allclose(np.load(tmp_path / "logits.npy"), ours, rtol=0, atol=LOGIT_TOL)


def test_export_backend_n_best_and_refusals(random_exports):
    model, root, _ = random_exports
    backend = ExportBackend(OnnxPrograms(root / "onnx"), CFG, step=0)  # float32: the reference's numbers
    hyps = backend.translate(SRC.numpy(), beam_size=1, n_best=1)
    assert np.array_equal(hyps.tokens[:, 0], decode.greedy_search(model, SRC)[0].numpy())
    scores = backend.score(SRC.numpy(), hyps.tokens[:, 0])
    np.testing.assert_allclose(scores.sum(1), hyps.logprob[:, 0], rtol=0, atol=1e-4)  # a search's score is its logprob
    with pytest.raises(runtime.UserError, match="sampling"):
        backend.sample(SRC.numpy(), seed=0)


@pytest.fixture
def runs(tiny_torch_and_jax_runs):
    """The shared 2-step torch run and the same run converted to JAX: {"torch": dir, "jax": dir}; read only."""
    return dict(zip(("torch", "jax"), tiny_torch_and_jax_runs))


@pytest.mark.parametrize("kind,backend,extra", [("onnx", "jax", ["--quantization", "int8"]),
                                                ("stablehlo", "torch", [])])
def test_convert_writes_a_proved_export_that_translates(runs, kind, backend, extra, tmp_path):
    from parity.commands.convert import main as convert

    dst = tmp_path / f"{kind}-of-{backend}"
    assert convert(["--to", kind, "--src", str(runs[backend]), "--dst", str(dst), "--checkpoint", "latest",
                    *extra]) == 0
    proof = json.loads((dst / runtime.PROOF_FILE).read_text())
    assert proof["kind"] == kind and proof["step"] == 2 and proof["sentences"] == 4
    assert proof["float32"]["greedy_agreement"] == proof["float32"]["beam4_agreement"] == 1.0
    assert proof["max_abs_logit_diff"] <= proof["bounds"]["max_abs_logit_diff"] == LOGIT_TOL * proof["max_abs_logit"]
    assert proof["max_abs_logit"] >= 1
    assert set(proof["files"]) >= {"model.json", "tokenizer.json"} and ("int8" in proof) == bool(extra)
    texts = ["dreiundachtzig", "siebenhundertdreiundvierzig"]
    with train.load(runs[backend], "latest") as run, train.load(dst) as exported:
        assert exported.translate(texts, beam=4) == run.translate(texts, beam=4)
        assert exported.step == 2
        assert f"step 2, {kind} export, d_model" in repr(exported)  # what decodes, not the source's backend
        pairs = list(zip(texts, run.translate(texts, beam=1)))
        ours, theirs = (r.evaluate(pairs, beam=4) for r in (run, exported))  # aiayn evaluate over the export
        assert theirs["bleu"] == ours["bleu"]
        # float32 programs: logits within 1e-5, so the mean loss too; int8 weights move them by up to about 0.5
        assert abs(theirs["loss"] - ours["loss"]) < (1e-5 if kind == "stablehlo" else 0.5)
        if kind == "stablehlo":  # aiayn serve's app over the export: the run's translations
            httpx = pytest.importorskip("httpx")
            from train.serving import Limits, Server, app

            with Server(app(exported, Limits()), port=0).start() as server:
                reply = httpx.post(f"{server.url}/translate", json={"texts": texts, "beam": 4}, timeout=60)
                info = httpx.get(f"{server.url}/info", timeout=60).json()
            assert reply.json()["translations"] == run.translate(texts, beam=4)
            assert info["export"] == kind and info["step"] == 2  # /info says what decodes
    with pytest.raises(runtime.UserError, match=f"is a {kind} export: an ensemble"):
        train.load([dst, dst])
    name = next(n for n in proof["files"] if n.endswith((".onnx", ".stablehlo")))
    (dst / name).write_bytes((dst / name).read_bytes() + b"\0")
    with pytest.raises(runtime.UserError, match="changed since"):
        train.load(dst)


def test_translate_bench_adds_export_rows(runs, tmp_path):
    from parity.commands import translate_bench

    (tmp_path / "in.txt").write_text("dreiundachtzig\nsiebenhundertdreiundvierzig\nviertausendvierhundertzwei\n")
    assert translate_bench.main(["--run-dir", str(runs["torch"]), "--checkpoint", "latest", "--input",
                                 str(tmp_path / "in.txt"), "--beam", "2", "--no-uncached", "--exports", "--json",
                                 str(tmp_path / "bench.json")]) == 0
    rows = {(r["search"], r["beam"]): r for r in json.loads((tmp_path / "bench.json").read_text())["rows"]}
    for name in ("torch cached", "jax cached", "onnxruntime float32", "onnxruntime int8", "stablehlo"):
        for beam in (1, 2):
            row = rows[name, beam]
            assert row["sentences"] == 3 and row["seconds"] > 0 and row["disk_mib"] > 0
            assert row["differ"] in (0, None) or name.endswith("int8")  # float32: the run's search, same function
            assert row["tokens_differ_from_jax"] == 0 or name.endswith("int8")
            assert ("bleu_vs_float32" in row) == name.endswith("int8")
    with train.load(runs["torch"], "latest") as run:
        weights = 4 * sum(p.numel() for p in run.backend.model.parameters()) / 2**20
    # safetensors: the float32 weights and a header; orbax's tensorstore compresses them (zstd), a little here
    assert weights <= rows["torch cached", 1]["disk_mib"] < weights + 0.5
    assert weights / 2 < rows["jax cached", 1]["disk_mib"] < weights + 0.5
    assert rows["onnxruntime int8", 1]["disk_mib"] < rows["onnxruntime float32", 1]["disk_mib"]
