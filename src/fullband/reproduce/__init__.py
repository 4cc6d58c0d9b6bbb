"""`fullband reproduce <experiment>`: the paper's claims at small scale. The registry of experiments (one module each,
listed once below) and reproduce(), which runs one of them end to end.

reproduce() trains the runs an experiment needs (from configs/tiny.toml plus overrides), evaluates them, and writes
docs/results/<experiment>.md with tables and figures, whatever the outcome. Finished runs are reused, interrupted ones
resumed."""

from __future__ import annotations

import json
import shlex
import time
from dataclasses import asdict
from pathlib import Path

from fullband.errors import InputError, closest
from fullband.files import check_no_loop, make_folder, replace_file
from fullband.reproduce import (compare, data_efficiency, fusion_ablation, probe, rl, robustness, schedule, sft,
                                stability, tracking, warmstart, warmstart_keep, warmstart_long)
from fullband.reproduce.runner import BASE, Experiment, Run, Settings, hardware, train_run
from fullband.reproduce.seeds import FINDINGS_FILE, SEEDS_FILE, Findings, across, across_lines
from fullband.validate import integer

__all__ = ["BASE", "EXPERIMENTS", "REGISTRY", "Experiment", "Run", "Settings", "check_extra", "gate_section",
           "hardware", "reproduce", "train_run"]

# the experiments, in the order `fullband reproduce all` runs them: adding one is a module with its EXPERIMENT
REGISTRY: dict[str, Experiment] = {m.EXPERIMENT.name: m.EXPERIMENT
                                   for m in (stability, probe, data_efficiency, fusion_ablation, sft, tracking, rl, compare,
                                           warmstart, warmstart_long, warmstart_keep, schedule, robustness)}
EXPERIMENTS = tuple(REGISTRY)


MAX_SEEDS = 100
# the options that change what an experiment reports, named in its report's command (--budget only says how much of a
# long run one invocation trains)
SAID = ("model", "replies", "cooldown", "cooldown_replay", "cooldown_anchor")
# settings reproduce() gives each run itself (after --set's): what to use instead
OWNED = {"train.seed": "--seeds N (seed 0 is the recipes as written, seed N sets train.seed = N)",
         "log.run_dir": "--root DIR (each run's folder is DIR/<experiment>/<run>)",
         "log.eval_every": "the experiment's own (its curves are read at the steps it chooses)"}


def reproduce(exp: str, *, root: str | Path = "runs/repro", docs: str | Path = "docs/results", base: str = BASE,
              extra: list[str] | None = None, seeds: int | None = None, **options) -> Path:
    """Run one experiment once per training seed (`seeds`, default the experiment's own: seed 0 is the recipes as
    written, seed N > 0 trains every run with train.seed = N under root/<exp>/seed-N); `extra`: training settings
    every run gets after the experiment's own (`--set`; the post-training phases' recipes excepted); `base` and
    `options` (keyword arguments of the experiment's function, e.g. sft's held_out) exist for tests. The report
    opens with the findings across seeds, then seed 0's report; every other seed's report is written beside it
    (<exp>/seed-N.md)."""
    if exp not in REGISTRY:
        raise InputError(f"experiment {exp!r} is unknown{closest(exp, EXPERIMENTS)}; "
                         f"accepted: {', '.join(EXPERIMENTS)}")
    experiment = REGISTRY[exp]
    n = experiment.seeds if seeds is None else seeds
    integer("--seeds", n, 1, below=MAX_SEEDS + 1, error=InputError)
    scale = options.get("scale")
    name = exp if scale in (None, "cpu") else f"{exp}-{scale}"  # another scale's study is a report of its own
    if experiment.check is not None:
        experiment.check(**options)  # before any folder is made
    check_extra(exp, extra, base)  # before anything is trained
    check_no_loop(root, "--root")
    root, docs = Path(root) / name, Path(docs)
    figs = make_folder(docs / name, "--docs folder")
    t0 = time.perf_counter()
    command = exp + (f" --scale {scale}" if name != exp else "") + (f" --seeds {n}" if n != experiment.seeds else "")
    command += "".join(f" --set {shlex.quote(o)}" for o in extra or ())
    command += "".join(f" --{key.replace('_', '-')} {shlex.quote(str(options[key]))}" for key in SAID
                       if options.get(key) is not None)
    per_seed, first = {}, []
    if experiment.seeds_option:  # the experiment is about seeds: it takes them itself, in one report
        options = {**options, "seeds": n}
    for seed in range(1 if experiment.seeds_option else n):
        settings = Settings(base, tuple(extra or ()), seed=seed)
        seed_figs = figs if seed == 0 else make_folder(figs / f"seed-{seed}", "--docs folder")
        if n > 1 and not experiment.seeds_option:
            print(f"=== {name}: seed {seed} ({seed + 1} of {n})", flush=True)
        lines = experiment.report(experiment.runs(), root if seed == 0 else root / f"seed-{seed}", seed_figs,
                                  settings, **options)
        per_seed[seed] = settings.findings
        replace_file(seed_figs / FINDINGS_FILE, json.dumps(settings.findings.to_data(), indent=1) + "\n")
        if seed == 0:
            first = lines
        else:
            replace_file(figs / f"seed-{seed}.md", "\n".join(
                [f"# Reproduction: {name}, seed {seed}", "",
                 f"Seed {seed} of `fullband reproduce {command}` (every run with `train.seed={seed}`, under "
                 f"`{root / f'seed-{seed}'}`); the findings across seeds are in [{name}.md](../{name}.md).", "",
                 *lines]) + "\n")
    total = time.perf_counter() - t0
    header = [f"# Reproduction: {name}", "",
              f"Produced by `fullband reproduce {command}` (runs under `{root}`), {time.strftime('%Y-%m-%d')}.",
              f"Hardware: {hardware()}. Wall time of this invocation: {total / 60:.1f} min "
              "(training time per run is in the tables; reused runs cost nothing here).", ""]
    if extra:  # settings every run got beyond the recipes (--set): the runs' own commands below omit them
        header[-1:] = ["Every run of this invocation also got " + ", ".join(f"`--set {o}`" for o in extra)
                       + ", beyond the recipes and the runs' commands below.", ""]
    out = docs / f"{name}.md"
    seed_lines = [] if experiment.seeds_option else _seed_lines(name, figs, per_seed)
    replace_file(out, "\n".join(header + seed_lines + first
                                 + gate_section(root, kept=figs / GATES_FILE)) + "\n")
    print(f"wrote {out}")
    return out


def check_extra(exp: str, extra: list[str] | None, base: str = BASE) -> None:
    """InputError, naming the run, where `extra` (--set) gives a mistyped key, a value one of the experiment's recipes
    refuses, or a setting the experiment gives each run itself (OWNED)."""
    from fullband.errors import ConfigError
    from fullband.train.config import load_run_config

    for pair in extra or ():
        key = pair.partition("=")[0].strip()
        if key in OWNED:
            raise InputError(f"--set {pair}: {key} is set by `fullband reproduce` for each run, after --set; "
                             f"accepted: {OWNED[key]}")
    for run in REGISTRY[exp].runs() if extra else ():
        try:
            load_run_config(run.config or base, [*run.overrides, *extra])
        except ConfigError as err:
            raise InputError(f"--set {' '.join(extra)}: the run {run.name!r} of {exp}: {err}") from None


def _seed_lines(name: str, figs: Path, per_seed: dict[int, Findings]) -> list[str]:
    """The report's opening: the findings across seeds (kept in SEEDS_FILE too), then the heading of seed 0's
    report; a one-seed run says that it measured no spread."""
    rows = across(per_seed)
    seeds = sorted(per_seed)
    replace_file(figs / SEEDS_FILE, json.dumps({"seeds": seeds, "rows": [asdict(r) for r in rows]}, indent=1) + "\n")
    if len(seeds) == 1:
        return ["One training seed (`--seeds 1`): no spread across seeds is measured here; `--seeds N` trains every "
                "run with N seeds and reports each finding's spread.", ""]
    others = ", ".join(f"[seed {s}]({name}/seed-{s}.md)" for s in seeds[1:])
    return ["## Across seeds", "", *across_lines(rows, seeds),
            f"Each seed's own report: seed 0 below, {others}.", "", "## Seed 0", ""]


GATES_FILE = "gates.json"  # in the report's folder: each run's gate line, for a report rebuilt without its runs


def gate_section(root: str | Path, *, kept: Path | None = None) -> list[str]:
    """The report's "## Stability gate" lines: one per run directory under `root` with a metrics.jsonl, the gate's
    verdict at its last eval (fullband.train.metrics.last_gate). `kept` (JSON): the lines of earlier reports, so runs
    whose folders are gone (an experiment that reuses its records on another machine) keep theirs; it is updated."""
    from fullband.files import read_json
    from fullband.train.metrics import METRICS_FILE, last_gate

    root = Path(root)
    said: dict[str, str] = dict(read_json(kept) or {}) if kept is not None else {}
    for run in sorted(p.parent for p in root.rglob(METRICS_FILE)) if root.is_dir() else []:
        gate = last_gate(run)
        if gate is None:
            verdict = "no validation eval logged"
        elif gate is False:
            verdict = "not measured (trained before the gate existed, or with log.gate_windows = 0)"
        else:
            verdict = "pass" if gate.passed else f"FAILED: {'; '.join(gate.failures())}"
        said[run.relative_to(root).as_posix()] = verdict
    if kept is not None and said:
        replace_file(kept, json.dumps(said, indent=1, sort_keys=True) + "\n")
    lines = ["", "## Stability gate", "",
             "Each run's stability gate at its last validation eval (docs/method.md, the stability gate).", ""]
    lines += [f"- `{name}`: {verdict}" for name, verdict in sorted(said.items())]
    if not said:
        lines.append("- no run directory with a metrics.jsonl under this experiment's root")
    return lines
