"""Every conversion `aiayn convert` makes, as one call: `convert(Conversion(...))`, over `train.interop`
(weights, runs, Marian) and `parity.ctranslate2`, each export proved by its own runtime (`parity.proof`)."""

from __future__ import annotations

from pathlib import Path

from train import checkpoints, data, runtime
from train.interop import marian
from train.interop.runs import (convert_run, load_jax_weights, load_torch_weights, run_weights, save_jax_weights,
                                save_torch_weights)
from train.interop.weights import FRAMEWORKS, jax_to_torch, torch_to_jax
from train.options import OptionError, checked, option

from . import ctranslate2 as ct2_export
from . import proof

EXPORTS = ("marian", "ctranslate2", "onnx", "stablehlo")


@checked
class Conversion:
    """What `convert` makes of what: weights (`src`) or a run (`run_dir`) into the other framework, a
    Marian model into a run (`source_format` "marian"), a run into Marian or CTranslate2 (`to`)."""

    to: str = option(None, "target: a framework (jax, torch), an HF Marian directory (marian: a run imported with "
                     "--from marian) or a CTranslate2 model directory (ctranslate2)", choices=(*FRAMEWORKS, *EXPORTS),
                     required=True)
    source_format: str | None = option(
        None, "import a pretrained model: --src is hf:ORG/NAME[@REVISION] (fetched into the Hugging Face cache; "
        "HF_HUB_OFFLINE=1 reads only the cache) or a local HF Marian directory (config.json, model.safetensors or "
        "pytorch_model.bin, source.spm, target.spm, vocab.json); --dst the run directory of the --to backend, which "
        "aiayn translate, aiayn evaluate and train.run --resume (fine-tuning) accept", choices=("marian",),
        flag="--from")
    src: str | None = option(
        None, "weights only: a .safetensors file (--to jax; a legacy torch.save state dict .pt/.pth/.bin with "
        "config.json beside it is read with weights_only=True) or a JAX weights directory (--to torch); with --from "
        "marian the HF directory; with --to an export (marian, ctranslate2, onnx, stablehlo) a run directory")
    run_dir: str | None = option(None, "instead of --src: a whole training run directory of the other backend "
                                 "(train.run --run-dir)")
    dst: Path = option(None, "a JAX weights directory (--to jax) or a .safetensors file (--to torch); with --run-dir "
                       "or --from the new run directory; with --to an export the model directory",
                       required=True)
    checkpoint: str | None = option(None, "with --run-dir: which checkpoints to convert: latest (default), best, all, "
                                    "or a step number; with --to an export: best (default), latest or a step")
    quantization: str | None = option(None, "with --to ctranslate2: CTranslate2's weight type, e.g. int8 (default: "
                                      "float32); with --to onnx: int8 adds ONNX Runtime's dynamically quantized "
                                      "graphs, which the export then decodes with")
    train: str | None = option(None, "with --from: the training data spec recorded in the run (train.run's data "
                               "specs), for fine-tuning with train.run --resume", metavar="SPEC")
    valid: str | None = option(None, "with --from: the validation data spec recorded in the run", metavar="SPEC")
    test: str | None = option(None, "with --from: the test data spec recorded in the run", metavar="SPEC")
    proof_sentences: str | None = option(
        None, "with --run-dir or --to an export: the sentences the result is checked on, read back by its own "
        f"runtime against the run (default: the run's first {proof.SENTENCES} validation sources); the figures go to "
        f"the export's {runtime.PROOF_FILE}", metavar="FILE")
    overwrite: bool = option(False, "replace an existing destination")

    def check(self) -> None:
        if (self.src is None) == (self.run_dir is None):
            raise OptionError("give {} or {}: what to convert", "src", "run_dir")
        reads_run = self.source_format is None and (self.run_dir is not None or self.to in EXPORTS)
        for name in ("checkpoint", "proof_sentences"):  # weights alone or an import have no checkpoints, no proof
            if getattr(self, name) is not None and not reads_run:
                raise OptionError("{} goes with {}, or with {} marian, ctranslate2, onnx or stablehlo", name,
                                  "run_dir", "to")
        if self.quantization is not None and self.to not in ("ctranslate2", "onnx"):
            raise OptionError("{} goes with {} ctranslate2 or onnx", "quantization", "to")
        if self.to == "onnx" and self.quantization not in (None, "float32", "int8"):
            raise OptionError("{} with {} onnx takes int8 or float32, " + f"got {self.quantization!r}", "quantization",
                              "to")
        if self.source_format is None and (self.train or self.valid or self.test):
            raise OptionError("{}/{}/{} go with {}", "train", "valid", "test", "source_format")
        if self.source_format is not None and self.to not in FRAMEWORKS:
            raise OptionError("{} marian imports into a run of {} jax or {} torch", "source_format", "to", "to")
        which = self.checkpoint or "latest"
        if self.run_dir is not None and which not in ("latest", "best", "all") and not which.isdigit():
            raise OptionError("{} takes latest, best, all or a step number, " + f"got {which!r}", "checkpoint")


def convert(c: Conversion) -> str:
    """Make what `c` asks for; what was written, in a line or two."""
    dst = Path(c.dst)
    if dst.exists() and not c.overwrite and not (dst.is_dir() and not any(dst.iterdir())):
        raise OptionError("{dst} exists; pass {} to replace it", "overwrite", dst=dst)  # an empty one: nothing lost
    if c.source_format is None and c.to in FRAMEWORKS and c.run_dir is None:
        _check_weights_destination(Path(c.src), dst, c.to)  # before any work, so nothing is left half-made
        if c.to == "jax":
            save_jax_weights(torch_to_jax(*load_torch_weights(c.src)), dst, overwrite=c.overwrite)
        else:
            save_torch_weights(jax_to_torch(load_jax_weights(c.src)), dst)
        return f"wrote {dst}"
    src = c.src or c.run_dir
    if c.source_format is None and c.to in FRAMEWORKS:
        sentences = proof.proof_sentences(src, c.proof_sentences)
        done = convert_run(src, dst, to=c.to, which=c.checkpoint or "latest", overwrite=c.overwrite,
                           check=lambda tmp: proof.run_proof(tmp, Path(src), sentences))
        return (f"wrote {dst}: the {done['backend']} run of {done['from']} (checkpoint step "
                f"{', '.join(map(str, done['steps']))}); {_proved(dst, 'the source')}\n"
                f"continue it with: python -m train.run --run-dir {dst} --resume")
    runtime.check_destination(dst, c.overwrite, "run" if c.source_format else c.to, src)
    if c.source_format == "marian":
        done = marian.import_marian(src, dst, to=c.to, train=c.train, valid=c.valid, test=c.test, overwrite=c.overwrite)
        cfg, revision = done["config"], f" at revision {done['revision']}" if "revision" in done else ""
        return (f"wrote {dst}: the {c.to} run of {src}{revision} ({cfg.num_encoder_layers}+{cfg.num_decoder_layers} "
                f"layers, d_model {cfg.d_model}, vocab {cfg.src_vocab_size}/{cfg.tgt_vocab_size}, step 0)\n"
                f"translate with: aiayn translate --run-dir {dst}")
    sentences = proof.proof_sentences(src, c.proof_sentences)
    params, cfg = run_weights(src, checkpoints.parse_checkpoint(c.checkpoint or "best"))
    if c.to == "marian":
        ids = marian.marian_origin(src)["marian_ids"]
        marian.export_marian(src, params, cfg, dst, overwrite=c.overwrite,
                             check=lambda tmp: proof.marian_proof(tmp, Path(src), params, cfg, sentences, ids))
    elif c.to in ("onnx", "stablehlo"):
        from .onnx_export import write_onnx
        from .stablehlo_export import write_stablehlo

        write = {"onnx": lambda d: write_onnx(params, cfg, d, c.quantization), "stablehlo": lambda d: write_stablehlo(
            params, cfg, d)}[c.to]
        copy = (*data.tokenizer_files(src), runtime.MODEL_FILE, runtime.CONFIG_FILE)  # what train.load(dst) reads
        with runtime.derive(src, dst, c.to, c.overwrite, copy, lambda tmp: proof.export_proof(
                tmp, Path(src), c.checkpoint or "best", sentences, c.to, c.quantization)) as tmp:
            write(tmp)
    else:
        ct2_export.export_ctranslate2(
            src, params, cfg, dst, quantization=c.quantization, force=c.overwrite,
            check=lambda tmp: proof.ctranslate2_proof(tmp, Path(src), params, cfg, sentences, c.quantization))
    return f"wrote {dst}: {_proved(dst, 'the run')}"


def _proved(dst: Path, whose: str) -> str:
    """What the proof written into `dst` found, against `whose` translations."""
    checked = runtime.read_json(dst / runtime.PROOF_FILE)
    return (f"{checked['greedy_agreement']:.1%} of {checked['sentences']} greedy translations equal {whose}'s, "
            f"logits within {checked['max_abs_logit_diff']:.1e} ({runtime.PROOF_FILE})")


def _check_weights_destination(src: Path, dst: Path, to: str) -> None:
    """UserError where `dst` cannot receive the converted weights of `src`: the source itself, a destination of
    the other kind (a directory for a file, or the reverse), a directory holding other files (never replaced)."""
    if dst.exists() and src.exists() and dst.resolve() == src.resolve():
        raise OptionError("{} {dst} is the source; write the converted weights elsewhere", "dst", dst=dst)
    if to == "torch" and dst.is_dir():
        raise OptionError("{} {dst} is a directory; {} torch writes a .safetensors file", "dst", "to", dst=dst)
    if to == "jax" and dst.exists() and not dst.is_dir():
        raise OptionError("{} {dst} is a file; {} jax writes a weights directory (params/ and config.json)", "dst",
                          "to", dst=dst)
    if to == "jax" and dst.is_dir():
        if others := sorted(p.name for p in dst.iterdir() if p.name not in ("params", "config.json")):
            raise OptionError("{} {dst} holds other files ({others}); it is never replaced", "dst", dst=dst,
                              others=", ".join(others[:3]))

