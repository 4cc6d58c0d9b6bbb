"""`fullband reproduce <experiment>`: the paper's claims at small scale, end to end: train the runs an
experiment needs (from configs/tiny.toml plus overrides), evaluate them, and write docs/results/<experiment>.md
with tables and figures, whatever the outcome. Finished runs are reused, interrupted ones resumed.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from dataclasses import dataclass, field
from itertools import takewhile
from pathlib import Path

import torch

from fullband.errors import InputError, closest
from fullband.eval.report import save_figure
from fullband.files import replace_file

BASE = "configs/tiny.toml"


@dataclass
class Run:
    name: str
    overrides: list[str] = field(default_factory=list)
    config: str = ""  # the recipe when it is not the experiment's base (configs/tiny.toml)


def _runs(exp: str) -> list[Run]:
    if exp == "stability":
        return [Run("one-two", ['train.passes="one-two"', "train.steps=600", "train.warmup_steps=40"]),
                Run("one-two-three", ['train.passes="one-two-three"', "train.steps=600", "train.warmup_steps=40"])]
    if exp == "data-efficiency":
        return [Run("fbt-N", ['train.passes="three-pass"', "train.steps=300"]),
                Run("standard-N", ['train.passes="none"', "train.steps=300"]),
                Run("standard-2N", ['train.passes="none"', "train.steps=600"])]
    if exp == "probe":
        windows = ["train.seq_len=512", "train.global_batch_tokens=8192", "train.micro_batch=8"]
        return [Run("probe-base", ['train.passes="none"', "train.steps=1600", *windows]),
                Run("probe-model", ['train.passes="three-pass"', "train.steps=800", "train.warmup_steps=10", *windows])]
    if exp == "fusion-ablation":
        return [Run("standard-base", ['train.passes="none"', "train.steps=400"])] + [
            Run(f"warm-{kind}", [f'model.fusion="{kind}"', 'train.passes="three-pass"', "train.steps=150",
                                 "train.warmup_steps=10"]) for kind in ("gated", "additive", "concat")]
    if exp == "tracking":
        return [Run(f"{task}-{name}", [f'data.corpus="{task}:{length}"', *overrides], TRACKING)
                for task, length in TRACKING_TASKS.items() for name, overrides in _tracking_schedules(length).items()]
    if exp == "sft":
        return [Run("base", []), Run("sft", [], SFT), Run("standard-base", ['train.passes="none"']),
                Run("standard-sft", ['train.passes="none"'], SFT)]
    raise InputError(f"experiment {exp!r} is unknown{closest(exp, EXPERIMENTS)}; accepted: {', '.join(EXPERIMENTS)}")


EXPERIMENTS = ("stability", "probe", "data-efficiency", "fusion-ablation", "sft", "tracking")
SFT = "configs/sft-tiny.toml"
TRACKING = "configs/tracking-tiny.toml"
TRACKING_TASKS = {"parity": 16, "counter": 16, "s5": 16, "registers": 8}  # task: L, the longest training input


STANDARD_PASSES = 'train.passes="none"'


def _tracking_schedules(length: int) -> dict[str, list[str]]:
    """The tracking runs' overrides: a standard model, the same with three times the steps (the three-pass
    model's compute), the paper's schedule, three passes every step, and a schedule growing to length + 3
    passes: the Jacobi fixed point of a whole example (BOS, the input, the query, the label), where training's
    last pass is the exact recurrence."""
    deep = length + 3
    grow = (f'[{{until = 0.25, probs = {{"1" = 1.0}}}}, {{until = 0.5, probs = {{"2" = 0.5, "4" = 0.5}}}}, '
            f'{{until = 0.75, probs = {{"4" = 0.5, "8" = 0.5}}}}, '
            f'{{until = 1.0, probs = {{"8" = 0.5, "{deep}" = 0.5}}}}]')
    return {"standard": [STANDARD_PASSES], "standard-3x": [STANDARD_PASSES, "train.steps=1200"],
            "fbt-paper": ['train.passes="paper-200b"'], "fbt-three": ['train.passes="three-pass"'],
            "fbt-grow": [f"train.passes={grow}"]}


def hardware() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), {gpu}"


@dataclass(frozen=True)
class Settings:
    """What every run of an experiment starts from: the base recipe and overrides applied after each run's own
    (tests shrink the runs with them)."""

    base: str = BASE
    extra: tuple[str, ...] = ()


def train_run(root: Path, run: Run, settings: Settings, extra: list[str] | None = None) -> tuple[Path, float]:
    """Train (or reuse / resume) runs under root/<name>; returns the final checkpoint and the wall time spent."""
    from fullband.train.checkpoint import list_checkpoints, read_trainer_state
    from fullband.train.config import load_run_config
    from fullband.train.trainer import RUN_FILE, train

    run_dir = root / run.name
    overrides = [*run.overrides, *(extra or []), *settings.extra, f'log.run_dir="{run_dir}"', "log.eval_every=0"]
    cfg = load_run_config(run.config or settings.base, overrides)
    done = list_checkpoints(run_dir)
    t0 = time.perf_counter()
    if not (done and read_trainer_state(done[-1])["step"] >= cfg.train.steps):
        print(f"== training {run.name}: {' '.join(run.overrides)}", flush=True)
        started = bool(done) or (run_dir / RUN_FILE).is_file()  # an interrupted run, with or without a checkpoint
        train(cfg, resume=run_dir if started else None)
    wall = time.perf_counter() - t0
    meta = run_dir / "wall.json"
    if wall > 5 or not meta.exists():
        replace_file(meta, json.dumps({"train_seconds": wall}))
    return list_checkpoints(run_dir)[-1], json.loads(meta.read_text())["train_seconds"]


COMMANDS = ("Commands (each run also gets `--set log.run_dir=runs/repro/<experiment>/<run>` and "
            "`--set log.eval_every=0`):")


def _figure_and_commands(exp: str, png: str, alt: str) -> list[str]:
    """The report's figure line and the header of its command list."""
    return [f"![{alt}]({exp}/{png})", "", COMMANDS, ""]


def _config_line(run: Run, *extra: str) -> str:
    sets = " ".join(f"--set {o}" for o in [*run.overrides, *extra])
    return f"`fullband train {run.config or BASE}{' ' + sets if sets else ''}`"


def reproduce(exp: str, *, root: str | Path = "runs/repro", docs: str | Path = "docs/results", base: str = BASE,
              extra: list[str] | None = None, **options) -> Path:
    """Run one experiment; `base`, `extra` overrides (applied after the experiment's own) and `options` (keyword
    arguments of the experiment's function, e.g. sft's held_out) exist for tests."""
    runs = _runs(exp)
    settings = Settings(base, tuple(extra or ()))
    root, docs = Path(root) / exp, Path(docs)
    figs = docs / exp
    figs.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    report = {"stability": _stability, "data-efficiency": _data_efficiency, "probe": _probe,
              "fusion-ablation": _fusion_ablation, "sft": _sft, "tracking": _tracking}[exp](runs, root, figs, settings,
                                                                                              **options)
    total = time.perf_counter() - t0
    header = [f"# Reproduction: {exp}", "",
              f"Produced by `fullband reproduce {exp}` (runs under `{root}`), {time.strftime('%Y-%m-%d')}.",
              f"Hardware: {hardware()}. Wall time of this invocation: {total / 60:.1f} min "
              "(training time per run is in the tables; reused runs cost nothing here).", ""]
    out = docs / f"{exp}.md"
    replace_file(out, "\n".join(header + report) + "\n")
    print(f"wrote {out}")
    return out


# ---------------------------------------------------------------------- experiments
def _val_batches(checkpoint: Path, windows: int = 128, seq_len: int = 256, batch: int = 16):
    from fullband.folder import read_config
    from fullband.data.tokenizer import load_tokenizer
    from fullband.eval.commands import held_out_stream, window_batches

    seq_len = min(seq_len, read_config(checkpoint).max_seq_len)
    stream = held_out_stream(checkpoint, load_tokenizer(checkpoint), corpus=None, val_percent=None)
    return list(window_batches(stream, seq_len, windows, batch))


def _stability(runs: list[Run], root: Path, figs: Path, settings: Settings) -> list[str]:
    from fullband.eval.report import plt as _plt
    from fullband.eval.stability import contraction, jacobi_sweep
    from fullband.model.decoder import FullbandLM

    lines = ["The paper (Fig. 3, appendix E): a 75/25 one/two-pass schedule is fine at its training depth but",
             "diverges when the pass map is iterated further; adding 3% three-pass batches (75/22/3) makes it a",
             "contraction, flat for 30+ iterations and stable at k = 1000.", "",
             "Here: the tiny byte-level model (configs/tiny.toml: D 128, 4 layers) trained 600 steps x 8K tokens",
             "(4.9M tokens) of the standard library with each schedule, then the fused pass map iterated on 64",
             "held-out windows of T = 256 tokens. At k > T the iterate is the exact recurrence (position t is",
             "final after t + 1 passes), so k = 300 and 1000 report that fixed point.", "",
             "| run | train time | " + " | ".join(f"k={k}" for k in (1, 2, 3, 5, 10, 30, 100, 300, 1000)) + " |",
             "|---|---|" + "---|" * 9]
    results = {}
    for run in runs:
        ckpt, wall = train_run(root, run, settings)
        model = FullbandLM.load(ckpt)
        batches = _val_batches(ckpt, windows=64)
        sweep = jacobi_sweep(model, batches, progress=True)
        con = contraction(model, batches[0][0][:2])
        results[run.name] = (sweep, con)
        lines.append(f"| {run.name} | {wall / 60:.1f} min | " + " | ".join(f"{v:.3f}" for v in sweep.loss) + " |")
    for name, (sweep, con) in results.items():
        loss = dict(zip(sweep.ks, sweep.loss))
        depth = 2 if name == "one-two" else 3
        trend = "rises" if loss[30] > loss[depth] + 0.01 else ("falls" if loss[30] < loss[depth] - 0.01 else "stays flat")
        lines.append("")
        lines.append(f"**{name}** (trained up to {depth} passes): loss {loss[depth]:.3f} at k = {depth}, {loss[30]:.3f} at "
                     f"k = 30 ({trend}), {loss[1000]:.3f} at k = 1000 (the exact recurrence); perturbation growth per "
                     f"pass over 32 passes {con.growth[-1]:.3f} ({'contracting' if con.growth[-1] < 1 else 'expanding'}).")
    lines += ["", "Held-out loss (nats/token) after k passes. Update size and contraction:", "",
              "| run | update RMS k=2 | k=10 | k=30 | k=100 | growth/pass at horizon 1, 8, 32 | one-pass gain |",
              "|---|---|---|---|---|---|---|"]
    for name, (sweep, con) in results.items():
        u = {k: v for k, v in zip(sweep.ks, sweep.update_rms)}
        g = dict(zip(con.horizons, con.growth))
        lines.append(f"| {name} | {u[2]:.2e} | {u[10]:.2e} | {u[30]:.2e} | {u[100]:.2e} | "
                     f"{g[1]:.3f}, {g[8]:.3f}, {g[32]:.3f} | {con.lipschitz:.3f} |")
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, (sweep, _) in results.items():
        axes[0].plot(sweep.ks, sweep.loss, marker="o", label=name)
        curve = [v for v in sweep.update_curve[1:]]
        ks = [k for k, v in zip(range(2, len(curve) + 2), curve) if v > 0]
        axes[1].loglog(ks, [v for v in curve if v > 0], label=name)
    axes[0].set_xscale("log")
    axes[0].set_xlabel("passes k")
    axes[0].set_ylabel("held-out loss (nats/token)")
    axes[1].set_xlabel("passes k")
    axes[1].set_ylabel("RMS ||h(k) - h(k-1)||")
    for ax in axes:
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    save_figure(fig, figs / "stability.png")
    lines += ["", *_figure_and_commands("stability", "stability.png", "stability")]
    lines += [f"- {_config_line(r)}, then `fullband eval stability --checkpoint <run>/step_000600`" for r in runs]
    return lines


def _data_efficiency(runs: list[Run], root: Path, figs: Path, settings: Settings) -> list[str]:
    from fullband.eval.report import plt as _plt
    from fullband.eval.loss import validation_loss
    from fullband.model.decoder import FullbandLM

    lines = ["The paper (Fig. 4): with two fused prefill passes, a full-bandwidth model trained on N tokens",
             "matches a standard transformer trained on 2N (100B ~ 200B, 200B ~ 400B).", "",
             "Here: configs/tiny.toml (0.9M parameters, byte-level) on the standard library; N = 300 steps x 8K",
             "tokens = 2.46M tokens. The standard baselines are the same code with `train.passes = \"none\"`.",
             "Held-out loss on 256 windows of 256 tokens (nats/token, ± standard error):", "",
             "| run | tokens | token-equivalent compute | train time | STANDARD | FUSED k=1 | FUSED k=2 |",
             "|---|---|---|---|---|---|---|"]
    table = {}
    for run in runs:
        ckpt, wall = train_run(root, run, settings)
        model = FullbandLM.load(ckpt)
        batches = _val_batches(ckpt, windows=256)
        state = json.loads((ckpt / "trainer.json").read_text())
        res = [validation_loss(model, batches, p) for p in ((1, 2, 3) if run.name.startswith("fbt") else (1,))]
        table[run.name] = res
        cells = [f"{r.nats:.4f} ± {r.stderr:.4f}" for r in res] + ["-"] * (3 - len(res))
        lines.append(f"| {run.name} | {state['tokens'] / 1e6:.2f}M | {state['compute_tokens'] / 1e6:.2f}M | "
                     f"{wall / 60:.1f} min | " + " | ".join(cells) + " |")
    fbt, s_n, s_2n = table["fbt-N"][-1], table["standard-N"][0], table["standard-2N"][0]
    d_n, se_n = fbt.paired_difference(s_n)
    d_2n, se_2n = fbt.paired_difference(s_2n)
    gap = s_n.nats - s_2n.nats
    closed = (s_n.nats - fbt.nats) / gap if abs(gap) > 1e-9 else float("nan")
    lines += ["", f"**Outcome.** Full-bandwidth at N with two fused prefill passes minus standard at N: {d_n:+.4f} ± "
              f"{se_n:.4f} nats/token; minus standard at 2N: {d_2n:+.4f} ± {se_2n:.4f} (paired over the same windows). "
              f"It closes {100 * closed:.0f}% of the standard model's N -> 2N gap; the paper's claim is ~100% "
              f"(FBT at N ~ standard at 2N). Note the full-bandwidth run spent 3x the token-equivalent compute "
              f"of standard-N (three passes per step) and 1.5x that of standard-2N."]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    std = [(1, table["standard-N"][0]), (2, table["standard-2N"][0])]
    ax.errorbar([t for t, _ in std], [r.nats for _, r in std], yerr=[r.stderr for _, r in std], marker="s",
                capsize=3, label="standard, STANDARD decoding")
    for k, r in enumerate(table["fbt-N"]):
        ax.errorbar([1], [r.nats], yerr=[r.stderr], marker="o", capsize=3,
                    label=f"full-bandwidth, {'STANDARD' if k == 0 else f'FUSED k={k}'}")
    ax.set_xticks([1, 2], ["N", "2N"])
    ax.set_xlabel("training tokens")
    ax.set_ylabel("held-out loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, figs / "data_efficiency.png")
    lines += ["", *_figure_and_commands("data-efficiency", "data_efficiency.png", "data efficiency")]
    lines += [f"- {_config_line(r)}" for r in runs]
    return lines


def _probe(runs: list[Run], root: Path, figs: Path, settings: Settings) -> list[str]:
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
        lines.append("")
        lines.append(f"**{task}**: layer-0 accuracy {one:.3f} with one-step recurrent prefill vs {std:.3f} with "
                     f"standard prefill (target >= 0.95 vs <= 0.65: {'met' if met else 'not met'}; the paper: "
                     f"{'0.996' if task == 'completion' else '1.000'} vs near chance).")
    lines += ["", *_figure_and_commands("probe", "probe.png", "probe"),
              f"- {_config_line(runs[0], corpus)}",
              f"- {_config_line(run, corpus, warm)}",
              f"- `fullband eval probe --checkpoint {ckpt} --scratch 0 8 32`"]
    return lines


def _fusion_ablation(runs: list[Run], root: Path, figs: Path, settings: Settings) -> list[str]:
    from fullband.eval.report import plt as _plt
    from fullband.eval.stability import state_contribution
    from fullband.model.decoder import FullbandLM

    base_ckpt, base_wall = train_run(root, runs[0], settings)
    lines = ["The paper (section 3.1): an additive fusion e + W h lets a model warm-started from a standard",
             "checkpoint ignore the state and keep its old loss; the asymmetric gate (h W_U) * sigmoid(e W_G)",
             "makes the state the value path, so reading it is mandatory.", "",
             f"Here: a standard tiny model ({runs[0].overrides[1]}, `passes = \"none\"`, {base_wall / 60:.1f} min), then",
             "each fusion warm-started from it (`train.init_from`) and trained 150 more steps with three passes.",
             "State contribution on 128 held-out windows: loss of one fused pass with the true states, with the",
             "states of another window swapped in, and with zero states; the swap penalty is what the state is worth.",
             "", "| fusion | train time | STANDARD | fused (true state) | swapped state | zero state | swap penalty |",
             "|---|---|---|---|---|---|---|"]
    results = {}
    for run in runs[1:]:
        ckpt, wall = train_run(root, run, settings, [f'train.init_from="{base_ckpt}"'])
        model = FullbandLM.load(ckpt)
        r = state_contribution(model, _val_batches(ckpt))
        results[run.name] = r
        lines.append(f"| {run.name.removeprefix('warm-')} | {wall / 60:.1f} min | {r['standard']:.4f} | "
                     f"{r['fused']:.4f} | {r['swapped']:.4f} | {r['zero']:.4f} | {r['swap_penalty']:+.4f} |")
    base = FullbandLM.load(base_ckpt)
    from fullband.eval.loss import validation_loss

    base_loss = validation_loss(base, _val_batches(base_ckpt), 1).nats
    lines += ["", f"The standard base model itself: {base_loss:.4f} nats/token.", ""]
    ranked = sorted(results, key=lambda n: results[n]["swap_penalty"])
    lines += ["**Outcome.** Swap penalty (what one window's own state is worth over another window's): "
              + ", ".join(f"{n.removeprefix('warm-')} {results[n]['swap_penalty']:+.4f}" for n in ranked)
              + f". The least state-dependent fusion is {ranked[0].removeprefix('warm-')}; the paper predicts the "
              "additive form learns to ignore the state (small penalty, and zero state ~ standard loss) while the "
              "gate cannot (zero state destroys its input).", ""]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    names = list(results)
    for i, key in enumerate(("fused", "swapped", "zero")):
        ax.bar([j + 0.27 * (i - 1) for j in range(len(names))], [results[n][key] for n in names], width=0.27,
               label={"fused": "true state", "swapped": "state of another window", "zero": "zero state"}[key])
    ax.axhline(base_loss, color="k", ls="--", lw=1, label="standard base model")
    ax.set_xticks(range(len(names)), [n.removeprefix("warm-") for n in names])
    ax.set_ylabel("held-out loss after one fused pass")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    save_figure(fig, figs / "fusion_ablation.png")
    lines += [*_figure_and_commands("fusion-ablation", "fusion_ablation.png", "fusion ablation"),
              f"- {_config_line(runs[0])}"]
    lines += [f"- {_config_line(r, f'train.init_from={chr(34)}{base_ckpt}{chr(34)}')}" for r in runs[1:]]
    return lines


def _sft(runs: list[Run], root: Path, figs: Path, settings: Settings, *, held_out: int = 300,
         max_new_tokens: int = 192, sft_extra: tuple[str, ...] = ()) -> list[str]:
    """Table 1 / Fig. 6 at this scale: a full-bandwidth model and a standard one (same size, same budget),
    each instruction-tuned on the synthetic chat set, scored on held-out conversations in every mode."""
    from fullband.data.chat.arithmetic import final_answer, write_chat_jsonl
    from fullband.data.chat.sources import chat_conversations
    from fullband.eval.commands import eval_chat
    from fullband.eval.loss import validation_loss
    from fullband.model.decoder import FullbandLM
    from fullband.train.config import load_run_config
    from fullband.train.data import prepare_data
    from fullband.train.parallel import Dist

    base, sft, std_base, std_sft = runs
    trained = {}
    for tuned, start in ((sft, base), (std_sft, std_base)):
        start_ckpt, start_wall = train_run(root, start, settings)
        warm = f'train.init_from="{start_ckpt}"'
        tuned.overrides = [*tuned.overrides, warm]
        ckpt, wall = train_run(root, tuned, settings, list(sft_extra))
        trained[tuned.name] = (ckpt, wall, start_wall)
    cfg = load_run_config(SFT, [*settings.extra, *sft_extra])
    data_file = root / "held_out.jsonl"
    conversations = []
    for messages in chat_conversations(cfg.data.corpus, "val", cfg.data.val_percent):
        conversations.append({"messages": [{"role": m.role, "content": m.content} for m in messages]})
        if len(conversations) >= held_out:
            break
    write_chat_jsonl(conversations, data_file)
    modes = ["standard", "soft", "fused:1", "fused:2"]
    results = {sft.name: eval_chat(trained[sft.name][0], data_file, modes=modes, out=figs / "fbt",
                                   max_new_tokens=max_new_tokens, progress=False),
               std_sft.name: eval_chat(trained[std_sft.name][0], data_file, modes=["standard"], out=figs / "standard",
                                       max_new_tokens=max_new_tokens, progress=False)}
    # the validation loss on assistant tokens, per pass count (training's own measure)
    ckpt = trained[sft.name][0]
    val = prepare_data(load_run_config(SFT, [*settings.extra, *sft_extra, f'log.run_dir="{root / sft.name}"']),
                       Dist(), run_dir=root / sft.name).val_batches
    model = FullbandLM.load(ckpt)
    val_losses = {k: validation_loss(model, val, k) for k in (1, 2, 3)}

    rows = [(name, r) for name in (sft.name, std_sft.name) for r in results[name]["rows"]]
    lines = ["The paper's Table 1 / Fig. 6: after instruction tuning, FUSED decoding scores higher than standard",
             "decoding (GSM8K 71.8 vs 68.4) and SOFT gives shorter reasoning at equal accuracy.", "",
             f"Here: the demo's full-bandwidth model (`{BASE}`, three passes every step) and a standard model of the",
             "same size and budget (`passes = \"none\"`), each instruction-tuned with "
             f"`{SFT}` (`train.init_from` = its base; the standard one with one pass per step) on the built-in",
             "synthetic set (arithmetic word problems, worked steps, `Answer: N`, ~30% two turns). "
             f"Scored on {results[sft.name]['n']} held-out conversations (the run's own validation split, never",
             "trained on): greedy answer to the last user turn, exact match of its final `Answer:` line; length of",
             "the reply in tokens (end marker included). Differences to STANDARD are paired over the same items.", "",
             "| model | decoding | exact match | vs STANDARD (same model) | reply tokens | vs STANDARD | ended |",
             "|---|---|---|---|---|---|---|"]
    for name, r in rows:
        same = r["mode"] == "standard"
        acc_diff = "" if same else f"{r['accuracy_diff']:+.3f} ± {r['accuracy_diff_se']:.3f}"
        tok_diff = "" if same else f"{r['tokens_diff']:+.1f} ± {r['tokens_diff_se']:.1f}"
        lines.append(f"| {name} | {r['mode']} | {r['accuracy']:.3f} ± {r['accuracy_se']:.3f} | {acc_diff} | "
                     f"{r['tokens']:.1f} ± {r['tokens_se']:.1f} | {tok_diff} | {r['ended']:.0%} |")
    lines += ["", "Training time: " + ", ".join(
        f"{name} {wall / 60:.1f} min (its base {start / 60:.1f} min)" for name, (_, wall, start) in trained.items()),
        "", f"Held-out loss of {sft.name} on assistant tokens (nats/token, prompts read plainly): "
        + ", ".join(f"{k} pass{'es' if k > 1 else ''} {v.nats:.4f} ± {v.stderr:.4f}" for k, v in val_losses.items()),
        ""]
    refs = results[sft.name]["references"]

    def correct(row: dict) -> list[float]:
        return [float(final_answer(a) == f) for a, f in zip(row["answers"], refs)]

    def verdict(diff: float, se: float) -> str:
        if diff == 0 or abs(diff) < 2 * se or not math.isfinite(se):
            return "within 2 standard errors: no difference shown"
        return f"{'higher' if diff > 0 else 'lower'}" + (f", {abs(diff) / se:.1f} standard errors" if se > 0 else "")

    fbt_rows = results[sft.name]["rows"]
    soft = next(r for r in fbt_rows if r["mode"] == "soft")
    best = max(fbt_rows[1:], key=lambda r: r["accuracy"])
    std = results[std_sft.name]["rows"][0]
    vs_std = [a - b for a, b in zip(correct(best), correct(std))]
    d_std = sum(vs_std) / len(vs_std)
    se_std = (sum((v - d_std) ** 2 for v in vs_std) / (len(vs_std) - 1) / len(vs_std)) ** 0.5 if len(vs_std) > 1 else 0
    lines += [f"**Outcome.** On the full-bandwidth model, {best['mode']} vs STANDARD decoding: accuracy "
              f"{best['accuracy_diff']:+.3f} ± {best['accuracy_diff_se']:.3f} "
              f"({verdict(best['accuracy_diff'], best['accuracy_diff_se'])}); SOFT vs STANDARD "
              f"{soft['accuracy_diff']:+.3f} ± {soft['accuracy_diff_se']:.3f} "
              f"({verdict(soft['accuracy_diff'], soft['accuracy_diff_se'])}), reply length "
              f"{soft['tokens_diff']:+.1f} ± {soft['tokens_diff_se']:.1f} tokens. Against the standard model "
              f"(same tokens, a third of the training compute): {best['mode']} {best['accuracy']:.3f} vs "
              f"{std['accuracy']:.3f}, paired {d_std:+.3f} ± {se_std:.3f} ({verdict(d_std, se_std)}). The replies "
              "follow the set's fixed worked form in every mode (the same length, every one closed by the end "
              "marker), so the length comparison cannot show shorter reasoning here; at 0.9M parameters the "
              "models copy the numbers and the form and mostly get the arithmetic wrong.", ""]
    lines += ["![chat accuracy and reply length per mode](sft/fbt/chat.png)", "", COMMANDS, "",
              f"- {_config_line(base)}", f"- {_config_line(sft)}", f"- {_config_line(std_base)}",
              f"- {_config_line(std_sft)}",
              f"- `fullband eval chat --checkpoint {trained[sft.name][0]} --data {data_file} --modes "
              f"{' '.join(modes)}`",
              f"- `fullband eval chat --checkpoint {trained[std_sft.name][0]} --data {data_file} --modes standard`"]
    return lines


SOLVED = 0.9  # accuracy the tracking report counts as solving a length


def _finished_eval(saved: Path, checkpoint: Path, n: int) -> dict | None:
    """A tracking evaluation already written for this checkpoint (same examples per length, every default mode,
    newer than the weights), so a rerun of the report does not score finished models again."""
    from fullband.model.mode import DecodeMode
    from fullband.eval.tracking import DEFAULT_MODES
    from fullband.files import read_json

    res = read_json(saved)
    if not res or res.get("checkpoint") != str(checkpoint) or res.get("n") != n:
        return None
    if [row.get("mode") for row in res.get("rows", [])] != [DecodeMode.parse(m).label for m in DEFAULT_MODES]:
        return None
    weights = checkpoint / "model.safetensors"
    if not (weights.is_file() and saved.with_suffix(".png").is_file()):  # the report links the figure
        return None
    if saved.stat().st_mtime < weights.stat().st_mtime:
        return None
    return res


def _tracking(runs: list[Run], root: Path, figs: Path, settings: Settings, *, n: int = 200,
              tasks: tuple[str, ...] | None = None) -> list[str]:
    """For each task: a standard model, full-bandwidth models of the same size and budget, and a standard model
    with the three-pass model's compute, trained on inputs of 1..L steps, scored at L, 2L, 4L, 8L in every
    decoding mode."""
    from fullband.data.tracking import parse_spec
    from fullband.eval.commands import eval_tracking

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
    summary, scored, reused, scoring = [], 0, 0, 0.0
    by_task: dict[str, list[tuple[Run, Path, float]]] = {}
    for run in runs:
        task, _ = parse_spec(run.overrides[0].split("=", 1)[1].strip('"'))
        if tasks is None or task in tasks:
            ckpt, wall = train_run(root, run, settings)
            by_task.setdefault(task, []).append((run, ckpt, wall))
    for task, trained in by_task.items():
        lines += [f"## {task}", ""]
        results = []
        for run, ckpt, wall in trained:
            res = _finished_eval(figs / run.name / f"tracking_{task}.json", ckpt, n)
            if res is None:
                t0 = time.perf_counter()
                res = eval_tracking(ckpt, n=n, out=figs / run.name, progress=False)
                scored, scoring = scored + 1, scoring + time.perf_counter() - t0
            else:
                reused += 1
            results.append((run, res, wall))
        lengths = results[0][1]["lengths"]
        lines += ["| model | train time | mode | " + " | ".join(f"length {k}" for k in lengths) + " |",
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
        summary.append(line)
        lines += [f"**{task}.** {line[len(task) + 1:]}. Accuracy ≥ {SOLVED} up to: standard {solved(best_std[1])}, "
                  f"full-bandwidth {solved(best_fbt[1])}.", ""]
    lines += ["**Outcome.** " + "; ".join(summary) + ".", "",
              "How to read it: FUSED prefill with k passes carries the fed-back state at most k positions along the "
              "prompt (pass j reads the state pass j - 1 computed one position back), so beyond k the fed-back state "
              "reaches the query only through EXACT prefill (the recurrence, one position at a time) or adaptive "
              "prefill when it converges; a model whose STANDARD row is high at L and at chance from 2L learned the "
              "task within its depth and window but not a transition it can iterate.", "",
              f"Training all {sum(len(t) for t in by_task.values())} runs took "
              f"{sum(w for t in by_task.values() for _, _, w in t) / 60:.1f} min (the tables' train times, summed). "
              f"Scoring in this invocation: {scored} models in {scoring / 60:.1f} min; {reused} evaluations reused "
              "(written by an earlier invocation for the same checkpoint, newer than its weights).", "", COMMANDS, ""]
    lines += [f"- {_config_line(run)}" for run in runs]
    lines += ["- `fullband eval tracking --checkpoint runs/repro/tracking/<run>/step_N` (the run's last checkpoint; "
              "task and L from the run)"]
    return lines
