"""Data for training: tokenizers (byte, BPE), corpora with a fixed train/val split, token shards and batch samplers."""

from fullband.data.corpus import DEFAULT_EXTENSIONS, Corpus, resolve_corpus
from fullband.data.sampler import WindowSampler, validation_batches
from fullband.data.shards import TokenStream, tokenize_corpus
from fullband.data.tokenizer import BPETokenizer, ByteTokenizer, load_tokenizer, train_bpe, train_tokenizer_cli

__all__ = ["BPETokenizer", "ByteTokenizer", "Corpus", "DEFAULT_EXTENSIONS", "TokenStream", "WindowSampler",
           "load_tokenizer", "resolve_corpus", "tokenize_corpus", "train_bpe", "train_tokenizer_cli",
           "validation_batches"]
