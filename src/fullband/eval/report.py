"""Tables and figures of fullband's evaluations, rendered from their result dicts: the eval functions compute and
return results; this module prints their tables and writes WHAT.json and WHAT.png (never over a file another
tool wrote)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from fullband.files import (OutputError, check_no_loop, check_writable, make_folder, plt, read_json, replace_file,
                            save_figure)


# ---------------------------------------------------------------------- output files
def check_out(out: str | Path, name: str) -> Path:
    """The folder for NAME.json / NAME.png, refused now (before any work) when it is a file or not writable, or
    when it holds a NAME.json / NAME.png that fullband eval did not write (those are never overwritten)."""
    out = Path(out)
    check_no_loop(out, "--out")
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise OutputError(f"--out {str(out)!r} is a file; accepted: a folder for {name}.json / {name}.png")
    ours = "checkpoint" in (read_json(out / f"{name}.json") or {})  # every eval result names its checkpoint
    theirs = [f for f in (f"{name}.json", f"{name}.png") if (out / f).exists() and not ours]
    if theirs:
        raise OutputError(f"--out {str(out)!r} holds {' and '.join(theirs)}, not written by fullband eval; nothing "
                          "was overwritten. Choose another --out")
    check_writable(out, "--out")
    return out


def write(out: Path, name: str, result: dict, fig=None) -> None:
    """NAME.json (and NAME.png) into `out`."""
    check_out(out, name)
    make_folder(out, "--out")
    replace_file(out / f"{name}.json", json.dumps(result, indent=2) + "\n")
    if fig is not None:
        save_figure(fig, out / f"{name}.png")


def show(name: str, result: dict, out: Path) -> None:
    """Print the table of result NAME and write its JSON and figure under `out`."""
    table, figure = RENDER[name]
    print(table(result))
    write(out, name, result, figure(result) if figure is not None else None)


def loss_table(result: dict) -> str:
    first = result["rows"][0]["mode"]
    lines = [f"{'mode':<15} {'passes':>6} {'nats/token':>11} {'± s.e.':>8} {f'minus {first} (paired)':>27} "
             f"{'bits/byte':>10}"]
    for r in result["rows"]:
        passes = r["passes"] or ("T+1" if r["mode"] == "exact" else f"{1 + r['fused_passes_used']:.1f}")
        paired = f"{r['minus_first']:+.4f} ± {r['minus_first_stderr']:.4f}" if r is not result["rows"][0] else ""
        lines.append(f"{r['mode']:<15} {passes:>6} {r['nats_per_token']:>11.4f} {r['stderr']:>8.4f} {paired:>27} "
                     f"{r['bits_per_byte']:>10.4f}")
    return "\n".join(lines)


def loss_figure(result: dict):
    """Left: held-out loss by fused prefill passes (± s.e. over windows); right: each mode minus the first
    (STANDARD), paired window by window (± 2 s.e.), which is what tells the modes apart."""
    from matplotlib.ticker import MaxNLocator

    rows = result["rows"]
    fig, axes = plt().subplots(1, 2, figsize=(10.5, 3.8))
    x = [r["passes"] - 1 if r["passes"] is not None else r["fused_passes_used"] for r in rows]
    for ax, key, err, scale, label in ((axes[0], "nats_per_token", "stderr", 1, "held-out loss (nats / token)"),
                                       (axes[1], "minus_first", "minus_first_stderr", 2,
                                        f"minus {rows[0]['mode']}, paired\n(nats / token, ± 2 s.e.)")):
        fixed = [(xi, r) for xi, r in zip(x, rows) if r["passes"] is not None]
        ax.errorbar([xi for xi, _ in fixed], [r[key] for _, r in fixed], yerr=[scale * r[err] for _, r in fixed],
                    marker="o", capsize=3, label="STANDARD (k=0) and FUSED (k prefill passes)")
        for xi, r in zip(x, rows):
            if r["fused_passes_used"] is not None:
                ax.errorbar([xi], [r[key]], yerr=[scale * r[err]], marker="D", capsize=3, ls="none",
                            label=f"{r['mode']} (mean passes used)")
            elif r["mode"] == "exact":
                ax.axhline(r[key], color="k", ls="--", lw=1, label="exact recurrence")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # ticks under the adaptive points' mean passes too
        ax.set(xlabel="fused prefill passes k", ylabel=label)
        ax.grid(alpha=0.3)
    axes[1].axhline(0, color="grey", lw=0.8)
    axes[0].legend(fontsize=7)
    fig.suptitle(Path(result["checkpoint"]).name, fontsize=10)
    return fig


def stability_table(result: dict) -> str:
    sweep, con = result["sweep"], result["contraction"]
    lines = [f"{'k':>5} {'loss':>8} {'± s.e.':>7} {'|h(k)-h(k-1)|':>14} {'|h(k)-exact|':>13}"]
    for i, k in enumerate(sweep["ks"]):
        ex = sweep["exact_rms"][i]
        lines.append(f"{k:>5} {sweep['loss'][i]:>8.4f} {sweep['loss_stderr'][i]:>7.4f} {sweep['update_rms'][i]:>14.3e} "
                     f"{(f'{ex:.3e}' if ex is not None else '-'):>13}")
    if sweep["converged_at"]:
        lines.append(f"every window reached its fixed point (the exact recurrence) at k = {sweep['converged_at']} "
                     f"(T = {result['seq_len']})")
    lines.append("perturbation growth per pass (||J^k v|| / ||v||)^(1/k): "
                 + ", ".join(f"k={h}: {g:.3f}" for h, g in zip(con["horizons"], con["growth"]))
                 + f"; one-pass gain ||J||_2 = {con['lipschitz']:.3f}")
    lines.append("growth < 1: the pass map contracts and long feedback horizons stay stable; > 1: perturbations grow")
    return "\n".join(lines)


def stability_figure(result: dict):
    sweep = result["sweep"]
    fig, axes = plt().subplots(1, 2, figsize=(10, 3.8))
    axes[0].errorbar(sweep["ks"], sweep["loss"], yerr=sweep["loss_stderr"], marker="o", capsize=3,
                     label="Jacobi iterate")
    if sweep["exact_loss"] is not None:
        axes[0].axhline(sweep["exact_loss"], color="k", ls="--", lw=1, label="exact recurrence")
    axes[0].set(xscale="log", xlabel="passes k", ylabel="held-out loss (nats / token)")
    axes[0].legend(fontsize=8)
    curve = np.array(sweep["update_curve"])
    kk = np.arange(1, len(curve) + 1)
    keep = curve > 0
    axes[1].loglog(kk[keep][1:], curve[keep][1:], label="RMS ||h(k) - h(k-1)||")
    exact = [(k, v) for k, v in zip(sweep["ks"], sweep["exact_rms"]) if v]
    if exact:
        axes[1].loglog(*zip(*exact), "s--", label="RMS ||h(k) - h_exact||")
    axes[1].set_xlabel("passes k")
    axes[1].legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3, which="both")
    fig.suptitle(f"{Path(result['checkpoint']).name}: iterating the fused pass map (T = {result['seq_len']})")
    return fig


def probe_table(result: dict) -> str:
    lines = []
    for task, t in result["tasks"].items():
        for name, ans in t["answer"].items():
            lines.append(f"{task:<11} model answers ({name}): {ans['accuracy']:.3f}  by length {ans['by_length']}")
        for mode, acc in t["modes"].items():
            lines.append(f"{task:<11} {mode:<9} layer 0: {acc[0]:.3f}  best: {max(acc):.3f} "
                         f"(depth {int(np.argmax(acc))})")
    return "\n".join(lines)


def probe_figure(result: dict):
    tasks = list(result["tasks"])
    fig, axes = plt().subplots(1, len(tasks), figsize=(5 * len(tasks), 3.8), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for mode, acc in result["tasks"][task]["modes"].items():
            ax.plot(range(len(acc)), acc, marker="o", label=mode if mode != "suffix" else f"suffix k={result['suffix']}")
        ax.axhline(0.5, color="k", lw=0.8, ls=":")
        ax.set(ylim=(0.3, 1.02), xticks=range(len(acc)), xlabel="depth (0 = stack input)",
               ylabel="probe accuracy (4-fold grouped CV)", title=task)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return fig


def generate_length_table(result: dict) -> str:
    lines = [f"{'mode':<14} {'median tokens':>13} {'mean':>8} {'exact match':>11}"]
    for r in result["modes"]:
        name = r["mode"] if r["mode"] != "fused" else f"fused k={r['prefill_passes']}"
        acc = f"{r['accuracy']:.3f}" if r["accuracy"] is not None else "-"
        lines.append(f"{name:<14} {r['median_tokens']:>13.1f} {r['mean_tokens']:>8.1f} {acc:>11}")
    return "\n".join(lines)


RENDER = {"loss": (loss_table, loss_figure), "stability": (stability_table, stability_figure),
          "probe": (probe_table, probe_figure), "generate_length": (generate_length_table, None)}
