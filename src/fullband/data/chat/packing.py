"""Chat packing: rendered conversations packed whole into training windows of seq_len positions, the rest padding
without loss; a conversation longer than a window is dropped or truncated."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from fullband.data.chat.templates import IGNORE, ChatSequence
from fullband.errors import DataError

TOO_LONG = ("drop", "truncate")
OPEN_WINDOWS = 16


@dataclass
class PackedChat:
    """Conversations packed whole into windows of seq_len positions (none is split across windows; the rest of a
    window is padding, plain and without loss). Each conversation's first position is plain in every pass (`start`):
    it is its BOS where the template writes one, and where it writes none no state crosses from the conversation
    before it either. Row r of the arrays is window r."""

    ids: np.ndarray  # (N, T) int64
    targets: np.ndarray  # (N, T) int64, IGNORE off responses
    fed: np.ndarray  # (N, T) bool
    start: np.ndarray  # (N, T) bool: each conversation's first position
    conversations: int
    dropped: int  # longer than a window (too_long="drop"), or left without a response token by truncation
    truncated: int

    def __len__(self) -> int:  # a WindowSampler counts (len - 1) // seq_len windows
        return self.ids.size + 1

    @property
    def fingerprint(self) -> str:
        import hashlib

        h = hashlib.sha256()
        for a in (self.ids, self.targets, self.fed):
            h.update(np.ascontiguousarray(a).tobytes())
        return h.hexdigest()[:16]

    def plain(self, windows: np.ndarray, fused: np.ndarray | None = None) -> np.ndarray:
        """(len(windows), T) the positions of `windows` that passes > 1 read with plain embeddings: what is not fed
        (prompts, markers, padding), or, in the rows `fused` marks (FUSED prefill), nothing but each conversation's
        first position, which is plain in every pass."""
        read = ~self.fed[windows]
        if fused is not None:
            read &= ~fused[:, None]
        return read | self.start[windows]

    @property
    def loss_tokens(self) -> int:
        return int((self.targets != IGNORE).sum())

    def describe(self, items: str = "conversations", targets: str = "assistant tokens") -> str:
        n, t = self.ids.shape
        parts = [f"{self.conversations} {items} in {n} windows of {t}",
                 f"{self.loss_tokens} {targets} ({self.loss_tokens / max(n * t, 1):.0%} of positions)"]
        if self.dropped:
            parts.append(f"{self.dropped} dropped (longer than a window)")
        if self.truncated:
            parts.append(f"{self.truncated} truncated to a window")
        return ", ".join(parts)


def pack_chats(sequences: Iterable[ChatSequence], seq_len: int, pad_id: int, *, too_long: str = "drop",
               what: str = "the data", alone: bool = False) -> PackedChat:
    """Pack conversations in order into windows of `seq_len` positions: a conversation goes into the first of the
    last OPEN_WINDOWS windows with room for it, else it starts a new one (`alone`: always a new one, so a window's
    loss is its conversation's). Longer ones are dropped, or (too_long="truncate") cut to one window (kept when a
    response token survives)."""
    if too_long not in TOO_LONG:
        raise DataError(f"too_long={too_long!r}; accepted: {', '.join(TOO_LONG)}")
    rows: list[tuple[list[int], list[int], list[bool], list[bool]]] = []
    open_rows: list[tuple[list[int], list[int], list[bool], list[bool]]] = []
    count = dropped = truncated = 0
    for seq in sequences:
        ids, targets, fed = seq.ids, seq.targets, seq.fed
        if len(ids) > seq_len:
            if too_long == "drop":
                dropped += 1
                continue
            ids, targets, fed = ids[:seq_len], targets[: seq_len - 1] + [IGNORE], fed[:seq_len]
            if all(t == IGNORE for t in targets):
                dropped += 1
                continue
            truncated += 1
        # first fit among the windows still open (the last OPEN_WINDOWS started), else a new window
        row = None if alone else next((r for r in open_rows if len(r[0]) + len(ids) <= seq_len), None)
        if row is None:
            row = ([], [], [], [])
            rows.append(row)
            open_rows.append(row)
            if len(open_rows) > OPEN_WINDOWS:
                open_rows.pop(0)
        for part, new in zip(row, (ids, targets, fed, [True] + [False] * (len(ids) - 1))):
            part.extend(new)
        count += 1
    if not rows and not dropped:
        raise DataError(f"{what} holds no conversation")
    if not rows:
        raise DataError(f"no conversation fits a window of seq_len={seq_len} tokens ({dropped} dropped); raise "
                        "train.seq_len or set data.chat_too_long = \"truncate\"")
    shape = (len(rows), seq_len)
    out = (np.full(shape, pad_id, dtype=np.int64), np.full(shape, IGNORE, dtype=np.int64), np.zeros(shape, dtype=bool),
           np.zeros(shape, dtype=bool))
    for r, row in enumerate(rows):  # (ids, targets, fed, start) of window r
        for array, part in zip(out, row):
            array[r, : len(part)] = part
    return PackedChat(*out, count, dropped, truncated)
