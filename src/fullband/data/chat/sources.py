"""Chat corpora: a spec (a .jsonl file, a folder or glob of them, 'hf:<dataset>', the synthetic 'arithmetic[:N]') read
as checked conversations, each on the train or the val side by a hash of its messages."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from fullband.data.chat.arithmetic import STYLES, arithmetic_chats
from fullband.data.chat.messages import Message, _numbered, check_messages
from fullband.errors import DataError
from fullband.data.corpus import regular_files
from fullband.files import regular_file
from fullband.validate import parse_int

SYNTHETIC = "arithmetic"  # "arithmetic" or "arithmetic:N": arithmetic_chats(N, seed=0), generated in memory
SYNTHETIC_MIXED = "arithmetic-mixed"  # the same problems, each reply worked fully, partly or not at all
SYNTHETIC_SIZE = 20000
SYNTHETIC_MAX = 10**6  # conversations of arithmetic:N (generated in memory, ~0.5 KB each)
CHAT_ACCEPTED = ("a .jsonl file, a folder or glob of .jsonl files, 'hf:<dataset>' with a 'messages' column, or "
                 "'arithmetic[:N]' / 'arithmetic-mixed[:N]' (the built-in synthetic set; -mixed: replies of three "
                 "lengths)")


def chat_conversations(spec: str | Sequence[str], split: str, val_percent: float) -> Iterator[list[Message]]:
    """The checked conversations of a chat corpus's `split` ('train' or 'val'). A conversation's split is a hash
    of its messages, so a conversation repeated anywhere in the data is always on the same side."""
    from fullband.data.corpus import in_val

    specs = [spec] if isinstance(spec, str) else list(spec)
    want_val = split == "val"
    for one in specs:
        for where, obj in _chat_objects(str(one)):
            messages = check_messages(obj, where)
            key = json.dumps([[m.role, m.content] for m in messages], ensure_ascii=False)
            if in_val(key, val_percent) == want_val:
                yield messages


def _chat_objects(spec: str) -> Iterator[tuple[str, Any]]:
    import glob
    import os

    name, _, count = spec.partition(":")
    if name in (SYNTHETIC, SYNTHETIC_MIXED):
        try:  # the set is generated in memory: a size far beyond any corpus is refused
            n = parse_int("N", count, 1, below=SYNTHETIC_MAX + 1, error=DataError) if count else SYNTHETIC_SIZE
        except DataError as err:
            raise DataError(f"chat corpus {spec!r}: {err}") from None
        styles = STYLES if name == SYNTHETIC_MIXED else ("full",)
        for i, obj in enumerate(arithmetic_chats(n, seed=0, styles=styles)):
            yield f"{name} conversation {i}", obj
        return
    if spec.startswith("hf:"):
        from fullband.data.corpus import _hf_part

        part = _hf_part(spec, "messages", None, "train", None)
        for i, row in enumerate(part.dataset.select_columns(["messages"])):
            yield f"{spec} row {i}", row
        return
    path = Path(spec).expanduser()
    if path.is_dir():  # a FIFO named like a .jsonl file is skipped (reading it would block), with a warning
        files = regular_files(sorted(path.rglob("*.jsonl")), spec)
    elif path.exists() or path.is_symlink():
        files = [regular_file(path, "chat corpus", error=DataError)]
    elif any(c in spec for c in "*?["):
        files = regular_files(sorted(Path(p) for p in glob.glob(os.path.expanduser(spec), recursive=True)
                                      if not Path(p).is_dir()), spec)
    else:
        raise DataError(f"chat corpus not found: {spec!r}; accepted: {CHAT_ACCEPTED}")
    if not files:
        raise DataError(f"chat corpus {spec!r} holds no .jsonl file; accepted: {CHAT_ACCEPTED}")
    for file in files:
        yield from _numbered(file)
