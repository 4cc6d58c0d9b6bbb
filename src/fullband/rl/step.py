"""One step of post-training on a model's own samples: sample G responses per prompt in a mode and score them, then

- `grpo`: standardise the rewards within each group and take `updates` optimiser steps on the clipped objective
  computed by a log-probability path (fullband.rl.logprob). The ratio's denominator is the same path's value at
  the first update, detached (1 there; later updates move away from it and the clip acts): on-policy, a path's
  own error cancels in the ratio and shows in the gradient.
- `distill` (on-policy distillation): the same clipped loss with an advantage per response token, the teacher's
  log-probability of the token minus the sampling policy's (fullband.rl.objective.distill_advantages): the
  responses sampled in a fed mode, as at inference, are pulled towards the STANDARD read of the same tokens, the
  starting model's (`teacher = "reference"`, frozen) or the policy's own (`"standard"`, no gradient through it,
  though it moves with every update: the two reads can meet by both changing). No reward
  is needed (the reward is still computed and logged).
- `rejection-sft` (on-policy SFT): keep the responses whose reward reaches `accept` (all of them, or each prompt's
  shortest) and take one optimiser step of the chat training objective (fullband.model.objective: `sft_passes`
  Jacobi passes, the pass weight, jitter and prefix mixin as the model's config says) on prompt + response,
  the prompts read as the sampling mode reads them (SOFT: plainly; FUSED: fed)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from fullband.decode.sampling import Sampling
from fullband.errors import InputError, TrainingDiverged
from fullband.model.core import FeedbackModel
from fullband.model.objective import distill_kl, scored_log_probs
from fullband.rl.logprob import (Rollout, logprobs, parse_path, response_targets, rl_mode, rollout,
                                 standard_logprobs, standard_response_logits)
from fullband.rl.objective import distill_advantages, group_advantages, policy_loss
from fullband.validate import integer, number


ALGORITHMS = ("grpo", "rejection-sft", "distill")
KEEP = ("correct", "shortest")
TEACHERS = ("standard", "reference")


@dataclass
class RLSettings:
    """How a step samples and what it optimises (the part of a recipe's [rl] table rl_step reads)."""

    mode: str = "soft"  # standard | soft | fused:K: how responses are sampled and scored
    group: int = 8  # G: responses per prompt (at least 2: advantages compare them)
    max_new_tokens: int = 64  # the longest sampled reply, in tokens
    temperature: float = 1.0  # the sampling temperature
    logprob: str = "exact"  # exact | jacobi:K | replay (fullband.rl.logprob)
    clip_low: float = 0.2  # grpo: the ratio is clipped to [1 - clip_low, 1 + clip_high] (from the second update on)
    clip_high: float = 0.28  # grpo: the upper clip (DAPO's clip-higher)
    kl_coef: float = 0.0  # > 0: a k3 KL penalty to the reference (the starting model)
    updates: int = 1  # optimiser steps per batch of samples (grpo)
    algorithm: str = "grpo"  # grpo | rejection-sft | distill (on-policy distillation towards rl.teacher)
    accept: float = 1.0  # rejection-sft: a response is kept when its reward is at least this
    keep: str = "correct"  # rejection-sft: "correct" (every kept response) | "shortest" (each prompt's shortest)
    sft_passes: int = 3  # rejection-sft: Jacobi passes of the training objective (STANDARD sampling: 1)
    teacher: str = "reference"  # distill: the STANDARD read of the frozen starting model, or of the policy itself
    # ("standard", stop-gradient: it moves with the policy, so both reads can agree by both changing)
    hold: float = 0.0  # grpo / distill: > 0 adds hold x KL(starting model || policy), both read STANDARD, over the
    # vocabulary at each response token: it keeps the STANDARD read where it was while the fed read is trained

    @property
    def needs_reference(self) -> bool:
        """Whether a step reads the frozen starting model: the KL penalty, the hold, or distillation towards it."""
        return self.kl_coef > 0 or self.hold > 0 or (self.algorithm == "distill" and self.teacher == "reference")

    def __post_init__(self) -> None:
        rl_mode(self.mode)
        parse_path(self.logprob)
        if self.algorithm not in ALGORITHMS:
            raise InputError(f"rl.algorithm={self.algorithm!r} is unknown; accepted: {', '.join(ALGORITHMS)}")
        if self.keep not in KEEP:
            raise InputError(f"rl.keep={self.keep!r} is unknown; accepted: {', '.join(KEEP)}")
        if self.teacher not in TEACHERS:
            raise InputError(f"rl.teacher={self.teacher!r} is unknown; accepted: {', '.join(TEACHERS)}")
        if self.algorithm == "distill" and self.teacher == "standard" and not rl_mode(self.mode).feeds_state:
            raise InputError(f"rl.algorithm='distill' with rl.mode={self.mode!r} and rl.teacher='standard': the "
                             "policy would be its own teacher (every advantage 0); accepted: a fed mode (soft, "
                             "fused:K), or rl.teacher='reference'")
        integer("rl.updates", self.updates, 1, error=InputError)
        if self.updates > 1 and parse_path(self.logprob)[0] == "replay":
            raise InputError(f"rl.logprob='replay' with rl.updates={self.updates}: the states were recorded by the "
                             "policy that sampled, so from the second update on they are stale (the policy moved) and "
                             "replay would score the new policy with the old one's states; accepted with updates > 1: "
                             "logprob = 'exact' or 'jacobi:K'")
        integer("rl.sft_passes", self.sft_passes, 1, error=InputError)
        number("rl.accept", self.accept, error=InputError)
        if isinstance(self.group, bool) or not isinstance(self.group, int) or self.group < 2:
            raise InputError(f"rl.group={self.group!r} is invalid; accepted: an integer >= 2 (advantages compare "
                             "the responses to one prompt)")
        integer("rl.max_new_tokens", self.max_new_tokens, 1, error=InputError)
        number("rl.temperature", self.temperature, low=0, low_open=True, error=InputError)
        for name in ("clip_low", "clip_high", "kl_coef", "hold"):
            number(f"rl.{name}", getattr(self, name), low=0, error=InputError)
        if self.hold > 0 and self.algorithm == "rejection-sft":
            raise InputError(f"rl.hold={self.hold:g} with rl.algorithm='rejection-sft': the hold is a term of the "
                             "clipped policy loss; accepted: rl.hold = 0, or rl.algorithm 'grpo' or 'distill'")


def sample(model: FeedbackModel, prompts: Sequence[Sequence[int]], score: Callable[[int, list[int]], float],
           settings: RLSettings, *, seed: int, stop_tokens: Sequence[int] | None = None) -> tuple[Rollout, Tensor]:
    """settings.group responses to each prompt (consecutive rows) and their rewards (float64)."""
    G = settings.group
    batch = [list(p) for p in prompts for _ in range(G)]
    r = rollout(model, batch, settings.max_new_tokens, mode=settings.mode, stop_tokens=stop_tokens,
                sampling=Sampling(temperature=settings.temperature, seed=seed))
    return r, torch.tensor([score(i // G, y) for i, y in enumerate(r.responses)], dtype=torch.float64)


def rl_step(model: FeedbackModel, optimizer: torch.optim.Optimizer, prompts: Sequence[Sequence[int]],
            score: Callable[[int, list[int]], float], settings: RLSettings, *, seed: int,
            stop_tokens: Sequence[int] | None = None, reference: FeedbackModel | None = None) -> dict:
    """One batch of samples on `prompts` (each sampled settings.group times) and the algorithm's update(s) on it;
    score(prompt index, response ids) -> reward. -> the step's metrics."""
    t0 = time.perf_counter()
    r, rewards = sample(model, prompts, score, settings, seed=seed, stop_tokens=stop_tokens)
    if settings.algorithm == "rejection-sft":
        row = _rejection_sft(model, optimizer, r, rewards, settings, seed=seed)
    elif settings.algorithm == "distill":
        row = _distill(model, optimizer, r, settings, reference)
    else:
        row = _grpo(model, optimizer, r, rewards, settings, reference)
    lengths = torch.tensor([len(y) for y in r.responses], dtype=torch.float64)
    tokens = int(r.mask.sum())
    dt = time.perf_counter() - t0
    groups = rewards.view(-1, settings.group)
    flat = int((groups == groups[:, :1]).all(dim=1).sum())  # groups whose replies all scored the same
    return {"reward": float(rewards.mean()), "reward_std": float(rewards.std()), "length": float(lengths.mean()),
            "flat_groups": flat, **row, "tokens": tokens, "seconds": dt, "tok_per_s": tokens / dt}


def apply_update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss: Tensor) -> None:
    """loss.backward() and the optimizer's step, with nothing non-finite let through: a NaN / infinite loss or
    gradient stops before the step (TrainingDiverged, the weights untouched), and so does a step whose update
    overflowed the weights (they are no longer finite: whoever saves must not)."""
    if not bool(torch.isfinite(loss)):
        raise TrainingDiverged(f"the loss is {float(loss.detach())}; stopped before applying it")
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if not _finite(p.grad for p in model.parameters()):
        optimizer.zero_grad(set_to_none=True)
        raise TrainingDiverged(f"the loss ({float(loss.detach()):.4g}) has non-finite gradients; stopped before "
                               "applying them")
    optimizer.step()
    if not _finite(p.detach() for p in model.parameters()):
        raise TrainingDiverged("the weights are no longer finite after the update (it overflowed); try a lower "
                               "learning rate")


def _finite(tensors) -> bool:
    flags = [torch.isfinite(t).all() for t in tensors if t is not None]
    return bool(torch.stack(flags).all()) if flags else True


def _grpo(model: FeedbackModel, optimizer: torch.optim.Optimizer, r: Rollout, rewards: Tensor,
          settings: RLSettings, reference: FeedbackModel | None) -> dict:
    advantages = group_advantages(rewards, settings.group)
    if not bool(torch.isfinite(advantages).all()):
        raise TrainingDiverged(f"the rewards ({float(rewards.min()):.4g} to {float(rewards.max()):.4g}) overflow "
                               "their groups' mean or standard deviation, so the advantages are not finite; "
                               "stopped before the update. Accepted: rewards whose sums stay finite (|reward| "
                               "well below 1e308)")
    advantages = advantages.float()
    return _updates(model, optimizer, r, settings, reference, lambda old: advantages)[0]


def _distill(model: FeedbackModel, optimizer: torch.optim.Optimizer, r: Rollout, settings: RLSettings,
             reference: FeedbackModel | None) -> dict:
    """On-policy distillation: the clipped loss with each token's advantage its teacher's log-probability minus
    the sampling policy's; the row's teacher_kl is the sampled KL(policy || teacher) per response token before the
    update."""
    if settings.teacher == "reference" and reference is None:
        raise InputError("rl.teacher='reference' needs the starting model: pass rl_step's reference")
    held = _held(model, r, settings, reference)
    if held is not None and settings.teacher == "reference":  # the hold read the start already: its tokens' values
        teacher = torch.zeros(r.mask.shape, dtype=held.start.dtype, device=held.start.device)
        teacher[r.mask.to(teacher.device)] = held.start.gather(-1, held.scored[:, None])[:, 0]
    else:
        teacher = standard_logprobs(reference if settings.teacher == "reference" else model, r)
    row, advantages = _updates(model, optimizer, r, settings, reference,
                               lambda old: distill_advantages(teacher, old, r.mask), held)
    return {**row, "teacher_kl": -float(advantages.sum() / r.mask.sum().clamp(min=1))}


@dataclass
class _Hold:
    """rl.hold's batch: prompt + response (inputs, targets: response_targets), the response tokens in order and the
    starting model's STANDARD log-distribution at each (N, V)."""

    inputs: Tensor
    targets: Tensor
    scored: Tensor
    start: Tensor


def _held(model: FeedbackModel, r: Rollout, settings: RLSettings, reference: FeedbackModel | None) -> _Hold | None:
    if settings.hold <= 0:
        return None
    if reference is None:
        raise InputError("rl.hold > 0 needs the starting model: pass rl_step's reference")
    inputs, targets, _ = response_targets(model, r)
    scored = targets[targets != -100]
    with torch.no_grad():
        start = scored_log_probs(standard_response_logits(reference, inputs, targets), scored)
    return _Hold(inputs, targets, scored, start)


def _updates(model: FeedbackModel, optimizer: torch.optim.Optimizer, r: Rollout, settings: RLSettings,
             reference: FeedbackModel | None, advantages_of: Callable[[Tensor], Tensor],
             held: _Hold | None = None) -> tuple[dict, Tensor]:
    """settings.updates optimiser steps of the clipped loss on the rollout; advantages_of(the first update's
    log-probabilities, detached) gives the advantages (per response or per token); `held`: rl.hold's batch, if the
    caller read it already. -> the row, the advantages."""
    ref = None
    if reference is not None and settings.kl_coef > 0:
        with torch.no_grad():
            ref = logprobs(reference, r, settings.logprob)
    held = held or _held(model, r, settings, reference)
    old = error = advantages = None
    clipped, holds = [], []
    for _ in range(settings.updates):
        logp = logprobs(model, r, settings.logprob)
        if old is None:
            old = logp.detach()
            error = float((old - r.logprobs.to(old.device)).abs()[r.mask].mean())
            advantages = advantages_of(old)
        out = policy_loss(logp, old, advantages, r.mask, clip_low=settings.clip_low, clip_high=settings.clip_high,
                          ref=ref, kl_coef=settings.kl_coef)
        loss = out.loss
        if held is not None:
            kl = distill_kl(held.start, standard_response_logits(model, held.inputs, held.targets), held.scored)
            loss = loss + settings.hold * kl
            holds.append(float(kl.detach()))
        apply_update(model, optimizer, loss)
        clipped.append(out.clip_fraction)
    row = {"loss": float(loss.detach()), "kl": out.kl, "clip_fraction": sum(clipped) / len(clipped),
           "logprob_error": error}
    if holds:
        row["hold_kl"] = holds[0]  # KL(start || policy), both read STANDARD, per response token before the update
    return row, advantages


def kept_rows(rewards: Tensor, lengths: Sequence[int], group: int, accept: float, keep: str) -> list[int]:
    """The rows rejection sampling keeps: reward >= accept; with keep="shortest", each group's shortest of them
    (the first on a tie)."""
    good = [i for i, v in enumerate(rewards.tolist()) if v >= accept]
    if keep == "correct":
        return good
    best: dict[int, int] = {}
    for i in good:
        g = i // group
        if g not in best or lengths[i] < lengths[best[g]]:
            best[g] = i
    return sorted(best.values())


def _rejection_sft(model: FeedbackModel, optimizer: torch.optim.Optimizer, r: Rollout, rewards: Tensor,
                   settings: RLSettings, *, seed: int) -> dict:
    from fullband.model.objective import objective

    keep = kept_rows(rewards, [len(y) for y in r.responses], settings.group, settings.accept, settings.keep)
    row = {"kept": len(keep), "loss": float("nan")}
    if not keep:
        return row
    kept = Rollout([r.prompts[i] for i in keep], [r.responses[i] for i in keep], r.logprobs[keep], r.states[keep],
                   r.mode)
    inputs, targets, prompt = response_targets(model, kept)
    passes = 1 if not r.mode.feeds_state else settings.sft_passes
    plain = r.mode.read(prompt.shape[1]).plain(prompt)  # the prompts as the mode reads them (fed: FUSED k > 0)
    plain = None if plain is None else plain[:, :-1]
    gen = torch.Generator(device=inputs.device).manual_seed(seed)
    out = objective(model, inputs, targets, passes, plain_mask=plain, generator=gen, noise=True)
    apply_update(model, optimizer, out.loss)
    row["loss"] = float(out.loss.detach())
    return row
