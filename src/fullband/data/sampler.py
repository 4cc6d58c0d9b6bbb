"""Training batches: windows of a token stream in a seeded per-epoch order, split over ranks and micro-batches.
Each batch is a pure function of (seed, step, micro, rank, world_size), so a resumed run sees the same batches."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

import numpy as np
import torch

from fullband.errors import ConfigError, DataError
from fullband.validate import integer

FORMAT = "fullband-window-sampler"
VERSION = 1
# Fields that must match on resume; micro_batch and world_size may change (the global order does not depend on them).
STATE_FIELDS = ("format", "version", "seed", "seq_len", "global_batch", "n_windows", "stream_fingerprint", "n_tokens")


class StreamLike(Protocol):
    def __len__(self) -> int: ...
    def slice(self, start: int, stop: int) -> np.ndarray: ...


Batch = tuple[torch.Tensor, torch.Tensor]


def count_windows(stream: StreamLike, seq_len: int) -> int:
    """Windows of seq_len + 1 tokens starting every seq_len tokens (consecutive windows share one token)."""
    n = (len(stream) - 1) // seq_len
    if n < 1:
        raise DataError(f"the token stream has {len(stream)} tokens, fewer than one window needs "
                        f"({seq_len + 1} for seq_len={seq_len}); "
                        "use a larger corpus (or a larger val_percent for validation) or a smaller seq_len")
    return n


def read_windows(stream: StreamLike, windows: np.ndarray, seq_len: int) -> Batch:
    """(inputs, targets), each int64 (len(windows), seq_len): targets are inputs shifted left by one token."""
    rows = np.stack([stream.slice(int(w) * seq_len, int(w) * seq_len + seq_len + 1) for w in windows]).astype(np.int64)
    tokens = torch.from_numpy(rows)  # (B, T + 1)
    # Contiguous copies: the model may .view() its inputs, which a strided slice would refuse.
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


class WindowSampler:
    """Global sample j of step s is window perm_e[(s * global_batch + j) % n_windows], e = its epoch.

    Rank r's micro-batch a takes j in [(a * world_size + r) * micro_batch, ... + micro_batch)."""

    def __init__(self, stream: StreamLike, seq_len: int, global_batch: int, micro_batch: int, seed: int, rank: int = 0,
                 world_size: int = 1) -> None:
        self.stream = stream
        self.seq_len = integer("seq_len", seq_len, 1)
        self.global_batch = integer("global_batch", global_batch, 1)
        self.micro_batch = integer("micro_batch", micro_batch, 1)
        self.world_size = integer("world_size", world_size, 1)
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.world_size:
            raise ConfigError(f"rank={rank!r}; accepted: an integer in [0, world_size={self.world_size})")
        self.seed, self.rank = integer("seed", seed, 0), int(rank)
        per_step = self.micro_batch * self.world_size
        if self.global_batch % per_step:
            nearest = max(per_step, global_batch // per_step * per_step)
            raise ConfigError(f"global_batch={global_batch} is not divisible by micro_batch * world_size = "
                              f"{micro_batch} * {world_size} = {per_step}; accepted: a multiple of {per_step}, e.g. "
                              f"{nearest}")
        self.accum_steps = self.global_batch // per_step
        self.n_windows = count_windows(stream, self.seq_len)
        self._perms: dict[int, np.ndarray] = {}

    def permutation(self, epoch: int) -> np.ndarray:
        """The window order of `epoch`; the latest two epochs are cached (a step may straddle a boundary)."""
        if epoch not in self._perms:
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch])))
            self._perms = {e: p for e, p in self._perms.items() if e == epoch - 1}
            self._perms[epoch] = rng.permutation(self.n_windows)
        return self._perms[epoch]

    def samples(self, step: int, micro: int) -> np.ndarray:
        """Global sample indices (step * global_batch + j) of this rank's micro-batch `micro` of step `step`."""
        integer("step", step, 0, error=DataError)
        if isinstance(micro, bool) or not isinstance(micro, (int, np.integer)) or not 0 <= micro < self.accum_steps:
            raise DataError(f"micro={micro!r}; accepted: an integer in [0, accum_steps={self.accum_steps})")
        first = (int(micro) * self.world_size + self.rank) * self.micro_batch
        return int(step) * self.global_batch + first + np.arange(self.micro_batch)

    def windows(self, step: int, micro: int) -> np.ndarray:
        """Window indices of this rank's micro-batch `micro` of optimizer step `step`."""
        epochs, slots = np.divmod(self.samples(step, micro), self.n_windows)
        return np.array([self.permutation(int(e))[s] for e, s in zip(epochs, slots)], dtype=np.int64)

    def epoch(self, step: int) -> float:
        """Fraction of passes over the data made before `step` (for logging)."""
        return step * self.global_batch / self.n_windows

    def batch(self, step: int, micro: int) -> Batch:
        """(inputs, targets), int64 tensors of shape (micro_batch, seq_len)."""
        return read_windows(self.stream, self.windows(step, micro), self.seq_len)

    def state_dict(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "seed": self.seed, "seq_len": self.seq_len,
                "global_batch": self.global_batch, "n_windows": self.n_windows,
                "stream_fingerprint": getattr(self.stream, "fingerprint", None), "n_tokens": len(self.stream)}

    def check_state(self, state: dict) -> None:
        """Raise DataError unless `state` (from a checkpoint) describes the same data order as this sampler."""
        if not isinstance(state, dict):
            raise DataError(f"sampler state is a {type(state).__name__}; accepted: a dict from "
                            "WindowSampler.state_dict()")
        now = self.state_dict()
        diffs = [f"{k}: checkpoint {state.get(k, '<missing>')!r}, now {now[k]!r}"
                 for k in STATE_FIELDS if state.get(k) != now[k]]
        if diffs:
            raise DataError("the data does not match the checkpoint's sampler, so resuming would not continue the same "
                            "batches (" + "; ".join(diffs) + "); accepted: the same corpus, tokenizer, seed, seq_len "
                            "and global_batch")


MIX_FORMAT = "fullband-mix-sampler"
MIX_BLOCK = 1000  # a share's resolution: every block of this many global samples holds each source's exact count


def block_counts(shares: Sequence[float], block: int = MIX_BLOCK) -> np.ndarray:
    """Each source's samples per block of `block`: share * block rounded by largest remainder (they sum to block;
    a positive share gets at least one)."""
    raw = np.asarray(shares, dtype=np.float64) * block / float(np.sum(shares))
    counts = np.maximum(np.floor(raw).astype(np.int64), 1)
    for i in np.argsort(-(raw - np.floor(raw)), kind="stable"):
        if counts.sum() >= block:
            break
        counts[i] += 1
    while counts.sum() > block:  # the minimum of one pushed it over: take from the largest
        counts[int(np.argmax(counts))] -= 1
    return counts


class MixSampler:
    """Windows of several token streams at chosen shares (data.shares): global sample g of step s (g = s *
    global_batch + j, as WindowSampler numbers them) belongs to block g // MIX_BLOCK, whose MIX_BLOCK slots hold
    source i exactly block_counts(shares)[i] times in a seeded order; source i's n-th sample is window
    perm_{i,e}[n % n_i] of its own stream, e = n // n_i (each source is its own epochs). A pure function of (seed,
    step, sample), so a resumed run sees the same batches and micro_batch / world_size may change."""

    def __init__(self, streams: Sequence[StreamLike], shares: Sequence[float], seq_len: int, global_batch: int,
                 micro_batch: int, seed: int, rank: int = 0, world_size: int = 1) -> None:
        if len(streams) != len(shares) or not streams:
            raise ConfigError(f"{len(streams)} stream(s) and {len(shares)} share(s); accepted: one share per stream")
        self.parts = [WindowSampler(s, seq_len, global_batch, micro_batch, seed, rank, world_size) for s in streams]
        first = self.parts[0]
        self.seq_len, self.global_batch, self.micro_batch = first.seq_len, first.global_batch, first.micro_batch
        self.world_size, self.seed, self.rank, self.accum_steps = first.world_size, first.seed, first.rank, \
            first.accum_steps
        self.shares = [float(x) for x in shares]
        self.counts = block_counts(self.shares)
        self._blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, n-th sample of that source) of every slot of block b; the latest two blocks are cached."""
        if b not in self._blocks:
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, 2, b])))
            source = rng.permutation(np.repeat(np.arange(len(self.counts)), self.counts))
            nth = np.empty(MIX_BLOCK, dtype=np.int64)
            for i, count in enumerate(self.counts):
                slots = source == i
                nth[slots] = b * count + np.arange(count)
            self._blocks = {k: v for k, v in self._blocks.items() if k == b - 1}
            self._blocks[b] = (source, nth)
        return self._blocks[b]

    def windows(self, step: int, micro: int) -> list[tuple[int, int]]:
        """(source, window) of each sample of this rank's micro-batch `micro` of optimizer step `step`."""
        out = []
        for g in self.parts[0].samples(step, micro):  # numbered as one stream's samples
            blk, slot = divmod(int(g), MIX_BLOCK)
            source, nth = self._block(blk)
            part = self.parts[int(source[slot])]
            epoch, at = divmod(int(nth[slot]), part.n_windows)
            out.append((int(source[slot]), int(part.permutation(epoch)[at])))
        return out

    def batch(self, step: int, micro: int) -> Batch:
        rows = [read_windows(self.parts[i].stream, np.array([w]), self.seq_len) for i, w in self.windows(step, micro)]
        return torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])

    def state_dict(self) -> dict:
        return {"format": MIX_FORMAT, "version": VERSION, "seed": self.seed, "seq_len": self.seq_len,
                "global_batch": self.global_batch, "shares": self.shares,
                "sources": [{k: state[k] for k in ("n_windows", "stream_fingerprint", "n_tokens")}
                            for state in (p.state_dict() for p in self.parts)]}

    def check_state(self, state: dict) -> None:
        """Raise DataError unless `state` (from a checkpoint) describes the same data order as this sampler."""
        if not isinstance(state, dict):
            raise DataError(f"sampler state is a {type(state).__name__}; accepted: a dict from "
                            "MixSampler.state_dict()")
        now = self.state_dict()
        diffs = [f"{k}: checkpoint {state.get(k, '<missing>')!r}, now {now[k]!r}" for k in now
                 if state.get(k) != now[k]]
        if diffs:
            raise DataError("the data does not match the checkpoint's sampler, so resuming would not continue the same "
                            "batches (" + "; ".join(diffs) + "); accepted: the same corpora, shares, tokenizer, seed, "
                            "seq_len and global_batch")


def validation_batches(stream: StreamLike, seq_len: int, n_windows: int, batch_size: int) -> list[Batch]:
    """Fixed (inputs, targets) batches over `n_windows` evenly spaced windows (all windows if the stream is shorter)."""
    seq_len, n_windows, batch_size = (integer(k, v, 1) for k, v in
                                      (("seq_len", seq_len), ("n_windows", n_windows), ("batch_size", batch_size)))
    return list(window_batches(stream, seq_len, n_windows, batch_size))


def window_batches(stream: StreamLike, seq_len: int, windows: int, batch_size: int) -> Iterator[Batch]:
    """validation_batches read lazily batch by batch (the stream stays on disk), unchecked; `windows` <= 0: all."""
    total = count_windows(stream, seq_len)
    n = min(windows, total) if windows > 0 else total
    # floor(i * total / n) is strictly increasing for n <= total: distinct, evenly spread windows.
    picks = np.arange(n, dtype=np.int64) * total // n
    for i in range(0, n, batch_size):
        yield read_windows(stream, picks[i : i + batch_size], seq_len)


class ChatSampler(WindowSampler):
    """The WindowSampler's order over packed chat windows (fullband.data.chat.packing.PackedChat). A batch is (inputs,
    targets, plain): `plain` (B, T) marks the positions read with plain embeddings in passes > 1. A window reads
    its prompts plainly, as SOFT decoding does (plain = not fed), or, with probability `fused_prompts`, feeds
    them too, as FUSED prefill does (plain = only each conversation's first position); the draw is a function of
    (seed, step, sample)."""

    def __init__(self, packed, global_batch: int, micro_batch: int, seed: int, *, fused_prompts: float = 0.0,
                 rank: int = 0, world_size: int = 1) -> None:
        super().__init__(packed, packed.ids.shape[1], global_batch, micro_batch, seed, rank=rank,
                         world_size=world_size)
        self.fused_prompts = float(fused_prompts)

    def batch(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        windows = self.windows(step, micro)
        first = (int(micro) * self.world_size + self.rank) * self.micro_batch
        draws = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, 1, int(step)])))
        fused = draws.random(self.global_batch)[first : first + self.micro_batch] < self.fused_prompts
        packed = self.stream
        return (torch.from_numpy(packed.ids[windows]), torch.from_numpy(packed.targets[windows]),
                torch.from_numpy(packed.plain(windows, fused)))


def chat_validation_batches(packed, n_windows: int, batch_size: int) -> list[tuple[torch.Tensor, ...]]:
    """Fixed (inputs, targets, plain) batches over `n_windows` evenly spaced packed windows, prompts read plainly
    (as SOFT decoding reads them)."""
    n_windows, batch_size = integer("n_windows", n_windows, 1), integer("batch_size", batch_size, 1)
    total = packed.ids.shape[0]
    n = min(n_windows, total)
    picks = np.arange(n, dtype=np.int64) * total // n
    batches = (picks[i : i + batch_size] for i in range(0, n, batch_size))
    return [(torch.from_numpy(packed.ids[w]), torch.from_numpy(packed.targets[w]),
             torch.from_numpy(packed.plain(w))) for w in batches]
