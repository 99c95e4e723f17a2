"""A run as a CTranslate2 model through CTranslate2's own spec classes (docs/interop.md#ctranslate2-out)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from torch_reference.config import BOS_ID, EOS_ID, PAD_ID, SPECIAL_TOKENS, UNK_ID, TransformerConfig
from torch_reference.model import sinusoidal_positions
from train import data, runtime
from train.data import spm
from train.translate.attention import output_tokens


def vocabulary(tokenizer, size: int) -> list[str]:
    """Token strings by id: the special names, then the tokenizer's tokens (unique, as CTranslate2 needs)."""
    tokens = list(SPECIAL_TOKENS) + [tokenizer.id_to_token(i) or f"<id{i}>" for i in range(len(SPECIAL_TOKENS), size)]
    seen: set[str] = set()
    for i, t in enumerate(tokens):  # a repeated token (e.g. a copied special row) gets a name of its own
        tokens[i] = f"<dup{i}>" if t in seen else t
        seen.add(tokens[i])
    return tokens


def build_spec(params: Mapping[str, np.ndarray], cfg: TransformerConfig, src_tokens: Sequence[str],
               tgt_tokens: Sequence[str]):
    """A `ctranslate2.specs.TransformerSpec` holding `params` (our torch layout, float32)."""
    spm.require("ctranslate2")
    from ctranslate2.specs import common_spec, transformer_spec

    activations = {"relu": common_spec.Activation.RELU, "gelu": common_spec.Activation.GELU,
                   "silu": common_spec.Activation.SWISH, "swiglu": common_spec.Activation.SWISH}
    if cfg.activation not in activations:
        raise ValueError(f"CTranslate2 has no counterpart of activation={cfg.activation!r}")
    # Copies: CTranslate2 quantizes the spec's arrays in place, which would change the caller's weights.
    p = {k: np.array(v, dtype=np.float32, order="C") for k, v in params.items()}
    pre_norm = cfg.norm_position == "pre"
    spec = transformer_spec.TransformerSpec.from_config(
        (cfg.num_encoder_layers, cfg.num_decoder_layers), cfg.num_heads, pre_norm=pre_norm,
        activation=activations[cfg.activation], ffn_glu=cfg.activation == "swiglu", rms_norm=cfg.norm == "rmsnorm")

    def linear(target, *names):  # several: fused, as CTranslate2 stores q, k, v
        target.weight = np.concatenate([p[f"{n}.weight"] for n in names])
        if f"{names[0]}.bias" in p:
            target.bias = np.concatenate([p[f"{n}.bias"] for n in names])

    def norm(target, name):
        target.gamma = p[f"{name}.weight"]
        if cfg.norm == "layernorm":
            target.beta = p[f"{name}.bias"]

    def attention(target, name, self_attention):
        q, k, v = (f"{name}.{x}_proj" for x in "qkv")
        for linear_spec, names in zip(target.linear, [[q, k, v]] if self_attention else [[q], [k, v]]):
            linear(linear_spec, *names)
        linear(target.linear[-1], f"{name}.out_proj")
        norm(target.layer_norm, f"{name}_norm")

    tgt_embed = p["src_embed.weight" if cfg.share_embeddings else "tgt_embed.weight"]
    sinusoids = sinusoidal_positions(cfg.max_len, cfg.d_model, halves=cfg.positions == "sinusoidal_halves").numpy()
    learned = cfg.positions == "learned"
    for stack, target in (("encoder", spec.encoder), ("decoder", spec.decoder)):
        target.scale_embeddings = float(np.sqrt(cfg.d_model)) if cfg.scale_embeddings else 1.0
        target.position_encodings.encodings = p[f"{stack}.positions.embedding.weight"] if learned else sinusoids
        if pre_norm:
            norm(target.layer_norm, f"{stack}.norm")
        for i, layer in enumerate(target.layer):
            name = f"{stack}.layers.{i}"
            attention(layer.self_attention, f"{name}.self_attn", True)
            if stack == "decoder":
                attention(layer.attention, f"{name}.cross_attn", False)
            linear(layer.ffn.linear_0, f"{name}.ff.linear1")
            linear(layer.ffn.linear_1, f"{name}.ff.linear2")
            if cfg.activation == "swiglu":
                linear(layer.ffn.linear_0_noact, f"{name}.ff.linear_gate")
            norm(layer.ffn.layer_norm, f"{name}.ff_norm")
    spec.encoder.embeddings[0].weight = p["src_embed.weight"]
    spec.decoder.embeddings.weight = tgt_embed
    spec.decoder.projection.weight = tgt_embed if cfg.tie_output else p["out_proj.weight"]
    bias = p.get("logits_bias", np.zeros(cfg.tgt_vocab_size, np.float32)).copy()
    bias[[PAD_ID, BOS_ID]] -= 1e9  # never emitted: far below any logit, finite (no inf - inf)
    spec.decoder.projection.bias = bias

    spec.config.layer_norm_epsilon = cfg.layer_norm_eps
    spec.config.unk_token, spec.config.bos_token = SPECIAL_TOKENS[UNK_ID], SPECIAL_TOKENS[BOS_ID]
    spec.config.eos_token, spec.config.decoder_start_token = SPECIAL_TOKENS[EOS_ID], SPECIAL_TOKENS[BOS_ID]
    spec.register_source_vocabulary(list(src_tokens))
    spec.register_target_vocabulary(list(tgt_tokens))
    return spec


def export_ctranslate2(run_dir: str | os.PathLike, params: Mapping[str, np.ndarray], cfg: TransformerConfig,
                       dst: str | os.PathLike, quantization: str | None = None, force: bool = False,
                       check: Callable[[Path], object] | None = None) -> Path:
    """Weights `params` of the run `run_dir` -> a CTranslate2 model with its tokenizers at `dst` once `check` passes."""
    ctranslate2 = spm.require("ctranslate2")
    tokenizers = data.load_tokenizers(run_dir)
    src_tokens = vocabulary(tokenizers.src, cfg.src_vocab_size)
    tgt_tokens = vocabulary(tokenizers.tgt, cfg.tgt_vocab_size)

    class RunConverter(ctranslate2.converters.Converter):
        def _load(self):
            return build_spec(params, cfg, src_tokens, tgt_tokens)

    copy = (*data.tokenizer_files(run_dir), runtime.MODEL_FILE)
    with runtime.derive(run_dir, dst, "ctranslate2", force, copy, check) as tmp:
        RunConverter().convert(str(tmp), quantization=quantization, force=True)  # tmp exists, empty
    return Path(dst)


def tokens(vocab: Sequence[str], ids: Sequence[int]) -> list[str]:
    """Our ids of one sentence -> CTranslate2's tokens (up to and with the first <eos>)."""
    return [vocab[i] for i in output_tokens(ids)]


def same_output(ours: Sequence[int], theirs: Sequence[int], limit: int) -> bool:
    """Whether CTranslate2's ids are ours for a sentence of length limit `limit` (ours may force <eos> at it)."""
    ours, theirs = list(ours), list(theirs)
    if len(ours) == limit and ours[-1:] == [EOS_ID]:
        return theirs[: limit - 1] == ours[:-1]
    return theirs == ours


class CT2Translator:
    """A CTranslate2 model directory written by `export_ctranslate2`, fed and read in our ids."""

    def __init__(self, model_dir: str | os.PathLike, **options: Any):
        """`options`: `ctranslate2.Translator`'s (device, compute_type, intra_threads, ...)."""
        ctranslate2 = spm.require("ctranslate2")
        self.model_dir = Path(model_dir)
        runtime.check_export(self.model_dir)
        self.translator = ctranslate2.Translator(str(model_dir), **options)
        names = ("shared", "shared") if (self.model_dir / "shared_vocabulary.json").is_file() else ("source", "target")
        self.src_vocab, self.tgt_vocab = (runtime.read_json(self.model_dir / f"{n}_vocabulary.json") for n in names)
        self.tgt_ids = {t: i for i, t in enumerate(self.tgt_vocab)}

    def translate_ids(self, src_ids: Sequence[Sequence[int]], beam_size: int = 1, max_len: int = 256,
                      length_penalty: float = 1.0) -> list[list[int]]:
        """Source ids (each ending with <eos>, padding ignored) -> output ids ending with <eos>."""
        results = self.translator.translate_batch(
            [tokens(self.src_vocab, row) for row in src_ids], beam_size=beam_size, max_decoding_length=max_len,
            min_decoding_length=0, length_penalty=length_penalty, return_end_token=True)
        return [[self.tgt_ids[t] for t in r.hypotheses[0]] for r in results]
