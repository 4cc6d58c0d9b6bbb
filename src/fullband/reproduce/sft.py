"""`fullband reproduce sft` (the paper's Table 1 / Fig. 6): a full-bandwidth and a standard base model, each
instruction-tuned on the synthetic chat set, scored on held-out conversations in every decoding mode."""

from __future__ import annotations

from pathlib import Path

from fullband.reproduce.runner import (BASE, COMMANDS, Experiment, Run, Settings, Tuned, config_line, held_out_chat,
                                       paired, shown, train_tuned, verdict)

SFT = "configs/sft-tiny.toml"


def runs() -> list[Run]:
    return [Run("base", []), Run("sft", [], SFT), Run("standard-base", ['train.passes="none"']),
            Run("standard-sft", ['train.passes="none"'], SFT)]


def report(runs: list[Run], root: Path, figs: Path, settings: Settings, *, held_out: int = 300,
         max_new_tokens: int = 192, sft_extra: tuple[str, ...] = ()) -> list[str]:
    """Table 1 / Fig. 6 at this scale: a full-bandwidth model and a standard one (same size, same budget),
    each instruction-tuned on the synthetic chat set, scored on held-out conversations in every mode."""
    from fullband.eval.commands import eval_chat
    from fullband.eval.loss import validation_loss
    from fullband.model.decoder import FullbandLM
    from fullband.train.config import load_run_config
    from fullband.train.data import prepare_data
    from fullband.train.parallel import Dist

    base, sft, std_base, std_sft = runs
    trained = train_tuned(root, ((sft, base), (std_sft, std_base)), settings, sft_extra)
    data_file = held_out_chat(root, load_run_config(SFT, [*settings.extra, *sft_extra]), held_out)
    modes = ["standard", "soft", "fused:1", "fused:2"]
    results, commands = {}, []
    for run, out, run_modes in ((sft, "fbt", modes), (std_sft, "standard", ["standard"])):
        ckpt = trained[run.name].checkpoint
        results[run.name] = eval_chat(ckpt, data_file, modes=run_modes, out=figs / out, max_new_tokens=max_new_tokens,
                                      progress=False)
        commands.append(f"- `fullband eval chat --checkpoint {ckpt} --data {data_file} --modes {' '.join(run_modes)}`")
    # the tuned model's validation loss on assistant tokens per pass count (training's own measure)
    val = prepare_data(load_run_config(SFT, [*settings.extra, *sft_extra, f'log.run_dir="{root / sft.name}"']),
                       Dist(), run_dir=root / sft.name).val_batches
    model = FullbandLM.load(trained[sft.name].checkpoint)
    val_losses = {k: validation_loss(model, val, k) for k in (1, 2, 3)}
    rows = [(name, r) for name in (sft.name, std_sft.name) for r in results[name]["rows"]]
    lines = _table(results[sft.name]["n"], rows)
    lines += ["", "Training time: " + ", ".join(f"{name} {t.wall / 60:.1f} min (its base {t.start_wall / 60:.1f} min)"
                                                for name, t in trained.items()),
              "", f"Held-out loss of {sft.name} on assistant tokens (nats/token, prompts read plainly): "
              + ", ".join(f"{k} pass{'es' if k > 1 else ''} {v.nats:.4f} ± {v.stderr:.4f}" for k, v in val_losses.items()),
              ""]
    params = sum(p.numel() for p in model.parameters())
    lines += _outcome(results[sft.name], results[std_sft.name], trained[sft.name], trained[std_sft.name], params)
    _record(settings.findings, results[sft.name], results[std_sft.name], val_losses)
    lines += [f"![chat accuracy and reply length per mode]({figs.name}/fbt/chat.png)", "", COMMANDS, "",
              *(f"- {config_line(r)}" for r in runs), *commands]
    return lines


def _table(n: int, rows: list[tuple[str, dict]]) -> list[str]:
    lines = ["The paper's Table 1 / Fig. 6: after instruction tuning, FUSED decoding scores higher than standard",
             "decoding (GSM8K 71.8 vs 68.4) and SOFT gives shorter reasoning at equal accuracy.", "",
             f"Here: the demo's full-bandwidth model (`{BASE}`, three passes every step) and a standard model of the",
             "same size and budget (`passes = \"none\"`), each instruction-tuned with "
             f"`{SFT}` (`train.init_from` = its base; the standard one with one pass per step) on the built-in",
             "synthetic set (arithmetic word problems, worked steps, `Answer: N`, ~30% two turns). "
             f"Scored on {n} held-out conversations (the run's own validation split, never",
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
    return lines


def _record(findings, fbt: dict, standard: dict, val_losses: dict) -> None:
    """The findings across seeds: every row's exact match and reply length, each mode against STANDARD decoding of
    the same model and against the standard model (paired over the items), the tuned model's loss per pass."""
    std = standard["rows"][0]
    for model, rows in (("sft", fbt["rows"]), ("standard-sft", standard["rows"])):
        for r in rows:
            findings.value(f"{model} {r['mode']}: exact match", r["accuracy"], r["accuracy_se"], fmt=".3f")
    for r in fbt["rows"][1:]:
        findings.diff(f"sft {r['mode']} minus STANDARD: exact match", r["accuracy_diff"], r["accuracy_diff_se"],
                      fmt="+.3f")
        findings.diff(f"sft {r['mode']} minus STANDARD: reply tokens", r["tokens_diff"], r["tokens_diff_se"],
                      up="longer", down="shorter", fmt="+.1f")
    for r in fbt["rows"]:
        findings.diff(f"sft {r['mode']} minus standard-sft: exact match", *paired(r["correct"], std["correct"]),
                      fmt="+.3f")
    for k, v in val_losses.items():
        findings.value(f"sft held-out loss, {k} pass{'es' if k > 1 else ''} (nats/token)", v.nats, v.stderr)


def _outcome(fbt: dict, standard: dict, fbt_run: Tuned, std_run: Tuned, params: int) -> list[str]:
    """The findings, computed from both models' evaluations (`fbt`, `standard`) and training budgets."""
    from fullband.data.chat.arithmetic import final_answer

    def correct(row: dict) -> list[float]:
        return [float(final_answer(a) == f) for a, f in zip(row["answers"], fbt["references"])]

    fbt_rows = fbt["rows"]
    soft = next(r for r in fbt_rows if r["mode"] == "soft")
    best = max(fbt_rows[1:], key=lambda r: r["accuracy"])
    std = standard["rows"][0]
    d_std, se_std = paired(correct(best), correct(std))
    budget = ("the same tokens" if std_run.tokens == fbt_run.tokens else
              f"{std_run.tokens / fbt_run.tokens:.2g}x the tokens") + (
        f", {std_run.compute_tokens / fbt_run.compute_tokens:.2g}x the training compute, base and SFT together")
    lengths, ended = [r["tokens"] for r in fbt_rows], [r["ended"] for r in (*fbt_rows, *standard["rows"])]
    tokens = f"{min(lengths):.1f}" + (f" to {max(lengths):.1f}" if max(lengths) > min(lengths) else "")
    if min(ended) == 1 or max(ended) == 0:
        closed = f"{'every one' if min(ended) == 1 else 'none'} closed by the end marker"
    else:
        closed = (f"{min(ended):.0%}" + (f" to {max(ended):.0%}" if max(ended) > min(ended) else "")
                  + " closed by the end marker per mode and model")
    if not any(shown(r["tokens_diff"], r["tokens_diff_se"]) for r in fbt_rows[1:]):
        length = ("The replies have the same length in every mode (no mode's differs from STANDARD's by 2 standard "
                  f"errors or more; {tokens} tokens on average; {closed}), so the length comparison cannot show "
                  "shorter reasoning here")
    else:
        length = (f"The reply length differs between modes ({tokens} tokens on average; {closed}): SOFT's is "
                  + ("shorter than STANDARD's, the paper's shorter reasoning"
                     if shown(soft["tokens_diff"], soft["tokens_diff_se"]) and soft["tokens_diff"] < 0
                     else "not shorter than STANDARD's"))
    best_acc = max(r["accuracy"] for r in (*fbt_rows, *standard["rows"]))
    skill = (f"mostly get the arithmetic wrong (exact match at most {best_acc:.3f} in any mode)" if best_acc < 0.5
             else f"get most of the arithmetic right (exact match up to {best_acc:.3f})")
    return [f"**Outcome.** On the full-bandwidth model, {best['mode']} vs STANDARD decoding: accuracy "
            f"{best['accuracy_diff']:+.3f} ± {best['accuracy_diff_se']:.3f} "
            f"({verdict(best['accuracy_diff'], best['accuracy_diff_se'])}); SOFT vs STANDARD "
            f"{soft['accuracy_diff']:+.3f} ± {soft['accuracy_diff_se']:.3f} "
            f"({verdict(soft['accuracy_diff'], soft['accuracy_diff_se'])}), reply length "
            f"{soft['tokens_diff']:+.1f} ± {soft['tokens_diff_se']:.1f} tokens "
            f"({verdict(soft['tokens_diff'], soft['tokens_diff_se'], 'longer', 'shorter')}). Against the standard "
            f"model ({budget}): {best['mode']} {best['accuracy']:.3f} vs {std['accuracy']:.3f}, paired "
            f"{d_std:+.3f} ± {se_std:.3f} ({verdict(d_std, se_std)}). {length}; at {params / 1e6:.2g}M parameters "
            f"the models {skill}.", ""]


EXPERIMENT = Experiment("sft", runs, report)
