"""Validation loss of a model on fixed batches, for any number of Jacobi passes (1 = STANDARD, k + 1 = FUSED
with k prefill passes): mean nats/token with its standard error over windows, and bits/byte for byte models."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class LossResult:
    passes: int
    nats: float  # mean NTP loss per token
    stderr: float  # standard error of the mean over windows
    tokens: int
    per_window: torch.Tensor = field(repr=False, default=None)  # (N,) mean loss of each window, for paired tests

    def paired_difference(self, other: "LossResult") -> tuple[float, float]:
        """Mean and standard error of (self - other) over the same windows."""
        d = (self.per_window - other.per_window).double()
        return float(d.mean()), float(d.std() / math.sqrt(d.numel())) if d.numel() > 1 else float("nan")

    @property
    def bits(self) -> float:
        return self.nats / math.log(2)


@torch.no_grad()
def validation_loss(model, batches, passes: int, *, autocast=None) -> LossResult:
    """Mean next-token loss of `passes` Jacobi passes over (inputs, targets) batches, in eval mode."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    per_window: list[torch.Tensor] = []
    try:
        for inputs, targets in batches:
            inputs, targets = inputs.to(device), targets.to(device)
            with autocast or contextlib.nullcontext():
                logits = model(inputs, passes=passes).logits
            nll = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
            per_window.append(nll.view(targets.shape).mean(dim=1).cpu())
    finally:
        model.train(was_training)
    losses = torch.cat(per_window).double()
    n = losses.numel()
    stderr = float(losses.std(unbiased=True) / math.sqrt(n)) if n > 1 else float("nan")
    return LossResult(passes=passes, nats=float(losses.mean()), stderr=stderr, tokens=n * targets.shape[1],
                      per_window=losses)
