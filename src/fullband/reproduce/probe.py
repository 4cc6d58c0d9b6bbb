"""`fullband reproduce probe` (the paper's Fig. 7, appendix F): a standard model and a warm-started full-bandwidth one
on synthetic tracking documents, linear probes on the layer-0 input at the final ':' per prefill."""

from __future__ import annotations

import json
from pathlib import Path

from fullband.reproduce.runner import COMMANDS, Experiment, Run, Settings, config_line, train_run


def runs() -> list[Run]:
    windows = ["train.seq_len=512", "train.global_batch_tokens=8192", "train.micro_batch=8"]
    return [Run("probe-base", ['train.passes="none"', "train.steps=1600", *windows]),
            Run("probe-model", ['train.passes="three-pass"', "train.steps=800", "train.warmup_steps=10", *windows])]


def report(runs: list[Run], root: Path, figs: Path, settings: Settings) -> list[str]:
    from fullband.data.synthetic import training_documents
    from fullband.eval.commands import eval_probe

    scratch = (0, 8, 32)
    root.mkdir(parents=True, exist_ok=True)
    mix = root / "synthetic.jsonl"
    if not mix.exists():
        docs = training_documents(60000, scratch=scratch, tasks=("completion", "memory"))
        mix.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    corpus = f'data.corpus="{mix}"'
    base_ckpt, base_wall = train_run(root, runs[0], settings, [corpus])
    warm = f'train.init_from="{base_ckpt}"'
    run = runs[1]
    ckpt, wall = train_run(root, run, settings, [corpus, warm])
    res = eval_probe(ckpt, tasks=("completion", "memory"), scratch=scratch, out=figs, progress=True)
    lines = ["The paper (Fig. 7, appendix F): a linear probe on the layer-0 input at the final ':' recovers the",
             "label 99.6% (completion tracking) and 100% (delayed memory) with one-step recurrent prefill, and is",
             "near chance with standard prefill. Target here: >= 95% vs <= 65%.", "",
             "Here: configs/tiny.toml (0.9M parameters, byte-level) with 512-token windows, trained only on",
             "60,000 synthetic task documents (completion tracking and delayed memory with 0/8/32 scratch updates,",
             "other seeds than the probe sets; each document is the example with its label right after the final",
             "':', so the ':' predicts the label as with the paper's tokens): first a standard model",
             f"({runs[0].overrides[1]}, `passes = \"none\"`, {base_wall / 60:.1f} min), then warm-started from it",
             f"with three passes every step ({run.overrides[1]}, {wall / 60:.1f} min). Probe sets: 80 digit-pair",
             "groups x 4 x 3 lengths (completion), 128 contexts x 2 x 3 lengths (memory); L2 logistic regression,",
             "4-fold grouped cross-validation.", "",
             "What the model itself answers at the ':' (first token of the right label scored above the other's):",
             "", "| task | STANDARD | FUSED k=1 | STANDARD by scratch length |", "|---|---|---|---|"]
    for task, t in res["tasks"].items():
        std, fused = t["answer"]["standard"], t["answer"]["fused k=1"]
        per = ", ".join(f"{n}: {a:.2f}" for n, a in std["by_length"].items())
        lines.append(f"| {task} | {std['accuracy']:.3f} | {fused['accuracy']:.3f} | {per} |")
    lines += ["", "Probe accuracy at the final ':' by depth (0 = the stack input):", "",
             "| task | prefill | layer 0 | best layer (accuracy) | last layer |", "|---|---|---|---|---|"]
    for task, t in res["tasks"].items():
        for mode, acc in t["modes"].items():
            best = max(range(len(acc)), key=lambda d: acc[d])
            lines.append(f"| {task} | {mode} | {acc[0]:.3f} | {best} ({acc[best]:.3f}) | {acc[-1]:.3f} |")
    for task, t in res["tasks"].items():
        one, std = t["modes"]["one-step"][0], t["modes"]["standard"][0]
        met = one >= 0.95 and std <= 0.65
        settings.findings.value(f"{task}: layer-0 probe, one-step recurrent prefill", one, fmt=".3f")
        settings.findings.value(f"{task}: layer-0 probe, standard prefill", std, fmt=".3f")
        settings.findings.claim(f"{task}: target met (>= 0.95 vs <= 0.65)", met)
        lines += ["", f"**{task}**: layer-0 accuracy {one:.3f} with one-step recurrent prefill vs {std:.3f} with "
                  f"standard prefill (target >= 0.95 vs <= 0.65: {'met' if met else 'not met'}; the paper: "
                  f"{'0.996' if task == 'completion' else '1.000'} vs near chance)."]
    lines += ["", f"![probe]({figs.name}/probe.png)", "", COMMANDS, "",
              f"- {config_line(runs[0], corpus)}",
              f"- {config_line(run, corpus, warm)}",
              f"- `fullband eval probe --checkpoint {ckpt} --scratch 0 8 32`"]
    return lines


EXPERIMENT = Experiment("probe", runs, report)
