"""Cross-attention heatmaps (`aiayn translate --plot-attention DIR`): each output teacher-forced once, input
line N drawn as DIR/NNNN.png (last decoder layer, heads averaged) and DIR/NNNN_layers.png (each layer, head)."""

from __future__ import annotations

import dataclasses
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from .. import data
from ..backends import Translator
from ..plots import save_figure
from ..runtime.files import OptionError
from ..runtime.replace import check_outside_runs


@dataclasses.dataclass(frozen=True)
class SentenceAttention:
    """One translated sentence and its cross-attention weights."""

    line: int  # 1-based line number in the input
    source: str
    translation: str
    src_tokens: list[str]  # (S,) labels, the source as the model read it (cut to max_len)
    tgt_tokens: list[str]  # (T,) labels, the output tokens, ending <eos> unless the length limit stopped it
    weights: np.ndarray  # (layers, heads, T, S) float32


# The byte-level BPE alphabet (GPT-2's, `tokenizers`' ByteLevel), character -> byte: the printable bytes are
# themselves, the others 256, 257, ... in order.
_PRINTABLE = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
BYTE_VALUES = {chr(b): b for b in _PRINTABLE} | {
    chr(256 + i): b for i, b in enumerate(b for b in range(256) if b not in _PRINTABLE)}


def token_label(tokenizer, token_id: int) -> str:
    """A token as readable text: specials by name, a leading space as ▁, bytes as UTF-8 (half a character: \\xNN)."""
    token = tokenizer.id_to_token(int(token_id))
    if token is None:
        return f"<{int(token_id)}>"
    if token_id in (data.PAD_ID, data.BOS_ID, data.EOS_ID, data.UNK_ID) or not set(token) <= BYTE_VALUES.keys():
        return token
    text = bytes(BYTE_VALUES[c] for c in token).decode("utf-8", errors="backslashreplace")
    return "▁" + text[1:] if text.startswith(" ") else text


def output_tokens(row: Sequence[int]) -> list[int]:
    """A search output row (ending <eos> then <pad>) -> its tokens up to and including <eos>."""
    row = [int(t) for t in row if t != data.PAD_ID]
    return row[: row.index(data.EOS_ID) + 1] if data.EOS_ID in row else row


class AttentionRecorder:
    """`translate_texts`' `on_batch` for `texts`: each non-empty line's attention (`found`, in input order)."""

    def __init__(self, backend: Translator, tokenizers: data.Tokenizers, texts: Sequence[str]):
        self.backend, self.tokenizers, self.texts = backend, tokenizers, texts
        self.found: list[SentenceAttention] = []

    def __call__(self, index: np.ndarray, src: np.ndarray, tokens: np.ndarray) -> None:
        hyps = data.decode_batch(self.tokenizers.tgt, tokens)
        outputs = [output_tokens(row) for row in tokens]
        # Teacher forcing: <bos>, then the output but its last token (row t predicts token t; later ones causal-masked)
        tgt_in = np.concatenate([np.full((len(tokens), 1), data.BOS_ID, tokens.dtype), tokens[:, :-1]], axis=1)
        weights = self.backend.cross_attention(src, tgt_in)  # (B, layers, H, T, S)
        for row, i in enumerate(index):
            if i < 0 or not self.texts[i].strip() or not outputs[row]:  # no sentence or no output: no plot
                continue
            source = [int(t) for t in src[row] if t != data.PAD_ID]
            self.found.append(SentenceAttention(
                line=int(i) + 1, source=self.texts[i].strip(), translation=hyps[row],
                src_tokens=[token_label(self.tokenizers.src, t) for t in source],
                tgt_tokens=[token_label(self.tokenizers.tgt, t) for t in outputs[row]],
                weights=weights[row, :, :, : len(outputs[row]), : len(source)]))
        self.found.sort(key=lambda a: a.line)

    def plot(self, directory: Path) -> None:
        """Every recorded sentence's plots in `directory` (created): NNNN.png and NNNN_layers.png."""
        Path(directory).mkdir(parents=True, exist_ok=True)
        for att in self.found:
            plot_sentence(att, Path(directory) / f"{att.line:04d}.png")
            plot_layers(att, Path(directory) / f"{att.line:04d}_layers.png")
        print(f"wrote {2 * len(self.found)} attention plots for {len(self.found)} sentences to {directory}",
              file=sys.stderr)


def _title(att: SentenceAttention, *lines: str) -> tuple[str, float]:
    """(the title: the sentence, → its translation, then `lines`; the inches it needs)."""
    wrap = lambda text: textwrap.wrap(text, 80, break_long_words=False, subsequent_indent="    ")  # at word ends
    title = [*wrap(att.source), *wrap(f"→ {att.translation}"), *lines]
    return "\n".join(title), 0.5 + 0.085 * max(map(len, title))  # 0.085 in: a character at 10 points, with margin


def _heatmap(ax, weights: np.ndarray, att: SentenceAttention, x_labels: bool, y_labels: bool, fontsize: float):
    image = ax.imshow(weights, cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
    ax.set_xticks(range(len(att.src_tokens)), att.src_tokens if x_labels else [], rotation=90, fontsize=fontsize)
    ax.set_yticks(range(len(att.tgt_tokens)), att.tgt_tokens if y_labels else [], fontsize=fontsize)
    ax.tick_params(length=2)
    return image


def plot_sentence(att: SentenceAttention, path: Path) -> None:
    """The last decoder layer's cross-attention, heads averaged: outputs (rows) x sources, sentence as title."""
    layers, heads, T, S = att.weights.shape
    cell = 0.42  # inches per token
    title, title_width = _title(att, f"cross-attention, decoder layer {layers} of {layers}, mean of {heads} heads")
    fig = Figure(figsize=(max(4.5, title_width, 2.6 + cell * S), max(3.5, 2.4 + cell * T)), layout="constrained")
    ax = fig.add_subplot()
    image = _heatmap(ax, att.weights[-1].mean(0), att, True, True, 10)
    ax.set_xlabel("source")
    ax.set_ylabel("output")
    fig.colorbar(image, ax=ax, shrink=0.8, label="attention weight")
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path)


def plot_layers(att: SentenceAttention, path: Path) -> None:
    """Every decoder layer (rows) x head (columns), on one colour scale."""
    layers, heads, T, S = att.weights.shape
    cell = 0.24
    title, title_width = _title(att, "cross-attention of every decoder layer and head: output tokens x source tokens")
    figsize = (max(6.0, title_width, 1.6 + heads * (0.6 + cell * S)), max(3.5, 1.6 + layers * (0.5 + cell * T)))
    fig = Figure(figsize=figsize, layout="constrained")
    axes = fig.subplots(layers, heads, squeeze=False)
    for layer in range(layers):
        for head in range(heads):
            ax = axes[layer, head]
            image = _heatmap(ax, att.weights[layer, head], att, layer == layers - 1, head == 0, 7)
            ax.set_title(f"layer {layer + 1}, head {head + 1}", fontsize=8)
    fig.colorbar(image, ax=axes, shrink=0.6, label="attention weight")
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path)


def check_plot_directory(directory: Path, source: Path | None = None) -> None:
    """OptionError unless `directory` is or can become a directory outside any run, not holding `source`."""
    check_outside_runs(directory / "0001.png", "plot_attention")
    if source is not None and directory.resolve() in source.resolve().parents:
        raise OptionError("{} {dir} holds the input {source}: its plots could replace it; give another directory",
                          "plot_attention", dir=directory, source=source)
    path = next(p for p in (directory, *directory.parents) if p.exists())  # the nearest that exists: "." or "/" last
    if not path.is_dir():
        raise OptionError("{} {dir}: {path} exists and is not a directory", "plot_attention", dir=directory, path=path)
