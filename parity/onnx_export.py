"""A trained run as ONNX (`aiayn convert --to onnx`): the torch twin's encoder and cached decoder step through
`torch.onnx.export`, in Optimum's Marian layout (docs/interop.md#deploying). Not jax2onnx: the version that keeps
this project's JAX fails on the Flax model (docs/interop.md#deploying says how)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from torch import nn

from torch_reference.config import TransformerConfig
from torch_reference.model import Transformer
from train.data import spm
from train.interop.exported import ONNX_FILES, quantized

OPSET = 17


class _Encoder(nn.Module):
    """input_ids, attention_mask (B, S) -> memory (B, S, D) and each decoder layer's cross-attention keys, values."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        memory = self.model.encode(input_ids, (attention_mask != 0)[:, None, None, :])
        return memory, *(a for layer in self.model.decoder.layers for a in layer.cross_attn.project_kv(memory))


class _DecoderStep(nn.Module):
    """`Transformer.decode_step` with the self-attention cache concatenated (its length is the position), not
    written in place: input_ids (N, 1), encoder_attention_mask (N, S), per layer past decoder key, value
    (N, H, t, K) and encoder key, value (N, H, S, K) -> logits (N, 1, V), per layer present decoder key, value."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, input_ids, encoder_attention_mask, *past):
        model, presents = self.model, []
        mask = (encoder_attention_mask != 0)[:, None, None, :]
        position = torch.zeros_like(input_ids) + past[0].shape[2]  # (N, 1): the length of the past
        x = model.decoder.positions(model.target_embedding(input_ids) * model.embed_scale, positions=position)
        for i, layer in enumerate(model.decoder.layers):
            past_k, past_v, cross_k, cross_v = past[4 * i: 4 * i + 4]

            def self_attn(h, layer=layer, past_k=past_k, past_v=past_v):
                k, v = layer.self_attn.project_kv(h)
                presents.extend((torch.cat([past_k, k], 2), torch.cat([past_v, v], 2)))
                return layer.self_attn(h, None, None, kv=tuple(presents[-2:]))

            x = layer.residual(x, layer.self_attn_norm, self_attn)
            x = layer.residual(x, layer.cross_attn_norm,
                               lambda h, layer=layer, kv=(cross_k, cross_v): layer.cross_attn(h, None, mask, kv=kv))
            x = layer.residual(x, layer.ff_norm, layer.ff)
        return model.project(x if model.decoder.norm is None else model.decoder.norm(x)), *presents


def _names(cfg: TransformerConfig, prefix: str, side: str) -> list[str]:
    return [f"{prefix}.{i}.{side}.{w}" for i in range(cfg.num_decoder_layers) for w in ("key", "value")]


def write_onnx(params: Mapping[str, np.ndarray], cfg: TransformerConfig, directory: Path,
               quantization: str | None = None) -> None:
    """The two graphs of `params` (torch layout) into `directory`; "int8": `*_quantized.onnx` copies beside them."""
    spm.require("onnx", "export")
    model = Transformer(cfg).eval()
    model.load_state_dict({k: torch.from_numpy(np.asarray(v, np.float32)) for k, v in params.items()})
    H, K, N, S, t = cfg.num_heads, cfg.d_model // cfg.num_heads, 2, 5, 3  # example sizes, every one dynamic
    ids, mask = torch.full((N, S), 4), torch.ones(N, S, dtype=torch.long)
    batch, src, past = {0: "batch_size"}, "encoder_sequence_length", "past_decoder_sequence_length"
    crosses, selfs = _names(cfg, "present", "encoder"), _names(cfg, "present", "decoder")
    past_selfs, past_crosses = _names(cfg, "past_key_values", "decoder"), _names(cfg, "past_key_values", "encoder")
    inputs = [n for pair in zip(past_selfs[::2], past_selfs[1::2], past_crosses[::2], past_crosses[1::2]) for n in pair]
    graphs = [  # (module, example inputs, input names, output names, dynamic axes)
        (_Encoder(model), (ids, mask), ["input_ids", "attention_mask"], ["last_hidden_state", *crosses],
         {"input_ids": {0: "batch_size", 1: src}, "attention_mask": {0: "batch_size", 1: src},
          "last_hidden_state": {0: "batch_size", 1: src}, **{n: {0: "batch_size", 2: src} for n in crosses}}),
        (_DecoderStep(model), (ids[:, :1], mask, *(torch.randn(N, H, t if ".decoder." in n else S, K) for n in inputs)),
         ["input_ids", "encoder_attention_mask", *inputs], ["logits", *selfs],
         {"input_ids": batch, "encoder_attention_mask": {0: "batch_size", 1: src}, "logits": batch,
          **{n: {0: "batch_size", 2: past if ".decoder." in n else src} for n in inputs},
          **{n: {0: "batch_size", 2: f"{past} + 1"} for n in selfs}}),
    ]
    with torch.no_grad():
        for name, (module, args, input_names, output_names, axes) in zip(ONNX_FILES, graphs):
            torch.onnx.export(module, args, str(directory / name), dynamo=False, opset_version=OPSET,
                              input_names=input_names, output_names=output_names, dynamic_axes=axes)
    if quantization == "int8":
        from onnxruntime.quantization import QuantType, quantize_dynamic

        logging.disable(logging.WARNING)  # its advice to pre-process, on the root logger, once a graph
        try:
            for name in ONNX_FILES:
                quantize_dynamic(directory / name, directory / quantized(name), weight_type=QuantType.QInt8)
        finally:
            logging.disable(logging.NOTSET)

