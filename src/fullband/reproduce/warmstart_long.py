"""`fullband reproduce warmstart-long`: the shipped warm-start recipe trained long, to measure (not extrapolate) how
many tokens the fed reads of SmolLM2-135M-Instruct need to reach the same model's STANDARD read. One run, far longer
than one sitting: each invocation trains for at most `budget` minutes (train.stop_after_minutes) and stops with a
checkpoint; the next invocation resumes it and extends the curve. The report is the curve of the gap (fed read minus
STANDARD, on the run's held-out windows) against tokens and FLOPs, and the latest checkpoint read by mode and in chat
as `fullband reproduce warmstart` reads its models."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Callable

from fullband.errors import InputError, closest
from fullband.reproduce import warmstart
from fullband.reproduce.runner import Experiment, Run, Settings, config_line, kept, train_run, val_batches
from fullband.validate import integer

GOAL = 0.05  # nats/token: issue 45's "within" of a fed read to STANDARD
BLEND_STEPS = 100  # the blend curriculum over the first 100 steps, as the 200-step recipe's first half
SCALES = {  # the warm start's scales with the long run's length; the held-out reads as warmstart's
    "micro": replace(warmstart.SCALES["micro"], steps=8),
    "cpu": replace(warmstart.SCALES["cpu"], steps=4000, eval_every=50),  # 2.05M tokens
}
NAME = "everything-blend-match"  # the shipped recipe (the blend alone was trained long before: warmstart-long-blend.md)
COOLDOWN = {"micro": 2, "cpu": 100}  # steps of the cooled branch read beside the latest checkpoint (cpu: 51K tokens)
# the recipe's weights that fall over a fraction of the steps (train.X_until): a branch keeps their step counts
UNTIL = ("blend_until", "distill_until", "anchor_until", "block_match_until")


def runs() -> list[Run]:
    # the shipped recipe (every weight, the blend, the block match), with a constant learning rate after warm-up (no
    # cooldown): each point of the curve is the recipe stopped there, not a schedule's end. The block match falls
    # over the nominal steps, as in the shipped recipe, so its weight is nearly constant over the curve's first part
    sets = dict((name, s) for name, _, s in warmstart.RUNS)[NAME]
    return [Run(NAME, ['train.passes="two-pass"', *sets], warmstart.RECIPE)]


def check(*, scale: str = "cpu", model: str = "", budget: float = 90.0, cooldown: int | None = None, **_) -> None:
    if scale not in SCALES:
        raise InputError(f"--scale {scale!r} is unknown{closest(scale, SCALES)}; accepted: {', '.join(SCALES)}")
    if not (isinstance(budget, (int, float)) and math.isfinite(budget) and budget >= 0):
        raise InputError(f"--budget {budget}: accepted: a finite number of minutes >= 0 of training in this invocation "
                         "(0: train nothing more, read and cool the latest checkpoint)")
    if cooldown is not None:
        integer("--cooldown", cooldown, 1, below=SCALES[scale].steps + 1, error=InputError)
    warmstart.check(model=model)


def cooled_steps(scale: str, cooldown: int | None) -> tuple[int, str]:
    """The cooled branch's length (--cooldown, default the scale's) and the tag its folder's name carries (none for
    the default, so a rerun reuses the branch an earlier invocation trained)."""
    steps = COOLDOWN[scale] if cooldown is None else cooldown
    return steps, "" if steps == COOLDOWN[scale] else str(steps)


def need_checkpoint(run_dir: Path, budget: float) -> None:
    """InputError before anything is done when `budget` is 0 (train nothing more) and the run has no checkpoint."""
    from fullband.train.checkpoint import list_checkpoints

    if budget == 0 and not list_checkpoints(run_dir):
        raise InputError(f"--budget 0 reads the run's latest checkpoint, and {run_dir} has none yet; accepted: minutes "
                         "> 0 of training")


def _overrides(sc, model: str, budget: float) -> list[str]:
    blend = min(BLEND_STEPS / sc.steps, 0.5)
    return [*warmstart._common(sc, model, sc.steps), "train.cooldown_fraction=0.0", f"train.blend_until={blend}",
            f"log.ckpt_every={sc.eval_every}", f"train.stop_after_minutes={budget}"]


def report(runs: list[Run], root: Path, figs: Path, settings: Settings, *, scale: str = "cpu", model: str = "",
           budget: float = 90.0, cooldown: int | None = None) -> list[str]:
    """`budget`: minutes of training in this invocation (0: none, the latest checkpoint read); `cooldown`: the cooled
    branch's steps (default the scale's)."""
    from fullband.gguf_file import SHIPPED

    check(scale=scale, model=model, budget=budget, cooldown=cooldown)
    need_checkpoint(root / runs[0].name, budget)
    sc = SCALES[scale]
    model = model or SHIPPED
    return trained_long(runs[0], root, figs, settings, sc, model, budget, _overrides(sc, model, budget),
                        cooled_steps(scale, cooldown), "The shipped warm-start recipe")


def trained_long(run: Run, root: Path, figs: Path, settings: Settings, sc, model: str, budget: float,
                 extra: list[str], cooldown: tuple[int, str], recipe: str, *,
                 curve_corpus: str | None = None, cooler: Callable[[Path], dict] | None = None) -> list[str]:
    """Train `run` (with `extra` after its overrides) for at most `budget` minutes more (0: not at all; the caller
    has checked that it has a checkpoint, need_checkpoint, before anything it does itself), cool its latest
    checkpoint over `cooldown` = (steps, the tag of the branch's folder: cooled_steps) more steps, read both and the
    pretrained model, and return the report's lines; `recipe` names it in the report's first sentence, `curve_corpus`
    the entry of a data.shares mix whose held-out windows the curve and the reads by mode read (None: the run's whole
    held-out split); `cooler(ckpt)`, where given, makes the cooled run in place of the branch (as _cooled returns it,
    with "how" and "made": the report's sentences on what it is and how its command reads, and "before": the tokens
    its first step follows, a run of its own counting from 0)."""
    from fullband.train.checkpoint import read_trainer_state

    extra = [*extra, f"log.eval_chats={json.dumps(str(_held_out_chats(root, sc)))}"]  # chat as a curve
    ckpt, _ = train_run(root, run, settings, extra, eval_every=sc.eval_every, train_more=budget > 0)
    state = read_trainer_state(ckpt)
    curve = warmstart._curve(root / run.name, curve_corpus)
    reads = [("pretrained", warmstart._base(root, model)), (run.name, ckpt)]
    cool = cooler(ckpt) if cooler is not None else _cooled(root, run, ckpt, *cooldown)
    if cool["run"] is not None:
        cooled_ckpt, _ = train_run(root, cool["run"], settings, [*extra, *cool["sets"]])
        reads.append((COOLED, cooled_ckpt))
        state_of = read_trainer_state(cooled_ckpt)
        # a run of its own (cooler) counts its tokens from 0: the report counts them from the long run's start
        cool["state"] = {**state_of, "tokens": state_of["tokens"] + cool.get("before", 0)}
    held = val_batches(ckpt, sc.final_windows, sc.seq_len, corpus=curve_corpus)
    evaluated = {name: kept(figs / "eval" / f"{name}.json", {"checkpoint": str(c)}, c,
                            lambda: warmstart._evaluated(c, held, sc)) for name, c in reads}
    for name, c in reads[1:]:
        tokens = cool["state"]["tokens"] if name == COOLED else read_trainer_state(c)["tokens"]
        for row in evaluated[name]["text"]:
            if row["mode"] != "STANDARD":
                settings.findings.diff(f"{run.name}{' cooled' if name == COOLED else ''} at {tokens:,} tokens: "
                                       f"{row['mode']} minus STANDARD (nats/token)", row["minus_first"],
                                       row["minus_first_stderr"])
    before = evaluated["pretrained"]["chat"]["rows"]["STANDARD"]["loss"]
    lines = [*_curve_lines(curve, figs, curve_corpus), *_chat_curve_lines(curve, figs, before)]
    return _write(run, extra, state, lines, evaluated, sc, budget, cool, recipe, curve_corpus)


COOLED = "cooled"  # the cooled branch's name in the report and its kept evaluation
CHATS_FILE = "held-out-chats.jsonl"  # the report's held-out chats, read at every evaluation (log.eval_chats)
CHAT_SPAN = 5  # the last evaluations whose chat reads the report averages


def _held_out_chats(root: Path, sc) -> Path:
    """root/CHATS_FILE: the report's held-out chats (warmstart.held_out_chats), written when it is missing or differs."""
    from fullband.data.chat.arithmetic import write_chat_jsonl
    from fullband.files import make_folder

    path, chats = make_folder(root, "--root folder") / CHATS_FILE, warmstart.held_out_chats(sc.chats)
    if not path.is_file() or [json.loads(line) for line in path.read_text().splitlines()] != chats:
        write_chat_jsonl(chats, path)
    return path


def _cooled(root: Path, run: Run, ckpt: Path, steps: int, tag: str = "") -> dict:
    """The long run's checkpoint `ckpt` (step S) continued with a cooldown: the learning rate falling linearly to 0
    over `steps` more steps, what the recipe gives when stopped at S + steps. It is a run of its own whose recipe is
    the long run's with S + steps steps, the cooldown over the last `steps` and every weight that falls over a
    fraction of the steps (train.*_until) ending at the same step as in the long run, so its first S steps are the
    long run's: its directory starts as a copy of the long run's at S (its settings, tokenizer and metrics, the
    checkpoint's files linked, not copied) and it resumes from there (trained from scratch, it gives the same model).
    A later invocation branches again from its own latest checkpoint. -> {"run": the branch, "sets": the settings it
    changes (applied after the long run's), "steps"}; run None (and "why") while S + steps is inside the blend
    curriculum, which a branch cannot end where the long run does. Its folder: <run>-cooled<tag>-<S>."""
    branch = branch_settings(ckpt, steps)
    if "why" in branch:
        return {"run": None, "steps": steps, "why": branch["why"]}
    run = Run(f"{run.name}-{COOLED}{tag}-{branch['start']}", run.overrides, run.config)
    if not (root / run.name).exists():
        _branch_from(ckpt, root / run.name, branch["settings"])
    return {"run": run, "sets": branch["sets"], "steps": steps}


def branch_settings(ckpt: Path, steps: int) -> dict:
    """The settings of the cooled branch from `ckpt` (see _cooled): {"start": its step, "settings": the run.json it
    starts with, "sets": the --set lines that make the long run's recipe its own} or {"why": it cannot be made}."""
    from fullband.errors import ConfigError
    from fullband.files import read_json_file
    from fullband.train.checkpoint import read_trainer_state
    from fullband.train.config import TrainConfig
    from fullband.train.rundir import RUN_FILE
    from fullband.train.schedule import blend_end, falling_end

    start = read_trainer_state(ckpt)["step"]
    saved = read_json_file(ckpt.parent / RUN_FILE, "the long run's settings", error=ConfigError)
    total = start + steps
    train = dict(saved["train"])
    end_of = dict.fromkeys(UNTIL, falling_end) | {"blend_until": blend_end}  # as the trainer's schedule ends them
    ends = {key: end_of[key](train["steps"], train.get(key, getattr(TrainConfig, key))) for key in UNTIL}
    if ends["blend_until"] >= total:
        return {"why": f"the latest checkpoint (step {start:,}) is too close to the blend curriculum's end (step "
                       f"{ends['blend_until']:,}) for a branch of {steps} steps"}
    train.update(steps=total, cooldown_fraction=steps / total, stop_after_minutes=0.0,
                 **{key: end / total for key, end in ends.items() if end > 0})
    sets = [f"train.{k}={train[k]!r}" for k in ("steps", "cooldown_fraction", "stop_after_minutes",
                                               *(k for k, end in ends.items() if end > 0))]
    return {"start": start, "settings": {**saved, "train": train}, "sets": sets}


def _branch_from(ckpt: Path, run_dir: Path, settings: dict) -> None:
    """A run directory that starts where `ckpt`'s run was at its step, with `settings` as its run.json: written whole
    or not at all."""
    import shutil

    from fullband.data.tokenizer import BYTE_TOKENIZER_FILE, CHAT_TEMPLATE_FILE, SPECIAL_IDS_FILE, TOKENIZER_FILE
    from fullband.files import Kind, atomic_folder
    from fullband.train.metrics import METRICS_FILE
    from fullband.train.rundir import RUN_FILE

    settings = {**settings, "log": {**settings.get("log", {}), "run_dir": str(run_dir)}}  # its own folder, not ckpt's
    with atomic_folder(run_dir, Kind("run directory", frozenset()), action="start the cooled branch") as tmp:
        (tmp / RUN_FILE).write_text(json.dumps(settings, indent=2) + "\n")
        for name in (TOKENIZER_FILE, SPECIAL_IDS_FILE, CHAT_TEMPLATE_FILE, BYTE_TOKENIZER_FILE, METRICS_FILE):
            if (ckpt.parent / name).is_file():  # the run's tokenizer, and its metrics (a resume cuts them at the step)
                shutil.copy2(ckpt.parent / name, tmp / name)
        linked_files(ckpt, tmp / ckpt.name)


def linked_files(source: Path, dest: Path) -> None:
    """`source`'s files into the folder `dest` (made when missing) as hard links (copies where links are refused)."""
    import os
    import shutil

    dest.mkdir(exist_ok=True)
    for entry in source.iterdir():
        if entry.is_file():
            try:
                os.link(entry, dest / entry.name)
            except OSError:  # another file system, or links refused
                shutil.copy2(entry, dest / entry.name)


def _write(run: Run, extra: list[str], state: dict, curve_lines: list[str], evaluated: dict, sc, budget: float,
           cool: dict, recipe: str, curve_corpus: str | None) -> list[str]:
    step, tokens = state["step"], state["tokens"]
    finished = step >= sc.steps
    match = warmstart.MATCH_WEIGHT
    lines = [f"{recipe} (every weight trained, the feedback weights at 30x the trunk's learning "
             f"rate, two passes every step, the blend curriculum over the first {BLEND_STEPS} steps, the block match "
             f"at {match:g} falling linearly to 0 at step {sc.steps:,}) trained long "
             "with a constant learning rate after warm-up, to measure how many tokens the fed reads take to come "
             f"within {GOAL} nats/token of the same model's STANDARD read. "
             + (f"**Finished: {step:,} steps, {tokens:,} tokens.**" if finished else
                f"**Trained so far: step {step:,} of {sc.steps:,} ({tokens:,} tokens, {state['elapsed'] / 60:.0f} "
                f"min of training); "
                + (f"this invocation trained at most {budget:g} minutes" if budget > 0 else
                   "this invocation trained nothing more (`--budget 0`)")
                + ", and the next one extends the curve.**"),
             f"Each invocation also reads the latest checkpoint **cooled**: continued for {cool['steps']} more steps "
             "with the learning rate falling linearly to 0 (and the weights that fall over the run on their own "
             "line), " + cool.get("how", "what the recipe gives when stopped there, as a schedule with a cooldown "
                                  "would stop it") + "; the curve's points are the run without it."
             + (f" No cooled read in this invocation: {cool['why']}." if cool["run"] is None else ""),
             "One run, one seed: the curve is measured, not extrapolated, and its spread across seeds is not.", ""]
    lines += curve_lines
    lines += _read_lines(run, evaluated, tokens, cool, curve_corpus)
    lines += [*warmstart._chat_lines(evaluated, [run] + ([Run(COOLED)] if cool["run"] else [])),
              "Commands (each run also gets `--set log.run_dir=...`; the long run `--set log.eval_every="
              f"{sc.eval_every}`; `--resume` on a run directory goes on). The long run:", "",
              config_line(run, *extra), ""]
    if cool["run"] is not None:
        made = cool.get("made", f"The cooled branch: its directory starts as a copy of the long run's at step "
                                f"{step:,} and it resumes from there (the same recipe trained from scratch gives the "
                                "same model):")
        lines += [made, "", config_line(cool["run"], *extra, *cool["sets"]), ""]
    return lines


def _gap(point: dict, passes: str) -> float | None:
    ev = point["eval"]
    return ev[passes] - ev["1"] if passes in ev and "1" in ev else None


def _curve_lines(curve: list[dict], figs: Path, corpus: str | None = None) -> list[str]:
    from fullband.files import plt
    from fullband.reproduce.runner import saved_figure

    which = f"the run's own held-out windows of `{corpus}`" if corpus else "the run's own held-out windows"
    lines = ["## The gap against tokens and FLOPs", "",
             f"At every evaluation, on {which}: STANDARD (1 pass), and the fed reads minus it (2 passes: FUSED k=1; "
             "3 passes: FUSED k=2).", ""]
    if not curve:
        return lines + ["No evaluation logged yet.", ""]
    fig, axes = plt().subplots(1, 2, figsize=(11, 3.8), sharey=True)
    for ax, key, label in ((axes[0], "tokens", "tokens trained"), (axes[1], "flops", "training FLOPs")):
        for passes, name in (("2", "FUSED k=1 - STANDARD"), ("3", "FUSED k=2 - STANDARD")):
            pts = [(p[key], _gap(p, passes)) for p in curve if _gap(p, passes) is not None]
            ax.plot(*zip(*pts), marker="o", ms=3, label=name)
        ax.axhline(GOAL, color="grey", ls="--", lw=1, label=f"goal: {GOAL}")
        ax.set(xlabel=label, ylabel="nats/token (symmetric log)")
        # linear within 0.1 of 0, logarithmic beyond: the first points (nats) do not flatten the tail (hundredths)
        # and a read below STANDARD still shows
        ax.set_yscale("symlog", linthresh=0.1)
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=8)
    fig.suptitle("Fed read minus STANDARD while the warm start trains (held-out)")
    lines += saved_figure(fig, figs, "gap.png", "the gap against tokens and FLOPs")[:2]
    chats = any(p["chats"] for p in curve)  # log.eval_chats: two more columns
    head = ["step", "tokens", "FLOPs", "STANDARD", "FUSED k=1 - STANDARD", "FUSED k=2 - STANDARD"]
    head += ["chat STANDARD", "chat FUSED k=1 - STANDARD"] if chats else []
    lines += ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for p in curve:
        cells = [f"{p['step']:,}", f"{p['tokens']:,}", f"{p['flops']:.3g}", f"{p['eval']['1']:.4f}",
                 *(_signed(_gap(p, k)) for k in ("2", "3"))]
        if chats:
            cells += [f"{p['chats']['1']:.4f}" if p["chats"] else "", _signed(_chat_gap(p))]
        lines.append("| " + " | ".join(cells) + " |")
    reached = next((p for p in curve if (g := _gap(p, "2")) is not None and g <= GOAL), None)
    first, last = curve[0], curve[-1]
    went = (f"was {_gap(last, '2'):+.3f} at {last['tokens']:,} tokens" if first is last else
            f"went from {_gap(first, '2'):+.3f} at {first['tokens']:,} tokens to {_gap(last, '2'):+.3f} at "
            f"{last['tokens']:,}")
    lines += ["", f"- FUSED k=1 - STANDARD {went}; "
              + (f"it first came within {GOAL} at {reached['tokens']:,} tokens ({reached['flops']:.3g} FLOPs)."
                 if reached else f"it has not come within {GOAL} yet."), ""]
    return lines


def _signed(value: float | None) -> str:
    return "" if value is None else f"{value:+.3f}"


def _chat_gap(point: dict) -> float | None:
    chats = point["chats"]
    return chats["2"] - chats["1"] if chats and "2" in chats else None


def _chat_curve_lines(curve: list[dict], figs: Path, before: float) -> list[str]:
    """The chat read at every evaluation (log.eval_chats) against tokens, with the pretrained model's STANDARD read of
    the same chats (`before`), and the mean and spread of the last CHAT_SPAN evaluations."""
    import statistics

    from fullband.files import plt
    from fullband.reproduce.runner import saved_figure

    points = [p for p in curve if p["chats"] and "2" in p["chats"]]
    lines = ["## Chat at every evaluation", "",
             f"The held-out chats of the section \"Chat kept?\" below (`{CHATS_FILE}` beside the run, "
             "`log.eval_chats`) read at every evaluation, each conversation in a window of its own: the assistant "
             "tokens' loss read STANDARD (1 pass) and with 2 passes (FUSED k=1 over the replies, the prompt read "
             f"plainly), in the run's training precision. The pretrained model's STANDARD read of them: {before:.3f}.",
             ""]
    if not points:
        return lines + ["No evaluation of this run read them (evaluations logged before `log.eval_chats` was set "
                        "read text alone).", ""]
    fig, ax = plt().subplots(figsize=(7, 3.8))
    tokens = [p["tokens"] for p in points]
    ax.plot(tokens, [p["chats"]["1"] for p in points], marker="o", ms=3, label="STANDARD")
    ax.plot(tokens, [p["chats"]["2"] for p in points], marker="o", ms=3, label="FUSED k=1")
    ax.axhline(before, color="grey", ls="--", lw=1, label="the pretrained model, STANDARD")
    ax.set(xlabel="tokens trained", ylabel="assistant-token nats/token", title="Held-out chat while the warm start trains")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    lines += saved_figure(fig, figs, "chat.png", "held-out chat loss against tokens")[:2]
    last = points[-CHAT_SPAN:]
    std, gap = [p["chats"]["1"] for p in last], [_chat_gap(p) for p in last]

    def spread(values):
        return f"SD {statistics.stdev(values):.3f}, " if len(values) > 1 else ""

    lines += [f"- Over the last {len(last)} evaluation(s) (tokens {last[0]['tokens']:,} to {last[-1]['tokens']:,}): "
              f"chat STANDARD {statistics.fmean(std):.3f} ({spread(std)}{min(std):.3f} to {max(std):.3f}), "
              f"{statistics.fmean(std) - before:+.3f} against the pretrained model; FUSED k=1 minus STANDARD "
              f"{statistics.fmean(gap):+.3f} ({spread(gap)}{min(gap):+.3f} to {max(gap):+.3f}). One evaluation's chat "
              "read moves from one evaluation to the next at a constant learning rate: compare the mean over several, "
              "or the cooled read.", ""]
    return lines


def _read_lines(run: Run, evaluated: dict, tokens: int, cool: dict, corpus: str | None = None) -> list[str]:
    cooled_tokens = cool["state"]["tokens"] if cool["run"] is not None else None
    windows = f"Held-out windows of `{corpus}`" if corpus else "Held-out windows"
    lines = [f"## The latest checkpoint by mode ({tokens:,} tokens)"
             + (f", and cooled ({cooled_tokens:,} tokens)" if cooled_tokens else ""), "",
             f"{windows} read as `fullband reproduce warmstart` reads its models; each fed read minus STANDARD "
             "paired by window (mean ± standard error).", "",
             "| model | tokens | STANDARD | FUSED k=1 - STD | FUSED k=2 - STD | SOFT-like (exact) - STD |",
             "|---|---|---|---|---|---|"]
    names = {"pretrained": 0, run.name: tokens, **({COOLED: cooled_tokens} if cooled_tokens else {})}
    read = {n: {r["mode"]: r for r in evaluated[n]["text"]} for n in names}
    for name, rows in read.items():
        cells = [f"{rows[m]['minus_first']:+.3f} ± {rows[m]['minus_first_stderr']:.3f}"
                 for m in ("FUSED k=1", "FUSED k=2", "SOFT-like (exact)")]
        lines.append(f"| {name} | {names[name]:,} | {rows['STANDARD']['nats_per_token']:.4f} | "
                     + " | ".join(cells) + " |")
    std = {n: rows["STANDARD"]["nats_per_token"] for n, rows in read.items()}
    lines.append("")
    for name, what in ((run.name, "the latest checkpoint"), (COOLED, "cooled"))[:len(names) - 1]:
        soft, fused = (read[name][m]["minus_first"] for m in ("SOFT-like (exact)", "FUSED k=1"))
        lines.append(f"- Goal (both fed reads within {GOAL} of STANDARD), {what}: "
                     f"{'met' if max(soft, fused) <= GOAL else 'not met'} (FUSED k=1 {fused:+.3f}, SOFT-like "
                     f"{soft:+.3f}).")
    cooled = f", cooled {std[COOLED] - std['pretrained']:+.4f}" if COOLED in std else ""
    lines += [f"- STANDARD against the pretrained model: {std[run.name] - std['pretrained']:+.4f} nats/token{cooled} "
              "(negative: the domain gain of training on this corpus; the trunk is not damaged where it is not "
              "above +0.02).", ""]
    return lines


EXPERIMENT = Experiment("warmstart-long", runs, report, check, seeds=1)  # 90 min an invocation on 2 cores
