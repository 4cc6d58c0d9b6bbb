"""One step of group-sampled policy gradient: sample G responses per prompt in a mode, score them, standardise the
rewards within each group, and take an optimiser step on the clipped objective computed by a log-probability path
(fullband.rl.logprob). The ratio's denominator is the same path's value, detached (1 on a step's first update):
on-policy, a path's own error cancels in the ratio and shows in the gradient."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from fullband.decode.sampling import Sampling
from fullband.errors import InputError
from fullband.model.core import FeedbackModel
from fullband.rl.logprob import logprobs, parse_path, rl_mode, rollout
from fullband.rl.objective import group_advantages, policy_loss
from fullband.validate import integer, number


@dataclass
class RLSettings:
    """How a step samples and what it optimises (the part of a recipe's [rl] table rl_step reads)."""

    mode: str = "soft"  # standard | soft | fused:K: how responses are sampled and scored
    group: int = 8  # G: responses per prompt
    max_new_tokens: int = 64
    temperature: float = 1.0
    logprob: str = "exact"  # exact | jacobi:K | replay (fullband.rl.logprob)
    clip_low: float = 0.2
    clip_high: float = 0.28
    kl_coef: float = 0.0  # > 0: a k3 KL penalty to the reference (the starting model)

    def __post_init__(self) -> None:
        rl_mode(self.mode)
        parse_path(self.logprob)
        if isinstance(self.group, bool) or not isinstance(self.group, int) or self.group < 2:
            raise InputError(f"rl.group={self.group!r} is invalid; accepted: an integer >= 2 (advantages compare "
                             "the responses to one prompt)")
        integer("rl.max_new_tokens", self.max_new_tokens, 1, error=InputError)
        number("rl.temperature", self.temperature, low=0, low_open=True, error=InputError)
        for name in ("clip_low", "clip_high", "kl_coef"):
            number(f"rl.{name}", getattr(self, name), low=0, error=InputError)


def rl_step(model: FeedbackModel, optimizer: torch.optim.Optimizer, prompts: Sequence[Sequence[int]],
            score: Callable[[int, list[int]], float], settings: RLSettings, *, seed: int,
            stop_tokens: Sequence[int] | None = None, reference: FeedbackModel | None = None) -> dict:
    """One update on `prompts` (each sampled settings.group times); score(prompt index, response ids) -> reward.
    -> the step's metrics."""
    t0 = time.perf_counter()
    G = settings.group
    batch = [list(p) for p in prompts for _ in range(G)]
    r = rollout(model, batch, settings.max_new_tokens, mode=settings.mode, stop_tokens=stop_tokens,
                sampling=Sampling(temperature=settings.temperature, seed=seed))
    rewards = torch.tensor([score(i // G, y) for i, y in enumerate(r.responses)], dtype=torch.float64)
    advantages = group_advantages(rewards, G).float()
    logp = logprobs(model, r, settings.logprob)
    ref = None
    if reference is not None and settings.kl_coef > 0:
        with torch.no_grad():
            ref = logprobs(reference, r, settings.logprob)
    out = policy_loss(logp, logp.detach(), advantages, r.mask, clip_low=settings.clip_low,
                      clip_high=settings.clip_high, ref=ref, kl_coef=settings.kl_coef)
    optimizer.zero_grad(set_to_none=True)
    out.loss.backward()
    optimizer.step()
    mask = r.mask
    lengths = torch.tensor([len(y) for y in r.responses], dtype=torch.float64)
    return {"reward": float(rewards.mean()), "reward_std": float(rewards.std()), "length": float(lengths.mean()),
            "loss": float(out.loss.detach()), "kl": out.kl, "clip_fraction": out.clip_fraction,
            "logprob_error": float((logp.detach() - r.logprobs.to(logp.device)).abs()[mask].mean()),
            "tokens": int(mask.sum()), "seconds": (dt := time.perf_counter() - t0), "tok_per_s": int(mask.sum()) / dt}
