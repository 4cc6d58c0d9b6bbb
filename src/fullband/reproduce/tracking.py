"""`fullband reproduce tracking`: serial state-tracking tasks (parity, counter, S5, registers), standard and
full-bandwidth models of one size trained on inputs up to L, scored at L, 2L, 4L, 8L in every decoding mode."""

from __future__ import annotations

import math
import time
from itertools import takewhile
from pathlib import Path

from fullband.reproduce.runner import COMMANDS, Experiment, Run, Settings, config_line, kept, shown, train_run

TRACKING = "configs/tracking-tiny.toml"
TRACKING_TASKS = {"parity": 16, "counter": 16, "s5": 16, "registers": 8}  # task: L, the longest training input
STANDARD_PASSES = 'train.passes="none"'


def _tracking_schedules(length: int) -> dict[str, list[str]]:
    """The tracking runs' overrides: a standard model, the same with three times the steps (the three-pass
    model's compute), the paper's schedule, three passes every step, and a schedule growing to length + 3
    passes: the Jacobi fixed point of a whole example (BOS, the input, the query, the label), where training's
    last pass is the exact recurrence."""
    return {"standard": [STANDARD_PASSES], "standard-3x": [STANDARD_PASSES, "train.steps=1200"],
            "fbt-paper": ['train.passes="paper-200b"'], "fbt-three": ['train.passes="three-pass"'],
            "fbt-grow": [f'train.passes="grow:{length + 3}"']}


def runs() -> list[Run]:
    return [Run(f"{task}-{name}", [f'data.corpus="{task}:{length}"', *overrides], TRACKING)
            for task, length in TRACKING_TASKS.items() for name, overrides in _tracking_schedules(length).items()]


SOLVED = 0.9  # accuracy the tracking report counts as solving a length


def report(runs: list[Run], root: Path, figs: Path, settings: Settings, *, n: int = 200,
              tasks: tuple[str, ...] | None = None) -> list[str]:
    """For each task: a standard model, full-bandwidth models of the same size and budget, and a standard model
    with the three-pass model's compute, trained on inputs of 1..L steps, scored at L, 2L, 4L, 8L in every
    decoding mode."""
    from fullband.data.tracking import parse_spec

    lines = _intro(n, tasks)
    summary, counts = [], {"scored": 0, "seconds": 0.0}
    by_task: dict[str, list[tuple[Run, Path, float]]] = {}
    for run in runs:
        task, _ = parse_spec(run.overrides[0].split("=", 1)[1].strip('"'))
        if tasks is None or task in tasks:
            ckpt, wall = train_run(root, run, settings)
            by_task.setdefault(task, []).append((run, ckpt, wall))
    for task, trained in by_task.items():
        results = [(run, _scored(figs, run, task, ckpt, n, counts), wall) for run, ckpt, wall in trained]
        task_lines, line = _task_lines(task, results, figs, settings.findings)
        lines += task_lines
        summary.append(line)
    lines += ["**Outcome.** " + "; ".join(summary) + ".", "",
              "How to read it: FUSED prefill with k passes carries the fed-back state at most k positions along the "
              "prompt (pass j reads the state pass j - 1 computed one position back), so beyond k the fed-back state "
              "reaches the query only through EXACT prefill (the recurrence, one position at a time) or adaptive "
              "prefill when it converges; a model whose STANDARD row is high at L and at chance from 2L learned the "
              "task within its depth and window but not a transition it can iterate.", "",
              f"Training all {sum(len(t) for t in by_task.values())} runs took "
              f"{sum(w for t in by_task.values() for _, _, w in t) / 60:.1f} min (the tables' train times, summed). "
              f"Scoring in this invocation: {counts['scored']} models in {counts['seconds'] / 60:.1f} min; "
              f"{sum(len(t) for t in by_task.values()) - counts['scored']} evaluations reused "
              "(written by an earlier invocation for the same checkpoint, newer than its weights).", "", COMMANDS, ""]
    lines += [f"- {config_line(run)}" for run in runs]
    lines += ["- `fullband eval tracking --checkpoint runs/repro/tracking/<run>/step_N` (the run's last checkpoint; "
              "task and L from the run)"]
    return lines


def _intro(n: int, tasks: tuple[str, ...] | None) -> list[str]:
    lines = ["Tasks that need a state updated serially along the input (fullband.data.tracking): running parity, a",
             "counter mod 5, the S5 word problem (where does 0 go under a word over two generators, composed left to",
             "right), the last write to one of 8 registers. A fixed-depth transformer does a bounded amount of",
             "serial computation per token; the exact latent-feedback recurrence is an RNN with the transformer as",
             "its cell. Each model: `configs/tracking-tiny.toml` (0.9M parameters, byte-level, from scratch), the",
             "loss on the answer only; the full-bandwidth models differ from the standard one only in the pass",
             "schedule: the paper's (`paper-200b`), three passes every step, and a schedule growing to the",
             "example's fixed point (L + 3 passes, the last stage). A second standard model trains three times",
             "as many steps (1200, the three-pass model's compute, three times the examples), to tell a task the",
             "standard model cannot learn at this budget from one it learns but cannot extend beyond L; the best",
             "standard model is picked by its STANDARD rows (its fusion gate was never trained), the best",
             "full-bandwidth one by any row, each by mean accuracy over the four lengths. Accuracy ± standard error",
             f"over {n} examples per length; modes: STANDARD, FUSED k = 1, 2, 4 prefill passes, adaptive prefill",
             "(tol 1e-3, at most 32 passes) and EXACT (the recurrence over the prompt).", ""]
    if tasks is not None and set(tasks) != set(TRACKING_TASKS):
        lines += [f"This report covers {', '.join(tasks)} only (`reproduce('tracking', tasks={tuple(tasks)!r})` in "
                  "Python); `fullband reproduce tracking` runs all four tasks, reusing finished runs.", ""]
    return lines


def _scored(figs: Path, run: Run, task: str, ckpt: Path, n: int, counts: dict) -> dict:
    """The run's tracking evaluation: the one kept for this checkpoint (the same examples per length, every default
    mode, its figure beside it), so a rerun scores no finished model again; else scored now (`counts` tallies the
    models scored and the time it took)."""
    from fullband.eval.commands import eval_tracking
    from fullband.eval.tracking import DEFAULT_MODES
    from fullband.model.mode import DecodeMode

    saved = figs / run.name / f"tracking_{task}.json"

    def complete(res: dict) -> bool:
        modes = [row.get("mode") for row in res.get("rows", [])]
        return modes == [DecodeMode.parse(m).label for m in DEFAULT_MODES] and saved.with_suffix(".png").is_file()

    def score() -> dict:
        t0 = time.perf_counter()
        res = eval_tracking(ckpt, n=n, out=figs / run.name, progress=False)
        counts["scored"] += 1
        counts["seconds"] += time.perf_counter() - t0
        return res

    return kept(saved, {"checkpoint": str(ckpt), "n": n}, ckpt, score, valid=complete, save=False)


def _task_lines(task: str, results: list[tuple[Run, dict, float]], figs: Path, findings) -> tuple[list[str], str]:
    """A task's table and its finding (recorded in `findings` for the spread across seeds); -> (its lines, the
    finding for the outcome)."""
    lengths = results[0][1]["lengths"]
    lines = [f"## {task}", "", "| model | train time | mode | " + " | ".join(f"length {k}" for k in lengths) + " |",
             "|---|---|---|" + "---|" * len(lengths)]
    for run, res, wall in results:
        for row in res["rows"]:
            cells = " | ".join(f"{a:.3f} ± {e:.3f}" for a, e in zip(row["accuracy"], row["stderr"]))
            lines.append(f"| {run.name} | {wall / 60:.1f} min | {row['mode']} | {cells} |")
    lines += ["", f"Chance: {results[0][1]['chance']:.2f}. Figures: "
              + ", ".join(f"[{run.name}]({figs.name}/{run.name}/tracking_{task}.png)" for run, _, _ in results), ""]
    # a standard model is read in STANDARD mode only (its fusion gate was never trained)
    std = [(r, row) for r, res, _ in results if STANDARD_PASSES in r.overrides for row in res["rows"]
           if row["mode"] == "standard"]
    fbt = [(r, row) for r, res, _ in results if STANDARD_PASSES not in r.overrides for row in res["rows"]]
    # the best by mean accuracy over the four lengths (one length alone would pick noise at chance level)
    best_std = max(std, key=lambda x: sum(x[1]["accuracy"]))
    best_fbt = max(fbt, key=lambda x: sum(x[1]["accuracy"]))

    def by_length(row: dict) -> str:
        return " / ".join(f"{a:.3f}" for a in row["accuracy"])

    def solved(row: dict) -> str:
        """The longest input length up to which accuracy stays at SOLVED or above."""
        upto = [k for k, _ in takewhile(lambda x: x[1] >= SOLVED, zip(lengths, row["accuracy"]))]
        return f"{upto[-1]} steps" if upto else "none"

    line = (f"{task} (accuracy at L / 2L / 4L / 8L, L = {lengths[0]}): best standard ({best_std[0].name}) "
            f"{by_length(best_std[1])}; "
            f"best full-bandwidth ({best_fbt[0].name}, {best_fbt[1]['mode']}) {by_length(best_fbt[1])}")
    lines += [f"**{task}.** {line[len(task) + 1:]}. Accuracy ≥ {SOLVED} up to: standard {solved(best_std[1])}, "
              f"full-bandwidth {solved(best_fbt[1])}.", ""]
    for who, (_, row) in (("standard", best_std), ("full-bandwidth", best_fbt)):
        for k, a, e in zip(lengths, row["accuracy"], row["stderr"]):
            findings.value(f"{task}, best {who}: accuracy at length {k}", a, e, fmt=".3f")
    findings.claim(f"{task}: best full-bandwidth ≥ {SOLVED} at every length up to {lengths[-1]}",
                   min(best_fbt[1]["accuracy"]) >= SOLVED)
    gain = best_fbt[1]["accuracy"][1] - best_std[1]["accuracy"][1]
    findings.claim(f"{task}: best full-bandwidth above best standard at {lengths[1]} by 2 s.e.",
                   gain > 0 and shown(gain, math.hypot(best_fbt[1]["stderr"][1], best_std[1]["stderr"][1])))
    return lines, line


EXPERIMENT = Experiment("tracking", runs, report)
