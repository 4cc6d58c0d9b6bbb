"""Group-sampled policy gradient with verifiable rewards (the GRPO / DAPO family): group-standardised advantages, a
clipped importance ratio, token-level normalisation and an optional KL penalty to a reference policy. On-policy
distillation uses the same loss with an advantage per token (distill_advantages).

The loss of a batch of B = prompts x G responses, each token's log-probability under the policy being trained
(logp), under the policy that sampled it (old), and under the reference (ref):

    ratio  = exp(logp - old)
    term   = min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)      A: the response's advantage
    kl     = exp(ref - logp) - (ref - logp) - 1                                  (the k3 estimator, >= 0)
    loss   = -sum(term - kl_coef * kl) / (response tokens in the batch)          (token-level, as DAPO)

A is one number per response (GRPO) or one per response token (on-policy distillation: A_t = teacher_t - old_t, the
negated sampled reverse KL of the token, whose policy gradient is the reverse KL's from the sampling policy to the
teacher, each token's own term only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from fullband.errors import InputError


def group_advantages(rewards: Tensor, group: int, *, eps: float = 1e-6) -> Tensor:
    """rewards (B,) of B / group consecutive groups -> each minus its group's mean, over its group's standard
    deviation (+ eps; a group whose rewards are all equal gets 0)."""
    if group < 2 or rewards.ndim != 1 or rewards.numel() % group:
        raise InputError(f"advantages need groups of G >= 2 responses; got G={group} for {tuple(rewards.shape)} "
                         "rewards")
    r = rewards.double().view(-1, group)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)).view(-1).to(rewards.dtype)


def distill_advantages(teacher: Tensor, old: Tensor, mask: Tensor) -> Tensor:
    """On-policy distillation's advantage of each sampled response token (B, R): its log-probability under the
    teacher minus under the policy that sampled it (0 past each response). Its mean over the response tokens,
    negated, is the sampled estimate of KL(policy || teacher) per token."""
    return torch.where(mask.to(old.device), teacher.to(old.dtype) - old, 0.0).detach()


@dataclass
class PolicyLoss:
    loss: Tensor  # the scalar to minimise
    clip_fraction: float  # share of response tokens whose ratio was clipped
    kl: float  # mean k3 KL to the reference per response token (0 without one)
    ratio_max: float


def policy_loss(logp: Tensor, old: Tensor, advantages: Tensor, mask: Tensor, *, clip_low: float = 0.2,
                clip_high: float = 0.28, ref: Tensor | None = None, kl_coef: float = 0.0) -> PolicyLoss:
    """The clipped policy-gradient loss of (B, R) per-token log-probabilities (see the module docstring);
    `advantages` (B,) one per response or (B, R) one per token."""
    mask = mask.to(logp.device)
    tokens = mask.sum().clamp(min=1)
    ratio = torch.exp(logp - old.detach())
    a = advantages.detach()
    a = a[:, None] if a.ndim == 1 else a
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    term = torch.minimum(ratio * a, clipped * a)
    kl = torch.zeros_like(logp)
    if ref is not None:
        d = ref.detach() - logp
        kl = torch.exp(d) - d - 1
    loss = -((term - kl_coef * kl) * mask).sum() / tokens
    with torch.no_grad():
        was_clipped = (ratio != clipped) & mask
        return PolicyLoss(loss, float(was_clipped.sum() / tokens), float((kl * mask).sum() / tokens),
                          float(ratio[mask].max()) if bool(mask.any()) else 1.0)
