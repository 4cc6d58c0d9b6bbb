"""Static, preallocated KV cache written at integer positions (one slot per position, per row).

Every decoding mode shares it: prefill writes positions [0, T) of every row; a decode step writes one
position per row, so rows of a ragged batch advance at their own positions."""

from __future__ import annotations

import torch
from torch import Tensor


class KVCache:
    """Keys and values of every layer slot (a looped model has one per block repetition): k[i], v[i] are
    (B, max_len, H_kv, Dh) (position-major, so one decode step writes each row's slot with a single index_copy_
    into the flattened (B * max_len, H_kv, Dh) view)."""

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_len: int, head_dim: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        shape = (batch, max_len, n_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.batch, self.max_len = batch, max_len

    @classmethod
    def wrap(cls, k: list[Tensor], v: list[Tensor]) -> "KVCache":
        """A cache over existing per-layer tensors (no copy)."""
        cache = cls.__new__(cls)
        cache.k, cache.v = k, v
        cache.batch, cache.max_len = k[0].shape[0], k[0].shape[1]
        return cache

    @classmethod
    def for_model(cls, model: torch.nn.Module, batch: int, max_len: int, layers: int | None = None) -> "KVCache":
        """A cache of `layers` slots (default config.n_layers; a looped model has one per block repetition)."""
        cfg = model.config
        param = next(model.parameters())
        return cls(cfg.n_layers if layers is None else layers, batch, cfg.n_kv_heads, max_len, cfg.head_dim,
                   dtype=param.dtype, device=param.device)

    def slots(self, positions: Tensor) -> Tensor:
        """Row-major slot of each row's position in the flattened cache: b * max_len + positions[b]."""
        return torch.arange(self.batch, device=positions.device) * self.max_len + positions

    def layer(self, i: int) -> tuple[Tensor, Tensor]:
        return self.k[i], self.v[i]

    def visible(self, positions: Tensor, kv_len: int) -> Tensor:
        """Attention mask (B, 1, 1, kv_len) for one query per row at `positions`: row b sees keys <= positions[b]."""
        keys = torch.arange(kv_len, device=positions.device)
        return (keys[None, :] <= positions[:, None])[:, None, None, :]

    def fork(self) -> None:
        """Fresh copies of every layer: a later write leaves the tensors an autograd graph saved untouched. The lists
        are refilled in place, so a cache wrapped over them (wrap: the decode step's) forks too."""
        self.k[:], self.v[:] = [k.clone() for k in self.k], [v.clone() for v in self.v]

    def select(self, rows: Tensor) -> None:
        """Keep (and reorder, or repeat) the batch rows `rows` (R,): each layer becomes (R, max_len, H_kv, Dh)."""
        rows = rows.to(self.k[0].device)
        self.k = [k.index_select(0, rows) for k in self.k]
        self.v = [v.index_select(0, rows) for v in self.v]
        self.batch = int(rows.shape[0])

    def grow(self, max_len: int) -> None:
        """Reallocate every layer to hold max_len positions (>= the current length), keeping what is written."""
        if max_len <= self.max_len:
            return
        def longer(t: Tensor) -> Tensor:
            out = t.new_zeros((t.shape[0], max_len, *t.shape[2:]))
            out[:, : self.max_len] = t
            return out
        self.k, self.v = [longer(k) for k in self.k], [longer(v) for v in self.v]
        self.max_len = max_len
