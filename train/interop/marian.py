"""HF Marian (OPUS-MT) models in and out (`aiayn convert --from/--to marian`, docs/interop.md)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torch_reference.config import BOS_ID, EOS_ID, PAD_ID, SPECIAL_TOKENS, UNK_ID, TransformerConfig
from torch_reference.model import Transformer, sinusoidal_positions

from .. import data, runtime
from ..backends import create_backend
from ..checkpoints import CheckpointMismatchError, TrainingState, check_keys
from ..config import DERIVED_MODEL_FIELDS, SPECIAL_ID_FIELDS, ExperimentConfig
from ..data import spm
from .weights import convert_state, read_state_dict

MARIAN_FORMAT = "marian"
# Our layer submodule -> HF's, inside encoder.layers.N / decoder.layers.N.
LAYER_NAMES = {"self_attn": "self_attn", "self_attn_norm": "self_attn_layer_norm",
               "cross_attn": "encoder_attn", "cross_attn_norm": "encoder_attn_layer_norm",
               "ff.linear1": "fc1", "ff.linear2": "fc2", "ff_norm": "final_layer_norm"}
ACTIVATIONS = {"swish": "silu", "silu": "silu", "relu": "relu", "gelu": "gelu"}  # HF ACT2FN name -> ours
HF_LAYER_NORM_EPS = 1e-5  # MarianEncoderLayer/MarianDecoderLayer: nn.LayerNorm(d_model), torch's default eps
POSITION_TOLERANCE = 1e-6  # a stored sinusoid table vs ours: float64 tables rounded once to float32 agree to ~1 ulp
HUB_PREFIX = "hf:"  # hf:ORG/NAME[@REVISION]: a Marian model on the Hugging Face hub
HUB_FILES = ["config.json", "model.safetensors", "pytorch_model.bin", "*.spm", "*vocab.json", "tokenizer_config.json"]
# tied to a parameter the state dict fills (the shared embedding), so load_state_dict reports them missing
TIED_KEYS = ("lm_head.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight")


class UnsupportedMarianConfig(ValueError):
    """A Marian config this project's Transformer cannot represent (the message names the field)."""


def _refuse(field: str, value: Any, why: str) -> None:
    raise UnsupportedMarianConfig(f"cannot import this Marian model: {field}={value!r} ({why})")


def marian_config(hf: Mapping[str, Any]) -> TransformerConfig:
    """The TransformerConfig computing what MarianMTModel computes for config.json `hf`; UnsupportedMarianConfig."""
    get = hf.get
    if get("model_type", MARIAN_FORMAT) != MARIAN_FORMAT:
        _refuse("model_type", get("model_type"), "only model_type 'marian' is read")
    # Fields of Marian-NMT configs that HF's MarianMTModel ignores, but that the original model used.
    for field, why in (("normalize_before", "pre-norm layers"), ("normalize_embedding", "a layer norm on the embeddings"),
                       ("add_final_layer_norm", "a layer norm after each stack"),
                       ("layernorm_embedding", "a layer norm on the embeddings")):
        if get(field):
            _refuse(field, get(field), f"{why}: MarianMTModel has none, this project's post-norm model neither")
    if get("static_position_embeddings", True) is False:
        _refuse("static_position_embeddings", False, "learned positions in Marian's layout")
    for ours, (enc, dec), default in (("d_ff", ("encoder_ffn_dim", "decoder_ffn_dim"), 4096),
                                      ("num_heads", ("encoder_attention_heads", "decoder_attention_heads"), 16)):
        if get(enc, default) != get(dec, default):
            _refuse(dec, get(dec, default), f"differs from {enc}={get(enc, default)}; this model has one {ours}")
    activation = get("activation_function", "gelu")
    if activation not in ACTIVATIONS:
        _refuse("activation_function", activation, f"supported: {', '.join(ACTIVATIONS)}")
    for field in ("encoder_layerdrop", "decoder_layerdrop"):
        if get(field, 0.0):
            _refuse(field, get(field), "this model has no such dropout; fine-tuning would differ")
    share = bool(get("share_encoder_decoder_embeddings", True))
    vocab = get("vocab_size", 58101)
    tgt_vocab = get("decoder_vocab_size") or vocab
    if share and tgt_vocab != vocab:
        _refuse("decoder_vocab_size", tgt_vocab, f"differs from vocab_size={vocab} with shared embeddings")
    if get("decoder_start_token_id", get("pad_token_id")) is None or get("pad_token_id", 58100) is None:
        _refuse("pad_token_id", None, "the model needs a pad id")
    try:
        return TransformerConfig(
            src_vocab_size=vocab + 1, tgt_vocab_size=tgt_vocab + 1, d_model=get("d_model", 1024),
            num_heads=get("encoder_attention_heads", 16), d_ff=get("encoder_ffn_dim", 4096),
            num_encoder_layers=get("encoder_layers", 12), num_decoder_layers=get("decoder_layers", 12),
            dropout=float(get("dropout", 0.1)), attention_dropout=float(get("attention_dropout", 0.0)),
            activation_dropout=float(get("activation_dropout", 0.0)), max_len=get("max_position_embeddings", 1024),
            layer_norm_eps=HF_LAYER_NORM_EPS, norm_position="post", activation=ACTIVATIONS[activation],
            norm="layernorm", positions="sinusoidal_halves", attention_bias=True, share_embeddings=share,
            tie_output=bool(get("tie_word_embeddings", True)), scale_embeddings=bool(get("scale_embedding", False)),
            output_bias=True)
    except ValueError as err:
        raise UnsupportedMarianConfig(f"cannot import this Marian model: {err}") from None


def marian_ids(vocab_size: int, pad: int, eos: int, unk: int, start: int) -> np.ndarray:
    """(vocab_size + 1,) the Marian id of each of our ids: pad, start, eos, unk, then the rest in order."""
    fixed = {PAD_ID: pad, BOS_ID: start, EOS_ID: eos, UNK_ID: unk}
    rest = [i for i in range(vocab_size) if i not in (pad, eos, unk)]
    order = np.array([fixed[i] for i in range(len(SPECIAL_TOKENS))] + rest, dtype=np.int64)
    assert len(order) == vocab_size + 1, "pad, eos and unk must be three different ids"
    return order


def side_orders(ids: Mapping[str, int]) -> tuple[np.ndarray, np.ndarray]:
    """(source order, target order): our id -> Marian id (the source starts nothing: its bos row copies pad's)."""
    src = marian_ids(ids["src_vocab_size"], ids["pad"], ids["eos"], ids["src_unk"], ids["pad"])
    tgt = marian_ids(ids["tgt_vocab_size"], ids["pad"], ids["eos"], ids["tgt_unk"], ids["decoder_start"])
    return src, tgt


def inverse_order(order: np.ndarray) -> np.ndarray:
    """(Marian vocab,) which of our rows each Marian row is written from: its own; the decoder start's, our bos."""
    inverse = np.empty(len(order) - 1, dtype=np.int64)
    inverse[order] = np.arange(len(order))
    inverse[order[BOS_ID]] = BOS_ID  # the one Marian row two of ours hold (order[BOS_ID]'s): bos wins either way
    return inverse


def hf_key(key: str) -> str:
    """Our torch key of a layer parameter -> HF's (`encoder.layers.0.ff.linear1.weight` -> `...layers.0.fc1.weight`)."""
    stack, layers, index, *rest = key.split(".")
    inner = ".".join(rest)
    ours = next((name for name in LAYER_NAMES if inner.startswith(name + ".")), None)  # no name prefixes another
    if layers != "layers" or ours is None:
        raise KeyError(key)
    return f"model.{stack}.layers.{index}.{LAYER_NAMES[ours]}{inner[len(ours):]}"


def _embedding_sources(cfg: TransformerConfig) -> dict[str, tuple[tuple[str, ...], str]]:
    """Our non-layer torch keys -> (HF keys to read, in preference order; which side's order)."""
    shared = ("model.shared.weight",) if cfg.share_embeddings else ()
    out = {"src_embed.weight": ((*shared, "model.encoder.embed_tokens.weight"), "src")}
    if not cfg.share_embeddings:
        out["tgt_embed.weight"] = (("model.decoder.embed_tokens.weight",), "tgt")
    if not cfg.tie_output:
        out["out_proj.weight"] = (("lm_head.weight",), "tgt")
    out["logits_bias"] = (("final_logits_bias",), "tgt")
    return out


def from_marian(state: Mapping[str, np.ndarray], cfg: TransformerConfig, ids: Mapping[str, int]) -> dict[str, np.ndarray]:
    """A MarianMTModel state dict (NumPy) -> our torch-layout parameters (float32, rows permuted), checked strictly."""
    orders = dict(zip(("src", "tgt"), side_orders(ids)))
    with torch.device("meta"):  # the parameters' shapes, no memory
        wanted = {k: tuple(v.shape) for k, v in Transformer(cfg).named_parameters()}
    embeddings = _embedding_sources(cfg)
    out, used = {}, set()
    for key in wanted:
        candidates, side = embeddings[key] if key in embeddings else ((hf_key(key),), None)  # a layer's: as it is
        if (found := next((c for c in candidates if c in state), None)) is not None:
            used.add(found)
            value = np.asarray(state[found], dtype=np.float32)
            out[key] = value if side is None else (value.reshape(-1) if key == "logits_bias" else value)[orders[side]]
    # Duplicates HF ties to the ones read (shared/tied embeddings) and the positions: checked, not read.
    ignorable = {"model.shared.weight", *TIED_KEYS} if cfg.tie_output or cfg.share_embeddings else set()
    for stack in ("encoder", "decoder"):
        key = f"model.{stack}.embed_positions.weight"
        if key in state:
            used.add(key)
            table = sinusoidal_positions(*np.shape(state[key]), halves=True).numpy()
            if np.abs(np.asarray(state[key], np.float32) - table).max() > POSITION_TOLERANCE:
                raise UnsupportedMarianConfig(f"cannot import this Marian model: {key} is not the sinusoid table")
    left = [k for k in state if k not in used and not (k in ignorable and _tied_copy(state, k, used))]
    check_keys("Marian weights", wanted, {k: np.shape(v) for k, v in [*out.items(), *((k, state[k]) for k in left)]})
    return out


def _tied_copy(state: Mapping[str, np.ndarray], key: str, used: set[str]) -> bool:
    """`key` holds the same matrix as one of the embeddings read (HF writes tied copies)."""
    return any(np.shape(state[u]) == np.shape(state[key]) and np.array_equal(state[u], state[key])
               for u in used if u.endswith(("shared.weight", "embed_tokens.weight")))


def to_marian(params: Mapping[str, np.ndarray], cfg: TransformerConfig,
              ids: Mapping[str, int] | None) -> dict[str, torch.Tensor]:
    """Our torch-layout parameters -> a MarianMTModel state dict, rows permuted back to Marian's `ids` if given."""
    inverses = ({"src": np.arange(cfg.src_vocab_size), "tgt": np.arange(cfg.tgt_vocab_size)} if ids is None
                else {side: inverse_order(order) for side, order in zip(("src", "tgt"), side_orders(ids))})
    embeddings, out = _embedding_sources(cfg), {}
    for key, value in params.items():
        value = np.asarray(value, dtype=np.float32)
        if key in embeddings:  # written under the first HF key the import reads it from
            (theirs, *_), side = embeddings[key]
            out[theirs] = value[inverses[side]][None] if key == "logits_bias" else value[inverses[side]]
        else:
            out[hf_key(key)] = value
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in out.items()}


def marian_source(src: str | os.PathLike) -> tuple[Path, dict[str, Any]]:
    """(the local Marian directory `src` names, {"from": src, "revision" of a hub name}): a directory, or
    `hf:ORG/NAME[@REVISION]` through huggingface_hub's cache (HF_HUB_OFFLINE honoured); failures a UserError."""
    text = str(src)
    if not text.startswith(HUB_PREFIX):
        return Path(src), {"from": text}
    hub = spm.require("huggingface_hub")
    from huggingface_hub import errors

    repo, _, revision = text.removeprefix(HUB_PREFIX).partition("@")
    try:
        path = Path(hub.snapshot_download(repo, revision=revision or None, allow_patterns=HUB_FILES))
    except errors.LocalEntryNotFoundError:
        raise runtime.UserError(f"{text} is not in the Hugging Face cache ({hub.constants.HF_HUB_CACHE}) and the hub "
                                "cannot be reached (offline: HF_HUB_OFFLINE=1, or no network)") from None
    except errors.RepositoryNotFoundError:
        raise runtime.UserError(f"{text}: no such model on the Hugging Face hub (or a private one)") from None
    except errors.RevisionNotFoundError:
        raise runtime.UserError(f"{text}: the model has no revision {revision!r}") from None
    except (errors.HFValidationError, errors.HfHubHTTPError) as err:
        raise runtime.UserError(f"{text}: {str(err).strip().splitlines()[0]}") from None
    return path, {"from": text, "revision": path.name}  # the snapshot directory is named by its commit


def read_marian_dir(src: str | os.PathLike) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(config.json, state dict as NumPy) of a local HF Marian directory (`read_state_dict`: no code runs)."""
    src = Path(src)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src} is not an HF model directory (config.json missing)")
    runtime.check_export(src)
    hf = runtime.read_json(src / "config.json")  # UserError naming the file when it is not JSON
    if not isinstance(hf, dict):
        raise ValueError(f"{src / 'config.json'} holds no JSON object")  # noqa: TRY004 (a bad file: main's one line)
    names = [name for name in ("model.safetensors", "pytorch_model.bin") if (src / name).is_file()]
    if not names:
        raise FileNotFoundError(f"{src} holds neither model.safetensors nor pytorch_model.bin")
    state = read_state_dict(src / names[0])
    return hf, {k: (v.float() if v.is_floating_point() else v).numpy() for k, v in state.items()}


def _pieces(vocab: Mapping[str, int], order: np.ndarray, vocab_size: int) -> list[str]:
    by_id = {i: p for p, i in vocab.items()}
    return [by_id.get(int(m), f"<marian_{int(m)}>") for m in order[: vocab_size + 1]]


def marian_tokenizers(src: Path, hf: Mapping[str, Any]) -> tuple[spm.SentencePieceTokenizer, spm.SentencePieceTokenizer, dict[str, int]]:
    """(source tokenizer, target tokenizer, special ids) of a Marian directory: MarianTokenizer's pieces, our ids."""
    share = bool(hf.get("share_encoder_decoder_embeddings", True))
    for name in ("source.spm", "target.spm", "vocab.json", *(() if share else ("target_vocab.json",))):
        if not (src / name).is_file():
            raise FileNotFoundError(f"{src} holds no {name} (a Marian model's tokenizer files)")
    src_vocab = runtime.read_json(src / "vocab.json")
    tgt_vocab = src_vocab if share else runtime.read_json(src / "target_vocab.json")
    for name, vocab in (("vocab.json", src_vocab), ("target_vocab.json", tgt_vocab)):
        if not isinstance(vocab, dict) or "<unk>" not in vocab:
            raise ValueError(f"{src / name} has no <unk>")
    pad = hf.get("pad_token_id", 58100)
    ids = {"pad": pad, "eos": hf.get("eos_token_id", 0), "decoder_start": hf.get("decoder_start_token_id", pad),
           "src_unk": src_vocab["<unk>"], "tgt_unk": tgt_vocab["<unk>"], "src_vocab_size": hf.get("vocab_size", 58101),
           "tgt_vocab_size": hf.get("decoder_vocab_size") or hf.get("vocab_size", 58101)}
    src_order, tgt_order = side_orders(ids)
    source_blob, target_blob = (src / "source.spm").read_bytes(), (src / "target.spm").read_bytes()
    # MarianTokenizer decodes with the source model when the vocabulary is shared, else the target's.
    decode_blob, decode_name = (source_blob, "source.spm") if share else (target_blob, "target.spm")
    try:  # source.spm is read first, by both sides when the vocabulary is shared
        name = "source.spm"
        src_tok = spm.SentencePieceTokenizer(source_blob, _pieces(src_vocab, src_order, ids["src_vocab_size"]),
                                             source_blob, "source.spm", "source.spm")
        name = "target.spm"
        tgt_tok = spm.SentencePieceTokenizer(target_blob, _pieces(tgt_vocab, tgt_order, ids["tgt_vocab_size"]),
                                             decode_blob, "target.spm", decode_name)
    except RuntimeError as err:  # "could not parse ModelProto"
        raise ValueError(f"{src / name} is not a SentencePiece model ({' '.join(str(err).split())})") from None
    return src_tok, tgt_tok, ids


def experiment_for(cfg: TransformerConfig, backend: str, train: str | None = None, valid: str | None = None,
                   test: str | None = None) -> ExperimentConfig:
    """The experiment of an imported run: preset base, each model field a `--set` override or a data-derived one."""
    model = {k: v for k, v in cfg.to_dict().items() if k not in (*DERIVED_MODEL_FIELDS, *SPECIAL_ID_FIELDS)}
    experiment = ExperimentConfig(backend=backend, preset="base", model=model, dropout=cfg.dropout, max_len=cfg.max_len,
                                  joint_vocab=cfg.share_embeddings, train=train, valid=valid, test=test,
                                  vocab_size=cfg.src_vocab_size if cfg.src_vocab_size >= 260 else None)
    rebuilt = experiment.model_config(cfg.src_vocab_size, cfg.tgt_vocab_size)
    assert rebuilt == cfg, (rebuilt, cfg)
    return experiment


def import_marian(src: str | os.PathLike, dst: str | os.PathLike, to: str = "torch", train: str | None = None,
                  valid: str | None = None, test: str | None = None, overwrite: bool = False) -> dict[str, Any]:
    """An HF Marian directory or hub name (`marian_source`) -> a run of the `to` backend at `dst`, whole or none."""
    (src, origin), dst = marian_source(src), Path(dst)
    hf, state = read_marian_dir(src)
    cfg = marian_config(hf)
    src_tok, tgt_tok, ids = marian_tokenizers(src, hf)
    params = from_marian(state, cfg, ids)
    experiment = experiment_for(cfg, to, train, valid, test).replace(run_dir=str(dst)).resolve()
    with runtime.derive(src, dst, "run", overwrite) as tmp:
        runtime.write_json_atomic(tmp / runtime.CONFIG_FILE, experiment.experiment())
        runtime.write_json_atomic(tmp / runtime.MODEL_FILE, cfg.to_dict())
        data.save_tokenizers(data.Tokenizers(src_tok, tgt_tok), tmp)
        backend = create_backend(experiment, cfg, str(tmp / runtime.CHECKPOINTS))
        try:
            backend.import_state(convert_state(TrainingState("torch", 0, params), to, cfg))
            backend.save({"step": 0, "data": {"epoch": 0, "index": 0}, "config": experiment.experiment(), "valid": None,
                          "imported_from": origin["from"]}, None)
        finally:
            backend.close()
        runtime.write_json_atomic(tmp / runtime.IMPORTED_FILE,
                                  {**origin, "format": MARIAN_FORMAT, "marian_config": hf, "marian_ids": ids})
    return {"run_dir": str(dst), "backend": to, **origin, "config": cfg}


def marian_origin(run_dir: str | os.PathLike) -> dict[str, Any]:
    """The Marian config and special ids an imported run came with (imported.json)."""
    record = runtime.read_json(Path(run_dir) / runtime.IMPORTED_FILE, default={})
    if record.get("format") != MARIAN_FORMAT:
        raise ValueError(f"{run_dir} was not imported from a Marian model (aiayn convert --from marian): its "
                         "vocabulary has no Marian numbering to export to")
    return record


def marian_model(record: Mapping[str, Any], params: Mapping[str, np.ndarray], cfg: TransformerConfig):
    """A `MarianMTModel` of an imported run's Marian config (`marian_origin`) holding `params`, checked strictly."""
    transformers = spm.require("transformers")
    hf_config = transformers.MarianConfig(**{k: v for k, v in record["marian_config"].items()
                                             if k not in ("architectures", "transformers_version", "model_type")})
    model = transformers.MarianMTModel(hf_config)
    missing, unexpected = model.load_state_dict(to_marian(params, cfg, record["marian_ids"]), strict=False)
    missing = [k for k in missing if "embed_positions" not in k and k not in TIED_KEYS]
    if missing or unexpected:
        raise CheckpointMismatchError(f"the run's weights in a Marian model: missing {missing}, "
                                      f"unexpected {unexpected}")
    return model


def export_marian(run_dir: str | os.PathLike, params: Mapping[str, np.ndarray], cfg: TransformerConfig,
                  dst: str | os.PathLike, overwrite: bool = False, check: Callable[[Path], object] | None = None) -> Path:
    """Weights `params` of `run_dir` (imported from Marian) -> an HF Marian directory at `dst` once `check` passes."""
    run_dir, dst = Path(run_dir), Path(dst)
    record = marian_origin(run_dir)
    model = marian_model(record, params, cfg)
    tokenizers = data.load_tokenizers(run_dir)
    src_tok, tgt_tok = tokenizers.src, tokenizers.tgt
    src_inverse, tgt_inverse = (inverse_order(o) for o in side_orders(record["marian_ids"]))
    with runtime.derive(run_dir, dst, "marian", overwrite, check=check) as tmp:
        model.save_pretrained(str(tmp))
        (tmp / "source.spm").write_bytes(src_tok.model)
        (tmp / "target.spm").write_bytes(tgt_tok.model)
        runtime.write_json_atomic(tmp / "vocab.json", {src_tok.pieces[int(o)]: m for m, o in enumerate(src_inverse)})
        if not cfg.share_embeddings:
            vocab = {tgt_tok.pieces[int(o)]: m for m, o in enumerate(tgt_inverse)}
            runtime.write_json_atomic(tmp / "target_vocab.json", vocab)
        runtime.write_json_atomic(tmp / "tokenizer_config.json", {"tokenizer_class": "MarianTokenizer", "separate_vocabs":
                                not cfg.share_embeddings, "model_max_length": cfg.max_len})
    return dst

