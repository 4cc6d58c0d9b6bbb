"""The plan of `fullband reproduce compare`: the methods it sets against each other (docs/method.md, section 4:
each one's model overrides and pass schedule, the reads it is scored with, the training FLOPs its schedule costs),
its scales, and every run it trains: each method at N steps, the standard model at 2N, at each rival's training
FLOPs and deeper, in two regimes; then the state-tracking runs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from fullband.reproduce.runner import Run, Settings
from fullband.reproduce.tracking import TRACKING, TRACKING_TASKS as TASKS


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


REGIMES = ("fresh", "repeated")


@dataclass(frozen=True)
class Scale:
    """The sizes of one study: overrides on configs/tiny.toml (language modelling) and configs/tracking-tiny.toml
    (state tracking), steps, the repeated regime's unique tokens, and the evaluations' sizes."""

    lm: tuple[str, ...]
    steps: int  # N: both regimes' steps (a method's runs; standard models also train 2N and matched-FLOP steps)
    unique_tokens: int  # the repeated regime's corpus: the training split's first tokens, repeated
    tracking: tuple[str, ...]
    tracking_steps: int
    windows: int  # held-out windows of every final read
    examples: int  # state-tracking examples per length
    cost: dict = field(default_factory=dict)  # fullband.bench.cost.run_cost_bench keywords
    eval_every: int = 25  # steps between the curves' held-out points


MICRO = ("model.d_model=32", "model.n_heads=2", "model.max_seq_len=256", "train.seq_len=32",
         "train.global_batch_tokens=256", "train.micro_batch=8", "train.warmup_steps=1", "log.eval_windows=4")
SCALES = {
    # the default, sized for <= 6 h on 2 CPU cores: the demo's model (0.9M parameters) on 200 steps of 4K tokens
    # (0.8M tokens per run; the repeated regime's 102K tokens are 8 epochs at N), the tracking recipe as it is
    "cpu": Scale(lm=("train.global_batch_tokens=4096",), steps=200, unique_tokens=102_400, tracking=(),
                 tracking_steps=400, windows=256, examples=200, cost=dict(repeats=7, seq_len=256)),
    # the same study on one GPU, 16x wider batches and a 4x larger model
    "gpu-small": Scale(lm=("model.d_model=512", "model.n_heads=8", "model.n_layers=8", "train.seq_len=512",
                           "model.max_seq_len=1024", "train.global_batch_tokens=131072", "train.micro_batch=64",
                           "train.warmup_steps=100", "log.eval_windows=128"),
                       steps=2000, unique_tokens=16_777_216,
                       tracking=("model.d_model=256", "model.n_heads=4", "train.global_batch_tokens=32768",
                                 "train.micro_batch=64"),
                       tracking_steps=2000, windows=512, examples=500,
                       cost=dict(repeats=9, batch=16, seq_len=512, prompt_len=128, new_tokens=64), eval_every=100),
    # a smoke test of the whole pipeline (a few minutes): the numbers mean nothing
    "micro": Scale(lm=(*MICRO, "log.ckpt_every=0"), steps=4, unique_tokens=2048,
                   tracking=(*MICRO[:2], "train.global_batch_tokens=512", "train.micro_batch=4",
                             "train.warmup_steps=1", "log.eval_windows=4", "log.ckpt_every=0"),
                   tracking_steps=4, windows=8, examples=8,
                   cost=dict(repeats=1, batch=2, seq_len=32, prompt_len=8, new_tokens=4), eval_every=2),
}


@dataclass
class Planned:
    run: Run
    method: str  # a METHODS key
    regime: str  # fresh | repeated | a tracking task
    steps: int
    role: str = ""  # standard models: "N", "2N", "xF" (matched FLOPs of some rival), "deep"
    model_cfg: object = None

    @property
    def name(self) -> str:
        return self.run.name


EVAL_PASSES = {"standard": "[1]", "feedback": "[1, 3]", "looped": "[1]", "ponder": "[2, 5]"}  # the curves' reads


def plan(scale: Scale, settings: Settings, lm_extra: tuple[str, ...] = (), tracking_extra: tuple[str, ...] = (),
         tasks: tuple[str, ...] | None = None) -> list[Planned]:
    """Every run of the study, in the order they train: per regime each method at N, the standard model at 2N,
    at each rival's training FLOPs (more steps; near-equal ratios share one run) and deeper with our training FLOPs
    per token; then the tracking runs, task by task (each method, and the standard model at our FLOPs)."""
    from fullband.train.config import load_run_config

    out: list[Planned] = []

    def cfg_of(config: str, overrides: list[str]):
        return load_run_config(config or settings.base, [*overrides, *settings.extra]).model

    def add(name: str, method: str, regime: str, steps: int, extra: list[str], config: str, n: int, role: str = ""):
        m = METHODS[method]
        overrides = [*extra, *m.model(n), f"train.passes={m.passes}", f"train.steps={steps}",
                     f"log.eval_passes={EVAL_PASSES[m.family]}"]
        out.append(Planned(Run(name, overrides, config), method, regime, steps, role, cfg_of(config, overrides)))

    base_lm = [*scale.lm, *lm_extra]
    lm = load_run_config(settings.base, [*base_lm, *settings.extra])
    seq, n_layers = lm.train.seq_len, lm.model.n_layers

    def flops_ratio(key: str, extra: list[str], n: int) -> float:
        m, std = METHODS[key], METHODS["standard"]
        return (_train_flops(cfg_of("", [*base_lm, *extra, *m.model(n), f"train.passes={m.passes}"]), m.passes, seq)
                / _train_flops(cfg_of("", [*base_lm, *std.model(n_layers), f"train.passes={std.passes}"]), std.passes,
                               seq))

    ratios: list[tuple[float, list[str]]] = []  # each rival's training FLOPs / standard's, near-equal ones merged
    for key in RIVALS:
        r = flops_ratio(key, [], n_layers)
        same = next((pair for pair in ratios if abs(pair[0] / r - 1) < 0.03), None)
        if same:
            same[1].append(key)
        else:
            ratios.append((r, [key]))
    ratios.sort()
    ours = next(r for r, keys in ratios if "fbt" in keys)
    deep = min(range(1, 4 * n_layers + 1),
               key=lambda n: abs(flops_ratio("standard", [f"model.n_layers={n}"], n) - ours))
    for regime in REGIMES:
        extra = [*base_lm, *([f"data.train_tokens={scale.unique_tokens}"] if regime == "repeated" else [])]
        for key in METHODS:
            add(f"{regime}-{key}", key, regime, scale.steps, extra, "", n_layers, "N" if key == "standard" else "")
        add(f"{regime}-standard-2n", "standard", regime, 2 * scale.steps, extra, "", n_layers, "2N")
        for r, keys in ratios:
            add(f"{regime}-standard-x{r:.2f}", "standard", regime, round(scale.steps * r), extra, "", n_layers,
                "x" + "/".join(keys))
        add(f"{regime}-standard-deep{deep}", "standard", regime, scale.steps, [*extra, f"model.n_layers={deep}"], "",
            deep, "deep")
    track = load_run_config(TRACKING, [*scale.tracking, *tracking_extra, *settings.extra])
    ours_keys = "/".join(next(keys for r, keys in ratios if "fbt" in keys))
    for task, length in TASKS.items():
        if tasks is not None and task not in tasks:
            continue
        extra = [f'data.corpus="{task}:{length}"', *scale.tracking, *tracking_extra]
        n = track.model.n_layers
        for key in METHODS:
            add(f"{task}-{key}", key, task, scale.tracking_steps, extra, TRACKING, n, "N" if key == "standard" else "")
        add(f"{task}-standard-x{ours:.2f}", "standard", task, round(scale.tracking_steps * ours), extra, TRACKING, n,
            "x" + ours_keys)
    return out


def runs() -> list[Run]:
    return [p.run for p in plan(SCALES["cpu"], Settings())]


def check(*, scale: str = "cpu", **_) -> None:
    """The study's options, checked before reproduce() writes anything."""
    from fullband.errors import InputError, closest

    if scale not in SCALES:
        raise InputError(f"--scale {scale!r} is unknown{closest(scale, SCALES)}; accepted: {', '.join(SCALES)}")
