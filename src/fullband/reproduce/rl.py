"""`fullband reproduce rl` (the paper's open item: on-policy post-training under latent feedback): a full-bandwidth
and a standard model, each pretrained, instruction-tuned on the mixed-verbosity arithmetic set, then post-trained
on its own samples by rejection sampling (on-policy SFT) and by group-sampled policy gradient (GRPO), every stage
scored on held-out conversations in every decoding mode; and the log-probability study on the tuned model."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fullband.reproduce.runner import (BASE, COMMANDS, Experiment, Run, Settings, config_line, held_out_chat, kept,
                                       paired, rl_run, train_tuned, verdict)

SFT = "configs/sft-tiny.toml"
RL = "configs/rl-tiny.toml"
# replies fully worked, by the last step, or the answer alone (the length is the model's choice); one turn, at most
# two changes to counts from 1 to 9: problems a 0.9M-parameter model answers correctly about 40% of the time
CORPUS = "arithmetic-mixed:20000:ops=2:numbers=9:turns=1"
# the post-training runs' settings over configs/rl-tiny.toml's (both algorithms, both models)
POST = ("rl.steps=60", "rl.lr=5e-5", "rl.max_new_tokens=80", "rl.eval_prompts=100", "rl.ckpt_every=20")
PASSES = 3  # the full-bandwidth recipe's passes per training step; the standard model's steps are this many times
STUDY_PATHS = ("jacobi:1", "jacobi:2", "jacobi:3", "jacobi:8", "replay")
STAGES = ("sft", "onpolicy-sft", "rl")


def runs() -> list[Run]:
    """The pretraining and SFT runs (fullband train); the standard model's have PASSES x the steps, so both
    models spend the same training compute (tokens x passes)."""
    corpus = f'data.corpus="{CORPUS}"'
    return [Run("base", []), Run("sft", [corpus], SFT),
            Run("standard-base", ['train.passes="none"', "train.steps=600"]),
            Run("standard-sft", ['train.passes="none"', corpus, "train.steps=450"], SFT)]


def post_runs(model: str, start: Path, mode: str, rl_extra: tuple[str, ...]) -> list[Run]:
    """On-policy SFT and GRPO from `start` (the tuned model), sampling in `mode`."""
    common = [f'rl.init_from="{start}"', f'rl.data="{CORPUS}"', f'rl.mode="{mode}"', "rl.eval_every=0", *POST,
              *rl_extra]
    prefix = "" if model == "fbt" else "standard-"
    return [Run(f"{prefix}onpolicy-sft", ['rl.algorithm="rejection-sft"', *common], RL),
            Run(f"{prefix}rl", ['rl.algorithm="grpo"', *common], RL)]


def report(runs: list[Run], root: Path, figs: Path, settings: Settings, *, held_out: int = 300,
           max_new_tokens: int = 128, sft_extra: tuple[str, ...] = (), rl_extra: tuple[str, ...] = (),
           study_prompts: int = 8, study_tokens: int = 32) -> list[str]:
    from fullband.rl.run import plot_rl
    from fullband.train.config import load_run_config

    base, sft, std_base, std_sft = runs
    tuned = train_tuned(root, ((sft, base), (std_sft, std_base)), settings, sft_extra)
    walls = {name: wall for t, s in ((sft, base), (std_sft, std_base))
             for name, wall in ((s.name, tuned[t.name].start_wall), (t.name, tuned[t.name].wall))}
    ckpts = {name: t.checkpoint for name, t in tuned.items()}
    post = {"fbt": post_runs("fbt", ckpts[sft.name], "soft", rl_extra),
            "standard": post_runs("standard", ckpts[std_sft.name], "standard", rl_extra)}
    posted = [*post["fbt"], *post["standard"]]
    for run in posted:
        ckpts[run.name], walls[run.name] = rl_run(root, run, settings=settings)

    # held-out conversations: the SFT runs' own validation split of the corpus, never trained on
    cfg = load_run_config(SFT, [f'data.corpus="{CORPUS}"', *settings.extra, *sft_extra])
    data_file = held_out_chat(root, cfg, held_out)
    modes = ["standard", "soft", "fused:1"]
    stage_runs = {"fbt": [sft.name, *(r.name for r in post["fbt"])],
                  "standard": [std_sft.name, *(r.name for r in post["standard"])]}
    results = _evaluate(stage_runs, ckpts, data_file, figs, held_out, max_new_tokens, modes)
    study = _study(ckpts[sft.name], data_file, study_prompts, study_tokens, figs / "logprob-study.json")
    table = {(model, stage, row["mode"]): row for model, names in stage_runs.items()
             for stage, name in zip(STAGES, names) for row in results[name]["rows"]}
    lines = _intro(results[sft.name]["n"]) + _table_lines(table)
    _record(settings.findings, table)
    fbt_compute, std_compute = tuned[sft.name].compute_tokens, tuned[std_sft.name].compute_tokens
    lines += ["", "Training time: " + ", ".join(f"{name} {w / 60:.1f} min" for name, w in walls.items())
              + f". Pretraining + SFT compute (tokens x passes): standard / full-bandwidth = "
              f"{std_compute / fbt_compute:.2f}.", ""]
    lines += _post_lines(root, posted)
    lines += _outcome(table, stage_runs)
    lines += _study_lines(study, study_prompts, study_tokens)
    _figure(table, figs / "rl.png")
    lines += [f"![exact match and reply length per stage and decoding]({figs.name}/rl.png)", "",
              *(f"![{r.name}: reward and reply length per step]({figs.name}/runs/{r.name}.png)" for r in posted),
              "", COMMANDS, "", *(f"- {config_line(r)}" for r in runs),
              *(f"- `fullband rl {r.config} " + " ".join(f"--set {o}" for o in r.overrides) + "`" for r in posted),
              f"- `fullband eval chat --checkpoint CHECKPOINT --data {data_file} --modes {' '.join(modes)}` for each "
              "stage's final checkpoint", "- the log-probability study: `fullband.rl.study.logprob_study` on "
              f"{ckpts[sft.name]} (raw: `{figs.name}/logprob-study.json`)"]
    (figs / "runs").mkdir(parents=True, exist_ok=True)
    for run in posted:  # each post-training run's reward / length curve beside the report
        plot_rl(root / run.name / "metrics.jsonl", figs / "runs" / f"{run.name}.png")
    return lines


def _evaluate(stage_runs: dict[str, list[str]], ckpts: dict[str, Path], data_file: Path, figs: Path, n: int,
              max_new_tokens: int, modes: list[str]) -> dict[str, dict]:
    """Every stage's final checkpoint on the held-out conversations (the full-bandwidth model's in every mode, the
    standard one's in STANDARD), each evaluation kept beside the report and reused by a rerun (the same checkpoint,
    items and reply budget)."""
    from fullband.eval.commands import eval_chat

    def every_item(r: dict) -> bool:
        return r.get("n", 0) + r.get("skipped", 0) == n and "lengths" in (r.get("rows") or [{}])[0]

    results: dict[str, dict] = {}
    for model, names in stage_runs.items():
        for name in names:
            out = figs / "eval" / name
            key = {"checkpoint": str(ckpts[name]), "data": str(data_file), "max_new_tokens": max_new_tokens}
            results[name] = kept(out / "chat.json", key, ckpts[name], lambda: eval_chat(
                ckpts[name], data_file, modes=modes if model == "fbt" else ["standard"], out=out,
                max_new_tokens=max_new_tokens, progress=False), valid=every_item, save=False)
    return results


def _intro(n: int) -> list[str]:
    return ["The paper's open problem: its SFT data came from standard decoding (off-policy), and the SOFT model's",
            "shorter reasoning vanished after SFT; on-policy post-training under latent-feedback decoding is its first",
            "future direction.", "",
            f"Here: the demo's full-bandwidth model (`{BASE}`, three passes every step) and a standard model of the",
            f"same size (`passes = \"none\"`, {PASSES}x the steps: the same training compute, tokens x passes), each "
            f"instruction-tuned with `{SFT}` on `{CORPUS}` (the built-in arithmetic problems; each reply worked "
            "fully, by its last step only, or as the answer alone, so a reply's length is the model's choice), then "
            f"post-trained from that SFT model with `{RL}` on its own samples (the full-bandwidth model sampling in "
            "SOFT, the standard one in STANDARD; the same prompts, group, steps and seeds):",
            "- **on-policy SFT** (`rl.algorithm = \"rejection-sft\"`): each step samples G replies per prompt, keeps "
            "the correct ones and trains on them with the chat objective;",
            "- **RL** (`rl.algorithm = \"grpo\"`): group-standardised advantages, clipped ratio, token-level "
            "normalisation; log-probabilities by the exact recurrence.", "",
            f"Scored on {n} held-out conversations (the SFT runs' validation split): greedy "
            "answer to the last user turn, exact match of its final `Answer:` line, reply length in tokens (end "
            "marker included). Differences are paired over the same items. The pretrained base models are code LMs "
            "without the chat markers: a chat prompt is outside their vocabulary, so the pipeline's first scored "
            "stage is SFT.", "",
            "| model | stage | decoding | exact match | vs SFT (same decoding) | reply tokens (mean) | median | "
            "vs SFT |", "|---|---|---|---|---|---|---|---|"]


def _table_lines(table: dict) -> list[str]:
    """A row per model, stage and decoding, with its paired change from the same model's SFT stage."""
    lines = []
    for (model, stage, mode), row in table.items():
        ref = table[model, "sft", mode]
        if stage == "sft":
            d_acc = d_len = ""
        else:
            d, se = paired(row["correct"], ref["correct"])
            dl, sel = paired(row["lengths"], ref["lengths"])
            d_acc, d_len = f"{d:+.3f} ± {se:.3f}", f"{dl:+.1f} ± {sel:.1f}"
        lines.append(f"| {model} | {stage} | {mode} | {row['accuracy']:.3f} ± {row['accuracy_se']:.3f} | {d_acc} | "
                     f"{row['tokens']:.1f} ± {row['tokens_se']:.1f} | {np.median(row['lengths']):.0f} | {d_len} |")
    return lines


def _record(findings, table: dict) -> None:
    """The findings across seeds: every row's exact match and reply length, and each post-training stage's paired
    change from the same model's SFT stage in the same decoding."""
    for (model, stage, mode), row in table.items():
        findings.value(f"{model} {stage} {mode}: exact match", row["accuracy"], row["accuracy_se"], fmt=".3f")
    for (model, stage, mode), row in table.items():
        if stage != "sft":
            ref = table[model, "sft", mode]
            findings.diff(f"{model} {stage} minus sft, {mode}: exact match", *paired(row["correct"], ref["correct"]),
                          fmt="+.3f")
            findings.diff(f"{model} {stage} minus sft, {mode}: reply tokens", *paired(row["lengths"], ref["lengths"]),
                          up="longer", down="shorter", fmt="+.1f")


def _study(ckpt: Path, data_file: Path, prompts: int, tokens: int, out: Path) -> list[dict]:
    """The log-probability study on the tuned full-bandwidth model, its held-out prompts, SOFT and FUSED k=2."""
    from fullband.data.chat.templates import chat_prompt, chat_template
    from fullband.data.tokenizer import load_tokenizer
    from fullband.decode.sampling import Sampling
    from fullband.eval.chat import held_out_items
    from fullband.loader import load_model
    from fullband.rl.study import logprob_study

    def compute() -> dict:
        model, tokenizer = load_model(ckpt), load_tokenizer(ckpt)
        template = chat_template(tokenizer)
        items = held_out_items(data_file, limit=prompts)
        ids = [chat_prompt(tokenizer, messages, template=template) for messages, _ in items]
        return {"rows": logprob_study(model, ids, tokens, modes=["soft", "fused:2"], paths=["exact", *STUDY_PATHS],
                                      sampling=Sampling(temperature=1.0, seed=0))}

    return kept(out, {"checkpoint": str(ckpt), "prompts": prompts, "tokens": tokens}, ckpt, compute)["rows"]


def _study_lines(rows: list[dict], prompts: int, tokens: int) -> list[str]:
    lines = ["### The log-probability of a sampled reply, three ways", "",
             f"On the tuned full-bandwidth model: {prompts} held-out prompts, {tokens} tokens sampled per prompt at "
             "temperature 1 by the decode engine in each mode (no stop: every reply is the full length); each path "
             "computes the replies' log-probabilities and the gradient of their sum (`fullband.rl.logprob`). Errors "
             "against `exact` in nats/token; time: the median of 3 forward + backward, alternated with exact's in "
             "one process; memory: what autograd saved for the backward pass.", "",
             "| mode | path | mean error | max error | gradient cosine | time vs exact | saved MiB |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        time_ = (f"{r['time_vs_exact']:.2f}" + (f" ({r['seconds']:.2f} s)" if r["path"] == "exact" else ""))
        lines.append(f"| {r['mode']} | {r['path']} | {r['mean_error']:.3g} | {r['max_error']:.3g} | "
                     f"{r['grad_cosine']:.4f} | {time_} | {r['saved_mib']:.0f} |")
    by = {(r["mode"], r["path"]): r for r in rows}
    lines.append("")
    for mode in dict.fromkeys(r["mode"] for r in rows):
        jac = [(int(p.split(":")[1]), by[mode, p]) for p in STUDY_PATHS if p.startswith("jacobi") and
               (mode, p) in by]
        usable = [k for k, r in jac if r["mean_error"] < 0.01]
        rep = by.get((mode, "replay"))
        lines.append(f"- {mode}: Jacobi's mean error falls from {jac[0][1]['mean_error']:.3g} (K = {jac[0][0]}) to "
                     f"{jac[-1][1]['mean_error']:.3g} (K = {jac[-1][0]}); "
                     + (f"below 0.01 nats/token from K = {usable[0]} on, at {by[mode, f'jacobi:{usable[0]}']['time_vs_exact']:.2f}x exact's time"
                        if usable else "never below 0.01 nats/token at these K")
                     + (f"; replay's values are exact to {rep['max_error']:.1g} at {rep['time_vs_exact']:.2f}x "
                        f"exact's time, its gradient's cosine with the exact one {rep['grad_cosine']:.3f}."
                        if rep else "."))
    return lines + [""]


def _post_lines(root: Path, posted: list[Run]) -> list[str]:
    """Each post-training run's first and last sampled reward and reply length (its metrics.jsonl)."""
    from fullband.rl.run import metric_rows

    lines = ["| post-training run | sampling | steps | reward (first 5 steps → last 5) | reply tokens (first 5 → "
             "last 5) | kept / step (on-policy SFT) | s / step |", "|---|---|---|---|---|---|---|"]
    def mean(rs, key):
        return sum(r[key] for r in rs) / len(rs)

    for run in posted:
        rows = [r for r in metric_rows(root / run.name / "metrics.jsonl") if "reward" in r]
        head, tail = rows[:5], rows[-5:]
        kept_mean = f"{mean(rows, 'kept'):.1f}" if "kept" in rows[0] else ""
        mode = next(o.split("=", 1)[1].strip('"') for o in run.overrides if o.startswith("rl.mode="))
        lines.append(f"| {run.name} | {mode} | {len(rows)} | {mean(head, 'reward'):.3f} → {mean(tail, 'reward'):.3f} "
                     f"| {mean(head, 'length'):.1f} → {mean(tail, 'length'):.1f} | {kept_mean} | "
                     f"{mean(rows, 'seconds'):.1f} |")
    return lines + [""]


def _outcome(table: dict, stage_runs: dict) -> list[str]:
    """The findings, computed from the table: for each model and post-training stage, its change from SFT in the
    model's own sampling mode (accuracy and length), and SOFT vs STANDARD on the full-bandwidth model per stage."""
    lines = ["**Outcome.**", ""]
    for model, own in (("fbt", "soft"), ("standard", "standard")):
        ref = table[model, "sft", own]
        for stage in STAGES[1:]:
            row = table[model, stage, own]
            d, se = paired(row["correct"], ref["correct"])
            dl, sel = paired(row["lengths"], ref["lengths"])
            lines.append(f"- {model}, {stage} vs SFT in {own}: exact match {ref['accuracy']:.3f} → "
                         f"{row['accuracy']:.3f} ({d:+.3f} ± {se:.3f}: {verdict(d, se)}); reply "
                         f"length {ref['tokens']:.1f} → {row['tokens']:.1f} tokens ({dl:+.1f} ± {sel:.1f}: "
                         f"{verdict(dl, sel, 'longer', 'shorter')}).")
    for stage in STAGES:
        soft, std = table["fbt", stage, "soft"], table["fbt", stage, "standard"]
        d, se = paired(soft["lengths"], std["lengths"])
        da, sea = paired(soft["correct"], std["correct"])
        lines.append(f"- fbt {stage}: SOFT vs STANDARD decoding, exact match {da:+.3f} ± {sea:.3f} "
                     f"({verdict(da, sea)}), reply length {d:+.2f} ± {se:.2f} tokens "
                     f"({verdict(d, se, 'longer', 'shorter')}).")
    best = {m: max((r["accuracy"], s, mode) for (mm, s, mode), r in table.items() if mm == m) for m in stage_runs}
    lines.append(f"- best of each model: full-bandwidth {best['fbt'][0]:.3f} ({best['fbt'][1]}, {best['fbt'][2]}), "
                 f"standard {best['standard'][0]:.3f} ({best['standard'][1]}).")
    return lines + [""]


def _figure(table: dict, out: Path) -> None:
    from fullband.files import plt, save_figure

    keys = list(table)
    labels = [f"{m} {s} {mode}" for m, s, mode in keys]
    fig, (a, b) = plt().subplots(1, 2, figsize=(max(10, 0.8 * len(keys)), 5), constrained_layout=True)
    x = np.arange(len(keys))
    colors = ["#3a7" if m == "fbt" else "#888" for m, _, _ in keys]
    a.bar(x, [table[k]["accuracy"] for k in keys], yerr=[table[k]["accuracy_se"] for k in keys], capsize=3,
          color=colors)
    a.set(ylabel="held-out exact match (greedy)")
    b.bar(x, [table[k]["tokens"] for k in keys], yerr=[table[k]["tokens_se"] for k in keys], capsize=3,
          color=colors)
    b.set(ylabel="mean reply length (tokens)")
    for ax in (a, b):
        ax.set_xticks(x, labels, fontsize=7, rotation=60, ha="right")
        ax.grid(alpha=0.3, axis="y")
    save_figure(fig, out)


EXPERIMENT = Experiment("rl", runs, report, seeds=2)  # about 100 min a seed on 2 cores
