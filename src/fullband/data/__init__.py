"""Tokenizers and corpora."""

from fullband.data.tokenizer import ByteTokenizer, load_tokenizer

__all__ = ["ByteTokenizer", "load_tokenizer"]
