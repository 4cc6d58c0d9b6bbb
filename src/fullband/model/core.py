"""The method written once: latent feedback on any transformer stack.

A runtime supplies its stack by subclassing FeedbackModel: the token embedding (`embed_tokens`), the stack over a
whole sequence (`stack`) or one cached position per row (`stack_step`), the head and a new cache, plus the fusion and
its input norm (`fusion`, `norm_in`); a runtime that lets the state enter above block 0 (config.feedback_target)
splits its stack there (`lower`, `lower_step`: the blocks below, which never read the state). Every rule of the
method lives here, once, on top of that (docs/method.md names each one's code): which positions are plain, the
input of the target block at a plain and at a fed position, one Jacobi pass and the pass loop, the exact
recurrence, and how a decoding mode reads a prompt.

The native model (model.decoder), the latent-feedback wrapper of a Hugging Face decoder (hf.feedback) and vLLM's
model (vllm.model) supply their stacks; the transformers class, the decode engine, the evaluators, chat and the
training objective (model.objective) call these rules. Shipped as source with every transformers folder
(fullband.hf.remote): it imports only other shipped modules.

Shapes: B batch, T positions, D model width, V vocabulary."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fullband.errors import InputError
from fullband.model.fusion import fused_input
from fullband.model.mode import DecodeMode
from fullband.validate import integer, number


@dataclass
class ModelOutput:
    """What a forward returns, for its last pass."""

    logits: Tensor | None  # (B, T, V); None when return_logits=False
    hidden: Tensor  # (B, T, D) the state that would be fed back to the next position
    top: Tensor  # (B, T, D) the final-norm output the LM head reads (== hidden when feedback="final")
    passes_used: int = 1  # Jacobi passes run (fewer than asked under `tol`; 0 for the exact recurrence)
    per_pass: list[Any] = field(default_factory=list)  # what `each_pass` returned after every pass, when given


# (pass j >= 1, the previous pass's states, the plain positions) -> (the states pass j reads, its plain positions)
Feed = Callable[[int, Tensor, Tensor], tuple[Tensor, Tensor]]
EachPass = Callable[[int, Tensor, Tensor], Any]  # (pass j >= 0, its fed-back states, its final-norm output)


def plain_positions(ids, positions, bos_token_id: int | None, *, prefix=0, mask=None):
    """Which positions take the plain embedding, elementwise (torch tensors or numpy arrays of one shape, or
    broadcastable: a batch (B, T), a decode step (B,), vLLM's packed rows (N,)): position 0 (nothing before it),
    positions below `prefix` (an int, or one per element), a BOS token (a document starts), and `mask`."""
    plain = (positions < 1) | (positions < prefix)
    if bos_token_id is not None:
        plain = plain | (ids == bos_token_id)
    return plain if mask is None else plain | mask


def shift_right(state: Tensor) -> Tensor:
    """(B, T, D) -> (B, T, D) with position t holding state[t - 1] (zeros at t = 0, which is always plain)."""
    return F.pad(state, (0, 0, 1, 0))[:, : state.shape[1]]


def update_rms(new: Tensor, old: Tensor) -> Tensor:
    """(B,) RMS of a pass's state update h^(j) - h^(j-1) in each row: what adaptive prefill compares with tol."""
    return (new - old).float().pow(2).mean(dim=(1, 2)).sqrt()


class FeedbackModel(nn.Module):
    """A transformer stack with latent feedback. Subclasses set `config` (a ModelConfig: vocab_size, max_seq_len,
    bos_token_id, input_norm, has_feedback, latent_head), `fusion` and `norm_in` (and `latent_head`, the objective's
    next-latent predictor, when config.latent_head asks for one), and implement the five stack methods."""

    config: Any
    fusion: nn.Module | None
    norm_in: nn.Module
    latent_head: nn.Module | None
    # The blend curriculum's weight a (train.blend_until, docs/method.md section 6): a fed position's input is
    # (1 - a) * plain + a * fused, so a warm start begins at the pretrained model (a = 0) and ends at the paper's
    # (a = 1). Set only inside `blended` (the training step); every reader outside it sees the paper's input.
    feed_blend: float = 1.0

    # ---------------------------------------------------------------- what a runtime supplies
    def embed_tokens(self, input_ids: Tensor) -> Tensor:
        """The token embeddings of ids (...,) -> (..., D)."""
        raise NotImplementedError

    def stack(self, x: Tensor, cache=None) -> tuple[Tensor, Tensor]:
        """The blocks from config.feedback_target (default 0: the whole stack) up over their inputs x (B, T, D) at
        positions 0..T-1 (causal) -> (fed-back state: the output config.feedback_source picks, final-norm output),
        both (B, T, D). A `cache` receives their keys and values (replacing what it held)."""
        raise NotImplementedError

    def stack_step(self, x: Tensor, positions: Tensor, cache, kv_len: int, mask: Tensor | None = None):
        """`stack` at one cached position per row: x (B, 1, D) at positions (B,), attending to the cache's first
        kv_len slots (under `mask`, from cache.visible, when rows are at different positions) -> (state, top), both
        (B, 1, D)."""
        raise NotImplementedError

    def lower(self, x: Tensor, cache=None) -> Tensor:
        """The blocks below config.feedback_target over stack inputs x (B, T, D) -> the target block's input (B, T, D);
        a `cache` receives their keys and values. None at target 0 (the default): x itself."""
        return self._no_lower(x)

    def lower_step(self, x: Tensor, positions: Tensor, cache, kv_len: int, mask: Tensor | None = None) -> Tensor:
        """`lower` at one cached position per row (as stack_step): x (B, 1, D) -> (B, 1, D)."""
        return self._no_lower(x)

    def _no_lower(self, x: Tensor) -> Tensor:
        if self.config.feedback_target:  # a runtime's config check refuses this first, by name
            raise NotImplementedError(f"{type(self).__name__} does not split its stack at feedback_target="
                                      f"{self.config.feedback_target}")
        return x

    def head(self, top: Tensor) -> Tensor:
        """(..., D) -> logits (..., V)."""
        raise NotImplementedError

    def new_cache(self, batch: int, max_len: int):
        """An empty cache for `batch` rows of up to `max_len` positions; it offers visible(positions, kv_len) and
        grow(max_len)."""
        raise NotImplementedError

    # ---------------------------------------------------------------- the stack input
    def plain_input(self, e: Tensor) -> Tensor:
        """The stack input of a plain position from its token embedding: norm_in(e) (the paper's input RMSNorm), or
        e itself when config.input_norm is false (Llama-style models, so a converted one computes what it did)."""
        return self.norm_in(e) if self.config.input_norm else e

    def embed_inputs(self, input_ids: Tensor, cache=None) -> Tensor:
        """The plain inputs of the target block for ids (B, T) -> (B, T, D): the plain stack input through the blocks
        below it (`lower`, whose keys and values a `cache` receives), computed once whatever the passes, since those
        blocks never read the state. At target 0 (the default) any shape (...,) -> (..., D)."""
        return self.lower(self.plain_input(self.embed_tokens(input_ids)), cache)

    def fuse(self, e: Tensor, prev: Tensor) -> Tensor:
        """norm_in(fuse(e, prev)) for plain inputs e (..., D) and the states they read, prev (..., D). The gate reads
        a gain-free RMS-normalised e unless e is norm_in's output (input_norm, target block 0)."""
        normalised = self.config.input_norm and not self.config.feedback_target
        return fused_input(self.fusion, self.norm_in, e, prev, normalise_gate=not normalised)

    def pass_inputs(self, e: Tensor, prev: Tensor | None, plain: Tensor | None) -> Tensor:
        """Stack inputs: each position of e fused with the state it reads (prev, aligned with e), except the `plain`
        ones (a bool mask broadcastable to e's leading dims), which keep e; prev None: all plain."""
        if prev is None:
            return e
        fused = self.fuse(e, prev)
        if self.feed_blend != 1.0:  # lerp does not promote: under autocast fused is the lower precision
            dtype = torch.promote_types(e.dtype, fused.dtype)
            fused = torch.lerp(e.to(dtype), fused.to(dtype), self.feed_blend)
        return fused if plain is None else torch.where(plain[..., None], e, fused)

    @contextlib.contextmanager
    def blended(self, weight: float):
        """Inside, fed positions take (1 - weight) * plain + weight * fused (the blend curriculum; 1: the paper's
        input); restored on exit."""
        number("blend weight", weight, low=0, high=1, error=InputError)
        before, self.feed_blend = self.feed_blend, float(weight)
        try:
            yield self
        finally:
            self.feed_blend = before

    def plain_of(self, input_ids: Tensor, positions: Tensor | None = None, *, prefix=0, mask=None) -> Tensor:
        """plain_positions of input_ids at `positions` (default: 0..T-1 of a batch (B, T)) for this model's BOS."""
        if positions is None:
            positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
        if mask is not None:
            mask = mask.to(device=input_ids.device, dtype=torch.bool)
        plain = plain_positions(input_ids, positions, self.config.bos_token_id, prefix=prefix, mask=mask)
        return plain.expand(input_ids.shape)

    # ---------------------------------------------------------------- Jacobi passes
    def exact_passes(self, length: int) -> int:
        """Jacobi passes after which `length` positions are at the fixed point (position t is final after t + 1)."""
        return length

    @property
    def state_lag(self) -> int:
        """How far back the state a fed position reads sits: 1, position t reads prev[t - 1] (jacobi_pass's shift,
        the decode step's carried state). So prompt positions read the states at positions < prompt length - lag."""
        return 1

    def jacobi_pass(self, e: Tensor, prev: Tensor | None = None, plain: Tensor | None = None, *,
                    cache=None) -> tuple[Tensor, Tensor]:
        """One Jacobi pass over all positions: position t reads prev[t - 1], the previous pass's state, unless
        `plain` (B, T) marks it; prev None is the plain pass. -> (fed-back state, final-norm output)."""
        return self.stack(self.pass_inputs(e, None if prev is None else shift_right(prev), plain), cache)

    def iterate(self, e: Tensor, plain: Tensor, passes: int, *, cache=None, tol: float | None = None,
                feed: Feed | None = None, each_pass: EachPass | None = None) -> tuple[Tensor, Tensor, int, list]:
        """The pass loop over plain inputs e (B, T, D): pass 1 is the plain stack; pass j > 1 feeds each position the
        state of its predecessor in pass j - 1 (`feed` may change what is fed, and which positions are plain: the
        training objective's jitter and prefix mixin). Stops after `passes`, or once every row's RMS update is below
        `tol`. Two passes' states are alive at a time. A `cache` receives the last pass's keys and values (every
        pass's under `tol`: any may be the last). -> (state, top, passes run, what each_pass returned per pass)."""
        state, seen = None, []
        for j in range(passes):
            prev, mask = (None, plain) if j == 0 else (feed(j, state, plain) if feed else (state, plain))
            last = j == passes - 1
            new, top = self.jacobi_pass(e, prev, mask, cache=cache if (last or tol is not None) else None)
            if tol is not None and j > 0:
                last = last or bool((update_rms(new, state) < tol).all())
            prev = state = new
            if each_pass is not None:
                seen.append(each_pass(j, state, top))
            if last:
                return state, top, j + 1, seen
        raise AssertionError("unreachable: passes >= 1")

    def forward(self, input_ids: Tensor, passes: int = 1, *, plain_mask: Tensor | None = None, cache=None,
                tol: float | None = None, feed: Feed | None = None, each_pass: EachPass | None = None,
                return_logits: bool = True) -> ModelOutput:
        """`passes` Jacobi passes over input_ids (B, T) in parallel; pass 1 is an ordinary transformer. Positions in
        `plain_mask` (B, T) stay plain in every pass (beside position 0 and BOS). With `tol`, the loop stops once
        every row's RMS update is below tol (adaptive prefill). `feed` and `each_pass` are the training objective's
        hooks (see iterate); a `cache` receives the last pass's keys and values."""
        self.check_ids(input_ids)
        passes = self.check_passes(passes)
        e = self.embed_inputs(input_ids, cache)
        state, top, used, seen = self.iterate(e, self.plain_of(input_ids, mask=plain_mask), passes, cache=cache,
                                              tol=tol, feed=feed, each_pass=each_pass)
        return ModelOutput(self.head(top) if return_logits else None, state, top, used, seen)

    # ---------------------------------------------------------------- the exact recurrence and one decode step
    def step(self, tokens: Tensor, positions: Tensor, cache, *, prev: Tensor | None = None,
             plain: Tensor | None = None, kv_len: int, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """One cached position per row: tokens (B,) at positions (B,), fed the states prev (B, D) (None: plain) unless
        the plain rule (or `plain` (B,)) says otherwise -> (state (B, D), final-norm output (B, D))."""
        e = self.plain_input(self.embed_tokens(tokens))
        e = self.lower_step(e[:, None], positions, cache, kv_len, mask)[:, 0]
        if prev is not None:
            e = self.pass_inputs(e, prev, self.plain_of(tokens, positions, mask=plain))
        state, top = self.stack_step(e[:, None], positions, cache, kv_len, mask)
        return state[:, 0], top[:, 0]

    @torch.no_grad()
    def recurrent_forward(self, input_ids: Tensor, plain_prefix: int = 0, *, plain_mask: Tensor | None = None,
                          cache=None, return_logits: bool = True) -> ModelOutput:
        """The exact latent-feedback recurrence, one position at a time: position t takes fuse(e_t, h_{t-1}) unless
        it is plain (t < plain_prefix, t = 0, BOS, or in plain_mask). The Jacobi iteration's fixed point."""
        self.check_ids(input_ids)
        B, T = input_ids.shape
        plain = self.plain_of(input_ids, prefix=plain_prefix, mask=plain_mask)
        if not self.config.has_feedback and not bool(plain.all()):
            raise InputError("recurrent_forward needs feedback weights; this model has fusion='none'")
        cache = cache if cache is not None else self.new_cache(B, T)
        states, tops, state = [], [], None
        for t in range(T):
            positions = torch.full((B,), t, device=input_ids.device)
            state, top = self.step(input_ids[:, t], positions, cache, prev=state, plain=plain[:, t], kv_len=t + 1)
            states.append(state)
            tops.append(top)
        hidden, top = torch.stack(states, 1), torch.stack(tops, 1)
        return ModelOutput(self.head(top) if return_logits else None, hidden, top, passes_used=0)

    # ---------------------------------------------------------------- a prompt as a mode reads it
    def read(self, input_ids: Tensor, mode: DecodeMode, *, cache=None, plain_mask: Tensor | None = None,
             return_logits: bool = False, each_pass: EachPass | None = None, fed: Tensor | None = None) -> ModelOutput:
        """Prompts input_ids (B, T) as `mode` reads them (DecodeMode.read decides how: the recurrence, or its passes
        capped at exact_passes(T)). A `cache` receives the keys and values; `each_pass` sees every Jacobi pass (as
        in iterate). `fed` (B, T), in SOFT only: positions read as they were generated, fed the previous position's
        state (a conversation's earlier replies), the rest of the prompt plain."""
        if fed is not None:
            fed = fed.to(device=input_ids.device, dtype=torch.bool)
        T = input_ids.shape[1]
        how = mode.read(T, int(fed.sum(-1).max()) if fed is not None and fed.numel() else 0,
                        fixed_point=self.exact_passes(T))
        if fed is not None and how.plain_prompt:
            plain_mask = ~fed if plain_mask is None else plain_mask | ~fed
        if how.exact:
            return self.recurrent_forward(input_ids, plain_mask=plain_mask, cache=cache, return_logits=return_logits)
        return self(input_ids, passes=how.passes, plain_mask=plain_mask, cache=cache, tol=how.tol,
                    return_logits=return_logits, each_pass=each_pass)

    # ---------------------------------------------------------------- checks
    def check_ids(self, input_ids: Tensor) -> None:
        """Raise InputError unless input_ids is an integer (B, T) tensor of in-vocabulary ids, T <= max_seq_len."""
        check_ids(input_ids, self.config.vocab_size, self.config.max_seq_len)

    def check_passes(self, passes: int) -> int:
        integer("passes", passes, 1, error=InputError)
        if passes > 1 and not self.config.has_feedback:
            raise InputError(f"passes={passes} needs feedback weights; this model has fusion='none' (passes=1 only)")
        return int(passes)


def check_ids(input_ids: Tensor, vocab_size: int, max_seq_len: int) -> None:
    """Raise InputError unless input_ids is an integer (B, T) tensor of ids in [0, vocab_size), T <= max_seq_len."""
    if not isinstance(input_ids, Tensor):
        raise InputError(f"input_ids must be a torch.Tensor of shape (B, T), got {type(input_ids).__name__}")
    if input_ids.ndim != 2 or input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise InputError(f"input_ids must be an integer tensor of shape (B, T); got dtype {input_ids.dtype}, "
                         f"shape {tuple(input_ids.shape)}")
    if input_ids.shape[1] == 0 or input_ids.shape[0] == 0:
        raise InputError(f"input_ids is empty (shape {tuple(input_ids.shape)}); need B >= 1 and T >= 1")
    if input_ids.shape[1] > max_seq_len:
        raise InputError(f"sequence length {input_ids.shape[1]} exceeds max_seq_len={max_seq_len}")
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise InputError(f"token id {bad} is out of range; accepted: 0 <= id < vocab_size={vocab_size}")
