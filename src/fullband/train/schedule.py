"""Schedules as pure functions of the step: the WSD learning-rate factor, the pass schedule (how many Jacobi passes
a step trains with) and a looped model's r (how often its group repeats), drawn from generators seeded by
(seed, step) so every rank and a resume agree."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import numpy as np

from fullband.errors import ConfigError, closest
from fullband.validate import ascii_int, integer, number

PROB_TOLERANCE = 1e-6


# ---------------------------------------------------------------- learning rate (warmup, stable, decay)
def cooldown_steps(total_steps: int, cooldown_fraction: float) -> int:
    """Steps in the cooldown: cooldown_fraction * total_steps, rounded, and at least 1 when the fraction is > 0."""
    integer("total_steps", total_steps, 1)
    number("cooldown_fraction", cooldown_fraction, low=0, high=1)
    return 0 if cooldown_fraction == 0 else min(total_steps, max(1, round(cooldown_fraction * total_steps)))


def in_cooldown(step: int, total_steps: int, cooldown_fraction: float) -> bool:
    """Whether `step` (0-based) lies in the final linear decay (z-loss and weight-decay decay switch on there)."""
    integer("step", step, 0)
    n = cooldown_steps(total_steps, cooldown_fraction)
    return n > 0 and step >= total_steps - n


def wsd_factor(step: int, total_steps: int, warmup_steps: int, cooldown_fraction: float) -> float:
    """LR multiplier in (0, 1] for 0-based `step` (the update made at that step): warmup, stable, decay.

    Warmup: (step + 1) / warmup_steps, so step 0 already moves and step warmup_steps - 1 reaches 1.
    Cooldown over the last n = cooldown_steps(total_steps, cooldown_fraction) steps: (total_steps - step) / n,
    1 at its first step, 1/n at the last step (total_steps - 1), and 0 at step total_steps, which is never
    taken. Where warmup and cooldown overlap (short runs) the smaller factor wins. Steps past the end give 0."""
    integer("step", step, 0)
    integer("warmup_steps", warmup_steps, 0)
    n = cooldown_steps(total_steps, cooldown_fraction)
    if warmup_steps > total_steps:
        raise ConfigError(f"warmup_steps={warmup_steps} exceeds total_steps={total_steps}; accepted: 0 <= "
                          "warmup_steps <= total_steps")
    if step >= total_steps:
        return 0.0
    factor = 1.0
    if step < warmup_steps:
        factor = (step + 1) / warmup_steps
    if n and step >= total_steps - n:
        factor = min(factor, (total_steps - step) / n)
    return factor


# ---------------------------------------------------------------- looped depth
LOOP_STREAM = 1  # appended to (seed, step): r's draws never share the pass count's stream


def blend_end(total_steps: int, until: float) -> int:
    """The step at which the blend curriculum's weight reaches 1 (train.blend_until; 0: no curriculum)."""
    return round(until * total_steps)


def falling_end(total_steps: int, until: float) -> int:
    """The step at which a distillation term's falling weight reaches 0 (train.distill_until and its kin)."""
    return max(1, round(until * total_steps))


def blend_weight(step: int, total_steps: int, until: float) -> float:
    """The blend curriculum's weight a at 0-based optimizer step `step` (train.blend_until): fed inputs are
    (1 - a) * plain + a * fused, a rising linearly from 0 at step 0 to 1 at round(until * total_steps) and 1 after
    (until 0: no curriculum, a = 1 from the start)."""
    end = blend_end(total_steps, until)
    return 1.0 if end <= 0 else min(1.0, step / end)


def distill_weight(step: int, total_steps: int, weight: float, until: float) -> float:
    """A distillation term's weight at 0-based optimizer step `step` (train.distill and train.distill_until,
    train.anchor and train.anchor_until, or train.block_match and train.block_match_until): `weight` at step 0,
    falling linearly to 0 at round(until * total_steps), 0 after; a function of the step only."""
    return weight * max(0.0, 1.0 - step / falling_end(total_steps, until))


def sample_loops(model_cfg, step: int, seed: int) -> int:
    """r, the looped group's repetitions at `step` for a ModelConfig: loops under loop_train = "fixed", else
    r ~ U{1..loops}; a function of (seed, step) only, the same on every rank (they must run one graph)."""
    integer("seed", seed, 0)
    if model_cfg.loop_train == "fixed" or model_cfg.loops == 1:
        return model_cfg.loops
    return int(np.random.default_rng([seed, step, LOOP_STREAM]).integers(1, model_cfg.loops + 1))


# ---------------------------------------------------------------- pass schedule
class Stage(NamedTuple):
    """Applies while step / total_steps < until; probs maps a pass count k >= 1 to its probability."""

    until: float
    probs: dict[int, float]


PRESETS: dict[str, list[tuple[float, dict[int, float]]]] = {
    "none": [(1.0, {1: 1.0})],
    "two-pass": [(1.0, {2: 1.0})],  # a warm start's cheapest feedback training (docs/results/warmstart.md)
    "three-pass": [(1.0, {3: 1.0})],
    "paper-100b": [(1.0, {1: 0.75, 3: 0.25})],
    # single-pass first, feedback passes from mid training: 75/22/3 one/two/three (mean 1.28 passes)
    "paper-200b": [(0.5, {1: 1.0}), (1.0, {1: 0.75, 2: 0.22, 3: 0.03})],
    # the stability experiment (docs/method.md, section 8): 75/25 one/two diverges when iterated, 3% three-pass fixes it
    "one-two": [(1.0, {1: 0.75, 2: 0.25})],
    "one-two-three": [(1.0, {1: 0.75, 2: 0.22, 3: 0.03})],
}


GROW = "grow:"


def draw(probs: Mapping[int, float], step: int, seed: int) -> int:
    """A pass count from {k: probability}, by numpy's generator seeded by [seed, step] only."""
    integer("seed", seed, 0)
    if len(probs) == 1:
        return next(iter(probs))
    u = np.random.default_rng([seed, step]).random()
    total = 0.0
    for k, p in probs.items():
        total += p
        if u < total:
            return k
    return max(k for k, p in probs.items() if p > 0)  # u within rounding of 1


@dataclass(frozen=True, eq=True)
class PassSchedule:
    """Stages (until_fraction, {k: probability}) in increasing `until`, the last at 1.0. The pass count of a
    step is drawn from numpy's generator seeded by [seed, step] only: reproducible on any rank or resume."""

    stages: tuple[Stage, ...]
    name: str | None = None  # the preset it came from, for logs

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", _validate_stages(self.stages))

    # ------------------------------------------------------------ construction
    @classmethod
    def preset(cls, name: str) -> "PassSchedule":
        """A preset by name (PRESETS), or "grow:N": passes growing over training, 1, then 2 or 4, 4 or 8, 8 or N
        (each capped at N) in four equal stages; with N the length of a whole example plus one, training's last
        stage includes the exact recurrence (the Jacobi fixed point), as for the state-tracking tasks."""
        if isinstance(name, str) and name.startswith(GROW):
            deep = name[len(GROW):]
            if not (deep.isascii() and deep.isdigit() and int(deep) >= 1):
                raise ConfigError(f"pass schedule {name!r}: {GROW}N needs an integer N >= 1 (e.g. {GROW}11)")
            deep = int(deep)
            return cls([(until, {k: n / 2 for k, n in Counter(min(k, deep) for k in pair).items()})
                        for until, pair in ((0.25, (1, 1)), (0.5, (2, 4)), (0.75, (4, 8)), (1.0, (8, deep)))], name=name)
        if name not in PRESETS:
            hint = closest(name, (*PRESETS, ADAPTIVE)) if isinstance(name, str) else ""
            raise ConfigError(f"unknown pass schedule {name!r}{hint}; accepted presets: {', '.join(PRESETS)}, "
                              f"{GROW}N, {ADAPTIVE}")
        return cls(PRESETS[name], name=name)

    @classmethod
    def parse(cls, value: Any) -> "PassSchedule":
        """A preset name, a PassSchedule, or stages as TOML gives them:
        [{until = 0.5, probs = {"1" = 1.0}}, {until = 1.0, probs = {"1" = 0.75, "3" = 0.25}}]
        (pairs [until, {k: p}] are accepted too)."""
        if isinstance(value, PassSchedule):
            return value
        if isinstance(value, str):
            return cls.preset(value)
        if not isinstance(value, Sequence) or isinstance(value, bytes):
            raise ConfigError(f"pass schedule {value!r} is invalid; accepted: a preset name ({', '.join(PRESETS)}) "
                              f"or a list of {{until = ..., probs = {{\"k\" = p, ...}}}} stages")
        return cls(list(value))  # __init__ reads and checks each stage

    def to_data(self) -> list[dict[str, Any]]:
        """Stages as TOML / JSON data (string keys); PassSchedule.parse(s.to_data()) == s."""
        return [{"until": s.until, "probs": {str(k): p for k, p in s.probs.items()}} for s in self.stages]

    # ------------------------------------------------------------ queries
    def stage_index(self, step: int, total_steps: int) -> int:
        """The stage that applies at 0-based `step`; steps past the end stay in the last stage."""
        integer("step", step, 0)
        integer("total_steps", total_steps, 1)
        for i, stage in enumerate(self.stages):
            if step < stage.until * total_steps:  # step / total_steps < until, without a float division
                return i
        return len(self.stages) - 1

    def sample(self, step: int, total_steps: int, seed: int) -> int:
        """The pass count k for `step`: a function of (seed, step) and the schedule only."""
        return draw(self.stages[self.stage_index(step, total_steps)].probs, step, seed)

    def mean_passes(self, total_steps: int | None = None) -> float:
        """Expected passes per step over the run (token-equivalent compute = tokens x this). With total_steps,
        stages are weighted by their whole step counts; without it, by their fractions of the run."""
        if total_steps is None:
            bounds = [0.0, *(s.until for s in self.stages)]
        else:  # a stage's first step: the smallest with step >= until * total_steps (the last until is 1)
            integer("total_steps", total_steps, 1)
            bounds = [0, *(min(total_steps, math.ceil(s.until * total_steps)) for s in self.stages)]
        weights = [until - prev for prev, until in zip(bounds, bounds[1:])]
        return sum(w * sum(k * p for k, p in s.probs.items()) for w, s in zip(weights, self.stages)) / sum(weights)

    @property
    def max_passes(self) -> int:
        """The largest k any step can draw (for sizing memory)."""
        return max(k for s in self.stages for k, p in s.probs.items() if p > 0)

    def __str__(self) -> str:
        body = "; ".join(f"until {s.until:g}: " + ", ".join(f"{k}x {p:g}" for k, p in s.probs.items())
                         for s in self.stages)
        return f"{self.name} ({body})" if self.name else body


def _stage_from_data(index: int, item: Any) -> tuple[Any, Any]:
    if isinstance(item, Mapping):
        unknown = sorted(set(item) - {"until", "probs"})
        if unknown or "until" not in item or "probs" not in item:
            why = f" (unknown key {unknown[0]!r}{closest(str(unknown[0]), ('until', 'probs'))})" if unknown else ""
            raise ConfigError(f"pass schedule stage {index + 1}: {dict(item)!r} is invalid{why}; accepted: a table "
                              "{until = <fraction>, probs = {\"k\" = p, ...}}")
        return item["until"], item["probs"]
    if isinstance(item, Sequence) and not isinstance(item, str) and len(item) == 2:
        return item[0], item[1]
    raise ConfigError(f"pass schedule stage {index + 1}: {item!r} is invalid; accepted: "
                      f"{{until = <fraction>, probs = {{\"k\" = p}}}}")


def _pass_count(stage: int, key: Any) -> int:
    """k from an int or a digit string (TOML keys are strings)."""
    k = key
    if isinstance(key, str) and (parsed := ascii_int(key.strip())) is not None:
        k = parsed
    if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
        raise ConfigError(f"pass schedule stage {stage}: pass count {key!r} is invalid; accepted: an integer k >= 1")
    return int(k)


def _validate_stages(stages: Sequence[Any]) -> tuple[Stage, ...]:
    if isinstance(stages, str | bytes) or not isinstance(stages, Sequence) or not stages:
        raise ConfigError(f"pass schedule {stages!r} has no stages; accepted: a non-empty list of (until, {{k: p}})")
    out: list[Stage] = []
    prev = 0.0
    for i, item in enumerate(stages, start=1):
        until, probs = _stage_from_data(i - 1, item)
        if isinstance(until, bool) or not isinstance(until, int | float) or not 0 < until <= 1:
            raise ConfigError(f"pass schedule stage {i}: until={until!r}; accepted: a fraction 0 < until <= 1")
        if until <= prev:
            raise ConfigError(f"pass schedule stage {i}: until={until} does not come after the previous stage's "
                              f"until={prev}; accepted: strictly increasing until fractions")
        if not isinstance(probs, Mapping) or not probs:
            raise ConfigError(f"pass schedule stage {i}: probs={probs!r}; accepted: a non-empty table "
                              "{k: probability}")
        clean: dict[int, float] = {}
        for key, p in probs.items():
            k = _pass_count(i, key)
            if isinstance(p, bool) or not isinstance(p, int | float) or not 0 <= p <= 1:
                raise ConfigError(f"pass schedule stage {i}: probability {p!r} for k={k}; accepted: 0 <= p <= 1")
            if k in clean:
                raise ConfigError(f"pass schedule stage {i}: k={k} appears twice in {dict(probs)!r}")
            clean[k] = float(p)
        total = sum(clean.values())
        if abs(total - 1) > PROB_TOLERANCE:
            raise ConfigError(f"pass schedule stage {i}: probabilities {dict(probs)!r} sum to {total:.6g}; accepted: "
                              f"a sum of 1 (tolerance {PROB_TOLERANCE:g})")
        out.append(Stage(float(until), dict(sorted(clean.items()))))
        prev = until
    if out[-1].until != 1.0:
        raise ConfigError(f"pass schedule: the last stage ends at until={out[-1].until}; accepted: the last until is "
                          "1.0 (the schedule must cover the whole run)")
    return tuple(out)


# ---------------------------------------------------------------- adaptive pass schedule
ADAPTIVE = "adaptive"


class PassMix(NamedTuple):
    """The adaptive schedule's state: the share of multi-pass steps and their highest pass count."""

    share: float
    top: int


# bounds on what one measurement of the adaptive schedule reads (each is a forward-mode pass over held-out windows):
# a measurement must stay a fraction of a step's cost; the pass counts are bounded by the window (RunConfig)
MEASURE_BOUNDS = {"windows": 257, "vectors": 65}


@dataclass(frozen=True)
class AdaptiveSchedule:
    """train.passes = "adaptive" (or a table {schedule = "adaptive", every = 25, ...}): the mix of pass counts is
    steered by the measured contraction of the pass map (docs/method.md, section 8).

    A step draws k = 1 with probability 1 - share; a multi-pass step draws the highest count `top` with probability
    deep_share, else k uniform in 2..top - 1 (top = 2: every multi-pass step has 2). The start is the paper's 75/22/3
    (share 0.25, top 3, deep_share 0.12). Every `every` steps the trainer measures, on the first `windows` held-out
    windows, the perturbation growth per pass over `horizon` passes (eval.stability.contraction, as `fullband eval
    stability` reports it) and the fixed-point residual between passes horizon - 1 and horizon; `decide` turns them
    into the next mix. So the pass count of a step is a function of (seed, step, the values measured before it)."""

    every: int = 25  # optimizer steps between measurements
    horizon: int = 8  # passes the growth and residual are measured over: beyond the trained depth
    windows: int = 2  # held-out windows measured (the first of the run's validation windows)
    vectors: int = 1  # random directions per measurement; the worst counts
    share: float = 0.25  # the starting share of multi-pass steps
    top: int = 3  # the starting highest pass count
    deep_share: float = 0.12  # of the multi-pass steps, the share drawn at `top`
    step: float = 0.05  # how much one decision moves the share
    # the floor: by default the paper's mix, so "lower" only gives back what "raise" added (below it the fused
    # passes go undertrained: docs/results/schedule.md, adaptive-low)
    min_share: float = 0.25
    min_top: int = 3
    max_share: float = 0.75
    cap: int = 8  # the highest pass count the schedule may reach
    expand: float = 0.9  # growth per pass at or above this: not contracting beyond the trained depth -> more passes
    margin: float = 0.5  # growth below this (and a small residual): contracting with margin -> fewer
    residual: float = 0.25  # the residual (relative to the state's RMS) above which the map is not converging

    def __post_init__(self) -> None:
        for name, low in (("every", 1), ("horizon", 2), ("windows", 1), ("vectors", 1), ("top", 2), ("min_top", 2),
                          ("cap", 2)):
            integer(f"train.passes.{name}", getattr(self, name), low, below=MEASURE_BOUNDS.get(name))
        for name in ("share", "deep_share", "min_share", "max_share"):
            number(f"train.passes.{name}", getattr(self, name), low=0, high=1)
        number("train.passes.step", self.step, low=0, high=1, low_open=True)
        for name in ("expand", "margin", "residual"):
            number(f"train.passes.{name}", getattr(self, name), low=0, low_open=True)
        if not self.min_share <= self.share <= self.max_share:
            raise ConfigError(f"train.passes.share={self.share} lies outside [min_share, max_share] = "
                              f"[{self.min_share}, {self.max_share}]; accepted: min_share <= share <= max_share")
        if not self.min_top <= self.top <= self.cap:
            raise ConfigError(f"train.passes.top={self.top} lies outside [min_top, cap] = [{self.min_top}, {self.cap}]; "
                              "accepted: min_top <= top <= cap")
        if self.margin >= self.expand:
            raise ConfigError(f"train.passes.margin={self.margin} is not below train.passes.expand={self.expand}; "
                              "accepted: margin < expand (between them the mix holds)")

    @property
    def name(self) -> str:
        return ADAPTIVE

    @property
    def max_passes(self) -> int:
        """The largest k any step can draw (for sizing memory): the cap."""
        return self.cap

    def start(self) -> PassMix:
        return PassMix(self.share, self.top)

    def probs(self, mix: PassMix) -> dict[int, float]:
        """{k: probability} of a step under `mix`."""
        multi = {2: mix.share} if mix.top == 2 else {
            **{k: mix.share * (1 - self.deep_share) / (mix.top - 2) for k in range(2, mix.top)},
            mix.top: mix.share * self.deep_share}
        return {1: 1 - mix.share, **multi}

    def sample(self, step: int, total_steps: int, seed: int, mix: PassMix | None = None) -> int:
        """The pass count k of `step` under `mix` (default: the starting mix)."""
        return draw(self.probs(mix or self.start()), step, seed)

    def mean_passes(self, total_steps: int | None = None) -> float:
        """Expected passes per step of the starting mix (the run's own depends on what it measures)."""
        return sum(k * p for k, p in self.probs(self.start()).items())

    def decide(self, mix: PassMix, growth: float, residual: float) -> tuple[PassMix, str]:
        """The next mix from a measurement -> (mix, "raise" | "lower" | "hold"). Not contracting beyond the trained
        depth (growth >= expand, or residual > self.residual): the share rises by `step`, and `top` by one when the
        share is at its maximum or the map expands (growth >= 1). Contracting with margin (growth < margin and the
        residual within bounds): the share falls by `step`, and `top` by one (not below min_top) once the share is at
        its minimum."""
        share, top = mix
        if not (math.isfinite(growth) and math.isfinite(residual)) or growth >= self.expand or residual > self.residual:
            if growth >= 1 or share >= self.max_share or not math.isfinite(growth):
                top = min(self.cap, top + 1)
            share = min(self.max_share, share + self.step)
            action = "raise"
        elif growth < self.margin:
            if share <= self.min_share:
                top = max(self.min_top, top - 1)
            share = max(self.min_share, share - self.step)
            action = "lower"
        else:
            action = "hold"
        return PassMix(round(share, 9), top), action

    def to_data(self) -> dict[str, Any]:
        return {"schedule": ADAPTIVE, **{f.name: getattr(self, f.name) for f in fields(self)}}

    def __str__(self) -> str:
        return (f"adaptive (start {self.share:g} multi-pass up to {self.top}, measured every {self.every} steps over "
                f"{self.horizon} passes)")


def parse_schedule(value: Any) -> PassSchedule | AdaptiveSchedule:
    """train.passes: "adaptive" or a table {schedule = "adaptive", <AdaptiveSchedule settings>}, else a fixed
    schedule (PassSchedule.parse: a preset name or stages)."""
    if isinstance(value, PassSchedule | AdaptiveSchedule):
        return value
    if value == ADAPTIVE:
        return AdaptiveSchedule()
    if isinstance(value, Mapping):
        if value.get("schedule") != ADAPTIVE:
            raise ConfigError(f"train.passes={dict(value)!r} is a table without schedule = \"adaptive\"; accepted: "
                              f'a preset name, a list of stages, or {{schedule = "adaptive", every = ..., ...}}')
        from fullband.configio import from_dict

        return from_dict(AdaptiveSchedule, {k: v for k, v in value.items() if k != "schedule"}, "train.passes")
    return PassSchedule.parse(value)
