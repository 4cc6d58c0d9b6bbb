"""Tokenizers: a byte-level one (256 byte ids + BOS/EOS/PAD) that needs no training, saved next to a model.

A checkpoint folder holds `tokenizer.json`; a file written by ByteTokenizer says so in its
`fullband_tokenizer` field.
"""

from __future__ import annotations

import json
from pathlib import Path

from fullband.errors import CheckpointError, InputError

TOKENIZER_FILE = "tokenizer.json"


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then BOS=256, EOS=257, PAD=258."""

    kind = "byte"
    bos_id, eos_id, pad_id = 256, 257, 258
    vocab_size = 259

    def encode(self, text: str, *, bos: bool = True, eos: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise InputError(f"text must be a str, got {type(text).__name__}")
        ids = list(text.encode("utf-8"))
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids: list[int], *, skip_special: bool = True) -> str:
        """Text of the byte ids (invalid UTF-8 becomes U+FFFD); special ids are dropped or shown as <bos> etc."""
        names = {self.bos_id: "<bos>", self.eos_id: "<eos>", self.pad_id: "<pad>"}
        parts, run = [], bytearray()
        for i in ids:
            if i < 256:
                run.append(i)
                continue
            if not skip_special:
                parts.append(run.decode("utf-8", errors="replace"))
                parts.append(names.get(i, f"<{i}>"))
                run = bytearray()
        parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)

    def save(self, directory: str | Path) -> None:
        payload = {"fullband_tokenizer": self.kind, "version": 1, "vocab_size": self.vocab_size}
        (Path(directory) / TOKENIZER_FILE).write_text(json.dumps(payload, indent=2) + "\n")


def load_tokenizer(directory: str | Path) -> ByteTokenizer:
    """The tokenizer saved in a checkpoint folder; a folder without one gets the byte tokenizer."""
    path = Path(directory) / TOKENIZER_FILE
    if not path.exists():
        return ByteTokenizer()
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path} is corrupted: {err}") from None
    kind = data.get("fullband_tokenizer") if isinstance(data, dict) else None
    if kind == "byte":
        return ByteTokenizer()
    raise CheckpointError(f"{path}: unknown tokenizer kind {kind!r}; accepted: 'byte'")
