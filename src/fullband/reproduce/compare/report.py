"""The report of `fullband reproduce compare`: trains (or reuses) the planned runs within the budget, evaluates
them and writes the cost, language-modelling and state-tracking tables, the figures and the summary."""

from __future__ import annotations

import time
from pathlib import Path

from fullband.machine import hardware
from fullband.reproduce.compare.evaluate import _kept_record, _write_record, cost_table, curve, lm_reads, tracking_eval
from fullband.reproduce.compare.plan import (METHODS, REGIMES, RIVALS, SCALES, TASKS, TRACKING, Planned, Scale,
                                             _train_flops, check, plan)
from fullband.reproduce.runner import Run, Settings, config_line, paired, run_threads, train_run


def _other_threads(done: tuple[Path, float, int | None]) -> bool:
    """Whether a run trained with another number of CPU threads than this process has (the report's machine line)."""
    import torch

    return done[2] is not None and done[2] != torch.get_num_threads()


def _train_time(done: tuple[Path, float, int | None]) -> str:
    """A run's training wall time, with the CPU threads it had when they were not this process's."""
    threads = done[2]
    return f"{done[1] / 60:.1f} min" + (f" ({threads} thread{'s' * (threads != 1)})" if _other_threads(done) else "")


def _paired(a: dict, b: dict) -> tuple[float, float]:
    return paired(a["per_window"], b["per_window"])


def _best(res: dict) -> tuple[str, dict]:
    return min(res.items(), key=lambda kv: kv[1]["nats"])

def report(runs: list[Run], root: Path, figs: Path, settings: Settings, *, scale: str = "cpu",
           budget: float | None = None, lm_extra: tuple[str, ...] = (), tracking_extra: tuple[str, ...] = (),
           tasks: tuple[str, ...] | None = None) -> list[str]:
    from fullband.train.checkpoint import list_checkpoints, read_trainer_state
    from fullband.train.config import load_run_config

    check(scale=scale)
    sc = SCALES[scale]
    planned = plan(sc, settings, tuple(lm_extra), tuple(tracking_extra), tasks)
    t0 = time.perf_counter()
    done: dict[str, tuple[Path, float, int | None]] = {}  # checkpoint, training wall time, CPU threads
    pending: list[Planned] = []
    kept: dict[str, dict] = {}  # runs reused from their records (their checkpoints are gone)
    for p in planned:
        run_dir = root / p.name
        ckpts = list_checkpoints(run_dir)
        finished = bool(ckpts) and read_trainer_state(ckpts[-1])["step"] >= p.steps
        if not finished and (record := _kept_record(p, figs, settings, sc)) is not None:
            kept[p.name] = record
            done[p.name] = (Path(record["checkpoint"]), record["train_seconds"], record.get("threads"))
            continue
        if not finished and budget is not None and (time.perf_counter() - t0) / 60 >= budget:
            pending.append(p)
            continue
        done[p.name] = (*train_run(root, p.run, settings, eval_every=sc.eval_every), run_threads(root / p.name))

    lines = _intro(sc, scale, planned)
    lm_cfg = load_run_config(settings.base, [*sc.lm, *lm_extra, *settings.extra])
    costs = cost_table({k: next(p.model_cfg for p in planned if p.name == f"fresh-{k}") for k in METHODS}, sc, figs)
    lines += _cost_lines(costs, planned)
    results: dict[str, dict] = {}
    curves: dict[str, list[dict]] = {}
    for p in planned:
        if p.name not in done or p.regime not in REGIMES:
            continue
        ckpt = done[p.name][0]
        results[p.name] = lm_reads(p, ckpt, figs, sc)
        curves[p.name] = (kept[p.name]["curve"] if p.name in kept else
                          curve(p, root / p.name, load_run_config(p.run.config or settings.base,
                                                                  [*p.run.overrides, *settings.extra])))
    for regime in REGIMES:
        lines += _lm_lines(regime, planned, results, done, sc, lm_cfg)
    tracking = {p.name: tracking_eval(p, done[p.name][0], figs, sc)
                for p in planned if p.name in done and p.regime in TASKS}
    for p in planned:  # every finished run's record, for a rerun where its checkpoints are gone
        if p.name in done and p.name not in kept:
            _write_record(p, figs, settings, done[p.name], curves.get(p.name))
    lines += _tracking_lines(planned, tracking, done)
    lines += _figures(planned, curves, tracking, figs, results, lm_cfg)
    uncurved = [p.name for p in planned if p.name in results and not curves.get(p.name)]
    if uncurved:
        lines += ["Drawn as one marker at the end of training (their best read over the final evaluation's windows), "
                  f"reused from records that kept no held-out curve: {', '.join(uncurved)}.", ""]
    lines += _implications(planned, results, tracking, costs, curves, settings.findings)
    total = sum(w for _, w, _ in done.values())
    other = sum(map(_other_threads, done.values()))
    lines += ["", f"Training the {len(done)} finished runs took {total / 60:.1f} min (their own wall times, summed; "
                  f"{hardware()})" + (f"; {other} of them trained with another number of CPU threads (marked in "
                                      "the tables), so their times are not this process's." if other else "."), ""]
    if pending:
        lines += [f"**Pending ({len(pending)} run{'s' * (len(pending) != 1)}, not started within this invocation's budget of {budget:g} min):** "
                  + ", ".join(p.name for p in pending) + ". Rerun the same command to go on; finished runs are "
                  "reused.", ""]
    lines += [f"Commands (each run also gets `--set log.run_dir=runs/repro/compare/<run>` and `--set "
              f"log.eval_every={sc.eval_every}`; the tracking runs start from `{TRACKING}`):", ""]
    lines += [f"- {config_line(p.run)}" for p in planned]
    return lines


def _intro(sc: Scale, scale: str, planned: list[Planned]) -> list[str]:
    fresh = [p for p in planned if p.regime == "fresh"]
    lines = [f"Scale `{scale}` (`fullband reproduce compare --scale {scale}`). Every method has the width and depth of "
             "the standard model and is trained with the same data, tokenizer, optimizer, learning-rate schedule and "
             "seed; only the mechanism and its pass schedule differ. The methods:", ""]
    for key, m in METHODS.items():
        lines.append(f"- **{key}**: {m.label}; train.passes = {m.passes}")
    lines += ["", "Decisions (the papers are silent or we chose): the three feedback settings train with the same "
              "three-pass schedule as ours, so that they differ in the mechanism only; looped depth runs a middle "
              "half of the blocks r times with r ~ U{1..3} per step (mean 2, as a stand-in for Huginn's random "
              "depth) and reads with r = 1..3; PonderLM-2 trains with their 4 or 5 passes and reads with FUSED k = 1 "
              "(its cheapest) and k = 4 (their prefill). Standard models are trained for N and 2N steps, for as many "
              "steps as each rival's training FLOPs buy, and as a deeper model with our training FLOPs per token.",
              "", f"Language modelling: {len(fresh)} runs per regime, N = {sc.steps} steps. The repeated regime trains "
              f"on the first {sc.unique_tokens:,} tokens of the training split only (data.train_tokens), repeated for "
              "as many epochs as the steps need; both regimes are scored on the same held-out windows.", ""]
    return lines


def _cost_lines(costs: dict[str, dict], planned: list[Planned]) -> list[str]:
    if not costs:
        return []
    some = next(iter(costs.values()))
    lines = ["## Cost", "", f"Counted from the config (fullband.model.flops) and measured side by side with the standard "
             f"model of the same width and depth (`fullband bench cost`; {some['hardware']}, {some['threads']} "
             f"threads; medians of {some['repeats']}, as ratios). Training: the schedule's expected step, "
             f"{some['batch']} windows of {some['seq_len']} tokens; decode: "
             f"per token at {some['decode_context']} keys; prefill: FLOPs per prompt token of the method's best read.",
             "", "| method | params added | train FLOPs/token (× std) | step time (× std) | decode b=1 (× std) | "
             "decode b=8 (× std) | prefill b=1: FLOPs, time (× std) | KV bytes/token (std) |",
             "|---|---|---|---|---|---|---|---|"]
    for key, c in costs.items():
        probs = c["probs"]
        rows = {r["variant"]: r for r in c["rows"]}
        flops = sum(p * rows[f"k={k}"]["flops_vs_standard"] for k, p in probs.items())
        time_ = sum(p * rows[f"k={k}"]["time_vs_standard"] for k, p in probs.items())
        feeds = [r for r in c["decode"] if r["variant"] not in ("standard model", "STANDARD")]
        pick = {}
        for b in (1, 8):
            at = [r for r in (feeds or c["decode"]) if r["batch"] == b and r["variant"] != "standard model"]
            pick[b] = f"{at[0]['time_vs_standard']:.2f} ({at[0]['variant']})" if at else "-"
        fused = [r for r in c["prefill"] if r["batch"] == 1 and r["variant"].startswith("FUSED")]
        pre = (fused or [r for r in c["prefill"] if r["batch"] == 1])[-1]
        lines.append(f"| {key} | {c['params_added']:,} (+{100 * c['params_added'] / c['params_standard']:.1f}%) | "
                     f"{flops:.2f} | {time_:.2f} | {pick[1]} | {pick[8]} | {pre['flops_vs_standard']:.2f}, "
                     f"{pre['time_vs_standard']:.2f} ({pre['variant']}) | {c['kv_bytes_per_token']:,} "
                     f"({c['kv_bytes_per_token_standard']:,}) |")
    deep = next((p for p in planned if p.role == "deep"), None)
    if deep is not None:
        from fullband.model.flops import param_count, train_flops

        std = next(p for p in planned if p.name == "fresh-standard")
        seq = 256
        lines += ["", f"The deeper standard model ({deep.model_cfg.n_layers} blocks): {param_count(deep.model_cfg):,} "
                  f"parameters against {param_count(std.model_cfg):,}, "
                  f"{train_flops(deep.model_cfg, 1, seq_len=seq) / train_flops(std.model_cfg, 1, seq_len=seq):.2f}x "
                  "the training FLOPs per token (counted, not timed)."]
    return lines + [""]


def _spent(p: Planned, lm_cfg) -> tuple[int, float]:
    """A language-modelling run's training tokens and counted training FLOPs (at its schedule's mean passes)."""
    tokens = p.steps * lm_cfg.train.global_batch_tokens
    return tokens, tokens * _train_flops(p.model_cfg, METHODS[p.method].passes, lm_cfg.train.seq_len)


def _lm_lines(regime: str, planned: list[Planned], results: dict, done: dict, sc: Scale, lm_cfg) -> list[str]:
    rows = [p for p in planned if p.regime == regime]
    title = {"fresh": "fresh data (less than one epoch)",
             "repeated": f"a fixed corpus of {sc.unique_tokens:,} tokens, repeated"}[regime]
    lines = [f"## Language modelling: {title}", "",
             f"Held-out loss (nats/token ± s.e. over {sc.windows} windows) after training; in brackets the paired "
             "difference to the standard model trained for N steps. Inference FLOPs: per token of the read, as a "
             "ratio to the standard model's. Cheapest read first, best read last.", "",
             "| run | steps | tokens | train FLOPs (× std-N) | train time | read | inference FLOPs (× std) | loss | "
             "vs std-N |", "|---|---|---|---|---|---|---|---|---|"]
    base = results.get(f"{regime}-standard", {}).get("STANDARD")
    tokens_per_step = lm_cfg.train.global_batch_tokens

    std_n = _spent(next(p for p in rows if p.name == f"{regime}-standard"), lm_cfg)[1]
    for p in rows:
        share = _spent(p, lm_cfg)[1] / std_n  # training FLOPs, as a multiple of the standard model's at N
        if p.name not in results:
            lines.append(f"| {p.name} | {p.steps} | - | {share:.2f} | pending | | | | |")
            continue
        res = results[p.name]
        for i, (label, r) in enumerate(res.items()):
            diff = "" if base is None or p.name == f"{regime}-standard" else "{:+.4f} ± {:.4f}".format(*_paired(r, base))
            head = (f"| {p.name} | {p.steps} | {p.steps * tokens_per_step / 1e6:.2f}M | {share:.2f} | "
                    f"{_train_time(done[p.name])}" if i == 0 else "| | | | |")
            ratio = r["flops"] / base["flops"] if base else float("nan")
            lines.append(f"{head} | {label} | {ratio:.2f} | {r['nats']:.4f} ± {r['stderr']:.4f} | {diff} |")
    return lines + [""]


def _tracking_lines(planned: list[Planned], tracking: dict, done: dict) -> list[str]:
    lines = ["## State tracking", "",
             "Accuracy ± s.e. at L, 2L, 4L, 8L (configs/tracking-tiny.toml, trained on inputs of 1..L steps); every "
             "read of each method.", ""]
    for task in TASKS:
        rows = [p for p in planned if p.regime == task]
        if not rows:
            continue
        lines += [f"### {task}", "", "| run | train time | read | L | 2L | 4L | 8L |", "|---|---|---|---|---|---|---|"]
        for p in rows:
            if p.name not in tracking:
                lines.append(f"| {p.name} | pending | | | | | |")
                continue
            for i, row in enumerate(tracking[p.name]["rows"]):
                cells = " | ".join(f"{a:.3f} ± {e:.3f}" for a, e in zip(row["accuracy"], row["stderr"]))
                head = f"| {p.name} | {_train_time(done[p.name])}" if i == 0 else "| |"
                lines.append(f"{head} | {row['mode']} | {cells} |")
        some = next((tracking[p.name] for p in rows if p.name in tracking), None)
        if some:
            lines.append(f"\nChance: {some['chance']:.2f}. Lengths: {', '.join(map(str, some['lengths']))}.")
        lines.append("")
    return lines


LINESTYLE = {"standard": "-", "feedback": "-", "looped": "--", "ponder": ":"}


def _figures(planned: list[Planned], curves: dict, tracking: dict, figs: Path, results: dict, lm_cfg) -> list[str]:
    from fullband.files import plt as _plt, save_figure

    plt = _plt()
    lines = ["## Figures", ""]
    for axis, png, xlabel in (("tokens", "loss_tokens.png", "training tokens"),
                              ("flops", "loss_flops.png", "training FLOPs (counted)")):
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
        for ax, regime in zip(axes, REGIMES):
            drawn = [p for p in planned if p.regime == regime and (curves.get(p.name) or p.name in results)]
            for colour, p in zip(plt.cm.tab20.colors[::2] + plt.cm.tab20.colors[1::2], drawn):  # 20 distinct
                pts = curves.get(p.name)
                if not pts:  # a reused run whose record kept no curve: its final point
                    label, best = _best(results[p.name])
                    x = _spent(p, lm_cfg)[axis == "flops"]
                    ax.plot([x], [best["nats"]], "D", color=colour, ms=5,
                            label=f"{p.name.split('-', 1)[1]} ({label}, final)")
                    continue
                k = max(pts[-1]["eval"], key=int)  # the most passes it was scored with during training
                ax.plot([q[axis] for q in pts], [q["eval"][k] for q in pts], LINESTYLE[METHODS[p.method].family],
                        color=colour, marker="o", ms=2.5,
                        label=f"{p.name.split('-', 1)[1]} ({k} pass{'es' if k != '1' else ''})")
            ax.set(xlabel=xlabel, title=regime, xscale="log")
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("held-out loss (nats/token, 64 windows)")
        for ax in axes:
            if ax.get_lines():
                ax.legend(fontsize=7)
        save_figure(fig, figs / png)
        lines += [f"![loss vs {axis}]({figs.name}/{png})", ""]
    tasks = [t for t in TASKS if any(p.regime == t and p.name in tracking for p in planned)]
    if tasks:
        fig, axes = plt.subplots(1, len(tasks), figsize=(4 * len(tasks), 3.6), squeeze=False)
        for ax, task in zip(axes[0], tasks):
            for p in planned:
                if p.regime != task or p.name not in tracking:
                    continue
                res = tracking[p.name]
                row = max(res["rows"], key=lambda r: sum(r["accuracy"]))
                ax.errorbar(res["lengths"], row["accuracy"], yerr=row["stderr"], capsize=2,
                            ls=LINESTYLE[METHODS[p.method].family], marker="o", ms=3,
                            label=f"{p.name.split('-', 1)[1]} ({row['mode']})")
            ax.axhline(res["chance"], color="grey", lw=0.8)
            ax.set(xscale="log", xlabel="input length", title=task, ylim=(0, 1.02))
            ax.set_xticks(res["lengths"], [str(n) for n in res["lengths"]])  # L, 2L, 4L, 8L, not log decades
            ax.minorticks_off()
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("accuracy (best read)")
        axes[0][-1].legend(fontsize=6)
        save_figure(fig, figs / "tracking.png")
        lines += [f"![accuracy vs length]({figs.name}/tracking.png)", ""]
    return lines


def _implications(planned: list[Planned], results: dict, tracking: dict, costs: dict, curves: dict,
                  findings) -> list[str]:
    """The summary table and its verdicts, each also recorded in `findings` (the spread across seeds)."""
    lines = ["## Summary", "",
             "Each rival against the standard model of the same width and depth trained for N steps (per token), "
             "against the standard model trained for the rival's training FLOPs (per training FLOP), and in its "
             "cheapest read (per inference FLOP: the read's FLOPs as a ratio to the standard model's). Paired "
             "differences in held-out loss (nats/token ± s.e.); negative: the rival is better.", "",
             "| regime | method | best read | vs std-N (per token) | vs std at its FLOPs (per train FLOP) | "
             "cheapest read (inference FLOPs × std) | its vs std-N |", "|---|---|---|---|---|---|---|"]
    verdicts = []
    for regime in REGIMES:
        base = results.get(f"{regime}-standard", {}).get("STANDARD")
        if base is None:
            continue
        for key in RIVALS:
            res = results.get(f"{regime}-{key}")
            if res is None:
                continue
            label, best = _best(res)
            matched = next((p for p in planned if p.regime == regime and p.role.startswith("x")
                            and key in p.role[1:].split("/")), None)
            mres = results.get(matched.name, {}).get("STANDARD") if matched else None
            d_tok = _paired(best, base)
            d_flop = _paired(best, mres) if mres else None
            cheap_label, cheap = next(iter(res.items()))
            d_cheap = _paired(cheap, base)
            lines.append(f"| {regime} | {key} | {label} | {d_tok[0]:+.4f} ± {d_tok[1]:.4f} | "
                         + (f"{d_flop[0]:+.4f} ± {d_flop[1]:.4f} ({matched.name})" if d_flop else "pending")
                         + f" | {cheap_label} ({cheap['flops'] / base['flops']:.2f}) | "
                           f"{d_cheap[0]:+.4f} ± {d_cheap[1]:.4f} |")
            findings.diff(f"{regime}: {key}, best read minus std-N (nats/token)", *d_tok)
            if d_flop:
                verdicts.append((regime, key, d_tok, d_flop))
                findings.diff(f"{regime}: {key}, best read minus std at its FLOPs (nats/token)", *d_flop)
        n2 = results.get(f"{regime}-standard-2n", {}).get("STANDARD")
        if n2 is not None:
            g = _paired(n2, base)
            lines.append(f"| {regime} | standard 2N | STANDARD | {g[0]:+.4f} ± {g[1]:.4f} | | | |")
    lines.append("")
    for regime in REGIMES:
        rows = [v for v in verdicts if v[0] == regime]
        if not rows:
            continue
        best_tok = min(rows, key=lambda v: v[2][0])
        best_flop = min(rows, key=lambda v: v[3][0])
        wins = [v[1] for v in rows if v[3][0] + 2 * v[3][1] < 0]
        lines.append(f"- **{regime}**: per token the lowest loss is {best_tok[1]}'s ({best_tok[2][0]:+.4f} ± "
                     f"{best_tok[2][1]:.4f} vs the standard model at N); per training FLOP the best is "
                     f"{best_flop[1]}'s ({best_flop[3][0]:+.4f} ± {best_flop[3][1]:.4f} vs the standard model given its "
                     f"FLOPs). Rivals ahead of the FLOP-matched standard model by more than 2 s.e.: "
                     f"{', '.join(wins) if wins else 'none'}. " + _per_inference_flop(regime, planned, results)
                     + _early_stopping(regime, planned, curves))
    for task in TASKS:
        got = {p.method if not p.role.startswith("x") else "standard-matched": tracking[p.name]
               for p in planned if p.regime == task and p.name in tracking}
        if not got:
            continue
        parts = []
        for key, res in got.items():
            row = max(res["rows"], key=lambda r: sum(r["accuracy"]))
            for k, a, e in zip(("L", "2L", "4L", "8L"), row["accuracy"], row["stderr"]):
                findings.value(f"{task}: {key}, best read's accuracy at {k}", a, e, fmt=".3f")
            parts.append(f"{key} {row['mode']} " + "/".join(f"{a:.2f}" for a in row["accuracy"]))
        lines.append(f"- **{task}** (best read per method, accuracy at L/2L/4L/8L): " + "; ".join(parts) + ".")
    return lines + [""]


def _early_stopping(regime: str, planned: list[Planned], curves: dict) -> str:
    """The standard model at its best point anywhere on its runs' held-out curves (early stopping: where more steps
    overfit, the FLOP-matched runs end worse than they were), against each rival's last point, both on the curves'
    windows (unpaired, no s.e.); runs without a curve (pending, or reused from a record that kept none) are left out."""
    drawn = [p for p in planned if p.regime == regime and curves.get(p.name)]
    std = [p for p in drawn if p.method == "standard" and p.role != "deep"]
    rivals = [p for p in drawn if p.method in RIVALS]
    if not curves.get(f"{regime}-standard") or not rivals:
        return ""
    base = curves[f"{regime}-standard"][-1]["flops"]
    loss, step, flops, run = min((q["eval"]["1"], q["step"], q["flops"], p.name) for p in std for q in curves[p.name])
    parts = []
    for p in rivals:
        last = curves[p.name][-1]
        k = max(last["eval"], key=int)
        parts.append(f"{p.method} {last['eval'][k] - loss:+.4f} ({k} pass{'es' if k != '1' else ''})")
    return (f" Early stopping: the standard model's lowest held-out loss on any of its curves is {loss:.4f} ({run}, "
            f"step {step}, {flops / base:.2f}x the FLOPs of N steps); each rival's last point against it (the curves' "
            f"windows, unpaired): {', '.join(parts)}.")


def _per_inference_flop(regime: str, planned: list[Planned], results: dict) -> str:
    """The lowest loss among the rivals' reads that cost at most the standard model's inference FLOPs (+1%), and
    the deeper standard model's (more inference FLOPs per token), both against the standard model at N."""
    base = results[f"{regime}-standard"]["STANDARD"]
    cheap = [(key, label, r) for key in RIVALS for label, r in results.get(f"{regime}-{key}", {}).items()
             if r["flops"] <= 1.01 * base["flops"]]
    parts = []
    if cheap:
        key, label, r = min(cheap, key=lambda x: x[2]["nats"])
        d = _paired(r, base)
        parts.append(f"Per inference FLOP, at the standard model's cost the lowest loss is {key}'s {label} read "
                     f"({d[0]:+.4f} ± {d[1]:.4f})")
    deep = next((p for p in planned if p.regime == regime and p.role == "deep" and p.name in results), None)
    if deep is not None:
        r = results[deep.name]["STANDARD"]
        d = _paired(r, base)
        parts.append(f"the deeper standard model, at {r['flops'] / base['flops']:.2f}x the inference FLOPs, is at "
                     f"{d[0]:+.4f} ± {d[1]:.4f}")
    return "; ".join(parts) + "." if parts else ""
