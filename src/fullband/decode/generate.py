"""The decode engine: every mode (fullband.model.mode) is one prefill followed by the same decode step, for any
FeedbackModel (fullband.model.core: the native FullbandLM, a Hugging Face model wrapped with latent feedback) and
for whoever drives it (generate / stream, score, the transformers class, chat).

Prompts of different lengths are right-padded; each row advances at its own position. What decoding carries
from one position to the next (and could carry from one call to the next: a conversation's turns) is a
DecodeState: the cache, each row's next position and its fed-back state.

Shipped as source with every transformers folder (fullband.hf.remote): it imports only other shipped modules."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fullband.decode.sampling import Sampling
from fullband.errors import InputError
from fullband.model.cache import KVCache
from fullband.model.core import FeedbackModel, ModelOutput
from fullband.model.mode import DecodeMode, default_mode
from fullband.validate import integer, spans

__all__ = ["DecodeMode", "DecodeRequest", "DecodeState", "Sampling", "Step", "advance", "generate", "prefill", "stream"]


@dataclass
class Step:
    """One generated position for every row of the batch."""

    tokens: Tensor  # (B,) the sampled token of each row
    logits: Tensor  # (B, V) the logits it was sampled from
    finished: Tensor  # (B,) bool: the row had already emitted a stop token (its token here is filler)
    prefill_passes: int = 1  # Jacobi passes the prompt got (1 + fused passes; fewer than the cap under tol)
    state: Tensor | None = None  # (B, D) the fed-back state of the position the logits came from: what the token
    #                              reads when the mode feeds it (a rollout's record, fullband.rl.logprob)


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
def prefill(model: FeedbackModel, ids: Tensor, lengths: Tensor, mode: DecodeMode, *, room: int,
            longest: int | None = None, fed: Tensor | None = None) -> tuple[DecodeState, ModelOutput]:
    """Read right-padded prompts ids (B, T) (row b real for its first lengths[b] positions) as `mode` reads them
    (FeedbackModel.read; `fed` (B, T): SOFT prompt positions read as they were generated), into a new cache with
    `room` more positions per row. -> (DecodeState, the prompt's ModelOutput: hidden / top for every position,
    passes_used: Jacobi passes run, 0 for the exact recurrence)."""
    B = ids.shape[0]
    longest = int(lengths.max()) if longest is None else longest
    cache = model.new_cache(B, longest + room)
    out = model.read(ids, mode, cache=cache, fed=fed)
    rows = torch.arange(B, device=ids.device)
    state = DecodeState(cache, lengths.clone(), out.hidden[rows, lengths - 1], longest,
                        ragged=bool((lengths != longest).any()))
    return state, out


def advance(model: FeedbackModel, state: DecodeState, tokens: Tensor, *, feed: bool, stepper=None) -> Tensor:
    """One decode step: tokens (B,) go in at each row's next position, fed each row's state when `feed` (a mode
    that feeds generated positions; the plain rule still applies: a BOS token starts afresh); `state` advances.
    -> logits (B, V) for the next position."""
    kv_len = state.longest + 1
    max_len = model.config.max_seq_len
    if kv_len > max_len:
        raise InputError(f"sequence length {kv_len} exceeds max_seq_len={max_len}")
    if kv_len > state.cache.max_len:  # the transformers class does not know its final length up front
        state.cache.grow(min(2 * state.cache.max_len, max_len))
    step = stepper or make_stepper(model, state)
    new_state, logits = step(tokens, state.positions, state.state if feed else None, kv_len)
    state.state, state.positions, state.longest = new_state, state.positions + 1, kv_len
    return logits


def _step(model, ks: list[Tensor], vs: list[Tensor], tokens, positions, prev, kv_len: int, mask):
    """One native decode step over the cache tensors ks, vs -> (state (B, D), logits (B, V))."""
    state, top = model.step(tokens, positions, KVCache.wrap(ks, vs), prev=prev, kv_len=kv_len, mask=mask)
    return state, model.head(top)


_COMPILED: dict[str, object] = {}


def make_stepper(model: FeedbackModel, state: DecodeState, *, compile: bool = False):
    """The decode step advance calls: (tokens, positions, prev, kv_len) -> (state, logits), attending to the first
    kv_len positions, masked per row only for ragged batches. A native model's step can be compiled: the cache
    tensors and kv_len are dynamic graph inputs, so one compile serves every batch size, cache and length; other
    models run it through torch.compile as it comes (graph breaks allowed)."""
    cache = state.cache
    native = isinstance(cache, KVCache)
    fn = _step if native else model.step
    if compile and not native:
        fn = torch.compile(model.step, dynamic=True)
    elif compile:
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

    def stepper(tokens, positions, prev, kv_len):
        mask = cache.visible(positions, kv_len) if state.ragged else None
        if native:
            return fn(model, cache.k, cache.v, tokens, positions, prev, kv_len, mask)
        new_state, top = fn(tokens, positions, cache, prev=prev, kv_len=kv_len, mask=mask)
        return new_state, model.head(top)

    return stepper


# ---------------------------------------------------------------------- the loop
def stream(model: FeedbackModel, prompts, max_new_tokens: int, *, mode: str | DecodeMode | None = None,
           sampling: Sampling | None = None, stop_tokens: Sequence[int] | None = None, compile: bool = False,
           forced_tokens=None, prefill_passes: int | str | None = None, prefill_tol: float | None = None,
           max_prefill_passes: int | None = None, temperature: float | None = None, top_k: int | None = None,
           top_p: float | None = None, seed: int | None = None, grad: bool = False, fed=None) -> Iterator[Step]:
    """Yield one Step per generated position of `prompts` (a list of token-id lists of any lengths, or a (B, T) /
    (T,) tensor) decoded by `model` (any FeedbackModel) in `mode`. Arguments are checked now, before the first step.

    `mode` is a DecodeMode or its name (default: the model's, `default_mode`: SOFT, or STANDARD for a model whose
    feedback weights are untrained or absent); `sampling` a Sampling (default greedy). The keywords prefill_passes (an
    integer, or "auto": adaptive prefill with prefill_tol and max_prefill_passes) and temperature / top_k / top_p /
    seed spell the same settings one by one. `compile=True` runs the decode step through torch.compile (the first
    call compiles for a while; later ones are faster than eager, on CPU mostly at batch 1). `forced_tokens`
    (B, max_new_tokens) feeds the given tokens instead of sampled ones (teacher forcing): each Step's logits then
    score the forced token, exactly as decoding in `mode` would see it. `grad=True` keeps the autograd graph
    (logits differentiable in the weights: the exact log-probability of a response, fullband.rl.logprob). `fed`, in
    SOFT: for each prompt, the [start, end) spans of its positions that were generated (a conversation's earlier
    replies, fullband.fed_chat_prompt), read as they were: fed, by the exact recurrence; the rest plainly."""
    if not isinstance(model, FeedbackModel):
        raise InputError(f"{type(model).__name__} is not a fullband model; fullband.generate / stream / score decode a "
                         "FeedbackModel: a FullbandLM, a model wrapped with fullband.hf.add_latent_feedback, or a "
                         "transformers FullbandForCausalLM's .model")
    cfg = model.config
    mode = DecodeMode.of(default_mode(cfg) if mode is None else mode, prefill_passes, tol=prefill_tol,
                         max_passes=max_prefill_passes).check(cfg)
    sampling = Sampling.of(sampling, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    if grad and compile:
        raise InputError("grad=True decodes eagerly; compile=True is for inference")
    request = DecodeRequest.of(cfg, prompts, max_new_tokens, mode, sampling, stop_tokens, forced_tokens, fed)
    return _run(model, request, bool(compile), bool(grad))


@dataclass
class DecodeRequest:
    """What `stream` decodes, checked (DecodeRequest.of): right-padded prompts ids (B, T) with their lengths (B,),
    the new tokens, the mode and sampling, the stop tokens, forced tokens (B, max_new) and fed prompt spans (B, T)."""

    ids: Tensor
    lengths: Tensor
    max_new: int
    mode: DecodeMode
    sampling: Sampling
    stops: Tensor | None = None
    forced: Tensor | None = None
    fed: Tensor | None = None

    @property
    def longest(self) -> int:
        return int(self.lengths.max())

    @classmethod
    def of(cls, cfg, prompts, max_new_tokens: int, mode: DecodeMode, sampling: Sampling, stop_tokens=None,
           forced_tokens=None, fed=None) -> DecodeRequest:
        """Check what a decode asks of a model whose config is `cfg` (InputError naming what is wrong)."""
        ids, lengths = _pack_prompts(prompts, cfg.vocab_size)
        integer("max_new_tokens", max_new_tokens, 1, error=InputError)
        longest = int(lengths.max())
        if longest + max_new_tokens > cfg.max_seq_len:
            raise InputError(f"prompt length {longest} + max_new_tokens {max_new_tokens} = {longest + max_new_tokens} "
                             f"exceeds max_seq_len={cfg.max_seq_len}; shorten the prompt or ask for at most "
                             f"{max(cfg.max_seq_len - longest, 0)} new tokens")
        forced = None
        if forced_tokens is not None:
            forced = torch.as_tensor(forced_tokens)
            if forced.ndim != 2 or forced.shape != (ids.shape[0], max_new_tokens) or forced.dtype.is_floating_point:
                raise InputError(f"forced_tokens must be integer ids of shape (prompts, max_new_tokens) = "
                                 f"({ids.shape[0]}, {max_new_tokens}); got shape {tuple(forced.shape)}, dtype "
                                 f"{forced.dtype}")
            if forced.numel() and (int(forced.min()) < 0 or int(forced.max()) >= cfg.vocab_size):
                raise InputError(f"forced_tokens hold ids outside 0 <= id < vocab_size={cfg.vocab_size}")
        if fed is not None:
            fed = fed_mask(fed, lengths, ids.shape[1])
            mode.read(longest, max(1, int(fed.sum(-1).max())))  # fed spans are SOFT's: refused in another mode now
        return cls(ids, lengths, int(max_new_tokens), mode, sampling, _check_stop_tokens(stop_tokens, cfg.vocab_size),
                   forced, fed)


def model_stops(model: FeedbackModel, tokenizer) -> list[int]:
    """The tokenizer's stop ids that are ids of `model` (one past its vocabulary is never sampled, and stop_tokens
    refuses it)."""
    return [i for i in tokenizer.stop_ids if i < model.config.vocab_size]


def generate(model: FeedbackModel, prompts, max_new_tokens: int, **options) -> list[list[int]]:
    """Generated token ids of each prompt (a stop token, when hit, is the last id). Options as for `stream`."""
    return collect(stream(model, prompts, max_new_tokens, **options))


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


def _run(model: FeedbackModel, request: DecodeRequest, compile: bool, grad: bool) -> Iterator[Step]:
    """The steps of _decode, each computed in the decoding's grad mode (inference mode, or gradients with `grad`)
    with the model in eval mode, and the caller's own grad mode and train flag back while it holds a step: a
    backward() or a training step inside `for step in stream(...)` runs as it would outside the loop."""
    steps = _decode(model, request, compile, grad)
    try:
        while True:
            training = model.training
            with torch.enable_grad() if grad else torch.inference_mode():
                if training:
                    model.eval()
                try:
                    step = next(steps)
                except StopIteration:
                    return
                finally:
                    if training:
                        model.train()
            yield step
    finally:
        steps.close()


def _decode(model: FeedbackModel, r: DecodeRequest, compile: bool, grad: bool) -> Iterator[Step]:
    device = next(model.parameters()).device
    ids, lengths = r.ids.to(device), r.lengths.to(device)
    forced = None if r.forced is None else r.forced.to(device)
    B = ids.shape[0]
    generator = r.sampling.generator(device)
    state, out = prefill(model, ids, lengths, r.mode, room=r.max_new, longest=r.longest, fed=r.fed)
    rows = torch.arange(B, device=device)
    logits = model.head(out.top[rows, lengths - 1])  # (B, V)
    used = out.passes_used
    del out
    if grad and not hasattr(state.cache, "fork"):
        raise InputError(f"grad=True needs fullband's KV cache; {type(model).__name__} keeps another")
    stepper = make_stepper(model, state, compile=compile)
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    stops = None if r.stops is None else r.stops.to(device)
    for s in range(r.max_new):
        tokens = r.sampling(logits, generator) if forced is None else forced[:, s]
        yield Step(tokens=tokens, logits=logits, finished=finished.clone(), prefill_passes=used, state=state.state)
        if stops is not None:
            finished |= torch.isin(tokens, stops)
            if bool(finished.all()):
                return
        if s == r.max_new - 1:
            return
        if grad:  # the step writes the cache in place: keep the tensors autograd saved as they were
            state.cache.fork()
        logits = advance(model, state, tokens, feed=r.mode.feeds_state, stepper=stepper)


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
            raise InputError(f"prompt {i} must be a 1-D sequence of integer token ids; got dtype {t.dtype}, shape "
                             f"{tuple(t.shape)}")
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= vocab_size:
            raise InputError(f"prompt {i} has token id {lo if lo < 0 else hi}; accepted: 0 <= id < "
                             f"vocab_size={vocab_size}")
        seqs.append(t.long().cpu())
    return torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True), torch.tensor([len(t) for t in seqs])


def fed_mask(fed, lengths: Tensor, T: int) -> Tensor:
    """Each prompt's fed spans (a list per prompt of [start, end) pairs, positions within it) -> a (B, T) mask."""
    if isinstance(fed, str | bytes) or not isinstance(fed, Sequence) or len(fed) != len(lengths):
        raise InputError(f"fed must hold one list of [start, end) spans per prompt ({len(lengths)} prompts); got "
                         f"{fed!r}")
    mask = torch.zeros(len(lengths), T, dtype=torch.bool)
    for row, (row_spans, n) in enumerate(zip(fed, lengths.tolist())):
        for start, end in spans(f"fed[{row}]", row_spans, length=n, error=InputError):
            mask[row, start:end] = True
    return mask


def _check_stop_tokens(stop_tokens, vocab_size: int) -> Tensor | None:
    if stop_tokens is None:
        return None
    stops = list(stop_tokens) if not isinstance(stop_tokens, int) else [stop_tokens]
    for t in stops:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise InputError(f"stop token {t!r} is invalid; accepted: integer ids 0 <= id < vocab_size={vocab_size}")
    return torch.tensor(stops, dtype=torch.long) if stops else None
