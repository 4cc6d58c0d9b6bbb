"""`fullband reproduce warmstart`: latent feedback added to a real pretrained model (SmolLM2-135M-Instruct by
default) and trained on with the multi-pass objective. Which weights to train (the fusion alone or everything), the
blend curriculum, the fusion's initialisation; the model read STANDARD, FUSED k = 1, 2 and SOFT-like (the exact
recurrence: every position fed, as SOFT decoding feeds what it generates) against tokens trained; the controls
(continued pretraining without feedback at equal tokens and at equal FLOPs); chat kept (assistant-token loss of
ChatML arithmetic conversations by mode, greedy answers); the pass map's contraction and residuals."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fullband.errors import InputError, closest
from fullband.reproduce.runner import (Experiment, Run, Settings, config_line, kept, paired, saved_figure,
                                       train_run, val_batches, verdict)

RECIPE = "configs/warmstart-smollm2.toml"
FEEDBACK_ONLY = '["fusion.*", "norm_in.*"]'


@dataclass(frozen=True)
class Scale:
    steps: int  # optimizer steps of a feedback run (the equal-FLOPs control takes twice as many)
    seq_len: int
    windows: int  # windows per optimizer step
    micro_batch: int
    eval_every: int  # held-out points of the curves
    eval_windows: int
    final_windows: int  # held-out windows of the final read by mode
    chats: int  # held-out arithmetic conversations scored by mode
    answers: int  # greedy answers shown per mode
    new_tokens: int
    warmup: int


SCALES = {
    "micro": Scale(steps=4, seq_len=32, windows=2, micro_batch=2, eval_every=2, eval_windows=2, final_windows=2,
                   chats=2, answers=1, new_tokens=6, warmup=1),
    "cpu": Scale(steps=200, seq_len=128, windows=4, micro_batch=4, eval_every=25, eval_windows=16, final_windows=32,
                 chats=24, answers=3, new_tokens=40, warmup=10),
    "gpu": Scale(steps=2000, seq_len=512, windows=32, micro_batch=8, eval_every=200, eval_windows=64,
                 final_windows=256, chats=256, answers=3, new_tokens=96, warmup=100),
}

# what each run changes: the feedback runs (two passes every step) and the controls (one pass, no state)
FEEDBACK_LR, TRUNK_LR, MULT = "3e-3", "1e-4", "30"
# every key the shipped recipe sets is pinned here, so each run stays what the study trained whatever it ships
NO_MATCH = "train.block_match=0.0"
PART = [f"train.trainable={FEEDBACK_ONLY}", f"optim.adam_lr={FEEDBACK_LR}", "optim.feedback_lr_mult=1", NO_MATCH]
ALL = [f"optim.adam_lr={TRUNK_LR}", f"optim.feedback_lr_mult={MULT}", NO_MATCH]
PLAIN, BLEND = "train.blend_until=0.0", "train.blend_until=0.5"
DISTILL = "train.distill=1.0"
ANCHOR = "train.anchor=1.0"
MATCH_WEIGHT = 40.0  # the block match's weight at step 0 (falling to 0 over the run)
MATCH = f"train.block_match={MATCH_WEIGHT}"
IDENTITY = ['model.fusion_init="identity"', "model.fusion_gate_scale=0"]
RUNS = (
    ("feedback-only", "the fusion and norm_in alone, the trunk frozen", [*PART, PLAIN]),
    ("feedback-only-blend", "as feedback-only, with the blend curriculum (a: 0 -> 1 over the first half)",
     [*PART, BLEND]),
    ("feedback-only-identity", "as feedback-only, W_U started at the identity and every gate at 1/2",
     [*PART, PLAIN, *IDENTITY]),
    ("everything", "every weight; the feedback weights at 30x the trunk's learning rate", [*ALL, PLAIN]),
    ("everything-blend", "as everything, with the blend curriculum", [*ALL, BLEND]),
    ("everything-blend-distill", "as everything-blend, the fed pass drawn towards the STANDARD read (train.distill: "
     "1 falling to 0 over the run)", [*ALL, BLEND, DISTILL]),
    ("everything-blend-identity", "as everything-blend, W_U started at the identity and every gate at 1/2",
     [*ALL, BLEND, *IDENTITY]),
    ("everything-blend-anchor", "as everything-blend, every pass drawn towards the pretrained model's STANDARD read "
     "(train.anchor: 1 falling to 0 over the run)", [*ALL, BLEND, ANCHOR]),
    ("everything-blend-match", "as everything-blend, every block's output in the fed pass drawn towards the first "
     "pass's (train.block_match: 40 falling to 0 over the run)", [*ALL, BLEND, MATCH]),
    ("everything-blend-additive", "as everything-blend, the additive fusion e + h W in place of the paper's gate (a "
     "comparison, never the default: the token keeps its own path, and the model may ignore the state)",
     [*ALL, BLEND, 'model.fusion="additive"']),
)
CONTROLS = (
    ("continued", "control: the same tokens, one pass (continued pretraining, no state)", 1),
    ("continued-2x", "control: twice the steps, one pass (the FLOPs of a two-pass run that trains everything)", 2),
)


def runs() -> list[Run]:
    out = [Run(name, ['train.passes="two-pass"', *sets], RECIPE) for name, _, sets in RUNS]
    return out + [Run(name, ['train.passes="none"', f"optim.adam_lr={TRUNK_LR}", "optim.feedback_lr_mult=1", PLAIN,
                             NO_MATCH], RECIPE) for name, _, _ in CONTROLS]


def check(*, scale: str = "cpu", model: str = "", **_) -> None:
    if scale not in SCALES:
        raise InputError(f"--scale {scale!r} is unknown{closest(scale, SCALES)}; accepted: {', '.join(SCALES)}")
    if model:
        from fullband.hf.convert import pretrained_source

        if not pretrained_source(model):
            raise InputError(f"--model {model!r} is not a pretrained Llama (a .gguf file, shipped:smollm2 or a "
                             "transformers Llama folder)")


def _common(sc: Scale, model: str, steps: int) -> list[str]:
    return [f'train.init_from="{model}"', f"train.steps={steps}", f"train.seq_len={sc.seq_len}",
            f"train.global_batch_tokens={sc.windows * sc.seq_len}", f"train.micro_batch={sc.micro_batch}",
            f"train.warmup_steps={sc.warmup}", "train.cooldown_fraction=0.2", "train.z_loss=0.0",
            'data.corpus="stdlib"', "data.val_percent=1.0", "optim.weight_decay=0.0", "optim.grad_clip=1.0",
            'model.fusion="gated"', "model.jitter=0.02", "model.prefix_mixin_prob=0.5",
            f"log.eval_windows={sc.eval_windows}", "log.eval_passes=[1, 2, 3]", f"log.ckpt_every={steps}",
            "log.keep_last=1"]


def report(runs: list[Run], root: Path, figs: Path, settings: Settings, *, scale: str = "cpu",
           model: str = "") -> list[str]:
    from fullband.gguf_file import SHIPPED

    check(scale=scale, model=model)
    sc = SCALES[scale]
    model = model or SHIPPED
    trained: dict[str, dict] = {}
    for run in runs:
        steps = sc.steps * {name: times for name, _, times in CONTROLS}.get(run.name, 1)
        extra = _common(sc, model, steps)
        ckpt, wall = train_run(root, run, settings, extra, eval_every=sc.eval_every)
        trained[run.name] = {"ckpt": ckpt, "wall": wall, "extra": extra, "curve": _curve(root / run.name),
                             "step_seconds": _step_seconds(root / run.name)}
    base = _base(root, model)
    # the held-out windows every model is read on (the runs' validation split; one tokenizer for all)
    held = val_batches(Path(trained[runs[0].name]["ckpt"]), sc.final_windows, sc.seq_len)
    ckpts = {**{name: Path(info["ckpt"]) for name, info in trained.items()}, "pretrained": base}
    # each model's evaluation, kept in figs/eval/<name>.json under its checkpoint: a rerun reuses it
    evaluated = {name: kept(figs / "eval" / f"{name}.json", {"checkpoint": str(c)}, c, lambda: _evaluated(c, held, sc))
                 for name, c in ckpts.items()}
    for name in ["pretrained", *(r.name for r in runs)]:  # the findings across seeds: each model's read gaps
        for row in evaluated[name]["text"]:
            if row["mode"] == "STANDARD":
                settings.findings.value(f"{name}: STANDARD (nats/token)", row["nats_per_token"])
            else:
                settings.findings.diff(f"{name}: {row['mode']} minus STANDARD (nats/token)", row["minus_first"],
                                       row["minus_first_stderr"])
    return _write(runs, trained, evaluated, sc, scale, model, figs)


def _curve(run_dir: Path, corpus: str | None = None) -> list[dict]:
    """The run's evaluations: {"step", "tokens", "flops", "eval": held-out loss by pass count, "chats": log.eval_chats'
    read by pass count (None: not read)}, read on every held-out window, or (`corpus`, an entry of data.shares) on
    that corpus's windows alone."""
    from fullband.rl.run import metric_rows

    rows = metric_rows(run_dir / "metrics.jsonl")
    flops = {r["step"]: r["flops"] for r in rows if "flops" in r}
    return [{"step": r["step"], "tokens": r["tokens"], "flops": flops.get(r["step"], 0.0),
             "eval": r["eval"] if corpus is None else r["eval_by_corpus"][corpus], "chats": r.get("eval_chats")}
            for r in rows if "eval" in r]


def _step_seconds(run_dir: Path) -> float:
    """The median wall time of the run's optimizer steps (robust to a stretch trained beside other work)."""
    import statistics

    from fullband.rl.run import metric_rows

    rows = [r for r in metric_rows(run_dir / "metrics.jsonl") if r.get("tok_per_s")]
    per_step = rows[0]["tokens"] if rows else 0  # tokens of one step: the first row's count
    return statistics.median(per_step / r["tok_per_s"] for r in rows) if rows else float("nan")


def _base(root: Path, model: str) -> Path:
    """The pretrained model as `fullband convert` gives it (a fresh fusion: STANDARD is the model itself)."""
    from fullband.hf.convert import convert

    out = root / "pretrained"
    if not (out / "config.json").is_file():
        import torch

        torch.manual_seed(0)  # the fresh fusion's draw, so a rerun elsewhere reads the same pretrained model
        convert(model, out)
    return out


def _evaluated(ckpt: Path, held: list, sc: Scale) -> dict:
    """Held-out loss by mode on the windows `held`, chat loss by mode and greedy answers, contraction and residuals
    of one model."""
    import torch

    from fullband.model.decoder import FullbandLM
    from fullband.data.tokenizer import load_tokenizer
    from fullband.eval.commands import bytes_per_token
    from fullband.eval.loss import loss_by_mode
    from fullband.eval.stability import contraction, jacobi_sweep
    from fullband.model.mode import DecodeMode

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = FullbandLM.load(ckpt).to(device).eval()
    tok = load_tokenizer(ckpt)
    batches = [(i.to(device), t.to(device)) for i, t in held]
    modes = [("STANDARD", DecodeMode("standard")), ("FUSED k=1", DecodeMode("fused", 1)),
             ("FUSED k=2", DecodeMode("fused", 2)), ("SOFT-like (exact)", DecodeMode("exact"))]
    with torch.no_grad():
        text = loss_by_mode(model, batches, modes, bytes_per_token(tok, model.config.vocab_size), keep_windows=True)
        sweep = jacobi_sweep(model, batches[:1], (1, 2, 3, 4, 8), exact=False)
    con = contraction(model, batches[0][0][:1], horizons=(1, 2, 4), vectors=1, power_iters=8)
    return {"text": text, "chat": _chat(model, tok, sc),
            "residual": {"k": sweep.ks, "update_rms": sweep.update_rms, "loss": sweep.loss},
            "contraction": {"horizons": con.horizons, "growth": con.growth, "lipschitz": con.lipschitz}}


def held_out_chats(n: int) -> list[dict]:
    """The report's held-out chats: one-turn arithmetic word problems (a fixed draw; the first n of a longer draw)."""
    from fullband.data.chat.arithmetic import arithmetic_chats

    return arithmetic_chats(n, seed=12345, follow_up=0.0, styles=("partial",))


def _chat(model, tok, sc: Scale) -> dict:
    """Assistant-token loss of held-out arithmetic conversations (one turn, rendered with the model's own template)
    read STANDARD, SOFT (prompt plain, the reply fed as generated) and FUSED k = 1, and a few greedy answers."""
    import torch

    from fullband.data.chat.messages import as_message
    from fullband.data.chat.templates import IGNORE, chat_prompt, chat_template, encode_chat
    from fullband.decode.generate import generate
    from fullband.eval.chat import _mean_se
    from fullband.model.mode import DecodeMode
    from fullband.model.objective import ntp

    device = next(model.parameters()).device
    template = chat_template(tok)
    chats = held_out_chats(sc.chats)
    modes = {"STANDARD": DecodeMode("standard"), "SOFT": DecodeMode("soft"), "FUSED k=1": DecodeMode("fused", 1)}
    losses: dict[str, list[float]] = {m: [] for m in modes}
    with torch.no_grad():
        for chat in chats:
            seq = encode_chat(template, [as_message(m, "chat") for m in chat["messages"]])
            ids = torch.tensor([seq.ids[: model.config.max_seq_len]], device=device)
            targets = torch.tensor([seq.targets[: ids.shape[1]]], device=device)
            fed = torch.tensor([seq.fed[: ids.shape[1]]], device=device)
            if int((targets != IGNORE).sum()) == 0:
                continue
            for name, mode in modes.items():
                out = model.read(ids, mode, fed=fed if name == "SOFT" else None, return_logits=True)
                losses[name].append(float(ntp(out.logits, targets)))
        answers = {}
        questions = [c["messages"][:1] for c in chats[: sc.answers]]
        prompts = [chat_prompt(tok, q, template=template) for q in questions]
        for name, mode in modes.items():
            outs = generate(model, prompts, sc.new_tokens, mode=mode, stop_tokens=list(tok.stop_ids))
            answers[name] = [tok.decode([t for t in o if t not in tok.stop_ids]) for o in outs]
    rows = {}
    for name in modes:
        mean, se = _mean_se(losses[name])
        diff, diff_se = _mean_se([a - b for a, b in zip(losses[name], losses["STANDARD"])])
        rows[name] = {"loss": mean, "se": se, "minus_standard": diff, "minus_standard_se": diff_se,
                      "per_item": losses[name]}
    return {"n": len(losses["STANDARD"]), "rows": rows, "questions": [q[0]["content"] for q in questions],
            "answers": answers}


def _write(runs: list[Run], trained: dict, evaluated: dict, sc: Scale, scale: str, model: str,
           figs: Path) -> list[str]:
    from fullband.eval.commands import run_data

    about = {name: what for name, what, _ in RUNS} | {name: what for name, what, _ in CONTROLS}
    tokens = sc.steps * sc.windows * sc.seq_len
    data = run_data(Path(trained[runs[0].name]["ckpt"]))
    corpus = ("the Python standard library (its code, docstrings and `pydoc_data`'s prose; corpus `stdlib`, "
              if data.get("corpus") == "stdlib" else f"the corpus `{data.get('corpus')}` (")
    lines = [f"Scale `{scale}`: {model} warm-started with latent feedback (the paper's gated fusion, fresh), trained "
             f"on {corpus}{data.get('val_percent')}% of files held out) in {sc.steps} steps of {sc.windows} x "
             f"{sc.seq_len} tokens ({tokens:,} tokens), "
             "two passes every step (`train.passes = \"two-pass\"`), AdamW, jitter 0.02, prefix mixin 0.5. The "
             "controls train every weight with one pass (no state).", "",
             "| run | what it trains | tokens | training FLOPs | wall | median s / step |", "|---|---|---|---|---|---|"]
    for run in runs:
        info = trained[run.name]
        last = info["curve"][-1] if info["curve"] else {"tokens": 0, "flops": 0.0}
        lines.append(f"| {run.name} | {about[run.name]} | {last['tokens']:,} | {last['flops']:.3g} | "
                     f"{info['wall'] / 60:.1f} min | {info['step_seconds']:.2f} |")
    lines += ["", "Training FLOPs are counted as the trainer counts them (6 N per token per pass, plus attention): "
              "a run with the trunk frozen computes no weight gradients for it, so its real cost is lower.", ""]
    lines += _text_table(evaluated, runs)
    lines += _against_controls(evaluated, runs)
    lines += _curves(trained, runs, figs)
    lines += _chat_lines(evaluated, runs)
    lines += _stability_lines(evaluated, runs)
    lines += _outcome(trained, evaluated, runs, sc)
    lines += ["", "## Commands", "",
              f"Each run also gets `--set log.run_dir=runs/repro/warmstart/<run>` and `--set log.eval_every="
              f"{sc.eval_every}`. Wall times are as measured, with whatever else ran on the machine; the median step "
              "time is robust to that.", ""]
    lines += [f"- {config_line(r, *trained[r.name]['extra'])}" for r in runs]
    return lines


def _text_table(evaluated: dict, runs: list[Run]) -> list[str]:
    first = evaluated["pretrained"]["text"]
    names = ["pretrained", *(r.name for r in runs)]
    modes = [row["mode"] for row in first]
    base = first[0]["nats_per_token"]
    lines = ["## Held-out loss by mode", "",
             "nats per token on held-out windows (mean over windows); in brackets the paired difference to the same "
             f"model's STANDARD read ± its standard error. The pretrained model's STANDARD: {base:.4f}.", "",
             "| model | " + " | ".join(modes) + " |", "|---|" + "---|" * len(modes)]
    for name in names:
        cells = []
        for row in evaluated[name]["text"]:
            diff = "" if row["mode"] == "STANDARD" else \
                f" ({row['minus_first']:+.3f} ± {row['minus_first_stderr']:.3f})"
            cells.append(f"{row['nats_per_token']:.4f}{diff}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines + [""]


def _paired(a: list[float], b: list[float]) -> str:
    return "{:+.3f} ± {:.3f}".format(*paired(a, b))


def _gap_change(evaluated: dict, a: str, b: str, mode: str) -> str:
    """Run a's gap (`mode` minus STANDARD) minus run b's, paired window by window, with its verdict."""
    def gap(name):
        return np.subtract(_read(evaluated, name, mode)["per_window"], _read(evaluated, name, "STANDARD")["per_window"])

    diff, se = paired(gap(a), gap(b))
    return f"{diff:+.3f} ± {se:.3f} ({verdict(diff, se, up='worse', down='better')})"


def _read(evaluated: dict, name: str, mode: str) -> dict:
    """A model's held-out read in `mode` (its row of the text table)."""
    return {row["mode"]: row for row in evaluated[name]["text"]}[mode]


def _against_controls(evaluated: dict, runs: list[Run]) -> list[str]:
    """Each feedback run's reads against the pretrained model and the controls' STANDARD reads, paired by window
    (every model is read on the same windows)."""
    controls = ["pretrained", *(r.name for r in runs if r.name.startswith("continued"))]
    modes = [row["mode"] for row in evaluated["pretrained"]["text"]]
    lines = ["Against the pretrained model and the controls: each feedback run's read minus the STANDARD read of "
             "the model in the column, paired window by window (nats/token ± standard error; negative: the "
             "feedback run is better).", "",
             "| run | read | " + " | ".join(f"vs {c} STANDARD" for c in controls) + " |",
             "|---|---|" + "---|" * len(controls)]
    for name in (r.name for r in runs if not r.name.startswith("continued")):
        for mode in modes:
            mine = _read(evaluated, name, mode)["per_window"]
            cells = [_paired(mine, _read(evaluated, c, "STANDARD")["per_window"]) for c in controls]
            lines.append(f"| {name} | {mode} | " + " | ".join(cells) + " |")
    return lines + [""]


def _curves(trained: dict, runs: list[Run], figs: Path) -> list[str]:
    from fullband.files import plt

    fig, axes = plt().subplots(1, 3, figsize=(13, 3.8), sharey=False)
    for ax, passes, title in zip(axes, ("1", "2", "3"), ("STANDARD (1 pass)", "FUSED k=1 (2 passes)",
                                                         "FUSED k=2 (3 passes)")):
        for run in runs:
            pts = [(p["tokens"], p["eval"][passes]) for p in trained[run.name]["curve"] if passes in p["eval"]]
            if pts:
                ax.plot(*zip(*pts), marker="o", ms=3, label=run.name)
        ax.set(title=title, xlabel="tokens trained", ylabel="held-out nats/token")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    lines = ["## Loss against tokens trained", "",
             "Held-out loss at every evaluation of each run (the run's own held-out windows).", ""]
    lines += saved_figure(fig, figs, "curves.png", "held-out loss by pass count against tokens")[:2]
    feedback = [r.name for r in runs if not r.name.startswith("continued")]
    points = trained[feedback[0]]["curve"]
    lines += ["The gap FUSED k=1 - STANDARD (2 passes - 1 pass, nats/token on the same held-out windows) at each "
              "evaluation: what the fed read still costs. A blended run is evaluated with the paper's input (a = 1) "
              "throughout, so its gap is large while a < 1.", "",
              "| tokens | " + " | ".join(feedback) + " |", "|---|" + "---|" * len(feedback)]
    for i, point in enumerate(points):
        cells = []
        for name in feedback:
            curve = trained[name]["curve"]
            ev = curve[i]["eval"] if i < len(curve) else {}
            cells.append(f"{ev['2'] - ev['1']:+.3f}" if "1" in ev and "2" in ev else "")
        lines.append(f"| {point['tokens']:,} | " + " | ".join(cells) + " |")
    return lines + [""]


def _chat_lines(evaluated: dict, runs: list[Run]) -> list[str]:
    names = ["pretrained", *(r.name for r in runs)]
    chat = evaluated["pretrained"]["chat"]
    modes = list(chat["rows"])
    before = chat["rows"]["STANDARD"]["per_item"]
    lines = ["## Chat kept?", "",
             f"Assistant-token loss (nats/token) on {chat['n']} held-out one-turn arithmetic conversations rendered "
             "with the model's own ChatML template: STANDARD, SOFT (the prompt plain, the reply fed as SOFT decoding "
             "generates it: the exact recurrence) and FUSED k=1; in brackets the paired difference to the pretrained "
             "model's STANDARD read of the same conversations (before -> after).", "",
             "| model | " + " | ".join(modes) + " |", "|---|" + "---|" * len(modes)]
    for name in names:
        rows = evaluated[name]["chat"]["rows"]
        cells = [f"{rows[m]['loss']:.3f}" + ("" if name == "pretrained" and m == "STANDARD" else
                                             f" ({_paired(rows[m]['per_item'], before)})") for m in modes]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Greedy answers (first held-out questions), the pretrained model and each feedback run:", ""]
    for i, question in enumerate(chat["questions"]):
        lines += [f"**{question}**", "", "| model | mode | answer |", "|---|---|---|"]
        for name in (n for n in names if not n.startswith("continued")):
            for mode in modes:
                answer = evaluated[name]["chat"]["answers"][mode][i].replace("\n", " ").replace("|", "\\|")
                lines.append(f"| {name} | {mode} | {answer[:160]} |")
        lines.append("")
    return lines


def _stability_lines(evaluated: dict, runs: list[Run]) -> list[str]:
    names = ["pretrained", *(r.name for r in runs if not r.name.startswith("continued"))]
    ks = evaluated["pretrained"]["residual"]["k"]
    horizons = evaluated["pretrained"]["contraction"]["horizons"]
    lines = ["## Does the warm-started pass map contract?", "",
             "RMS of the state update h^(k) - h^(k-1) after k passes over one batch of held-out windows (k = 1: "
             "the state itself), and the linearised pass map's growth (||J^k v|| / ||v||)^(1/k) at the exact fixed "
             "point (`eval stability`'s estimate; < 1: perturbations shrink).", "",
             "| model | " + " | ".join(f"update k={k}" for k in ks) + " | "
             + " | ".join(f"growth k={h}" for h in horizons) + " | one-pass gain |",
             "|---|" + "---|" * (len(ks) + len(horizons) + 1)]
    for name in names:
        r, c = evaluated[name]["residual"], evaluated[name]["contraction"]
        lines.append(f"| {name} | " + " | ".join(f"{v:.3g}" for v in r["update_rms"]) + " | "
                     + " | ".join(f"{g:.3f}" for g in c["growth"]) + f" | {c['lipschitz']:.3f} |")
    return lines + [""]


def _outcome(trained: dict, evaluated: dict, runs: list[Run], sc: Scale) -> list[str]:
    feedback = [r.name for r in runs if not r.name.startswith("continued")]
    mode = "FUSED k=1"
    best = min(feedback, key=lambda n: _read(evaluated, n, mode)["minus_first"])
    gap, start = (_read(evaluated, n, mode)["minus_first"] for n in (best, "pretrained"))
    std = {name: _read(evaluated, name, "STANDARD")["nats_per_token"] for name in [*trained, "pretrained"]}
    lines = ["## Outcome", "",
             f"- The fed reads start far from STANDARD: with a fresh fusion the pretrained model's FUSED k=1 is "
             f"{start:+.3f} nats/token from its STANDARD read. After {sc.steps} steps the closest run, **{best}**, "
             f"is at {gap:+.3f} ({'no worse than' if gap <= 0 else 'still worse than'} STANDARD)."]
    pts = [(p["tokens"], p["eval"]["2"] - p["eval"]["1"]) for p in trained[best]["curve"]
           if "2" in p["eval"] and "1" in p["eval"]]
    if len(pts) >= 3 and gap > 0:
        (t0, g0), (t1, g1) = pts[len(pts) // 2], pts[-1]
        if g1 < g0 and t1 > t0 and g1 > 0:
            rate = math.log(g0 / g1) / (t1 - t0)  # the gap's decay rate over the second half, if exponential
            need = t1 + math.log(g1 / 0.01) / rate
            per_s = sc.windows * sc.seq_len / trained[best]["step_seconds"]
            lines.append(f"- The gap (pass 2 - pass 1 on the run's held-out windows) fell from {g0:.3f} to {g1:.3f} "
                         f"over the last {t1 - t0:,} tokens; if it kept that exponential rate it would be within "
                         f"0.01 nats after about {need / 1e3:,.0f}k tokens, {need / per_s / 3600:.1f} h at this run's "
                         f"{per_s:.0f} tokens/s (an extrapolation, not a measurement: the decay may slow).")
        else:
            lines.append(f"- The gap (pass 2 - pass 1) did not shrink over the second half ({g0:.3f} -> {g1:.3f}).")
    for a, b, what in (("everything", "feedback-only", "training every weight against the feedback weights alone"),
                       ("everything-blend", "everything", "the blend curriculum (every weight trained)"),
                       ("feedback-only-blend", "feedback-only", "the blend curriculum (the feedback weights alone)"),
                       ("feedback-only-identity", "feedback-only", "the identity start (the feedback weights alone)"),
                       ("everything-blend-distill", "everything-blend", "self-distillation (every weight, the blend)"),
                       ("everything-blend-identity", "everything-blend",
                        "the identity start (every weight, the blend)"),
                       ("everything-blend-anchor", "everything-blend", "the anchor (every weight, the blend)"),
                       ("everything-blend-match", "everything-blend", "the block match (every weight, the blend)"),
                       ("everything-blend-additive", "everything-blend",
                        "the additive fusion in place of the gate (every weight, the blend)")):
        if a in feedback and b in feedback:
            lines.append(f"- {what}: FUSED k=1 - STANDARD {_read(evaluated, a, mode)['minus_first']:+.3f} against "
                         f"{_read(evaluated, b, mode)['minus_first']:+.3f}; the difference of the gaps, paired by "
                         f"window, {_gap_change(evaluated, a, b, mode)}.")
    growth = {n: max(evaluated[n]["contraction"]["growth"]) for n in feedback}
    lines.append(f"- Every warm-started pass map {'contracts' if max(growth.values()) < 1 else 'does not contract'} "
                 f"at its fixed point (largest growth per pass {max(growth.values()):.3f}; the pretrained model's "
                 f"fresh fusion {max(evaluated['pretrained']['contraction']['growth']):.3f}).")
    for name in trained:
        if name.startswith("continued"):
            lines.append(f"- Control {name}: STANDARD {std[name]:.4f} against the pretrained {std['pretrained']:.4f} "
                         f"(the domain gain alone: {std[name] - std['pretrained']:+.4f}).")
    return lines + [""]


EXPERIMENT = Experiment("warmstart", runs, report, check, seeds=2)  # about 2 h a seed on 2 cores
