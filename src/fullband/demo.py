"""The main job on the embedded default (`make demo`): train configs/tiny.toml on the Python standard library,
then report held-out loss for STANDARD and FUSED prefill and sample a code continuation in every mode.

Everything lands in the run directory: metrics, checkpoints, loss.png, val_loss.png, samples.md, demo.json.
A finished run is reused; an interrupted one is resumed."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from fullband.decode.generate import generate
from fullband.files import lock_folder, make_folder, replace_file
from fullband.eval.loss import validation_loss
from fullband.model.decoder import FullbandLM
from fullband.train.checkpoint import list_checkpoints, read_trainer_state
from fullband.train.config import load_run_config
from fullband.train.data import prepare_data
from fullband.train.parallel import Dist
from fullband.train.rundir import RUN_FILE
from fullband.train.trainer import train

PROMPT = 'def read_config(path):\n    """Read a configuration file and return a dict."""\n'
MODES = [("standard", 0), ("soft", 0), ("fused", 1), ("fused", 2), ("exact", 0)]
EVAL = [("STANDARD (1 pass)", 1), ("FUSED, 1 prefill pass", 2), ("FUSED, 2 prefill passes", 3)]


def run_demo(config: str | Path = "configs/tiny.toml", run_dir: str | Path = "runs/demo", *, new_tokens: int = 120,
             eval_windows: int = 256) -> int:
    run_dir = Path(run_dir)
    overrides = [f'log.run_dir="{run_dir}"']
    cfg = load_run_config(config, overrides)
    make_folder(run_dir, "demo run directory")
    with lock_folder(run_dir, "demo run directory", hint=", or pass another --out"):
        return _demo(cfg, config, run_dir, new_tokens=new_tokens, eval_windows=eval_windows)


def _demo(cfg, config, run_dir: Path, *, new_tokens: int, eval_windows: int) -> int:
    t0 = time.perf_counter()
    done = list_checkpoints(run_dir)
    if done and read_trainer_state(done[-1])["step"] >= cfg.train.steps:
        print(f"{run_dir} already holds a finished run ({done[-1].name}); delete it to train again")
    else:
        print(f"training {config} on {cfg.data.corpus!r} ({cfg.train.steps} steps x "
              f"{cfg.train.global_batch_tokens} tokens, pass schedule {cfg.train.passes!r})")
        started = bool(done) or (run_dir / RUN_FILE).is_file()  # an interrupted run, with or without a checkpoint
        train(cfg, resume=run_dir if started else None)
    train_seconds = time.perf_counter() - t0
    final = list_checkpoints(run_dir)[-1]
    model = FullbandLM.load(final)

    # held-out loss by mode, on more windows than the periodic validation used
    cfg.log.eval_windows = eval_windows
    data = prepare_data(cfg, Dist(), run_dir=run_dir)
    print(f"\nheld-out loss on {len(data.val_batches)} batches of the validation split "
          f"({cfg.data.corpus!r}, files never trained on):")
    print(f"  {'mode':<26} {'nats/token':>10} {'± s.e.':>8} {'bits/token':>10}  {'vs STANDARD (paired)':>22}")
    losses, standard = {}, None
    for label, passes in EVAL:
        r = validation_loss(model, data.val_batches, passes)
        standard = standard or r
        diff, se = r.paired_difference(standard)
        losses[label] = {"passes": passes, "nats": r.nats, "stderr": r.stderr, "bits_per_token": r.bits,
                         "minus_standard": diff, "minus_standard_stderr": se}
        paired = f"{diff:+.4f} ± {se:.4f}" if passes > 1 else ""
        print(f"  {label:<26} {r.nats:>10.4f} {r.stderr:>8.4f} {r.bits:>10.4f}  {paired:>22}")

    tok = data.tokenizer
    prompt = tok.encode(PROMPT)
    samples = {}
    print(f"\ngreedy continuations of:\n{PROMPT}")
    for mode, k in MODES:
        name = mode if mode != "fused" else f"fused (k={k})"
        ids = generate(model, [prompt], new_tokens, mode=mode, prefill_passes=k, stop_tokens=[tok.eos_id])[0]
        samples[name] = tok.decode(ids)
        print(f"--- {name} ---\n{samples[name]}\n")

    _plot_losses(losses, run_dir / "val_loss.png")
    md = [f"# Demo samples ({final.name})", "", "Prompt:", "", "```python", PROMPT.rstrip(), "```", ""]
    for name, text in samples.items():
        md += [f"## {name}", "", "```python", PROMPT + text, "```", ""]
    replace_file(run_dir / "samples.md", "\n".join(md))
    summary = {"checkpoint": str(final), "wall_seconds": train_seconds, "val_loss": losses, "samples": samples,
               "threads": torch.get_num_threads()}
    replace_file(run_dir / "demo.json", json.dumps(summary, indent=2) + "\n")
    print(f"wrote {run_dir}/: metrics.jsonl, loss.png, val_loss.png, samples.md, demo.json, {final.name}/")
    return 0


def _plot_losses(losses: dict, out: Path) -> None:
    from fullband.eval.report import plt as pyplot

    plt = pyplot()
    labels = list(losses)
    values = [losses[k]["nats"] for k in labels]
    errors = [losses[k]["stderr"] for k in labels]
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    bars = ax.bar(range(len(labels)), values, yerr=errors, capsize=4, color=["#777", "#3a7", "#27a"])
    lo = min(values) - 3 * max(errors)
    ax.set_ylim(max(0.0, lo - 0.05 * abs(lo)), max(values) + 3 * max(errors))
    ax.set_xticks(range(len(labels)), [label.replace(", ", ",\n") for label in labels], fontsize=8)
    ax.set(ylabel="held-out loss (nats / token)", title="Latent feedback at prefill: same weights, three modes")
    for bar, v in zip(bars, values):
        ax.text(bar.get_x() + bar.get_width() / 2, v, f"{v:.3f}", ha="center", va="bottom", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
