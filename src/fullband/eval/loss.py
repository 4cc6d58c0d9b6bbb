"""Held-out loss of a model on fixed batches: for any number of Jacobi passes (validation_loss: mean nats/token with
its standard error over windows, paired differences), and for decoding modes (loss_by_mode: STANDARD, FUSED k,
adaptive, exact, with bits/byte)."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from fullband.model.mode import DecodeMode
from fullband.model.objective import ntp


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
        return float(d.mean()), _se(d)


@torch.no_grad()
def validation_loss(model, batches, passes: int, *, autocast=None) -> LossResult:
    """Mean next-token loss of `passes` Jacobi passes over (inputs, targets) batches, in eval mode (a window is read
    as FeedbackModel.read reads a prompt: passes beyond its length repeat the fixed point, so are not run). Chat
    batches (inputs, targets, plain) read `plain` positions plainly and score only targets != -100 (assistant
    tokens): a window's loss is then the mean over its scored tokens. `model` may be a data-parallel wrapper."""
    was_training = model.training
    model.eval()
    net = getattr(model, "module", model)
    device = next(model.parameters()).device
    mode = DecodeMode.from_passes(passes)
    per_window: list[torch.Tensor] = []
    tokens = 0
    try:
        for inputs, targets, *plain in batches:
            inputs, targets = inputs.to(device), targets.to(device)
            with autocast or contextlib.nullcontext():
                logits = net.read(inputs, mode, plain_mask=plain[0].to(device) if plain else None,
                                  return_logits=True).logits
            nll = ntp(logits, targets, reduction="none")
            scored = (targets != -100).sum(dim=1)
            tokens += int(scored.sum())
            per_window.append((nll.view(targets.shape).sum(dim=1) / scored.clamp(min=1)).cpu())
    finally:
        model.train(was_training)
    losses = torch.cat(per_window).double()
    return LossResult(passes=passes, nats=float(losses.mean()), stderr=_se(losses), tokens=tokens, per_window=losses)


@torch.no_grad()
def loss_by_mode(model, batches, modes: list[tuple[str, DecodeMode]], bytes_per_token: torch.Tensor, *,
                 keep_windows: bool = False) -> list[dict]:
    """Held-out loss of every (name, mode) over (inputs, targets) batches, each window read as the mode prefills a
    prompt (Jacobi passes, adaptive under "auto", or the exact recurrence): one row per mode with nats/token, its
    standard error over windows, its difference to the first mode (STANDARD) paired window by window with that
    difference's standard error, bits/byte (all of a mode's bits over all bytes scored), and the fused passes adaptive
    prefill used on average; `keep_windows` adds each window's nats/token (to pair other models read on the same
    windows)."""
    sums = {name: [] for name, _ in modes}
    used: dict[str, list[int]] = {name: [] for name, mode in modes if mode.adaptive}
    nbytes = 0.0
    for inputs, targets in batches:
        nbytes += float(bytes_per_token[targets].sum())
        for name, mode in modes:
            res = model.read(inputs, mode, return_logits=True)
            if mode.adaptive:
                used[name].append(res.passes_used - 1)
            nll = ntp(res.logits, targets, reduction="none")
            sums[name].append(nll.view(targets.shape).double())
    rows, first = [], None
    for name, mode in modes:
        nll = torch.cat(sums[name])  # (N, T)
        per_window = nll.mean(dim=1)
        first = per_window if first is None else first
        diff = per_window - first  # paired with the first mode (STANDARD) window by window
        rows.append({"mode": name, "passes": None if mode.exact or mode.adaptive else mode.passes,
                     "fused_passes_used": float(np.mean(used[name])) if name in used else None,
                     "nats_per_token": float(per_window.mean()), "stderr": _se(per_window),
                     "minus_first": float(diff.mean()), "minus_first_stderr": _se(diff),
                     "bits_per_byte": float(nll.sum()) / math.log(2) / max(nbytes, 1.0)})
        if keep_windows:
            rows[-1]["per_window"] = per_window.tolist()
    return rows


def _se(values: torch.Tensor) -> float:
    return float(values.std() / math.sqrt(len(values))) if len(values) > 1 else float("nan")
