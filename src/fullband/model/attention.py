"""Grouped-query causal self-attention with optional QK-RMSNorm and RoPE, reading/writing a static KV cache.

Shapes: B batch, T positions, H query heads, Hk key/value heads, Dh head dim, D model width, S cache length.
q, k and v come from one (H + 2 Hk) * Dh x D matrix `wqkv`; q and k are normalised and rotated together."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.torch_version import TorchVersion

from fullband.model.config import ModelConfig
from fullband.model.layers import apply_rotary, linear, rms_norm

_SDPA_GQA = TorchVersion(torch.__version__) >= (2, 5)


def _attend(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, mask: Tensor | None) -> Tensor:
    if k.shape[1] != q.shape[1]:
        if _SDPA_GQA:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)


def window_mask(q_pos: Tensor, k_pos: Tensor, window: int) -> Tensor:
    """Bool mask, True where key position k is visible from query position q: k <= q and q - k < window."""
    diff = q_pos[..., :, None] - k_pos[..., None, :]
    return (diff >= 0) & (diff < window)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.eps = cfg.norm_eps
        self.window = cfg.sliding_window if cfg.is_local(layer) else None
        self.wqkv = nn.Linear(cfg.d_model, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)
        # QK-RMSNorm over each head's Dh, with a gain per query head and per key head
        self.qk_gain = nn.Parameter(torch.ones(cfg.n_heads + cfg.n_kv_heads, cfg.head_dim)) if cfg.qk_norm else None
        # per-head output gate (one scalar per head and position), as in the paper's 1B model
        self.w_gate = nn.Linear(cfg.d_model, cfg.n_heads, bias=False) if cfg.attn_gate else None

    def _project(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, T, D) -> q (B, H, T, Dh), k (B, T, Hk, Dh), v (B, T, Hk, Dh): normalised and rotated."""
        B, T, _ = x.shape
        H, Hk, Dh = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = linear(x, self.wqkv.weight).view(B, T, H + 2 * Hk, Dh)
        qk, v = qkv.split([H + Hk, Hk], dim=2)
        if self.qk_gain is not None:
            qk = rms_norm(qk, None, self.eps) * self.qk_gain
        qk = apply_rotary(qk, cos, sin)  # (B, T, H + Hk, Dh)
        return qk[:, :, :H].transpose(1, 2), qk[:, :, H:], v

    def _output(self, x: Tensor, y: Tensor) -> Tensor:
        """Per-head attention outputs y (B, H, T, Dh) -> (B, T, D), through the output gates when there are any."""
        B, T, _ = x.shape
        if self.w_gate is not None:
            y = y * torch.sigmoid(linear(x, self.w_gate.weight)).transpose(1, 2)[..., None]  # (B, H, T, 1)
        return linear(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim), self.wo.weight)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv: tuple[Tensor, Tensor] | None = None,
                window_mask: Tensor | None = None) -> Tensor:
        """Causal attention over x (B, T, D) at positions 0..T-1; fills kv[:, :T] when a cache layer is given.
        Sliding-window layers attend under `window_mask` (None: the window covers everything)."""
        T = x.shape[1]
        q, k, v = self._project(x, cos, sin)
        if kv is not None:
            kv[0][:, :T] = k
            kv[1][:, :T] = v
        mask = window_mask if self.window is not None else None
        return self._output(x, _attend(q, k.transpose(1, 2), v.transpose(1, 2), causal=mask is None, mask=mask))

    def step(self, x: Tensor, cos: Tensor, sin: Tensor, kv: tuple[Tensor, Tensor], slots: Tensor, kv_len: int,
             mask: Tensor | None = None, window_mask: Tensor | None = None) -> Tensor:
        """One decode position per row: x (B, 1, D) written at cache `slots` (B,), attending to the cache's first
        kv_len positions under `mask` (rows at different positions); sliding-window layers under `window_mask`."""
        Hk, Dh = self.n_kv_heads, self.head_dim
        q, k, v = self._project(x, cos, sin)
        kv[0].view(-1, Hk, Dh).index_copy_(0, slots, k[:, 0])
        kv[1].view(-1, Hk, Dh).index_copy_(0, slots, v[:, 0])
        if self.window is not None and window_mask is not None:
            mask = window_mask
        keys, values = kv[0][:, :kv_len].transpose(1, 2), kv[1][:, :kv_len].transpose(1, 2)
        return self._output(x, _attend(q, keys, values, causal=False, mask=mask))
