"""`fullband reproduce schedule`: the paper's pass schedule (75/22/3 one/two/three passes) against 75/25 and the
adaptive schedule (train.passes = "adaptive"), each with and without next-latent supervision (train.latent_loss),
at equal expected training FLOPs, on the code LM and on a state-tracking task, plus a stress setting meant to make
75/25 diverge; held-out loss by mode, contraction per pass and past the trained depth, the stability gate."""

from __future__ import annotations

import json
import time
from pathlib import Path

from fullband.reproduce.runner import BASE, COMMANDS, Experiment, Run, Settings, config_line, kept, train_run

TRACKING = "configs/tracking-tiny.toml"
TASK = "registers:8"  # the task whose answer needs the fed-back state most (docs/results/tracking.md)
STEPS = 400  # the 75/22/3 run's steps in every setting; the others get its expected training FLOPs
EVAL_EVERY = 100  # held-out loss and the stability gate every so many steps (metrics.jsonl)
SCHEDULES = {"75-22-3": 'train.passes="one-two-three"', "75-25": 'train.passes="one-two"',
             "adaptive": 'train.passes={schedule = "adaptive", every = 25}',
             # the floor below the paper's mix: the share may fall to 5% and the highest k to 2
             "adaptive-low": 'train.passes={schedule = "adaptive", every = 25, min_share = 0.05, min_top = 2}'}
LATENT = ['model.latent_head="linear"', "train.latent_loss=0.1"]
# the stress setting: no jitter or plain prefixes on the fed state (the training noise that makes a pass map robust
# to its input), and twice the learning rates
STRESS = ["model.jitter=0.0", "model.prefix_mixin_prob=0.0", "optim.lr=0.04", "optim.adam_lr=0.008"]
SETTINGS = {  # name: (recipe, its overrides, whether the latent-supervised runs are trained too, its schedules)
    "code": (BASE, [], True, tuple(SCHEDULES)),
    # (on registers the adaptive schedule only ever raised the mix: adaptive-low would train the same run)
    "registers": (TRACKING, [f'data.corpus="{TASK}"', "log.eval_passes=[1, 2, 3]"], True, tuple(SCHEDULES)[:3]),
    "stress": (BASE, STRESS, False, tuple(SCHEDULES)),
}
KS = (1, 2, 3, 8, 32, 1000)
DIVERGES = 0.05  # nats/token: a loss at k = 1000 this far above the trained depth's "settles worse"


def expected_step_flops(recipe: str, overrides: list[str]) -> float:
    """A run's expected training FLOPs per step: its schedule's (for the adaptive one: its starting mix's) chance of
    each pass count times that count's counted FLOPs (fullband.model.flops.train_flops, the latent head included)."""
    from fullband.model.flops import train_flops
    from fullband.train.config import load_run_config
    from fullband.train.schedule import AdaptiveSchedule

    cfg = load_run_config(recipe, overrides)
    sched, t = cfg.train.schedule, cfg.train
    probs = sched.probs(sched.start()) if isinstance(sched, AdaptiveSchedule) else sched.stages[-1].probs
    return t.global_batch_tokens * sum(p * train_flops(cfg.model, k, seq_len=t.seq_len, latent=t.latent_loss > 0)
                                       for k, p in probs.items())


def runs() -> list[Run]:
    out = []
    for setting, (recipe, extra, latent, schedules) in SETTINGS.items():
        ref = expected_step_flops(recipe, [*extra, SCHEDULES["75-22-3"]])
        for name in schedules:
            for supervised in (False, True) if latent else (False,):
                overrides = [*extra, SCHEDULES[name], *(LATENT if supervised else [])]
                steps = round(STEPS * ref / expected_step_flops(recipe, overrides))
                out.append(Run(f"{setting}-{name}" + ("-latent" if supervised else ""),
                               [*overrides, f"train.steps={steps}"], recipe if recipe != BASE else ""))
    return out


def _setting(run: Run) -> str:
    return run.name.split("-", 1)[0]


def _held_out(ckpt: Path, windows: int = 16):
    """The run's own validation windows (any data format), as its trainer read them: [(inputs, targets), ...]."""
    from dataclasses import replace

    from fullband.train.config import RunConfig
    from fullband.train.data import prepare_data
    from fullband.train.parallel import Dist

    cfg = RunConfig.from_dict(json.loads((ckpt.parent / "run.json").read_text()))
    cfg = replace(cfg, log=replace(cfg.log, eval_windows=windows))
    return [(b[0], b[1]) for b in prepare_data(cfg, Dist()).val_batches]


def _evaluate(run: Run, ckpt: Path, figs: Path) -> dict:
    """Loss after k passes (k = 1000: past the trained depth), contraction, the gate on the final checkpoint, the
    accuracy on the tracking task; kept beside the report (a rerun reuses it while the checkpoint is unchanged)."""
    from dataclasses import asdict

    def compute() -> dict:
        from fullband.eval.gate import stability_gate
        from fullband.eval.stability import contraction, jacobi_sweep
        from fullband.model.decoder import FullbandLM
        from fullband.train.checkpoint import read_trainer_state

        model = FullbandLM.load(ckpt)
        batches = _held_out(ckpt)
        sweep = jacobi_sweep(model, batches, KS, exact=False, progress=True)
        con = contraction(model, batches[0][0][:2])
        gate = stability_gate(model, batches[0][0][:4])
        state = read_trainer_state(ckpt)
        out = {"sweep": asdict(sweep), "contraction": asdict(con), "gate": gate.to_dict(),
               **{k: state[k] for k in ("step", "tokens", "compute_tokens", "flops")}}
        if _setting(run) == "registers":
            from fullband.eval.commands import eval_tracking

            out["tracking"] = eval_tracking(ckpt, n=100, modes=("standard", "fused:2", "exact"), progress=False,
                                            out=figs / run.name)
        return out

    return kept(figs / run.name / "schedule_eval.json", {"checkpoint": str(ckpt), "ks": list(KS)}, ckpt, compute)


def _trajectory(run_dir: Path) -> dict:
    """From metrics.jsonl: the adaptive schedule's decisions and mixes, and the gate at every evaluation."""
    from fullband.train.metrics import METRICS_FILE, metric_rows

    rows = metric_rows(run_dir / METRICS_FILE)
    return {"adapt": [(r["step"], r["adapt"]) for r in rows if "adapt" in r],
            "gates": [r["gate"] for r in rows if isinstance(r.get("gate"), dict)]}


def report(runs: list[Run], root: Path, figs: Path, settings: Settings) -> list[str]:
    from fullband.machine import hardware

    trained = []
    for run in runs:
        ckpt, wall = train_run(root, run, settings, eval_every=EVAL_EVERY)
        trained.append((run, ckpt, wall))
    t0 = time.perf_counter()
    results = {run.name: (run, wall, _evaluate(run, ckpt, figs), _trajectory(root / run.name))
               for run, ckpt, wall in trained}
    lines = _intro()
    for setting in SETTINGS:
        rows = [v for k, v in results.items() if _setting(v[0]) == setting]
        if rows:
            lines += _setting_lines(setting, rows)
    lines += _findings(results, settings.findings)
    lines += _figures(results, figs)
    lines += [f"Evaluation in this invocation: {(time.perf_counter() - t0) / 60:.1f} min ({hardware()}).", "",
              COMMANDS, ""]
    lines += [f"- {config_line(run, f'log.eval_every={EVAL_EVERY}')}" for run, _, _ in trained]
    return lines


def _intro() -> list[str]:
    return [
        "The paper trains with an empirical pass schedule (75% one pass, 22% two, 3% three) and reports that without",
        "the 3% three-pass steps (75/25) the pass map, iterated past the trained depth, diverges. Here each schedule",
        "is trained with and without next-latent supervision (an auxiliary head predicts the next position's",
        "fed-back state from this position's, `model.latent_head = \"linear\"`, `train.latent_loss = 0.1`) at equal",
        "expected training FLOPs: the 75/22/3 run trains "
        f"{STEPS} steps and every other run of its setting the steps that cost the same, by the FLOP counter",
        "(the adaptive schedule's expected cost is its starting mix's, which is 75/22/3; what it spent is in the",
        "FLOPs column). The adaptive schedule measures the pass map's perturbation growth per pass over 8 passes",
        "and the fixed-point residual every 25 steps on two held-out windows and raises or lowers the share of",
        "multi-pass steps and the highest pass count (docs/method.md, section 8). Its floor is the paper's mix",
        "(`adaptive`: lowering only gives back what raising added); `adaptive-low` may fall to 5% multi-pass steps",
        "of at most 2 passes.", "",
        "Settings: **code**: `configs/tiny.toml` (D 128, 4 layers, byte-level, the standard library's source,",
        f"8K tokens a step); **registers**: `configs/tracking-tiny.toml` on `{TASK}` (the loss on the answer",
        "only); **stress**: the code setting without the training noise on the fed state (jitter 0, no plain",
        "prefixes) at twice the learning rates, a setting chosen to make 75/25 diverge.", "",
        "Columns: held-out loss (nats/token; registers: on the answer) after k fused passes (k = 1 is the standard",
        "read; k = 1000 is far past every trained depth); growth: the worst perturbation growth per pass of the",
        "linearised pass map at its fixed point over 8 and 32 passes (< 1: contracting); gain: the one-pass",
        "amplification; gate: the stability checklist on the final checkpoint (finite logits, max |logit| < 100,",
        "the state's RMS p99 within [0.25, 4] x pass 1's at pass 32, the residual at pass 32 <= 0.25 and <= pass",
        "8's) and how many of the run's evaluations during training failed it. A growth of 0.000: perturbations",
        "vanish below float32's range within 32 passes.", ""]


def _setting_lines(setting: str, rows: list) -> list[str]:
    ref = next((ev for run, _, ev, _ in rows if run.name == f"{setting}-75-22-3"), None)
    tracking = setting == "registers"
    extra = " | exact acc L / 2L | standard acc L / 2L" if tracking else ""
    lines = [f"## {setting}", "",
             "| run | steps | tokens | FLOPs | vs 75/22/3 | train | " + " | ".join(f"k={k}" for k in KS)
             + " | growth 8 / 32 | gain | gate" + extra + " |",
             "|---" * (9 + len(KS) + (2 if tracking else 0)) + "|"]
    for run, wall, ev, traj in rows:
        con = ev["contraction"]
        growth = dict(zip(con["horizons"], con["growth"]))
        flops = ev["flops"] / ref["flops"] if ref else float("nan")
        fails = sum(not g["passed"] for g in traj["gates"])
        gate = ("pass" if ev["gate"]["passed"] else "FAIL: " + ", ".join(
            name for name, c in ev["gate"]["checks"].items() if c["passed"] is False))
        cells = [run.name.removeprefix(f"{setting}-"), str(ev["step"]), f"{ev['tokens'] / 1e6:.2f}M",
                 f"{ev['flops']:.3g}", f"{flops:.3f}", f"{wall / 60:.1f} min",
                 *(f"{v:.3f}" for v in ev["sweep"]["loss"]), f"{growth[8]:.3f} / {growth[32]:.3f}",
                 f"{con['lipschitz']:.2f}", f"{gate} ({fails}/{len(traj['gates'])} evals failed)"]
        if tracking:
            acc = {row["mode"]: row["accuracy"] for row in ev["tracking"]["rows"]}
            cells += [" / ".join(f"{a:.2f}" for a in acc[m][:2]) for m in ("exact", "standard")]
        lines.append("| " + " | ".join(cells) + " |")
    adaptive = [(run, traj) for run, _, _, traj in rows if traj["adapt"]]
    for run, traj in adaptive:
        decisions = [a["action"] for _, a in traj["adapt"]]
        last = traj["adapt"][-1][1]
        lines += ["", f"{run.name}: {len(decisions)} measurements ({decisions.count('raise')} raise, "
                  f"{decisions.count('hold')} hold, {decisions.count('lower')} lower); growth per pass over 8 "
                  f"passes from {traj['adapt'][0][1]['growth']:.3f} to {last['growth']:.3f}; the mix ended at "
                  f"{last['share']:.2f} multi-pass steps up to {last['top']} passes."]
    return [*lines, ""]


def _behaviour(ev: dict, depth: int) -> tuple[str, float]:
    """How a pass map behaves iterated past its trained depth -> ("diverges" | "settles worse" | "stays stable", the
    loss at k = 1000 minus the loss at the depth). Diverges: a non-finite loss, or perturbations that grow (growth
    per pass over 32 passes >= 1); settles worse: contracting, but to a fixed point more than DIVERGES nats/token
    worse."""
    import math

    loss = dict(zip(ev["sweep"]["ks"], ev["sweep"]["loss"]))
    rise = loss[1000] - loss[depth]
    growth = dict(zip(ev["contraction"]["horizons"], ev["contraction"]["growth"]))[32]
    if not (math.isfinite(rise) and growth < 1):
        return "diverges", rise
    return ("settles worse" if rise > DIVERGES else "stays stable"), rise


def _claim(b25: tuple[str, float], b223: tuple[str, float]) -> str:
    """The paper's stability finding (75/25 diverges past its depth, 75/22/3 does not) against what was measured."""
    if b25[0] == "diverges":
        return ("reproduced: 75/25 diverges and 75/22/3 does not" if b223[0] != "diverges"
                else "not reproduced: both diverge")
    if b223[0] == "diverges":
        return "not reproduced: 75/22/3 diverges and 75/25 does not"
    if b25[1] > b223[1] + 0.02:
        return ("reproduced in part: neither diverges (both contract), but 75/25's loss rises more past its trained "
                f"depth ({b25[1]:+.3f} vs {b223[1]:+.3f} nats/token)")
    return (f"not reproduced: neither diverges (both contract; loss past the trained depth {b25[1]:+.3f} for 75/25, "
            f"{b223[1]:+.3f} for 75/22/3)")


def _findings(results: dict, findings) -> list[str]:
    """The report's findings, each also recorded in `findings` (the spread across seeds)."""
    lines = ["## Findings", ""]
    for setting in SETTINGS:
        got = {run.name.removeprefix(f"{setting}-"): ev for run, _, ev, _ in results.values()
               if _setting(run) == setting}
        if "75-25" not in got or "75-22-3" not in got:
            continue
        b25, b223 = _behaviour(got["75-25"], 2), _behaviour(got["75-22-3"], 3)
        g = {k: dict(zip(v["contraction"]["horizons"], v["contraction"]["growth"]))[32] for k, v in got.items()}
        for name, (_, rise) in (("75/25", b25), ("75/22/3", b223)):
            findings.value(f"{setting}: {name}, loss at k = 1000 minus at its trained depth (nats/token)", rise,
                           fmt="+.3f")
        findings.claim(f"{setting}: no schedule diverges past its trained depth",
                       all(_behaviour(ev, 3 if k != "75-25" else 2)[0] != "diverges" for k, ev in got.items()))
        findings.claim(f"{setting}: 75/25 rises more past its depth than 75/22/3 (by 0.02+)", b25[1] > b223[1] + 0.02)
        lines.append(f"- **{setting}**: the paper's stability finding is {_claim(b25, b223)}. Past the trained depth "
                     f"75/25 {b25[0]}, 75/22/3 {b223[0]}; growth per pass over 32 passes 75/25 {g['75-25']:.3f}, "
                     f"75/22/3 {g['75-22-3']:.3f}.")
        for sched in SCHEDULES:
            if f"{sched}-latent" in got and sched in got:
                a, b = got[f"{sched}-latent"]["sweep"]["loss"], got[sched]["sweep"]["loss"]
                findings.value(f"{setting}: {sched}, latent supervision's change at k = 2 (nats/token)", a[1] - b[1],
                               fmt="+.3f")
                lines.append(f"  - {sched}: latent supervision changes the held-out loss by "
                             + ", ".join(f"{x - y:+.3f} at k={k}" for k, x, y in zip(KS, a, b) if k in (1, 2, 1000))
                             + f" (FLOPs {got[f'{sched}-latent']['flops'] / got[sched]['flops']:.3f}x).")
        for sched in ("adaptive", "adaptive-low"):
            if sched in got:
                a, b = got[sched], got["75-22-3"]
                findings.value(f"{setting}: {sched} minus 75/22/3 at k = 2 (nats/token)",
                               a["sweep"]["loss"][1] - b["sweep"]["loss"][1], fmt="+.3f")
                lines.append(f"  - {sched} vs 75/22/3: held-out loss "
                             f"{a['sweep']['loss'][0] - b['sweep']['loss'][0]:+.3f} at k=1, "
                             f"{a['sweep']['loss'][1] - b['sweep']['loss'][1]:+.3f} at k=2, at "
                             f"{a['flops'] / b['flops']:.3f}x the FLOPs and {a['tokens'] / b['tokens']:.3f}x the "
                             "tokens; "
                             f"from k = 3 to k = 1000 it {_behaviour(a, 3)[0]}.")
    front = [run.name for run, _, ev, _ in results.values()
             if ev["gate"]["checks"]["residual"]["passed"] is False and _behaviour(ev, 1)[0] != "diverges"]
    if front:
        lines += ["", f"The gate's residual check fails for {', '.join(front)} although their pass maps contract: "
                  "there the iterate settles as a front, each position final once the exact state of its predecessors "
                  "has reached it (one position per pass, and attention reaches across a window's examples), so the "
                  "residual at pass 32 measures how far the front still has to travel, not growth. The pilot's "
                  "checklist reads that as instability."]
    return [*lines, ""]


def _figures(results: dict, figs: Path) -> list[str]:
    from fullband.files import plt
    from fullband.reproduce.runner import saved_figure

    fig, axes = plt().subplots(1, len(SETTINGS) + 1, figsize=(5 * (len(SETTINGS) + 1), 3.8))
    for ax, setting in zip(axes, SETTINGS):
        for run, _, ev, _ in results.values():
            if _setting(run) == setting:
                ax.plot(ev["sweep"]["ks"], ev["sweep"]["loss"], marker="o", label=run.name.removeprefix(f"{setting}-"))
        ax.set(xscale="log", xlabel="passes k", ylabel="held-out loss (nats/token)", title=setting)
    ax = axes[-1]
    for run, _, _, traj in results.values():
        if traj["adapt"]:
            steps = [s for s, _ in traj["adapt"]]
            (line,) = ax.plot(steps, [a["share"] for _, a in traj["adapt"]], label=run.name)
            ax.plot(steps, [a["top"] / 10 for _, a in traj["adapt"]], ls="--", color=line.get_color())
    ax.set(xlabel="step", ylabel="multi-pass share (solid), top k / 10 (dashed)", title="adaptive schedule")
    for ax in axes:
        ax.grid(alpha=0.3, which="both")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    lines = saved_figure(fig, figs, "schedule.png", "schedule")
    return lines[:2]  # the figure; the command list comes at the end


EXPERIMENT = Experiment("schedule", runs, report)
