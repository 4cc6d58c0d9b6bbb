"""The methods `fullband reproduce compare` sets against each other (docs/method.md, section 4): each one's model
overrides and pass schedule, the reads it is scored with, and the training FLOPs its schedule costs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Read:
    """One way of reading held-out text: `passes` Jacobi passes (1: STANDARD, k + 1: FUSED k) with the looped group
    run `loops` times (None: the config's)."""

    label: str
    passes: int = 1
    loops: int | None = None


@dataclass(frozen=True)
class Method:
    key: str
    label: str
    family: str  # standard | feedback | looped | ponder
    model: Callable[[int], list[str]]  # n_layers -> model overrides
    passes: str  # train.passes, as TOML


def _feedback(source: Callable[[int], int | None], target: Callable[[int], int], fusion: str,
              residual: bool) -> Callable[[int], list[str]]:
    def overrides(n: int) -> list[str]:
        out = [f'model.fusion="{fusion}"', f"model.feedback_target={target(n)}"]
        if source(n) is not None:
            out.append(f"model.feedback_source={source(n)}")
        return out + (['model.feedback="residual"'] if residual else [])

    return overrides


THREE = '"three-pass"'
PONDER_PASSES = '[{until = 1.0, probs = {"4" = 0.5, "5" = 0.5}}]'  # their 2-3 refinements + the plain and final pass
METHODS = {m.key: m for m in (
    Method("standard", "standard transformer", "standard", lambda n: ['model.fusion="none"'], '"none"'),
    Method("fbt", "full-bandwidth (ours): top state into block 0, gated", "feedback", lambda n: [], THREE),
    Method("t2mlr", "T2MLR-like: block n/2's stream into block n/4, their mixer", "feedback",
           _feedback(lambda n: n // 2, lambda n: n // 4, "t2mlr", True), THREE),
    Method("lrt", "LRT-like: block n-2's stream into block 0, additive", "feedback",
           _feedback(lambda n: n - 2, lambda n: 0, "additive", True), THREE),
    Method("looped", "looped depth: blocks [n/4, 3n/4) r times, r ~ U{1..3}", "looped",
           lambda n: ['model.fusion="none"', f"model.loop_start={n // 4}", f"model.loop_stop={3 * n // 4}",
                      "model.loops=3", 'model.loop_train="uniform"'], '"none"'),
    Method("ponder", "PonderLM-2: a ponder slot per token fed its own state", "ponder",
           lambda n: ['model.fusion="none"', "model.ponder=true", "model.jitter=0", "model.prefix_mixin_prob=0"],
           PONDER_PASSES),
)}
RIVALS = [k for k in METHODS if k != "standard"]


def reads(family: str, loops: int = 3) -> list[Read]:
    """The reads of a method, cheapest first."""
    if family == "feedback":
        return [Read("STANDARD"), Read("FUSED k=1", 2), Read("FUSED k=2", 3)]
    if family == "looped":
        return [Read(f"r={r}", 1, r) for r in range(1, loops + 1)]
    if family == "ponder":
        return [Read("FUSED k=1", 2), Read("FUSED k=4", 5)]
    return [Read("STANDARD")]


def tracking_modes(family: str, loops: int = 3) -> list[tuple[str, str, int | None]]:
    """(label, mode, r) of a method's state-tracking reads."""
    if family == "feedback":
        from fullband.eval.tracking import DEFAULT_MODES

        return [(m, m, None) for m in DEFAULT_MODES]
    if family == "looped":
        return [(f"r={r}", "standard", r) for r in (1, loops, 2 * loops)]
    if family == "ponder":
        return [(m, m, None) for m in ("fused:1", "fused:4", "fused:auto", "exact")]
    return [("standard", "standard", None)]


def _schedule(passes: str):
    """A method's train.passes (TOML text) as a PassSchedule."""
    import tomllib

    from fullband.train.schedule import PassSchedule

    return PassSchedule.parse(tomllib.loads(f"v = {passes}")["v"])


def _mean_passes(passes: str) -> float:
    return _schedule(passes).mean_passes()


def _train_flops(cfg, passes: str, seq_len: int) -> float:
    from fullband.model.flops import train_flops

    return train_flops(cfg, _mean_passes(passes), seq_len=seq_len)
