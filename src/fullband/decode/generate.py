"""Latent-feedback decoding: STANDARD, SOFT, FUSED and EXACT modes over one static KV cache.

  standard  plain prefill; plain token embeddings while generating (an ordinary LM)
  soft      plain prefill; each generated position t takes fuse(e_t, h_{t-1})
  fused     prefill with 1 + prefill_passes Jacobi passes (the last one fills a fresh cache), then as soft
  exact     the prompt itself runs through the exact recurrence, then as soft (the ground truth)

Every mode is one prefill (model.forward or model.recurrent_forward writing the cache) followed by the
same decode step (model.step). Ragged batches are right-padded; each row advances at its own position.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from fullband.decode.cache import KVCache
from fullband.decode.sampling import sample
from fullband.errors import InputError, closest

MODES = ("standard", "soft", "fused", "exact")


@dataclass
class Step:
    """One generated position for every row of the batch."""

    tokens: Tensor  # (B,) the sampled token of each row
    logits: Tensor  # (B, V) the logits it was sampled from
    finished: Tensor  # (B,) bool: the row had already emitted a stop token (its token here is filler)
    prefill_passes: int = 1  # Jacobi passes the prompt got (1 + fused passes; fewer than the cap under "auto")


def stream(
    model,
    prompts,
    max_new_tokens: int,
    *,
    mode: str = "soft",
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
    Step's logits then score the forced token, exactly as decoding in `mode` would see it."""
    if not callable(getattr(model, "step", None)):
        raise InputError(f"{type(model).__name__} has no native decode step; fullband.generate / stream / score need a "
                         "FullbandLM (a model wrapped with add_latent_feedback decodes with its own .generate; a "
                         "Llama converts to a FullbandLM with `fullband convert`)")
    cfg = model.config
    ids, lengths = _pack_prompts(prompts, cfg.vocab_size)
    check_int("max_new_tokens", max_new_tokens, 1)
    check_mode(mode)
    prefill_passes, tol = check_prefill(prefill_passes, cfg.max_seq_len, prefill_tol, max_prefill_passes)
    if mode != "standard" and not cfg.has_feedback:
        raise InputError(f"mode={mode!r} needs feedback weights; this model has fusion='none' (use mode='standard')")
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
    passes = 1 + (prefill_passes if mode == "fused" else 0)
    sampling = dict(temperature=float(temperature), top_k=top_k, top_p=top_p)
    return _decode(model, ids, lengths, max_new_tokens, mode, passes, sampling, seed, stops, bool(compile),
                   tol if mode == "fused" else None, forced)


def generate(model, prompts, max_new_tokens: int, **kwargs) -> list[list[int]]:
    """Generated token ids of each prompt (a stop token, when hit, is the last id). See `stream`."""
    out: list[list[int]] | None = None
    for step in stream(model, prompts, max_new_tokens, **kwargs):
        tokens, finished = step.tokens.tolist(), step.finished.tolist()
        out = out if out is not None else [[] for _ in tokens]
        for row, (tok, done) in enumerate(zip(tokens, finished)):
            if not done:
                out[row].append(tok)
    return out


def _decode(model, ids: Tensor, lengths: Tensor, max_new: int, mode: str, passes: int, sampling: dict,
            seed: int | None, stops: Tensor | None, compile: bool, tol: float | None,
            forced: Tensor | None = None) -> Iterator[Step]:
    device = next(model.parameters()).device
    ids, lengths = ids.to(device), lengths.to(device)
    forced = None if forced is None else forced.to(device)
    B = ids.shape[0]
    longest, shortest = int(lengths.max()), int(lengths.min())
    # one slot more than decoding writes: a slice that never spans the whole cache keeps compiled graphs general
    cache = KVCache.for_model(model, B, longest + max_new)
    step = _stepper(model, cache, ragged=longest != shortest, compile=compile)
    generator = torch.Generator(device).manual_seed(seed) if seed is not None else None
    bos = model.config.bos_token_id
    feed = mode != "standard"
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            out = prefill(model, ids, cache, mode, passes, tol=tol)
            rows, last = torch.arange(B, device=device), lengths - 1
            state, logits = out.hidden[rows, last], model.head(out.top[rows, last])  # (B, D), (B, V)
            used = out.passes_used
            del out
            positions = lengths.clone()
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
                plain = (tokens == bos) if (feed and bos is not None) else None
                state, logits = step(tokens, positions, state if feed else None, plain, longest + s + 1)
                positions += 1
    finally:
        model.train(was_training)


def prefill(model, ids: Tensor, cache: KVCache | None, mode: str, passes: int, *, tol: float | None = None,
            return_logits: bool = False):
    """Run right-padded prompts ids (B, T) through `model` as `mode` reads them, writing `cache`: the exact
    recurrence for "exact" (passes_used 0), else `passes` Jacobi passes (1 + prefill passes for "fused")."""
    if mode == "exact":
        out = model.recurrent_forward(ids, cache=cache, return_logits=return_logits)
        out.passes_used = 0
        return out
    # T passes reach the fixed point of a T-token prompt; further passes would recompute it unchanged
    return model(ids, passes=min(passes, ids.shape[1]), cache=cache, return_logits=return_logits, tol=tol)


def _step(model, ks: list[Tensor], vs: list[Tensor], tokens, positions, prev, plain, kv_len: int, mask):
    """One decode step over the cache tensors ks, vs -> (state (B, D), logits (B, V))."""
    cache = KVCache.wrap(ks, vs)
    state, top = model.step(tokens, positions, cache, prev=prev, plain=plain, kv_len=kv_len, mask=mask)
    return state, model.head(top)


_COMPILED: dict[str, object] = {}


def _stepper(model, cache: KVCache, *, ragged: bool, compile: bool):
    """The decode step the loop calls: attends to the first kv_len cache positions, masked per row only for
    ragged batches. Compiled, the cache tensors and kv_len are dynamic graph inputs, so one compile serves
    every batch size, cache and length."""
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

    def step(tokens, positions, prev, plain, kv_len):
        mask = cache.visible(positions, kv_len) if ragged else None
        return fn(model, cache.k, cache.v, tokens, positions, prev, plain, kv_len, mask)

    return step


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


def check_int(name: str, value, minimum: int, error: type[Exception] = InputError) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise error(f"{name}={value!r} is invalid; accepted: an integer >= {minimum}")
    return value


def check_mode(mode, name: str = "mode", error: type[Exception] = InputError) -> str:
    if mode not in MODES:
        hint = closest(mode, MODES) if isinstance(mode, str) else ""
        raise error(f"{name}={mode!r} is not a decoding mode{hint}; accepted: {', '.join(MODES)}")
    return mode


def check_prefill(prefill_passes, max_seq_len: int, prefill_tol=1e-3, max_prefill_passes: int = 32,
                  error: type[Exception] = InputError) -> tuple[int, float | None]:
    """(fused passes to run at most, tolerance or None) for prefill_passes = an integer or "auto".

    The cap is max_seq_len: a prompt of T tokens is exact (the recurrence's fixed point) after T passes, so more
    can change nothing (and prefill never runs more passes than the prompt is long)."""
    tol = None
    if prefill_passes == "auto":
        check_int("max_prefill_passes", max_prefill_passes, 1, error)
        if (isinstance(prefill_tol, bool) or not isinstance(prefill_tol, int | float) or not prefill_tol > 0
                or not math.isfinite(prefill_tol)):
            raise error(f"prefill_tol={prefill_tol!r} is invalid; accepted: a finite number > 0")
        prefill_passes, tol, name = max_prefill_passes, float(prefill_tol), "max_prefill_passes"
    elif isinstance(prefill_passes, str):
        raise error(f"prefill_passes={prefill_passes!r} is invalid; accepted: an integer >= 0 or 'auto'")
    else:
        name = "prefill_passes"
    check_int(name, prefill_passes, 0, error)
    if prefill_passes > max_seq_len:
        raise error(f"{name}={prefill_passes} is above the cap of max_seq_len={max_seq_len}: a prompt is exact "
                    f"after as many passes as it has tokens, so more cannot change anything; accepted: 0 <= "
                    f"{name} <= {max_seq_len}")
    return prefill_passes, tol


def check_sampling(temperature, top_k, top_p, seed) -> None:
    """Raise InputError for a sampling setting `sample` cannot honour."""
    if (isinstance(temperature, bool) or not isinstance(temperature, int | float) or not temperature >= 0
            or not math.isfinite(temperature)):
        raise InputError(f"temperature={temperature!r} is invalid; accepted: a finite number >= 0 (0 = greedy)")
    if top_k is not None:
        check_int("top_k", top_k, 1)
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, int | float) or not 0 < top_p <= 1):
        raise InputError(f"top_p={top_p!r} is invalid; accepted: 0 < top_p <= 1")
    if seed is not None:
        check_int("seed", seed, 0)
        if seed >= 2**63:
            raise InputError(f"seed={seed} is out of range; accepted: an integer 0 <= seed < 2**63")


def _check_stop_tokens(stop_tokens, vocab_size: int) -> Tensor | None:
    if stop_tokens is None:
        return None
    stops = list(stop_tokens) if not isinstance(stop_tokens, int) else [stop_tokens]
    for t in stops:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise InputError(f"stop token {t!r} is invalid; accepted: integer ids 0 <= id < vocab_size={vocab_size}")
    return torch.tensor(stops, dtype=torch.long) if stops else None
