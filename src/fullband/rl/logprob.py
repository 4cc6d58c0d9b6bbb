"""The log-probability of sampled responses under latent feedback, three ways (docs/method.md, post-training).

A response's probability depends on the states fed back while it was sampled, and each of those on everything
sampled before it. log pi(y | x) and its gradient come from:

- `exact`: the decode engine itself, teacher-forced with gradients (fullband.decode.stream(grad=True)): the
  prompt read as the mode reads it, then one fed step per response token. Values and gradients exact;
  sequential over the response.
- `jacobi:K`: K Jacobi passes over prompt + response in parallel, the prompt kept as the mode read it (SOFT and
  STANDARD: plain; FUSED k: its 1 + k passes). Equal to exact, values and gradients, once K >= the response
  length (+ k for FUSED k): position t is exact after t passes of its own. The prompt's states are held where the
  prompt reads them (FeedbackModel.state_lag: a ponder slot reads its own token's state, not the one before).
- `replay`: one parallel pass fed the states recorded at sampling time (a Rollout's). Values exact; the gradient
  is cut at the states (they are constants).

Log-probabilities are of the model's own distribution (log_softmax of the logits, temperature 1), whatever the
sampling settings were, unless a temperature is asked for (`scores`: TRL scores at its sampling temperature); each is
the row's per-token value, 0 past the row's response."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from fullband.decode.generate import stream
from fullband.decode.sampling import Sampling
from fullband.errors import InputError
from fullband.model.core import FeedbackModel
from fullband.model.mode import DecodeMode
from fullband.validate import number, parse_int

RL_MODES = ("standard", "soft", "fused")  # EXACT reads its prompt without gradients: not a policy to train


@dataclass
class Rollout:
    """Sampled responses and what sampling saw: prompts (B lists), responses (B lists, up to and including a stop
    token), the engine's log-probability of each response token (B, R) and the state each one read (B, R, D), in
    the mode they were sampled in."""

    prompts: list[list[int]]
    responses: list[list[int]]
    logprobs: Tensor
    states: Tensor
    mode: DecodeMode

    @property
    def mask(self) -> Tensor:
        """(B, R) True on each row's response tokens."""
        lengths = torch.tensor([len(r) for r in self.responses])
        return torch.arange(self.logprobs.shape[1])[None, :] < lengths[:, None]


def rl_mode(mode: str | DecodeMode) -> DecodeMode:
    dm = DecodeMode.parse(mode) if isinstance(mode, str) else DecodeMode.of(mode)
    if dm.name not in RL_MODES or dm.adaptive:
        raise InputError(f"mode {dm.label!r} cannot be trained on-policy; accepted: standard, soft, fused:K")
    return dm


@torch.no_grad()
def rollout(model: FeedbackModel, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
            mode: str | DecodeMode = "soft", sampling: Sampling | None = None,
            stop_tokens: Sequence[int] | None = None) -> Rollout:
    """Sample a response to each prompt with the decode engine, recording its log-probabilities and fed states."""
    dm = rl_mode(mode)
    tokens, logps, states, finished = [], [], [], []
    for step in stream(model, prompts, max_new_tokens, mode=dm, sampling=sampling, stop_tokens=stop_tokens):
        logp = log_softmax(step.logits)
        tokens.append(step.tokens)
        logps.append(logp.gather(1, step.tokens[:, None])[:, 0])
        states.append(step.state)
        finished.append(step.finished)
    live = ~torch.stack(finished, 1).cpu()  # (B, R)
    ids = torch.stack(tokens, 1).cpu()
    responses = [row[keep].tolist() for row, keep in zip(ids, live)]
    logprobs = torch.where(live, torch.stack(logps, 1).cpu(), 0.0)
    return Rollout([list(map(int, p)) for p in prompts], responses, logprobs, torch.stack(states, 1), dm)


def log_softmax(logits: Tensor) -> Tensor:
    """Log-probabilities over the last dim, in float32 at least (float64 logits stay float64)."""
    return torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)


def parse_path(path: str) -> tuple[str, int | None]:
    """'exact' | 'replay' | 'jacobi:K' -> (name, K)."""
    name, _, k = path.partition(":")
    if name in ("exact", "replay") and not k:
        return name, None
    if name == "jacobi" and k:
        return name, parse_int("jacobi passes K", k, 1, error=InputError)
    raise InputError(f"logprob path {path!r} is unknown; accepted: exact, jacobi:K (K >= 1 passes), replay")


@torch.no_grad()
def standard_logprobs(model: FeedbackModel, r: Rollout) -> Tensor:
    """(B, R) each response token's log-probability under `model`'s STANDARD read of prompt + response (one plain
    pass, nothing fed; 0 past each response), without gradients: on-policy distillation's teacher."""
    return logprobs(model, replace(r, mode=DecodeMode.parse("standard")), "jacobi:1")


def logprobs(model: FeedbackModel, r: Rollout, path: str = "exact") -> Tensor:
    """(B, R) log pi(response token | everything before it) by `path`, differentiable in the model's weights."""
    return _score(model, r, path, Scoring())[0]


def scores(model: FeedbackModel, r: Rollout, path: str = "exact", *,
           temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """(B, R) log-probabilities as `logprobs`, of softmax(logits / temperature), and the entropy of each response
    token's distribution (B, R); both differentiable, 0 past each response."""
    number("temperature", temperature, low=0, low_open=True, error=InputError)
    return _score(model, r, path, Scoring(temperature, entropy=True))


@dataclass(frozen=True)
class Scoring:
    """What is read from each response token's logits: its log-probability at `temperature`, and the entropy."""

    temperature: float = 1.0
    entropy: bool = False

    def __call__(self, logits: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor | None]:
        """logits (..., V), tokens (...) -> log-probabilities (...) and entropies (...) or None."""
        logp = log_softmax(logits if self.temperature == 1 else logits / self.temperature)
        picked = logp.gather(-1, tokens[..., None])[..., 0]
        return picked, (-(logp.exp() * logp).sum(-1) if self.entropy else None)


def _score(model: FeedbackModel, r: Rollout, path: str, how: Scoring) -> tuple[Tensor, Tensor | None]:
    name, k = parse_path(path)
    logp, entropy = _exact(model, r, how) if name == "exact" else _parallel(model, r, passes=k, how=how)
    mask = r.mask.to(logp.device)
    return torch.where(mask, logp, 0.0), None if entropy is None else torch.where(mask, entropy, 0.0)


def _exact(model: FeedbackModel, r: Rollout, how: Scoring) -> tuple[Tensor, Tensor | None]:
    R = r.logprobs.shape[1]
    device = next(model.parameters()).device
    forced = torch.nn.utils.rnn.pad_sequence([torch.tensor(y + [0] * (R - len(y))) for y in r.responses],
                                             batch_first=True).to(device)
    out = [how(step.logits, forced[:, s])
           for s, step in enumerate(stream(model, r.prompts, R, mode=r.mode, forced_tokens=forced, grad=True))]
    logp, entropy = zip(*out)
    return torch.stack(logp, 1), (torch.stack(entropy, 1) if how.entropy else None)


def sequences(model: FeedbackModel, r: Rollout) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Prompt + response right-padded (B, T), the prompt lengths (B,), each row's prompt mask (B, T) and the
    position of each response token (B, R; clamped into the row past its end)."""
    device = next(model.parameters()).device
    rows = [p + y for p, y in zip(r.prompts, r.responses)]
    T = max(map(len, rows))
    ids = torch.tensor([row + [0] * (T - len(row)) for row in rows], device=device)
    plen = torch.tensor([len(p) for p in r.prompts], device=device)
    at = (plen[:, None] + torch.arange(r.logprobs.shape[1], device=device)[None, :]).clamp(max=T - 1)
    return ids, plen, torch.arange(T, device=device)[None, :] < plen[:, None], at


def response_targets(model: FeedbackModel, r: Rollout) -> tuple[Tensor, Tensor, Tensor]:
    """Prompt + response as a training batch: the inputs (B, T - 1), each next token where it is a response token
    (B, T - 1; -100 elsewhere) and each row's prompt mask over the whole sequence (B, T)."""
    ids, plen, prompt, _ = sequences(model, r)
    end = plen + torch.tensor([len(y) for y in r.responses], device=ids.device)
    q = torch.arange(1, ids.shape[1], device=ids.device)[None, :]  # the position each target sits at
    return ids[:, :-1], torch.where((q >= plen[:, None]) & (q < end[:, None]), ids[:, 1:], -100), prompt


def standard_response_logits(model: FeedbackModel, inputs: Tensor, targets: Tensor) -> Tensor:
    """(N, V) the STANDARD read's logits (one plain pass) at the N scored positions of a response_targets batch,
    differentiable: the response tokens' next-token distributions, and no other position's."""
    top = model(inputs, passes=1, return_logits=False).top
    return model.head(top[targets != -100])


def _gather(model: FeedbackModel, top: Tensor, ids: Tensor, at: Tensor,
            how: Scoring) -> tuple[Tensor, Tensor | None]:
    """Each response token's scores from the final-norm outputs top (B, T, D): the token at position q is scored by
    the logits at q - 1."""
    logits = model.head(top.gather(1, (at - 1)[..., None].expand(*at.shape, top.shape[-1])))
    return how(logits, ids.gather(1, at))


def _parallel(model: FeedbackModel, r: Rollout, passes: int | None, how: Scoring) -> tuple[Tensor, Tensor | None]:
    """jacobi:K (passes=K) or replay (passes None) over the whole sequences."""
    ids, plen, prompt, at = sequences(model, r)
    dm = r.mode
    if not dm.feeds_state:  # STANDARD: nothing is fed, one plain pass is the exact reading
        return _gather(model, model(ids, passes=1, return_logits=False).top, ids, at, how)
    read = dm.read(int(plen.max()))
    plain_prompt = read.plain(prompt)
    # the states prompt positions read: those at positions < prompt length - state_lag (each position its
    # predecessor's; under ponder each ponder slot its own token's, so the last prompt position's too)
    held = torch.arange(ids.shape[1], device=ids.device)[None, :] < (plen - model.state_lag)[:, None]
    if passes is None:
        return _gather(model, _replay(model, r, ids, plen, at, plain_prompt, held), ids, at, how)
    k = read.passes - 1
    frozen: list[Tensor] = []

    # FUSED k: from pass 1 + k on, prompt positions keep reading what they read in pass 1 + k (their states stay as
    # the mode read them)
    def feed(j: int, state: Tensor, plain: Tensor) -> tuple[Tensor, Tensor]:
        if j < k:
            return state, plain
        if j == k:
            frozen.append(state)
        return torch.where(held[..., None], frozen[0], state), plain

    out = model(ids, passes=passes, plain_mask=plain_prompt, feed=None if k == 0 else feed, return_logits=False)
    return _gather(model, out.top, ids, at, how)


def _replay(model: FeedbackModel, r: Rollout, ids: Tensor, plen: Tensor, at: Tensor,
            plain_prompt: Tensor | None, held: Tensor) -> Tensor:
    """One Jacobi pass whose previous-pass states are those read at sampling time -> final-norm outputs (B, T, D).
    Response token i was sampled from the logits at at[i] - 1; the state recorded with it, position at[i] - 1's,
    is what the response reads from there. `held` (B, T): the states the prompt read instead."""
    B, T = ids.shape
    prev = torch.zeros(B, T, r.states.shape[-1], dtype=r.states.dtype, device=ids.device)
    live = r.mask.to(ids.device)
    rows = torch.arange(B, device=ids.device)[:, None].expand_as(at)
    prev[rows[live], at[live] - 1] = r.states.to(ids.device)[live]
    if plain_prompt is None:  # FUSED: the prompt's last pass read the pass before it (recomputed: deterministic)
        last: list[Tensor] = []  # the last two passes' states

        def keep(j: int, state: Tensor, top: Tensor) -> None:
            last[:] = [*last[-1:], state]

        prompt_ids = ids[:, : int(plen.max())]
        with torch.no_grad():
            model.read(prompt_ids, r.mode, each_pass=keep)
        if len(last) > 1:  # else one-token prompts, which read no state
            P = prompt_ids.shape[1]
            prev[:, :P] = torch.where(held[:, :P, None], last[0].to(prev.dtype), prev[:, :P])
    e = model.embed_inputs(ids)
    return model.jacobi_pass(e, prev.detach(), model.plain_of(ids, mask=plain_prompt))[1]
