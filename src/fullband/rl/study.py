"""The log-probability study: for each way of computing a sampled response's log-probability (fullband.rl.logprob),
how wrong it is against the exact one (value, gradient direction) and what it costs (time, memory held for the
backward pass), on the same rollouts."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from fullband.decode.sampling import Sampling
from fullband.model.core import FeedbackModel
from fullband.rl.logprob import Rollout, logprobs, rollout


def _pass(model: FeedbackModel, r: Rollout, path: str) -> tuple[torch.Tensor, torch.Tensor, float, int]:
    """One forward and backward of the summed log-probability -> (values, flat gradient, seconds, bytes saved)."""
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        values = logprobs(model, r, path)
    values.sum().backward()
    dt = time.perf_counter() - t0
    grad = torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).flatten() for p in model.parameters()])
    return values.detach(), grad, dt, saved


def logprob_study(model: FeedbackModel, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                  modes: Sequence[str], paths: Sequence[str], sampling: Sampling,
                  repeats: int = 3) -> list[dict]:
    """One row per (mode, path): the mean and largest value error against exact (nats/token, over the response
    tokens), the cosine of the gradient with the exact gradient, the median time of a forward + backward, its ratio
    to exact's (measured alternately, in this process), and the bytes autograd saved for the backward pass."""
    rows = []
    for mode in modes:
        r = rollout(model, prompts, max_new_tokens, mode=mode, sampling=sampling)
        mask = r.mask
        exact, exact_grad, _, _ = _pass(model, r, "exact")
        times: dict[str, list[float]] = {p: [] for p in ("exact", *paths)}
        results = {}
        for _ in range(repeats):  # alternate the paths: a busy machine slows them alike
            for path in times:
                values, grad, dt, saved = _pass(model, r, path)
                times[path].append(dt)
                results[path] = (values, grad, saved)
        base = sorted(times["exact"])[repeats // 2]
        for path in paths:
            values, grad, saved = results[path]
            err = (values - exact).abs()[mask]
            cosine = torch.nn.functional.cosine_similarity(grad.double(), exact_grad.double(), dim=0)
            rows.append({"mode": r.mode.label, "path": path, "tokens": int(mask.sum()),
                         "mean_error": float(err.mean()), "max_error": float(err.max()),
                         "engine_error": float((values - r.logprobs).abs()[mask].max()),
                         "grad_cosine": float(cosine),
                         "seconds": (t := sorted(times[path])[repeats // 2]), "time_vs_exact": t / base,
                         "saved_mib": saved / 2**20})
    model.zero_grad(set_to_none=True)
    return rows
