"""What a run trains on, as NumPy, never torch or jax (docs/design.md#layout); the names below are the interface."""

from torch_reference.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID

from .batches import Batch, Batcher, bucket_lengths, source_batches
from .corpora import LoadedPairs, Pair, load_parallel, split_lines
from .corpus_store import TokenStore
from .numbers import (NUMBER_BANDS, SEEN_BANDS, Splits, band_range, number_band, number_from_english, number_words,
                      numbers_corpus, numbers_range)
from .splits import corpus_tokenizers, load_split, load_splits, train_store
from .vocab import (JOINT_TOKENIZER, SRC_TOKENIZER, TGT_TOKENIZER, Tokenizers, decode, decode_batch, encode,
                    encode_pairs, load_tokenizers, save_tokenizers, tokenizer_files, train_tokenizer, train_tokenizers)

__all__ = ["BOS_ID", "EOS_ID", "PAD_ID", "UNK_ID", "Batch", "Batcher", "bucket_lengths", "source_batches",
           "LoadedPairs", "Pair", "load_parallel", "split_lines", "NUMBER_BANDS", "SEEN_BANDS", "Splits", "band_range",
           "number_band", "number_from_english", "number_words", "numbers_corpus", "numbers_range", "Tokenizers",
           "decode", "decode_batch", "encode", "encode_pairs", "train_tokenizer", "train_tokenizers", "JOINT_TOKENIZER",
           "SRC_TOKENIZER", "TGT_TOKENIZER", "load_tokenizers", "save_tokenizers", "tokenizer_files",
           "corpus_tokenizers", "load_split", "load_splits", "train_store", "TokenStore"]
