"""The decode engine: every mode (fullband.decode.mode) is one prefill followed by the same decode step, for any
model that implements the small decode interface, and for whoever drives it (generate / stream, score, the
transformers class, the latent-feedback wrapper around a Hugging Face model).

The decode interface (duck-typed; FullbandLM and fullband.hf.LatentFeedback implement it):
  config                                   vocab_size, max_seq_len, bos_token_id, has_feedback
  new_cache(batch, max_len)                an empty cache; it offers visible(positions, kv_len) (a mask for rows
                                           at different positions) and grow(max_len)
  forward(ids, passes, cache=, tol=, return_logits=False)   Jacobi passes; the last one writes the cache
  recurrent_forward(ids, cache=, return_logits=False)       the exact recurrence, writing the cache
  step(tokens, positions, cache, prev=, plain=, kv_len=, mask=) -> (state, top): one position per row
  head(top) -> logits

Prompts of different lengths are right-padded; each row advances at its own position. What decoding carries
from one position to the next (and could carry from one call to the next: a conversation's turns) is a
DecodeState: the cache, each row's next position and its fed-back state.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fullband.decode.mode import MODES, DecodeMode
from fullband.decode.sampling import sample
from fullband.errors import InputError
from fullband.model.cache import KVCache
from fullband.validate import integer, number

__all__ = ["MODES", "DecodeMode", "DecodeState", "Step", "advance", "decode", "generate", "prefill", "stream"]


@dataclass
class Step:
    """One generated position for every row of the batch."""

    tokens: Tensor  # (B,) the sampled token of each row
    logits: Tensor  # (B, V) the logits it was sampled from
    finished: Tensor  # (B,) bool: the row had already emitted a stop token (its token here is filler)
    prefill_passes: int = 1  # Jacobi passes the prompt got (1 + fused passes; fewer than the cap under "auto")


@dataclass
class DecodeState:
    """What a decode step reads and advances: the model's cache, each row's next position (B,) and fed-back state
    (B, D) from its last position. `longest` (1 + the largest position written, a host int) and `ragged` (rows at
    different positions) stay on the host, so a step never reads positions back from the device; after rows are
    selected (beam search) both stay as they were: an upper bound and a mask that is merely unneeded are exact."""

    cache: Any
    positions: Tensor
    state: Tensor
    longest: int
    ragged: bool


# ---------------------------------------------------------------------- the two primitives
def prefill(model, ids: Tensor, lengths: Tensor, mode: DecodeMode, *, room: int, longest: int | None = None,
            return_logits: bool = False):
    """Run right-padded prompts ids (B, T) (row b real for its first lengths[b] positions) through `model` as
    `mode` reads them, into a new cache with `room` more positions per row. -> (DecodeState, the ModelOutput of
    the prompt: hidden / top for every position, passes_used: Jacobi passes run, 0 for the exact recurrence)."""
    B, T = ids.shape
    longest = int(lengths.max()) if longest is None else longest
    cache = model.new_cache(B, longest + room)
    if mode.exact:
        out = model.recurrent_forward(ids, cache=cache, return_logits=return_logits)
        out.passes_used = 0
    else:
        out = model(ids, passes=mode.prompt_passes(T), cache=cache, return_logits=return_logits, tol=mode.tolerance)
    rows = torch.arange(B, device=ids.device)
    state = DecodeState(cache, lengths.clone(), out.hidden[rows, lengths - 1], longest,
                        ragged=bool((lengths != longest).any()))
    return state, out


def advance(model, state: DecodeState, tokens: Tensor, mode: DecodeMode, stepper=None) -> Tensor:
    """One decode step: tokens (B,) go in at each row's next position, fed each row's state unless the mode is
    STANDARD (BOS tokens stay plain); `state` advances. -> logits (B, V) for the next position."""
    kv_len = state.longest + 1
    max_len = model.config.max_seq_len
    if kv_len > max_len:
        raise InputError(f"sequence length {kv_len} exceeds max_seq_len={max_len}")
    if kv_len > state.cache.max_len:  # the transformers class does not know its final length up front
        state.cache.grow(min(2 * state.cache.max_len, max_len))
    prev = plain = None
    if mode.feeds_state:
        bos = model.config.bos_token_id
        prev, plain = state.state, (tokens == bos if bos is not None else None)
    step = stepper or make_stepper(model, state)
    new_state, logits = step(tokens, state.positions, prev, plain, kv_len)
    state.state, state.positions, state.longest = new_state, state.positions + 1, kv_len
    return logits


def _step(model, ks: list[Tensor], vs: list[Tensor], tokens, positions, prev, plain, kv_len: int, mask):
    """One native decode step over the cache tensors ks, vs -> (state (B, D), logits (B, V))."""
    cache = KVCache.wrap(ks, vs)
    state, top = model.step(tokens, positions, cache, prev=prev, plain=plain, kv_len=kv_len, mask=mask)
    return state, model.head(top)


_COMPILED: dict[str, object] = {}


def make_stepper(model, state: DecodeState, *, compile: bool = False):
    """The decode step advance calls: (tokens, positions, prev, plain, kv_len) -> (state, logits), attending to
    the first kv_len positions, masked per row only for ragged batches. A native model's step can be compiled:
    the cache tensors and kv_len are dynamic graph inputs, so one compile serves every batch size, cache and
    length; other models run it through torch.compile as it comes (graph breaks allowed)."""
    cache = state.cache
    if isinstance(cache, KVCache):
        fn = _step
        if compile:
            kind = next(model.parameters()).device.type
            if kind not in _COMPILED:
                # one graph per model, dtype, mode (state or not), batch 1 or more, ragged or not: allow them all
                import torch._dynamo.config as dynamo_config

                name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
                setattr(dynamo_config, name, max(getattr(dynamo_config, name), 64))
                # on CPU the C++ wrapper removes the Python overhead between kernels (the batch-1 bottleneck)
                options = {"cpp_wrapper": True} if kind == "cpu" else None
                _COMPILED[kind] = torch.compile(_step, dynamic=True, fullgraph=True, options=options)
            fn = _COMPILED[kind]

        def native(tokens, positions, prev, plain, kv_len):
            mask = cache.visible(positions, kv_len) if state.ragged else None
            return fn(model, cache.k, cache.v, tokens, positions, prev, plain, kv_len, mask)

        return native

    step = torch.compile(model.step, dynamic=True) if compile else model.step

    def other(tokens, positions, prev, plain, kv_len):
        mask = cache.visible(positions, kv_len) if state.ragged else None
        new_state, top = step(tokens, positions, cache, prev=prev, plain=plain, kv_len=kv_len, mask=mask)
        return new_state, model.head(top)

    return other


# ---------------------------------------------------------------------- the loop
def stream(
    model,
    prompts,
    max_new_tokens: int,
    *,
    mode: str | DecodeMode = "soft",
    prefill_passes: int | str = 1,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop_tokens: Sequence[int] | None = None,
    compile: bool = False,
    prefill_tol: float = 1e-3,
    max_prefill_passes: int = 32,
    forced_tokens=None,
) -> Iterator[Step]:
    """Yield one Step per generated position. Arguments are checked now, before the first step.

    `compile=True` runs the decode step through torch.compile (the first call compiles for a while; later
    ones are faster than eager, on CPU mostly at batch 1). `prefill_passes="auto"` (fused mode) iterates
    fused passes until the RMS state update falls below `prefill_tol`, at most `max_prefill_passes`.
    `forced_tokens` (B, max_new_tokens) feeds the given tokens instead of sampled ones (teacher forcing): each
    Step's logits then score the forced token, exactly as decoding in `mode` would see it. This public entry
    takes a native FullbandLM; a model wrapped with add_latent_feedback decodes with its own .generate."""
    from fullband.model.decoder import FullbandLM

    if not isinstance(model, FullbandLM):
        raise InputError(f"{type(model).__name__} has no native decode step; fullband.generate / stream / score need a "
                         "FullbandLM (a model wrapped with add_latent_feedback decodes with its own .generate; a "
                         "Llama converts to a FullbandLM with `fullband convert`)")
    return decode(model, prompts, max_new_tokens, mode=mode, prefill_passes=prefill_passes, temperature=temperature,
                  top_k=top_k, top_p=top_p, seed=seed, stop_tokens=stop_tokens, compile=compile,
                  prefill_tol=prefill_tol, max_prefill_passes=max_prefill_passes, forced_tokens=forced_tokens)


def decode(model, prompts, max_new_tokens: int, *, mode: str | DecodeMode = "soft", prefill_passes: int | str = 1,
           temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
           stop_tokens: Sequence[int] | None = None, compile: bool = False, prefill_tol: float = 1e-3,
           max_prefill_passes: int = 32, forced_tokens=None) -> Iterator[Step]:
    """`stream` for any model with the decode interface (see the module docstring)."""
    cfg = model.config
    ids, lengths = _pack_prompts(prompts, cfg.vocab_size)
    integer("max_new_tokens", max_new_tokens, 1, error=InputError)
    dm = DecodeMode.of(mode, prefill_passes, tol=prefill_tol, max_passes=max_prefill_passes).check(cfg)
    longest = int(lengths.max())
    if longest + max_new_tokens > cfg.max_seq_len:
        raise InputError(
            f"prompt length {longest} + max_new_tokens {max_new_tokens} = {longest + max_new_tokens} exceeds "
            f"max_seq_len={cfg.max_seq_len}; shorten the prompt or ask for at most "
            f"{max(cfg.max_seq_len - longest, 0)} new tokens"
        )
    check_sampling(temperature, top_k, top_p, seed)
    stops = _check_stop_tokens(stop_tokens, cfg.vocab_size)
    forced = None
    if forced_tokens is not None:
        forced = torch.as_tensor(forced_tokens)
        if forced.ndim != 2 or forced.shape != (ids.shape[0], max_new_tokens) or forced.dtype.is_floating_point:
            raise InputError(f"forced_tokens must be integer ids of shape (prompts, max_new_tokens) = "
                             f"({ids.shape[0]}, {max_new_tokens}); got shape {tuple(forced.shape)}, dtype {forced.dtype}")
        if forced.numel() and (int(forced.min()) < 0 or int(forced.max()) >= cfg.vocab_size):
            raise InputError(f"forced_tokens hold ids outside 0 <= id < vocab_size={cfg.vocab_size}")
    sampling = dict(temperature=float(temperature), top_k=top_k, top_p=top_p)
    return _decode(model, ids, lengths, longest, max_new_tokens, dm, sampling, seed, stops, bool(compile), forced)


def generate(model, prompts, max_new_tokens: int, **kwargs) -> list[list[int]]:
    """Generated token ids of each prompt (a stop token, when hit, is the last id). See `stream`."""
    return collect(stream(model, prompts, max_new_tokens, **kwargs))


def collect(steps: Iterator[Step]) -> list[list[int]]:
    """Each row's tokens from a stream of Steps (up to and including its stop token)."""
    out: list[list[int]] | None = None
    for step in steps:
        tokens, finished = step.tokens.tolist(), step.finished.tolist()
        out = out if out is not None else [[] for _ in tokens]
        for row, (tok, done) in enumerate(zip(tokens, finished)):
            if not done:
                out[row].append(tok)
    return out


def _decode(model, ids: Tensor, lengths: Tensor, longest: int, max_new: int, mode: DecodeMode, sampling: dict,
            seed: int | None, stops: Tensor | None, compile: bool, forced: Tensor | None) -> Iterator[Step]:
    device = next(model.parameters()).device
    ids, lengths = ids.to(device), lengths.to(device)
    forced = None if forced is None else forced.to(device)
    B = ids.shape[0]
    generator = torch.Generator(device).manual_seed(seed) if seed is not None else None
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            # one slot more than decoding writes: a slice that never spans the whole cache keeps compiled graphs general
            state, out = prefill(model, ids, lengths, mode, room=max_new, longest=longest)
            rows = torch.arange(B, device=device)
            logits = model.head(out.top[rows, lengths - 1])  # (B, V)
            used = out.passes_used
            del out
            stepper = make_stepper(model, state, compile=compile)
            finished = torch.zeros(B, dtype=torch.bool, device=device)
            stops = None if stops is None else stops.to(device)
            for s in range(max_new):
                tokens = sample(logits, generator=generator, **sampling) if forced is None else forced[:, s]
                yield Step(tokens=tokens, logits=logits, finished=finished.clone(), prefill_passes=used)
                if stops is not None:
                    finished |= torch.isin(tokens, stops)
                    if bool(finished.all()):
                        return
                if s == max_new - 1:
                    return
                logits = advance(model, state, tokens, mode, stepper)
    finally:
        model.train(was_training)


# ---------------------------------------------------------------------- argument checks
def _pack_prompts(prompts, vocab_size: int) -> tuple[Tensor, Tensor]:
    """Prompts (a (B, T) / (T,) tensor, or a list of id sequences) -> right-padded (B, T_max) ids, lengths (B,)."""
    if isinstance(prompts, Tensor):
        if prompts.ndim == 1:
            prompts = prompts[None]
        if prompts.ndim != 2:
            raise InputError(f"prompts tensor must be (T,) or (B, T); got shape {tuple(prompts.shape)}")
        rows = list(prompts)
    elif isinstance(prompts, Sequence) and not isinstance(prompts, str | bytes):
        rows = list(prompts)
        if rows and all(isinstance(t, int) for t in rows):
            raise InputError("prompts must be a list of token-id sequences; for one prompt pass [ids], not ids")
    else:
        raise InputError(f"prompts must be a list of token-id sequences or a tensor, got {type(prompts).__name__}")
    if not rows:
        raise InputError("prompts is empty; give at least one prompt")
    seqs = []
    for i, row in enumerate(rows):
        try:
            t = torch.as_tensor(row)
        except (TypeError, ValueError) as err:
            raise InputError(f"prompt {i} is not a sequence of token ids: {err}") from None
        if t.numel() == 0:
            raise InputError(f"prompt {i} is empty; every prompt needs at least one token (e.g. BOS)")
        if t.ndim != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
            raise InputError(
                f"prompt {i} must be a 1-D sequence of integer token ids; got dtype {t.dtype}, shape {tuple(t.shape)}"
            )
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= vocab_size:
            raise InputError(
                f"prompt {i} has token id {lo if lo < 0 else hi}; accepted: 0 <= id < vocab_size={vocab_size}"
            )
        seqs.append(t.long().cpu())
    lengths = torch.tensor([len(t) for t in seqs])
    ids = torch.zeros(len(seqs), int(lengths.max()), dtype=torch.long)
    for i, t in enumerate(seqs):
        ids[i, : len(t)] = t
    return ids, lengths


def check_sampling(temperature, top_k, top_p, seed) -> None:
    """Raise InputError for a sampling setting `sample` cannot honour."""
    number("temperature", temperature, low=0, error=InputError)
    if top_k is not None:
        integer("top_k", top_k, 1, error=InputError)
    if top_p is not None:
        number("top_p", top_p, low=0, high=1, low_open=True, error=InputError)
    if seed is not None:
        integer("seed", seed, 0, below=2**63, error=InputError)


def _check_stop_tokens(stop_tokens, vocab_size: int) -> Tensor | None:
    if stop_tokens is None:
        return None
    stops = list(stop_tokens) if not isinstance(stop_tokens, int) else [stop_tokens]
    for t in stops:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise InputError(f"stop token {t!r} is invalid; accepted: integer ids 0 <= id < vocab_size={vocab_size}")
    return torch.tensor(stops, dtype=torch.long) if stops else None
