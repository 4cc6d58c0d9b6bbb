"""The stability gate: a checklist of cheap stability diagnostics run on a few held-out windows at every validation
eval of `fullband train` (logged in metrics.jsonl, shown by `fullband doctor` and every `fullband reproduce` report).

  a. every logit finite, at each pass count evaluated (1, `mid`, `deep`);
  b. max |logit| < 100;
  c. the fed-back state's per-position RMS, 99th percentile, at pass `deep` within [0.25, 4] x its value at pass 1;
  d. the fixed-point residual RMS(h^(k) - h^(k-1)) / RMS(h^(k)) at pass `deep` <= 0.25 and <= its value at `mid`.
c and d need feedback weights (else "n/a"). Windows of T positions are exact after T passes (T + 1 under ponder), so
the passes stop there and a residual beyond is 0."""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor

from fullband.eval.stability import relative_residual

LOGIT_LIMIT = 100.0
RMS_BAND = (0.25, 4.0)
RESIDUAL_LIMIT = 0.25
# a residual this small counts as converged whatever pass `mid`'s was: float rounding (bf16 rounds at ~4e-3
# relative), not growth, decides the order of two residuals that small
RESIDUAL_FLOOR = 1e-3
CHECKS = ("finite", "max_logit", "state_rms", "residual")


@dataclass
class Check:
    name: str  # one of CHECKS
    values: dict[str, float | None]  # what was measured (keys name the pass or the ratio)
    threshold: str
    passed: bool | None  # None: n/a (a model without feedback weights)
    failure: str = ""  # what failed, in words (empty when passed or n/a)


@dataclass
class Gate:
    checks: list[Check] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(c.passed is not False for c in self.checks)

    def failures(self) -> list[str]:
        return [c.failure for c in self.checks if c.passed is False]

    def summary(self) -> str:
        """One line: 'stability gate: pass' or 'stability gate: FAILED (what failed; ...)'."""
        return "stability gate: pass" if self.passed else f"stability gate: FAILED ({'; '.join(self.failures())})"

    def to_dict(self) -> dict:
        """JSON-ready: {"passed", "summary", "checks": {name: {values, threshold, passed, failure}}} (checks keyed by
        name, so a metrics logger flattens it to scalars)."""
        return {"passed": self.passed, "summary": self.summary(),
                "checks": {c.name: {k: v for k, v in asdict(c).items() if k != "name"} for c in self.checks}}

    @classmethod
    def from_dict(cls, d: dict) -> Gate:
        return cls([Check(name=name, **c) for name, c in d["checks"].items()])


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g}"


@torch.no_grad()
def stability_gate(model, inputs: Tensor, *, plain_mask: Tensor | None = None, deep: int = 32, mid: int = 8,
                   autocast=None) -> Gate:
    """The gate on windows inputs (B, T): one run of the model's own pass loop (its forward, so an FSDP model's
    collectives run as in any forward: every rank must call it, on the same windows), the logits formed only at
    passes 1, mid and deep. Read-only; the model's train mode is restored. `model` may be a DDP wrapper."""
    if not 1 <= mid <= deep:
        raise ValueError(f"need 1 <= mid <= deep, got mid={mid}, deep={deep}")
    net = getattr(model, "module", model)
    was_training = net.training
    net.eval()
    device = next(net.parameters()).device
    inputs = inputs.to(device)
    feedback = net.config.has_feedback
    runs = min(deep, net.exact_passes(inputs.shape[1])) if feedback else 1  # beyond: the fixed point, repeated
    logit_at = sorted({1, min(mid, runs), runs})
    seen: dict = {"finite": {}, "max": {}, "residual": {}}

    def each_pass(j: int, h: Tensor, top: Tensor) -> None:
        k = j + 1
        if k in logit_at:
            finite, biggest = True, 0.0
            for row in top:  # one window's logits at a time: (T, V) is the largest tensor formed
                logits = net.head(row).float()
                finite = finite and bool(torch.isfinite(logits).all())
                biggest = max(biggest, float(logits.abs().nan_to_num(nan=math.inf).max()))
            seen["finite"][k], seen["max"][k] = finite, biggest
        if k == 1:
            seen["rms1"] = _p99_rms(h)
        if k in (mid, deep) and "h" in seen:
            seen["residual"][k] = relative_residual(h, seen["h"])
        seen["h"] = h
        if k == runs:
            seen["rms_deep"] = _p99_rms(h)

    try:
        with autocast or contextlib.nullcontext():
            net(inputs, passes=runs, plain_mask=None if plain_mask is None else plain_mask.to(device),
                each_pass=each_pass, return_logits=False)
    finally:
        net.train(was_training)
    return _judge(seen, feedback, runs, mid, deep)


def _p99_rms(h: Tensor) -> float:
    """99th percentile over positions of the per-position RMS of h (B, T, D)."""
    return float(torch.quantile(h.double().pow(2).mean(-1).sqrt().flatten(), 0.99))


def _judge(seen: dict, feedback: bool, runs: int, mid: int, deep: int) -> Gate:
    passes = sorted(seen["finite"])
    bad = [k for k in passes if not seen["finite"][k]]
    checks = [Check("finite", {str(k): float(seen["finite"][k]) for k in passes}, "every logit finite", not bad,
                    f"non-finite logits at pass {', '.join(map(str, bad))}" if bad else "")]
    biggest = max(seen["max"].values())
    worst = max(passes, key=lambda k: seen["max"][k])
    ok = biggest < LOGIT_LIMIT
    checks.append(Check("max_logit", {str(k): seen["max"][k] for k in passes}, f"< {LOGIT_LIMIT:g}", ok,
                        "" if ok else f"max |logit| {_fmt(biggest)} >= {LOGIT_LIMIT:g} at pass {worst}"))
    if not feedback:
        checks += [Check("state_rms", {}, "n/a: no feedback weights", None),
                   Check("residual", {}, "n/a: no feedback weights", None)]
        return Gate(checks)
    lo, hi = RMS_BAND
    ratio = seen["rms_deep"] / seen["rms1"] if seen["rms1"] > 0 else math.inf
    ok = lo <= ratio <= hi  # False for NaN
    checks.append(Check("state_rms", {"pass1": seen["rms1"], f"pass{deep}": seen["rms_deep"], "ratio": ratio},
                        f"p99 per-position state RMS at pass {deep} within [{lo:g}, {hi:g}] x pass 1", ok,
                        "" if ok else f"state RMS p99 at pass {deep} {_fmt(ratio)} x pass 1, outside [{lo:g}, {hi:g}]"))
    r_mid = seen["residual"].get(mid, 0.0) if runs >= mid else 0.0  # exact before pass mid: nothing moves after
    r_deep = seen["residual"].get(deep, 0.0) if runs >= deep else 0.0
    why = []
    if not r_deep <= RESIDUAL_LIMIT:
        why.append(f"residual at pass {deep} {_fmt(r_deep)} > {RESIDUAL_LIMIT:g}")
    elif not r_deep <= max(r_mid, RESIDUAL_FLOOR):
        why.append(f"residual at pass {deep} {_fmt(r_deep)} > pass {mid}'s {_fmt(r_mid)}")
    checks.append(Check("residual", {f"pass{mid}": r_mid, f"pass{deep}": r_deep},
                        f"RMS(h^k - h^(k-1)) / RMS(h^k) at pass {deep} <= {RESIDUAL_LIMIT:g} and <= pass {mid}'s",
                        not why, "; ".join(why)))
    return Gate(checks)


def verdict(gate: dict) -> str:
    """A logged gate (Gate.to_dict) in words: 'stability gate: pass' or 'stability gate FAILED: what failed; ...'."""
    g = Gate.from_dict(gate)
    return "stability gate: pass" if g.passed else f"stability gate FAILED: {'; '.join(g.failures())}"


def gate_windows(batches, windows: int) -> tuple[Tensor, Tensor | None]:
    """The first `windows` windows of (inputs, targets[, plain]) batches -> (inputs (N, T), plain mask or None)."""
    inputs, plain, n = [], [], 0
    for batch in batches:
        if n >= windows:
            break
        inputs.append(batch[0][: windows - n])
        if len(batch) > 2:
            plain.append(batch[2][: windows - n])
        n += inputs[-1].shape[0]
    if not inputs:
        raise ValueError("no validation windows to run the stability gate on")
    return torch.cat(inputs), torch.cat(plain) if plain else None
