"""FullbandLM: the native full-bandwidth model: a pre-norm decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU)
whose input can fuse the previous position's top state, and whose block group [loop_start, loop_stop) may repeat
per token (looped depth, `loops`; each repetition with its own KV cache slots), or which runs PonderLM-2's two
positions per token (`ponder`: a token slot and a ponder slot). It supplies its transformer stack
to the method's core (fullband.model.core.FeedbackModel), which runs the Jacobi passes, the exact recurrence and
the decode step on it.

Shipped as source with every transformers folder (fullband.hf.remote): it imports only other shipped modules.

Shapes: B batch, T positions, D model width, V vocabulary."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from fullband.errors import InputError
from fullband.model.attention import Attention, window_mask
from fullband.model.cache import KVCache
from fullband.model.config import MAX_LOOPS, ModelConfig
from fullband.model.core import FeedbackModel, ModelOutput, check_ids, plain_positions, shift_right
from fullband.model.fusion import build_fusion
from fullband.model.layers import RMSNorm, Rotary, SwiGLU, build_latent_head, linear
from fullband.model.weights import init_parameter_
from fullband.validate import integer

__all__ = ["Block", "FullbandLM", "ModelOutput", "check_ids", "plain_positions", "shift_right"]


class FolderIO(NamedTuple):
    save: Callable
    load: Callable


def _folder_io() -> FolderIO:
    if FullbandLM.folder_io is None:  # only without `import fullband` having run, which every import does
        raise RuntimeError("FullbandLM.save / load need fullband.loader: import fullband first")
    return FullbandLM.folder_io


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, layer)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.d_ff)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv: tuple[Tensor, Tensor] | None = None,
                window_mask: Tensor | None = None) -> Tensor:
        """All positions from 0 (see Attention.forward)."""
        x = x + self.attn(self.attn_norm(x), cos, sin, kv, window_mask=window_mask)
        return x + self.mlp(self.mlp_norm(x))

    def step(self, x: Tensor, cos: Tensor, sin: Tensor, kv: tuple[Tensor, Tensor], slots: Tensor, kv_len: int,
             mask: Tensor | None, window_mask: Tensor | None) -> Tensor:
        """One cached position per row (see Attention.step)."""
        x = x + self.attn.step(self.attn_norm(x), cos, sin, kv, slots, kv_len, mask, window_mask)
        return x + self.mlp(self.mlp_norm(x))


class FullbandLM(FeedbackModel):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise InputError(f"FullbandLM expects a ModelConfig, got {type(config).__name__}")
        self.config = cfg = config
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.norm_in = RMSNorm(cfg.d_model, cfg.norm_eps)  # the paper's input_rmsnorm
        self.fusion = build_fusion(cfg.fusion, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm_out = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.latent_head = build_latent_head(cfg.latent_head, cfg.d_model)
        self._has_local = any(cfg.is_local(i) for i in range(cfg.n_layers))
        self.loops = cfg.loops  # r, the looped group's repetitions now (the trainer's per step: `looping`)
        self.reset_parameters()

    # ---------------------------------------------------------------- initialisation
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Every parameter initialised as the weight table says (fullband.model.weights.init_parameter_)."""
        for name, p in self.named_parameters():
            init_parameter_(name, p, self.config)

    # ---------------------------------------------------------------- the stack (FeedbackModel's interface)
    def embed_tokens(self, input_ids: Tensor) -> Tensor:
        return self.embed(input_ids)

    def stack(self, x: Tensor, cache: KVCache | None = None) -> tuple[Tensor, Tensor]:
        return self._out(*self._blocks(x, cache, self.config.feedback_target, self.config.n_layers))

    def stack_step(self, x: Tensor, positions: Tensor, cache: KVCache, kv_len: int,
                   mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return self._out(*self._blocks_step(x, positions, cache, kv_len, mask, self.config.feedback_target,
                                            self.config.n_layers))

    def lower(self, x: Tensor, cache: KVCache | None = None) -> Tensor:
        return self._blocks(x, cache, 0, self.config.feedback_target)[0] if self.config.feedback_target else x

    def lower_step(self, x: Tensor, positions: Tensor, cache: KVCache, kv_len: int,
                   mask: Tensor | None = None) -> Tensor:
        if not self.config.feedback_target:
            return x
        return self._blocks_step(x, positions, cache, kv_len, mask, 0, self.config.feedback_target)[0]

    def _blocks(self, x: Tensor, cache: KVCache | None, start: int, stop: int,
                pairs: bool = False) -> tuple[Tensor, Tensor | None]:
        """Blocks [start, stop) over x (B, T, D) at positions 0..T-1 -> (the last one's output, the source block's
        output, or None when it is not among them). `pairs`: x is ponder slots' sequence, slot s at rotary s // 2."""
        T = x.shape[1]
        span = torch.arange(T, device=x.device)
        if pairs:  # (T, 1, 1, Dh) -> (1, T, 1, Dh)
            cos, sin = (t[None, :, 0] for t in self.rotary.at(span // 2, x.dtype))
        else:
            cos, sin = self.rotary.prefix(T, x.dtype)
        local = self._window_mask(span, span, T)
        source = None
        for i, slot in self._order(start, stop, cache):
            x = self.blocks[i](x, cos, sin, None if cache is None else cache.layer(slot), local)
            source = x if i == self.config.source_layer else source  # a looped source: its last repetition
        return x, source

    def _blocks_step(self, x: Tensor, positions: Tensor, cache: KVCache, kv_len: int, mask: Tensor | None,
                     start: int, stop: int, pairs: bool = False) -> tuple[Tensor, Tensor | None]:
        """_blocks at one cached position per row (see Block.step)."""
        cos, sin = self.rotary.at(positions // 2 if pairs else positions, x.dtype)
        slots = cache.slots(positions)
        local = self._window_mask(positions[:, None], torch.arange(kv_len, device=positions.device), kv_len)
        if local is not None:  # (B, 1, kv_len) -> (B, 1, 1, kv_len)
            local = local[:, None]
        source = None
        for i, slot in self._order(start, stop, cache):
            x = self.blocks[i].step(x, cos, sin, cache.layer(slot), slots, kv_len, mask, local)
            source = x if i == self.config.source_layer else source
        return x, source

    def _order(self, start: int, stop: int, cache: KVCache | None) -> list[tuple[int, int]]:
        """(block, cache slot) of blocks [start, stop) in the order they run: the looped group `self.loops` times,
        repetition k >= 1 of its block i at slot n_layers + (k - 1) G + (i - loop_start), so repetition 0 keeps
        the unlooped layout and each repetition attends to its own keys and values at earlier positions."""
        order = [(i, i) for i in range(start, stop)]
        cfg, r = self.config, self.loops
        if r == 1 or not start <= cfg.loop_start < stop:  # the config keeps the group on one side of the target
            return order
        if cache is not None and len(cache.k) < self.cache_layers:
            raise InputError(f"the KV cache holds {len(cache.k)} layer slots; this model at loops={r} needs "
                             f"{self.cache_layers} (a cache made at another loops: make it with new_cache)")
        a, b, G = cfg.loop_start, cfg.loop_stop, cfg.loop_size
        again = [(i, cfg.n_layers + (k - 1) * G + i - a) for k in range(1, r) for i in range(a, b)]
        return order[: b - start] + again + order[b - start:]

    @property
    def cache_layers(self) -> int:
        """KV cache layer slots at the current loops: n_layers + (loops - 1) G."""
        return self.config.n_layers + (self.loops - 1) * self.config.loop_size

    @contextmanager
    def looping(self, loops: int) -> Iterator[None]:
        """Run the looped group `loops` times (r) inside the context instead of config.loops: the trainer's r of a
        step, or more test-time compute. A KV cache holds the slots of the r it was made at (new_cache)."""
        integer("loops", loops, 1, below=MAX_LOOPS + 1, error=InputError)
        if loops != 1 and not self.config.has_loop:
            raise InputError(f"loops={loops} needs a looped group; this model has loop_start = loop_stop = null")
        before, self.loops = self.loops, int(loops)
        try:
            yield
        finally:
            self.loops = before

    def _out(self, x: Tensor, source: Tensor) -> tuple[Tensor, Tensor]:
        """The last block's output and the source block's -> (fed-back state, final-norm output): the state is the
        final-norm output under feedback="final" (the source is then the top), else the source's residual stream."""
        top = self.norm_out(x)
        return (top if self.config.feedback == "final" else source), top

    def head(self, top: Tensor) -> Tensor:
        """LM head (tied to the embedding unless config.tie_embeddings is false): (..., D) -> logits (..., V)."""
        return linear(top, self.embed.weight if self.lm_head is None else self.lm_head.weight)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty KV cache for `batch` rows of up to `max_len` positions (2 max_len slots under ponder: two per
        token), in this model's dtype and device."""
        return KVCache.for_model(self, batch, max_len * self.config.slots_per_token, self.cache_layers)

    # ---------------------------------------------------------------- PonderLM-2 (config.ponder)
    def exact_passes(self, length: int) -> int:
        """Under ponder, pass j's token slots are exact up to position j - 1 and its ponder slots, which read them
        from pass j - 1, up to j - 2: length + 1 passes reach the fixed point (ModelConfig.exact_passes)."""
        return self.config.exact_passes(length)

    @property
    def state_lag(self) -> int:
        """Under ponder 0: ponder slot t reads its own token slot's state, prev[t]. Else the core's 1."""
        return 0 if self.config.ponder else 1

    def jacobi_pass(self, e: Tensor, prev: Tensor | None = None, plain: Tensor | None = None, *,
                    cache: KVCache | None = None) -> tuple[Tensor, Tensor]:
        """Under ponder, a pass after the plain one runs [e_0, z_0, e_1, z_1, ...] (B, 2T, D): ponder slot z_t is fed
        prev[t], the state token slot t produced in the previous pass (no shift, no plain positions: every token has
        its own), both slots at rotary position t. -> (token slots' states, ponder slots' final-norm outputs: z_t's
        predicts token t + 1), each (B, T, D). Else the core's pass."""
        if not self.config.ponder or prev is None:
            return super().jacobi_pass(e, prev, plain, cache=cache)
        x = torch.stack([e, prev.to(e.dtype)], 2).flatten(1, 2)  # (B, T, 2, D) -> (B, 2T, D)
        state, top = self._out(*self._blocks(x, cache, 0, self.config.n_layers, pairs=True))
        return state[:, 0::2], top[:, 1::2]

    def step(self, tokens: Tensor, positions: Tensor, cache: KVCache, *, prev: Tensor | None = None,
             plain: Tensor | None = None, kv_len: int, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Under ponder, token t's two forward steps: its embedding at cache slot 2t, then that slot's state at slot
        2t + 1 (`prev` and `plain` take no part: the ponder slot reads its own token's state). -> (token slot's
        state, ponder slot's final-norm output), each (B, D). Else the core's step. With gradients, the cache is
        forked between the two (the second write would change what the first one's attention saved)."""
        if not self.config.ponder:
            return super().step(tokens, positions, cache, prev=prev, plain=plain, kv_len=kv_len, mask=mask)
        x, token_state = self.plain_input(self.embed_tokens(tokens))[:, None], None
        for slot in (0, 1):
            if slot and torch.is_grad_enabled():
                cache.fork()
            at, seen = 2 * positions + slot, 2 * kv_len - 1 + slot
            visible = None if mask is None else cache.visible(at, seen)
            x, top = self._out(*self._blocks_step(x, at, cache, seen, visible, 0, self.config.n_layers, pairs=True))
            token_state = x if slot == 0 else token_state
        return token_state[:, 0], top[:, 0]

    def _window_mask(self, q_pos: Tensor, k_pos: Tensor, span: int) -> Tensor | None:
        """Sliding-window visibility for the local layers; None when there are none or the window covers `span`."""
        window = self.config.sliding_window
        return None if not self._has_local or window >= span else window_mask(q_pos, k_pos, window)

    # ---------------------------------------------------------------- checks and checkpoints
    def num_params(self, *, fusion: bool = True) -> int:
        return sum(p.numel() for n, p in self.named_parameters() if fusion or not n.startswith("fusion."))

    # Folders are fullband.loader's business (above this package, which imports nothing above it): importing
    # fullband installs its save and load here.
    folder_io: ClassVar[FolderIO | None] = None

    def save(self, directory: str | Path, *, tokenizer=None, overwrite: bool = False) -> Path:
        """config.json + model.safetensors (+ tokenizer.json) into a new or empty folder; overwrite=True replaces
        a model folder saved earlier (never a folder holding anything else)."""
        return _folder_io().save(self, directory, tokenizer=tokenizer, overwrite=overwrite)

    @classmethod
    def load(cls, directory: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> "FullbandLM":
        """The native model a folder holds: a model folder, a training checkpoint, or a transformers folder of ours
        (fullband.load_model also loads a model.hf_path run's wrapped Hugging Face model)."""
        return _folder_io().load(directory, device=device, dtype=dtype)
