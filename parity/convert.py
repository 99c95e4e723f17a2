"""`python -m parity.convert`: weights, training runs and pretrained models between formats.

Weights and training runs between the frameworks (`train.interop.weights`, `train.interop.runs`); with
the `interop` extra an HF Marian directory becomes a run, an imported run goes back to one
(`train.interop.marian`), and any run becomes a CTranslate2 model (`parity.ctranslate2`). Examples:
docs/interop.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from train import runtime, store
from train.interop import marian
from train.interop.runs import (convert_run, load_jax_weights, load_torch_weights, run_weights, save_jax_weights,
                                save_torch_weights)
from train.interop.weights import FRAMEWORKS, jax_to_torch, torch_to_jax
from train.store import CheckpointError

from . import ctranslate2 as ct2_export
from . import proof


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m parity.convert",
        description="Convert Transformer weights between the PyTorch reference (safetensors) and the "
        "Flax mirror (orbax checkpoint directory). The config travels with the weights; every key and "
        "shape is checked strictly. With --run-dir: convert a whole training run of `train.run` (weights, "
        "Adam moments, step and schedule position, data position, tokenizer, config) to the other "
        "backend, so that `python -m train.run --run-dir DST --resume` continues it there.",
        epilog="examples:\n  python -m parity.convert --to jax --src model.safetensors --dst jax_ckpt/\n"
        "  python -m parity.convert --to torch --src jax_ckpt/ --dst model.safetensors\n"
        "  python -m parity.convert --to torch --run-dir runs/jax-numbers --dst runs/torch-numbers\n"
        "  python -m train.run --run-dir runs/torch-numbers --resume --steps 1600",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--to", required=True, choices=["jax", "torch", "marian", "ctranslate2"],
                        help="target: a framework (jax, torch), an HF Marian directory (marian: a run imported with "
                        "--from marian) or a CTranslate2 model directory (ctranslate2)")
    parser.add_argument("--from", dest="source_format", choices=["marian"],
                        help="import a pretrained model: --src is hf:ORG/NAME[@REVISION] (fetched into the Hugging Face "
                        "cache; HF_HUB_OFFLINE=1 reads only the cache) or a local HF Marian directory (config.json, "
                        "model.safetensors or pytorch_model.bin, source.spm, target.spm, vocab.json); --dst the run "
                        "directory of the --to backend, which train.translate, train.evaluate and train.run --resume "
                        "(fine-tuning) accept")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--src", help="weights only: a .safetensors file (--to jax; a legacy torch.save state dict "
                        ".pt/.pth/.bin with config.json beside it is read with weights_only=True) or a JAX weights "
                        "directory (--to torch); with --from marian the HF directory; with --to marian or "
                        "ctranslate2 a run directory")
    source.add_argument("--run-dir", help="a whole training run directory of the other backend (train.run --run-dir)")
    parser.add_argument("--dst", required=True, help="a JAX weights directory (--to jax) or a .safetensors file "
                        "(--to torch); with --run-dir or --from the new run directory; with --to marian or "
                        "ctranslate2 the model directory")
    parser.add_argument("--checkpoint", help="with --run-dir: which checkpoints to convert: latest (default), best, "
                        "all, or a step number; with --to marian or ctranslate2: best (default), latest or a step")
    parser.add_argument("--quantization", help="with --to ctranslate2: CTranslate2's weight type, e.g. int8 "
                        "(default: float32)")
    for name in ("train", "valid", "test"):
        parser.add_argument(f"--{name}", metavar="SPEC", help=f"with --from: the {name} data spec recorded in the run "
                            "(train.run's data specs), for fine-tuning with train.run --resume")
    parser.add_argument("--proof-sentences", metavar="FILE",
                        help="with --run-dir or --to marian/ctranslate2: the sentences the result is checked on, read "
                        f"back by its own runtime against the run (default: the run's first {proof.SENTENCES} "
                        f"validation sources); the figures go to the export's {proof.PROOF_FILE}")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing destination")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)

    dst = Path(args.dst)
    # A refused destination is a file problem (1), not a flag's (2); an empty directory holds nothing to replace.
    if dst.exists() and not args.overwrite and not (dst.is_dir() and not any(dst.iterdir())):
        parser.exit(1, f"error: {dst} exists; pass --overwrite to replace it\n")
    reads_run = args.source_format is None and (args.run_dir is not None or args.to in ("marian", "ctranslate2"))
    for flag, value in (("--checkpoint", args.checkpoint), ("--proof-sentences", args.proof_sentences)):
        if value is not None and not reads_run:  # weights alone or an import have no checkpoints, no proof
            parser.error(f"{flag} goes with --run-dir, or with --to marian or ctranslate2")
    try:
        if args.source_format is not None or args.to in ("marian", "ctranslate2"):
            return _interop_cli(parser, args)
        if args.quantization is not None or any(getattr(args, n) for n in ("train", "valid", "test")):
            parser.error("--quantization goes with --to ctranslate2; --train/--valid/--test with --from")
        if args.src is not None and (problem := _weights_destination_problem(Path(args.src), dst, args.to)):
            parser.exit(1, f"error: {problem}\n")  # checked before any work, so nothing is left half-made
        if args.run_dir is not None:
            return _convert_run_cli(parser, args)
        if args.to == "jax":
            state_dict, cfg = load_torch_weights(args.src)
            save_jax_weights(torch_to_jax(state_dict, cfg), dst, overwrite=args.overwrite)
        else:
            save_torch_weights(jax_to_torch(load_jax_weights(args.src)), dst)
    except (FileExistsError, ImportError, OSError, ValueError, RuntimeError, CheckpointError, runtime.UserError) as err:
        parser.exit(1, f"error: {runtime.error_text(err)}\n")  # OSError: a full disk, a read-only place
    print(f"wrote {dst}")
    return 0


def _weights_destination_problem(src: Path, dst: Path, to: str) -> str | None:
    """Why `dst` cannot receive the converted weights of `src` (None: it can): the source itself,
    a destination of the other kind (a directory for a file, a file for a directory), or a
    directory holding files that are not JAX weights (never replaced)."""
    if dst.exists() and src.exists() and dst.resolve() == src.resolve():
        return f"--dst {dst} is the source; write the converted weights elsewhere"
    if to == "torch":
        return f"--dst {dst} is a directory; --to torch writes a .safetensors file" if dst.is_dir() else None
    if dst.exists() and not dst.is_dir():
        return f"--dst {dst} is a file; --to jax writes a weights directory (params/ and config.json)"
    if dst.is_dir():
        others = sorted(p.name for p in dst.iterdir() if p.name not in ("params", "config.json"))
        if others:
            return f"--dst {dst} holds other files ({', '.join(others[:3])}); it is never replaced"
    return None


def _interop_cli(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """--from marian, --to marian, --to ctranslate2 (errors: main's)."""
    src = args.src or args.run_dir
    if args.source_format is not None and args.to not in FRAMEWORKS:
        parser.error(f"--from {args.source_format} imports into a run of --to jax or --to torch")
    if args.quantization is not None and args.to != "ctranslate2":
        parser.error("--quantization goes with --to ctranslate2")
    if args.source_format is None and any(getattr(args, n) for n in ("train", "valid", "test")):
        parser.error("--train/--valid/--test go with --from")
    runtime.check_destination(Path(args.dst), args.overwrite, "run" if args.source_format else args.to, src)
    if args.source_format == "marian":
        done = marian.import_marian(
            src, args.dst, to=args.to, train=args.train, valid=args.valid, test=args.test, overwrite=args.overwrite)
        cfg = done["config"]
        revision = f" at revision {done['revision']}" if "revision" in done else ""
        print(f"wrote {done['run_dir']}: the {args.to} run of {src}{revision} ({cfg.num_encoder_layers}+{cfg.num_decoder_layers} "
              f"layers, d_model {cfg.d_model}, vocab {cfg.src_vocab_size}/{cfg.tgt_vocab_size}, step 0)")
        print(f"translate with: python -m train.translate --run-dir {done['run_dir']}")
        return 0
    sentences = proof.proof_sentences(src, args.proof_sentences)
    params, cfg = run_weights(src, store.parse_checkpoint(args.checkpoint or "best"))
    if args.to == "marian":
        ids = marian.marian_origin(src)["marian_ids"]
        marian.export_marian(src, params, cfg, args.dst, overwrite=args.overwrite,
                             check=lambda tmp: proof.marian_proof(tmp, Path(src), params, cfg, sentences, ids))
    else:
        ct2_export.export_ctranslate2(
            src, params, cfg, args.dst, quantization=args.quantization, force=args.overwrite,
            check=lambda tmp: proof.ctranslate2_proof(tmp, Path(src), params, cfg, sentences, args.quantization))
    checked = runtime.read_json(Path(args.dst) / proof.PROOF_FILE)
    print(f"wrote {args.dst}: {checked['greedy_agreement']:.1%} of {checked['sentences']} greedy translations equal "
          f"the run's, logits within {checked['max_abs_logit_diff']:.1e} ({proof.PROOF_FILE})")
    return 0


def _convert_run_cli(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """--run-dir (errors: main's)."""
    which = args.checkpoint or "latest"
    if which not in ("latest", "best", "all") and not which.isdigit():
        parser.error(f"--checkpoint takes latest, best, all or a step number, got {which!r}")
    sentences = proof.proof_sentences(args.run_dir, args.proof_sentences)
    done = convert_run(args.run_dir, args.dst, to=args.to, which=which, overwrite=args.overwrite,
                       check=lambda tmp: proof.run_proof(tmp, Path(args.run_dir), sentences))
    steps = ", ".join(map(str, done["steps"]))
    checked = runtime.read_json(Path(args.dst) / proof.PROOF_FILE)
    print(f"wrote {done['run_dir']}: the {done['backend']} run of {done['from']} (checkpoint step {steps}); "
          f"{checked['greedy_agreement']:.1%} of {checked['sentences']} greedy translations equal the source's, "
          f"logits within {checked['max_abs_logit_diff']:.1e} ({proof.PROOF_FILE})")
    print(f"continue it with: python -m train.run --run-dir {done['run_dir']} --resume")
    return 0


if __name__ == "__main__":
    sys.exit(runtime.exit_status(main))
