"""FullbandLM: a decoder-only LM whose input can fuse the previous position's top state (latent feedback).

Three ways to run the same weights:
  forward(ids, passes=k)   k time-parallel (Jacobi) passes (each one `jacobi_pass`); pass 1 is an ordinary
                           transformer
  recurrent_forward(ids)   the exact sequential recurrence, token by token (the ground truth)
  step(tokens, ...)        one cached decode step, shared by every decoding mode

forward, recurrent_forward, step, head and new_cache are the decode interface fullband.decode drives (the
latent-feedback wrapper around a Hugging Face model implements the same).

Shapes: B batch, T positions, D model width, V vocabulary, k passes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fullband.model.cache import KVCache
from fullband.errors import InputError
from fullband.model.attention import Attention, window_mask
from fullband.model.config import ModelConfig
from fullband.model.fusion import build_fusion, fused_input, init_fusion_weight_
from fullband.model.layers import RMSNorm, Rotary, SwiGLU, linear
from fullband.validate import integer


class FolderIO(NamedTuple):
    save: Callable
    load: Callable


def _folder_io() -> FolderIO:
    if FullbandLM.folder_io is None:  # only without `import fullband` having run, which every import does
        raise RuntimeError("FullbandLM.save / load need fullband.checkpoint: import fullband first")
    return FullbandLM.folder_io


@dataclass
class ModelOutput:
    """What a forward returns; everything is for the last pass unless named `pass_*`."""

    logits: Tensor | None  # (B, T, V); None when return_logits=False
    hidden: Tensor  # (B, T, D) the state that would be fed back to the next position
    top: Tensor  # (B, T, D) the final-norm output the LM head reads (== hidden when feedback="final")
    loss: Tensor | None = None  # the multi-pass objective, when targets were given
    pass_losses: list[Tensor] = field(default_factory=list)  # NTP loss of every pass (targets given)
    pass_logits: list[Tensor] = field(default_factory=list)  # every pass's logits (training, no targets)
    pass_hidden: list[Tensor] = field(default_factory=list)  # every pass's fed-back state
    pass_z: list[Tensor] = field(default_factory=list)  # every pass's mean logsumexp^2 (z_loss > 0)
    passes_used: int = 0  # passes run (fewer than asked when `tol` stopped the iteration)
    update_rms: list[Tensor] = field(default_factory=list)  # (B,) RMS of h^(j) - h^(j-1) per pass (with `tol`)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, layer)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.d_ff)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, **attn_kwargs) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, **attn_kwargs)
        return x + self.mlp(self.mlp_norm(x))


class FullbandLM(nn.Module):
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
        self._has_local = any(cfg.is_local(i) for i in range(cfg.n_layers))
        self.reset_parameters()

    # ---------------------------------------------------------------- initialisation
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, init_std) weights; residual-branch outputs scaled by 1/sqrt(2L) so the top state's norm
        stays O(1) as depth grows; fusion matrices at 1/sqrt(fan_in) (DECISION: the fused input starts at
        unit scale, gates spread over sigmoid's range); every norm gain at 1."""
        for name, p in self.named_parameters():
            init_parameter_(name, p, self.config)

    # ---------------------------------------------------------------- pieces
    def plain_positions(self, input_ids: Tensor, plain_mask: Tensor | None = None, plain_prefix: int = 0) -> Tensor:
        """(B, T) bool: positions that take the plain embedding (position 0, BOS, a plain prefix, a mask)."""
        return plain_positions(input_ids, self.config.bos_token_id, plain_mask, plain_prefix)

    def embed_inputs(self, input_ids: Tensor) -> Tensor:
        """The plain stack input: norm_in(embedding), or the raw embedding when config.input_norm is false."""
        e = self.embed(input_ids)
        return self.norm_in(e) if self.config.input_norm else e

    def fuse_inputs(self, e: Tensor, prev: Tensor | None, plain: Tensor | None = None) -> Tensor:
        """Stack input: e = embed_inputs(ids) (B, T, D); prev (B, T, D) the state each position reads
        (already shifted). Positions in `plain` (B, T), or all when prev is None, keep e."""
        if prev is None:
            return e
        return fused_input(self.fusion, self.norm_in, e, prev, plain, normalise_gate=not self.config.input_norm)

    def body(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache | None = None, **step) -> tuple[Tensor, Tensor]:
        """Run the blocks on stack inputs x (B, T, D) -> (fed-back state, final-norm output), both (B, T, D)."""
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, kv=None if cache is None else cache.layer(i), **step)
        top = self.norm_out(x)
        return (top if self.config.feedback == "final" else x), top

    def head(self, top: Tensor) -> Tensor:
        """LM head (tied to the embedding unless config.tie_embeddings is false): (..., D) -> logits (..., V)."""
        return linear(top, self.embed.weight if self.lm_head is None else self.lm_head.weight)

    # ---------------------------------------------------------------- time-parallel passes
    def jacobi_pass(self, e: Tensor, prev: Tensor | None = None, plain: Tensor | None = None, *,
                    cache: KVCache | None = None) -> tuple[Tensor, Tensor]:
        """One Jacobi pass over all positions. The stack inputs are built from the token inputs e =
        embed_inputs(ids) (B, T, D) and the previous pass's fed-back states prev (B, T, D): position t reads
        prev[t - 1] unless `plain` (B, T) marks it; prev None is the plain pass. -> (fed-back state, final-norm
        output), both (B, T, D). A `cache` receives this pass's keys and values."""
        x = e if prev is None else self.fuse_inputs(e, shift_right(prev), plain)
        T = e.shape[1]
        cos, sin = self.rotary.prefix(T, e.dtype)
        span = torch.arange(T, device=e.device)
        return self.body(x, cos, sin, cache=cache, window_mask=self._window_mask(span, span, T))

    def forward(
        self,
        input_ids: Tensor,
        passes: int = 1,
        *,
        targets: Tensor | None = None,
        plain_mask: Tensor | None = None,
        generator: torch.Generator | None = None,
        cache: KVCache | None = None,
        return_logits: bool = True,
        z_loss: float = 0.0,
        tol: float | None = None,
    ) -> ModelOutput:
        """k Jacobi passes over all positions in parallel.

        Pass 1 is the standard forward. Pass j > 1 feeds position t the state h_{t-1} of pass j-1; in
        training mode that state gets uniform jitter and each sequence a random plain prefix. With
        `targets` (B, T) (-100 = ignore) the output carries every pass's NTP loss and the objective
        NTP(1) + pass_loss_weight * mean(NTP(2..k)), each pass's term plus z_loss * mean(logsumexp(logits)^2)
        when z_loss > 0. A `cache` receives the last pass's keys and values. With `tol`, iteration stops early
        once the RMS update ||h^(j) - h^(j-1)|| of every row is below tol (adaptive prefill); `passes` caps it.
        """
        self.check_ids(input_ids)
        passes = _check_passes(passes, self.config)
        return multipass(self, input_ids, passes, targets=targets, plain_mask=plain_mask, generator=generator,
                         return_logits=return_logits, z_loss=z_loss, tol=tol, cache=cache)

    def _window_mask(self, q_pos: Tensor, k_pos: Tensor, span: int) -> Tensor | None:
        """Sliding-window visibility for the local layers; None when there are none or the window covers `span`."""
        window = self.config.sliding_window
        if not self._has_local or window >= span:
            return None
        return window_mask(q_pos, k_pos, window)

    # ---------------------------------------------------------------- exact recurrence and decode step
    @torch.no_grad()
    def recurrent_forward(
        self,
        input_ids: Tensor,
        plain_prefix: int = 0,
        *,
        plain_mask: Tensor | None = None,
        cache: KVCache | None = None,
        return_logits: bool = True,
    ) -> ModelOutput:
        """The exact latent-feedback recurrence, one position at a time: position t takes
        fuse(e_t, h_{t-1}) unless it is plain (t < plain_prefix, t = 0, BOS, or in plain_mask)."""
        self.check_ids(input_ids)
        B, T = input_ids.shape
        plain = self.plain_positions(input_ids, plain_mask, plain_prefix)
        if not self.config.has_feedback and not bool(plain.all()):
            raise InputError("recurrent_forward needs feedback weights; this model has fusion='none'")
        cache = cache if cache is not None else KVCache.for_model(self, B, T)
        states, tops = [], []
        state = None
        for t in range(T):
            positions = torch.full((B,), t, device=input_ids.device)
            state, top = self.step(input_ids[:, t], positions, cache, prev=state, plain=plain[:, t], kv_len=t + 1)
            states.append(state)
            tops.append(top)
        hidden, top = torch.stack(states, 1), torch.stack(tops, 1)
        return ModelOutput(logits=self.head(top) if return_logits else None, hidden=hidden, top=top)

    def step(
        self,
        tokens: Tensor,
        positions: Tensor,
        cache: KVCache,
        *,
        prev: Tensor | None = None,
        plain: Tensor | None = None,
        kv_len: int,
        mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """One cached position per row: tokens (B,) at positions (B,), fed the states prev (B, D) (none: plain)
        -> (state (B, D), final-norm output (B, D)). `plain` (B,) marks rows that ignore prev."""
        e = self.embed_inputs(tokens[:, None])  # (B, 1, D)
        x = self.fuse_inputs(e, None if prev is None else prev[:, None], None if plain is None else plain[:, None])
        cos, sin = self.rotary.at(positions, e.dtype)
        slots = cache.slots(positions)
        local = self._window_mask(positions[:, None], torch.arange(kv_len, device=positions.device), kv_len)
        if local is not None:  # (B, 1, kv_len) -> (B, 1, 1, kv_len)
            local = local[:, None]
        state, top = self.body(x, cos, sin, cache=cache, slots=slots, kv_len=kv_len, mask=mask, window_mask=local)
        return state[:, 0], top[:, 0]

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty KV cache for `batch` rows of up to `max_len` positions, in this model's dtype and device."""
        return KVCache.for_model(self, batch, max_len)

    # ---------------------------------------------------------------- checks and checkpoints
    def check_ids(self, input_ids: Tensor) -> None:
        """Raise InputError unless input_ids is an integer (B, T) tensor of in-vocabulary ids, T <= max_seq_len."""
        check_ids(input_ids, self.config.vocab_size, self.config.max_seq_len)

    def num_params(self, *, fusion: bool = True) -> int:
        return sum(p.numel() for n, p in self.named_parameters() if fusion or not n.startswith("fusion."))

    # Folders are fullband.checkpoint's business (above this package, which imports nothing above it): importing
    # fullband installs its save and load here.
    folder_io: ClassVar[FolderIO | None] = None

    def save(self, directory: str | Path, *, tokenizer=None, overwrite: bool = False) -> Path:
        """config.json + model.safetensors (+ tokenizer.json) into a new or empty folder; overwrite=True replaces
        a model folder saved earlier (never a folder holding anything else)."""
        return _folder_io().save(self, directory, tokenizer=tokenizer, overwrite=overwrite)

    @classmethod
    def load(cls, directory: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> "FullbandLM":
        """The model a folder holds (a folder of a model.hf_path run loads as its wrapped Hugging Face model)."""
        return _folder_io().load(directory, device=device, dtype=dtype)


def multipass(net, input_ids: Tensor, passes: int, *, targets: Tensor | None = None,
              plain_mask: Tensor | None = None, generator: torch.Generator | None = None, return_logits: bool = True,
              z_loss: float = 0.0, tol: float | None = None, cache=None) -> ModelOutput:
    """The time-parallel multi-pass forward of FullbandLM.forward, for any `net` with `config` (the multi-pass
    knobs, bos_token_id), `training`, `embed_inputs`, `plain_positions`, `jacobi_pass` and `head`."""
    cfg = net.config
    B, T = input_ids.shape
    e = net.embed_inputs(input_ids)  # (B, T, D)
    plain = net.plain_positions(input_ids, plain_mask)
    out = ModelOutput(logits=None, hidden=e, top=e)
    training = net.training
    state = logits = prev = None
    mask = plain
    for j in range(passes):
        if j > 0:
            prev = state.detach() if cfg.detach_between_passes else state
            if training and cfg.jitter > 0:
                noise = torch.empty(prev.shape, dtype=prev.dtype, device=prev.device)
                prev = prev + noise.uniform_(-cfg.jitter, cfg.jitter, generator=generator)
            if training and cfg.prefix_mixin_prob > 0:
                mask = plain | prefix_mixin(B, T, cfg.prefix_mixin_prob, input_ids.device, generator)
        last = j == passes - 1
        # with a tolerance any pass may be the last, so each one (re)writes the cache
        write = cache is not None and (last or tol is not None)
        new_state, top = net.jacobi_pass(e, prev, mask, cache=cache if write else None)
        if tol is not None and j > 0:  # Jacobi convergence: RMS update of every row below tol
            update = (new_state - state).float().pow(2).mean(dim=(1, 2)).sqrt()
            out.update_rms.append(update)
            last = last or bool((update < tol).all())
        state = new_state
        out.pass_hidden.append(state)
        out.passes_used = j + 1
        if targets is not None or training or (last and return_logits):
            logits = net.head(top)
            if targets is not None:
                flat = logits.flatten(0, 1).float()
                out.pass_losses.append(F.cross_entropy(flat, targets.flatten()))
                if z_loss > 0:
                    out.pass_z.append(flat.logsumexp(-1).pow(2).mean())
            elif training:
                out.pass_logits.append(logits)
        if last:
            break
    out.hidden, out.top = state, top
    out.logits = logits if return_logits else None
    if targets is not None:
        terms = out.pass_losses
        if z_loss > 0:
            terms = [ce + z_loss * z for ce, z in zip(out.pass_losses, out.pass_z)]
        out.loss = terms[0]
        if len(terms) > 1:
            out.loss = out.loss + cfg.pass_loss_weight * torch.stack(terms[1:]).mean()
    return out


def prefix_mixin(B: int, T: int, prob: float, device: torch.device, generator: torch.Generator | None) -> Tensor:
    """(B, T) bool: with probability `prob` a sequence reverts positions t <= p, p ~ U[0, T), to plain inputs."""
    use = torch.rand(B, device=device, generator=generator) < prob
    p = torch.randint(0, T, (B,), device=device, generator=generator)
    return use[:, None] & (torch.arange(T, device=device)[None, :] <= p[:, None])


@torch.no_grad()
def init_parameter_(name: str, p: Tensor, cfg: ModelConfig) -> Tensor:
    """The initialisation of FullbandLM parameter `name` (see FullbandLM.reset_parameters)."""
    if p.ndim == 1 or name.endswith("qk_gain"):
        return nn.init.ones_(p)
    if name.startswith("fusion."):
        return init_fusion_weight_(p)
    if name.endswith(("attn.wo.weight", "mlp.w_down.weight")):
        return nn.init.normal_(p, std=cfg.init_std / (2 * cfg.n_layers) ** 0.5)
    return nn.init.normal_(p, std=cfg.init_std)


def check_ids(input_ids: Tensor, vocab_size: int, max_seq_len: int) -> None:
    """Raise InputError unless input_ids is an integer (B, T) tensor of ids in [0, vocab_size), T <= max_seq_len."""
    if not isinstance(input_ids, Tensor):
        raise InputError(f"input_ids must be a torch.Tensor of shape (B, T), got {type(input_ids).__name__}")
    if input_ids.ndim != 2 or input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise InputError(
            f"input_ids must be an integer tensor of shape (B, T); got dtype {input_ids.dtype}, "
            f"shape {tuple(input_ids.shape)}"
        )
    if input_ids.shape[1] == 0 or input_ids.shape[0] == 0:
        raise InputError(f"input_ids is empty (shape {tuple(input_ids.shape)}); need B >= 1 and T >= 1")
    if input_ids.shape[1] > max_seq_len:
        raise InputError(f"sequence length {input_ids.shape[1]} exceeds max_seq_len={max_seq_len}")
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise InputError(f"token id {bad} is out of range; accepted: 0 <= id < vocab_size={vocab_size}")


def plain_positions(input_ids: Tensor, bos_token_id: int | None, plain_mask: Tensor | None = None,
                    plain_prefix: int = 0) -> Tensor:
    """(B, T) bool: positions that take the plain embedding: t < max(plain_prefix, 1), BOS, or in plain_mask."""
    B, T = input_ids.shape
    plain = (torch.arange(T, device=input_ids.device) < max(plain_prefix, 1)).expand(B, T)
    if bos_token_id is not None:
        plain = plain | (input_ids == bos_token_id)
    if plain_mask is not None:
        plain = plain | plain_mask.to(device=input_ids.device, dtype=torch.bool)
    return plain


def shift_right(state: Tensor) -> Tensor:
    """(B, T, D) -> (B, T, D) with position t holding state[t - 1] (zeros at t = 0, which is always plain)."""
    return F.pad(state, (0, 0, 1, 0))[:, : state.shape[1]]


def _check_passes(passes: int, cfg: ModelConfig) -> int:
    integer("passes", passes, 1, error=InputError)
    if passes > 1 and not cfg.has_feedback:
        raise InputError(f"passes={passes} needs feedback weights; this model has fusion='none' (passes=1 only)")
    return passes
